"""The release gate: rules, a pure ``decide`` and the verdict's markdown / JUnit forms.

Owns: the rules file format (SPEC 2, ``gate``), the built-in default rules, metric
directions, and the decision itself — thresholds on the candidate's aggregates and
paired-bootstrap regression tests against a baseline.
Does not: read the DB (the caller builds ``RunData``), resolve run ids or tags,
print, or exit — only the CLI turns a ``Verdict`` into an exit code.

Decisions worth knowing (all surface as rows, never silently):

* A threshold on a metric the candidate lacks (or whose aggregate is null) fails
  with reason "metric missing".
* A regression rule whose metric neither run has (say ``needle_recall`` under the
  default rules, gating two first-token runs) is a ``skipped`` row, not a failure:
  the default rules name every headline metric and most runs hold only some.
  A metric only the baseline has fails (the candidate lost it); one only the
  candidate has is skipped (nothing to compare against).
* A regression rule where both runs have the metric but no shared prompt has a
  per-sample value on both sides fails: the regression cannot be ruled out.
* Two runs sharing no prompt at all, or regression rules without a baseline, are
  ``BadInput``: the user asked for a comparison that cannot be made.
"""

from __future__ import annotations

import math
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from evalkit.errors import BadInput
from evalkit.scoring import registry, stats

__all__ = [
    "DEFAULT_RULES",
    "HEADLINE_METRICS",
    "Regression",
    "Rules",
    "RunData",
    "Threshold",
    "Verdict",
    "VerdictRow",
    "decide",
    "load_rules",
    "parse_rules",
    "to_junit",
    "to_markdown",
]

HEADLINE_METRICS = ("ft_hit", "ft_hit_prob", "opener_rate", "opener_mass", "needle_recall")
DEFAULT_REGRESSION_DELTA = 0.02

_OPS = {
    ">=": lambda x, y: x >= y,
    ">": lambda x, y: x > y,
    "<=": lambda x, y: x <= y,
    "<": lambda x, y: x < y,
    # Aggregates are floats: equality allows for rounding noise.
    "==": lambda x, y: math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12),
}
_OPS_TEXT = ", ".join(_OPS)
_THRESHOLD_RE = re.compile(r"^\s*(>=|<=|==|>|<)\s*(\S+)\s*$")
_KEY_RE = re.compile(r"^[^\s/]+(/[^\s/]+)?$")
_SECTIONS = ("thresholds", "regressions", "higher_is_better")


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Threshold:
    """``metric op value`` on the candidate's aggregate; ``task`` None = every task with it."""

    metric: str
    op: str  # one of >=, >, <=, <, ==
    value: float
    task: str | None = None

    @property
    def key(self) -> str:
        return f"{self.task}/{self.metric}" if self.task else self.metric


@dataclass(frozen=True)
class Regression:
    """Fails when the CI of the candidate's drop vs the baseline lies wholly above ``delta``."""

    metric: str
    delta: float  # largest tolerated drop (increase, for lower-is-better metrics)
    task: str | None = None

    @property
    def key(self) -> str:
        return f"{self.task}/{self.metric}" if self.task else self.metric


@dataclass(frozen=True)
class Rules:
    thresholds: tuple[Threshold, ...] = ()
    regressions: tuple[Regression, ...] = ()
    # "metric" or "task/metric" -> True when higher is better; overrides the registry
    higher_is_better: Mapping[str, bool] = field(default_factory=dict)
    source: str = "built-in default rules"

    def is_higher_better(self, task: str | None, metric: str) -> bool:
        if task is not None and f"{task}/{metric}" in self.higher_is_better:
            return self.higher_is_better[f"{task}/{metric}"]
        if metric in self.higher_is_better:
            return self.higher_is_better[metric]
        known = registry.higher_is_better(metric)
        return True if known is None else known


DEFAULT_RULES = Rules(
    regressions=tuple(Regression(m, DEFAULT_REGRESSION_DELTA) for m in HEADLINE_METRICS),
)


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


