"""A run's life in the DB: recorded as it starts, restarted by a resume, updated, and finished in one
transaction; and the writer's upkeep every one of these does first.

Owns: `insert_run`, `restart_run`, `update_run`, `mark_interrupted`, `heartbeat`, `finish_run`,
and `open_writer` / `transaction` with upkeep: before a writer uses the DB, it brings in the
finished runs kept in the spool folder (`spool.ingest_pending`) and records as `abandoned` the runs
whose process is gone (`rows.mark_abandoned`). The connection layer below (`db`) only opens and
migrates. Does not: define the rows (`rows`) or write spool files (`spool`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import duckdb

from evalkit import redact
from evalkit.errors import BadInput
from evalkit.store import db, spool
from evalkit.store.db import db_path, now
from evalkit.store.rows import _check_columns, _update, mark_abandoned, scrub_row, this_process, write_results


@contextlib.contextmanager
def open_writer(path: str | os.PathLike | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
    """`db.open_writer`, after the writer's upkeep: finished runs kept in the spool folder are brought
    in, and runs whose process is gone are recorded as `abandoned`. Keep the block short."""
    with db.open_writer(path) as con:  # its errors, the upkeep's included, come out as db.open_writer's
        spool.ingest_pending(con, db_path(path))
        mark_abandoned(con)
        yield con


@contextlib.contextmanager
def transaction(path: str | os.PathLike | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
    """One short write transaction, after the writer's upkeep (`open_writer`); committed on success."""
    with open_writer(path) as con, db.in_transaction(con) as con:
        yield con


def insert_run(path, row: dict[str, Any]):
    """Record a run as it starts (status 'running'); return the DB's `spool.Identity`, which binds
    the run's results to this DB should they have to be kept in a spool file."""
    _check_columns(row)
    row = scrub_row(row)
    cols = list(row)
    with transaction(path) as con:
        con.execute(f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                    [row[c] for c in cols])
        return spool.bind_file(con, db_path(path))


RESUMABLE = ("interrupted", "abandoned", "failed")  # and `running` whose process is gone (abandoned)


def restart_run(path, run_id: str):
    """Record a stopped run as `running` again in this process (a resume); return the DB's
    `spool.Identity`. Raises BadInput when the run is no longer resumable — another process
    resumed it (or finished it) since it was checked — and changes nothing then."""
    with transaction(path) as con:  # upkeep first: a `running` run whose process is gone is `abandoned` now
        row = con.execute("SELECT status, pid, host FROM runs WHERE id = ?", [run_id]).fetchall()
        if not row:
            raise BadInput(f"run {run_id} is gone from the DB; nothing to resume")
        status, pid, host = row[0]
        if status == "running":
            raise BadInput(f"run {run_id} was resumed by another process (pid {pid} on {host}) a moment ago; "
                           "resume it once that one has stopped")
        if status not in RESUMABLE:
            raise BadInput(f"run {run_id} is {status} now: another process finished it; nothing to resume")
        _update(con, run_id, {"status": "running", "error": None, "finished_at": None, "duration_s": None,
                              **this_process()})
        return spool.bind_file(con, db_path(path))


def update_run(path, run_id: str, **fields: Any) -> None:
    """Set some columns of one run (e.g. status, finished_at, error)."""
    _check_columns(fields)
    with transaction(path) as con:
        _update(con, run_id, fields)


def mark_interrupted(path, run_id: str, error: str, duration_s: float) -> None:
    """Mark a run `interrupted`, unless it already finished."""
    with db.transaction(path) as con:
        con.execute(
            "UPDATE runs SET status = 'interrupted', error = ?, finished_at = ?, duration_s = ? "
            "WHERE id = ? AND status = 'running'",
            [redact.text(error), now(), duration_s, run_id],
        )


def heartbeat(path, run_id: str) -> None:
    """Refresh a running run's heartbeat (a short write; the caller ignores a busy DB)."""
    with db.transaction(path) as con:
        con.execute("UPDATE runs SET heartbeat_at = ? WHERE id = ? AND status = 'running'", [now(), run_id])


def finish_run(path, run_id: str, *, metrics, samples, topk, lead=(), attention=(), flags=(), first_char=(),
               **fields: Any) -> None:
    """Write a run's results and mark it finished, all in one transaction."""
    with transaction(path) as con:
        write_results(con, run_id, metrics=metrics, samples=samples, topk=topk, lead=lead, attention=attention,
                      flags=flags, first_char=first_char, **fields)
