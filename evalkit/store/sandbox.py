"""`evalkit query`: the user's SQL, run where it can read the named sources and nothing else.

Owns: the sandbox, made of DuckDB's own settings — a read-only connection with external
access off (no file reads or writes beyond the DB itself, no ATTACH, no extension
install or load) and the configuration locked so the SQL cannot turn it back on — and,
as a second layer, refusing every statement type that is not a read; and the merged
query over several DB files and Parquet exports, whose sources are loaded before the
same lock is put on. Does not: format output.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import duckdb

from evalkit.errors import BadInput
from evalkit.store.db import (
    SANDBOX_CONFIG,
    db_path,
    inspect_con,
    is_duckdb_file,
    migrate,
    open_reader,
    open_waiting,
    refusal,
)

# statement types that only read. MULTI is what DuckDB makes of PIVOT (a SELECT over an
# enum it builds). A read-typed statement wrapping a write (EXPLAIN ANALYZE COPY ...) is
# stopped by the sandbox itself, not by this list.
READ_STATEMENTS = frozenset({"SELECT", "EXPLAIN", "PRAGMA", "MULTI"})
READ_PRAGMAS = frozenset({"table_info", "show_tables", "show_tables_expanded", "show", "database_size",
                          "database_list", "storage_info", "version", "functions", "collations", "metadata_info"})
_PRAGMA = re.compile(r"^\s*PRAGMA\s+(\w+)", re.I)
# the statement an EXPLAIN [ANALYZE] [(options)] wraps
_EXPLAINED = re.compile(r"^\s*EXPLAIN\b(?:\s+ANALY[SZ]E\b)?(?:\s*\([^)]*\))?\s*(\S.*)$", re.I | re.S)
# the tables of an evalkit DB that an export holds and a merged query unions; an export made by an
# older evalkit may lack the later ones (OPTIONAL)
TABLES = ("runs", "metrics", "samples", "first_token_topk", "tags", "lead_indicators")
OPTIONAL = frozenset({"lead_indicators"})


def check_read_only(sql: str) -> None:
    """Refuse SQL with any statement that is not a read (checked before any file is opened)."""
    try:
        statements = [(st.type.name, st.query) for st in duckdb.connect(":memory:").extract_statements(sql)]
    except duckdb.Error as exc:
        raise BadInput(f"SQL error: {str(exc).splitlines()[0]}") from exc
    except ValueError as exc:  # a statement type the Python package does not list (UPDATE EXTENSIONS)
        raise BadInput(f"evalkit query is read-only: a statement of an unlisted type is refused ({exc})") from exc
    if not statements:
        raise BadInput("empty SQL")
    for kind, query in statements:
        if kind not in READ_STATEMENTS:
            raise BadInput(f"evalkit query is read-only: {kind} statements are refused")
        if kind == "PRAGMA":  # DuckDB reports COPY FROM DATABASE and import_database as pragmas too
            name = _PRAGMA.match(query)
            if not name or name.group(1).lower() not in READ_PRAGMAS:
                raise BadInput("evalkit query is read-only: only the PRAGMAs that read "
                               f"({', '.join(sorted(READ_PRAGMAS))}) are allowed")
        inner = _EXPLAINED.match(query) if kind == "EXPLAIN" else None
        if inner:  # EXPLAIN ANALYZE runs the statement it explains: that one must read too
            check_read_only(inner.group(1))


def run_sql(con: duckdb.DuckDBPyConnection, sql: str) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of already-checked SQL; DuckDB's errors become one-line BadInput."""
    try:
        cur = con.execute(sql)
        cols = [d[0] for d in cur.description] if cur.description else []
        return cols, cur.fetchall()
    except duckdb.Error as exc:
        first = str(exc).splitlines()[0]
        if isinstance(exc, duckdb.PermissionException) or "disabled by configuration" in first:
            raise BadInput(f"evalkit query may only read the database: {first}") from exc
        raise BadInput(f"SQL error: {first}") from exc


