"""The gate's statistics: one test per check, each with an interval, a one-sided p-value
and the number of prompts that would decide it. Pure: plain numbers in, plain numbers out.

Owns:
- `tango_interval` — Tango's score interval for the difference of two paired proportions,
  built from the discordant pairs (0/1 metrics under an absolute margin), and
  `mcnemar_exact_p`, the exact McNemar test shown beside it;
- `paired_continuous` — the paired percentile bootstrap of the drop (or of
  ``drop_i − r·baseline_i`` for a relative margin, so the baseline's own noise counts);
- `threshold_*` — an interval for one run's value against a bound: Wilson's score interval
  for 0/1 values, the bootstrap otherwise, or an interval stored with an aggregate;
- `holm` — Holm's step-down over the checks that could fail.

Does not: know tasks, runs or rules, or decide the gate's outcome (``decide`` does).

Every test speaks of an *excess*: how far the estimate lies on the wrong side of its
limit (drop − margin for a regression, bound − value for ``>=``). A check passes when
the whole interval of the excess is below 0, fails when the whole interval is above 0,
and is inconclusive when it straddles 0. ``p_fail`` is the one-sided p-value of
"the excess is at most 0": small when the data show the check failing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from evalkit.defaults import MIN_BOOTSTRAP_PROMPTS, MIN_SCORE_INTERVAL_PROMPTS
from evalkit.kinds import CheckStatus
from evalkit.scoring.stats import bootstrap_means

# the most prompts a "would decide it" estimate reports; beyond it the row says "more than"
MAX_DECIDE_N = 1_000_000

# The fewest prompts (pairs) on which each method may pass or fail a check; below it the check is
# inconclusive and says how many it needs (docs/gate.md "Too few prompts"). The score intervals
# (Tango's, Wilson's) keep close to their level from about 10; a percentile bootstrap draws its
# interval from the sample's own spread and runs narrow on small samples (n − 1 of n in variance,
# worse on heavy tails such as zh ft_hit_prob), so it waits for 20; values identical on every prompt
# pass by identity of computation, which one or two prompts cannot show.
MIN_PROMPTS: dict[str, int] = {
    "Tango score interval": MIN_SCORE_INTERVAL_PROMPTS,
    "Wilson interval": MIN_SCORE_INTERVAL_PROMPTS,
    "paired bootstrap": MIN_BOOTSTRAP_PROMPTS,
    "bootstrap interval": MIN_BOOTSTRAP_PROMPTS,
    "identical on every prompt": MIN_SCORE_INTERVAL_PROMPTS,
    "stored intervals, unpaired": MIN_BOOTSTRAP_PROMPTS,
    "stored interval": MIN_BOOTSTRAP_PROMPTS,
}


@dataclass(frozen=True)
class Evidence:
    """One check's test: an estimate with its interval, against a limit."""

    method: str  # how the interval was made, as the row shows it
    estimate: float  # the drop (regression) or the value (threshold)
    lo: float  # interval of the estimate
    hi: float
    limit: float  # the margin the drop must stay below, or the threshold's bound
    status: CheckStatus  # "pass" | "fail" | "inconclusive", before Holm
    p_fail: float | None  # one-sided p of "no worse than the limit"; None: nothing to correct
    n: int  # prompts (pairs) behind it
    decide_n: int | None = None  # prompts that would decide an inconclusive check; None: none would
    note: str = ""  # extra evidence shown beside it (McNemar's p, the discordant pairs)
    short: str = ""  # why this method cannot decide on these data (too few prompts, a degenerate interval)


def too_little(ev: Evidence) -> Evidence:
    """``ev`` made inconclusive when it rests on fewer prompts than its method needs (`MIN_PROMPTS`);
    unchanged otherwise. An undecidable check has no p-value for Holm: it cannot fail.

    >>> t = too_little(Evidence("paired bootstrap", 0.5, 0.5, 0.5, 0.01, "fail", 0.0002, n=1))
    >>> t.status, t.decide_n, t.short
    ('inconclusive', 20, 'the paired bootstrap needs at least 20 prompts, this check has 1')
    """
    need = MIN_PROMPTS.get(ev.method, 0)
    if ev.n >= need or ev.short:
        return ev
    return degenerate(ev, f"the {ev.method} needs at least {need} prompts, this check has {ev.n}", need)


