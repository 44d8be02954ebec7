"""The rows a run writes, and whether a `running` run is still alive.

Owns: the columns of `runs`, `metrics`, `samples`, `first_token_topk` and `attention_layers` as evalkit
writes them; recording a run as it starts, updating it, and writing its results in one
transaction (`finish_run`); the bulk insert through Arrow; the run's liveness — the
process that runs it (host, pid, pid start time), its heartbeat, and deciding that a
run whose process is gone is `abandoned` (readers show it so; writers record it).
Does not: open the file (`db`) or keep results that cannot be written (`spool`).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from collections.abc import Sequence
from typing import Any

import duckdb

from evalkit.errors import BadInput
from evalkit.kinds import RunStatus
from evalkit.scoring import registry
from evalkit.store.db import db_path, now, transaction

RUN_COLUMNS = (
    "id", "created_at", "finished_at", "status", "name", "model", "model_args",
    "model_fingerprint", "dtype", "quant", "template", "template_text", "system_prompt",
    "tasks", "seed", "batch_size", "sample_limit", "top_k", "first_temperature",
    "ban_openers", "opener_lexicon_version", "evalkit_version", "lm_eval_version",
    "transformers_version", "torch_version", "git_commit", "host", "duration_s",
    "config", "error", "pid", "pid_start", "heartbeat_at", "model_name", "kv_cache", "quant_detail", "attention",
    "attn_implementation", "engine", "unavailable",
)
SAMPLE_COLUMNS = (
    "run_id", "task", "doc_id", "prompt_hash", "prompt", "target", "response",
    "first_token", "first_token_id", "first_unit", "ft_outcome", "lang", "category",
    "ft_hit", "ft_token_hit", "ft_hit_prob", "opener_rate", "opener_mass",
    "prior_drift", "top3_mass", "top3_share", "unstable", "entropy", "needle_depth",
    "needle_length", "needle_tokens", "needle_hint", "needle_recall", "metrics",
    "top1_prob", "answer_hit", "ft_answer_mismatch", "answer",
    "sink_rate", "needle_attn", "question_attn", "first_wins", "last_wins", "conflict_both",
    "conflict_pick", "conflict_pair", "conflict_order", "answer_prob",
)
# the samples columns that hold one numeric per-sample metric value each (the registry says which)
SAMPLE_METRIC_COLUMNS = registry.per_sample_columns()
METRIC_COLUMNS = ("run_id", "task", "metric", "filter", "value", "stderr", "n", "ci_lo", "ci_hi")
TOPK_COLUMNS = ("run_id", "task", "doc_id", "rank", "token_id", "token", "logprob", "unit")
LEAD_COLUMNS = ("run_id", "task", "category", "signal", "auroc", "ci_lo", "ci_hi", "n", "n_right", "base_rate",
                "reason")
ATTENTION_COLUMNS = ("run_id", "task", "doc_id", "layer", "sink_rate", "sink_score", "needle_attn", "question_attn")
RESULT_TABLES = {"metrics": METRIC_COLUMNS, "samples": SAMPLE_COLUMNS, "first_token_topk": TOPK_COLUMNS,
                 "lead_indicators": LEAD_COLUMNS, "attention_layers": ATTENTION_COLUMNS}

# a run on another host is taken for abandoned when its heartbeat is older than this
STALE_AFTER = dt.timedelta(minutes=10)


def _check_columns(fields) -> None:
    unknown = set(fields) - set(RUN_COLUMNS)
    if unknown:
        raise ValueError(f"unknown run columns: {sorted(unknown)}")


def insert_run(path, row: dict[str, Any]):
    """Record a run as it starts (status 'running'); return the DB's `spool.Identity`, which binds
    the run's results to this DB should they have to be kept in a spool file."""
    from evalkit.store import spool

    _check_columns(row)
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
    from evalkit.store import spool

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


def _update(con, run_id: str, fields: dict[str, Any]) -> None:
    assignments = ", ".join(f"{c} = ?" for c in fields)
    con.execute(f"UPDATE runs SET {assignments} WHERE id = ?", [*fields.values(), run_id])


def mark_interrupted(path, run_id: str, error: str, duration_s: float) -> None:
    """Mark a run `interrupted`, unless it already finished."""
    with transaction(path, upkeep=False) as con:
        con.execute(
            "UPDATE runs SET status = 'interrupted', error = ?, finished_at = ?, duration_s = ? "
            "WHERE id = ? AND status = 'running'",
            [error, now(), duration_s, run_id],
        )


def heartbeat(path, run_id: str) -> None:
    """Refresh a running run's heartbeat (a short write; the caller ignores a busy DB)."""
    with transaction(path, upkeep=False) as con:
        con.execute("UPDATE runs SET heartbeat_at = ? WHERE id = ? AND status = 'running'", [now(), run_id])


