"""The gate's decision, a pure function: `decide(candidate, baseline, rules) -> Verdict`.

Owns: `check_names` (a rule that matches nothing in either run is an error, never a silent
skip), and the decision itself — each rule a test with three outcomes (pass, fail, inconclusive), and
Holm's correction over the checks that could fail. Does not: read the DB (the caller
builds `RunData`), compute a test's statistics (`paired`), resolve run ids or tags,
print, or exit — only the CLI turns a `Verdict` into an exit code.

The decision (docs/gate.md):

* A regression is a non-inferiority test. It **passes** when the 95 % interval of the
  candidate's drop lies wholly below the rule's margin, **fails** when it lies wholly above
  the margin *and* the failure survives Holm's step-down over every check that could fail
  (family-wise error of a false fail at most 2.5 %, one-sided), and is **inconclusive**
  otherwise; the row then says about how many prompts would decide it.
* 0/1 metrics under an absolute margin use Tango's score interval on the discordant pairs;
  other metrics, and relative margins, the paired bootstrap.
* A threshold compares the interval of the candidate's value with the bound in the same
  three ways (Wilson for 0/1 values, the bootstrap otherwise, or the interval stored with
  an aggregate); a value with no interval, or an ``==`` rule, is compared as a point.
* The gate fails if any row fails, else is inconclusive if any row is, else passes. A run
  gated against itself passes every regression by identity.

Rows that are decided without a test (all surface, never silently):

* A threshold on a metric the candidate lacks (or whose aggregate is null) fails
  with reason "metric missing".
* A regression rule whose metric neither run has (say ``needle_recall`` under the
  default rules, gating two first-token runs) is a ``skipped`` row, not a failure.
  A metric only the baseline has fails (the candidate lost it); one only the
  candidate has is skipped (nothing to compare against). A pair metric (js_div) that
  cannot be computed because one run has no first-token top-k (``RunData.lacks``) fails
  the same way, naming that run; it is skipped only when both runs lack it.
* A regression where both runs have the metric but no shared prompt has a per-sample
  value on both sides, and no interval is stored on both sides, is inconclusive.
* Two runs sharing no prompt at all, or regression rules without a baseline, are
  ``BadInput``: the user asked for a comparison that cannot be made.
"""

from dataclasses import replace
from typing import Any

from evalkit.errors import BadInput
from evalkit.kinds import GateOutcome
from evalkit.release import paired
from evalkit.release.rules import OPS, Regression, Rules, Threshold
from evalkit.release.verdict import (  # RunData, Verdict, VerdictRow and fmt are read from here too
    ALPHA,
    DEGENERATE_METRIC,
    N_BOOT,
    NOT_COMPUTED_WORDS,
    TWIN_WORDS,
    RunData,
    Verdict,
    VerdictRow,
    _metric_tasks,
    _prompts,
    _value,
    fmt,
)
from evalkit.scoring import registry


