"""What `evalkit run --metrics gate` costs against `--metrics all` on the same prompts, and whether the gate
reaches the same verdicts on the calibration pairs under both (SPEC §4: at most 25 % of a full run's
CPU seconds, one thread; bf16, int8-weight and the same GGUF on llama.cpp pass against the q4_1
baseline, int8-dynamic fails, at 100 prompts a task).

Each variant runs in a process of its own (`python -m evalkit run`, one thread: OMP_NUM_THREADS=1 and
MKL_NUM_THREADS=1), once under each selection, into one DB; its CPU seconds are the child's user + system
time (`resource.getrusage(RUSAGE_CHILDREN)`), so other load on a shared machine does not count, and its
wall time is printed beside them. Then `evalkit gate` (the default rules) judges every candidate against
the baseline of the same selection, and the bench prints both tables side by side:

    python bench/gate_metrics.py --limit 100 --db /tmp/gate_metrics.duckdb [--variants q4_1,bf16,...]
    python bench/gate_metrics.py --db /tmp/gate_metrics.duckdb --report --rows err1.log err2.log
        # the tables of the stored runs (several benches may share one DB, each on some variants)

The variants are `--quant` names of the default model, and `llamacpp` (the same GGUF on the llama.cpp
engine, when llama-cpp-python is importable). The first is the baseline; int8-dynamic is the clearly worse
candidate, every other one a benign one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SELECTIONS = ("all", "gate")
VARIANTS = "q4_1,bf16,int8-weight,int8-dynamic,llamacpp"
WORSE = ("int8-dynamic",)
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def run_one(db: str, variant: str, metrics: str, limit: int) -> dict:
    """One `evalkit run` in its own one-thread process: {variant, metrics, run, cpu_s, wall_s}."""
    cmd = [sys.executable, "-m", "evalkit", "run", "--tasks", "firsttoken", "--limit", str(limit), "--metrics",
           metrics, "--db", db, "--name", f"{variant}-{metrics}"]
    # llama.cpp's own thread pool takes the usable cores unless told: one thread, as the others
    cmd += ["--model", "llamacpp", "--model-args", "n_threads=1"] if variant == "llamacpp" else ["--quant", variant]
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:])} failed ({out.returncode}): {out.stderr.strip()[-800:]}")
    found = re.search(r"^run (\S+)\s+done", out.stdout, re.M)
    if not found:
        raise SystemExit(f"no run id in: {out.stdout[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row = {"variant": variant, "metrics": metrics, "run": found.group(1), "cpu_s": cpu, "wall_s": wall}
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def gate(db: str, candidate: str, baseline: str) -> tuple[str, str]:
    """(outcome, the rows that were not a pass: 'task/metric status') of `evalkit gate` with the default rules."""
    from evalkit.release.db import gate_runs

    result = gate_runs(db, candidate, baseline)
    rows = [f"{r.name} {r.status}" for r in result.verdict.rows if r.status in ("fail", "inconclusive")]
    skipped = sum(1 for r in result.verdict.rows if r.status == "skipped")
    return result.outcome, (", ".join(rows) or "-") + f" ({len(result.verdict.rows)} rows, {skipped} skipped)"


def stored(db: str) -> list[dict]:
    """The bench's runs in the DB, newest of each (variant, metrics), with their durations."""
    from evalkit.store.db import open_reader

    with open_reader(db) as con:
        got = con.execute("SELECT name, id, duration_s FROM runs WHERE status = 'done' ORDER BY created_at").fetchall()
    out: dict[tuple[str, str], dict] = {}
    for name, run_id, duration in got:
        variant, _, metrics = (name or "").rpartition("-")
        if metrics in SELECTIONS and variant:
            out[(variant, metrics)] = {"variant": variant, "metrics": metrics, "run": run_id, "cpu_s": None,
                                       "wall_s": duration}
    return list(out.values())


