"""The gate's rules: the rules file format, its validation, and the built-in default rules.

Owns: `Threshold` and `Regression` rules, `Rules` (with per-metric direction overrides;
the directions and the default margins themselves come from the metric registry), the
shipped rule sets `RULE_SETS` built from the registry's `RULE_SET_METRICS` — `same` ("the same
model, cheaper": quality and js_div, the default, `DEFAULT_RULES`) and `upgrade` ("no worse":
quality only) — and `load_rules` / `parse_rules`, which take a set's name or a rules file (which
may say `extends: same|upgrade`) and refuse a malformed file with one line naming the file and
the key. Does not: decide (`decide`), render (`render`) or read the DB (`db`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import yaml

from evalkit.errors import BadInput
from evalkit.kinds import MARGIN_KINDS, RULE_SETS, MarginKind, RuleSet, ThresholdOp
from evalkit.paths import read_input
from evalkit.scoring import registry
from evalkit.scoring.registry import HEADLINE_METRICS, Margin

__all__ = ["DEFAULT_RULES", "HEADLINE_METRICS", "RULE_SETS", "Margin", "Regression", "Rules", "Threshold",
           "load_rules", "parse_rules", "rule_set"]

OPS = {  # threshold operator -> comparison
    ">=": lambda x, y: x >= y,
    ">": lambda x, y: x > y,
    "<=": lambda x, y: x <= y,
    "<": lambda x, y: x < y,
    # Aggregates are floats: equality allows for rounding noise.
    "==": lambda x, y: math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12),
}
_OPS_TEXT = ", ".join(OPS)
_THRESHOLD_RE = re.compile(r"^\s*(>=|<=|==|>|<)\s*(\S+)\s*$")
_KEY_RE = re.compile(r"^[^\s/]+(/[^\s/]+)?$")
_SECTIONS = ("extends", "thresholds", "regressions", "higher_is_better")
MAX_RULES_BYTES = 1 << 20  # a rules file is a few lines; a device or a huge file is refused unread


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Threshold:
    """``metric op value`` on the candidate's aggregate; ``task`` None = every task with it."""

    metric: str
    op: ThresholdOp
    value: float
    task: str | None = None

    @property
    def key(self) -> str:
        return f"{self.task}/{self.metric}" if self.task else self.metric


@dataclass(frozen=True)
class Regression:
    """A non-inferiority check: passes when the CI of the candidate's drop against the baseline
    lies wholly below ``margin``, fails when it lies wholly above, else is inconclusive.

    ``margin`` may be given as a number, an absolute drop: ``Regression("ft_hit", 0.05)``.
    """

    metric: str
    margin: Margin  # largest tolerated drop (increase, for lower-is-better metrics)
    task: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.margin, Margin):
            object.__setattr__(self, "margin", Margin("delta", float(self.margin)))

    @property
    def key(self) -> str:
        return f"{self.task}/{self.metric}" if self.task else self.metric


@dataclass(frozen=True)
class Rules:
    thresholds: tuple[Threshold, ...] = ()
    regressions: tuple[Regression, ...] = ()
    # "metric" or "task/metric" -> True when higher is better; overrides the registry
    higher_is_better: Mapping[str, bool] = field(default_factory=dict)
    source: str = "built-in rules 'same'"
    shipped: RuleSet | None = None  # the shipped set these rules are (None: a rules file)
    extends: RuleSet | None = None  # the shipped set a rules file builds on (its `extends:`)

    @property
    def question(self) -> RuleSet | None:
        """The question the rules answer: the shipped set they are or extend."""
        return self.shipped or self.extends

    def is_higher_better(self, task: str | None, metric: str) -> bool:
        if task is not None and f"{task}/{metric}" in self.higher_is_better:
            return self.higher_is_better[f"{task}/{metric}"]
        if metric in self.higher_is_better:
            return self.higher_is_better[metric]
        known = registry.higher_is_better(metric)
        return True if known is None else known


def _shipped(name: RuleSet) -> Rules:
    metrics = registry.RULE_SET_METRICS[name]
    return Rules(regressions=tuple(Regression(m, registry.METRICS[m].margin) for m in metrics),  # type: ignore[arg-type]
                 source=f"built-in rules {name!r}", shipped=name)