def decide(
    candidate: RunData,
    baseline: RunData | None,
    rules: Rules,
    *,
    n_boot: int = N_BOOT,
    seed: int = 0,
    alpha: float = ALPHA,
    twins: bool | None = None,
) -> Verdict:
    """Check ``candidate`` against ``rules`` (and ``baseline`` for regressions). Pure.

    Thresholds test the candidate's value against their bound; regressions pair
    per-sample values over the (task, doc_id) keys both runs hold with the metric
    non-null and test the drop against the rule's margin (see the module docstring).

    Raises ``BadInput`` when there are regression rules but no baseline, or the
    two runs share no prompt at all.

    ``twins`` (default: only under a shipped rule set, `same` or `upgrade`): a 0/1 regression that its outcomes cannot
    decide at this size is left to its exact, continuous twin on the same task (the registry's
    ``twin``: answer_hit -> answer_prob) when the twin's row passes; the 0/1 row is then
    ``skipped`` and says so (`_twins_speak`).
    """
    rows: list[VerdictRow] = []
    cand_tasks = _metric_tasks(candidate)
    tests = dict(n_boot=n_boot, seed=seed, alpha=alpha)

    for threshold in rules.thresholds:
        rows.extend(_check_threshold(candidate, threshold, rules, tests))

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
        use_twins = twins if twins is not None else rules.shipped is not None
        regressions = list(rules.regressions)
        if use_twins:  # a metric a run did not compute is checked through its stand-in, where both runs hold it
            regressions += _stand_ins(regressions, candidate, baseline, cand_tasks, base_tasks)
        for rule in regressions:
            if rule.task is not None:
                tasks = [rule.task]
            else:
                tasks = sorted(cand_tasks.get(rule.metric, set()) | base_tasks.get(rule.metric, set()))
                if not tasks:  # aggregates only (e.g. middle_gap): tested on their stored intervals
                    tasks = sorted({t for t, m in {**candidate.metrics, **baseline.metrics} if m == rule.metric})
            lacking = _lacking(rule.metric, candidate, baseline)
            if lacking:
                rows.append(lacking(rule, None, rules))
                continue
            if not tasks:
                why = _not_computed(rule.metric, candidate, baseline)
                rows.append(
                    VerdictRow(
                        kind="regression",
                        task=None,
                        metric=rule.metric,
                        status="inconclusive" if why else "skipped",
                        reason=why or f"neither run has metric {rule.metric!r}",
                        margin=str(rule.margin),
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
                        tests=tests,
                    )
                )

    rows, family = _holm(rows, alpha)
    if twins if twins is not None else rules.shipped is not None:
        rows = _twins_speak(rows)
    rows += degenerate_rows(candidate, rules)
    if any(r.status == "fail" for r in rows):
        outcome: GateOutcome = "fail"
    elif any(r.status == "inconclusive" for r in rows):
        outcome = "inconclusive"
    else:
        outcome = "pass"
    return Verdict(outcome=outcome, rows=rows, family=family)


def degenerate_rows(candidate: RunData, rules: Rules) -> list[VerdictRow]:
    """Under rules that ask "is the candidate no worse?" (`upgrade`, or a file extending it), a failing row
    per task where the candidate's output is degenerate (`scoring.degenerate`): a model that answers
    "????" or stops at once looks confident and free of openers, so its means may pass every rule; it is
    refused with the reason instead. Under other rules the gate only notes it (`release.db`).

    >>> from evalkit.release.rules import rule_set
    >>> run = RunData("c", {}, {}, degenerate={"firsttoken_en": "9 of 10 responses repeat one token or character"})
    >>> [(r.status, r.task, r.metric) for r in degenerate_rows(run, rule_set("upgrade"))]
    [('fail', 'firsttoken_en', 'degenerate')]
    >>> degenerate_rows(run, rule_set("same"))
    []
    """
    if rules.question != "upgrade":
        return []
    return [VerdictRow(kind="threshold", task=task, metric=DEGENERATE_METRIC, status="fail",
                       reason=f"the candidate's output is degenerate ({why}); the upgrade rules pass no "
                              "degenerate candidate (docs/gate.md)")
            for task, why in sorted(candidate.degenerate.items())]


def _lacking(metric: str, candidate: RunData, baseline: RunData):
    """A maker of the row for a pair metric one run cannot have (`RunData.lacks`): a fail, as a metric
    only the baseline has fails ("metric missing", naming the run); a skip when both runs lack it.
    None when neither lacks it."""
    why = [run.lacks[metric] for run in (candidate, baseline) if metric in run.lacks]
    if not why:
        return None
    both = len(why) == 2

    def row(rule: Regression, task: str | None, rules: Rules) -> VerdictRow:
        return VerdictRow(
            kind="regression", task=task, metric=rule.metric, status="skipped" if both else "fail",
            reason=(f"neither run can have {rule.metric!r}: " if both else "metric missing: ") + "; ".join(why),
            margin=str(rule.margin), higher_is_better=rules.is_higher_better(task, rule.metric))

    return row


def _stand_ins(regressions: list[Regression], candidate: RunData, baseline: RunData,
               cand_tasks: dict[str, set[str]], base_tasks: dict[str, set[str]]) -> list[Regression]:
    """A regression on the registry's stand-in (opener_mass -> opener_start_mass, under its own margin) for
    each rule whose metric a run did not compute, where both runs hold the stand-in's per-prompt values and
    no rule checks it already (`evalkit run --metrics gate` computes the stand-in in the metric's place)."""
    checked = {(r.task, r.metric) for r in regressions}
    out: list[Regression] = []
    for rule in regressions:
        known = registry.get(rule.metric)
        stand = known.stand_in if known else None
        if stand is None or (rule.task, stand) in checked or not _not_computed(rule.metric, candidate, baseline):
            continue
        if stand in cand_tasks and stand in base_tasks:
            out.append(Regression(stand, registry.METRICS[stand].margin, rule.task))  # type: ignore[arg-type]
            checked.add((rule.task, stand))
    return out