def write_results(con, run_id: str, *, metrics, samples, topk, lead=(), attention=(), **fields: Any) -> None:
    """Insert a run's results and set its final columns, inside the caller's transaction."""
    _check_columns(fields)
    insert_rows(con, "metrics", METRIC_COLUMNS, metrics)
    insert_rows(con, "samples", SAMPLE_COLUMNS, samples)
    insert_rows(con, "first_token_topk", TOPK_COLUMNS, topk)
    insert_rows(con, "lead_indicators", LEAD_COLUMNS, list(lead))
    insert_rows(con, "attention_layers", ATTENTION_COLUMNS, list(attention))
    _update(con, run_id, fields)


def finish_run(path, run_id: str, *, metrics, samples, topk, lead=(), attention=(), **fields: Any) -> None:
    """Write a run's results and mark it finished, all in one transaction."""
    with transaction(path) as con:
        write_results(con, run_id, metrics=metrics, samples=samples, topk=topk, lead=lead, attention=attention,
                      **fields)


# ---- bulk insert --------------------------------------------------------------------------


def _arrow_type(duckdb_type: str):
    import pyarrow as pa

    return {"VARCHAR": pa.string(), "DOUBLE": pa.float64(), "INTEGER": pa.int32(), "BIGINT": pa.int64(),
            "BOOLEAN": pa.bool_(), "TIMESTAMP": pa.timestamp("us")}.get(duckdb_type, pa.string())


# rows per Arrow record batch handed to DuckDB: small enough that Arrow reuses its
# buffers (one 200k-row batch spends much of its time growing and faulting in memory)
_BATCH_ROWS = 8192


def insert_rows(con, table: str, columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    """Bulk insert through Arrow record batches (fast; executemany is row by row).

    The dicts become batches lazily, as DuckDB reads them: converting them (Python, under
    the GIL) overlaps DuckDB compressing and writing full row groups on another thread.
    A key missing from a dict is NULL; keys outside `columns` are ignored.
    """
    if not rows:
        return
    import pyarrow as pa

    types = dict(con.execute(
        "SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = ? AND database_name = "
        "current_database()", [table]).fetchall())
    schema = pa.schema([(c, _arrow_type(types[c])) for c in columns])
    row_type = pa.struct(schema)
    # dicts -> struct array (one C++ pass per batch) -> the batch's columns
    batches = (pa.RecordBatch.from_struct_array(pa.array(rows[i:i + _BATCH_ROWS], type=row_type))
               for i in range(0, len(rows), _BATCH_ROWS))
    arrow = pa.RecordBatchReader.from_batches(schema, batches)  # noqa: F841  (read by DuckDB's replacement scan)
    con.execute(f"INSERT INTO {table} ({', '.join(columns)}) SELECT {', '.join(columns)} FROM arrow")


# ---- liveness -----------------------------------------------------------------------------


def process_start(pid: int) -> str | None:
    """The start time of process `pid` as the kernel counts it (Linux), None where unknown.

    With the pid it tells a live run's process from a later process that reuses the pid.
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19] if len(fields) > 19 else None  # field 22 of stat(5), counted after "(comm)"


def this_process() -> dict[str, Any]:
    """The liveness columns of a run started by this process."""
    pid = os.getpid()
    return {"host": platform.node(), "pid": pid, "pid_start": process_start(pid), "heartbeat_at": now()}


def _process_gone(pid: int, pid_start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's process: it exists
        pass
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        if state in ("Z", "X"):  # a zombie has exited; only its exit status is left
            return True
    except (OSError, IndexError):
        pass
    current = process_start(pid)
    return pid_start is not None and current is not None and current != pid_start


def is_abandoned(status: RunStatus | None, host: str | None, pid: int | None, pid_start: str | None,
                 heartbeat_at: dt.datetime | None, at: dt.datetime | None = None) -> bool:
    """A `running` run whose process is gone: on this host, its pid no longer runs (or runs
    another program); elsewhere, its heartbeat is older than STALE_AFTER. Runs recorded
    before evalkit kept a pid count by their heartbeat alone (none: not abandoned)."""
    if status != "running":
        return False
    if host == platform.node() and pid:
        return _process_gone(int(pid), pid_start)
    if heartbeat_at is None:
        return False
    return (at or now()) - heartbeat_at > STALE_AFTER


def abandoned_ids(con) -> list[str]:
    """Ids of the `running` runs whose process is gone (reads only)."""
    rows = con.execute(
        "SELECT id, status, host, pid, pid_start, heartbeat_at FROM runs WHERE status = 'running'"
    ).fetchall()
    return [r[0] for r in rows if is_abandoned(*r[1:])]


def mark_abandoned(con) -> list[str]:
    """Record as `abandoned` every running run whose process is gone; return their ids."""
    ids = abandoned_ids(con)
    if ids:
        try:
            con.execute(
                "UPDATE runs SET status = 'abandoned', error = coalesce(error, 'its process ended without "
                "finishing the run') WHERE status = 'running' AND id IN (SELECT unnest(?::VARCHAR[]))", [ids])
        except duckdb.TransactionException:  # another connection of this process is updating it
            return []
    return ids
