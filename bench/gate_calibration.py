"""How often the default gate fails a model that is as good as its baseline, and how often
it stops one that is worse: the gate's calibration, from two runs stored in a DB.

1. False fails (A/A). Each draw takes n prompts a task, with replacement, from the prompts
   both runs share, and for every prompt and metric swaps the two runs' values at random:
   every true drop is then 0, with the per-prompt noise of a real pair of models. The
   default rules gate one side against the other. The promise is a false FAIL in at most
   2.5 % of draws (one-sided, family-wise over the rules, Holm).
2. Power. The baseline's own values, drawn the same way, against a copy with a drop of
   k × each headline metric's default margin planted in all of them at once: a 0/1 metric
   loses hits (or gains openers) at random at the rate that makes the expected drop k ×
   its margin; a probability is scaled on every prompt (exact, so its power is optimistic).
   k = 2 is clearly worse (the gate should fail it); k = 0.5 is within the margins.

    python bench/gate_calibration.py --db reports/evalkit.duckdb --baseline RUN --other RUN \\
        [--reps 100] [--n 20,50,100,all] [--k 0.5,2]

It prints one table of pass / inconclusive / fail shares per n for each part.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evalkit.release.decide import RunData, decide  # noqa: E402
from evalkit.release.rules import DEFAULT_RULES  # noqa: E402
from evalkit.scoring import registry  # noqa: E402

HEADLINE = registry.HEADLINE_METRICS


def load(db: str, baseline: str, other: str) -> tuple[RunData, RunData]:
    from evalkit.release.db import _done_run, load_run_data
    from evalkit.store.db import open_reader

    with open_reader(db) as con:
        return load_run_data(con, _done_run(con, baseline, "read")), load_run_data(con, _done_run(con, other, "read"))


def shared_by_task(a: RunData, b: RunData) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for task, doc in sorted(a.samples.keys() & b.samples.keys()):
        out.setdefault(task, []).append(doc)
    return out


def draw(tasks: dict[str, list[str]], n: int | None, rng: np.random.Generator) -> list[tuple[str, str, str]]:
    """(task, doc, new doc key) for n prompts a task drawn with replacement (None: every prompt once)."""
    out = []
    for task, docs in tasks.items():
        picks = docs if n is None else [docs[i] for i in rng.integers(0, len(docs), size=n)]
        out += [(task, doc, f"{doc}#{j}") for j, doc in enumerate(picks)]
    return out


def run_from(run_id: str, samples: dict) -> RunData:
    return RunData(run_id=run_id, metrics={}, samples=samples)


def aa_pair(base: RunData, other: RunData, picks, rng) -> tuple[RunData, RunData]:
    left: dict = {}
    right: dict = {}
    for task, doc, key in picks:
        a, b = base.samples[(task, doc)], other.samples[(task, doc)]
        left[(task, key)], right[(task, key)] = {}, {}
        for m in HEADLINE:
            if m in a and m in b:
                x, y = (a[m], b[m]) if rng.random() < 0.5 else (b[m], a[m])
                left[(task, key)][m], right[(task, key)][m] = x, y
    return run_from("aa-cand", left), run_from("aa-base", right)


def planted_pair(base: RunData, picks, k: float, rng) -> tuple[RunData, RunData]:
    """The baseline's values, and a candidate with a drop of k × each margin planted."""
    rates: dict[tuple[str, str], float] = {}  # (task, metric) -> mean over the task's prompts
    for (task, _doc), values in base.samples.items():
        for m in HEADLINE:
            if m in values:
                rates.setdefault((task, m), []).append(values[m])  # type: ignore[attr-defined]
    rates = {key: float(np.mean(v)) for key, v in rates.items()}  # type: ignore[arg-type]
    cand: dict = {}
    ref: dict = {}
    for task, doc, key in picks:
        values = base.samples[(task, doc)]
        ref[(task, key)] = {m: values[m] for m in HEADLINE if m in values}
        cand[(task, key)] = {}
        for m, v in ref[(task, key)].items():
            metric = registry.METRICS[m]
            margin = metric.margin
            higher = metric.higher_is_better
            if margin.kind == "relative":
                cand[(task, key)][m] = v * (1 - k * margin.value) if higher else v * (1 + k * margin.value)
                continue
            drop = k * margin.value
            p = rates[(task, m)]
            if higher:  # lose a hit with probability drop / p
                flip = v == 1 and rng.random() < min(1.0, drop / p if p > 0 else 0.0)
                cand[(task, key)][m] = 0.0 if flip else v
            else:  # gain an opener with probability drop / (1 - p)
                flip = v == 0 and rng.random() < min(1.0, drop / (1 - p) if p < 1 else 0.0)
                cand[(task, key)][m] = 1.0 if flip else v
    return run_from("planted", cand), run_from("base", ref)


def shares(outcomes: list[str]) -> str:
    c = Counter(outcomes)
    total = len(outcomes)
    return " | ".join(f"{c[o] / total:.2f}" for o in ("pass", "inconclusive", "fail"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", required=True)
    parser.add_argument("--baseline", required=True, help="the run whose values the power part plants drops in")
    parser.add_argument("--other", required=True, help="a second run on the same prompts (the A/A part's noise)")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--n", default="20,50,100,all", help="prompts a task per draw; all = every shared prompt")
    parser.add_argument("--k", default="0.5,2", help="planted drops, in multiples of each margin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples per check (the gate: 4000)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    base, other = load(args.db, args.baseline, args.other)
    tasks = shared_by_task(base, other)
    sizes = [None if s == "all" else int(s) for s in args.n.split(",")]
    ks = [float(k) for k in args.k.split(",")]
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    print(f"runs {base.run_id} (baseline) and {other.run_id}; tasks: "
          + ", ".join(f"{t} ({len(d)} shared prompts)" for t, d in tasks.items())
          + f"; {args.reps} draws per cell, default rules\n")

    def label(n):
        return "all" if n is None else str(n)

    print("1. False fails (A/A: the two runs' values swapped at random, true drop 0)\n")
    print("| n a task | pass | inconclusive | fail |\n|---:|---:|---:|---:|")
    for n in sizes:
        outcomes = []
        for r in range(args.reps):
            cand, ref = aa_pair(base, other, draw(tasks, n, rng), rng)
            outcomes.append(decide(cand, ref, DEFAULT_RULES, n_boot=args.n_boot, seed=r).outcome)
        print(f"| {label(n)} | {shares(outcomes)} |", flush=True)

    for k in ks:
        print(f"\n2. Power: a drop of {k:g} × every headline margin planted (shares pass | inconclusive | fail)\n")
        print("| n a task | pass | inconclusive | fail |\n|---:|---:|---:|---:|")
        for n in sizes:
            outcomes = []
            for r in range(args.reps):
                cand, ref = planted_pair(base, draw(tasks, n, rng), k, rng)
                outcomes.append(decide(cand, ref, DEFAULT_RULES, n_boot=args.n_boot, seed=r).outcome)
            print(f"| {label(n)} | {shares(outcomes)} |", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