def degenerate(ev: Evidence, why: str, decide_n: int | None = None) -> Evidence:
    """``ev`` as an inconclusive check that its method cannot decide, with the reason."""
    return Evidence(method=ev.method, estimate=ev.estimate, lo=ev.lo, hi=ev.hi, limit=ev.limit,
                    status="inconclusive", p_fail=None, n=ev.n, decide_n=decide_n, note=ev.note, short=why)


def _status(excess_lo: float, excess_hi: float) -> CheckStatus:
    if excess_hi < 0:
        return "pass"
    if excess_lo > 0:
        return "fail"
    return "inconclusive"


def _z(alpha: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(1 - alpha / 2))


# ------------------------------------------------------------------------- paired 0/1


def tango_restricted_p21(b: float, c: float, n: float, delta: float) -> float:
    """The restricted maximum-likelihood estimate of the (0, 1) cell's probability under
    ``p_b − p_c = delta`` (Tango 1998, eq. 3): the root of ``A x² + B x + C = 0``.

    ``b`` counts pairs the candidate lost (baseline 1, candidate 0), ``c`` pairs it gained.

    At the observed drop it is the observed share c / n; at no drop, the discordant pairs split evenly:

    >>> tango_restricted_p21(3, 1, 20, 0.1), tango_restricted_p21(3, 1, 20, 0.0)
    (0.05, 0.1)
    """
    a_ = 2.0 * n
    b_ = -b - c + (2.0 * n - b + c) * delta
    c_ = -c * delta * (1.0 - delta)
    disc = max(b_ * b_ - 4.0 * a_ * c_, 0.0)
    return max((math.sqrt(disc) - b_) / (2.0 * a_), 0.0)


def tango_z(b: float, c: float, n: float, delta: float) -> float:
    """Tango's score statistic for ``H0: drop = delta`` (drop = (b − c) / n); decreasing in delta."""
    p21 = tango_restricted_p21(b, c, n, delta)
    var = n * (2.0 * p21 + delta * (1.0 - delta))
    diff = b - c - n * delta
    if var <= 0.0:
        return 0.0 if diff == 0 else math.copysign(math.inf, diff)
    return diff / math.sqrt(var)


def tango_interval(b: float, c: float, n: float, alpha: float = 0.05) -> tuple[float, float]:
    """Tango's score interval for the drop ``(b − c) / n`` of paired proportions.

    The set of ``delta`` in [−1, 1] whose score test ``|tango_z| ≤ z(1 − alpha/2)``: it stays
    inside [−1, 1], and with no discordant pair it is not a point (0 of 20 discordant pairs
    still allows a drop of 0.16).

    >>> lo, hi = tango_interval(0, 0, 20)
    >>> round(lo, 3), round(hi, 3)
    (-0.161, 0.161)
    """
    from scipy.optimize import brentq

    if n <= 0:
        raise ValueError("tango_interval: no pairs")
    z = _z(alpha)
    est = (b - c) / n
    edge = 1.0 - 1e-12

    def bound(target: float, a: float, e: float) -> float:
        f = lambda d: tango_z(b, c, n, d) - target  # noqa: E731 - a root-finding closure
        if f(e) * f(a) > 0:
            return e  # the test never rejects before the edge
        return float(brentq(f, a, e, xtol=1e-12))

    lo = bound(z, est, -edge) if est > -edge else -1.0
    hi = bound(-z, est, edge) if est < edge else 1.0
    return lo, hi


def mcnemar_exact_p(b: int, c: int) -> float:
    """McNemar's exact two-sided p-value: the binomial test of b successes in b + c discordant pairs.

    >>> mcnemar_exact_p(0, 0), round(mcnemar_exact_p(6, 0), 4)
    (1.0, 0.0312)
    """
    if b + c == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(b, b + c, 0.5).pvalue)


