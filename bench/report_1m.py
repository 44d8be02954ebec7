"""Bench: `evalkit report` over 1M sample rows must take < 5 s.

Builds a DuckDB file with 10 done runs and 1,000,000 synthetic sample rows
(first-token and needle rows), their metric rows (aggregated by DuckDB from the
samples) and 1,000,000 first_token_topk rows (2,000 prompts × 50 ranks per run),
all inserted with `INSERT ... SELECT FROM range(...)`. Then it times the report
twice: the library function in this process, and the `evalkit report` command
as a fresh subprocess (imports included), and prints each next to the target.
CPU seconds include the worker processes that draw the figures. Each report
must hold all five sections, none omitted, and every PNG the page links to.

    python bench/report_1m.py [--rows 1000000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 5.0
RUNS = 10
SECTIONS = ("runs", "leaderboard", "first-token", "needle", "trend")
PNG = b"\x89PNG\r\n\x1a\n"
TOPK_PROMPTS = 2_000  # per run
TOPK_K = 50
SAMPLE_METRICS = ("ft_hit", "ft_token_hit", "ft_hit_prob", "opener_rate", "opener_mass", "prior_drift",
                  "top3_mass", "unstable", "entropy")


def build(db: Path, rows: int) -> None:
    from evalkit.store.db import open_writer

    with open_writer(db) as con:
        con.execute("BEGIN TRANSACTION")
        for i in range(RUNS):
            model = f"/models/model-{i % 3}"
            con.execute(
                "INSERT INTO runs (id, created_at, finished_at, status, name, model, model_args, quant, template, "
                "tasks, seed, sample_limit, top_k, duration_s) VALUES (?, TIMESTAMP '2026-01-01' + to_hours(?), "
                "TIMESTAMP '2026-01-01' + to_hours(?) + to_minutes(30), 'done', ?, 'hf', ?, ?, ?, ?, 1234, NULL, ?, 1800)",
                [f"bench-{i:02d}", i, i, f"bench {i}", json.dumps({"pretrained": model}),
                 ["fp32", "int8-dynamic"][i % 2], ["chat", "plain"][i // 5], ["firsttoken", "needle"], TOPK_K],
            )
        # one row per r: run r % RUNS; 80 % first-token prompts (en / zh), 20 % needle prompts
        con.execute(
            f"""
            INSERT INTO samples (run_id, task, doc_id, prompt_hash, prompt, target, response, first_token,
                first_token_id, first_unit, ft_outcome, lang, category, ft_hit, ft_token_hit, ft_hit_prob,
                opener_rate, opener_mass, prior_drift, top3_mass, unstable, entropy, needle_depth,
                needle_length, needle_tokens, needle_hint, needle_recall, metrics)
            WITH base AS (
                SELECT r, r % {RUNS} AS run, r // {RUNS} AS doc, (r // {RUNS}) % 10 AS kind,
                       hash(r) % 1000 / 1000.0 AS u
                FROM range({rows}) t(r)
            )
            SELECT printf('bench-%02d', run),
                   CASE WHEN kind < 4 THEN 'firsttoken_en' WHEN kind < 8 THEN 'firsttoken_zh' ELSE 'needle_en' END,
                   'd-' || doc, md5(doc::VARCHAR),
                   'What is item ' || doc || ' of the synthetic benchmark, in one word?',
                   '["Answer"]', CASE WHEN u < 0.6 THEN 'Answer is here.' ELSE 'Sure! Let me explain.' END,
                   CASE WHEN u < 0.6 THEN 'Answer' ELSE 'Sure' END, CASE WHEN u < 0.6 THEN 11 ELSE 12 END,
                   CASE WHEN u < 0.6 THEN 'answer' ELSE 'sure' END,
                   CASE WHEN u < 0.6 THEN 'hit' ELSE 'opener' END,
                   CASE WHEN kind BETWEEN 4 AND 7 THEN 'zh' ELSE 'en' END, 'synthetic',
                   (u < 0.6)::DOUBLE, (u < 0.55)::DOUBLE, 0.6 * u + 0.2 * run / {RUNS},
                   (u >= 0.6)::DOUBLE, 0.4 * (1 - u), u, 0.5 + 0.4 * u, (u < 0.2)::DOUBLE, 3 * u,
                   CASE WHEN kind >= 8 THEN (doc % 11) / 10.0 END,
                   CASE WHEN kind >= 8 THEN [256, 512, 1024, 2048][1 + (doc // 11) % 4] END,
                   CASE WHEN kind >= 8 THEN [256, 512, 1024, 2048][1 + (doc // 11) % 4] - 2 END,
                   CASE WHEN kind >= 8 THEN kind = 9 END,
                   CASE WHEN kind >= 8 THEN (u < 0.5 + 0.4 * abs((doc % 11) / 10.0 - 0.5))::DOUBLE END,
                   '{{}}'
            FROM base
            """
        )
        unpivot = ", ".join(SAMPLE_METRICS) + ", needle_recall"
        con.execute(
            f"""
            INSERT INTO metrics
            SELECT run_id, task, metric, 'none', avg(value), stddev_samp(value) / sqrt(count(*)), count(*)
            FROM (UNPIVOT (SELECT run_id, task, {unpivot} FROM samples) ON {unpivot}
                  INTO NAME metric VALUE value)
            GROUP BY run_id, task, metric
            """
        )
        # top-k: the first TOPK_PROMPTS first-token prompts of each run, geometric probabilities
        con.execute(
            f"""
            INSERT INTO first_token_topk
            SELECT s.run_id, s.task, s.doc_id, k.rank,
                   CASE WHEN k.rank = 0 THEN s.first_token_id ELSE 100 + (k.rank + hash(s.doc_id) % 3) END,
                   CASE WHEN k.rank = 0 THEN s.first_token ELSE ' tok' || k.rank END,
                   ln(0.5) * (k.rank + 1)
            FROM (SELECT run_id, task, doc_id, first_token_id, first_token,
                         row_number() OVER (PARTITION BY run_id ORDER BY doc_id) AS i
                  FROM samples WHERE task LIKE 'firsttoken%') s,
                 range({TOPK_K}) k(rank)
            WHERE s.i <= {TOPK_PROMPTS}
            """
        )
        con.execute("COMMIT")
        con.execute("CHECKPOINT")
        counts = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                  for t in ("runs", "samples", "metrics", "first_token_topk")}
    print("built:", ", ".join(f"{t} {n:,}" for t, n in counts.items()))


def cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended (the figure workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def check(out: Path) -> str:
    """Sections and images of the report in `out`; exits when one is missing or omitted."""
    page = (out / "index.html").read_text("utf-8")
    images = re.findall(r'<img src="([^"]+)"', page)
    missing = [s for s in SECTIONS if f'<section id="{s}">' not in page]
    broken = [i for i in images if not (out / i).is_file() or (out / i).read_bytes()[:8] != PNG]
    if missing or broken or "Omitted:" in page:
        sys.exit(f"incomplete report in {out}: sections missing {missing}, images broken {broken}, "
                 f"omitted {re.findall(r'Omitted: ([^<]*)', page)}")
    return f"{len(SECTIONS)} sections, {len(images)} images: {', '.join(images)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--keep", type=Path, default=None, help="Build in this folder and keep it.")
    args = parser.parse_args()

    work = args.keep or Path(tempfile.mkdtemp(prefix="evalkit-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    db = work / "bench.duckdb"
    if db.exists():
        db.unlink()
    t0 = time.perf_counter()
    build(db, args.rows)
    print(f"build: {time.perf_counter() - t0:.1f} s")

    from evalkit.report.build import build_report

    t0, c0 = time.perf_counter(), cpu_s()
    report = build_report(db, None, work / "report-lib", prompts=4)
    lib_s, lib_cpu = time.perf_counter() - t0, cpu_s() - c0
    print(f"report (library, in process): {lib_s:.2f} s wall, {lib_cpu:.2f} s CPU, {len(report.files)} files "
          f"[target < {TARGET_S:.0f} s: {'ok' if lib_s < TARGET_S else 'OVER'}]")
    print(f"  {check(work / 'report-lib')}")

    exe = Path(sys.executable).with_name("evalkit")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from evalkit.cli import main; main()"]
    env = {**os.environ, "EVALKIT_DB": str(db)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([*cmd, "report", "--out", str(work / "report-cli")], env=env,
                          capture_output=True, text=True, check=False)
    cli_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cli_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != 0:
        sys.exit(f"evalkit report failed ({proc.returncode}): {proc.stderr.strip()}")
    print(f"report (CLI subprocess):      {cli_s:.2f} s wall, {cli_cpu:.2f} s CPU, {len(proc.stdout.split())} files "
          f"[target < {TARGET_S:.0f} s: {'ok' if cli_s < TARGET_S else 'OVER'}]")
    print(f"  {check(work / 'report-cli')}")
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):
        print(f"note: load average {load:.1f} on {os.cpu_count()} CPUs: wall times are inflated; "
              "CPU time (all threads) is the load-independent figure")
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept: {work}")


if __name__ == "__main__":
    main()
