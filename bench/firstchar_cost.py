"""What the first-character distribution (docs/metrics.md "Across tokenizers", `engines.firstchar`) costs.

The default SmolLM2-135M-Instruct under `chat`, the firsttoken suite (`--limit N` prompts a language), run
side by side in this one process with `first_char=false` (no first_char_topk: the code path before m030) and
the default `first_char=true`, once as a full run and once under `--metrics gate` (which computes it: the
gate's js_div reads it across tokenizers). The settings alternate `--repeats` times into a throwaway DB, the
cheaper pass of each kept. Prints the process's CPU seconds a prompt of each pass, the ratio (budget: at most
1.15), and the mean positions the expansion fed, unresolved mass and stored events a prompt per language.

    python bench/firstchar_cost.py [--limit N] [--repeats 1]

CPU seconds are the process's (all threads) from the run's start, the model loaded, to its end (storing
included): steadier than wall time on a shared machine.
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


def _pass(evalkit, db, tasks, on: bool, metrics: str | None, limit: int | None) -> tuple[float, float, object]:
    """(CPU seconds from the run's start, after the model loaded, to its end; eval wall seconds; the run)."""
    started: list[float] = []
    run = evalkit.run(tasks, db=db, name=f"first_char={on}", model_args=f"first_char={str(on).lower()}",
                      metrics=metrics, limit=limit, on_start=lambda _: started.append(time.process_time()))
    return time.process_time() - started[0], run.eval_s, run


def _stored(db, run_id: str) -> list[tuple]:
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(
            """SELECT s.task, count(DISTINCT s.doc_id), avg(s.fc_unresolved_mass), max(s.fc_unresolved_mass),
                      avg(s.fc_rest_mass), count(c.rank) / count(DISTINCT s.doc_id)
               FROM samples s LEFT JOIN first_char_topk c ON c.run_id = s.run_id AND c.task = s.task
                    AND c.doc_id = s.doc_id
               WHERE s.run_id = ? GROUP BY s.task ORDER BY s.task""", [run_id]).fetchall()
    finally:
        con.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=20, help="prompts per first-token task (default 20)")
    parser.add_argument("--repeats", type=int, default=1, help="passes per setting (the cheaper is kept)")
    parser.add_argument("--tasks", default="firsttoken_en,firsttoken_zh")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import evalkit

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.duckdb"
        for metrics in (None, "gate"):
            best: dict[bool, tuple[float, float, object]] = {}
            for _ in range(args.repeats):
                for on in (False, True):
                    cpu, wall, run = _pass(evalkit, db, args.tasks, on, metrics, args.limit)
                    print(f"  {metrics or 'all':<5} first_char={str(on).lower():<5} {cpu:7.1f} s CPU "
                          f"({wall:6.1f} s eval wall), {run.n_samples} prompts", flush=True)
                    if on not in best or cpu < best[on][0]:
                        best[on] = (cpu, wall, run)
            n = best[True][2].n_samples
            rows.append((metrics or "all", n, best[False][0] / n, best[True][0] / n, best[True][0] / best[False][0]))
            if metrics is None:
                stored = _stored(db, best[True][2].id)
        print()
        print(f"{'--metrics':<10} {'prompts':>7} {'CPU s/prompt without':>21} {'with':>8} {'ratio':>7}")
        for metrics, n, off, on_, ratio in rows:
            print(f"{metrics:<10} {n:>7} {off:>21.3f} {on_:>8.3f} {ratio:>7.3f}")
        print()
        print(f"{'task':<16} {'prompts':>7} {'unresolved mean':>16} {'max':>9} {'rest mean':>10} {'events/prompt':>14}")
        for task, n, unres, unres_max, rest, events in stored:
            print(f"{task:<16} {n:>7} {unres:>16.2e} {unres_max:>9.2e} {rest:>10.2e} {events:>14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