def paired_binary(cand: Sequence[float], base: Sequence[float], *, higher_is_better: bool,
                  margin: float, alpha: float = 0.05) -> Evidence:
    """Paired 0/1 values (prompt by prompt) against an absolute margin on the drop: Tango's interval.

    >>> t = paired_binary([0] * 10 + [1] * 10, [1] * 20, higher_is_better=True, margin=0.05)
    >>> t.status, t.estimate, t.note
    ('fail', 0.5, 'discordant pairs 10 lost / 0 gained, McNemar exact p = 0.002')
    """
    sign = 1.0 if higher_is_better else -1.0
    drops = [sign * (b_ - c_) for c_, b_ in zip(cand, base)]
    n = len(drops)
    lost = sum(1 for d in drops if d > 0)
    gained = sum(1 for d in drops if d < 0)
    lo, hi = tango_interval(lost, gained, n, alpha)
    est = (lost - gained) / n
    from scipy.stats import norm

    p_fail = float(norm.sf(tango_z(lost, gained, n, margin)))
    status = _status(lo - margin, hi - margin)

    def ci_at(m: float) -> tuple[float, float]:
        return tango_interval(lost * m / n, gained * m / n, m, alpha)

    return too_little(Evidence(
        method="Tango score interval", estimate=est, lo=lo, hi=hi, limit=margin, status=status,
        p_fail=p_fail, n=n, decide_n=_decide_n(status, ci_at, est, margin, n),
        note=f"discordant pairs {lost} lost / {gained} gained, McNemar exact p = {mcnemar_exact_p(lost, gained):.2g}",
    ))


# --------------------------------------------------------------------- paired continuous


def paired_continuous(cand: Sequence[float], base: Sequence[float], *, higher_is_better: bool,
                      delta: float | None = None, relative: float | None = None, alpha: float = 0.05,
                      n_boot: int = 4000, seed: int = 0) -> Evidence:
    """Paired values against a margin on the drop, by the paired percentile bootstrap.

    Give one of ``delta`` (the drop may be at most this) or ``relative`` (at most this share
    of the baseline's mean). A relative margin is tested on ``e_i = drop_i − r·baseline_i``,
    whose mean is below 0 exactly when the drop is below r × the baseline's mean: the
    baseline's own noise is part of the interval. The shown interval of the drop is the
    excess's interval shifted by the margin's point value.

    Values identical on every prompt pass: the candidate computes what the baseline did. Below
    `MIN_PROMPTS` either way, and when every prompt's excess is one and the same value although
    the runs differ (a bootstrap interval of width 0 measures no spread), the check is inconclusive.

    >>> t = paired_continuous([0.5, 0.4, 0.3] * 4, [0.5, 0.4, 0.3] * 4, higher_is_better=True, relative=0.1)
    >>> t.status, t.method
    ('pass', 'identical on every prompt')
    >>> paired_continuous([0.5], [0.9], higher_is_better=True, relative=0.1).status
    'inconclusive'
    >>> t = paired_continuous([0.4] * 30, [0.5] * 30, higher_is_better=True, delta=0.05)
    >>> t.status, t.lo == t.hi, t.short.startswith("every prompt's drop is the same")
    ('inconclusive', True, True)
    """
    if (delta is None) == (relative is None):
        raise ValueError("paired_continuous: give exactly one of delta and relative")
    c = np.asarray(cand, dtype=np.float64)
    b = np.asarray(base, dtype=np.float64)
    n = int(c.size)
    drops = (b - c) if higher_is_better else (c - b)
    margin = float(delta) if delta is not None else float(relative) * float(b.mean())  # type: ignore[arg-type]
    est = float(drops.mean())
    if np.all(drops == 0):
        return too_little(Evidence(method="identical on every prompt", estimate=0.0, lo=0.0, hi=0.0, limit=margin,
                                   status="pass", p_fail=1.0, n=n))
    excess = drops - (delta if delta is not None else relative * b)  # type: ignore[operator]
    means = bootstrap_means(excess, n_boot, seed)
    e_lo, e_hi = (float(q) for q in np.quantile(means, [alpha / 2, 1 - alpha / 2]))
    p_fail = float((1 + np.count_nonzero(means <= 0)) / (n_boot + 1))
    status = _status(e_lo, e_hi)
    lo, hi = e_lo + margin, e_hi + margin
    ev = too_little(Evidence(method="paired bootstrap", estimate=est, lo=lo, hi=hi, limit=margin, status=status,
                             p_fail=p_fail, n=n, decide_n=_decide_n(status, _normal_ci_at(est, lo, hi, n), est, margin, n)))
    if not ev.short and float(np.ptp(excess)) <= 1e-12 * max(1.0, float(np.abs(excess).max())):  # float noise
        what = "drop" if delta is not None else f"drop less {relative:g} x its baseline value"
        ev = degenerate(ev, f"every prompt's {what} is the same value ({fmt_g(float(excess[0]))}) though the runs "
                            "differ: a bootstrap interval of width 0 measures no spread")
    return ev


