"""Rules that can never fail are refused, with the reason (`release.rules.never_fails`, called by
`_check_margin` for every regression of a rules file or a shipped set).

The test checks the rule against an independent search: for every registry metric with a known
range and direction, and margins around the edges, a grid of (baseline, candidate) values over
the range says whether any pair fails the regression (`drop > delta`, or
`drop - r * baseline > 0` for a relative margin, as `release.paired` tests them); a margin is
accepted exactly when some pair can fail.
"""

from __future__ import annotations

import itertools

import pytest

from evalkit.errors import BadInput
from evalkit.release.rules import parse_rules
from evalkit.scoring import registry

BIG = 1e6  # stands for the top of an unbounded range in the search


def some_pair_fails(kind: str, r: float, lo: float, hi: float | None, higher: bool) -> bool:
    top = hi if hi is not None else max(BIG, 10 * abs(r))  # an unbounded range reaches past any margin
    grid = [lo + (top - lo) * i / 20 for i in range(21)]
    for b, c in itertools.product(grid, grid):
        drop = (b - c) if higher else (c - b)
        excess = drop - (r if kind == "delta" else r * b)
        if excess > 1e-9 * max(1.0, abs(drop)):
            return True
    return False


METRICS = [m.name for m in registry._METRICS if registry.value_range(m.name) is not None
           and registry.higher_is_better(m.name) is not None]


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("kind, r", [("delta", 0.5), ("delta", 0.999), ("delta", 1.0), ("delta", 2.0), ("delta", 1e300),
                                     ("relative", 0.5), ("relative", 0.999), ("relative", 1.0), ("relative", 3.0),
                                     ("relative", 1e300)])
def test_a_margin_is_kept_exactly_when_some_drop_can_fail_it(metric, kind, r):
    lo, hi = registry.value_range(metric)
    higher = registry.higher_is_better(metric)
    if kind == "delta" and hi is not None:
        r = r * (hi - lo)  # the margins scale with the range: 1.0 is its whole width
    can_fail = some_pair_fails(kind, r, lo, hi, higher)
    spec = {"regressions": {metric: {kind: r}}}
    if can_fail:
        (rule,) = parse_rules(spec).regressions
        assert rule.margin.value == r
    else:
        with pytest.raises(BadInput, match=f"regressions.{metric}: a margin of .* can never fail: "):
            parse_rules(spec)


def test_the_cases_of_the_review():
    for spec, why in ((1e300, "a drop is at most the whole baseline value"), ):
        with pytest.raises(BadInput, match=why):
            parse_rules({"regressions": {"ft_hit": {"relative": spec}}})
    with pytest.raises(BadInput, match="the largest possible drop is 1, the width of the range"):
        parse_rules({"regressions": {"ft_hit": 1.0}})
    assert parse_rules({"regressions": {"ft_hit": 0.05}}).regressions[0].margin.value == 0.05
