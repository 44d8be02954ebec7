"""The DB side of the release gate: reading two runs into ``decide.RunData``, and promotion tags.

Owns: ``load_run_data`` (aggregates from ``metrics``, per-sample values from
``samples``), ``with_distances`` (per prompt, the candidate's first-token distance from the
baseline, from both runs' stored top-k), ``gate_runs`` (rules, run resolution, ``gate.decide`` and its
markdown / JUnit renderings, all from one read-only connection) and
``promote`` (one row appended to ``tags``: ``tag:NAME`` is the run promoted to it most recently),
and ``record_decision`` (the gate's decision as ``gates`` and ``gate_checks`` rows, written after
the verdict on a DB already at this schema; ``store.promotions`` writes them).
Does not: decide pass or fail (``gate.decide`` does), print, write files, or
turn a verdict into an exit code (the CLI does).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from evalkit.errors import BadInput
from evalkit.scoring.registry import RULE_SET_QUESTIONS
from evalkit.store.db import db_path, now, open_reader
from evalkit.store.promotions import GateRecord, add_tag, record_gate
from evalkit.store.queries import degenerate_flags, not_computed, resolve_run, shown_status
from evalkit.store.rows import SAMPLE_METRIC_COLUMNS
from evalkit.store.runs import transaction

if TYPE_CHECKING:  # evalkit.release.decide imports numpy and yaml: loaded when a gate runs
    from evalkit.release.decide import Verdict
    from evalkit.release.rules import Rules



@dataclass(frozen=True)
class GateResult:
    verdict: Verdict
    candidate_id: str
    baseline_id: str
    markdown: str
    junit: str
    rules: str = ""  # the rules' source: "built-in rules 'same'" or the file
    question: str | None = None  # the question the rules answer (RULE_SET_QUESTIONS), None: a file's own
    note: str | None = None  # the runs differ in model or tokenizer: which question this is, how to ask the other
    rules_digest: str = ""  # `rules_digest` of the rules the verdict was reached under

    @property
    def passed(self) -> bool:
        return self.verdict.passed

    @property
    def outcome(self) -> str:
        """pass, fail or inconclusive."""
        return self.verdict.outcome


def _done_run(con, ref: str, action: str) -> str:
    """Resolve ``ref`` to a run id; BadInput unless that run finished (status 'done')."""
    run_id = resolve_run(con, ref)
    status = shown_status(con, run_id)
    if status != "done":
        raise BadInput(f"run {run_id} has status {status!r}; only a done run can be {action}")
    return run_id


def load_run_data(con, run_id: str):
    """One run as ``decide.RunData``: (task, metric) -> aggregate, (task, doc_id) -> {metric: value}.

    Aggregates take the ``none`` filter where a metric has several, with their stored interval
    (ci_lo / ci_hi, else value ± 1.96 stderr) where there is one; per-sample values are the
    numeric ``samples`` columns (SAMPLE_METRIC_COLUMNS), nulls left out.
    """
    from evalkit.release.decide import RunData

    metrics: dict[tuple[str, str], float] = {}
    intervals: dict[tuple[str, str], tuple[float, float, int | None]] = {}
    for task, metric, value, lo, hi, n in con.execute(
        "SELECT task, metric, arg_min(value, rank), arg_min(lo, rank), arg_min(hi, rank), arg_min(n, rank) "
        "FROM (SELECT *, CASE WHEN filter = 'none' THEN 0 ELSE 1 END AS rank, "
        "             coalesce(ci_lo, value - 1.96 * stderr) AS lo, coalesce(ci_hi, value + 1.96 * stderr) AS hi "
        "      FROM metrics WHERE run_id = ?) GROUP BY task, metric",
        [run_id],
    ).fetchall():
        metrics[(task, metric)] = value
        if lo is not None and hi is not None:
            intervals[(task, metric)] = (lo, hi, n)
    # does the first token predict the answer: lead_auroc.<signal> per task, over all its categories
    for task, signal, value, lo, hi, n in con.execute(
        "SELECT task, signal, auroc, ci_lo, ci_hi, n FROM lead_indicators WHERE run_id = ? AND category = '*'",
        [run_id],
    ).fetchall():
        metrics[(task, f"lead_auroc.{signal}")] = value
        if lo is not None and hi is not None:
            intervals[(task, f"lead_auroc.{signal}")] = (lo, hi, n)

    samples: dict[tuple[str, str], dict[str, float]] = {}
    cols = ", ".join(SAMPLE_METRIC_COLUMNS)
    cur = con.execute(f"SELECT task, doc_id, {cols} FROM samples WHERE run_id = ?", [run_id])
    while batch := cur.fetchmany(10_000):
        for task, doc_id, *values in batch:
            samples[(task, doc_id)] = {m: v for m, v in zip(SAMPLE_METRIC_COLUMNS, values) if v is not None}
    return RunData(run_id=run_id, metrics=metrics, samples=samples, intervals=intervals,
                   not_computed=not_computed(con, run_id),
                   degenerate={f["task"]: f["reason"] for f in degenerate_flags(con, run_id)})


def with_distances(con, cand, base):
    """(candidate, baseline) with each shared prompt's first-token distance added to both runs' samples.

    A distance metric (the registry's ``DISTANCE_METRICS``: ``js_div``) is a property of the pair,
    not of one run. The gate checks it as a regression like any other: the candidate's value on a
    prompt is its distance from the baseline there (``compare.pair_topk`` on both runs' stored
    top-k: by token id on one tokenizer, on the first-character events across two), the
    baseline's is its distance from itself, 0; the paired drop is then the mean distance, tested
    against an absolute margin; across tokenizers with the upper bound of each prompt's distance
    beside it (``registry.DISTANCE_BOUNDS``), which must pass too. A run that stored no top-k for the shared prompts (a text-only
    engine) is recorded in ``RunData.lacks``: the rule then fails as a metric missing on one side
    (`decide`), and is skipped only when neither run has a top-k.
    """
    from evalkit.compare import pair_topk
    from evalkit.release.decide import RunData
    from evalkit.scoring.registry import DISTANCE_BOUNDS, DISTANCE_METRICS, upper_bound_key

    pairing = pair_topk(con, base.run_id, cand.run_id)
    # across tokenizers each prompt's distance comes with the largest value the undecided mass allows
    # (`registry.DISTANCE_BOUNDS`); by token id there is none
    dist = {prompt: {**{m: d[m] for m in DISTANCE_METRICS},
                     **{upper_bound_key(m): d[hi] for m, hi in DISTANCE_BOUNDS.items() if hi in d}}
            for prompt, d in pairing.prompts.items()}
    lacks = {run_id: f"run {run_id} stored no first-token top-k for the prompts the two runs share"
             for run_id in pairing.missing}

    def added(run, own: bool) -> RunData:
        samples = {key: {**values, **({m: 0.0 for m in dist[key]} if own else dist[key])} if key in dist else values
                   for key, values in run.samples.items()}
        why = lacks.get(run.run_id)
        return RunData(run_id=run.run_id, metrics=run.metrics, samples=samples, intervals=run.intervals,
                       lacks={m: why for m in DISTANCE_METRICS} if why else {}, pairing=pairing,
                       not_computed=run.not_computed, degenerate=run.degenerate)

    return added(cand, cand.run_id == base.run_id), added(base, True)


def gate_runs(db, candidate: str, baseline: str, rules_path=None) -> GateResult:
    """Gate run ``candidate`` against ``baseline`` (ids, prefixes, latest, tag:NAME). Reads only.

    Raises BadInput for an invalid rules file, an unknown or unfinished run, or
    two runs that share no prompt.
    """
    from evalkit.release.decide import check_names, check_verdict, decide
    from evalkit.release.render import to_junit, to_markdown
    from evalkit.release.rules import load_rules

    rules = load_rules(rules_path)
    with open_reader(db) as con:
        cand_id = _done_run(con, candidate, "gated")
        base_id = _done_run(con, baseline, "gated")
        cand = load_run_data(con, cand_id)
        base = cand if base_id == cand_id else load_run_data(con, base_id)
        cand, base = with_distances(con, cand, base)
        differ = _model_or_tokenizer_differs(con, cand_id, base_id)
    check_names(rules, cand, base)
    verdict = decide(cand, base, rules)
    check_verdict(verdict, rules)
    head = rules_lines(rules, differ, cand.pairing)
    flagged = degenerate_lines(rules, cand, base)
    return GateResult(
        verdict=verdict,
        candidate_id=cand_id,
        baseline_id=base_id,
        markdown=to_markdown(verdict, cand_id, base_id, head=head + flagged),
        junit=to_junit(verdict, cand_id, base_id, rules=rules.source),
        rules=rules.source,
        question=RULE_SET_QUESTIONS.get(rules.question or ""),
        note=head[1] if len(head) > 1 and differ else None,
        rules_digest=rules_digest(rules),
    )


def _model_or_tokenizer_differs(con, a: str, b: str) -> str | None:
    """What sets two runs apart as models ("model fingerprint", "tokenizer"), None when neither does.
    An unknown value (NULL) is not taken for a difference."""
    rows = dict((r[0], r[1:]) for r in con.execute(
        "SELECT id, model_fingerprint, tokenizer_hash FROM runs WHERE id IN (?, ?)", [a, b]).fetchall())
    fa, fb = rows.get(a, (None, None)), rows.get(b, (None, None))
    found = [name for name, x, y in (("model fingerprint", fa[0], fb[0]), ("tokenizer", fa[1], fb[1]))
             if x is not None and y is not None and x != y]
    return " and ".join(found) or None


def degenerate_lines(rules, cand, base) -> list[str]:
    """A note per task where a gated run's output is degenerate (`scoring.degenerate`): the candidate's
    fails the upgrade rules (`decide.degenerate_rows`); under other rules, and for the baseline, the
    means the rules compare rank nothing there."""
    lines = []
    for who, run in (("candidate", cand), ("baseline", base)):
        if who == "baseline" and run.run_id == cand.run_id:
            continue
        for task, why in sorted(run.degenerate.items()):
            then = ("the upgrade rules refuse it" if who == "candidate" and rules.question == "upgrade"
                    else "its metrics there rank nothing, whatever the rules below say")
            lines.append(f"Note: the {who} {run.run_id} is degenerate output on {task} ({why}): {then}.")
    return lines


def rules_lines(rules, differ: str | None, pairing) -> list[str]:
    """The lines above the verdict table: which rules, which question they answer; when the runs are
    different models under `same`, how to ask "no worse?" instead; how js_div was paired."""
    from evalkit.kinds import RULE_SETS

    question = rules.question
    what = f"rules: {rules.source}" + (f" (extends {question!r})" if rules.extends else "")
    if question:
        what += f": {RULE_SET_QUESTIONS[question]}"
    lines = [what]
    if differ and question == "same":
        other = next(s for s in RULE_SETS if s != "same")
        lines.append(f"The runs differ in {differ}: these rules ask whether the candidate is the same model, "
                     f"cheaper, and js_div fails any real change of model. To ask whether it is no worse, "
                     f"run `evalkit gate ... --rules {other}` (or a rules file with `extends: {other}`).")
    elif differ and question is None:
        lines.append(f"The runs differ in {differ}; the shipped sets: --rules same (the same model, cheaper) "
                     "or --rules upgrade (no worse).")
    if pairing is not None and not pairing.missing and any(r.metric == "js_div" for r in rules.regressions):
        if pairing.space == "first_char_full":
            his = [d["js_hi"] for d in pairing.prompts.values()]
            bound = f"; over the whole distributions the mean lies within {sum(his) / len(his):.4g} at most" if his else ""
            lines.append(f"js_div compares the first character of each run's whole next-token distribution "
                         f"(first_char_topk; {pairing.relation.why}){bound}.")
        else:
            how = ("by token id (one tokenizer)" if pairing.space == "token_id" else
                   f"on the first non-whitespace character each token adds ({pairing.relation.why}; a run stored "
                   "before first_char_topk)")
            cut = f"; top-k lists cut to the shorter K = {pairing.k}" if pairing.k is not None else ""
            lines.append(f"js_div compares the runs' stored first-token top-k {how}{cut}.")
    return lines


def rules_digest(rules: Rules) -> str:
    """sha256 (hex, 16 characters) of what the rules say, not of how a file spells them: each
    threshold and regression with its resolved margin, the direction overrides, and the shipped
    set they are or extend (which also decides whether twins apply). Two files that mean the same
    rules share a digest; a shipped set's digest changes when a registered margin does."""

    canonical = {
        "thresholds": [[t.task, t.metric, t.op, t.value] for t in rules.thresholds],
        "regressions": [[r.task, r.metric, r.margin.kind, r.margin.value] for r in rules.regressions],
        "higher_is_better": sorted(rules.higher_is_better.items()),
        "shipped": rules.shipped,
        "extends": rules.extends,
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def new_gate_id() -> str:
    """A gate decision's id: `g` and the UTC minute, then 6 hex digits (`g2612051010-1a2b3c`)."""
    return "g" + now().strftime("%y%m%d%H%M") + "-" + uuid.uuid4().hex[:6]


def record_decision(db, result: GateResult, baseline_ref: str | None = None) -> str:
    """Keep the gate's decision in the DB (``gates`` and one ``gate_checks`` row per verdict row);
    return its id. Never migrates: BadInput (the line naming `evalkit migrate`) for an older schema,
    DatabaseBusy or StorageFault when the file cannot be written; nothing is written then."""
    from evalkit.version import __version__

    verdict = result.verdict
    gate = {
        "id": new_gate_id(), "created_at": now(), "candidate": result.candidate_id, "baseline": result.baseline_id,
        "baseline_ref": baseline_ref, "rules_name": result.rules, "rules_digest": result.rules_digest,
        "verdict": verdict.outcome, "n_pass": verdict.count("pass"), "n_fail": verdict.count("fail"),
        "n_inconclusive": verdict.count("inconclusive"), "n_skipped": verdict.count("skipped"),
        "holm_family": verdict.family, "evalkit_version": __version__,
    }
    checks = [{
        "kind": r.kind, "task": r.task, "metric": r.metric, "status": r.status, "observed": r.observed,
        "baseline_value": r.baseline, "bound": r.limit, "margin": r.margin, "drop": r.drop,
        "ci_lo": r.ci[0] if r.ci else None, "ci_hi": r.ci[1] if r.ci else None, "n": r.n, "method": r.method,
        "p_fail": r.p_fail, "decide_n": r.decide_n, "reason": r.reason,
    } for r in verdict.rows]
    return record_gate(db, GateRecord(gate, checks))


class Promotion(NamedTuple):
    run_id: str
    added: bool  # False: the run already was the tag's current run, and nothing was written
    previous: str | None  # the run the tag named before (None: a new tag)


def promote(db, ref: str, tag: str) -> Promotion:
    """Make a done run the tag's current run: ``tag:NAME`` then resolves to it, until the next
    promotion to that tag. Each promotion appends a ``tags`` row, so promoting an older run again
    moves the tag back (a rollback) and ``evalkit tags`` shows the history.

    Raises BadInput for a bad tag name or an unknown or unfinished run, before anything is written.
    """
    from evalkit.labels import check_tag_name

    check_tag_name(tag)
    if not db_path(db).is_file():
        raise BadInput(f"no evalkit database at {db_path(db)} (store a run with `evalkit run`, or pass --db)")
    with transaction(db) as con:
        run_id = _done_run(con, ref, "promoted")
        previous = add_tag(con, tag, run_id)
    return Promotion(run_id, previous != run_id, previous)
