"""Drift between two stored runs (docs/metrics.md §1.5): how the first-token distribution moved, and
how every per-sample metric changed, over the prompts both runs share.

Owns: `compare_runs(db, run_a, run_b) -> Comparison` and `compare_many(db, baseline,
candidates) -> MultiComparison` (a quantization sweep: each candidate against the same
baseline, one Comparison each, with every run's quant and what it applied) — the SQL that pairs two runs'
samples and top-k rows on (task, doc_id), and the per-task and overall summaries:
`top5_mass` of each run, mean `top5_overlap`, mean `js_div` (base 2, union of both
top-k supports plus one rest bucket, `stats.jsd`), `flip_rate` (share of shared prompts
whose rank-0 token differs), and for every numeric per-sample metric both runs have,
the paired delta B − A with a bootstrap 95 % CI (`stats.paired_bootstrap`).

Does not: format output or pick exit codes (`cli/compare.py`), or judge a regression
(`gate.py`). Prompts are paired by task and doc id only: comparing two templates pairs
the same question asked in two frames, which is the point.

Tokenizers (docs/metrics.md §1.5, `pair_topk`): runs on one tokenizer (`scoring.textspace.
tokenizer_relation`) compare top-k rows by token id, exactly as evalkit always has; runs on two
tokenizers compare on the first-character event space (`scoring.textspace`). Lists of different
K are cut to the shorter K first; a run with no top-k makes the distribution part missing, and
the note names the run.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass, field

from evalkit.errors import BadInput
from evalkit.kinds import EventSpace
from evalkit.scoring import stats, textspace
from evalkit.scoring.selection import NOT_COMPUTED
from evalkit.store.db import open_reader
from evalkit.store.queries import not_computed, resolve_run
from evalkit.store.rows import SAMPLE_METRIC_COLUMNS

ALL_TASKS = "all"  # the `task` of the overall rows
# the runs columns that make a run dimension (what a comparison is usually across)
DIMENSIONS = ("model", "model_fingerprint", "tokenizer_hash", "engine", "quant", "kv_cache", "template", "fed",
              "first_temperature", "ban_openers")
TOP_N = 5  # top5_mass / top5_overlap
N_BOOT = 2000
SEED = 0


@dataclass(frozen=True)
class DriftRow:
    """Distribution drift over the shared prompts of one task (or all tasks)."""

    task: str
    n: int  # shared prompts with top-k rows in both runs
    top5_mass_a: float  # mean over prompts of the top-5 first-token mass of run A
    top5_mass_b: float
    top5_overlap: float  # mean |top5_A ∩ top5_B| / 5
    js_div: float  # mean JSD₂(p_A ‖ p_B) over the stored top-k plus a rest bucket
    flip_rate: float  # share of prompts whose rank-0 token (first-character event) differs
    space: EventSpace = "token_id"  # what the distributions are over (docs/metrics.md §1.5)
    k: int | None = None  # the K both top-k lists were cut to; None: not cut (same K)
    # across tokenizers: the mean of each prompt's bounds on the JSD of the whole distributions
    # (`textspace.js_bounds`, `textspace.js_max`); on "first_char_full" the largest mass a run's
    # tolerance left unresolved on one prompt
    js_lo: float | None = None
    js_hi: float | None = None
    unresolved: float | None = None


@dataclass(frozen=True)
class MetricDelta:
    """One metric's paired change B − A over the shared prompts where both have a value."""

    task: str
    metric: str
    n: int
    mean_a: float
    mean_b: float
    delta: float  # mean_b − mean_a
    lo: float | None  # 95 % paired bootstrap CI of delta; None from fewer than MIN_BOOTSTRAP_PROMPTS pairs
    hi: float | None