def table(rows: list[dict], variants: list[str]) -> str:
    by = {(r["variant"], r["metrics"]): r for r in rows}
    lines = ["| variant | all: CPU s | all: wall s | gate: CPU s | gate: wall s | gate / all (CPU) |",
             "|---|---:|---:|---:|---:|---:|"]
    totals = {m: [0.0, 0.0] for m in SELECTIONS}
    for v in variants:
        a, g = by.get((v, "all")), by.get((v, "gate"))
        if not a and not g:
            continue

        def cell(r, key):
            return "not run" if r is None else "" if r[key] is None else f"{r[key]:.1f}"

        both = a and g and a["cpu_s"] and g["cpu_s"] is not None
        ratio = f"{100 * g['cpu_s'] / a['cpu_s']:.1f} %" if both else ""
        lines.append(f"| {v} | {cell(a, 'cpu_s')} | {cell(a, 'wall_s')} | {cell(g, 'cpu_s')} | {cell(g, 'wall_s')} "
                     f"| {ratio} |")
        if both:
            for m, r in (("all", a), ("gate", g)):
                totals[m][0] += r["cpu_s"] or 0.0
                totals[m][1] += r["wall_s"] or 0.0
    if totals["all"][0] and sum(1 for v in variants if (v, "all") in by and (v, "gate") in by) > 1:
        lines.append(f"| all variants | {totals['all'][0]:.1f} | {totals['all'][1]:.1f} | {totals['gate'][0]:.1f} | "
                     f"{totals['gate'][1]:.1f} | {100 * totals['gate'][0] / totals['all'][0]:.1f} % |")
    return "\n".join(lines)


def verdicts(db: str, rows: list[dict], variants: list[str]) -> str:
    by = {(r["variant"], r["metrics"]): r["run"] for r in rows}
    base = variants[0]
    pairs = [("all", "all"), ("gate", "gate"), ("gate", "all")]  # (candidate's selection, baseline's)
    lines = [f"| candidate (against {base}) | expected | all against all | gate against gate | "
             "gate against all |", "|---|---|---|---|---|"]
    for v in variants[1:]:
        cells = []
        for mc, mb in pairs:
            if (v, mc) in by and (base, mb) in by:
                outcome, why = gate(db, by[(v, mc)], by[(base, mb)])
                cells.append(f"**{outcome}**: {why}")
            else:
                cells.append("not run")
        lines.append(f"| {v} | {'fail' if v in WORSE else 'pass'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", required=True)
    parser.add_argument("--limit", type=int, default=100, help="prompts a task (firsttoken_en, firsttoken_zh)")
    parser.add_argument("--variants", default=VARIANTS, help="the baseline first; llamacpp: the GGUF on llama.cpp")
    parser.add_argument("--metrics", default=",".join(SELECTIONS), help="which selections to run (all,gate)")
    parser.add_argument("--report", action="store_true", help="run nothing: the tables of the runs in --db")
    parser.add_argument("--rows", nargs="*", default=[],
                        help="with --report: files of the JSON lines earlier benches printed on stderr (CPU s)")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if "llamacpp" in variants and importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not importable: the llamacpp variant is left out", file=sys.stderr)
        variants.remove("llamacpp")
    rows: list[dict] = []
    if args.report:  # the runs in the DB; their CPU seconds from the lines the benches that ran them printed
        timed = {(r["variant"], r["metrics"]): r for path in args.rows for line in Path(path).read_text().splitlines()
                 if line.startswith("{") and (r := json.loads(line))}
        rows = [timed.get((r["variant"], r["metrics"]), r) for r in stored(args.db)]
    else:
        for v in variants:  # each variant under both selections back to back: the machine's load is alike
            for m in args.metrics.split(","):
                rows.append(run_one(args.db, v, m, args.limit))
    print(f"`evalkit run --tasks firsttoken --limit {args.limit}`, one thread a process"
          + (" (CPU s: the child process's user + system time)" if not args.report else " (wall: runs.duration_s)"))
    print()
    print(table(rows, variants))
    print()
    print("gate verdicts, default rules, each selection's candidate against its own baseline")
    print()
    print(verdicts(args.db, rows, variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
