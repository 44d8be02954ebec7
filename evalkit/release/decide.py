"""The gate's decision, a pure function: `decide(candidate, baseline, rules) -> Verdict`.

Owns: `RunData` (what the gate needs of one run, as plain values), `check_names` (a
rule that matches nothing in either run is an error, never a silent skip), and the
decision itself — thresholds on the candidate's aggregates and paired-bootstrap
regression tests against a baseline. Does not: read the DB (the caller builds
`RunData`), resolve run ids or tags, print, or exit — only the CLI turns a `Verdict`
into an exit code.

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

import math
from dataclasses import dataclass
from typing import Any

from evalkit.errors import BadInput
from evalkit.release.rules import OPS, Regression, Rules, Threshold
from evalkit.scoring import registry, stats


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


def fmt(x: float | None) -> str:
    """A number as the verdict shows it (4 significant digits; -0 as 0)."""
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
        ok = OPS[rule.op](value, rule.value)
        reason = (
            f"{rule.metric} = {fmt(value)} {rule.op} {fmt(rule.value)}"
            if ok
            else f"{rule.metric} = {fmt(value)}, needs {rule.op} {fmt(rule.value)}"
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
        f"{word} {fmt(drop)} ({level} [{fmt(drop_lo)}, {fmt(drop_hi)}]) "
        + ("lies wholly above" if failed else "not wholly above")
        + f" {fmt(rule.delta)} over {d.n} prompts"
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


def check_names(rules: Rules, candidate: RunData, baseline: RunData | None) -> None:
    """Refuse (BadInput) a rule of a rules file whose name matches nothing.

    A misspelled metric or task would otherwise make its rule a silent `skipped` row
    and let the gate pass. A rule's task must be a task of one of the runs; its metric
    must be held by one of the runs, or be a metric evalkit knows (the registry) or the
    file gives a direction for — a known metric neither run holds (needle_recall when
    gating two first-token runs) stays a visible `skipped` row, so one rules file can
    serve several kinds of run. A regression on a metric the registry does not know
    needs its direction under `higher_is_better`. (`check_verdict` then refuses a gate
    where every rule was skipped.)
    """
    runs = [r for r in (candidate, baseline) if r is not None]
    held: dict[str, set[str]] = {}  # metric -> tasks holding it, aggregates or per-sample values
    for run in runs:
        for task, metric in run.metrics:
            held.setdefault(metric, set()).add(task)
        for (task, _doc), values in run.samples.items():
            for metric in values:
                held.setdefault(metric, set()).add(task)
    tasks = sorted({t for ts in held.values() for t in ts})

    def bad(section: str, key: str, msg: str) -> BadInput:
        return BadInput(f"rules file {rules.source}: {section}.{key}: {msg}")

    for section, rule in [*(("thresholds", r) for r in rules.thresholds),
                          *(("regressions", r) for r in rules.regressions)]:
        if rule.task is not None and rule.task not in tasks:
            raise bad(section, rule.key, f"no task {rule.task!r} in either run{registry.suggest(rule.task, tasks)} "
                                         f"(tasks: {', '.join(tasks)})")
        directed = any(k in rules.higher_is_better for k in (rule.metric, rule.key))
        if rule.metric not in held and registry.get(rule.metric) is None and not directed:
            known = sorted(held)
            hint = registry.suggest(rule.metric, known + list(registry.METRICS))
            raise bad(section, rule.key, f"unknown metric {rule.metric!r}{hint} (the runs hold: {', '.join(known)})")
        if section == "regressions" and registry.get(rule.metric) is None and not directed:
            raise bad(section, rule.key, f"evalkit does not know whether a higher {rule.metric} is better: "
                                         f"say so under higher_is_better ({rule.metric}: true or false)")


def check_verdict(verdict: Verdict, rules: Rules) -> None:
    """Refuse a verdict in which no rule checked anything: every row skipped is no gate at all."""
    if verdict.rows and all(r.status == "skipped" for r in verdict.rows):
        names = sorted({r.metric for r in verdict.rows})
        raise BadInput(f"{rules.source}: none of its metrics ({', '.join(names)}) is in either run, "
                       "so the gate would check nothing; give rules for the metrics these runs hold")