@dataclass(frozen=True)
class Comparison:
    run_a: str
    run_b: str
    n_shared: int  # prompts (task, doc_id) in both runs' samples
    drift: list[DriftRow] = field(default_factory=list)  # per task, then ALL_TASKS; [] when omitted
    drift_note: str | None = None  # why the distribution part is missing or partial
    deltas: list[MetricDelta] = field(default_factory=list)  # per task, then ALL_TASKS
    dimensions: dict[str, tuple] = field(default_factory=dict)  # run dimension -> (A's, B's), where they differ
    # drift by position of B against A (`drift_summary` rows, per task and bucket; docs/drift.md): [] when
    # B did not teacher-force A's responses
    by_position: list[dict] = field(default_factory=list)
    tokenizers: str | None = None  # how the runs' tokenizers were found the same or different
    # per-sample metric -> why a run did not compute it, where one run has it and the other does not (or
    # neither), read off the runs' `unavailable` (`evalkit run --metrics`, the engine): no delta, said plainly
    not_computed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RunInfo:
    """What a reader needs to tell the compared runs apart: name, quant and what it applied."""

    run_id: str
    name: str | None
    model: str | None
    quant: str | None
    quant_detail: dict | None  # runs.quant_detail, parsed (None: not recorded)
    tokenizer_hash: str | None = None  # runs.tokenizer_hash (None: stored before tokenizer identities)
    tokenizer_source: str | None = None
    # (task, reason) of each task flagged as degenerate output (`scoring.degenerate`): its deltas rank nothing
    degenerate: tuple[tuple[str, str], ...] = ()

    @property
    def quant_summary(self) -> str:
        return quant_summary(self.quant, self.quant_detail)


@dataclass(frozen=True)
class MultiComparison:
    """A baseline against several candidates: one Comparison per candidate (A = the baseline)."""

    baseline: str
    runs: dict[str, RunInfo]  # every run compared, by id
    comparisons: list[Comparison]


def compare_runs(db: str | os.PathLike | None, run_a: str, run_b: str) -> Comparison:
    """Compare run B against run A (each an id, unique prefix, `latest` or `tag:NAME`).

    Raises BadInput when a run is unknown or the two share no prompts.
    """
    return compare_many(db, run_a, [run_b]).comparisons[0]


def compare_many(db: str | os.PathLike | None, baseline: str, candidates: list[str]) -> MultiComparison:
    """Compare each candidate against the baseline, each pair over the prompts the two share.

    Raises BadInput when a run is unknown, named twice, or shares no prompts with the baseline.
    """
    if not candidates:
        raise BadInput("compare needs a baseline and at least one candidate run")
    with open_reader(db) as con:
        base = resolve_run(con, baseline)
        ids = [resolve_run(con, c) for c in candidates]
        seen = {base}
        for ref, run_id in zip(candidates, ids):
            if run_id in seen and len(candidates) > 1:
                raise BadInput(f"compare names run {run_id} twice ({ref!r}); give each run once")
            seen.add(run_id)
        metric_cols = list(SAMPLE_METRIC_COLUMNS)  # registry order
        pairs = []
        by_position: dict[str, list[dict]] = {}
        for b in ids:
            keys, values = _paired_samples(con, base, b, metric_cols)
            if not keys:
                raise BadInput(f"runs {base} and {b} share no prompts (same task and doc_id); nothing to compare")
            pairs.append((b, keys, values, pair_topk(con, base, b), _dimensions(con, base, b),
                          _missing(base, not_computed(con, base), b, not_computed(con, b), values)))
            by_position[b] = _by_position(con, base, b)
        info = run_info(con, [base, *ids])

    comparisons = []
    for b, keys, values, pairing, dims, missing in pairs:
        drift, note = drift_rows(keys, pairing)
        comparisons.append(Comparison(base, b, len(keys), drift, note, metric_deltas(keys, values, metric_cols),
                                      dims, by_position[b], pairing.relation.why, missing))
    return MultiComparison(base, info, comparisons)


def _missing(a: str, why_a: dict[str, str], b: str, why_b: dict[str, str],
             values: dict[str, list[tuple]]) -> dict[str, str]:
    """{metric: "run X did not compute it (why)"} for the per-sample metrics a run did not compute whose
    delta is therefore missing (no prompt has a value in both runs)."""
    out = {}
    for metric, pairs in values.items():
        if any(_finite(va) and _finite(vb) for va, vb in pairs):
            continue
        said = [f"run {rid} did not compute it ({why.removeprefix(NOT_COMPUTED + ': ')})"
                for rid, whys in ((a, why_a), (b, why_b)) if (why := whys.get(metric))]
        if said:
            out[metric] = "; ".join(said)
    return out


def run_info(con, ids: list[str]) -> dict[str, RunInfo]:
    import json

    rows = con.execute("SELECT id, name, coalesce(model_name, model), quant, quant_detail, tokenizer_hash, "
                       "tokenizer_source FROM runs WHERE id IN (SELECT unnest(?))", [ids]).fetchall()
    from evalkit.store.queries import degenerate_flags

    out = {}
    for run_id, name, model, quant, detail, tok_hash, tok_source in rows:
        try:
            parsed = json.loads(detail) if detail else None
        except ValueError:
            parsed = None
        flags = tuple((f["task"], f["reason"]) for f in degenerate_flags(con, run_id))
        out[run_id] = RunInfo(run_id, name, model, quant, parsed if isinstance(parsed, dict) else None,
                              tok_hash, tok_source, flags)
    return out


