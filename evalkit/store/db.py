"""The DuckDB file: opening, migrating, and the few reads and writes evalkit makes.

Owns: `open_store` (the only place that connects for writing and migrates),
short write transactions with a bounded retry on DuckDB's single-writer file
lock, run-id resolution, and read-only SQL for `evalkit query`. Does not:
compute metrics, format output, or decide exit codes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import duckdb

from evalkit.errors import BadInput
from evalkit.scoring import registry
from evalkit.store.migrations import MIGRATIONS

DEFAULT_DB = Path("reports") / "evalkit.duckdb"
LOCK_TIMEOUT_S = float(os.environ.get("EVALKIT_LOCK_TIMEOUT", "120"))

# statement types `evalkit query` lets through; everything else may write.
# MULTI is what DuckDB makes of PIVOT (a SELECT over an enum it builds); the
# connection is read-only besides, so nothing it expands to can write the file.
_READ_STATEMENTS = {"SELECT", "EXPLAIN", "PRAGMA", "SHOW", "DESCRIBE", "SUMMARIZE", "MULTI"}


def db_path(path: str | os.PathLike | None = None) -> Path:
    """The DB file to use: the argument, else $EVALKIT_DB, else reports/evalkit.duckdb."""
    return Path(path or os.environ.get("EVALKIT_DB") or DEFAULT_DB)


def _is_lock_error(exc: Exception) -> bool:
    text = str(exc).lower()
    return "lock" in text and ("conflict" in text or "could not set" in text)


def _connect(path: Path, read_only: bool) -> duckdb.DuckDBPyConnection:
    """Connect, waiting (bounded, with jitter) while another process holds the file lock."""
    if read_only and not path.exists():
        raise BadInput(f"no evalkit database at {path}")
    if path.exists() and path.is_dir():
        raise BadInput(f"{path} is a directory, not a DuckDB file")
    return open_waiting(path, lambda: duckdb.connect(str(path), read_only=read_only))


def open_waiting(path: Path, open_fn):
    """`open_fn()` (a connect or ATTACH of `path`), retried with backoff and jitter while
    another process holds DuckDB's file lock, up to LOCK_TIMEOUT_S; any other DuckDB
    error means the file is not a readable DuckDB file (BadInput)."""
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    delay = 0.05
    while True:
        try:
            return open_fn()
        except duckdb.Error as exc:
            if _is_lock_error(exc) and time.monotonic() < deadline:
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 1.0)
                continue
            if _is_lock_error(exc):
                raise
            raise BadInput(f"{path} is not a readable DuckDB file ({str(exc).splitlines()[0]})") from exc


def applied(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Names of the migrations already applied, in order (reads only)."""
    exists = con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'schema_version'"
    ).fetchone()[0]
    if not exists:
        return []
    return [r[0] for r in con.execute("SELECT name FROM schema_version ORDER BY version").fetchall()]