def _speaker(metric: str, rows: list[VerdictRow]) -> str | None:
    """The metric whose rows speak for a rule on `metric` that a run did not compute: its exact twin, the
    twin's stand-in, or its own stand-in (`registry.gate_reads`'s order), the first that has rows."""
    known = registry.get(metric)
    if known is None:
        return None
    twin = registry.METRICS[known.twin] if known.twin else None
    have = {r.metric for r in rows if r.kind == "regression" and r.status != "skipped"
            and not r.reason.startswith(NOT_COMPUTED_WORDS)}
    for name in (twin.name if twin else None, twin.stand_in if twin else None, known.stand_in):
        if name and name in have:
            return name
    return None


def _twins_speak(rows: list[VerdictRow]) -> list[VerdictRow]:
    """An inconclusive 0/1 regression whose exact twin (registry ``twin``) passes on the same task
    becomes ``skipped``: the twin's pass speaks for it, and the row says so. (A failing twin fails
    the gate by itself; the 0/1 row then stays as it was.)"""
    decided = {(r.task, r.metric): r for r in rows if r.kind == "regression" and r.status == "pass"}
    out = []
    for r in rows:
        known = registry.get(r.metric)
        twin_name = known.twin if known else None
        twin = decided.get((r.task, twin_name)) if twin_name else None
        if r.kind == "regression" and r.status == "inconclusive" and r.reason.startswith(NOT_COMPUTED_WORDS):
            # not computed (`evalkit run --metrics gate` computes its twin or stand-in in its place): their
            # rows speak for it where every one of them passes, on this task or (task None) on every task
            speaker = _speaker(r.metric, rows)
            theirs = [t for t in rows if t.kind == "regression" and t.metric == speaker
                      and (r.task is None or t.task == r.task)] if speaker else []
            if theirs and all(t.status == "pass" for t in theirs):
                where = "on this task" if r.task else f"on every task ({len(theirs)})"
                word = "exact twin" if speaker == twin_name else "stand-in"
                r = replace(r, status="skipped", reason=f"{r.reason}; its {word} {speaker} passes {where} "
                                                        "and speaks for it")
        elif r.kind == "regression" and r.status == "inconclusive" and twin is not None:
            r = replace(r, status="skipped", reason=(
                f"{TWIN_WORDS} {twin.metric}, which passes on this task: {r.metric}'s 0/1 "
                f"outcomes cannot decide at this size ({r.reason})"))
        out.append(r)
    return out


def _holm(rows: list[VerdictRow], alpha: float) -> tuple[list[VerdictRow], int]:
    """Keep a fail only where Holm's step-down over every tested row rejects "no worse than the limit"."""
    tested = [i for i, r in enumerate(rows) if r.p_fail is not None]
    rejected = paired.holm([rows[i].p_fail for i in tested], alpha / 2)  # type: ignore[misc]
    out = list(rows)
    for i, keep in zip(tested, rejected):
        r = rows[i]
        if r.status == "fail" and not keep:
            out[i] = replace(r, status="inconclusive", reason=(
                f"{r.reason.split('; ', 1)[0]}: past the limit at 95 %, not after Holm over {len(tested)} checks "
                f"(one-sided p = {r.p_fail:.2g})"))
    return out, len(tested)


def _test_reason(word: str, t: paired.Evidence, limit_text: str) -> str:
    if t.short:  # the method cannot decide on these data, whatever its interval says
        need = f"; {_prompts(t.decide_n)}" if t.decide_n else ""
        text = f"{word} {fmt(t.estimate)} ({t.method}, n = {t.n}) against {limit_text}: not decided: {t.short}"
        return text + (f"; {t.note}" if t.note else "") + need
    side = {"pass": "lies wholly on the right side of", "fail": "lies wholly past",
            "inconclusive": "straddles"}[t.status]
    text = (f"{word} {fmt(t.estimate)} (95 % CI [{fmt(t.lo)}, {fmt(t.hi)}], {t.method}, n = {t.n}) "
            f"{side} {limit_text}")
    if t.note:
        text += f"; {t.note}"
    if t.status == "inconclusive":
        text += f"; {_prompts(t.decide_n)}"
    return text