def quant_summary(quant: str | None, detail: dict | None) -> str:
    """One line of what a run's `--quant` applied, from its quant_detail.

    >>> quant_summary("int4-weight", {"library": "torchao", "version": "0.18.0", "bits": 4, "group_size": 32,
    ...                                "compute_dtype": "float32", "n_quantized": 210})
    'int4-weight: torchao 0.18.0, 4-bit, group 32, 210 modules quantized, float32 compute'
    """
    if not detail:
        return quant or "-"
    parts = []
    if detail.get("library"):
        parts.append(f"{detail['library']} {detail.get('version') or ''}".strip())
    if detail.get("bits"):
        parts.append(f"{detail['bits']}-bit")
    if detail.get("group_size"):
        parts.append(f"group {detail['group_size']}")
    elif detail.get("granularity"):
        parts.append(str(detail["granularity"]).split(";")[0])
    if detail.get("n_quantized"):
        parts.append(f"{detail['n_quantized']} modules quantized")
    if detail.get("compute_dtype"):
        parts.append(f"{detail['compute_dtype']} compute")
    return f"{quant or 'as loaded'}: {', '.join(parts)}"


def _dimensions(con, a: str, b: str) -> dict[str, tuple]:
    """The run dimensions (model, quant, kv_cache, template, ...) in which the two runs differ. The model is
    its name as `runs` shows it (the GGUF's or config's, e.g. gemma-3-270M), not the engine it was asked by."""
    cols = ", ".join("model := coalesce(model_name, model)" if d == "model" else d for d in DIMENSIONS)
    rows = dict(con.execute(f"SELECT id, struct_pack({cols}) FROM runs WHERE id IN (?, ?)", [a, b]).fetchall())
    da, db_ = rows.get(a) or {}, rows.get(b) or {}
    return {d: (da.get(d), db_.get(d)) for d in DIMENSIONS if da.get(d) != db_.get(d)}


# --- SQL ---------------------------------------------------------------------


def _by_position(con, a: str, b: str) -> list[dict]:
    """B's stored drift by position against A (`store.drift.pair_summary`); [] on a DB from before m019."""
    from evalkit.store.drift import pair_summary

    has = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'drift_summary' AND "
                      "database_name = current_database()").fetchone()[0]
    if not has:
        return []
    rows = pair_summary(con, a, b)
    ratios = {task: (v, lo, hi) for task, v, lo, hi in con.execute(
        "SELECT task, value, ci_lo, ci_hi FROM metrics WHERE run_id = ? AND metric = 'drift_first_ratio'",
        [b]).fetchall()}
    for r in rows:
        r["drift_first_ratio"], r["ratio_lo"], r["ratio_hi"] = ratios.get(r["task"], (None, None, None))
    return rows


def _paired_samples(con, a: str, b: str, cols: list[str]):
    """Shared (task, doc_id) keys, sorted, and {metric: [(value_a, value_b)] per key}.

    A prompt stored more than once in a run (should not happen) counts with its mean.
    """
    per_run = ", ".join(f"avg(CAST({c} AS DOUBLE)) AS {c}" for c in cols)
    pairs = ", ".join(f"a.{c}, b.{c}" for c in cols)
    sql = f"""
        WITH s AS (
            SELECT run_id, task, doc_id{', ' + per_run if cols else ''}
            FROM samples WHERE run_id IN (?, ?)
            GROUP BY run_id, task, doc_id
        )
        SELECT a.task, a.doc_id{', ' + pairs if cols else ''}
        FROM s a JOIN s b ON a.task = b.task AND a.doc_id = b.doc_id
        WHERE a.run_id = ? AND b.run_id = ?
        ORDER BY a.task, a.doc_id
    """
    rows = con.execute(sql, [a, b, a, b]).fetchall()
    keys = [(r[0], r[1]) for r in rows]
    values = {c: [(r[2 + 2 * i], r[3 + 2 * i]) for r in rows] for i, c in enumerate(cols)}
    return keys, values


# one prompt's stored top-k, rank order: (token ids, logprobs, token texts, first units)
TopK = tuple[list[int], list[float], list[str | None], list[str | None]]