def fmt_g(x: float) -> str:
    return f"{x + 0.0:.4g}"


def unpaired_stored(cand: tuple[float, float, float], base: tuple[float, float, float], *,
                    higher_is_better: bool, margin: float, n: int, alpha: float = 0.05) -> Evidence:
    """Two aggregates with stored intervals ``(value, lo, hi)`` and no per-prompt values: the drop
    with a normal approximation (each interval's half-width read as 1.96 standard errors)."""
    from scipy.stats import norm

    z = _z(alpha)
    se = math.hypot((cand[2] - cand[1]) / (2 * 1.96), (base[2] - base[1]) / (2 * 1.96))
    est = (base[0] - cand[0]) if higher_is_better else (cand[0] - base[0])
    lo, hi = est - z * se, est + z * se
    p_fail = float(norm.sf((est - margin) / se)) if se > 0 else float(est <= margin)
    status = _status(lo - margin, hi - margin)
    ev = Evidence(method="stored intervals, unpaired", estimate=est, lo=lo, hi=hi, limit=margin,
                  status=status, p_fail=p_fail, n=n,
                  decide_n=_decide_n(status, _normal_ci_at(est, lo, hi, n), est, margin, n))
    if se <= 0:
        return degenerate(ev, "both stored intervals have width 0: no spread to test a drop with")
    return too_little(ev)


# ---------------------------------------------------------------------------- thresholds


def wilson(k: float, n: float, alpha: float = 0.05) -> tuple[float, float]:
    """Wilson's score interval for k successes in n (real-valued counts allowed).

    >>> lo, hi = wilson(1, 10)
    >>> round(lo, 4), round(hi, 4)
    (0.0179, 0.4042)
    """
    z = _z(alpha)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _shortfall(op: str, value: float, bound: float) -> float:
    """How far ``value`` lies on the wrong side of ``op bound`` (> 0: the wrong side)."""
    return bound - value if op in (">=", ">") else value - bound


def _threshold_status(op: str, lo: float, hi: float, bound: float) -> CheckStatus:
    if op in (">=", ">"):
        ok = lo >= bound if op == ">=" else lo > bound
        bad = hi < bound if op == ">=" else hi <= bound
    else:
        ok = hi <= bound if op == "<=" else hi < bound
        bad = lo > bound if op == "<=" else lo >= bound
    return "pass" if ok else "fail" if bad else "inconclusive"


def threshold_binary(values: Sequence[float], op: str, bound: float, alpha: float = 0.05) -> Evidence:
    """0/1 per-prompt values against ``op bound``: Wilson's interval, and the score test's p.

    >>> t = threshold_binary([1] * 18 + [0] * 2, ">=", 0.5)
    >>> t.status, round(t.lo, 3)
    ('pass', 0.699)
    """
    from scipy.stats import norm

    n = len(values)
    k = float(sum(values))
    p = k / n
    lo, hi = wilson(k, n, alpha)
    sd = math.sqrt(bound * (1 - bound) / n) if 0 < bound < 1 else 0.0
    short = _shortfall(op, p, bound)
    p_fail = float(norm.sf(short / sd)) if sd > 0 else float(short <= 0)
    status = _threshold_status(op, lo, hi, bound)
    return too_little(Evidence(method="Wilson interval", estimate=p, lo=lo, hi=hi, limit=bound, status=status,
                               p_fail=p_fail, n=n,
                               decide_n=_decide_n(status, lambda m: wilson(p * m, m, alpha), p, bound, n)))


