"""Opening the evalkit DuckDB file: who may write it, what it must be, and waiting for its lock.

Owns: the DB path (`db_path`), telling an evalkit DB from anything else (`inspect_file`:
a missing file, not DuckDB, an empty DuckDB file, another program's DuckDB file, an
evalkit DB of an older or newer schema), the two ways in — `open_reader` (read-only,
never migrates, never writes, refuses what it cannot read with one line) and
`open_writer` (creates and migrates; used by `run`, `promote`, `migrate` and `ingest`
only) — short write transactions, and the bounded, jittered wait on DuckDB's
single-writer file lock. Does not: know which rows a run writes (`rows`), keep unwritten results (`spool`), do the
writer's upkeep (ingesting kept runs, recording dead ones: `runs.open_writer`), or run user
SQL (`sandbox`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import random
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import duckdb

from evalkit import envvars
from evalkit.errors import BadInput, DatabaseBusy, StorageFault
from evalkit.paths import is_duckdb_file, kind_of, utf8_path
from evalkit.store.migrations import APPLICATION_ID, MIGRATIONS

MIGRATION_NAMES = [m.__name__ for m in MIGRATIONS]


def db_path(path: str | os.PathLike | None = None) -> Path:
    """The DB file to use: the argument, else $EVALKIT_DB, else reports/evalkit.duckdb; BadInput for a
    path DuckDB cannot open (a byte that is not UTF-8, `paths.utf8_path`)."""
    chosen = Path(path) if path else envvars.db()
    utf8_path(chosen, "the DB path")
    return chosen


def now() -> dt.datetime:
    """The current UTC time as the naive TIMESTAMP evalkit stores."""
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def refuse_special(path: Path) -> None:
    """BadInput when the DB path is a folder, FIFO, device or socket: a DB is a regular file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise BadInput(f"{path} is {kind_of(mode)}, not a DuckDB file")


def is_lock_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "lock" in text and ("conflict" in text or "could not set" in text)


def open_waiting(path: Path, open_fn: Callable[[], duckdb.DuckDBPyConnection]):
    """`open_fn()` (a connect or ATTACH of `path`), retried with backoff and jitter while another
    process holds DuckDB's file lock, for up to $EVALKIT_LOCK_TIMEOUT seconds (then DatabaseBusy);
    any other DuckDB error means the file is not a readable DuckDB file (BadInput)."""
    utf8_path(path, "the DB path")  # every connect and ATTACH comes here: DuckDB takes UTF-8 paths only
    timeout = envvars.lock_timeout()
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            return open_fn()
        except duckdb.Error as exc:
            if not is_lock_error(exc):
                raise BadInput(f"{path} is not a readable DuckDB file ({str(exc).splitlines()[0]})") from exc
            if time.monotonic() >= deadline:
                raise DatabaseBusy(f"{path} is locked by another process (waited {timeout:g} s); "
                                   "close it there and try again") from exc
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 1.0)


# ---- what a file is -----------------------------------------------------------------------


@dataclass(frozen=True)
class FileState:
    """What `inspect_file` found; `problem` is the one line a reader would refuse it with."""

    kind: str  # missing | not-duckdb | empty | foreign | evalkit
    applied: tuple[str, ...] = ()  # migrations recorded in it (evalkit only)
    unknown: tuple[str, ...] = ()  # migrations this evalkit does not know (a newer evalkit wrote it)

    @property
    def pending(self) -> list[str]:
        return [m for m in MIGRATION_NAMES if m not in self.applied]


# the shape of the two tables by which evalkit knows its own file: column -> type, in order
SCHEMA_VERSION_COLUMNS = {"version": "INTEGER", "name": "VARCHAR", "applied_at": "TIMESTAMP"}
META_COLUMNS = {"key": "VARCHAR", "value": "VARCHAR"}


