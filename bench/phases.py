"""Where a run's time goes, phase by phase, before and after the engine's speed work, in one process.

Runs the same suite twice on the default model (SmolLM2-135M-Instruct, fp32 on CPU), each into its own
DuckDB file, through the real `evalkit.run` path:

  before  the reference engine (`tests/reference_engine.py`, the engine as it was) at its old batch
          size (8): left-padded prefills, the candidate trie padded per level to the batch's widest
          row, first units in forwards of their own, decode in the prefill's shrinking batches;
  after   `evalkit.engines.transformers.firststep` at the default batch size.

For each it prints each phase's share of the time (load, prefill + first-step reads, candidate trie,
first units, decode, other: lm-eval, scoring, storing), CPU-seconds and wall seconds, and the positions
the model computed per prompt (padding included) against those the metrics need: unique prompt tokens
(the head every prompt shares counted once), trie nodes, first-unit nodes the trie does not feed, and
decode tokens. Then the ratio of the whole runs, and how far the stored numbers moved: the largest
difference of every per-sample metric, of every top-k log-probability, and how many first tokens,
responses and first units differ.

    python bench/phases.py                     # the whole firsttoken suite (470 prompts), both paths
    python bench/phases.py --limit 20          # 20 prompts a task (40), a quick look
    python bench/phases.py --paths after       # the new engine alone

The machine is shared: the ratio of the two runs, measured side by side, is the number to quote.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PHASES = ("load", "prefill", "trie", "units", "decode", "other")
METRICS = ("ft_hit_prob", "opener_mass", "prior_drift", "top1_prob", "top3_mass", "entropy", "ft_hit",
           "ft_token_hit", "opener_rate", "answer_hit", "unstable")


class Meter:
    """Wall and CPU seconds, and model positions fed, per phase, for the engine class it instruments."""

    def __init__(self):
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.fed: dict[str, int] = defaultdict(int)
        self.stack: list[str] = []

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time `name`, excluding the nested phases timed inside it."""
        outer = self.stack[-1] if self.stack else None
        w0, c0 = time.perf_counter(), time.process_time()
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()
            dw, dc = time.perf_counter() - w0, time.process_time() - c0
            self.wall[name] += dw
            self.cpu[name] += dc
            if outer is not None:
                self.wall[outer] -= dw
                self.cpu[outer] -= dc

    def wrap(self, cls, method: str, name: str) -> None:
        original = getattr(cls, method)
        meter = self

        def timed(*args, **kwargs):
            with meter.phase(name):
                return original(*args, **kwargs)

        setattr(cls, method, timed)

    def count_forward(self, cls) -> None:
        original = cls.forward
        meter = self

        def forward(engine, input_ids, *args, **kwargs):
            meter.fed[meter.stack[-1] if meter.stack else "prefill"] += int(input_ids.numel())
            return original(engine, input_ids, *args, **kwargs)

        cls.forward = forward


class ReferenceProber:
    """`firststep.Prober`'s interface over the reference engine: each submission probed whole at once
    (prefill, trie, units and its own decode), as the engine did before the speed work."""

    def __init__(self, model, tokenizer, **settings):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.done: list = []

    def submit(self, key, contexts, candidates=None, *, seed=0, banned_first_ids=frozenset(), progress=None,
               **per_prompt):
        from tests import reference_engine

        steps = reference_engine.probe(self.model, self.tokenizer, contexts, candidates, seed=seed,
                                       banned_first_ids=banned_first_ids, progress=progress,
                                       **self.settings, **per_prompt)
        self.done.append((key, steps))

    def ready(self):
        out, self.done = self.done, []
        return out

    def finish(self):
        return self.ready()


def instrument(path: str) -> tuple[Meter, list, Any]:
    """Patch the engine module `path` runs with (the model reads `firststep.Prober` at call time);
    returns the meter, the list the probed steps are recorded in, and the patch's undo."""
    from evalkit.engines.transformers import firststep as engine
    from evalkit.engines.transformers.decoder import _Decoder
    from tests import reference_engine

    meter = Meter()
    steps: list = []
    saved = engine.Prober
    if path == "before":
        cls, prober = reference_engine._Engine, ReferenceProber
        meter.wrap(cls, "run_batch", "prefill")  # what run_batch does outside the phases below
        meter.wrap(cls, "candidate_probs", "trie")
        meter.wrap(cls, "complete_units", "units")
        meter.wrap(cls, "generate", "decode")
    else:
        cls, prober = engine._Engine, saved
        meter.wrap(cls, "run_batch", "prefill")
        meter.wrap(cls, "score_nodes", "trie")  # the first units ride in the trie's level forwards
        meter.wrap(_Decoder, "step", "decode")
    meter.count_forward(cls)

    class Recording(prober):  # type: ignore[misc, valid-type]
        def ready(self):
            out = super().ready()
            for _, s in out:
                steps.extend(s)
            return out

    engine.Prober = Recording

    def undo():
        engine.Prober = saved

    return meter, steps, undo


def needed(steps) -> dict[str, float]:
    """Positions the metrics need, summed over prompts (the shared head once)."""
    prompts = [s.context_ids for s in steps if s.candidate_tokens or s.response_ids or s.answer_ids]
    head = len(os.path.commonprefix(prompts)) if prompts else 0
    return {
        "prompt": head + sum(len(p) - head for p in prompts),
        "trie": sum(s.candidate_positions for s in steps),
        "units": sum(getattr(s, "unit_positions", 0) for s in steps),
        "decode": sum(len(s.answer_ids or s.response_ids) for s in steps),
        "prompts": len(prompts),
    }