def load_rules(path: str | os.PathLike[str] | None) -> Rules:
    """Rules from a YAML file, or ``DEFAULT_RULES`` when ``path`` is None.

    Raises ``BadInput`` (one line naming the file and the problem) when the file
    cannot be read, is not YAML, or its content is malformed (see ``parse_rules``).
    """
    if path is None:
        return DEFAULT_RULES
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise BadInput(f"cannot read rules file {name}: {reason}") from None
    try:
        obj = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise BadInput(f"rules file {name} is not valid YAML: {_yaml_problem(exc)}") from None
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
        ...                  "regressions": {"firsttoken_zh/opener_rate": 0.02}})
        >>> r.thresholds[0]
        Threshold(metric='ft_hit', op='>=', value=0.5, task=None)
        >>> r.regressions[0].task, r.regressions[0].delta
        ('firsttoken_zh', 0.02)

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
            raise bad(f"{where}: bad number {number!r} in {spec!r}")
        thresholds.append(Threshold(metric=metric, op=op, value=value, task=task))

    regressions = []
    for key, spec in section("regressions").items():
        task, metric = split_key("regressions", key)
        where = f"regressions.{key}"
        if isinstance(spec, bool) or not isinstance(spec, (int, float)):
            raise bad(f"{where}: expected a number (the tolerated drop, e.g. 0.02), got {spec!r}")
        if not math.isfinite(spec):
            raise bad(f"{where}: bad number {spec!r}")
        if spec < 0:
            raise bad(f"{where}: delta must be >= 0, got {spec!r}")
        regressions.append(Regression(metric=metric, delta=float(spec), task=task))

    directions: dict[str, bool] = {}
    for key, spec in section("higher_is_better").items():
        split_key("higher_is_better", key)
        if not isinstance(spec, bool):
            raise bad(f"higher_is_better.{key}: expected true or false, got {spec!r}")
        directions[key] = spec

    if not thresholds and not regressions:
        raise bad("defines no thresholds or regressions (a gate with no rules checks nothing)")
    return Rules(
        thresholds=tuple(thresholds),
        regressions=tuple(regressions),
        higher_is_better=directions,
        source=source,
    )


def _kind(obj: Any) -> str:
    return {list: "a list", str: "a string"}.get(type(obj), type(obj).__name__)


