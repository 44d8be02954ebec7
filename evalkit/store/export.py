"""Past one machine: every table of the DB as Parquet files, to carry between machines.

Owns: `export_parquet` (every table of one DB to DIR/<table>.parquet through DuckDB's
COPY, on a read-only connection). The export is all or nothing: the files are written
into a new folder beside DIR, which then replaces DIR whole (`paths.atomic_folder`), so
an interrupted export leaves the previous export as it was, never a mix of the two.
Does not: write to any DB, or query several sources at once (`sandbox.merged_query`
reads exports back).
"""

from __future__ import annotations

import os
from pathlib import Path

from evalkit.errors import BadInput
from evalkit.paths import atomic_folder, check_output_dir, utf8_path
from evalkit.store.db import db_path, open_reader
from evalkit.store.sandbox import TABLES


def _literal(text: str | os.PathLike) -> str:
    """A SQL string literal."""
    return "'" + str(text).replace("'", "''") + "'"


def export_parquet(db: str | os.PathLike | None, out_dir: str | os.PathLike) -> list[tuple[str, int, Path]]:
    """Write every table of the DB as `out_dir/<table>.parquet`, replacing `out_dir` whole;
    return (table, rows, file) per table.

    `out_dir` may hold nothing but an earlier export (anything else is refused, BadInput).

    >>> export_parquet("reports/evalkit.duckdb", "export/")  # doctest: +SKIP
    [('runs', 3, PosixPath('export/runs.parquet')), ('metrics', 36, ...), ...]
    """
    import duckdb

    utf8_path(out_dir, "--parquet")  # DuckDB's COPY TO takes UTF-8 paths only
    out = check_output_dir(out_dir, "--parquet", [f"{t}.parquet" for t in TABLES], protect=[db_path(db)],
                           whole=True)
    written = []
    with open_reader(db) as con, atomic_folder(out, "--parquet") as new:
        for table in TABLES:
            name = f"{table}.parquet"
            try:
                n = con.execute(f"COPY (SELECT * FROM {table}) TO {_literal(new / name)} (FORMAT parquet)"
                                ).fetchone()[0]
            except duckdb.IOException as exc:  # disk full, quota: one line, the old export kept
                reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                raise BadInput(f"cannot write --parquet {out / name}: {reason}") from None
            written.append((table, int(n), out / name))
    return written
