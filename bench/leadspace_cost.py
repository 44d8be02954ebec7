"""What the whitespace-led event (docs/metrics.md "One event for text and probability") moves and costs.

The whole suite — the default SmolLM2-135M-Instruct under `chat`, every firsttoken prompt (470), one seed —
run side by side in this one process: `lead_space=false` (each candidate string scored right after the
prompt only: the definition and the code path before m028) and the default `lead_space=true` (every
distinct token path by which the response, after its leading whitespace, begins with the string: " Paris",
"\\n\\n" then "Paris"). The two alternate `--repeats` times into a throwaway DB, the cheaper pass of each kept;
it prints each metric's mean before -> after per task, the process's CPU seconds of each pass and their ratio
(budget: at most 1.10).

With `--gemma`, also Gemma-3-270M base on llama.cpp: 40 English firsttoken prompts fed as
"<bos>Question: {prompt}\\nAnswer:" under `--template plain`, ft_hit against ft_hit_prob before -> after.

    python bench/leadspace_cost.py [--limit N] [--repeats 1] [--gemma]

CPU seconds are the process's (all threads), steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

METRICS = ("ft_hit", "ft_hit_prob", "ft_token_hit", "opener_rate", "opener_mass", "opener_start_mass",
           "answer_hit", "answer_prob", "ws_mass", "prior_drift", "top3_mass", "entropy")
GEMMA = Path.home() / ".cache" / "evalkit-test" / "gemma" / "gemma-3-270m-q4_k_m.gguf"


def _means(run) -> dict[str, dict[str, float]]:
    frame = run.samples_frame()
    out: dict[str, dict[str, float]] = {}
    for task, part in [("all", frame), *frame.groupby("task")]:
        out[str(task)] = {m: float(part[m].mean()) for m in METRICS if m in part and part[m].notna().any()}
    out["all"]["n"] = float(len(frame))
    return out


def _table(before: dict, after: dict) -> None:
    for task in before:
        print(f"  {task}:")
        for m in METRICS:
            if m in before[task] or m in after[task]:
                b, a = before[task].get(m), after[task].get(m)
                fmt = (lambda v: "NULL" if v is None else f"{v:.4f}")
                print(f"    {m:<18} {fmt(b):>8} -> {fmt(a):<8}")


def _pair(evalkit, db, tasks, repeats: int, **options) -> tuple[dict, dict, float, float]:
    best: dict[bool, tuple[float, float, dict]] = {}
    for _ in range(repeats):
        for lead in (False, True):
            args = ",".join(a for a in (options.get("model_args"), f"lead_space={str(lead).lower()}") if a)
            c0 = time.process_time()
            run = evalkit.run(tasks, db=db, name=f"lead_space={lead}", **{**options, "model_args": args})
            cpu = time.process_time() - c0
            print(f"  lead_space={str(lead).lower():<5} eval {run.eval_s:7.1f}s wall {cpu:7.1f}s CPU (whole run)",
                  flush=True)
            if lead not in best or cpu < best[lead][0]:
                best[lead] = (cpu, run.eval_s, _means(run))
    return best[False][2], best[True][2], best[False][0], best[True][0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=None, help="prompts per first-token task (default: all)")
    parser.add_argument("--repeats", type=int, default=1, help="passes per setting (the cheaper is kept)")
    parser.add_argument("--gemma", action="store_true", help="also Gemma-3-270M on llama.cpp (40 en prompts)")
    parser.add_argument("--skip-default", action="store_true", help="only the Gemma part")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import evalkit

    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "bench.duckdb"
        if not args.skip_default:
            print("SmolLM2-135M-Instruct (q4_1), chat, firsttoken" + (f" --limit {args.limit}" if args.limit else ""))
            before, after, c0, c1 = _pair(evalkit, db, "firsttoken", args.repeats, limit=args.limit)
            _table(before, after)
            print(f"  prompts: {int(after['all']['n'])}; CPU s before {c0:.1f} -> after {c1:.1f}: "
                  f"ratio {c1 / c0:.3f} (budget 1.10)")
        if args.gemma:
            if not GEMMA.is_file():
                print(f"Gemma-3-270M: not at {GEMMA} (`bash scripts/test-deps.sh` fetches it); skipped")
                return 0
            rows = [json.loads(line) for line in (ROOT / "tasks/firsttoken/data/firsttoken_en.jsonl").open()][:40]
            prompts = Path(tmp) / "qa.jsonl"
            with prompts.open("w") as f:
                for r in rows:
                    f.write(json.dumps({**r, "prompt": f"<bos>Question: {r['prompt']}\nAnswer:"}) + "\n")
            print("Gemma-3-270M (Q4_K_M) on llama.cpp, '<bos>Question: …\\nAnswer:' under --template plain, 40 en")
            before, after, c0, c1 = _pair(evalkit, db, (), args.repeats, model="llamacpp", template="plain",
                                          prompts_file=str(prompts), model_args=f"model={GEMMA}")
            _table(before, after)
            print(f"  CPU s before {c0:.1f} -> after {c1:.1f}: ratio {c1 / c0:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
