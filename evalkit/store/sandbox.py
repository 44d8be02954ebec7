"""`evalkit query`: the user's SQL, run where it can read the named sources and nothing else.

Owns: the sandbox, made of DuckDB's own settings — a read-only connection with external
access off (no file reads or writes beyond the DB itself, no ATTACH, no extension
install or load) and the configuration locked so the SQL cannot turn it back on — and,
as a second layer, refusing every statement type that is not a read; the merged
query over several DB files and Parquet exports, whose sources are loaded before the
same lock is put on, each source counted once; and the limits on a running statement —
a timeout and Ctrl-C, both through DuckDB's own `interrupt()`, after which the
connection is closed and the DB's lock released. Does not: format output.
"""

from __future__ import annotations

import functools
import math
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import duckdb

from evalkit.errors import BadInput
from evalkit.paths import ANY_SIZE, is_duckdb_file, open_input
from evalkit.store.db import (
    SANDBOX_CONFIG,
    db_path,
    inspect_con,
    migrate,
    open_reader,
    open_waiting,
    refusal,
    refuse_special,
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
# older evalkit may lack the later ones (OPTIONAL): they read as empty tables
TABLES = ("runs", "metrics", "samples", "first_token_topk", "tags", "lead_indicators", "attention_layers", "gates",
          "gate_checks", "degenerate", "first_char_topk")
# older exports lack them
OPTIONAL = frozenset({"lead_indicators", "attention_layers", "gates", "gate_checks", "degenerate", "first_char_topk"})
# seconds the user's SQL may run before it is stopped (`evalkit query --timeout`)
DEFAULT_TIMEOUT = 300.0
PARQUET_MAGIC = b"PAR1"  # the first and the last four bytes of every Parquet file

T = TypeVar("T")


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


def check_timeout(timeout: float) -> float:
    """The statement timeout in seconds: a finite number above 0, else BadInput."""
    if not (math.isfinite(timeout) and timeout > 0):
        raise BadInput(f"--timeout must be a finite number of seconds > 0, got {timeout:g}")
    return float(timeout)


def interruptible(con: duckdb.DuckDBPyConnection, work: Callable[[], T], timeout: float | None = None) -> T:
    """`work()` — DuckDB calls on `con` — stopped by DuckDB's own `con.interrupt()` after
    `timeout` seconds (BadInput) or on Ctrl-C (KeyboardInterrupt, exit 130); it has ended
    when this returns or raises, so `con` can be closed and its lock released at once.

    `work` runs in a worker thread while this thread waits, because Python runs its SIGINT
    handler only in the main thread and only between bytecodes: with DuckDB busy on the
    main thread, Ctrl-C went unseen until the statement ended (DuckDB's own check for
    signals left a hashing SELECT running 15 s after SIGINT). A wait is where Ctrl-C lands
    at once, and the wait's own timeout is the timer. Python's KeyboardInterrupt is the
    handler: caught here, only while `work` runs. The wait is on an Event, not
    `Thread.join`: a join that Ctrl-C interrupts takes the thread for ended (Python 3.11).
    """
    outcome: dict[str, object] = {}  # "value": work's result | "error": what it raised
    done = threading.Event()  # set once `work` has returned or raised: `con` is idle

    def target() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:  # handed to the waiting thread, raised there
            outcome["error"] = exc
        finally:
            done.set()

    try:
        threading.Thread(target=target, name="evalkit-sql", daemon=True).start()
        finished = done.wait(None if timeout is None else min(timeout, threading.TIMEOUT_MAX))
    except KeyboardInterrupt:
        con.interrupt()
        done.wait()
        raise
    if not finished:  # past the timeout
        con.interrupt()
        done.wait()
        if "value" not in outcome:  # it did not finish in the moment before the interrupt
            raise BadInput(f"query stopped after {timeout:g} s (--timeout)")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def run_sql(con: duckdb.DuckDBPyConnection, sql: str,
            timeout: float | None = DEFAULT_TIMEOUT) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of already-checked SQL, stopped after `timeout` seconds (None: no
    limit) or on Ctrl-C (`interruptible`); DuckDB's errors become one-line BadInput."""

    def execute() -> tuple[list[str], list[tuple]]:
        cur = con.execute(sql)
        cols = [d[0] for d in cur.description] if cur.description else []
        return cols, cur.fetchall()

    try:
        return interruptible(con, execute, timeout)
    except duckdb.Error as exc:
        first = str(exc).splitlines()[0]
        if isinstance(exc, duckdb.PermissionException) or "disabled by configuration" in first:
            raise BadInput(f"evalkit query may only read the database: {first}") from exc
        raise BadInput(f"SQL error: {first}") from exc


def read_query(path, sql: str, timeout: float = DEFAULT_TIMEOUT) -> tuple[list[str], list[tuple]]:
    """Run read-only SQL on one DB in the sandbox, for at most `timeout` seconds; return
    (column names, rows)."""
    timeout = check_timeout(timeout)
    check_read_only(sql)
    with open_reader(path, sandbox=True) as con:
        return run_sql(con, sql, timeout)


def _literal(text: str | os.PathLike) -> str:
    """A SQL string literal."""
    return "'" + str(text).replace("'", "''") + "'"


def _attach(con: duckdb.DuckDBPyConnection, path: Path, alias: str) -> None:
    """ATTACH one evalkit DB file READ_ONLY (waiting, bounded, while a writer holds its lock)."""
    if not path.exists():
        raise BadInput(f"no evalkit database at {path}")
    if path.is_dir():
        raise BadInput(f"{path} is a directory, not a DuckDB file")
    refuse_special(path)
    if not is_duckdb_file(path):
        raise BadInput(f"{path} is not a DuckDB file")
    open_waiting(path, lambda: con.execute(f"ATTACH {_literal(path)} AS {alias} (READ_ONLY)"))
    problem = refusal(path, inspect_con(con, alias), writer=False)
    if problem:
        raise BadInput(problem)


def is_parquet_file(path: Path) -> bool:
    """A Parquet file begins and ends with the magic bytes 'PAR1'."""
    try:
        with open_input(path, "Parquet file", ANY_SIZE) as fh:  # a FIFO or device: no Parquet file, never waited on
            size = os.fstat(fh.fileno()).st_size
            if size < 12:  # magic, a footer length, magic
                return False
            return head_and_tail(fh.fileno(), size) == (PARQUET_MAGIC, PARQUET_MAGIC)
    except (OSError, BadInput):
        return False


def head_and_tail(fd: int, size: int) -> tuple[bytes, bytes]:
    return os.pread(fd, 4, 0), os.pread(fd, 4, size - 4)


def _parquet_files(folder: Path) -> dict[str, Path]:
    """table -> Parquet file of one export folder; every table must be there, and be Parquet."""
    if not folder.is_dir():
        raise BadInput(f"no evalkit export at {folder} (run `evalkit export --parquet {folder}`)")
    missing = [t for t in TABLES if t not in OPTIONAL and not (folder / f"{t}.parquet").is_file()]
    if missing:
        raise BadInput(f"{folder} is not a complete evalkit export: {missing[0]}.parquet is missing")
    files = {t: folder / f"{t}.parquet" for t in TABLES if (folder / f"{t}.parquet").is_file()}
    for file in files.values():
        if is_duckdb_file(file):
            raise BadInput(f"{file} is a DuckDB file, not Parquet (a DuckDB file goes with --db)")
        if not is_parquet_file(file):
            raise BadInput(f"{file} is not a Parquet file (re-export the folder with `evalkit export --parquet`)")
    return files


def _load_parquet(con: duckdb.DuckDBPyConnection, files: dict[str, Path], prefix: str) -> None:
    """Each table of one export as the in-memory table `prefix` + table (empty where the
    export lacks an OPTIONAL table); a file DuckDB cannot read is BadInput naming it."""
    for table in TABLES:
        if table not in files:  # an older export without this (OPTIONAL) table
            con.execute(_empty_table_sql(table, f"{prefix}{table}"))
            continue
        try:
            con.execute(f"CREATE TABLE {prefix}{table} AS SELECT * FROM read_parquet({_literal(files[table])})")
        except duckdb.Error as exc:  # Parquet magic, but a damaged file
            raise BadInput(f"{files[table]} is not a readable Parquet file "
                           f"({str(exc).strip().splitlines()[0]})") from exc


def _distinct_sources(paths: Sequence[str | os.PathLike], option: str) -> None:
    """Refuse a source named twice (the same path, `./`, a symlink or a hard link to it).

    Refused rather than dropped: a repeat is a mistake in the command (a glob that also
    matches a symlink), and a silent repeat would count every row twice while a silent
    drop would hide it; the library writes no notes (it formats no output), so one line
    that names both spellings is what the user sees. A copy of a file is another file
    and is not caught here.
    """
    seen: dict[tuple[int, int], str] = {}  # (device, inode) -> the source as first spelled
    for given in paths:
        path = os.fspath(given)
        try:
            st = os.stat(path)
        except OSError:  # missing: refused when it is opened
            continue
        first = seen.get((st.st_dev, st.st_ino))
        if first is not None:
            raise BadInput(f"{option} {path} is the same source as {option} {first}: name each source once "
                           "(it would count twice)")
        seen[(st.st_dev, st.st_ino)] = path


def _empty_table_sql(table: str, name: str) -> str:
    """CREATE TABLE `name` with the columns `table` has in a freshly migrated DB (no rows)."""
    scratch = duckdb.connect(":memory:")
    try:
        migrate(scratch)
        cols = scratch.execute("SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = ? "
                               "ORDER BY column_index", [table]).fetchall()
    finally:
        scratch.close()
    return f"CREATE TABLE {name} (" + ", ".join(f'"{c}" {t}' for c, t in cols) + ")"


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


# the source each run id is read from when several hold it (a DB and its own export, two copies of one
# file): a done copy first, then the first source named (--db before --parquet, in command order)
OWNER_TABLE = "evalkit_run_source"
# the tables whose rows belong to no one run, each row kept once by these columns: a tag's history (one row a
# promotion, so a rollback's second row for a run stays), a gate's record and its checks
ONCE_BY = {"tags": ("tag", "run_id", "created_at"), "gates": ("id",), "gate_checks": ("gate_id", "position")}


def _union_by_run(con: duckdb.DuckDBPyConnection, sources: list[dict[str, str]]) -> None:
    """One view per table over every source, each run counted once (idempotent by run id): a run's
    rows come from the one source `OWNER_TABLE` names for it, so merging a DB with its own export,
    or an export twice over, adds nothing. A tag's promotion, a gate and its checks are kept once each."""
    runs = " UNION ALL ".join(f"SELECT id, status, {i} AS src FROM {src['runs']}" for i, src in enumerate(sources))
    con.execute(f"CREATE TABLE {OWNER_TABLE} AS SELECT id, arg_min(src, (status IS DISTINCT FROM 'done', src)) "
                f"AS src FROM ({runs}) GROUP BY id")
    for table in TABLES:
        key = "id" if table == "runs" else "run_id"
        parts = [f"SELECT * FROM {src[table]} WHERE {key} NOT IN "
                 f"(SELECT id FROM {OWNER_TABLE} WHERE src <> {i})" for i, src in enumerate(sources) if table in src]
        if table in ONCE_BY:  # rows of no one run (a tag's history, the gate's records): every source's, each once
            parts = [f"SELECT * FROM {src[table]}" for src in sources if table in src]
        if not parts:
            continue
        union = " UNION ALL BY NAME ".join(parts)
        if table in ONCE_BY:
            keys = ", ".join(ONCE_BY[table])
            union = f"SELECT DISTINCT ON ({keys}) * FROM ({union}) ORDER BY {keys}"
        con.execute(f"CREATE VIEW {table} AS {union}")


def merged_query(
    db_paths: Sequence[str | os.PathLike] = (),
    parquet_dirs: Sequence[str | os.PathLike] = (),
    sql: str = "",
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[list[str], list[tuple]]:
    """Read-only SQL over several DB files and Parquet exports; return (column names, rows).

    One DB file and no export is `read_query`. Otherwise an in-memory DuckDB attaches
    each DB file READ_ONLY and reads each export's Parquet files into memory; every
    table (runs, metrics, ...) is then a view unioning (UNION ALL BY NAME) that table
    over all sources, the DB's own views (leaderboard, ...) are rebuilt on top, and
    only then is external access turned off and the configuration locked, so the
    user's SQL reaches the named sources and nothing else. Each source counts once: one
    named twice is refused (`_distinct_sources`); and each run counts once, from one source,
    however many hold it (`_union_by_run`: a DB merged with its own export is the DB). `timeout` bounds the user's SQL, not
    the loading of the sources; Ctrl-C stops either.
    """
    timeout = check_timeout(timeout)
    _distinct_sources(db_paths, "--db")
    _distinct_sources(parquet_dirs, "--parquet")
    dbs = [Path(p) for p in db_paths]
    exports = [Path(p) for p in parquet_dirs]
    if len(dbs) <= 1 and not exports:
        return read_query(db_path(dbs[0]) if dbs else None, sql, timeout)
    check_read_only(sql)
    con = duckdb.connect(":memory:", config={k: v for k, v in SANDBOX_CONFIG.items()
                                             if k not in ("enable_external_access", "lock_configuration")})
    try:
        sources: list[dict[str, str]] = []  # per source: table -> relation
        for i, path in enumerate(dbs):
            alias = f"evalkit_src{i}"
            _attach(con, path, alias)
            sources.append({t: f"{alias}.main.{t}" for t in TABLES})
        for j, folder in enumerate(exports):
            files = _parquet_files(folder)
            interruptible(con, functools.partial(_load_parquet, con, files, f"evalkit_pq{j}_"))
            sources.append({t: f"evalkit_pq{j}_{t}" for t in TABLES})
        _union_by_run(con, sources)
        for definition in view_definitions():
            try:
                con.execute(definition)
            except duckdb.Error:  # an export too old for this view: the tables stay queryable
                pass
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        return run_sql(con, sql, timeout)
    finally:
        con.close()