RULE_SET_RULES: dict[str, Rules] = {name: _shipped(name) for name in RULE_SETS}  # type: ignore[arg-type]
DEFAULT_RULES = RULE_SET_RULES["same"]


def rule_set(name: str) -> Rules:
    """A shipped rule set by name; BadInput listing the sets for any other name.

    >>> [r.metric for r in rule_set("upgrade").regressions][-1], rule_set("same").regressions[-1].metric
    ('needle_recall', 'js_div')
    """
    if name not in RULE_SET_RULES:
        raise BadInput(f"unknown rule set {name!r}{registry.suggest(name, list(RULE_SETS))} "
                       f"(shipped sets: {', '.join(RULE_SETS)}; or give a rules file)")
    return RULE_SET_RULES[name]


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys instead of keeping the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # unhashable key; reported later as "not a string"
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

# Plain scalars read as numbers and booleans only where a reader sees one (YAML 1.2's core schema),
# never by YAML 1.1's other forms: `0_5` (5), `010` (8), `1:30` (90), `yes`/`off` (booleans) and dates
# stay text, which the checks below refuse by name; `1e308` is a number (YAML 1.1 wants a dot).
_DECIMAL = r"[-+]?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
_NUMBER_RE = re.compile(rf"^{_DECIMAL}$")
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag == "tag:yaml.org,2002:null"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                    list("tTfF"))
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"),
                                    list("-+0123456789"))
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(rf"^(?:{_DECIMAL}|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"), list("-+0123456789."))


def load_rules(path: str | os.PathLike[str] | None) -> Rules:
    """The rules a `--rules` value names: a shipped set (`same`, `upgrade`), a YAML file, or
    ``DEFAULT_RULES`` (`same`) when ``path`` is None. A set's name wins over a file of that name
    (write ./same for the file).

    Raises ``BadInput`` (one line naming the file and the problem) when the value is a bare word
    that is neither a shipped set nor an existing file (listing the sets), or the file cannot be read, is not YAML,
    or its content is malformed (see ``parse_rules``).
    """
    if path is None:
        return DEFAULT_RULES
    name = os.fspath(path)
    if name in RULE_SET_RULES:
        return RULE_SET_RULES[name]
    if not os.path.lexists(name) and not re.search(r"[/\\.]", name):  # a bare word: meant as a set's name
        raise BadInput(f"--rules {name!r} is neither a shipped rule set{registry.suggest(name, list(RULE_SETS))} "
                       f"({', '.join(RULE_SETS)}) nor a rules file")
    try:
        text = read_input(name, "rules file", MAX_RULES_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"cannot read rules file {name}: {exc}") from None
    try:
        obj = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise BadInput(f"rules file {name} is not valid YAML: {_yaml_problem(exc)}") from None
    except RecursionError:
        raise BadInput(f"rules file {name} is nested too deep") from None
    return parse_rules(obj, source=name)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    text = " ".join(f"{where}{problem}".split())  # one line
    if "chomping" in text:  # an unquoted ">= 0.5" reads as a YAML block scalar
        text += ' (quote comparisons, e.g. ft_hit: ">= 0.5")'
    return text


