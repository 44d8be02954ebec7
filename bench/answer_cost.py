"""What the whole-answer continuation (answer_hit, docs/metrics.md §1.7) costs a run.

The same first-token run — the default SmolLM2-135M-Instruct, chat template, the
firsttoken tasks at `--limit N`, one seed — with `answer_max_tokens=0` (the greedy
response stops at the task's stop strings, 16 tokens at most, as before answer_hit
existed) and with the default 48 (the continuation of the prompts with `answers_full`
runs on to 48 tokens, from the same prefill and KV cache). The two settings alternate,
`--repeats` times each, into a throwaway DB; the fastest pass of each is kept. It
prints each pass's evaluation wall time and the process's CPU time, and the ratios.

    python bench/answer_cost.py [--limit 40] [--repeats 2]

CPU seconds are the process's (all threads), steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=40, help="prompts per first-token task")
    parser.add_argument("--repeats", type=int, default=2, help="passes per setting (the fastest is kept)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import evalkit

    best: dict[int, tuple[float, float]] = {}
    checkable = None
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.duckdb"
        for _ in range(args.repeats):
            for tokens in (0, 48):
                c0 = time.process_time()
                run = evalkit.run("firsttoken", db=db, limit=args.limit, model_args=f"answer_max_tokens={tokens}",
                                  name=f"answer_max_tokens={tokens}")
                cpu = time.process_time() - c0
                print(f"answer_max_tokens={tokens:<3} eval {run.eval_s:6.1f}s wall  {cpu:6.1f}s CPU (whole run)",
                      flush=True)
                if tokens not in best or run.eval_s < best[tokens][0]:
                    best[tokens] = (run.eval_s, cpu)
                if tokens and checkable is None:
                    frame = run.samples_frame()
                    checkable = int(frame["answer_hit"].notna().sum()), len(frame)
    (w0, c0), (w1, c1) = best[0], best[48]
    print()
    print(f"prompts: {checkable[1]} ({checkable[0]} with answers_full, continued to 48 tokens)")
    print(f"answer_max_tokens=48 against 0: eval wall {w1 / w0:.2f}x ({w0:.1f}s -> {w1:.1f}s), "
          f"CPU {c1 / c0:.2f}x ({c0:.1f}s -> {c1:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