def pending(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Names of the migrations not yet applied (reads only)."""
    done = set(applied(con))
    return [m.__name__ for m in MIGRATIONS if m.__name__ not in done]


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
        con.execute("BEGIN TRANSACTION")
        try:
            migration(con)
            con.execute(
                "INSERT INTO schema_version VALUES (?, ?, ?)",
                [version, migration.__name__, _now()],
            )
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise
        ran.append(migration.__name__)
    return ran


def _looks_like_evalkit(con: duckdb.DuckDBPyConnection) -> bool:
    tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    return not tables or "schema_version" in tables


@contextlib.contextmanager
def open_store(path: str | os.PathLike | None = None, *, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
    """Connect to the evalkit DB (migrating it when writable) and close it on exit.

    Keep the block short: while it is open, no other process can write the file.
    """
    path = db_path(path)
    if not read_only:
        if path.exists() and not _has_duckdb_header(path):
            raise BadInput(f"{path} is not a DuckDB file")
        path.parent.mkdir(parents=True, exist_ok=True)
    con = _connect(path, read_only)
    try:
        if not _looks_like_evalkit(con):
            raise BadInput(f"{path} is a DuckDB file but not an evalkit database")
        if not read_only:
            migrate(con)
        elif pending(con):
            # a file written by an older evalkit: upgrade its schema once, then read
            con.close()
            with open_store(path):
                pass
            con = _connect(path, read_only)
        yield con
    finally:
        con.close()


def _has_duckdb_header(path: Path) -> bool:
    """A DuckDB file carries the magic bytes 'DUCK' at offset 8; an empty file is not one either."""
    with open(path, "rb") as fh:
        head = fh.read(12)
    return len(head) == 12 and head[8:12] == b"DUCK"


@contextlib.contextmanager
def transaction(path: str | os.PathLike | None = None) -> Iterator[duckdb.DuckDBPyConnection]:
    """One short write transaction on the DB, committed on success, rolled back on error."""
    with open_store(path) as con:
        con.execute("BEGIN TRANSACTION")
        try:
            yield con
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


# ---- runs -------------------------------------------------------------------

RUN_COLUMNS = (
    "id", "created_at", "finished_at", "status", "name", "model", "model_args",
    "model_fingerprint", "dtype", "quant", "template", "template_text", "system_prompt",
    "tasks", "seed", "batch_size", "sample_limit", "top_k", "first_temperature",
    "ban_openers", "opener_lexicon_version", "evalkit_version", "lm_eval_version",
    "transformers_version", "torch_version", "git_commit", "host", "duration_s",
    "config", "error",
)


def insert_run(path, row: dict[str, Any]) -> None:
    """Record a run as it starts (status 'running')."""
    unknown = set(row) - set(RUN_COLUMNS)
    if unknown:
        raise ValueError(f"unknown run columns: {sorted(unknown)}")
    cols = list(row)
    with transaction(path) as con:
        con.execute(
            f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
            [row[c] for c in cols],
        )


def update_run(path, run_id: str, **fields: Any) -> None:
    """Set some columns of one run (e.g. status, finished_at, error)."""
    unknown = set(fields) - set(RUN_COLUMNS)
    if unknown:
        raise ValueError(f"unknown run columns: {sorted(unknown)}")
    assignments = ", ".join(f"{c} = ?" for c in fields)
    with transaction(path) as con:
        con.execute(f"UPDATE runs SET {assignments} WHERE id = ?", [*fields.values(), run_id])


def mark_interrupted(path, run_id: str, error: str, duration_s: float) -> None:
    """Mark a run `interrupted`, unless it already finished."""
    with transaction(path) as con:
        con.execute(
            "UPDATE runs SET status = 'interrupted', error = ?, finished_at = ?, duration_s = ? "
            "WHERE id = ? AND status = 'running'",
            [error, _now(), duration_s, run_id],
        )


SAMPLE_COLUMNS = (
    "run_id", "task", "doc_id", "prompt_hash", "prompt", "target", "response",
    "first_token", "first_token_id", "first_unit", "ft_outcome", "lang", "category",
    "ft_hit", "ft_token_hit", "ft_hit_prob", "opener_rate", "opener_mass",
    "prior_drift", "top3_mass", "top3_share", "unstable", "entropy", "needle_depth",
    "needle_length", "needle_tokens", "needle_hint", "needle_recall", "metrics",
)
# the samples columns that hold one numeric per-sample metric value each (the registry says which)
SAMPLE_METRIC_COLUMNS = registry.per_sample_columns()
METRIC_COLUMNS = ("run_id", "task", "metric", "filter", "value", "stderr", "n")
TOPK_COLUMNS = ("run_id", "task", "doc_id", "rank", "token_id", "token", "logprob")


def _arrow_types():
    import pyarrow as pa

    return {"VARCHAR": pa.string, "DOUBLE": pa.float64, "INTEGER": pa.int32, "BIGINT": pa.int64,
            "BOOLEAN": pa.bool_, "TIMESTAMP": lambda: pa.timestamp("us")}


class _LazyTypes(dict):
    def get(self, key, default=None):
        if not self:
            self.update(_arrow_types())
        return super().get(key, default)


_ARROW_TYPES = _LazyTypes()  # DuckDB type -> Arrow type factory, filled on first use


# rows per Arrow record batch handed to DuckDB: small enough that Arrow reuses its
# buffers (one 200k-row batch spends much of its time growing and faulting in memory)
_BATCH_ROWS = 8192


def _insert_rows(con, table: str, columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    """Bulk insert through Arrow record batches (fast; executemany is row by row).

    The dicts become batches lazily, as DuckDB reads them: converting them (Python, under
    the GIL) overlaps DuckDB compressing and writing full row groups on another thread.
    A key missing from a dict is NULL; keys outside `columns` are ignored.
    """
    if not rows:
        return
    import pyarrow as pa

    types = dict(con.execute(f"SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = '{table}'").fetchall())
    schema = pa.schema([(c, _ARROW_TYPES.get(types[c], pa.string())()) for c in columns])
    row_type = pa.struct(schema)
    # dicts -> struct array (one C++ pass per batch) -> the batch's columns
    batches = (pa.RecordBatch.from_struct_array(pa.array(rows[i:i + _BATCH_ROWS], type=row_type))
               for i in range(0, len(rows), _BATCH_ROWS))
    arrow = pa.RecordBatchReader.from_batches(schema, batches)  # noqa: F841  (read by DuckDB's replacement scan)
    con.execute(f"INSERT INTO {table} ({', '.join(columns)}) SELECT {', '.join(columns)} FROM arrow")


def finish_run(path, run_id: str, *, metrics, samples, topk, **fields: Any) -> None:
    """Write a run's results and mark it finished, all in one transaction."""
    with transaction(path) as con:
        _insert_rows(con, "metrics", METRIC_COLUMNS, metrics)
        _insert_rows(con, "samples", SAMPLE_COLUMNS, samples)
        _insert_rows(con, "first_token_topk", TOPK_COLUMNS, topk)
        assignments = ", ".join(f"{c} = ?" for c in fields)
        con.execute(f"UPDATE runs SET {assignments} WHERE id = ?", [*fields.values(), run_id])


def resolve_run(con: duckdb.DuckDBPyConnection, ref: str) -> str:
    """A run id from an id, a unique id prefix, `latest`, `tag:NAME`, or a run's `--name`
    (the newest `done` run of that name, else the newest of any status)."""
    ref = ref.strip()
    if ref == "latest":
        row = con.execute("SELECT id FROM runs ORDER BY created_at DESC, id DESC LIMIT 1").fetchone()
        if row is None:
            raise BadInput("no runs in the database yet")
        return row[0]
    if ref.startswith("tag:"):
        tag = ref[4:]
        row = con.execute(
            "SELECT t.run_id FROM tags t JOIN runs r ON r.id = t.run_id "
            "WHERE t.tag = ? ORDER BY r.created_at DESC, t.created_at DESC LIMIT 1",
            [tag],
        ).fetchone()
        if row is None:
            raise BadInput(f"no run has the tag {tag!r}")
        return row[0]
    if not ref:
        raise BadInput("empty run id")
    ids = [r[0] for r in con.execute("SELECT id FROM runs WHERE starts_with(id, ?) ORDER BY id", [ref]).fetchall()]
    named = con.execute("SELECT id FROM runs WHERE name = ? ORDER BY status = 'done' DESC, created_at DESC, id DESC "
                        "LIMIT 1", [ref]).fetchone()
    if ids and named and ids != [ref]:
        raise BadInput(f"{ref!r} is both a run name and an id prefix ({ids[0]}): give the full id")
    if not ids:
        if named is None:
            raise BadInput(f"unknown run {ref!r} (not a run id, id prefix, run name, latest or tag:NAME)")
        return named[0]
    if len(ids) > 1:
        raise BadInput(f"run id prefix {ref!r} is ambiguous: {', '.join(ids[:5])}")
    return ids[0]


def check_read_only(sql: str) -> None:
    """Refuse SQL with any statement that could write (checked before any file is opened)."""
    try:
        statements = duckdb.connect(":memory:").extract_statements(sql)
    except duckdb.Error as exc:
        raise BadInput(f"SQL error: {str(exc).splitlines()[0]}") from exc
    if not statements:
        raise BadInput("empty SQL")
    for st in statements:
        kind = st.type.name
        if kind not in _READ_STATEMENTS:
            raise BadInput(f"evalkit query is read-only: {kind} statements are refused")


def read_query(path, sql: str) -> tuple[list[str], list[tuple]]:
    """Run read-only SQL and return (column names, rows); writes are refused as BadInput."""
    check_read_only(sql)
    with open_store(path, read_only=True) as con:
        return run_sql(con, sql)


def run_sql(con: duckdb.DuckDBPyConnection, sql: str) -> tuple[list[str], list[tuple]]:
    """(column names, rows) of already-checked SQL; DuckDB's errors become one-line BadInput."""
    try:
        cur = con.execute(sql)
        cols = [d[0] for d in cur.description] if cur.description else []
        return cols, cur.fetchall()
    except duckdb.Error as exc:
        raise BadInput(f"SQL error: {str(exc).splitlines()[0]}") from exc
