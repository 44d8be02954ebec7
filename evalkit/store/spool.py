"""Finished runs that could not be written yet: kept in a file beside the DB, brought in later.

Owns: `keep` (a run's whole row and results as a small evalkit DuckDB file in the
spool folder `<db>.spool/`, or in the system's temporary folder when that cannot be
written, e.g. a full disk) and `ingest` (bring spooled runs into the DB: the run row
replaced, its results inserted, in one transaction, then the spool file removed).
Every writer brings pending spool files in when it opens the DB, and `evalkit ingest`
does it on demand. Does not: decide when a write has failed (the runner does).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import duckdb

from evalkit.errors import BadInput
from evalkit.store import runs
from evalkit.store.db import db_path, inspect_con, migrate, open_writer

SUFFIX = ".duckdb"


def spool_dir(db: Path) -> Path:
    """The spool folder of a DB file: `reports/evalkit.duckdb` -> `reports/evalkit.duckdb.spool`."""
    return Path(str(db) + ".spool")


def _fallback_dir(db: Path) -> Path:
    return Path(tempfile.gettempdir()) / "evalkit-spool" / Path(db).name


def keep(db: Path, row: dict[str, Any], *, metrics, samples, topk, lead=()) -> Path:
    """Write one finished run (its complete `runs` row and its results) to a spool file; return its path.

    Written under a temporary name and renamed when complete, so a reader never takes a
    half-written file for a spooled run. Raises OSError / duckdb.Error when neither the
    spool folder nor the temporary folder can hold it.
    """
    errors = []
    for folder in (spool_dir(db), _fallback_dir(db)):
        try:
            return _write(folder, row, metrics=metrics, samples=samples, topk=topk, lead=lead)
        except (OSError, duckdb.Error) as exc:
            errors.append(f"{folder}: {str(exc).splitlines()[0]}")
    raise OSError("cannot keep the run's results anywhere (" + "; ".join(errors) + ")")


def _write(folder: Path, row: dict[str, Any], *, metrics, samples, topk, lead=()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"{row['id']}{SUFFIX}"
    partial = folder / f".{row['id']}{SUFFIX}.partial"
    partial.unlink(missing_ok=True)
    con = duckdb.connect(str(partial))
    try:
        migrate(con)
        cols = [c for c in runs.RUN_COLUMNS if c in row]
        con.execute(f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                    [row[c] for c in cols])
        runs.insert_rows(con, "metrics", runs.METRIC_COLUMNS, metrics)
        runs.insert_rows(con, "samples", runs.SAMPLE_COLUMNS, samples)
        runs.insert_rows(con, "first_token_topk", runs.TOPK_COLUMNS, topk)
        runs.insert_rows(con, "lead_indicators", runs.LEAD_COLUMNS, list(lead))
        con.execute("CHECKPOINT")
    finally:
        con.close()
    Path(str(partial) + ".wal").unlink(missing_ok=True)
    os.replace(partial, final)
    return final


def pending_files(db: Path) -> list[Path]:
    """Spool files waiting to be brought into `db`, oldest first."""
    files = []
    for folder in (spool_dir(db), _fallback_dir(db)):
        if folder.is_dir():
            files += sorted(folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
    return files


def pending_ids(db: Path) -> set[str]:
    """Ids of the runs whose results wait in spool files (a reader shows them as `kept`)."""
    return {p.name[: -len(SUFFIX)] for p in pending_files(db)}


def _ingest_file(con: duckdb.DuckDBPyConnection, path: Path) -> str:
    """Bring one spool file into the open DB (one transaction); return the run id."""
    alias = "evalkit_spool"
    con.execute(f"ATTACH '{str(path).replace(chr(39), chr(39) * 2)}' AS {alias} (READ_ONLY)")
    try:
        state = inspect_con(con, alias)
        if state.kind != "evalkit" or state.pending or state.unknown:
            raise BadInput(f"{path} is not an evalkit spool file of this version")
        ids = [r[0] for r in con.execute(f"SELECT id FROM {alias}.main.runs").fetchall()]
        if len(ids) != 1:
            raise BadInput(f"{path} is not an evalkit spool file (it holds {len(ids)} runs, not 1)")
        run_id = ids[0]
        con.execute("BEGIN TRANSACTION")
        try:
            for table in ("runs", *runs.RESULT_TABLES):
                key = "id" if table == "runs" else "run_id"
                con.execute(f"DELETE FROM main.{table} WHERE {key} = ?", [run_id])
                cols = ", ".join(runs.RUN_COLUMNS if table == "runs" else runs.RESULT_TABLES[table])
                con.execute(f"INSERT INTO main.{table} ({cols}) SELECT {cols} FROM {alias}.main.{table}")
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    finally:
        con.execute(f"DETACH {alias}")
    return run_id


def ingest_pending(con: duckdb.DuckDBPyConnection, db: Path, files: Iterable[Path] | None = None) -> list[str]:
    """Bring spool files (default: all pending for `db`) into the open DB; remove each once it is in."""
    done = []
    for path in list(files) if files is not None else pending_files(db):
        done.append(_ingest_file(con, path))
        path.unlink(missing_ok=True)
    return done


def ingest(db, paths: Iterable[str | os.PathLike] = ()) -> list[str]:
    """`evalkit ingest [PATH ...]`: bring in the named spool files, or every pending one; return run ids."""
    files = [Path(p) for p in paths]
    for path in files:
        if not path.is_file():
            raise BadInput(f"no spool file at {path}")
    path = db_path(db)
    with open_writer(path, upkeep=False) as con:
        ids = ingest_pending(con, path, files or None)
        runs.mark_abandoned(con)
    return ids