def paired_topk(con, a: str, b: str) -> tuple[dict[tuple[str, str], TopK], dict[tuple[str, str], TopK]]:
    """Each run's stored top-k per shared prompt: {(task, doc_id): TopK}, rank order.

    One query for both runs, restricted to the prompts both runs' samples hold.
    """
    rows = con.execute(
        """
        WITH shared AS (
            SELECT task, doc_id FROM samples WHERE run_id = ?
            INTERSECT
            SELECT task, doc_id FROM samples WHERE run_id = ?
        )
        SELECT t.run_id, t.task, t.doc_id,
               list(t.token_id ORDER BY t.rank) AS ids, list(t.logprob ORDER BY t.rank) AS lps,
               list(t.token ORDER BY t.rank) AS texts, list(t.unit ORDER BY t.rank) AS units
        FROM first_token_topk t JOIN shared s ON t.task = s.task AND t.doc_id = s.doc_id
        WHERE t.run_id IN (?, ?)
        GROUP BY t.run_id, t.task, t.doc_id
        """,
        [a, b, a, b],
    ).fetchall()
    out: dict[str, dict[tuple[str, str], TopK]] = {a: {}, b: {}}
    for run_id, task, doc_id, ids, lps, texts, units in rows:
        out[run_id][(task, doc_id)] = (ids, lps, texts, units)
    if a == b:
        return out[a], out[a]
    return out[a], out[b]


@dataclass(frozen=True)
class Pairing:
    """Two runs' first-token distributions paired prompt by prompt, on the event space their
    tokenizers allow (docs/metrics.md §1.5)."""

    run_a: str
    run_b: str
    relation: textspace.Relation  # same tokenizer or not, and how that was decided
    space: EventSpace  # "token_id" (one tokenizer), "first_char_full" or "first_char" (two: `pair_topk`)
    k: int | None  # the K both lists were cut to; None: the runs' K agree (or one is unknown)
    missing: tuple[str, ...]  # the runs with no top-k on the shared prompts
    prompts: dict[tuple[str, str], dict[str, float]]  # (task, doc_id) -> prompt_drift's values
    n_shared: int = 0  # shared prompts (before looking for top-k)


def pair_topk(con, a: str, b: str) -> Pairing:
    """Run B's first-token distributions against run A's on every shared prompt with top-k in both.

    Same tokenizer (`textspace.tokenizer_relation`): `prompt_drift` by token id, today's numbers;
    different tokenizers, both runs with a stored first-character distribution (first_char_topk, m030):
    `textspace.prompt_drift_chars` on it ("first_char_full"), over the prompts both hold; otherwise (a run
    stored before it) `textspace.prompt_drift_text` on the first-character events of the stored top-k
    ("first_char"). On the top-k, both lists are first cut to the shorter of the runs' K (`runs.top_k`,
    or the longest list stored) when the two differ.
    """
    topk_a, topk_b = paired_topk(con, a, b)
    facts = dict((r[0], r[1:]) for r in con.execute(
        "SELECT id, tokenizer_hash, model_fingerprint, top_k, tokenizer_source FROM runs WHERE id IN (?, ?)",
        [a, b]).fetchall())
    n_shared = con.execute("SELECT count(*) FROM (SELECT task, doc_id FROM samples WHERE run_id = ? INTERSECT "
                           "SELECT task, doc_id FROM samples WHERE run_id = ?)", [a, b]).fetchone()[0]
    sides = {a: topk_a, b: topk_b}
    none = (None,) * 4
    tok = {r: textspace.RunTokenizer(r, facts.get(r, none)[0], facts.get(r, none)[1], _texts(sides[r]),
                                     facts.get(r, none)[3]) for r in (a, b)}
    relation = textspace.tokenizer_relation(tok[a], tok[b]) if a != b else textspace.Relation(True, "one run")
    missing = tuple(r for r in dict.fromkeys((a, b)) if not sides[r])
    k = textspace.cut(*(_stored_k(facts.get(r, none)[2], sides[r]) for r in (a, b)))
    space: EventSpace = "token_id" if relation.same else "first_char"
    prompts: dict[tuple[str, str], dict[str, float]] = {}
    chars = paired_chars(con, a, b) if not relation.same else ({}, {})
    if chars[0] and chars[1]:
        for key in chars[0].keys() & chars[1].keys():
            prompts[key] = textspace.prompt_drift_chars(chars[0][key], chars[1][key])
        return Pairing(a, b, relation, "first_char_full", None, (), prompts, n_shared)
    if not missing:
        for key in topk_a.keys() & topk_b.keys():
            ta, tb = _cut(topk_a[key], k), _cut(topk_b[key], k)
            if not ta[0] or not tb[0]:
                continue
            prompts[key] = (prompt_drift((ta[0], ta[1]), (tb[0], tb[1])) if relation.same
                            else textspace.prompt_drift_text(_tokens(ta), _tokens(tb)))
    return Pairing(a, b, relation, space, k, missing, prompts, n_shared)