def read_query(path, sql: str) -> tuple[list[str], list[tuple]]:
    """Run read-only SQL on one DB in the sandbox; return (column names, rows)."""
    check_read_only(sql)
    with open_reader(path, sandbox=True) as con:
        return run_sql(con, sql)


def _literal(text: str | os.PathLike) -> str:
    """A SQL string literal."""
    return "'" + str(text).replace("'", "''") + "'"


def _attach(con: duckdb.DuckDBPyConnection, path: Path, alias: str) -> None:
    """ATTACH one evalkit DB file READ_ONLY (waiting, bounded, while a writer holds its lock)."""
    if not path.exists():
        raise BadInput(f"no evalkit database at {path}")
    if path.is_dir():
        raise BadInput(f"{path} is a directory, not a DuckDB file")
    if not is_duckdb_file(path):
        raise BadInput(f"{path} is not a DuckDB file")
    open_waiting(path, lambda: con.execute(f"ATTACH {_literal(path)} AS {alias} (READ_ONLY)"))
    problem = refusal(path, inspect_con(con, alias), writer=False)
    if problem:
        raise BadInput(problem)


def _parquet_files(folder: Path) -> dict[str, Path]:
    """table -> Parquet file of one export folder; every table must be there."""
    if not folder.is_dir():
        raise BadInput(f"no evalkit export at {folder} (run `evalkit export --parquet {folder}`)")
    missing = [t for t in TABLES if t not in OPTIONAL and not (folder / f"{t}.parquet").is_file()]
    if missing:
        raise BadInput(f"{folder} is not a complete evalkit export: {missing[0]}.parquet is missing")
    return {t: folder / f"{t}.parquet" for t in TABLES if (folder / f"{t}.parquet").is_file()}


def view_definitions() -> list[str]:
    """The CREATE VIEW statements of a freshly migrated DB (leaderboard, needle_heatmap, ...)."""
    scratch = duckdb.connect(":memory:")
    try:
        migrate(scratch)
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

    One DB file and no export is `read_query`. Otherwise an in-memory DuckDB attaches
    each DB file READ_ONLY and reads each export's Parquet files into memory; every
    table (runs, metrics, ...) is then a view unioning (UNION ALL BY NAME) that table
    over all sources, the DB's own views (leaderboard, ...) are rebuilt on top, and
    only then is external access turned off and the configuration locked, so the
    user's SQL reaches the named sources and nothing else.
    """
    db_paths = [Path(p) for p in db_paths]
    parquet_dirs = [Path(p) for p in parquet_dirs]
    if len(db_paths) <= 1 and not parquet_dirs:
        return read_query(db_path(db_paths[0]) if db_paths else None, sql)
    check_read_only(sql)
    con = duckdb.connect(":memory:", config={k: v for k, v in SANDBOX_CONFIG.items()
                                             if k not in ("enable_external_access", "lock_configuration")})
    try:
        sources: list[dict[str, str]] = []  # per source: table -> relation
        for i, path in enumerate(db_paths):
            alias = f"evalkit_src{i}"
            _attach(con, path, alias)
            sources.append({t: f"{alias}.main.{t}" for t in TABLES})
        for j, folder in enumerate(parquet_dirs):
            files = _parquet_files(folder)
            for table, file in files.items():
                con.execute(f"CREATE TABLE evalkit_pq{j}_{table} AS SELECT * FROM read_parquet({_literal(file)})")
            sources.append({t: f"evalkit_pq{j}_{t}" for t in files})
        for table in TABLES:
            parts = [f"SELECT * FROM {src[table]}" for src in sources if table in src]
            if parts:
                con.execute(f"CREATE VIEW {table} AS " + " UNION ALL BY NAME ".join(parts))
        for definition in view_definitions():
            try:
                con.execute(definition)
            except duckdb.Error:  # an export too old for this view: the tables stay queryable
                pass
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        return run_sql(con, sql)
    finally:
        con.close()
