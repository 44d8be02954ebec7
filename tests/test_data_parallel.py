"""A real data-parallel launch: `torchrun --nproc_per_node 2` (gloo, CPU) of `evalkit run`.

- Each rank computes only its share of the prompts (lm-eval's doc split by `lm.rank` /
  `lm.world_size`), and says how many it computed; the shares add up to the prompts, none twice
  (lm-eval's padding copy of a short rank's last request is not computed again).
- Rank 0 gathers the shares and stores one run equal to a single-process run of the same
  prompts: the same samples, metrics and first_token_topk rows, value for value, when both
  run one prompt per batch on one thread (the same arithmetic); rank 1 stores nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
COMPUTED = re.compile(r"evalkit: rank (\d+) of (\d+) computed (\d+) prompts")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                              "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    return {**env, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **extra}


def _run(cmd: list[str], db: Path) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(EVALKIT_DB=str(db)), timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def _rows(db: Path) -> dict[str, list[tuple]]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        (run_id,), = con.execute("SELECT id FROM runs WHERE status = 'done'").fetchall()
        out = {}
        for table, order in (("samples", "task, doc_id"), ("first_token_topk", "task, doc_id, rank"),
                             ("metrics", "task, metric, filter")):
            out[table] = con.execute(f"SELECT * EXCLUDE (run_id) FROM {table} WHERE run_id = ? ORDER BY {order}",
                                     [run_id]).fetchall()
        return out
    finally:
        con.close()


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this python")
def test_two_processes_share_the_prompts_and_store_what_one_process_stores(tiny_model_dir, tmp_path):
    args = ["run", "--model", "hf", "--model-args", f"pretrained={tiny_model_dir}", "--tasks", "firsttoken",
            "--limit", "5", "--batch-size", "1"]
    launched = _run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "-m", "evalkit", *args,
                     "--db", str(tmp_path / "two.duckdb")], tmp_path / "two.duckdb")
    single = _run([sys.executable, "-m", "evalkit", *args, "--db", str(tmp_path / "one.duckdb")],
                  tmp_path / "one.duckdb")

    # 2 tasks x 5 prompts: rank 0 gets documents 0, 2, 4 of each, rank 1 documents 1, 3
    computed = {int(r): int(n) for r, w, n in COMPUTED.findall(launched.stderr) if w == "2"}
    assert computed == {0: 6, 1: 4}, launched.stderr[-3000:]
    assert "not stored: this is rank 1 of 2, which computed 4 prompts" in launched.stdout
    assert launched.stdout.count(" done ") == 1  # one stored run, by rank 0
    assert not COMPUTED.search(single.stderr)  # a single process is no launch

    two, one = _rows(tmp_path / "two.duckdb"), _rows(tmp_path / "one.duckdb")
    assert len(one["samples"]) == 10 and len(one["first_token_topk"]) == 10 * 50
    assert len({(s[0], s[1]) for s in two["samples"]}) == len(two["samples"]) == 10  # none lost, none twice
    for table in one:
        assert two[table] == one[table], table