def parse_rules(obj: Any, *, source: str = "rules") -> Rules:
    """Validate a parsed rules document (a mapping) into ``Rules``.

    Example::

        >>> r = parse_rules({"thresholds": {"ft_hit": ">= 0.5"},
        ...                  "regressions": {"firsttoken_zh/opener_rate": 0.02,
        ...                                  "ft_hit_prob": {"relative": 0.1}, "ft_hit": "default"}})
        >>> r.thresholds[0]
        Threshold(metric='ft_hit', op='>=', value=0.5, task=None)
        >>> [(g.task, g.metric, str(g.margin)) for g in r.regressions]
        [('firsttoken_zh', 'opener_rate', '0.02'), (None, 'ft_hit_prob', '10 % of baseline'), (None, 'ft_hit', '0.05')]

    A regression's margin is a number or ``{delta: X}`` (the drop may be at most X), ``{relative: R}``
    (at most R × the baseline's value), or ``default`` (the registry's margin for the metric).

    Raises ``BadInput`` naming ``source`` and the offending key when the document
    is not a mapping, has an unknown top-level key, a bad key, operator or number,
    a negative delta, a non-boolean direction, or no rules at all.
    """

    def bad(msg: str) -> BadInput:
        return BadInput(f"rules file {source}: {msg}")

    if obj is None:
        raise bad("is empty (expected a mapping with 'thresholds' and/or 'regressions')")
    if not isinstance(obj, Mapping):
        raise bad(f"expected a mapping at the top level, got {_kind(obj)}")
    for key in obj:
        if key not in _SECTIONS:
            raise bad(f"unknown top-level key {key!r} (expected one of {', '.join(_SECTIONS)})")

    base: Rules | None = None
    if "extends" in obj:
        if obj["extends"] not in RULE_SET_RULES:
            raise bad(f"extends: {_clip(repr(obj['extends']))} is not a shipped rule set (known: {', '.join(RULE_SETS)})")
        base = RULE_SET_RULES[obj["extends"]]

    def section(name: str) -> Mapping[Any, Any]:
        value = obj.get(name)
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise bad(f"'{name}' must be a mapping of metric -> value, got {_kind(value)}")
        return value

    def split_key(name: str, key: Any) -> tuple[str | None, str]:
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise bad(
                f"{name}: bad key {key!r} (expected a metric name or task/metric, no spaces)"
            )
        task, _, metric = key.rpartition("/")
        return (task or None), metric

    thresholds = []
    for key, spec in section("thresholds").items():
        task, metric = split_key("thresholds", key)
        where = f"thresholds.{key}"
        if not isinstance(spec, str):
            raise bad(f'{where}: expected a quoted comparison like ">= 0.5", got {spec!r}')
        m = _THRESHOLD_RE.match(spec)
        if not m:
            raise bad(
                f"{where}: bad operator in {spec!r} "
                f'(expected "<op> <number>" with op one of {_OPS_TEXT})'
            )
        op, number = m.groups()
        value = _finite_float(number)
        if value is None:
            raise bad(f"{where}: bad number {_clip(number)} in {_clip(repr(spec))}")
        _check_bound(where, metric, op, value, bad)
        thresholds.append(Threshold(metric=metric, op=cast(ThresholdOp, op), value=value, task=task))

    regressions = []
    for key, spec in section("regressions").items():
        task, metric = split_key("regressions", key)
        margin = _margin(f"regressions.{key}", metric, spec, bad)
        _check_margin(f"regressions.{key}", metric, margin, bad)
        regressions.append(Regression(metric=metric, margin=margin, task=task))

    directions: dict[str, bool] = {}
    for key, spec in section("higher_is_better").items():
        _, metric = split_key("higher_is_better", key)
        if not isinstance(spec, bool):
            raise bad(f"higher_is_better.{key}: expected true or false, got {_clip(repr(spec))}")
        known = registry.higher_is_better(metric)
        if known is not None and known != spec:
            raise bad(f"higher_is_better.{key}: evalkit knows {metric} as {'higher' if known else 'lower'} is better; "
                      "this section gives directions to metrics evalkit does not know, never flips a known one")
        directions[key] = spec

    if base is not None:  # the file's rules replace the set's rule of the same key and add the others
        own = {r.key for r in regressions}
        regressions = [r for r in base.regressions if r.key not in own] + regressions
    for name, rules in (("thresholds", thresholds), ("regressions", regressions)):
        _check_precedence(name, rules, bad)

    if not thresholds and not regressions:
        raise bad("defines no thresholds or regressions (a gate with no rules checks nothing)")
    return Rules(
        thresholds=tuple(thresholds),
        regressions=tuple(regressions),
        higher_is_better=directions,
        source=source,
        extends=base.shipped if base is not None else None,
    )


_MARGIN_HELP = "a number, {delta: X}, {relative: R} or default"


