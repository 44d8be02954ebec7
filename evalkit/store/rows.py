"""The rows a run writes, and whether a `running` run is still alive, on a connection the caller holds.

Owns: the columns of `runs`, `metrics`, `samples`, `first_token_topk`, `lead_indicators` and
`attention_layers` as evalkit writes them; writing a run's results inside the caller's transaction
(`write_results`); the bulk insert through Arrow; the run's liveness — the process that runs it
(host, pid, pid start time), its heartbeat, and deciding that a run whose process is gone is
`abandoned` (readers show it so; writers record it, `mark_abandoned`).
Does not: open the file (`db`), keep results that cannot be written (`spool`), or open the
transactions of a run's life (`runs`).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from collections.abc import Sequence
from typing import Any

import duckdb

from evalkit import redact
from evalkit.kinds import RunStatus
from evalkit.scoring import degenerate, registry
from evalkit.store.db import now

RUN_COLUMNS = (
    "id", "created_at", "finished_at", "status", "name", "model", "model_args",
    "model_fingerprint", "dtype", "quant", "template", "template_text", "system_prompt",
    "tasks", "seed", "batch_size", "sample_limit", "top_k", "first_temperature",
    "ban_openers", "opener_lexicon_version", "evalkit_version", "lm_eval_version",
    "transformers_version", "torch_version", "git_commit", "host", "duration_s",
    "config", "error", "pid", "pid_start", "heartbeat_at", "model_name", "kv_cache", "quant_detail", "attention",
    "attn_implementation", "engine", "unavailable", "tokenizer_hash", "tokenizer_source", "batch_positions",
    "trie_positions", "memory_budget", "metric_selection", "fed", "fed_note", "model_arch", "model_file_type",
)
SAMPLE_COLUMNS = (
    "run_id", "task", "doc_id", "prompt_hash", "prompt", "target", "response",
    "first_token", "first_token_id", "first_unit", "ft_outcome", "lang", "category",
    "ft_hit", "ft_token_hit", "ft_hit_prob", "opener_rate", "opener_mass",
    "prior_drift", "top3_mass", "top3_share", "unstable", "entropy", "needle_depth",
    "needle_length", "needle_tokens", "needle_hint", "needle_recall", "metrics",
    "top1_prob", "answer_hit", "ft_answer_mismatch", "answer",
    "sink_rate", "needle_attn", "question_attn", "first_wins", "last_wins", "conflict_both",
    "conflict_pick", "conflict_pair", "conflict_order", "answer_prob", "opener_start_mass", "ws_mass",
    "special_mass",
    "fc_rest_mass", "fc_unresolved_mass",
)
# the samples columns that hold one numeric per-sample metric value each (the registry says which)
SAMPLE_METRIC_COLUMNS = registry.per_sample_columns()
METRIC_COLUMNS = ("run_id", "task", "metric", "filter", "value", "stderr", "n", "ci_lo", "ci_hi")
TOPK_COLUMNS = ("run_id", "task", "doc_id", "rank", "token_id", "token", "logprob", "unit")
LEAD_COLUMNS = ("run_id", "task", "category", "signal", "auroc", "ci_lo", "ci_hi", "n", "n_right", "base_rate",
                "reason")
ATTENTION_COLUMNS = ("run_id", "task", "doc_id", "layer", "sink_rate", "sink_score", "needle_attn", "question_attn")
FIRST_CHAR_COLUMNS = ("run_id", "task", "doc_id", "rank", "event", "prob")  # `firstchar`'s top events (m030)
DEGENERATE_COLUMNS = degenerate.COLUMNS  # one row per run x task: its responses counted, flagged or not (m029)
RESULT_TABLES = {"metrics": METRIC_COLUMNS, "samples": SAMPLE_COLUMNS, "first_token_topk": TOPK_COLUMNS,
                 "lead_indicators": LEAD_COLUMNS, "attention_layers": ATTENTION_COLUMNS,
                 "degenerate": DEGENERATE_COLUMNS, "first_char_topk": FIRST_CHAR_COLUMNS}

# a run on another host is taken for abandoned when its heartbeat is older than this
STALE_AFTER = dt.timedelta(minutes=10)


def _check_columns(fields) -> None:
    unknown = set(fields) - set(RUN_COLUMNS)
    if unknown:
        raise ValueError(f"unknown run columns: {sorted(unknown)}")


def scrub_row(fields: dict[str, Any]) -> dict[str, Any]:
    """A row as it may be stored: every registered secret and URL credential in its text as `***`
    (`redact.value`); every write of a run row or result rows passes through here."""
    return redact.value(fields)


def _update(con, run_id: str, fields: dict[str, Any]) -> None:
    fields = scrub_row(fields)
    assignments = ", ".join(f"{c} = ?" for c in fields)
    con.execute(f"UPDATE runs SET {assignments} WHERE id = ?", [*fields.values(), run_id])


def write_results(con, run_id: str, *, metrics, samples, topk, lead=(), attention=(), flags=(), first_char=(),
                  **fields: Any) -> None:
    """Insert a run's results and set its final columns, inside the caller's transaction."""
    _check_columns(fields)
    insert_rows(con, "metrics", METRIC_COLUMNS, metrics)
    insert_rows(con, "samples", SAMPLE_COLUMNS, samples)
    insert_rows(con, "first_token_topk", TOPK_COLUMNS, topk)
    insert_rows(con, "lead_indicators", LEAD_COLUMNS, list(lead))
    insert_rows(con, "attention_layers", ATTENTION_COLUMNS, list(attention))
    insert_rows(con, "degenerate", DEGENERATE_COLUMNS, list(flags))  # `scoring.degenerate.task_rows`
    insert_rows(con, "first_char_topk", FIRST_CHAR_COLUMNS, list(first_char))  # `collect.first_char_rows`
    _update(con, run_id, fields)


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
    if redact.active():  # a registered secret a server sent back in a text is stored as ***
        rows = [scrub_row(r) for r in rows]
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