def threshold_continuous(values: Sequence[float], op: str, bound: float, alpha: float = 0.05,
                         n_boot: int = 4000, seed: int = 0) -> Evidence:
    """Per-prompt values against ``op bound``: the bootstrap interval of their mean."""
    arr = np.asarray(values, dtype=np.float64)
    n = int(arr.size)
    est = float(arr.mean())
    means = bootstrap_means(arr, n_boot, seed)
    lo, hi = (float(q) for q in np.quantile(means, [alpha / 2, 1 - alpha / 2]))
    wrong = means < bound if op in (">=", ">") else means > bound
    # p of "the bound is met": the share of resampled means on the right side
    p_fail = float((1 + np.count_nonzero(~wrong)) / (n_boot + 1))
    status = _threshold_status(op, lo, hi, bound)
    return too_little(Evidence(method="bootstrap interval", estimate=est, lo=lo, hi=hi, limit=bound, status=status,
                               p_fail=p_fail, n=n,
                               decide_n=_decide_n(status, _normal_ci_at(est, lo, hi, n), est, bound, n)))


def threshold_stored(value: float, lo: float, hi: float, op: str, bound: float, n: int | None) -> Evidence:
    """An aggregate with an interval stored beside it (a group task, a derived metric, an AUROC);
    the p-value reads the interval's half-width as 1.96 standard errors."""
    from scipy.stats import norm

    se = (hi - lo) / (2 * 1.96)
    short = _shortfall(op, value, bound)
    p_fail = float(norm.sf(short / se)) if se > 0 else float(short <= 0)
    status = _threshold_status(op, lo, hi, bound)
    m = n or 0
    ev = Evidence(method="stored interval", estimate=value, lo=lo, hi=hi, limit=bound, status=status,
                  p_fail=p_fail, n=m, decide_n=_decide_n(status, _normal_ci_at(value, lo, hi, m), value, bound, m))
    if se <= 0:
        return degenerate(ev, "the stored interval has width 0: no spread to test the value with")
    return too_little(ev) if n else ev  # an interval stored without its count: its own method's word


# ------------------------------------------------------------------- prompts to decide


def _normal_ci_at(est: float, lo: float, hi: float, n: int) -> Callable[[float], tuple[float, float]]:
    """The interval at m prompts, its half-widths shrinking as sqrt(n / m)."""
    return lambda m: (est - (est - lo) * math.sqrt(n / m), est + (hi - est) * math.sqrt(n / m))


def _decide_n(status: CheckStatus, ci_at: Callable[[float], tuple[float, float]], est: float, limit: float,
              n: int) -> int | None:
    """About how many prompts, with the same observed rates and spread, would put the interval
    wholly on one side of ``limit``; None when no number would (the estimate sits on it), and for a
    check that is already decided.

    >>> _decide_n("inconclusive", lambda m: (0.1 - 1 / m ** 0.5, 0.1 + 1 / m ** 0.5), 0.1, 0.0, 1)
    101
    """
    if status != "inconclusive" or est == limit or n <= 0:
        return None

    def decided(m: float) -> bool:
        lo, hi = ci_at(m)
        return hi < limit if est < limit else lo > limit

    lo_n, hi_n = n, 2 * n
    while not decided(hi_n):
        if hi_n > MAX_DECIDE_N:
            return MAX_DECIDE_N + 1
        lo_n, hi_n = hi_n, 2 * hi_n
    while hi_n - lo_n > 1:
        mid = (lo_n + hi_n) // 2
        lo_n, hi_n = (lo_n, mid) if decided(mid) else (mid, hi_n)
    return hi_n


# --------------------------------------------------------------------------- multiplicity


def holm(p_values: Sequence[float], alpha: float) -> list[bool]:
    """Holm's step-down: which hypotheses are rejected with family-wise error at most ``alpha``.

    The smallest p is compared with alpha / m, the next with alpha / (m − 1), ... and the
    procedure stops at the first that is not rejected.

    >>> holm([0.001, 0.02, 0.012, 0.5], alpha=0.05)
    [True, True, True, False]
    >>> holm([0.02, 0.02], alpha=0.025)
    [False, False]
    """
    m = len(p_values)
    rejected = [False] * m
    for rank, i in enumerate(sorted(range(m), key=lambda j: p_values[j])):
        if p_values[i] > alpha / (m - rank):
            break
        rejected[i] = True
    return rejected