def _check_precedence(section: str, rules: list[Threshold] | list[Regression], bad) -> None:
    """Refuse a `task/metric` rule that is not stricter than the `metric` rule beside it.

    Both rules check that task (the stricter binds), so a looser or equal one checks nothing new; it
    only adds a row to Holm's family, which can quietly turn the stricter rule's FAIL into
    INCONCLUSIVE. Two rules whose strictness cannot be compared (a delta margin beside a relative one,
    bounds on opposite sides) are refused too: name each task instead of the bare metric.
    """
    general = {r.metric: r for r in rules if r.task is None}
    for rule in rules:
        over = general.get(rule.metric)
        if rule.task is None or over is None:
            continue
        where = f"{section}.{rule.key}"
        stricter = _stricter(rule, over)
        if stricter is None:
            raise bad(f"{where}: cannot tell whether it is stricter than {section}.{over.key} "
                      f"({_rule_text(rule)} beside {_rule_text(over)}); a task/metric rule may only tighten "
                      f"the metric rule: give both in the same form, or name each task instead of {over.key}")
        if not stricter:
            raise bad(f"{where}: {_rule_text(rule)} is not stricter than {section}.{over.key} "
                      f"({_rule_text(over)}), which checks that task too; a task/metric rule may only tighten "
                      f"the metric rule (to loosen one task, name each task instead of {over.key})")


def _stricter(rule: Threshold | Regression, over: Threshold | Regression) -> bool | None:
    """Whether `rule` is strictly stricter than `over` on the same metric; None when it cannot be told.

    >>> _stricter(Regression("m", 0.01, "t"), Regression("m", 0.02)), _stricter(Threshold("m", ">", 0.5, "t"),
    ...     Threshold("m", ">=", 0.5)), _stricter(Threshold("m", "<=", 0.5, "t"), Threshold("m", ">=", 0.5))
    (True, True, None)
    """
    if isinstance(rule, Regression) and isinstance(over, Regression):
        if rule.margin.kind != over.margin.kind:
            return None
        return rule.margin.value < over.margin.value
    assert isinstance(rule, Threshold) and isinstance(over, Threshold)
    if rule.op == "==" or over.op == "==":
        return None
    lower = {">=": True, ">": True, "<=": False, "<": False}
    if lower[rule.op] != lower[over.op]:
        return None
    if rule.value != over.value:
        return rule.value > over.value if lower[rule.op] else rule.value < over.value
    return len(rule.op) < len(over.op)  # at the same bound, > is stricter than >=


def _rule_text(rule: Threshold | Regression) -> str:
    return f'"{rule.op} {rule.value:g}"' if isinstance(rule, Threshold) else f"margin {rule.margin}"


def _margin(where: str, metric: str, spec: Any, bad) -> Margin:
    """A regression's margin from its rules-file value (see ``parse_rules``)."""
    if spec == "default":
        known = registry.margin(metric)
        if known is None:
            raise bad(f"{where}: evalkit has no default margin for {metric!r}; give {_MARGIN_HELP.rsplit(' or', 1)[0]}")
        return known
    kind: MarginKind = "delta"
    if isinstance(spec, Mapping):
        if len(spec) != 1 or next(iter(spec)) not in MARGIN_KINDS:
            raise bad(f"{where}: expected {_MARGIN_HELP}, got {dict(spec)!r}")
        key, spec = next(iter(spec.items()))
        kind = cast(MarginKind, key)
    if isinstance(spec, str) and _NUMBER_RE.match(spec.strip()):
        raise bad(f"{where}: the margin {_clip(repr(spec))} is quoted text; write the number unquoted")
    if isinstance(spec, bool) or not isinstance(spec, (int, float)):
        raise bad(f"{where}: expected {_MARGIN_HELP} (the tolerated drop), got {_clip(repr(spec))}")
    try:
        finite = math.isfinite(spec)  # an int too large for a float raises
    except OverflowError:
        finite = False
    if not finite:
        raise bad(f"{where}: bad number {_clip(repr(spec))} (not a finite number)")
    if spec < 0:
        raise bad(f"{where}: {kind} must be >= 0, got {spec!r}")
    return Margin(kind, float(spec))


def _range_text(lo: float, hi: float | None) -> str:
    return f"[{lo:g}, ∞)" if hi is None else f"[{lo:g}, {hi:g}]"