def _finite_float(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


# ------------------------------------------------------------------------ decision


@dataclass
class RunData:
    """What the gate needs of one run, as plain values (the caller reads the DB)."""

    run_id: str
    metrics: dict[tuple[str, str], float]  # (task, metric) -> aggregate value
    samples: dict[tuple[str, str], dict[str, float]]  # (task, doc_id) -> {metric: value}


@dataclass(frozen=True)
class VerdictRow:
    """One checked (rule, task) pair."""

    kind: str  # "threshold" | "regression"
    task: str | None  # None when the rule matched no task
    metric: str
    status: str  # "pass" | "fail" | "skipped"
    reason: str  # one human line
    observed: float | None = None  # candidate: aggregate (threshold) or paired mean (regression)
    baseline: float | None = None  # baseline paired mean (regression)
    op: str | None = None  # threshold operator
    limit: float | None = None  # threshold value, or the tolerated drop
    delta: float | None = None  # candidate − baseline over the paired prompts
    ci: tuple[float, float] | None = None  # bootstrap CI of delta
    n: int | None = None  # paired prompts
    higher_is_better: bool = True

    @property
    def name(self) -> str:
        return f"{self.task or '*'}/{self.metric}"


@dataclass(frozen=True)
class Verdict:
    passed: bool
    rows: list[VerdictRow]

    @property
    def reasons(self) -> list[str]:
        """One line per failing row."""
        return [f"{r.kind} {r.name}: {r.reason}" for r in self.rows if r.status == "fail"]

    def count(self, status: str) -> int:
        return sum(1 for r in self.rows if r.status == status)


def _value(v: Any) -> float | None:
    """A per-sample or aggregate value as a finite float; None when null, NaN or not a number."""
    if v is None or isinstance(v, str):
        return None
    try:
        f = float(v)  # bools and numpy scalars too
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _metric_tasks(run: RunData) -> dict[str, set[str]]:
    """metric -> tasks where the run has per-sample values of it.

    Regressions pair per-sample values, so only these tasks can carry one; a
    group task (aggregate rows only, e.g. `firsttoken`) is left to thresholds.
    """
    found: dict[str, set[str]] = {}
    for (task, _doc), values in run.samples.items():
        for metric, v in values.items():
            if _value(v) is not None:
                found.setdefault(metric, set()).add(task)
    return found


def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    return f"{x + 0.0:.4g}"  # + 0.0 turns −0.0 into 0.0


def decide(
    candidate: RunData,
    baseline: RunData | None,
    rules: Rules,
    *,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> Verdict:
    """Check ``candidate`` against ``rules`` (and ``baseline`` for regressions). Pure.

    Thresholds compare the candidate's aggregate metric. Regressions pair
    per-sample values over the (task, doc_id) keys both runs hold with the metric
    non-null, bootstrap the mean difference (candidate − baseline), and fail when
    the CI of the drop (baseline − candidate; candidate − baseline for
    lower-is-better metrics) lies wholly above the rule's delta.

    Raises ``BadInput`` when there are regression rules but no baseline, or the
    two runs share no prompt at all.
    """
    rows: list[VerdictRow] = []
    cand_tasks = _metric_tasks(candidate)

    for rule in rules.thresholds:
        rows.extend(_check_threshold(candidate, rule, rules))

    if rules.regressions:
        if baseline is None:
            raise BadInput(
                f"{rules.source} set regression limits but no baseline run was given"
            )
        shared = candidate.samples.keys() & baseline.samples.keys()
        if not shared:
            raise BadInput(f"runs {candidate.run_id} and {baseline.run_id} share no prompts")
        base_tasks = _metric_tasks(baseline)
        shared_by_task: dict[str, list[tuple[str, str]]] = {}
        for key in sorted(shared, key=lambda k: (str(k[0]), str(k[1]))):
            shared_by_task.setdefault(key[0], []).append(key)
        for rule in rules.regressions:
            if rule.task is not None:
                tasks = [rule.task]
            else:
                tasks = sorted(cand_tasks.get(rule.metric, set()) | base_tasks.get(rule.metric, set()))
                if not tasks:  # aggregates only (e.g. middle_gap): nothing to pair, so it fails
                    tasks = sorted({t for t, m in {**candidate.metrics, **baseline.metrics} if m == rule.metric})
            if not tasks:
                rows.append(
                    VerdictRow(
                        kind="regression",
                        task=None,
                        metric=rule.metric,
                        status="skipped",
                        reason=f"neither run has metric {rule.metric!r}",
                        limit=rule.delta,
                        higher_is_better=rules.is_higher_better(None, rule.metric),
                    )
                )
                continue
            for task in tasks:
                rows.append(
                    _check_regression(
                        candidate,
                        baseline,
                        rule,
                        task,
                        in_cand=task in cand_tasks.get(rule.metric, ()) or (task, rule.metric) in candidate.metrics,
                        in_base=task in base_tasks.get(rule.metric, ()) or (task, rule.metric) in baseline.metrics,
                        keys=shared_by_task.get(task, []),
                        rules=rules,
                        n_boot=n_boot,
                        seed=seed,
                        alpha=alpha,
                    )
                )

    passed = all(r.status != "fail" for r in rows)
    return Verdict(passed=passed, rows=rows)


def _check_threshold(candidate: RunData, rule: Threshold, rules: Rules) -> list[VerdictRow]:
    if rule.task is not None:
        tasks = [rule.task]
    else:
        tasks = sorted(t for (t, m) in candidate.metrics if m == rule.metric)
    if not tasks:
        return [
            VerdictRow(
                kind="threshold",
                task=None,
                metric=rule.metric,
                status="fail",
                reason=f"metric missing: run {candidate.run_id} has no {rule.metric!r} in any task",
                op=rule.op,
                limit=rule.value,
                higher_is_better=rules.is_higher_better(None, rule.metric),
            )
        ]
    out = []
    for task in tasks:
        common = dict(
            kind="threshold",
            task=task,
            metric=rule.metric,
            op=rule.op,
            limit=rule.value,
            higher_is_better=rules.is_higher_better(task, rule.metric),
        )
        if (task, rule.metric) not in candidate.metrics:
            out.append(
                VerdictRow(
                    status="fail",
                    reason=f"metric missing: run {candidate.run_id} has no {rule.metric!r} for task {task!r}",
                    **common,
                )
            )
            continue
        value = _value(candidate.metrics[(task, rule.metric)])
        if value is None:
            out.append(
                VerdictRow(
                    status="fail",
                    reason=f"metric missing: {rule.metric!r} for task {task!r} is null",
                    **common,
                )
            )
            continue
        ok = _OPS[rule.op](value, rule.value)
        reason = (
            f"{rule.metric} = {_fmt(value)} {rule.op} {_fmt(rule.value)}"
            if ok
            else f"{rule.metric} = {_fmt(value)}, needs {rule.op} {_fmt(rule.value)}"
        )
        out.append(
            VerdictRow(status="pass" if ok else "fail", reason=reason, observed=value, **common)
        )
    return out


def _check_regression(
    candidate: RunData,
    baseline: RunData,
    rule: Regression,
    task: str,
    *,
    in_cand: bool,
    in_base: bool,
    keys: list[tuple[str, str]],
    rules: Rules,
    n_boot: int,
    seed: int,
    alpha: float,
) -> VerdictRow:
    higher = rules.is_higher_better(task, rule.metric)
    common = dict(
        kind="regression", task=task, metric=rule.metric, limit=rule.delta, higher_is_better=higher
    )
    if not in_cand and not in_base:
        return VerdictRow(
            status="skipped", reason=f"neither run has metric {rule.metric!r} for this task", **common
        )
    if not in_cand:
        return VerdictRow(
            status="fail",
            reason=f"metric missing: candidate {candidate.run_id} lacks {rule.metric!r}, "
            f"which baseline {baseline.run_id} has",
            **common,
        )
    if not in_base:
        return VerdictRow(
            status="skipped",
            reason=f"baseline {baseline.run_id} has no {rule.metric!r}; nothing to compare",
            **common,
        )

    cand_vals: list[float] = []
    base_vals: list[float] = []
    for key in keys:
        a = _value(candidate.samples[key].get(rule.metric))
        b = _value(baseline.samples[key].get(rule.metric))
        if a is not None and b is not None:
            cand_vals.append(a)
            base_vals.append(b)
    if not cand_vals:
        return VerdictRow(
            status="fail",
            reason=f"no shared prompt has a per-sample {rule.metric!r} in both runs; "
            "a regression cannot be ruled out",
            **common,
        )

    d = stats.paired_bootstrap(cand_vals, base_vals, n_boot=n_boot, seed=seed, alpha=alpha)
    # drop: how much worse the candidate is; its CI bounds follow from delta's.
    if higher:
        drop, drop_lo, drop_hi = -d.delta, -d.hi, -d.lo
    else:
        drop, drop_lo, drop_hi = d.delta, d.lo, d.hi
    word = "drop" if higher else "increase"
    level = f"{100 * (1 - alpha):g} % CI"
    failed = drop_lo > rule.delta
    reason = (
        f"{word} {_fmt(drop)} ({level} [{_fmt(drop_lo)}, {_fmt(drop_hi)}]) "
        + ("lies wholly above" if failed else "not wholly above")
        + f" {_fmt(rule.delta)} over {d.n} prompts"
    )
    return VerdictRow(
        status="fail" if failed else "pass",
        reason=reason,
        observed=d.mean_a,
        baseline=d.mean_b,
        delta=d.delta,
        ci=(d.lo, d.hi),
        n=d.n,
        **common,
    )


# ------------------------------------------------------------------------ rendering


def _limit_text(row: VerdictRow) -> str:
    if row.limit is None:
        return ""
    if row.kind == "threshold":
        return f"{row.op} {_fmt(row.limit)}"
    return f"{'drop' if row.higher_is_better else 'increase'} ≤ {_fmt(row.limit)}"


def _delta_text(row: VerdictRow) -> str:
    if row.delta is None:
        return ""
    text = f"{row.delta + 0.0:+.4g}"
    if row.ci is not None:
        text += f" [{_fmt(row.ci[0])}, {_fmt(row.ci[1])}]"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(verdict: Verdict, candidate_id: str, baseline_id: str | None = None) -> str:
    """The verdict as a header line (PASS / FAIL) and one markdown table row per check."""
    word = "PASS" if verdict.passed else "FAIL"
    against = f" vs baseline `{baseline_id}`" if baseline_id else ""
    lines = [
        f"## evalkit gate: {word} — candidate `{candidate_id}`{against}",
        "",
        f"{len(verdict.rows)} checks: {verdict.count('pass')} pass, "
        f"{verdict.count('fail')} fail, {verdict.count('skipped')} skipped.",
        "",
        "| status | kind | task | metric | candidate | baseline | limit | Δ [CI] | n | reason |",
        "|---|---|---|---|---:|---:|---|---|---:|---|",
    ]
    for r in verdict.rows:
        status = {"pass": "pass", "fail": "**FAIL**", "skipped": "skipped"}[r.status]
        cells = [
            status,
            r.kind,
            r.task or "*",
            r.metric,
            _fmt(r.observed),
            _fmt(r.baseline),
            _limit_text(r),
            _delta_text(r),
            "" if r.n is None else str(r.n),
            r.reason,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def to_junit(verdict: Verdict, candidate_id: str, baseline_id: str | None = None) -> str:
    """The verdict as JUnit XML: one testsuite "evalkit-gate", one testcase per row."""
    suite = ET.Element(
        "testsuite",
        {
            "name": "evalkit-gate",
            "tests": str(len(verdict.rows)),
            "failures": str(verdict.count("fail")),
            "errors": "0",
            "skipped": str(verdict.count("skipped")),
            "time": "0",
        },
    )
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", {"name": "candidate", "value": candidate_id})
    if baseline_id:
        ET.SubElement(props, "property", {"name": "baseline", "value": baseline_id})
    for r in verdict.rows:
        case = ET.SubElement(
            suite,
            "testcase",
            {"classname": f"evalkit.gate.{r.kind}", "name": r.name, "time": "0"},
        )
        if r.status == "fail":
            failure = ET.SubElement(case, "failure", {"message": r.reason, "type": r.kind})
            failure.text = r.reason
        elif r.status == "skipped":
            ET.SubElement(case, "skipped", {"message": r.reason})
        else:
            out = ET.SubElement(case, "system-out")
            out.text = r.reason
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"