def _objects(con: duckdb.DuckDBPyConnection, db: str) -> dict[tuple[str, str], str]:
    """(schema, name) -> kind of everything a program created in database `db`: tables, views,
    sequences, macros, types, indexes and schemas of its own (DuckDB's catalog functions)."""
    found: dict[tuple[str, str], str] = {}
    queries = {
        "table": "SELECT schema_name, table_name FROM duckdb_tables() WHERE database_name = ?",
        "view": "SELECT schema_name, view_name FROM duckdb_views() WHERE database_name = ? AND NOT internal",
        "sequence": "SELECT schema_name, sequence_name FROM duckdb_sequences() WHERE database_name = ?",
        "macro": "SELECT schema_name, function_name FROM duckdb_functions() WHERE database_name = ? AND NOT internal",
        "type": "SELECT schema_name, type_name FROM duckdb_types() WHERE database_name = ? AND NOT internal",
        "index": "SELECT schema_name, index_name FROM duckdb_indexes() WHERE database_name = ?",
        "schema": "SELECT schema_name, schema_name FROM duckdb_schemas() WHERE database_name = ? AND NOT internal",
    }
    for kind, sql in queries.items():
        for schema, name in con.execute(sql, [db]).fetchall():
            found.setdefault((schema, name), kind)
    return found


def _has_shape(con: duckdb.DuckDBPyConnection, db: str, table: str, columns: dict[str, str]) -> bool:
    """Whether `db`.main.`table` is a base table whose columns are exactly `columns` (name and type, in order)."""
    got = con.execute("SELECT column_name, data_type FROM duckdb_columns() WHERE database_name = ? "
                      "AND schema_name = 'main' AND table_name = ? ORDER BY column_index", [db, table]).fetchall()
    return [(n.lower(), t.upper()) for n, t in got] == list(columns.items())