def paired_chars(con, a: str, b: str) -> tuple[dict[tuple[str, str], textspace.FirstChars],
                                              dict[tuple[str, str], textspace.FirstChars]]:
    """Each run's stored first-character distribution per shared prompt ({} for a run with none, or a DB
    from before m030): first_char_topk in rank order, with the samples row's rest and unresolved mass."""
    has = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'first_char_topk' AND "
                      "database_name = current_database()").fetchone()[0]
    if not has:
        return {}, {}
    rows = con.execute(
        """
        WITH shared AS (
            SELECT task, doc_id FROM samples WHERE run_id = ?
            INTERSECT
            SELECT task, doc_id FROM samples WHERE run_id = ?
        ), ev AS (
            SELECT c.run_id, c.task, c.doc_id, list(c.event ORDER BY c.rank) AS events,
                   list(c.prob ORDER BY c.rank) AS probs
            FROM first_char_topk c JOIN shared s ON c.task = s.task AND c.doc_id = s.doc_id
            WHERE c.run_id IN (?, ?)
            GROUP BY c.run_id, c.task, c.doc_id
        )
        SELECT ev.run_id, ev.task, ev.doc_id, ev.events, ev.probs,
               any_value(s.fc_rest_mass), any_value(s.fc_unresolved_mass)
        FROM ev LEFT JOIN samples s ON s.run_id = ev.run_id AND s.task = ev.task AND s.doc_id = ev.doc_id
        GROUP BY ALL
        """,
        [a, b, a, b],
    ).fetchall()
    out: dict[str, dict[tuple[str, str], textspace.FirstChars]] = {a: {}, b: {}}
    for run_id, task, doc_id, events, probs, rest, unresolved in rows:
        out[run_id][(task, doc_id)] = textspace.FirstChars(list(zip(events, probs)), rest or 0.0, unresolved or 0.0)
    return out[a], out[b]


def _texts(topk: dict[tuple[str, str], TopK]) -> dict[int, frozenset[str]]:
    """token id -> the texts a run's stored top-k rows give it."""
    found: dict[int, set[str]] = {}
    for ids, _, texts, _ in topk.values():
        for t, text in zip(ids, texts):
            if text is not None:
                found.setdefault(int(t), set()).add(text)
    return {t: frozenset(v) for t, v in found.items()}


def _stored_k(top_k: int | None, topk: dict[tuple[str, str], TopK]) -> int | None:
    """A run's K: runs.top_k, else the longest list it stored (None: it stored none)."""
    if top_k is not None:
        return int(top_k)
    return max((len(v[0]) for v in topk.values()), default=None)


def _cut(top: TopK, k: int | None) -> TopK:
    if k is None:
        return top
    return top[0][:k], top[1][:k], top[2][:k], top[3][:k]


def _tokens(top: TopK) -> list[textspace.TopToken]:
    return [textspace.TopToken(text, unit, lp) for text, unit, lp in zip(top[2], top[3], top[1])]


# --- pure summaries -----------------------------------------------------------


