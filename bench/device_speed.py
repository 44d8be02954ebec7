"""Where a device's time goes: fp32 against bf16, plain against `--attention`, and by SDPA kernel.

In one process, the default model loaded once per variant on `--device`, the same prompts each
time, each path warmed up once and then timed (after a device synchronize), best of `--rounds`:

  (1) `EvalkitHFLM.generate_until` on `--per-lang` firsttoken prompts of each language (every
      first-token metric, the answer continued to 48 tokens), under `--quant fp32` and `bf16`:
      seconds a prompt and bf16 / fp32 (the issue's target: <= 1);
  (2) the same requests under each set of SDPA kernels torch may pick from (as evalkit leaves it:
      torch's order without cuDNN; cuDNN first; flash + memory-efficient only; math only), fp32
      and bf16, so a kernel that is slow on
      evalkit's shapes (the prefill, a KV cache one column longer at every decode step, the
      candidate trie's levels: a new shape at almost every call) shows as the row that differs;
  (3) needle_en prompts (`--needle-length` tokens, depths 0, 0.5, 1) through `engine.probe` with
      48 tokens to answer, plainly and with the attention read (`evalkit_eager` on the prefill):
      --attention / plain (the issue's target: <= 2.5).

    python bench/device_speed.py [--device cuda] [--per-lang 10] [--rounds 2] [--needle-length 1024]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def clock(device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def best(fn, device, rounds: int) -> float:
    fn()  # warm-up: kernels chosen, caches built
    times = []
    for _ in range(rounds):
        t = clock(device)
        fn()
        times.append(clock(device) - t)
    return min(times)


def kernel_sets():
    """(label, the SDPA backends allowed, whether their order is a priority) for (2); None: as evalkit
    leaves it (on CUDA, `hf.no_cudnn_attention`: torch's order without cuDNN)."""
    from torch.nn.attention import SDPBackend

    flash, efficient, math_, cudnn = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
                                      SDPBackend.CUDNN_ATTENTION)
    return [("evalkit default", None, False), ("cuDNN first", [cudnn, flash, efficient, math_], True),
            ("flash + efficient", [flash, efficient], False), ("math only", [math_], False)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--per-lang", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--needle-length", type=int, default=1024)
    ap.add_argument("--model-args", default=None, help="pretrained=DIR,... instead of the default model")
    ap.add_argument("--skip-kernels", action="store_true", help="leave out (2)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in ("lm_eval", "lm-eval", "lm_eval.models.huggingface", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)

    import contextlib

    import torch
    from first_token_vs_sampling import UNTIL, evalkit_lm_path, load_docs
    from lm_eval.api.instance import Instance
    from torch.nn.attention import sdpa_kernel

    from evalkit.engines.transformers import attention
    from evalkit.engines.transformers import firststep as engine
    from evalkit.engines import resolve as models
    from evalkit.prompts.templates import get_template, render_prompt

    docs = load_docs(args.per_lang)
    per_prompt: dict[str, float] = {}
    for quant in ("fp32", "bf16"):
        lm = models.load(models.resolve("hf", args.model_args, quant_name=quant, device=args.device), batch_size=8)
        device = lm.model.device
        template = get_template("chat")
        contexts = [render_prompt(lm.tokenizer, template, d["prompt"]) for d in docs]
        gen = {"until": UNTIL, "do_sample": False, "max_gen_toks": 0}
        requests = [Instance("generate_until", d, (c, dict(gen)), idx=0, metadata=("speed", i, 1))
                    for i, (c, d) in enumerate(zip(contexts, docs))]
        if quant == "fp32":
            print(f"{len(docs)} firsttoken prompts on {device} "
                  f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
                  f"torch {torch.__version__}, best of {args.rounds}")
        sets = kernel_sets() if not args.skip_kernels and device.type == "cuda" else kernel_sets()[:1]
        for label, allowed, priority in sets:
            scope = sdpa_kernel(allowed, set_priority=priority) if allowed else contextlib.nullcontext()
            try:
                with scope:
                    s = best(lambda: lm.generate_until(requests, disable_tqdm=True), device, args.rounds)
            except RuntimeError as exc:  # no kernel of the set serves a shape
                print(f"    {quant:<5} {label:<18} not run: {str(exc).splitlines()[0][:90]}")
                continue
            per_prompt[f"{quant} {label}"] = s / len(docs)
            print(f"    {quant:<5} {label:<18} {s / len(docs) * 1000:8.1f} ms a prompt")
        if quant == "fp32":  # (3) on the fp32 model
            from evalkit.prompts.needle import build_doc
            from evalkit.prompts.needle_task import token_counter

            count = token_counter(lm.tokenizer, chat=template.chat, system=template.system)
            needles = [build_doc(count, lang="en", length=args.needle_length, depth=d, hint=False, seed=1234)
                       for d in (0.0, 0.5, 1.0)]
            ctxs = [render_prompt(lm.tokenizer, template, d["prompt"]) for d in needles]
            reads = []
            for doc, ctx in zip(needles, ctxs):
                start = ctx.index(doc["needle"])
                reads.append(attention.Request({"needle_attn": attention.token_span(
                    lm.tokenizer, ctx, start, start + len(doc["needle"]))}))

            def run(reqs, ctxs=ctxs):
                return engine.probe(lm.model, lm.tokenizer, ctxs, max_new_tokens=48, stop=UNTIL,
                                    batch_size=len(ctxs), attention=reqs)

            plain = best(lambda: run(None), device, args.rounds)
            attention.install(lm.model)
            read = best(lambda: run(reads), device, args.rounds)
            print(f"    --attention, {len(ctxs)} needle_en prompts of {args.needle_length} tokens, 48 to answer: "
                  f"plain {plain:.2f} s, --attention {read:.2f} s: {read / plain:.2f}x   target <= 2.5x   "
                  f"{'PASS' if read / plain <= 2.5 else 'FAIL'}")
        del lm
    if "fp32 evalkit default" in per_prompt and "bf16 evalkit default" in per_prompt:
        ratio = per_prompt["bf16 evalkit default"] / per_prompt["fp32 evalkit default"]
        print(f"    bf16 / fp32 (evalkit's default kernels): {ratio:.2f}x   target <= 1   {'PASS' if ratio <= 1 else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
