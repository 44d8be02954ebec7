"""The cost of each KV-cache policy against `full`, on the same needle prompts, side by side.

The default SmolLM2-135M-Instruct (loaded once) answers the same needle prompts
(en and zh, the needle at depth 0, chat template, built as the needle tasks build
them) under each policy through `engine.probe`, as a run does (greedy, 48 tokens at
most, stop "\\n\\n"), one prompt a batch. Per policy and length it prints the wall
and CPU seconds a prompt, their ratio to `full`, whether the key was recalled, and
the size of the 4-D attention mask the evicting policies add to the prefill
(batch × P² × 4 bytes in float32; transformers' own causal mask for a left-padded
batch is a B × P² boolean, and SDPA's attention weights B × heads × P² floats a layer).

    python bench/kv_cache_cost.py [--lengths 512,1024,2048] [--policies full,window:256,...] [--repeats 1]

CPU seconds are the process's (all threads), steadier than wall time on a shared machine.
The policies whose backend package is missing are skipped with a note.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_POLICIES = "full,window:256,sinkwindow:4:256,fp8,quantized:quanto:4,quantized:hqq:4"
GEN_TOKENS = 48
UNTIL = ["\n\n"]


def needle_contexts(tokenizer, lengths: list[int], langs: list[str]) -> list[tuple[str, int, str, str]]:
    """(lang, length, context, key) of one depth-0 needle prompt per language and length."""
    from evalkit.prompts import needle
    from evalkit.prompts.needle_task import token_counter
    from evalkit.prompts.templates import get_template, render_prompt

    template = get_template("chat")
    count = token_counter(tokenizer, chat=template.chat, system=template.system)
    out = []
    for lang in langs:
        for length in lengths:
            doc = needle.build_doc(count, lang=lang, length=length, depth=0.0, hint=False, seed=1234)
            out.append((lang, length, render_prompt(tokenizer, template, doc["prompt"]), doc["key"]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,1024,2048")
    parser.add_argument("--langs", default="en,zh")
    parser.add_argument("--policies", default=DEFAULT_POLICIES)
    parser.add_argument("--repeats", type=int, default=1, help="timed passes per policy (the best is kept)")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda ...")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from evalkit.engines.transformers import firststep as engine
    from evalkit.engines import kvpolicy
    from evalkit.engines import resolve as models
    from evalkit.errors import BadInput
    from evalkit.scoring.needle import needle_recall

    policies = []
    for spec in args.policies.split(","):
        policy = kvpolicy.parse(spec)
        try:
            kvpolicy.check_available(policy)
        except BadInput as exc:
            print(f"skipped {spec}: {exc}")
            continue
        policies.append(policy)
    lengths = [int(x) for x in args.lengths.split(",")]
    t0 = time.perf_counter()
    lm = models.load(models.resolve("hf", None, device=args.device), batch_size=1)
    print(f"model loaded in {time.perf_counter() - t0:.1f}s; torch threads {torch.get_num_threads()}")
    prompts = needle_contexts(lm.tokenizer, lengths, args.langs.split(","))
    n_tokens = {(lang, length): len(lm.tokenizer(ctx, add_special_tokens=False)["input_ids"])
                for lang, length, ctx, _ in prompts}

    cost: dict[tuple[str, int], dict[str, tuple[float, float]]] = {}  # (policy, length) -> wall, cpu per prompt
    recall: dict[tuple[str, int], list[float]] = {}
    for policy in policies:
        for length in lengths:
            batch = [p for p in prompts if p[1] == length]
            best = None
            for _ in range(max(1, args.repeats)):
                w0, c0 = time.perf_counter(), time.process_time()
                steps = engine.probe(lm.model, lm.tokenizer, [p[2] for p in batch], max_new_tokens=GEN_TOKENS,
                                     stop=UNTIL, batch_size=1, kv_policy=policy)
                wall, cpu = (time.perf_counter() - w0) / len(batch), (time.process_time() - c0) / len(batch)
                best = (wall, cpu) if best is None or cpu < best[1] else best
            cost[(policy.spec, length)] = best
            recall[(policy.spec, length)] = [
                needle_recall(lm.tok_decode(s.response_ids, skip_special_tokens=True).split("\n\n")[0], p[3])
                for s, p in zip(steps, batch)]
            print(f"  {policy.spec:<20} L={length:<5} wall {best[0]:7.2f}s  cpu {best[1]:7.2f}s a prompt", flush=True)

    print()
    print("cost a prompt against full (CPU-second ratio; wall ratio in brackets), recall of the depth-0 key")
    header = f"{'policy':<20}" + "".join(f"{'L=' + str(n):>26}" for n in lengths)
    print(header)
    for policy in policies:
        cells = []
        for length in lengths:
            wall, cpu = cost[(policy.spec, length)]
            fw, fc = cost.get(("full", length), (wall, cpu))
            hits = recall[(policy.spec, length)]
            cells.append(f"{cpu / fc:6.2f}x [{wall / fw:5.2f}x] {cpu:6.2f}s r={sum(hits):.0f}/{len(hits)}")
        print(f"{policy.spec:<20}" + "".join(f"{c:>26}" for c in cells))
    print()
    print("prompt tokens: " + ", ".join(f"{lang}@{length}={n}" for (lang, length), n in n_tokens.items()))
    for length in lengths:
        P = max(n for (lang, n_len), n in n_tokens.items() if n_len == length)
        print(f"4-D float32 prefill mask of the evicting policies at P={P}: {P * P * 4 / 2**20:.1f} MiB a prompt "
              f"(transformers' boolean mask: {P * P / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
