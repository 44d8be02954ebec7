"""The DB side of the release gate: reading two runs into ``decide.RunData``, and promotion tags.

Owns: ``load_run_data`` (aggregates from ``metrics``, per-sample values from
``samples``), ``with_distances`` (per prompt, the candidate's first-token distance from the
baseline, from both runs' stored top-k), ``gate_runs`` (rules, run resolution, ``gate.decide`` and its
markdown / JUnit renderings, all from one read-only connection) and
``promote`` (the only write: one row in ``tags``).
Does not: decide pass or fail (``gate.decide`` does), print, write files, or
turn a verdict into an exit code (the CLI does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from evalkit.errors import BadInput
from evalkit.store.db import db_path, now, open_reader
from evalkit.store.queries import not_computed, resolve_run, shown_status
from evalkit.store.rows import SAMPLE_METRIC_COLUMNS
from evalkit.store.runs import transaction

if TYPE_CHECKING:  # evalkit.release.decide imports numpy and yaml: loaded when a gate runs
    from evalkit.release.decide import Verdict

_TAG_RE = re.compile(r"[\w.\-]+")


@dataclass(frozen=True)
class GateResult:
    verdict: Verdict
    candidate_id: str
    baseline_id: str
    markdown: str
    junit: str

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
                   not_computed=not_computed(con, run_id))


def with_distances(con, cand, base):
    """(candidate, baseline) with each shared prompt's first-token distance added to both runs' samples.

    A distance metric (the registry's ``DISTANCE_METRICS``: ``js_div``) is a property of the pair,
    not of one run. The gate checks it as a regression like any other: the candidate's value on a
    prompt is its distance from the baseline there (``compare.prompt_drift`` on both runs' stored
    top-k), the baseline's is its distance from itself, 0; the paired drop is then the mean
    distance, tested against an absolute margin. Prompts without top-k in either run get no value
    (a text-only engine's run: the rule is then ``skipped``, neither run having the metric).
    """
    from evalkit.compare import paired_topk, prompt_drift
    from evalkit.release.decide import RunData
    from evalkit.scoring.registry import DISTANCE_METRICS

    topk_c, topk_b = paired_topk(con, cand.run_id, base.run_id)
    dist: dict[tuple[str, str], dict[str, float]] = {}
    for key in topk_c.keys() & topk_b.keys():
        drift = prompt_drift(topk_b[key], topk_c[key])
        dist[key] = {m: drift[m] for m in DISTANCE_METRICS}

    def added(run, own: bool) -> RunData:
        samples = {key: {**values, **({m: 0.0 for m in dist[key]} if own else dist[key])} if key in dist else values
                   for key, values in run.samples.items()}
        return RunData(run_id=run.run_id, metrics=run.metrics, samples=samples, intervals=run.intervals,
                       not_computed=run.not_computed)

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
    check_names(rules, cand, base)
    verdict = decide(cand, base, rules)
    check_verdict(verdict, rules)
    return GateResult(
        verdict=verdict,
        candidate_id=cand_id,
        baseline_id=base_id,
        markdown=to_markdown(verdict, cand_id, base_id),
        junit=to_junit(verdict, cand_id, base_id),
    )


def promote(db, ref: str, tag: str) -> tuple[str, bool]:
    """Tag a done run (``tag:NAME`` then resolves to the newest run with that tag).

    Returns (run id, whether a new tag row was written; False when the run
    already had the tag). Raises BadInput for a bad tag name or an unknown or
    unfinished run, before anything is written.
    """
    if not _TAG_RE.fullmatch(tag or ""):
        raise BadInput(f"bad tag name {tag!r}: use letters, digits, '.', '_' or '-'")
    if not db_path(db).is_file():
        raise BadInput(f"no evalkit database at {db_path(db)} (store a run with `evalkit run`, or pass --db)")
    with transaction(db) as con:
        run_id = _done_run(con, ref, "promoted")
        exists = con.execute("SELECT count(*) FROM tags WHERE tag = ? AND run_id = ?", [tag, run_id]).fetchall()[0][0]
        if not exists:
            con.execute("INSERT INTO tags (tag, run_id, created_at) VALUES (?, ?, ?)", [tag, run_id, now()])
    return run_id, not exists
