"""Ingest budget: DuckDB takes ≥ 100k sample rows/s.

Usage: python bench/ingest.py [--rows 200000] [--topk-rows 1000000]

Builds synthetic rows shaped like a real run's (every SAMPLE_COLUMNS field,
~150-character prompts, a per-sample metrics JSON) in memory, then times
`runs.finish_run` on a fresh DB file: the one transaction a run ends with
(metrics + samples + first_token_topk + the run row's UPDATE, then COMMIT).
Row building is not timed; the dict → Arrow conversion inside
`rows.insert_rows` is. Reported separately: samples alone through
`_insert_rows`, and first_token_topk rows (a run writes k ≥ 50 per prompt).
Process CPU seconds are printed too: on a shared, busy machine they say more
than wall time (DuckDB uses a second thread to compress while Python converts
rows, so CPU can exceed wall).

Not timed, but printed: importing pyarrow and pandas (DuckDB imports pandas
the first time it scans a Python object). A run has imported both before it
finishes (lm-eval imports `datasets`, which imports them), so `finish_run`
never pays for them there.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evalkit.store import db as store_db  # noqa: E402  (after the sys.path line above)
from evalkit.store import rows, runs  # noqa: E402

TARGET_ROWS_PER_S = 100_000


def sample_rows(run_id: str, n: int) -> list[dict]:
    rng = random.Random(0)
    words = ["recursion", "paris", "sure", "certainly", "the", "of", "a", "is", "to",
             "递归", "巴黎", "好的", "当然", "首先"]
    rows = []
    for i in range(n):
        lang = "zh" if i % 2 else "en"
        prompt = " ".join(rng.choice(words) for _ in range(25))
        ft_hit = float(rng.random() < 0.5)
        metrics = {"ft_hit": ft_hit, "ft_hit_prob": rng.random(), "opener_rate": 1 - ft_hit,
                   "opener_mass": rng.random(), "prior_drift": rng.random(), "top3_mass": rng.random()}
        rows.append({
            "run_id": run_id, "task": f"firsttoken_{lang}", "doc_id": f"{lang}-{i:07d}",
            "prompt_hash": f"{rng.getrandbits(64):016x}", "prompt": prompt, "target": json.dumps(["Recursion"]),
            "response": "Recursion is a function calling itself.", "first_token": "Rec", "first_token_id": 1234,
            "first_unit": "Recursion", "ft_outcome": "hit" if ft_hit else "opener", "lang": lang, "category": "def",
            "ft_hit": ft_hit, "ft_token_hit": ft_hit, "ft_hit_prob": metrics["ft_hit_prob"],
            "opener_rate": 1 - ft_hit, "opener_mass": metrics["opener_mass"], "prior_drift": metrics["prior_drift"],
            "top3_mass": metrics["top3_mass"], "top3_share": None, "unstable": None, "entropy": rng.random() * 5,
            "needle_depth": None, "needle_length": None, "needle_tokens": None, "needle_hint": None,
            "needle_recall": None, "metrics": json.dumps(metrics),
        })
    return rows


def topk_rows(run_id: str, n: int, k: int = 50) -> list[dict]:
    rng = random.Random(1)
    return [
        {"run_id": run_id, "task": "firsttoken_en", "doc_id": f"en-{i // k:07d}", "rank": i % k,
         "token_id": rng.randrange(49152), "token": "tok", "logprob": -rng.random() * 10}
        for i in range(n)
    ]


def new_run(db: Path, run_id: str) -> None:
    runs.insert_run(db, {"id": run_id, "created_at": store_db.now(), "status": "running", "model": "bench"})


def preload() -> float:
    """Import what a run has imported before `finish_run` (see the module docstring); seconds taken."""
    t0 = time.perf_counter()
    import pandas  # noqa: F401
    import pyarrow  # noqa: F401

    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--topk-rows", type=int, default=1_000_000)
    args = parser.parse_args()
    import_s = preload()
    with tempfile.TemporaryDirectory(prefix="evalkit-ingest-") as tmp:
        db = Path(tmp) / "evalkit.duckdb"
        results = []

        new_run(db, "r1")
        samples = sample_rows("r1", args.rows)
        metrics = [{"run_id": "r1", "task": "firsttoken_en", "metric": "ft_hit", "filter": "none",
                    "value": 0.5, "stderr": 0.01, "n": args.rows}]
        t0, c0 = time.perf_counter(), time.process_time()
        runs.finish_run(db, "r1", metrics=metrics, samples=samples, topk=[], status="done",
                         finished_at=store_db.now(), duration_s=1.0)
        results.append(("finish_run, samples", args.rows, time.perf_counter() - t0, time.process_time() - c0))

        new_run(db, "r2")
        samples = sample_rows("r2", args.rows)
        with store_db.transaction(db) as con:
            t0, c0 = time.perf_counter(), time.process_time()
            rows.insert_rows(con, "samples", rows.SAMPLE_COLUMNS, samples)
            results.append(("_insert_rows, samples", args.rows, time.perf_counter() - t0, time.process_time() - c0))

        new_run(db, "r3")
        topk = topk_rows("r3", args.topk_rows)
        t0, c0 = time.perf_counter(), time.process_time()
        runs.finish_run(db, "r3", metrics=[], samples=[], topk=topk, status="done",
                         finished_at=store_db.now(), duration_s=1.0)
        results.append(("finish_run, top-k", args.topk_rows, time.perf_counter() - t0, time.process_time() - c0))

        with store_db.open_reader(db) as con:
            stored = con.execute("SELECT count(*) FROM samples").fetchone()[0]
        assert stored == 2 * args.rows, stored
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (wall time suffers when others run)")
    print(f"importing pyarrow + pandas (done by lm-eval before a run's finish_run; not timed): {import_s:.2f} s")
    for label, n, seconds, cpu in results:
        rate = n / seconds
        verdict = "ok" if rate >= TARGET_ROWS_PER_S else "UNDER TARGET"
        print(f"{label:<24} {n:>9,} rows in {seconds:6.3f} s = {rate:>11,.0f} rows/s  "
              f"(process CPU {cpu:6.3f} s = {n / cpu:>11,.0f} rows/CPU-s)"
              f"   target >= {TARGET_ROWS_PER_S:,} rows/s: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
