"""Read-side questions the commands ask of the DB (runs list, one run's summary).

Owns: the SQL of `runs` and `show`. Does not: format output or write.
"""

from __future__ import annotations

from typing import Any

from evalkit.store.db import open_store, resolve_run


def _read(path, fn):
    with open_store(path, read_only=True) as con:
        return fn(con)


def list_runs(path, limit: int = 50):
    def q(con):
        cur = con.execute(
            """
            SELECT id, created_at, status, name, model, quant, template, tasks,
                   round(duration_s, 1) AS duration_s
            FROM runs ORDER BY created_at DESC, id DESC LIMIT ?
            """,
            [limit],
        )
        return [d[0] for d in cur.description], cur.fetchall()

    return _read(path, q)


def run_summary(path, ref: str) -> tuple[dict[str, Any], list[str], list[tuple]]:
    def q(con):
        run_id = resolve_run(con, ref)
        cur = con.execute(
            "SELECT id, name, status, created_at, finished_at, round(duration_s, 1) AS duration_s, model, "
            "quant, dtype, template, system_prompt, tasks, seed, sample_limit, first_temperature, ban_openers, "
            "opener_lexicon_version, model_fingerprint, lm_eval_version, git_commit, error FROM runs WHERE id = ?",
            [run_id],
        )
        cols = [d[0] for d in cur.description]
        info = dict(zip(cols, cur.fetchone()))
        cur = con.execute(
            "SELECT task, metric, value, stderr, n FROM metrics WHERE run_id = ? ORDER BY task, metric", [run_id]
        )
        return info, [d[0] for d in cur.description], cur.fetchall()

    return _read(path, q)


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