def run_path(path: str, args, db: Path) -> dict:
    import evalkit

    meter, steps, undo = instrument(path)
    w0, c0 = time.perf_counter(), time.process_time()
    try:
        batch = 8 if path == "before" else args.batch_size
        options = {"batch_size": batch} if batch else {}
        run = evalkit.run(tasks=args.tasks, db=db, limit=args.limit, device=args.device, **options)
    finally:
        undo()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    meter.wall["load"] = run.load_s
    accounted = sum(meter.wall[p] for p in ("prefill", "trie", "units", "decode"))
    meter.wall["other"] = wall - run.load_s - accounted
    meter.cpu["other"] = cpu - sum(meter.cpu[p] for p in ("prefill", "trie", "units", "decode"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"run": run, "wall": wall, "cpu": cpu, "meter": meter, "needed": needed(steps), "db": db, "peak_rss": peak}


def report(path: str, r: dict) -> None:
    m, n = r["meter"], r["needed"]
    prompts = max(n["prompts"], 1)
    print(f"\n{path}: {r['wall']:.1f} s wall, {r['cpu']:.1f} CPU-s, {n['prompts']} prompts probed, "
          f"{r['run'].n_samples} samples stored")
    print(f"  {'phase':<8} {'wall s':>8} {'share':>6} {'CPU s':>8} {'fed/prompt':>11} {'needed/prompt':>14}")
    need = {"prefill": n["prompt"], "trie": n["trie"], "units": n["units"], "decode": n["decode"]}
    for p in PHASES:
        fed = f"{m.fed[p] / prompts:11.1f}" if p in need else " " * 11
        want = f"{need[p] / prompts:14.1f}" if p in need else ""
        print(f"  {p:<8} {m.wall[p]:8.1f} {m.wall[p] / r['wall']:6.1%} {m.cpu.get(p, 0.0):8.1f} {fed} {want}")
    total_fed = sum(m.fed[p] for p in need)
    print(f"  positions per prompt: {total_fed / prompts:.1f} computed, {sum(need.values()) / prompts:.1f} needed")
    print(f"  peak RSS of this process so far: {r['peak_rss'] / 2**30:.2f} GB")


def differences(before: dict, after: dict) -> None:
    import duckdb

    con = duckdb.connect()
    con.execute(f"ATTACH '{before['db']}' AS a (READ_ONLY)")
    con.execute(f"ATTACH '{after['db']}' AS b (READ_ONLY)")
    pairs = "FROM a.samples x JOIN b.samples y USING (task, doc_id)"
    n = con.execute(f"SELECT count(*) {pairs}").fetchone()[0]
    print(f"\nstored numbers, before vs after, over {n} samples:")
    for metric in METRICS:
        row = con.execute(f"SELECT max(abs(x.{metric} - y.{metric})), count(x.{metric}) {pairs}").fetchone()
        if row[1]:
            print(f"  {metric:<14} largest |difference| {row[0]:.3g}  (n={row[1]})")
    row = con.execute(f"""SELECT sum((x.first_token_id IS DISTINCT FROM y.first_token_id)::INT),
                                 sum((x.response IS DISTINCT FROM y.response)::INT),
                                 sum((x.answer IS DISTINCT FROM y.answer)::INT),
                                 sum((x.first_unit IS DISTINCT FROM y.first_unit)::INT) {pairs}""").fetchone()
    print(f"  first tokens differing {row[0]}, responses {row[1]}, answers {row[2]}, first units {row[3]}")
    row = con.execute("""SELECT max(abs(x.logprob - y.logprob)), sum((x.token_id <> y.token_id)::INT),
                                sum((x.unit IS DISTINCT FROM y.unit)::INT), count(*)
                         FROM a.first_token_topk x JOIN b.first_token_topk y USING (task, doc_id, rank)""").fetchone()
    print(f"  top-k rows {row[3]}: largest |logprob difference| {row[0]:.3g} nats, token differs at {row[1]}, "
          f"unit differs at {row[2]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="firsttoken")
    ap.add_argument("--limit", type=int, default=None, help="prompts per task (default: all)")
    ap.add_argument("--paths", default="before,after", help="before, after, or both (comma list)")
    ap.add_argument("--batch-size", type=int, default=None, help="the after path's batch size (default: evalkit's)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or any(p not in ("before", "after") for p in paths):
        ap.error("--paths takes before, after or both")
    results = {}
    with tempfile.TemporaryDirectory(prefix="evalkit-phases-") as tmp:
        for path in paths:
            results[path] = run_path(path, args, Path(tmp) / f"{path}.duckdb")
            report(path, results[path])
        if len(results) == 2:
            b, a = results["before"], results["after"]
            print(f"\nwhole run, before / after: {b['wall'] / a['wall']:.2f}x wall "
                  f"({b['wall']:.1f} s -> {a['wall']:.1f} s), {b['cpu'] / a['cpu']:.2f}x CPU-seconds; "
                  f"eval alone {b['run'].eval_s / a['run'].eval_s:.2f}x "
                  f"({b['run'].eval_s:.1f} s -> {a['run'].eval_s:.1f} s)")
            differences(b, a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
