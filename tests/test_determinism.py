"""Reliability, determinism: same seed and configuration → identical metric values and sample rows.

Compared in SQL: EXCEPT ALL both ways over every column but run_id, for
metrics, samples and first_token_topk; with the fake LM and with evalkit's
probing hf model on the tiny random Llama.
"""

from __future__ import annotations

import duckdb
import pytest

from evalkit.runner.execute import RunConfig, execute

TABLES = ("metrics", "samples", "first_token_topk")


def differences(db, table: str, run_a: str, run_b: str) -> tuple[int, int, list[tuple]]:
    """(rows of A, rows of B, rows in one run but not the other) over every column but run_id."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        cols = [r[0] for r in con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ? AND column_name <> 'run_id' "
            "ORDER BY ordinal_position", [table],
        ).fetchall()]
        select = f"SELECT {', '.join(cols)} FROM {table} WHERE run_id = ?"
        n_a = con.execute(f"SELECT count(*) FROM {table} WHERE run_id = ?", [run_a]).fetchone()[0]
        n_b = con.execute(f"SELECT count(*) FROM {table} WHERE run_id = ?", [run_b]).fetchone()[0]
        diff = con.execute(
            f"({select} EXCEPT ALL {select}) UNION ALL ({select} EXCEPT ALL {select}) LIMIT 5",
            [run_a, run_b, run_b, run_a],
        ).fetchall()
        return n_a, n_b, diff
    finally:
        con.close()


def two_runs(cfg: RunConfig) -> tuple[str, str]:
    a = execute(cfg)
    b = execute(cfg)
    assert a.status == b.status == "done"
    assert a.run_id != b.run_id
    return a.run_id, b.run_id


def test_fake_lm_runs_are_identical(tmp_path):
    db = tmp_path / "evalkit.duckdb"
    cfg = RunConfig(tasks=["firsttoken"], model="evalkit-fake", model_args="mode=opener", limit=4, seed=7, db=str(db))
    run_a, run_b = two_runs(cfg)
    for table in ("metrics", "samples"):
        n_a, n_b, diff = differences(db, table, run_a, run_b)
        assert n_a == n_b > 0, (table, n_a, n_b)
        assert diff == [], f"{table} differ: {diff}"


@pytest.mark.parametrize("template", ["chat", "direct"])
def test_probe_model_runs_are_identical(tiny_model_dir, tmp_path, template):
    db = tmp_path / "evalkit.duckdb"
    cfg = RunConfig(
        tasks=["firsttoken"], model="hf", model_args=f"pretrained={tiny_model_dir}", device="cpu",
        limit=3, seed=11, template=template, db=str(db),
    )
    run_a, run_b = two_runs(cfg)
    for table in TABLES:
        n_a, n_b, diff = differences(db, table, run_a, run_b)
        assert n_a == n_b > 0, (table, n_a, n_b)
        assert diff == [], f"{table} differ: {diff}"
    con = duckdb.connect(str(db), read_only=True)
    try:  # the top-k holds k >= 50 candidates per prompt (see docs/storage-and-sql.md), so the comparison covers them
        per_prompt = con.execute(
            "SELECT min(n) FROM (SELECT count(*) AS n FROM first_token_topk WHERE run_id = ? GROUP BY task, doc_id)",
            [run_a],
        ).fetchone()[0]
    finally:
        con.close()
    assert per_prompt >= 50
