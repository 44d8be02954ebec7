"""bench/device_check.py, the agreement table of scripts/gpu_check.sh, on stored runs it can read.

- Two copies of the same runs agree: every difference 0, PASS, exit 0.
- A per-prompt metric that moved past its tolerance, a flipped top-1 token, or a run made on
  one side only is a FAIL (exit 1) naming the check.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[1]


def check(a: Path, b: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "device_check.py"), str(a), str(b), "--device", "cuda"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def edit(db: Path, *sql: str) -> None:
    con = duckdb.connect(str(db))
    try:
        for statement in sql:
            con.execute(statement)
    finally:
        con.close()


def topk_rows(db: Path, first: int) -> None:
    """Give every sample two top-k rows, token `first` on top."""
    con = duckdb.connect(str(db))
    try:
        for run_id, task, doc_id in con.execute("SELECT run_id, task, doc_id FROM samples").fetchall():
            for rank, (token, lp) in enumerate(((first, -0.1), (first + 1, -2.5))):
                con.execute("INSERT INTO first_token_topk (run_id, task, doc_id, rank, token_id, token, logprob) "
                            "VALUES (?, ?, ?, ?, ?, ?, ?)", [run_id, task, doc_id, rank, token, str(token), lp])
    finally:
        con.close()


def test_copies_agree_and_a_moved_value_fails(fake_run, tmp_path):
    cpu, dev = tmp_path / "cpu.duckdb", tmp_path / "dev.duckdb"
    fake_run(cpu)
    edit(cpu, "UPDATE samples SET ft_hit_prob = 0.5")
    topk_rows(cpu, 7)
    shutil.copy(cpu, dev)
    out = check(cpu, dev)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "agreement: PASS" in out.stdout and "max |Δ ft_hit_prob|" in out.stdout
    assert "top-1 flip rate                0.00e+00" in out.stdout

    edit(dev, "UPDATE samples SET ft_hit_prob = 0.502 WHERE doc_id = (SELECT min(doc_id) FROM samples)")
    out = check(cpu, dev)
    assert out.returncode == 1
    line = next(x for x in out.stdout.splitlines() if "max |Δ ft_hit_prob|" in x)
    assert "2.00e-03" in line and line.endswith("FAIL")


def test_a_flipped_top_token_and_an_unpaired_run_fail(fake_run, tmp_path):
    cpu, dev = tmp_path / "cpu.duckdb", tmp_path / "dev.duckdb"
    fake_run(cpu)
    shutil.copy(cpu, dev)
    topk_rows(cpu, 7)
    topk_rows(dev, 8)
    out = check(cpu, dev)
    assert out.returncode == 1
    assert next(x for x in out.stdout.splitlines() if "top-1 flip rate" in x).endswith("FAIL")
    edit(dev, "DELETE FROM first_token_topk")
    edit(dev, "UPDATE runs SET quant = 'bf16'")
    out = check(cpu, dev)
    assert out.returncode == 1 and out.stdout.count("unpaired run") == 2
