"""What journaling one prompt at a time costs: a line per prompt against a line per batch.

The journal (evalkit/store/journal.py) writes each finished prompt's response as a signed line
and flushes it to disk (fsync), so a kill loses only the prompts in flight. This bench writes
the same responses both ways into a journal beside a scratch DB path (the spool folder of
`--db`, default a temporary folder: measure on the disk your DB lives on) and prints the time
per prompt, wall and CPU, and the bytes per prompt. The responses are shaped like the default
model's on the firsttoken tasks: top-50 first tokens, the per-prompt metrics, ten first units,
a 48-token response.

    python bench/journal_rows.py [--prompts 256] [--batch 32] [--db DIR/evalkit.duckdb]
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def response(i: int):
    from evalkit.contract import FirstStepResult

    topk = [(1000 + r, f" tok{r}", -0.1 * r - i * 1e-6) for r in range(50)]
    metrics = {m: 0.123456789 + i * 1e-9 for m in ("ft_hit", "ft_hit_prob", "ft_token_hit", "opener_rate",
                                                     "opener_mass", "prior_drift", "top1_prob", "top3_mass",
                                                     "entropy", "answer_hit", "answer_prob", "unstable")}
    return FirstStepResult(text="The capital of France is Paris, a city on the Seine. " * 4, first_token_id=1000,
                           first_token=" The", first_unit=" The", topk=topk, entropy=1.2345, metrics=metrics,
                           answer_text="Paris", units={1000 + r: f"u{r}" for r in range(10)},
                           token_ids=list(range(48)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--db", type=Path, default=None)
    args = parser.parse_args()
    from evalkit.store import journal, spool

    folder = None if args.db else tempfile.TemporaryDirectory()
    db = args.db or Path(folder.name) / "evalkit.duckdb"  # type: ignore[union-attr]
    me = spool.Identity(secrets.token_hex(16), secrets.token_hex(32))
    results = [response(i) for i in range(args.prompts)]
    timings = {}
    step = 8  # prompts finishing in one decode step, flushed together (the engine's grouping)
    for way in ("a line per prompt", f"a line per prompt, {step} a flush", f"a line per batch of {args.batch}"):
        run_id = f"bench-{secrets.token_hex(3)}"
        j = journal.Journal.create(db, me, run_id, {"bench": True})
        wall, cpu = time.perf_counter(), time.process_time()
        for start in range(0, args.prompts, args.batch):
            chunk = results[start:start + args.batch]
            key = ["bench", start]
            if way == "a line per prompt":
                for row, r in enumerate(chunk):
                    j.record_row(key, row, len(chunk), r)
            elif way.startswith("a line per prompt"):
                for at in range(0, len(chunk), step):
                    j.record_rows([(key, row, len(chunk), chunk[row]) for row in range(at, min(at + step, len(chunk)))])
            j.record(key, chunk)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        size = j.path.stat().st_size if j.path else 0
        j.discard()
        timings[way] = (wall, cpu, size)
        print(f"{way:<28} {1e3 * wall / args.prompts:7.3f} ms wall / prompt  {1e3 * cpu / args.prompts:7.3f} ms CPU / "
              f"prompt  {size / args.prompts / 1024:6.1f} KiB / prompt")
    (w1, c1, _), (w8, c8, _), (wb, cb, _) = timings.values()
    for what, w, c in (("a prompt at a time", w1, c1), (f"{step} prompts a flush", w8, c8)):
        print(f"{what} costs {1e3 * (w - wb) / args.prompts:.3f} ms wall and {1e3 * (c - cb) / args.prompts:.3f} ms "
              f"CPU more a prompt than whole batches ({args.prompts} prompts)")
    if folder is not None:
        folder.cleanup()


if __name__ == "__main__":
    main()
