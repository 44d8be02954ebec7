"""The rows of drift by position (docs/drift.md): `response_tokens`, `drift_base`, `drift`, `drift_summary`.

Owns: writing a base run's greedy tokens and (with `--keep-distributions`) its compact
distributions; reading them back as a base for a later run; writing a candidate's per-position
rows and its llama.cpp summaries per task × position bucket; reading one pair's summaries
(`evalkit compare`, the report). Does not: compute anything (`scoring.drift`) or run a model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from evalkit.errors import BadInput
from evalkit.scoring import drift

Key = tuple[str, str]  # (task, doc_id)


@dataclass
class BaseItem:
    """One prompt of a base run: its context text, its greedy tokens and their compact distributions."""

    context: str
    token_ids: list[int]
    dists: list[drift.Compact]


def _insert(con, table: str, columns: dict[str, object], rows: Sequence[dict]) -> None:
    """Insert `rows` into `table` through one Arrow table with explicit column types (lists included)."""
    if not rows:
        return
    import pyarrow as pa

    data = pa.table({c: pa.array([r[c] for r in rows], type=t) for c, t in columns.items()})
    con.register("_drift_rows", data)
    try:
        con.execute(f"INSERT INTO {table} ({', '.join(columns)}) SELECT {', '.join(columns)} FROM _drift_rows")
    finally:
        con.unregister("_drift_rows")


def write_base(con, run_id: str, items: Mapping[Key, BaseItem], *, keep: bool, eps: float) -> int:
    """Store a base run's greedy tokens, and with `keep` its compact distributions; returns the bytes
    of the distribution values written (4 per token id, 4 per log-prob, 8 per tail)."""
    import pyarrow as pa

    tokens = [{"run_id": run_id, "task": t, "doc_id": d, "token_ids": list(map(int, it.token_ids))}
              for (t, d), it in sorted(items.items())]
    _insert(con, "response_tokens", {"run_id": pa.string(), "task": pa.string(), "doc_id": pa.string(),
                                     "token_ids": pa.list_(pa.int32())}, tokens)
    if not keep:
        return 0
    rows = []
    nbytes = 0
    for (t, d), it in sorted(items.items()):
        for pos, c in enumerate(it.dists):
            rows.append({"run_id": run_id, "task": t, "doc_id": d, "position": pos, "token_ids": c.ids.tolist(),
                         "logprobs": c.logprobs.tolist(), "tail": c.tail, "eps": eps})
            nbytes += c.nbytes()
    _insert(con, "drift_base", {"run_id": pa.string(), "task": pa.string(), "doc_id": pa.string(),
                                "position": pa.int32(), "token_ids": pa.list_(pa.int32()),
                                "logprobs": pa.list_(pa.float32()), "tail": pa.float64(), "eps": pa.float64()},
            rows)
    return nbytes


def load_base(con, run_id: str) -> dict[Key, BaseItem]:
    """A stored base run's prompts, greedy tokens and kept distributions; BadInput when it kept none."""
    n = con.execute("SELECT count(*) FROM drift_base WHERE run_id = ?", [run_id]).fetchone()[0]
    if not n:
        raise BadInput(f"run {run_id} kept no distributions to compare with; run the base with "
                       "--keep-distributions (or use a sweep: --quant BASE,CANDIDATE --drift)")
    rows = con.execute(
        """
        SELECT s.task, s.doc_id, any_value(s.prompt), any_value(t.token_ids),
               list(b.token_ids ORDER BY b.position), list(b.logprobs ORDER BY b.position),
               list(b.tail ORDER BY b.position)
        FROM drift_base b
        JOIN response_tokens t ON t.run_id = b.run_id AND t.task = b.task AND t.doc_id = b.doc_id
        JOIN samples s ON s.run_id = b.run_id AND s.task = b.task AND s.doc_id = b.doc_id
        WHERE b.run_id = ?
        GROUP BY s.task, s.doc_id
        """, [run_id]).fetchall()
    out = {}
    for task, doc, prompt, tokens, ids, lps, tails in rows:
        dists = [drift.Compact(np.asarray(i, dtype=np.int32), np.asarray(lp, dtype=np.float32), float(tl))
                 for i, lp, tl in zip(ids, lps, tails)]
        out[(task, doc)] = BaseItem(prompt, list(tokens), dists)
    return out


def summary_rows(run_id: str, base_run_id: str, per_key: Mapping[Key, Sequence[drift.PositionDrift]]) -> list[dict]:
    """One `drift_summary` row per task × bucket (and `all`) of the candidate's positions."""
    by_task: dict[str, list[tuple[int, drift.PositionDrift]]] = {}
    for (task, _), rows in sorted(per_key.items()):
        by_task.setdefault(task, []).extend(enumerate(rows))
    out = []
    for task, pairs in by_task.items():
        if not pairs:
            continue
        sums = drift.by_bucket([p for p, _ in pairs], [r.kld for _, r in pairs], [r.dp for _, r in pairs],
                               [r.same_top for _, r in pairs], [r.bound for _, r in pairs])
        for label, s in sums.items():
            out.append({"run_id": run_id, "base_run_id": base_run_id, "task": task, "bucket": label, **s.to_row()})
    return out


def write_drift(con, run_id: str, base_run_id: str, per_key: Mapping[Key, Sequence[drift.PositionDrift]]) -> None:
    """Store a candidate's per-position rows and its summaries (one transaction: the caller's)."""
    import pyarrow as pa

    rows = [{"run_id": run_id, "base_run_id": base_run_id, "task": t, "doc_id": d, "position": p,
             "kld": r.kld, "same_top": bool(r.same_top), "dp": r.dp, "kld_bound": r.bound}
            for (t, d), rs in sorted(per_key.items()) for p, r in enumerate(rs)]
    _insert(con, "drift", {"run_id": pa.string(), "base_run_id": pa.string(), "task": pa.string(),
                           "doc_id": pa.string(), "position": pa.int32(), "kld": pa.float64(),
                           "same_top": pa.bool_(), "dp": pa.float64(), "kld_bound": pa.float64()}, rows)
    summaries = summary_rows(run_id, base_run_id, per_key)
    if summaries:
        cols = {c: (pa.string() if c in ("run_id", "base_run_id", "task", "bucket") else
                    pa.int32() if c == "n" else pa.float64()) for c in summaries[0]}
        _insert(con, "drift_summary", cols, summaries)


def pair_summary(con, base_run_id: str, run_id: str) -> list[dict]:
    """The stored summaries of `run_id` against `base_run_id`, per task and bucket ([] when none)."""
    cur = con.execute(
        "SELECT * FROM drift_summary WHERE base_run_id = ? AND run_id = ? ORDER BY task, "
        "list_position(['all', '0', '1', '2-3', '4-7', '8-15', '16+'], bucket)", [base_run_id, run_id])
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def positions(con, run_ids: Iterable[str]) -> list[dict]:
    """Per run, task and position: mean KLD, same-top share, prompts (the `drift_by_position` view)."""
    ids = list(run_ids)
    cur = con.execute("SELECT * FROM drift_by_position WHERE run_id IN (SELECT unnest(?)) "
                      "ORDER BY run_id, task, position", [ids])
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]
