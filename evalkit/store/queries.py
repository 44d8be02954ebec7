"""Read-side questions the commands ask of the DB: which run a name means, the runs list, one run.

Owns: `resolve_run` (an id, a unique id prefix, `latest`, `tag:NAME` or a run name to
a run id), the SQL of `runs`, `show` and `needle-heatmap`, and showing a `running` run
whose process is gone as `abandoned` (see `rows.is_abandoned`; only writers record it).
Does not: format output or write.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Any

import duckdb

from evalkit.errors import BadInput
from evalkit.kinds import ShownStatus
from evalkit.scoring.lead import SIGNALS as LEAD_SIGNALS
from evalkit.store.db import db_path, open_reader
from evalkit.store.promotions import current_run
from evalkit.store.rows import is_abandoned
from evalkit.store.spool import pending_ids

_LIVENESS = "status, host, pid, pid_start, heartbeat_at"


LATEST = "latest"  # the newest run
TAG_PREFIX = "tag:"  # tag:NAME, the newest run with that tag


def unaddressable_name(name: str) -> str | None:
    """Why a run called `name` could never be found by it (`resolve_run` reads `latest` and
    `tag:...` first), None when it can be.

    >>> unaddressable_name("latest"), unaddressable_name("tag:prod"), unaddressable_name("baseline")
    ('`latest` always means the newest run', '`tag:...` always names a tag', None)
    """
    name = name.strip()
    if name == LATEST:
        return f"`{LATEST}` always means the newest run"
    if name.startswith(TAG_PREFIX):
        return f"`{TAG_PREFIX}...` always names a tag"
    return None


def dangling(tag: str, run_id: str) -> str:
    """The line for a tag whose current run is gone from the DB (deleted by another client)."""
    return (f"tag:{tag} points to run {run_id}, which is gone from the DB (deleted outside evalkit); "
            f"promote a run to it again (evalkit promote RUN --tag {tag}), or see `evalkit tags {tag}`")


def resolve_run(con: duckdb.DuckDBPyConnection, ref: str) -> str:
    """A run id from an id, a unique id prefix, `latest`, `tag:NAME` (the run promoted to NAME
    most recently), or a run's `--name` (the newest `done` run of that name, else the newest of
    any status)."""
    ref = ref.strip()
    if ref == LATEST:
        row = con.execute("SELECT id FROM runs ORDER BY created_at DESC, id DESC LIMIT 1").fetchone()
        if row is None:
            raise BadInput("no runs in the database yet")
        return row[0]
    if ref.startswith(TAG_PREFIX):
        tag = ref[len(TAG_PREFIX):]
        run_id = current_run(con, tag)  # the run promoted to it most recently (a rollback moves it back)
        if run_id is None:
            raise BadInput(f"no run has the tag {tag!r}")
        if not con.execute("SELECT count(*) FROM runs WHERE id = ?", [run_id]).fetchone()[0]:
            raise BadInput(dangling(tag, run_id))
        return run_id
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


def _read(path, fn):
    with open_reader(path) as con:
        return fn(con)


def _shown(row: tuple, run_id: str, kept: AbstractSet[str]) -> ShownStatus:
    status = row[0]
    if status == "running" and run_id in kept:
        return "kept"
    return "abandoned" if is_abandoned(*row) else status


def shown_status(con: duckdb.DuckDBPyConnection, run_id: str, kept: AbstractSet[str] = frozenset()) -> ShownStatus:
    """A run's status as a reader shows it: `kept` for a finished run whose results wait in a
    spool file (`kept` holds their ids), `abandoned` for a running run whose process is gone."""
    row = con.execute(f"SELECT {_LIVENESS} FROM runs WHERE id = ?", [run_id]).fetchone()
    return _shown(row, run_id, kept)


def list_runs(path, limit: int = 50):
    """(columns, rows) of the newest `limit` runs, newest first."""
    if limit < 1:
        raise BadInput(f"--limit must be at least 1, got {limit}")
    kept = pending_ids(db_path(path))

    def q(con):
        cur = con.execute(
            f"""
            SELECT id, created_at, status, name, coalesce(model_name, model) AS model, engine, quant, template, kv_cache,
                   tasks,
                   round(duration_s, 1) AS duration_s,
                   (SELECT '⚠ ' || string_agg(d.task, ', ' ORDER BY d.task) FROM degenerate d
                    WHERE d.run_id = runs.id AND d.degenerate) AS degenerate, {_LIVENESS}
            FROM runs ORDER BY created_at DESC, id DESC LIMIT ?
            """,
            [limit],
        )
        shown = len(cur.description) - len(_LIVENESS.split(","))  # the columns before the liveness ones
        cols = [d[0] for d in cur.description][:shown]
        rows = []
        for r in cur.fetchall():
            r = list(r)
            r[2] = _shown(tuple(r[shown:]), r[0], kept)
            rows.append(tuple(r[:shown]))
        return cols, rows

    return _read(path, q)


def lead_rows(path, ref: str, category: str = "*") -> tuple[str, list[dict[str, Any]]]:
    """(run id, the run's leading-indicator rows of one category, `*` = all checkable prompts)."""

    def q(con):
        run_id = resolve_run(con, ref)
        cur = con.execute(
            "SELECT task, signal, auroc, ci_lo, ci_hi, n, n_right, base_rate, reason FROM lead_indicators "
            "WHERE run_id = ? AND category = ? ORDER BY task, list_position(?, signal)",
            [run_id, category, list(LEAD_SIGNALS)],
        )
        cols = [d[0] for d in cur.description]
        return run_id, [dict(zip(cols, r)) for r in cur.fetchall()]

    return _read(path, q)


def run_summary(path, ref: str) -> tuple[dict[str, Any], list[str], list[tuple]]:
    def q(con):
        run_id = resolve_run(con, ref)
        cur = con.execute(
            "SELECT id, name, status, created_at, finished_at, round(duration_s, 1) AS duration_s, model_name, model, "
            "model_arch, model_file_type, engine, quant, dtype, kv_cache, template, fed, fed_note, system_prompt, tasks, seed, "
            "sample_limit, batch_size, "
            "batch_positions, trie_positions, memory_budget, first_temperature, "
            "ban_openers, metric_selection, unavailable, "
            "attention, attn_implementation, opener_lexicon_version, model_fingerprint, tokenizer_hash, tokenizer_source, "
            "lm_eval_version, git_commit, "
            "host, pid, error FROM runs WHERE id = ?",
            [run_id],
        )
        cols = [d[0] for d in cur.description]
        info = dict(zip(cols, cur.fetchone()))
        info["status"] = shown_status(con, run_id, pending_ids(db_path(path)))
        flags = degenerate_flags(con, run_id)
        info["degenerate"] = "; ".join(f"⚠ {f['task']}: {f['reason']}" for f in flags) or None
        cur = con.execute(
            "SELECT task, metric, filter, value, stderr, ci_lo, ci_hi, n FROM metrics WHERE run_id = ? "
            "ORDER BY task, metric, filter",
            [run_id]
        )
        return info, [d[0] for d in cur.description], cur.fetchall()

    return _read(path, q)


def degenerate_flags(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict[str, Any]]:
    """The run's tasks flagged as degenerate output (`scoring.degenerate`, the `degenerate` table), by task:
    [{task, reason, n, n_empty, n_at_once, n_repeated, special_mass, example}]; [] when none is (or the run
    was not checked: stored before m029)."""
    cur = con.execute("SELECT task, reason, n, n_empty, n_at_once, n_repeated, special_mass, example FROM degenerate "
                      "WHERE run_id = ? AND degenerate ORDER BY task", [run_id])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def needle_cells(path, ref: str) -> tuple[str, list[dict[str, Any]]]:
    """(run id, rows of the needle_heatmap view for that run)."""

    def q(con):
        run_id = resolve_run(con, ref)
        cur = con.execute(
            "SELECT lang, hint, depth, length, recall, n FROM needle_heatmap WHERE run_id = ? "
            "ORDER BY lang, hint, length, depth",
            [run_id],
        )
        cols = [d[0] for d in cur.description]
        return run_id, [dict(zip(cols, r)) for r in cur.fetchall()]

    return _read(path, q)


def not_computed(con, run_id: str) -> dict[str, str]:
    """{metric: why} of what the run did not compute (its row's `unavailable`: what `evalkit run --metrics`
    skipped, what its engine cannot compute); {} when it computed everything."""
    import json

    (text,) = con.execute("SELECT unavailable FROM runs WHERE id = ?", [run_id]).fetchone()
    try:
        found = json.loads(text) if text else {}
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}
