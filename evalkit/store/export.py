"""Past one machine: every table of the DB as Parquet files, to carry between machines.

Owns: `export_parquet` (every table of one DB to DIR/<table>.parquet through DuckDB's
COPY, on a read-only connection). Does not: write to any DB, or query several sources
at once (`sandbox.merged_query` reads exports back).
"""

from __future__ import annotations

import os
from pathlib import Path

from evalkit.paths import check_output_dir
from evalkit.store.db import db_path, open_reader
from evalkit.store.sandbox import TABLES


def _literal(text: str | os.PathLike) -> str:
    """A SQL string literal."""
    return "'" + str(text).replace("'", "''") + "'"


def export_parquet(db: str | os.PathLike | None, out_dir: str | os.PathLike) -> list[tuple[str, int, Path]]:
    """Write every table of the DB as `out_dir/<table>.parquet`; return (table, rows, file) per table.

    >>> export_parquet("reports/evalkit.duckdb", "export/")  # doctest: +SKIP
    [('runs', 3, PosixPath('export/runs.parquet')), ('metrics', 36, ...), ...]
    """
    out = check_output_dir(out_dir, "--parquet", [f"{t}.parquet" for t in TABLES], protect=[db_path(db)])
    written = []
    with open_reader(db) as con:
        out.mkdir(parents=True, exist_ok=True)
        for table in TABLES:
            path = out / f"{table}.parquet"
            n = con.execute(f"COPY (SELECT * FROM {table}) TO {_literal(path)} (FORMAT parquet)").fetchone()[0]
            written.append((table, int(n), path))
    return written