def prompt_drift(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> dict[str, float]:
    """Drift of one prompt between two stored top-k lists (token ids, logprobs; rank order).

    >>> d = prompt_drift(([1, 2], [math.log(0.5), math.log(0.5)]), ([2, 1], [math.log(0.5), math.log(0.5)]))
    >>> (round(d["top5_mass_a"], 6), d["top5_overlap"], d["js_div"], d["flipped"])
    (1.0, 0.4, 0.0, 1.0)
    """
    ids_a, lps_a = a
    ids_b, lps_b = b
    p = {int(t): math.exp(lp) for t, lp in zip(ids_a, lps_a)}
    q = {int(t): math.exp(lp) for t, lp in zip(ids_b, lps_b)}
    return {
        "top5_mass_a": sum(math.exp(lp) for lp in lps_a[:TOP_N]),
        "top5_mass_b": sum(math.exp(lp) for lp in lps_b[:TOP_N]),
        "top5_overlap": stats.top_overlap(ids_a, ids_b, TOP_N),
        "js_div": stats.jsd(p, q),
        "flipped": 1.0 if ids_a[0] != ids_b[0] else 0.0,
    }


def missing_note(missing: tuple[str, ...], labels: dict[str, str] | None = None) -> str:
    """The line a comparison shows for runs without a top-k: "metric missing", naming each run."""
    named = " and ".join(f"{(labels or {}).get(r, 'run')} {r}".strip() for r in missing)
    return (f"distribution drift omitted (metric missing): {named} stored no first-token top-k for the shared "
            "prompts (a text-only backend?); metric deltas only")


def drift_rows(keys, pairing: Pairing) -> tuple[list[DriftRow], str | None]:
    """Per-task and overall drift over `keys` (shared (task, doc_id)); (rows, note).

    Rows are [] with a note when either run has no top-k rows for the shared prompts
    (a text-only backend); the note also says when only some shared prompts have them,
    when the lists were cut to a shorter K, and when the runs' tokenizers differ.
    """
    if pairing.missing:
        labels = {pairing.run_a: "run A", pairing.run_b: "run B"}
        return [], missing_note(pairing.missing, labels)
    by_task: dict[str, list[dict[str, float]]] = defaultdict(list)
    for key in keys:
        if key in pairing.prompts:
            by_task[key[0]].append(pairing.prompts[key])
    n = sum(len(v) for v in by_task.values())
    if n == 0:
        return [], "distribution drift omitted: no shared prompt has first-token top-k in both runs"
    notes = []
    if n < len(keys):
        notes.append(f"distribution drift over the {n} of {len(keys)} shared prompts with top-k in both runs")
    if pairing.k is not None:
        notes.append(f"top-k lists cut to the shorter K = {pairing.k} before comparing")
    if pairing.space == "first_char_full":
        notes.append(f"{pairing.relation.why}: top5_overlap, js_div and flip_rate compare the first character of "
                     "the response from each run's whole next-token distribution (first_char_topk; docs/metrics.md, "
                     "'Across tokenizers'); js_lo..js_hi bound js_div of the whole distributions")
    elif not pairing.relation.same:
        notes.append(f"{pairing.relation.why}: top5_overlap, js_div and flip_rate compare the first non-whitespace "
                     "character each stored top-k token adds (docs/metrics.md, 'Across tokenizers'), not token ids: "
                     "a run without first_char_topk; js_lo..js_hi bound js_div of the whole distributions, the "
                     "mass the stored top-k leaves undecided (past K, whitespace-only, byte fragments) anywhere")
    rows = [_drift_row(task, by_task[task], pairing) for task in sorted(by_task)]
    rows.append(_drift_row(ALL_TASKS, [d for task in sorted(by_task) for d in by_task[task]], pairing))
    return rows, "; ".join(notes) or None


def _drift_row(task: str, prompts: list[dict[str, float]], pairing: Pairing) -> DriftRow:
    mean = lambda k: sum(p[k] for p in prompts) / len(prompts)  # noqa: E731
    full = pairing.space == "first_char_full"
    chars = pairing.space != "token_id"
    return DriftRow(task, len(prompts), mean("top5_mass_a"), mean("top5_mass_b"),
                    mean("top5_overlap"), mean("js_div"), mean("flipped"), pairing.space, pairing.k,
                    js_lo=mean("js_lo") if chars else None, js_hi=mean("js_hi") if chars else None,
                    unresolved=max(max(p["unresolved_a"], p["unresolved_b"]) for p in prompts) if full else None)


def metric_deltas(keys, values: dict[str, list[tuple]], metrics: list[str]) -> list[MetricDelta]:
    """Paired B − A per task and overall for every metric with a value in both runs."""
    tasks = sorted({task for task, _ in keys})
    out = []
    for scope in tasks + [ALL_TASKS]:
        for metric in metrics:
            pairs = [
                (va, vb)
                for (task, _), (va, vb) in zip(keys, values[metric])
                if (scope == ALL_TASKS or task == scope) and _finite(va) and _finite(vb)
            ]
            if not pairs:
                continue
            a_vals = [va for va, _ in pairs]
            b_vals = [vb for _, vb in pairs]
            d = stats.paired_bootstrap(b_vals, a_vals, n_boot=N_BOOT, seed=SEED)
            few = d.n < stats.min_prompts(binary=False)  # no interval from too few prompts, as the gate
            out.append(MetricDelta(scope, metric, d.n, mean_a=d.mean_b, mean_b=d.mean_a,
                                   delta=d.delta, lo=None if few else d.lo, hi=None if few else d.hi))
    return out


def _finite(v) -> bool:
    return v is not None and math.isfinite(v)
