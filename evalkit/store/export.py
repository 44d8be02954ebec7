"""Past one machine: Parquet export of the DB, and read-only SQL over several DBs and exports.

Owns: `export_parquet` (every table of one DB to DIR/<table>.parquet through
DuckDB's COPY, on a read-only connection) and `merged_query` (one in-memory
DuckDB that ATTACHes each DB file READ_ONLY, reads each export folder with
read_parquet, and unions every table over all sources, so that
`SELECT count(*) FROM runs` counts the runs of every machine).
Does not: write to any DB, merge or deduplicate runs (a run given twice, e.g.
its DB and that DB's export, is counted twice), or migrate old files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import duckdb

from evalkit.errors import BadInput
from evalkit.store import db as store

# the tables an export holds, one Parquet file each
TABLES = ("runs", "metrics", "samples", "first_token_topk", "tags")


def _literal(text: str | os.PathLike) -> str:
    """A SQL string literal."""
    return "'" + str(text).replace("'", "''") + "'"


def export_parquet(db: str | os.PathLike | None, out_dir: str | os.PathLike) -> list[tuple[str, int, Path]]:
    """Write every table of the DB as `out_dir/<table>.parquet`; return (table, rows, file) per table.

    >>> export_parquet("reports/evalkit.duckdb", "export/")  # doctest: +SKIP
    [('runs', 3, PosixPath('export/runs.parquet')), ('metrics', 36, ...), ...]
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise BadInput(f"--parquet {out} exists and is not a folder")
    written = []
    with store.open_store(db, read_only=True) as con:
        out.mkdir(parents=True, exist_ok=True)
        for table in TABLES:
            path = out / f"{table}.parquet"
            n = con.execute(f"COPY (SELECT * FROM {table}) TO {_literal(path)} (FORMAT parquet)").fetchone()[0]
            written.append((table, int(n), path))
    return written


def _attach(con: duckdb.DuckDBPyConnection, path: Path, alias: str) -> None:
    """ATTACH one evalkit DB file READ_ONLY, waiting (bounded) while a writer holds its lock."""
    if not path.exists():
        raise BadInput(f"no evalkit database at {path}")
    if path.is_dir():
        raise BadInput(f"{path} is a directory, not a DuckDB file")
    if not store._has_duckdb_header(path):
        raise BadInput(f"{path} is not a DuckDB file")
    store.open_waiting(path, lambda: con.execute(f"ATTACH {_literal(path)} AS {alias} (READ_ONLY)"))
    tables = {
        r[0] for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = ?", [alias]
        ).fetchall()
    }
    if "schema_version" not in tables:
        raise BadInput(f"{path} is a DuckDB file but not an evalkit database")


def _parquet_sources(folder: Path) -> dict[str, str]:
    """table -> read_parquet(...) expression for one export folder; every table must be there."""
    if not folder.is_dir():
        raise BadInput(f"no evalkit export at {folder} (run `evalkit export --parquet {folder}`)")
    missing = [t for t in TABLES if not (folder / f"{t}.parquet").is_file()]
    if missing:
        raise BadInput(f"{folder} is not a complete evalkit export: {missing[0]}.parquet is missing")
    return {t: f"read_parquet({_literal(folder / f'{t}.parquet')})" for t in TABLES}


def _view_definitions() -> list[str]:
    """The CREATE VIEW statements of a freshly migrated DB (leaderboard, needle_heatmap, ...)."""
    scratch = duckdb.connect(":memory:")
    try:
        store.migrate(scratch)
        return [r[0] for r in scratch.execute(
            "SELECT sql FROM duckdb_views() WHERE NOT internal AND database_name = 'memory' ORDER BY view_name"
        ).fetchall()]
    finally:
        scratch.close()


def merged_query(
    db_paths: Sequence[str | os.PathLike] = (),
    parquet_dirs: Sequence[str | os.PathLike] = (),
    sql: str = "",
) -> tuple[list[str], list[tuple]]:
    """Read-only SQL over several DB files and Parquet exports; return (column names, rows).

    One DB file and no export is `store.read_query`. Otherwise every table
    (runs, metrics, ...) is a view unioning (UNION ALL BY NAME) that table
    over all sources, and the DB's own views (leaderboard, ...) are rebuilt
    on top of them. Writes are refused as BadInput, as in `read_query`.
    """
    db_paths = [Path(p) for p in db_paths]
    parquet_dirs = [Path(p) for p in parquet_dirs]
    if len(db_paths) <= 1 and not parquet_dirs:
        return store.read_query(db_paths[0] if db_paths else None, sql)
    store.check_read_only(sql)
    con = duckdb.connect(":memory:")
    try:
        sources: list[dict[str, str]] = []  # per source: table -> relation
        for i, path in enumerate(db_paths):
            alias = f"evalkit_src{i}"
            _attach(con, path, alias)
            present = {r[0] for r in con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = ?", [alias]
            ).fetchall()}
            sources.append({t: f"{alias}.main.{t}" for t in TABLES if t in present})
        for folder in parquet_dirs:
            sources.append(_parquet_sources(folder))
        for table in TABLES:
            parts = [f"SELECT * FROM {src[table]}" for src in sources if table in src]
            if parts:
                con.execute(f"CREATE VIEW {table} AS " + " UNION ALL BY NAME ".join(parts))
        for definition in _view_definitions():
            try:
                con.execute(definition)
            except duckdb.Error:  # a source too old for this view: the tables stay queryable
                pass
        return store.run_sql(con, sql)
    finally:
        con.close()