def _check_threshold(candidate: RunData, rule: Threshold, rules: Rules, tests: dict) -> list[VerdictRow]:
    if rule.task is not None:
        tasks = [rule.task]
    else:
        tasks = sorted(t for (t, m) in candidate.metrics if m == rule.metric)
    if not tasks:
        why = _not_computed(rule.metric, candidate)
        return [
            VerdictRow(
                kind="threshold",
                task=None,
                metric=rule.metric,
                status="inconclusive" if why else "fail",
                reason=why or f"metric missing: run {candidate.run_id} has no {rule.metric!r} in any task",
                op=rule.op,
                limit=rule.value,
                higher_is_better=rules.is_higher_better(None, rule.metric),
            )
        ]
    out = []
    for task in tasks:
        common: dict[str, Any] = dict(
            kind="threshold",
            task=task,
            metric=rule.metric,
            op=rule.op,
            limit=rule.value,
            higher_is_better=rules.is_higher_better(task, rule.metric),
        )
        if (task, rule.metric) not in candidate.metrics:
            why = _not_computed(rule.metric, candidate)
            out.append(
                VerdictRow(
                    status="inconclusive" if why else "fail",
                    reason=why or f"metric missing: run {candidate.run_id} has no {rule.metric!r} for task {task!r}",
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
        t = _threshold_test(candidate, task, rule, value, tests)
        if t is None:  # no interval: a point comparison
            ok = OPS[rule.op](value, rule.value)
            why = "an == rule" if rule.op == "==" else "no interval"
            reason = (
                f"{rule.metric} = {fmt(value)} {rule.op} {fmt(rule.value)} ({why}: compared as a point)"
                if ok
                else f"{rule.metric} = {fmt(value)}, needs {rule.op} {fmt(rule.value)} ({why}: compared as a point)"
            )
            out.append(VerdictRow(status="pass" if ok else "fail", reason=reason, observed=value, **common))
            continue
        out.append(VerdictRow(
            status=t.status, reason=_test_reason(rule.metric, t, f"{rule.op} {fmt(rule.value)}"),
            observed=t.estimate, ci=(t.lo, t.hi), n=t.n, method=t.method, p_fail=t.p_fail,
            decide_n=t.decide_n, **common))
    return out


def _threshold_test(run: RunData, task: str, rule: Threshold, value: float, tests: dict) -> paired.Evidence | None:
    """The interval test of one threshold: per-prompt values where the run has them, else the stored
    interval; None for an ``==`` rule or a value with nothing to make an interval from."""
    if rule.op == "==":
        return None
    values = [v for (t, _doc), vals in run.samples.items() if t == task
              if (v := _value(vals.get(rule.metric))) is not None]
    alpha = tests["alpha"]
    if values:  # one value too: the test then says how many prompts it needs
        if _binary(rule.metric, values):
            return paired.threshold_binary(values, rule.op, rule.value, alpha)
        return paired.threshold_continuous(values, rule.op, rule.value, alpha, tests["n_boot"], tests["seed"])
    stored = _interval(run, (task, rule.metric))
    if stored is not None:
        return paired.threshold_stored(value, stored[0], stored[1], rule.op, rule.value, stored[2])
    return None


def _binary(metric: str, values: list[float]) -> bool:
    known = registry.get(metric)
    return bool(known and known.binary) and all(v in (0.0, 1.0) for v in values)


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
    tests: dict,
) -> VerdictRow:
    higher = rules.is_higher_better(task, rule.metric)
    common: dict[str, Any] = dict(
        kind="regression", task=task, metric=rule.metric, margin=str(rule.margin), higher_is_better=higher
    )
    if rule.margin.kind == "delta":
        common["limit"] = rule.margin.value
    why = _not_computed(rule.metric, *([candidate] if not in_cand else []), *([baseline] if not in_base else []))
    if why and not (in_cand and in_base):
        return VerdictRow(status="inconclusive", reason=why, **common)
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

    cand_vals, base_vals = _paired_values(candidate, baseline, keys, rule.metric)
    word = "drop" if higher else "increase"
    if candidate.run_id == baseline.run_id:
        return VerdictRow(status="pass", reason="the candidate is the baseline: no drop by identity",
                          observed=_mean(cand_vals), baseline=_mean(base_vals), drop=0.0, ci=(0.0, 0.0),
                          n=len(cand_vals), method="identity", **common)
    if not cand_vals:
        return _regression_from_intervals(candidate, baseline, rule, task, higher, word, common)

    margin = rule.margin
    if margin.kind == "delta" and _binary(rule.metric, cand_vals + base_vals):
        t = paired.paired_binary(cand_vals, base_vals, higher_is_better=higher, margin=margin.value,
                                 alpha=tests["alpha"])
    else:
        t = _continuous(cand_vals, base_vals, higher, margin, tests)
    common["limit"] = t.limit
    status, reason = t.status, _test_reason(word, t, _margin_text(t.limit, rule))
    bound = registry.upper_bound_key(rule.metric)
    if status == "pass" and bound is not None:
        cand_his, base_his = _paired_values(candidate, baseline, keys, bound)
        if cand_his:
            t_hi = _continuous(cand_his, base_his, higher, margin, tests)
            if t_hi.status != "pass":  # what the stored events leave undecided could still break the margin
                status = "inconclusive"
                reason += (f"; not decided: the mass the stored events leave undecided allows "
                           f"{fmt(t_hi.estimate)} (95 % CI [{fmt(t_hi.lo)}, {fmt(t_hi.hi)}]) at most, "
                           f"which does not lie wholly below {_margin_text(t_hi.limit, rule)}")
    return VerdictRow(
        status=status, reason=reason,
        observed=_mean(cand_vals), baseline=_mean(base_vals), drop=t.estimate, ci=(t.lo, t.hi), n=t.n,
        method=t.method, p_fail=t.p_fail, decide_n=t.decide_n, **common)


def _paired_values(candidate: RunData, baseline: RunData, keys: list[tuple[str, str]],
                   name: str) -> tuple[list[float], list[float]]:
    """The values of `name` (a metric, or a distance's bound) on the prompts of `keys` where both runs have one."""
    cand_vals: list[float] = []
    base_vals: list[float] = []
    for key in keys:
        a = _value(candidate.samples[key].get(name))
        b = _value(baseline.samples[key].get(name))
        if a is not None and b is not None:
            cand_vals.append(a)
            base_vals.append(b)
    return cand_vals, base_vals


def _continuous(cand_vals: list[float], base_vals: list[float], higher: bool, margin: registry.Margin,
                tests: dict) -> paired.Evidence:
    """The paired bootstrap of a regression under its margin (absolute or relative)."""
    return paired.paired_continuous(cand_vals, base_vals, higher_is_better=higher, alpha=tests["alpha"],
                                    n_boot=tests["n_boot"], seed=tests["seed"], **{margin.kind: margin.value})


def _not_computed(metric: str, *runs: RunData) -> str | None:
    """A rule's plain reason when a run did not compute its metric (`RunData.not_computed`: `evalkit run
    --metrics` skipped it, or its engine cannot), naming each such run; None when every run computed it.

    >>> a = RunData("a", {}, {}, not_computed={"ft_hit": "not computed: --metrics gate skips the greedy response"})
    >>> _not_computed("ft_hit", a, RunData("b", {}, {}))
    "not computed: run a did not compute 'ft_hit' (--metrics gate skips the greedy response)"
    """
    known = registry.get(metric)
    name = known.name if known else metric
    said = [(run.run_id, why) for run in runs if (why := run.not_computed.get(name)) is not None]
    if not said:
        return None
    whys = "; ".join(f"run {rid} did not compute {metric!r} ({why.removeprefix(NOT_COMPUTED_WORDS + ': ')})"
                     for rid, why in said)
    return f"{NOT_COMPUTED_WORDS}: {whys}"


def _margin_text(limit: float, rule: Regression) -> str:
    if rule.margin.kind == "delta":
        return f"the margin {fmt(limit)}"
    return f"the margin {fmt(limit)} ({rule.margin})"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _regression_from_intervals(candidate: RunData, baseline: RunData, rule: Regression, task: str,
                               higher: bool, word: str, common: dict[str, Any]) -> VerdictRow:
    """A regression on an aggregate with no per-prompt values (middle_gap, a group task): the stored
    intervals of both runs, unpaired; inconclusive when either run stored none."""
    key = (task, rule.metric)
    a, b = _value(candidate.metrics.get(key)), _value(baseline.metrics.get(key))
    ia, ib = _interval(candidate, key), _interval(baseline, key)
    if a is None or b is None or ia is None or ib is None:
        return VerdictRow(
            status="inconclusive",
            reason=f"no shared prompt has a per-sample {rule.metric!r} in both runs and no interval is stored "
            "with both aggregates: nothing to test a drop with",
            observed=a, baseline=b, **common,
        )
    margin = rule.margin.value if rule.margin.kind == "delta" else rule.margin.value * abs(b)
    counts = [m for m in (ia[2], ib[2]) if m]
    t = paired.unpaired_stored((a, ia[0], ia[1]), (b, ib[0], ib[1]), higher_is_better=higher, margin=margin,
                               n=min(counts) if counts else 0)
    common["limit"] = t.limit
    return VerdictRow(status=t.status, reason=_test_reason(word, t, _margin_text(t.limit, rule)), observed=a,
                      baseline=b, drop=t.estimate, ci=(t.lo, t.hi), n=t.n or None, method=t.method,
                      p_fail=t.p_fail, decide_n=t.decide_n, **common)


def _interval(run: RunData, key: tuple[str, str]) -> tuple[float, float, int | None] | None:
    """The finite interval stored with one of the run's aggregates, None when there is none."""
    stored = run.intervals.get(key)
    if not stored or _value(stored[0]) is None or _value(stored[1]) is None:
        return None
    return stored


def check_names(rules: Rules, candidate: RunData, baseline: RunData | None) -> None:
    """Refuse (BadInput) a rule of a rules file whose name matches nothing.

    A misspelled metric or task would otherwise make its rule a silent `skipped` row
    and let the gate pass. A rule's task must be a task of one of the runs; its metric
    must be held by one of the runs, or be a metric evalkit knows (the registry) or the
    file gives a direction for — a known metric neither run holds (needle_recall when
    gating two first-token runs) stays a visible `skipped` row, so one rules file can
    serve several kinds of run. A regression on a metric the registry does not know, or
    knows as descriptive (no direction), needs its direction under `higher_is_better`. (`check_verdict` then refuses a gate
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

    checked: list[tuple[str, Threshold | Regression]] = [*(("thresholds", r) for r in rules.thresholds),
                                                         *(("regressions", r) for r in rules.regressions)]
    for section, rule in checked:
        if rule.task is not None and rule.task not in tasks:
            raise bad(section, rule.key, f"no task {rule.task!r} in either run{registry.suggest(rule.task, tasks)} "
                                         f"(tasks: {', '.join(tasks)})")
        directed = any(k in rules.higher_is_better for k in (rule.metric, rule.key))
        if rule.metric not in held and registry.get(rule.metric) is None and not directed:
            known = sorted(held)
            hint = registry.suggest(rule.metric, known + list(registry.METRICS))
            raise bad(section, rule.key, f"unknown metric {rule.metric!r}{hint} (the runs hold: {', '.join(known)})")
        if section == "regressions" and registry.higher_is_better(rule.metric) is None and not directed:
            why = (f"{rule.metric} describes without ranking (no better direction)" if registry.get(rule.metric)
                   else f"evalkit does not know whether a higher {rule.metric} is better")
            raise bad(section, rule.key, f"{why}: say so under higher_is_better ({rule.metric}: true or false)")


def check_verdict(verdict: Verdict, rules: Rules) -> None:
    """Refuse a verdict in which no rule checked anything: every row skipped is no gate at all."""
    if verdict.rows and all(r.status == "skipped" for r in verdict.rows):
        names = sorted({r.metric for r in verdict.rows})
        raise BadInput(f"{rules.source}: none of its metrics ({', '.join(names)}) is in either run, "
                       "so the gate would check nothing; give rules for the metrics these runs hold")
