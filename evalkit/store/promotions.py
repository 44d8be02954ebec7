"""Promotions and gate decisions in the DB: the `tags` history and the `gates` record.

Owns: appending a promotion (`add_tag`: one `tags` row each time a run becomes a tag's
current run, its time strictly after the tag's previous row, so the newest row is always the
current one), reading a tag's history (`tag_history`), writing one gate decision with its
checks (`record_gate`, into `gates` and `gate_checks`, on a DB already at this evalkit's
schema: it never migrates) and reading the recent ones (`recent_gates`). Does not: decide
(`release.decide`), resolve `tag:NAME` (`queries.resolve_run` reads the same rule: the
newest row), check that a run may be promoted (`release.db`), or print.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb

from evalkit.errors import BadInput
from evalkit.store.db import in_transaction, now, open_reader, open_writer

TICK = dt.timedelta(microseconds=1)  # the least step of a TIMESTAMP: a later promotion is never a tie

GATE_COLUMNS = ("id", "created_at", "candidate", "baseline", "baseline_ref", "rules_name", "rules_digest", "verdict",
                "n_pass", "n_fail", "n_inconclusive", "n_skipped", "holm_family", "evalkit_version")
CHECK_COLUMNS = ("gate_id", "position", "kind", "task", "metric", "status", "observed", "baseline_value", "bound",
                 "margin", "drop", "ci_lo", "ci_hi", "n", "method", "p_fail", "decide_n", "reason")


def current_run(con: duckdb.DuckDBPyConnection, tag: str) -> str | None:
    """The run the tag names now: that of its newest row (None: no run has the tag)."""
    row = con.execute("SELECT arg_max(run_id, created_at) FROM tags WHERE tag = ?", [tag]).fetchall()
    return row[0][0] if row else None


def add_tag(con: duckdb.DuckDBPyConnection, tag: str, run_id: str) -> str | None:
    """Make `run_id` the tag's current run by appending a row; returns the run it named before.

    Nothing is written when the run is already the tag's current one (BadInput is not raised:
    the caller says so). The row's time is now, or a microsecond after the tag's newest row when
    the clock reads earlier (two promotions in one microsecond, a clock set back), so the newest
    row is always the newest promotion. Run inside the caller's transaction."""
    before = current_run(con, tag)
    if before == run_id:
        return before
    last = con.execute("SELECT max(created_at) FROM tags WHERE tag = ?", [tag]).fetchall()[0][0]
    at = now() if last is None else max(now(), last + TICK)
    con.execute("INSERT INTO tags (tag, run_id, created_at) VALUES (?, ?, ?)", [tag, run_id, at])
    return before


def tag_history(con: duckdb.DuckDBPyConnection, tag: str | None = None) -> list[dict[str, Any]]:
    """Every promotion, per tag oldest first: tag, promoted_at, run_id, the run's name, model,
    quant and status, `current` (the row `tag:NAME` resolves to) and `dangling` (its run is gone
    from the DB, deleted by another client). BadInput for a tag no row has."""
    rows = con.execute(
        """
        SELECT t.tag, t.created_at AS promoted_at, t.run_id, r.name, coalesce(r.model_name, r.model) AS model, r.quant,
               t.created_at = max(t.created_at) OVER (PARTITION BY t.tag) AS current, r.id IS NULL AS dangling
        FROM tags t LEFT JOIN runs r ON r.id = t.run_id
        WHERE ? IS NULL OR t.tag = ?
        ORDER BY t.tag, t.created_at
        """,
        [tag, tag],
    )
    cols = [d[0] for d in rows.description]
    out = [dict(zip(cols, r)) for r in rows.fetchall()]
    if tag is not None and not out:
        known = [r[0] for r in con.execute("SELECT DISTINCT tag FROM tags ORDER BY tag").fetchall()]
        raise BadInput(f"no run has the tag {tag!r}" + (f" (tags: {', '.join(known)})" if known else " (no tags yet)"))
    return out


def read_tag_history(path: str | os.PathLike | None, tag: str | None = None) -> list[dict[str, Any]]:
    """`tag_history` on a read-only connection to the DB at `path`."""
    with open_reader(path) as con:
        return tag_history(con, tag)


@dataclass(frozen=True)
class GateRecord:
    """One gate decision as it is stored: the `gates` row (GATE_COLUMNS) and its checks'
    rows (CHECK_COLUMNS without `gate_id`, in verdict order; `position` is their index)."""

    gate: dict[str, Any]
    checks: Sequence[dict[str, Any]] = field(default_factory=tuple)


def record_gate(path: str | os.PathLike | None, record: GateRecord) -> str:
    """Store one gate decision in one transaction; return its id.

    Opens the DB for writing without upgrading it (`open_writer(upgrade=False)`): a DB of an
    older schema is refused with the line naming `evalkit migrate`, and nothing is written."""
    gate = {c: record.gate.get(c) for c in GATE_COLUMNS}
    with open_writer(path, upgrade=False) as con, in_transaction(con):
        con.execute(f"INSERT INTO gates ({', '.join(GATE_COLUMNS)}) VALUES ({', '.join('?' * len(GATE_COLUMNS))})",
                    [gate[c] for c in GATE_COLUMNS])
        rows = [[gate["id"], i, *(check.get(c) for c in CHECK_COLUMNS[2:])] for i, check in enumerate(record.checks)]
        if rows:
            con.executemany(f"INSERT INTO gate_checks ({', '.join(CHECK_COLUMNS)}) "
                            f"VALUES ({', '.join('?' * len(CHECK_COLUMNS))})", rows)
    return str(gate["id"])


def recent_gates(con: duckdb.DuckDBPyConnection, limit: int = 20) -> list[dict[str, Any]]:
    """The newest `limit` gate decisions, newest first (the `gates` columns)."""
    cur = con.execute(f"SELECT {', '.join(GATE_COLUMNS)} FROM gates ORDER BY created_at DESC, id DESC LIMIT ?",
                      [limit])
    return [dict(zip(GATE_COLUMNS, r)) for r in cur.fetchall()]
