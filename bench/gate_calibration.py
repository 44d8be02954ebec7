"""The default gate's calibration on the pairs users gate: how often it passes a benign change,
how often it fails one falsely, and how often it stops a planted drop. docs/gate.md publishes
the table.

From a baseline run and one or more benign candidates (fp32 -> bf16, int8 weight-only, the same
GGUF on another engine), stored in one DB, each draw takes n prompts a task with replacement from
the prompts both runs share and gates them with the default rules (`decide`, as `evalkit gate`):

(a) False fails on benign noise (A/A). For every prompt and metric the two runs' values are
    swapped at random: every true drop is 0, the per-prompt noise is that of the real pair.
    Target: FAIL in at most 2.5 % of draws.
(b) Benign pass rate. The real pair, as stored. Target: PASS in at least 95 % of draws.
(c) Planted drops. The benign candidate's own values (its real noise) with a drop of k x each
    headline margin planted in all headline metrics at once, noisily: a probability (relative
    margin) is multiplied on each prompt by a random factor whose mean is 1 - k x margin
    (log-normal spread, sigma 0.25), a 0/1 metric loses hits (gains openers) at random at the rate
    whose expected drop is k x its margin, and a distance on a fixed scale (js_div) grows on each
    prompt by k x its margin times the same kind of random factor. k = 0.5 lies within the
    margins, k = 2 is clearly worse. Target at k = 2: FAIL in at least 95 % of draws.

Each candidate's per-prompt first-token distance from the baseline (js_div) is added from both
runs' stored top-k as `evalkit gate` adds it (`release.db.with_distances`); the baseline's is 0.
(d) With --worse: a clearly worse real pair (int8-dynamic), as stored: its FAIL share.

One command, measuring everything (runs the variants first when --run is given):

    python bench/gate_calibration.py --run --db /tmp/cal.duckdb              # the whole suite
    python bench/gate_calibration.py --run --limit 100 --db /tmp/cal.duckdb  # 100 prompts a task
    python bench/gate_calibration.py --db DB --baseline RUN --benign RUN[,RUN] [--worse RUN] \\
        [--reps 200] [--n 100,all] [--k 0.5,1,2] [--out table.md]
    python bench/gate_calibration.py --pairs-json ap.json --baseline q4_1 --benign bf16,int8-weight \\
        --worse int8-dynamic          # answer_prob's rule alone, from bench/answer_prob_pairs.py
    python bench/gate_calibration.py --run --metrics gate --limit 100 --db /tmp/cal.duckdb  # gate runs

Runs stored with `evalkit run --metrics gate` hold what the gate reads in place of the metrics they skip
(`opener_start_mass` for `opener_mass`; the exact twins for the 0/1 metrics); the draws keep those, and
each run's reasons for what it did not compute, so the default rules check them as `evalkit gate` does.

--run stores a q4_1 baseline and the bf16, int8-weight and int8-dynamic variants (one sweep),
and the llama.cpp engine on the same GGUF when llama-cpp-python is importable; it prints the ids.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import subprocess
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
KEPT = tuple(dict.fromkeys((*HEADLINE, *registry.GATE_METRICS)))  # what the draws keep of each prompt
SIGMA = 0.25  # log-normal spread of a planted drop on a probability, per prompt
OUTCOMES = ("pass", "inconclusive", "fail")


# ----------------------------------------------------------------------------- the runs


def run_variants(db: str, limit: int | None, metrics: str = "all") -> dict[str, str]:
    """Store the baseline and the variants with the real CLI; returns label -> run id."""
    common = [sys.executable, "-m", "evalkit", "run", "--tasks", "firsttoken", "--db", db, "--metrics", metrics]
    if limit:
        common += ["--limit", str(limit)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    ids: dict[str, str] = {}
    quants = ["q4_1", "bf16", "int8-weight", "int8-dynamic"]
    out = subprocess.run([*common, "--quant", ",".join(quants)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"evalkit run failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    found = re.findall(r"^run (\S+)\s+done", out.stdout, re.M)
    if len(found) != len(quants):
        raise SystemExit(f"expected {len(quants)} runs, found {found}: {out.stdout[-500:]}")
    ids.update(zip(quants, found))
    if importlib.util.find_spec("llama_cpp") is not None:
        out = subprocess.run([*common, "--model", "llamacpp", "--name", "llamacpp"], env=env, capture_output=True,
                             text=True)
        if out.returncode != 0:
            raise SystemExit(f"evalkit run --model llamacpp failed: {out.stderr.strip()[-500:]}")
        ids["llamacpp"] = re.findall(r"^run (\S+)\s+done", out.stdout, re.M)[-1]
    else:
        print("llama-cpp-python is not importable: the hf-vs-llamacpp pair is left out", file=sys.stderr)
    return ids


def load(db: str | None, ref: str, pairs: dict | None = None) -> RunData:
    """A stored run (a ref in the DB), or a variant of a --pairs-json file (bench/answer_prob_pairs.py)."""
    if pairs is not None:
        if ref not in pairs:
            raise SystemExit(f"{ref!r} is not in the pairs file (it has {', '.join(pairs)})")
        return RunData(run_id=ref, metrics={},
                       samples={tuple(key.split("/", 1)): values for key, values in pairs[ref].items()})  # type: ignore[misc]
    from evalkit.release.db import _done_run, load_run_data
    from evalkit.store.db import open_reader

    assert db is not None
    with open_reader(db) as con:
        return load_run_data(con, _done_run(con, ref, "read"))


def shared_by_task(a: RunData, b: RunData) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for task, doc in sorted(a.samples.keys() & b.samples.keys()):
        out.setdefault(task, []).append(doc)
    return out


# ----------------------------------------------------------------------------- the draws


def draw(tasks: dict[str, list[str]], n: int | None, rng: np.random.Generator) -> list[tuple[str, str, str]]:
    """(task, doc, new doc key) for n prompts a task drawn with replacement (None: every prompt once)."""
    out = []
    for task, docs in tasks.items():
        picks = docs if n is None or n >= len(docs) else [docs[i] for i in rng.integers(0, len(docs), size=n)]
        out += [(task, doc, f"{doc}#{j}") for j, doc in enumerate(picks)]
    return out


def as_run(run_id: str, samples: dict, like: RunData | None = None) -> RunData:
    """A drawn run; `like`: the stored run it was drawn from, whose reasons for what it did not compute it keeps."""
    return RunData(run_id=run_id, metrics={}, samples=samples, not_computed=dict(like.not_computed) if like else {})


def stored_pair(base: RunData, cand: RunData, picks) -> tuple[RunData, RunData]:
    """(candidate, baseline) as stored, on the drawn prompts."""
    c, b = {}, {}
    for task, doc, key in picks:
        c[(task, key)] = {m: v for m, v in cand.samples[(task, doc)].items() if m in KEPT}
        b[(task, key)] = {m: v for m, v in base.samples[(task, doc)].items() if m in KEPT}
    return as_run("cand", c, cand), as_run("base", b, base)


def aa_pair(base: RunData, other: RunData, picks, rng) -> tuple[RunData, RunData]:
    """The two runs' values swapped at random per prompt and metric: true drop 0, the pair's noise."""
    left: dict = {}
    right: dict = {}
    for task, doc, key in picks:
        a, b = base.samples[(task, doc)], other.samples[(task, doc)]
        left[(task, key)], right[(task, key)] = {}, {}
        for m in KEPT:
            if m in a and m in b:
                x, y = (a[m], b[m]) if rng.random() < 0.5 else (b[m], a[m])
                left[(task, key)][m], right[(task, key)][m] = x, y
    return as_run("aa-cand", left, other), as_run("aa-base", right, base)


def planted_pair(base: RunData, cand: RunData, picks, k: float, rng) -> tuple[RunData, RunData]:
    """(candidate with a noisy drop of k x each margin planted in its own values, the baseline)."""
    rates: dict[tuple[str, str], list[float]] = {}
    for (task, _doc), values in cand.samples.items():
        for m in KEPT:
            if m in values:
                rates.setdefault((task, m), []).append(values[m])
    mean = {key: float(np.mean(v)) for key, v in rates.items()}
    c, b = stored_pair(base, cand, picks)
    out: dict = {}
    for key, values in c.samples.items():
        task = key[0]
        out[key] = {}
        for m, v in values.items():
            spec = registry.METRICS[m]
            margin, higher = spec.margin, spec.higher_is_better
            assert margin is not None
            if margin.kind == "relative":
                noise = float(np.exp(SIGMA * rng.standard_normal() - SIGMA ** 2 / 2))  # mean 1
                factor = (1 - k * margin.value) if higher else (1 + k * margin.value)
                out[key][m] = max(0.0, v * factor * noise) if higher else min(1.0, v * factor * noise)
                continue
            if not spec.binary:  # a continuous value on a fixed scale (js_div, bits): k x margin added, noisily
                noise = float(np.exp(SIGMA * rng.standard_normal() - SIGMA ** 2 / 2))  # mean 1
                step = k * margin.value * noise
                out[key][m] = v - step if higher else v + step
                continue
            drop, p = k * margin.value, mean[(task, m)]
            if higher:  # lose a hit with probability drop / p
                flip = v == 1 and rng.random() < (min(1.0, drop / p) if p > 0 else 0.0)
                out[key][m] = 0.0 if flip else v
            else:  # gain an opener with probability drop / (1 - p)
                flip = v == 0 and rng.random() < (min(1.0, drop / (1 - p)) if p < 1 else 0.0)
                out[key][m] = 1.0 if flip else v
    return as_run("planted", out, cand), b


def shares(outcomes: list[str]) -> dict[str, float]:
    c = Counter(outcomes)
    return {o: c[o] / len(outcomes) for o in OUTCOMES}


def deciding_rows(outcomes_rows: list[list]) -> str:
    """The rows that most often kept a draw from passing: 'task/metric status' with their share."""
    c: Counter = Counter()
    for rows in outcomes_rows:
        for r in rows:
            if r.status in ("fail", "inconclusive"):
                c[f"{r.task or '*'}/{r.metric} {r.status}"] += 1
    total = len(outcomes_rows)
    return ", ".join(f"{k} {v / total:.2f}" for k, v in c.most_common(3)) or "-"


# ----------------------------------------------------------------------------- the table


def calibrate(base: RunData, benign: dict[str, RunData], worse: dict[str, RunData], sizes, ks, reps: int,
              n_boot: int, seed: int) -> list[dict]:
    """One dict per (pair, n): the shares of each part, and which rows kept draws from passing."""
    rng = np.random.default_rng(seed)
    table = []

    def gate(pair_fn, n, tasks) -> tuple[dict[str, float], str]:
        outcomes, rows = [], []
        for r in range(reps):
            cand, ref = pair_fn(draw(tasks, n, rng))
            verdict = decide(cand, ref, DEFAULT_RULES, n_boot=n_boot, seed=r)
            outcomes.append(verdict.outcome)
            rows.append(verdict.rows)
        return shares(outcomes), deciding_rows(rows)

    for label, other in benign.items():
        tasks = shared_by_task(base, other)
        for n in sizes:
            row: dict = {"pair": label, "n": n, "tasks": {t: len(d) for t, d in tasks.items()}}
            row["aa"], _ = gate(lambda p, other=other: aa_pair(base, other, p, rng), n, tasks)
            row["benign"], row["benign_why"] = gate(lambda p, other=other: stored_pair(base, other, p), n, tasks)
            for k in ks:
                row[f"k{k:g}"], _ = gate(lambda p, other=other, k=k: planted_pair(base, other, p, k, rng), n, tasks)
            table.append(row)
            print(f"  {label} n={n or 'all'} done", file=sys.stderr, flush=True)
    for label, other in worse.items():
        tasks = shared_by_task(base, other)
        for n in sizes:
            res, why = gate(lambda p, other=other: stored_pair(base, other, p), n, tasks)
            table.append({"pair": label, "n": n, "worse": res, "worse_why": why,
                          "tasks": {t: len(d) for t, d in tasks.items()}})
    return table


def markdown(table: list[dict], ks, reps: int) -> str:
    def pct(x: float) -> str:
        return f"{100 * x:.0f} %"

    def mark(ok: bool) -> str:
        return "" if ok else " ✗"

    lines = [f"| pair | n a task | (a) A/A false FAIL (≤ 2.5 %) | (b) benign PASS (≥ 95 %) | "
             + " | ".join(f"(c) k = {k:g}: FAIL" + (" (≥ 95 %)" if k == 2 else "") for k in ks)
             + " | what kept benign draws from passing |",
             "|---|---:|---:|---:|" + "---:|" * len(ks) + "---|"]
    for row in table:
        n = "all" if row["n"] is None else str(row["n"])
        if "worse" in row:
            lines.append(f"| {row['pair']} (clearly worse, as stored) | {n} | | | "
                         + " | ".join("" for _ in ks[:-1]) + f" | FAIL {pct(row['worse']['fail'])}"
                         + f"{mark(row['worse']['fail'] >= 0.95)} | {row['worse_why']} |")
            continue
        cells = [pct(row["aa"]["fail"]) + mark(row["aa"]["fail"] <= 0.025),
                 pct(row["benign"]["pass"]) + mark(row["benign"]["pass"] >= 0.95)]
        for k in ks:
            cell = pct(row[f"k{k:g}"]["fail"])
            cells.append(cell + (mark(row[f"k{k:g}"]["fail"] >= 0.95) if k == 2 else ""))
        lines.append(f"| {row['pair']} | {n} | " + " | ".join(cells) + f" | {row['benign_why']} |")
    lines.append(f"\n{reps} draws a cell; ✗ marks a missed target.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", help="the DuckDB file holding the runs")
    parser.add_argument("--pairs-json", help="instead of --db: variants' per-prompt values from bench/answer_prob_pairs.py")
    parser.add_argument("--run", action="store_true", help="store the baseline and variants first (real runs)")
    parser.add_argument("--limit", type=int, default=None, help="with --run: prompts a task (default: all)")
    parser.add_argument("--metrics", default="all", help="with --run: what the runs compute (evalkit run --metrics)")
    parser.add_argument("--baseline", help="the baseline run (without --run)")
    parser.add_argument("--benign", default="", help="benign candidates, comma-separated run refs")
    parser.add_argument("--worse", default="", help="clearly worse candidates, comma-separated run refs")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--n", default="100,all", help="prompts a task per draw; all = every shared prompt once")
    parser.add_argument("--k", default="0.5,1,2", help="planted drops, in multiples of each margin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples per check (the gate: 4000)")
    parser.add_argument("--out", help="also write the markdown table here")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    if not args.db and not args.pairs_json:
        parser.error("give --db or --pairs-json")
    pairs = json.loads(Path(args.pairs_json).read_text(encoding="utf-8")) if args.pairs_json else None
    if args.run:
        ids = run_variants(args.db, args.limit, args.metrics)
        print("stored: " + ", ".join(f"{k} {v}" for k, v in ids.items()), file=sys.stderr)
        baseline = ids["q4_1"]
        benign_refs = {k: ids[k] for k in ("bf16", "int8-weight", "llamacpp") if k in ids}
        worse_refs = {"int8-dynamic": ids["int8-dynamic"]}
    else:
        if not args.baseline or not args.benign:
            parser.error("give --run, or --baseline and --benign")
        baseline = args.baseline
        benign_refs = {r: r for r in args.benign.split(",") if r}
        worse_refs = {r: r for r in args.worse.split(",") if r}
    base = load(args.db, baseline, pairs)
    benign = {label: load(args.db, ref, pairs) for label, ref in benign_refs.items()}
    worse = {label: load(args.db, ref, pairs) for label, ref in worse_refs.items()}
    if args.db is not None:  # each candidate's first-token distance from the baseline, as `evalkit gate` adds it
        from evalkit.release.db import with_distances
        from evalkit.store.db import open_reader

        with open_reader(args.db) as con:
            benign = {label: with_distances(con, run, base)[0] for label, run in benign.items()}
            worse = {label: with_distances(con, run, base)[0] for label, run in worse.items()}
            base = with_distances(con, base, base)[1]  # the baseline's distance from itself: 0 on every prompt
    sizes = [None if s == "all" else int(s) for s in args.n.split(",")]
    ks = [float(k) for k in args.k.split(",")]
    start = time.perf_counter()
    table = calibrate(base, benign, worse, sizes, ks, args.reps, args.n_boot, args.seed)
    text = (f"baseline {base.run_id}; default rules ({', '.join(HEADLINE)}); pairs: "
            + ", ".join(f"{k} = {v.run_id}" for k, v in {**benign, **worse}.items()) + "; shared prompts: "
            + "; ".join(f"{r['pair']}: " + ", ".join(f"{t} {n}" for t, n in r["tasks"].items())
                        for r in table if r["n"] == sizes[0]) + "\n\n" + markdown(table, ks, args.reps)
            + f"\n{time.perf_counter() - start:.0f} s\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