def _check_bound(where: str, metric: str, op: str, value: float, bad) -> None:
    """A threshold whose bound lies outside the registry's range of `metric` (``ft_hit >= 1.01``,
    ``entropy <= -1``), or that no value in it can meet (``ft_hit > 1``), is a mistake in the rules:
    the gate would decide a check that cannot be reached."""
    span = registry.value_range(metric)
    if span is None:
        return
    lo, hi = span
    outside = value < lo or (hi is not None and value > hi)
    never = (op == ">" and hi is not None and value >= hi) or (op == "<" and value <= lo)
    if outside or never:
        raise bad(f"{where}: {op} {value:g} is outside what {metric} can reach ({metric} lies in "
                  f"{_range_text(lo, hi)})")


def _check_margin(where: str, metric: str, margin: Margin, bad) -> None:
    """Refuse a margin under which no value in the registry's range of `metric` can fail the check
    (`never_fails`): a delta at least the range's width, or a relative margin no drop can exceed."""
    span = registry.value_range(metric)
    higher = registry.higher_is_better(metric)
    if span is None or higher is None:
        return
    why = never_fails(margin.kind, margin.value, span[0], span[1], higher)
    if why:
        raise bad(f"{where}: a margin of {margin} can never fail: {why} ({metric} lies in "
                  f"{_range_text(*span)}); give a margin some drop can exceed")


def never_fails(kind: str, r: float, lo: float, hi: float | None, higher: bool) -> str | None:
    """Why no candidate and baseline values in [lo, hi] can fail a regression with this margin, or None.

    A regression fails when the drop exceeds the margin: for a delta, `drop > r`, and the largest
    drop is the range's width; for a relative margin, `drop - r * baseline > 0` (`release.paired`),
    whose largest value over the range is at one of its corners.

    >>> never_fails("delta", 1.0, 0.0, 1.0, True)
    'the largest possible drop is 1, the width of the range'
    >>> never_fails("delta", 0.99, 0.0, 1.0, True) is None, never_fails("relative", 0.5, 0.0, 1.0, True) is None
    (True, True)
    >>> never_fails("relative", 1.0, 0.0, 1.0, True)
    'a drop is at most the whole baseline value, so never more than 1 x it'
    >>> never_fails("relative", 1e300, 0.0, None, False) is None  # lower is better, unbounded: can fail
    True
    """
    if kind == "delta":
        if hi is not None and r >= hi - lo:
            return f"the largest possible drop is {hi - lo:g}, the width of the range"
        return None
    if higher:  # drop - r*b = (1 - r) * b - c, largest at c = lo and b at an end of the range
        ends = [lo] + ([hi] if hi is not None else [])
        if hi is None and r < 1:
            return None
        worst = max((1 - r) * b - lo for b in ends)
        if hi is None and r == 1:
            worst = max(worst, -lo)
    else:  # drop - r*b = c - (1 + r) * b, largest at c = hi, b = lo (1 + r > 0)
        if hi is None:
            return None
        worst = hi - (1 + r) * lo
    if worst <= 0:
        return (f"a drop is at most the whole baseline value, so never more than {r:g} x it" if higher and lo >= 0
                else f"no drop in the range exceeds {r:g} x the baseline value")
    return None


def _clip(text: str, width: int = 40) -> str:
    """A value as the one-line error shows it: at most `width` characters.

    >>> _clip("9" * 400)
    '999999999999999999…999999999999999999 (400 characters)'
    """
    return text if len(text) <= width else f"{text[:18]}…{text[-18:]} ({len(text)} characters)"


def _kind(obj: Any) -> str:
    names: dict[type, str] = {list: "a list", str: "a string"}
    return names.get(type(obj), type(obj).__name__)


def _finite_float(text: str) -> float | None:
    """A decimal number as written in a rules file, None for anything else: no `_` separators, hex,
    inf, nan or non-ASCII digits, which Python's float() would take (`float("0_5") == 5.0`).

    >>> _finite_float("0.5"), _finite_float("1e308"), _finite_float("0_5"), _finite_float("1e400"), _finite_float("nan")
    (0.5, 1e+308, None, None, None)
    """
    if not _NUMBER_RE.match(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None