def _old_evalkit(con: duckdb.DuckDBPyConnection, db: str, names: tuple[str, ...], tables: set[str]) -> bool:
    """Whether an unmarked file is an evalkit DB from before the marker (m008): its migrations
    are our first ones, in order, and every table they create has exactly their columns."""
    count = len(names)
    if not names or list(names) != MIGRATION_NAMES[:count] or count > MIGRATION_NAMES.index("m008_create_meta"):
        return False
    scratch = duckdb.connect(":memory:")
    try:
        for migration in MIGRATIONS[:count]:
            migration(scratch)
        made = {t for (t,) in scratch.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
        shapes = {t: dict(scratch.execute("SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = ? "
                                          "ORDER BY column_index", [t]).fetchall()) for t in made}
    finally:
        scratch.close()
    return made <= tables and all(_has_shape(con, db, t, cols) for t, cols in shapes.items())


def inspect_con(con: duckdb.DuckDBPyConnection, database: str | None = None) -> FileState:
    """What the open database (`database`, default the connection's own) is, by what evalkit wrote.

    An evalkit DB is known by its own marks, never by a table name another program may use
    too: `evalkit_meta` (a table of exactly evalkit's columns) holding evalkit's
    application_id, and `schema_version` of exactly evalkit's columns listing evalkit's
    migrations. A DB written before the marker (m008) is known by its migrations alone, which
    must be evalkit's first ones, in order. A file holding anything at all (a table, a view, a
    sequence, a macro, a type, a schema) that is not marked so is `foreign`; `empty` is a file
    with nothing in it. Reads only; a catalog DuckDB cannot read as evalkit's is `foreign`.
    """
    # fetchall, not fetchone: a result left unfinished blocks the connection's relational API
    # (`con.sql`) in DuckDB 2, and a reader's connection is handed to the user
    db = database or con.execute("SELECT current_database()").fetchall()[0][0]
    try:
        objects = _objects(con, db)
        if not objects:
            return FileState("empty")
        tables = {name for (schema, name), kind in objects.items() if schema == "main" and kind == "table"}
        if "schema_version" not in tables or not _has_shape(con, db, "schema_version", SCHEMA_VERSION_COLUMNS):
            return FileState("foreign")
        quoted = '"' + db.replace('"', '""') + '"'
        names = tuple(r[0] for r in con.execute(
            f"SELECT name FROM {quoted}.main.schema_version ORDER BY version").fetchall())
        marked = False
        if "evalkit_meta" in tables and _has_shape(con, db, "evalkit_meta", META_COLUMNS):
            rows = con.execute(f"SELECT value FROM {quoted}.main.evalkit_meta WHERE key = 'application_id'").fetchall()
            marked = rows == [(APPLICATION_ID,)]
    except duckdb.Error:
        return FileState("foreign")
    known = [n for n in names if n in MIGRATION_NAMES]
    if not (marked or _old_evalkit(con, db, names, tables)):
        return FileState("foreign")
    return FileState("evalkit", tuple(known), tuple(n for n in names if n not in MIGRATION_NAMES))


def refusal(path: Path, state: FileState, *, writer: bool) -> str | None:
    """Why a reader (or a writer) cannot use this file, or None."""
    if state.kind == "foreign":
        return f"{path} is a DuckDB file of another program, not an evalkit database; evalkit leaves it alone"
    if state.unknown:
        return (f"{path} was written by a newer evalkit (schema {state.unknown[-1]} is unknown here); "
                "upgrade evalkit to read it")
    if writer:
        return None
    if state.kind == "empty":
        return f"{path} is an empty DuckDB file with no evalkit runs yet (store one with `evalkit run`)"
    if state.pending:
        return (f"{path} was written by an older evalkit ({len(state.pending)} schema upgrades pending); "
                f"run `evalkit migrate --db {path}` to upgrade it")
    return None


# ---- readers ------------------------------------------------------------------------------

SANDBOX_CONFIG = {
    # DuckDB's own guarantees for SQL the user wrote: no file, extension or other database
    # is reachable from the connection, and the settings cannot be changed back.
    "enable_external_access": False,
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "allow_community_extensions": False,
    "lock_configuration": True,
}


def _connect_reader(path: Path, config: dict | None) -> duckdb.DuckDBPyConnection:
    if not path.exists():
        raise BadInput(f"no evalkit database at {path} (store a run with `evalkit run`, or pass --db)")
    if path.is_dir():
        raise BadInput(f"{path} is a directory, not a DuckDB file")
    refuse_special(path)
    if not is_duckdb_file(path):
        raise BadInput(f"{path} is not a DuckDB file")
    return open_waiting(path, lambda: duckdb.connect(str(path), read_only=True, config=dict(config or {})))


def reader_connection(path: str | os.PathLike | None = None, *, sandbox: bool = False) -> duckdb.DuckDBPyConnection:
    """A read-only connection to an evalkit DB at the current schema; the caller closes it.

    Never creates, migrates or writes anything. Refuses (BadInput, one line) a missing
    file, a file that is not DuckDB, an empty DuckDB file, another program's DuckDB
    file, and an evalkit DB of another schema (naming `evalkit migrate` for an older
    one). `sandbox` adds DuckDB's external-access lock (for user SQL). While it is open
    no other process can write the file.
    """
    path = db_path(path)
    con = _connect_reader(path, SANDBOX_CONFIG if sandbox else None)
    problem = refusal(path, inspect_con(con), writer=False)
    if problem:
        con.close()
        raise BadInput(problem)
    if sandbox:
        hide_secrets(con)
    return con


SECRET_KEYS = ("spool_key",)  # evalkit_meta rows user SQL does not see by name


def hide_secrets(con: duckdb.DuckDBPyConnection) -> None:
    """Shadow `evalkit_meta` with a TEMP view without the signing key, so `SELECT * FROM
    evalkit_meta` (or `main.evalkit_meta`) in `evalkit query` never prints it into a log. Only
    a catalog-qualified name (`evalkit.main.evalkit_meta`) reaches the table itself, as any
    DuckDB client with read access to the file does: DuckDB has no per-table permission, so
    the key's real guard is that only this user's closed spool folders are trusted (spool)."""
    db = con.execute("SELECT current_database()").fetchall()[0][0]
    quoted = '"' + db.replace('"', '""') + '"'
    hidden = ", ".join(f"'{k}'" for k in SECRET_KEYS)
    con.execute(f"CREATE TEMP VIEW evalkit_meta AS SELECT * FROM {quoted}.main.evalkit_meta WHERE key NOT IN ({hidden})")


@contextlib.contextmanager
def open_reader(path: str | os.PathLike | None = None, *, sandbox: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
    """`reader_connection` for one short block, closed on exit."""
    con = reader_connection(path, sandbox=sandbox)
    try:
        yield con
    finally:
        con.close()


def file_state(path: str | os.PathLike | None = None) -> FileState:
    """What the DB file is, read without writing (a missing file is `missing`)."""
    path = db_path(path)
    if not path.exists():
        return FileState("missing")
    if path.is_dir() or not is_duckdb_file(path):
        return FileState("not-duckdb")
    con = open_waiting(path, lambda: duckdb.connect(str(path), read_only=True))
    try:
        return inspect_con(con)
    finally:
        con.close()


def check_writable(path: str | os.PathLike | None = None) -> Path:
    """Refuse, before any work, a DB path a writer could not use; return the path.

    A missing file is fine (it is created on the first write); so is an empty DuckDB
    file. A folder, a non-DuckDB file, another program's DuckDB file or a newer
    evalkit's DB is BadInput.
    """
    path = db_path(path)
    if path.is_dir():
        raise BadInput(f"{path} is a directory, not a DuckDB file")
    refuse_special(path)
    if path.exists():
        if not is_duckdb_file(path):
            raise BadInput(f"{path} is not a DuckDB file")
        problem = refusal(path, file_state(path), writer=True)
        if problem:
            raise BadInput(problem)
    elif not _creatable(path.parent):
        raise BadInput(f"cannot create the database {path}: its folder is not writable")
    return path


def _creatable(folder: Path) -> bool:
    while not folder.exists():
        if folder.parent == folder:
            return False
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK)


# ---- writers ------------------------------------------------------------------------------


def applied(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Names of the migrations already applied, in order (reads only)."""
    state = inspect_con(con)
    return list(state.applied) if state.kind == "evalkit" else []


def pending(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Names of the migrations not yet applied (reads only)."""
    done = set(applied(con))
    return [name for name in MIGRATION_NAMES if name not in done]


def migrate(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Apply pending migrations, each with its record in one transaction; return their names."""
    con.execute(
        "CREATE TABLE IF NOT EXISTS schema_version "
        "(version INTEGER PRIMARY KEY, name VARCHAR NOT NULL, applied_at TIMESTAMP NOT NULL)"
    )
    done = set(applied(con))
    ran = []
    for version, migration in enumerate(MIGRATIONS, start=1):
        if migration.__name__ in done:
            continue
        with in_transaction(con):
            migration(con)
            con.execute("INSERT INTO schema_version VALUES (?, ?, ?)", [version, migration.__name__, now()])
        ran.append(migration.__name__)
    return ran


# Files written by this evalkit are readable by DuckDB 1.x clients (the CLI, DBeaver, older
# Python packages) too: DuckDB writes the oldest storage format that holds what evalkit stores.
STORAGE_COMPATIBILITY = "v1.0.0"


@contextlib.contextmanager
def open_writer(path: str | os.PathLike | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-write connection to the evalkit DB, created and migrated as needed; closed on exit.

    Only writers use it (`run`, `promote`, `migrate`, `ingest`). Refuses another program's DuckDB
    file and a newer evalkit's DB. It opens and migrates only: a writer that should first bring in
    kept runs and record dead ones opens through `store.runs.open_writer`. Keep the block short.
    """
    path = check_writable(path)
    config: dict[str, str | bool | int | float | list[str]] = (
        {} if path.exists() else {"storage_compatibility_version": STORAGE_COMPATIBILITY})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        con = open_waiting(path, lambda: duckdb.connect(str(path), config=config))
    except (duckdb.Error, OSError) as exc:
        raise as_fault(path, exc) from exc
    try:
        problem = refusal(path, inspect_con(con), writer=True)
        if problem:
            raise BadInput(problem)
        migrate(con)
        yield con
    except (duckdb.Error, OSError) as exc:
        raise as_fault(path, exc) from exc
    finally:
        con.close()


# what a file system says when it refuses a write: the user's to fix, so one line (exit 2)
_FAULTS = ("No space left on device", "Disk quota exceeded", "Read-only file system", "Permission denied")


def as_fault(path: Path, exc: BaseException) -> BaseException:
    """A write the file system refused, as StorageFault (one line naming the DB); any other error as it is."""
    text = str(exc)
    fault = next((f for f in _FAULTS if f in text), None)
    return StorageFault(f"cannot write the DB {path}: {fault}") if fault else exc


@contextlib.contextmanager
def in_transaction(con: duckdb.DuckDBPyConnection) -> Iterator[duckdb.DuckDBPyConnection]:
    """The block as one transaction on `con`: committed on success, rolled back on error."""
    con.execute("BEGIN TRANSACTION")
    try:
        yield con
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")


@contextlib.contextmanager
def transaction(path: str | os.PathLike | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
    """One short write transaction on the DB (`open_writer`: no upkeep), committed on success."""
    with open_writer(path) as con, in_transaction(con) as con:
        yield con
