"""What `--attention` costs: time over a plain run on the same needle prompts, and peak memory at 2048 tokens.

On the default SmolLM2-135M-Instruct (Q4_1 GGUF, fp32 compute on CPU):

  (1) time, in one process, the model loaded once: the same needle_en prompts (chat
      template, `--length` tokens, depths 0, 0.5 and 1 by default) through `engine.probe`
      as a run sends them (batched as a run batches them, 48 tokens to answer, stop "\\n\\n"), plainly (the
      model's own sdpa attention) and with the attention read (`evalkit_eager`, the needle
      span requested). The two alternate `--rounds` times; the fastest of each is kept.
      Prints seconds a prompt and the ratio attention / plain;
  (2) peak RSS of two whole runs as child processes, each measured on its own:
      `evalkit run --tasks needle_en --needle-lengths 2048 --needle-depths 0,0.1,...,0.7`
      (8 prompts: at the default batch size, 8, the engine's position budget,
      `defaults.BATCH_TOKENS` = 4608, runs them 2 at a time; `--rss-batch-size N` asks for
      at most N at a time) with and without
      `--attention`, against the 2 GB budget of the default run (bench/peak_rss.py);
  (3) with `--long-grid`, the CPU cost of the `long` preset: one plain prompt at each of
      2048, 4096 and 7680 tokens (prefill and answer), to price the 33 prompts a task of
      the long grid holds (11 depths x 3 lengths).

    python bench/attention_cost.py [--length 2048] [--depths 0,0.5,1] [--rounds 2]
                                   [--rss-depths 0,0.1,...,0.7] [--rss-batch-size N]
                                   [--skip-time] [--skip-rss] [--long-grid] [--device cuda]

Takes about 2.5 minutes for (1) on a quiet 2-core CPU and several more for (2), two model
loads and two whole runs (25 minutes in all with the load average at 4); `--long-grid`
adds about 1.5.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUDGET_BYTES = 2 * 10**9  # the default run's budget (bench/peak_rss.py)
GEN_TOKENS = 48
UNTIL = ["\n\n"]


def load_model(device: str = "cpu"):
    from evalkit.engines import resolve as models

    plan = models.resolve("hf", None, device=device)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    return models.load(plan, batch_size=8)


def needle_contexts(tokenizer, length: int, depths: list[float], lang: str = "en"):
    """The needle_en documents a run builds (chat template, seed 1234) and their templated contexts."""
    from evalkit.prompts.needle import build_doc
    from evalkit.prompts.needle_task import token_counter
    from evalkit.prompts.templates import get_template, render_prompt

    template = get_template("chat")
    count = token_counter(tokenizer, chat=template.chat, system=template.system)
    docs = [build_doc(count, lang=lang, length=length, depth=d, hint=False, seed=1234) for d in depths]
    return docs, [render_prompt(tokenizer, template, d["prompt"]) for d in docs]


def timed(fn, *args, **kwargs):
    """(seconds, result) of fn(*args, **kwargs), the device's queued work included (CUDA is asynchronous)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    sync()
    return time.perf_counter() - t0, result


def time_paths(lm, length: int, depths: list[float], rounds: int) -> None:
    from evalkit.engines.transformers import attention
    from evalkit.engines.transformers import firststep as engine

    model, tokenizer = lm.model, lm.tokenizer
    docs, contexts = needle_contexts(tokenizer, length, depths)
    requests = []
    for doc, ctx in zip(docs, contexts):
        start = ctx.index(doc["needle"])
        requests.append(attention.Request({"needle_attn": attention.token_span(tokenizer, ctx, start,
                                                                               start + len(doc["needle"]))}))
    n_tokens = [len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in contexts]

    def run(reads):
        return engine.probe(model, tokenizer, contexts, max_new_tokens=GEN_TOKENS, stop=UNTIL,
                            batch_size=len(contexts), attention=reads)

    plain, read, same = [], [], True
    for _ in range(rounds):
        model.set_attn_implementation("sdpa")
        seconds, base = timed(run, None)
        plain.append(seconds)
        attention.install(model)
        seconds, got = timed(run, requests)
        read.append(seconds)
        same &= all(a.response_ids == b.response_ids for a, b in zip(base, got))
    model.set_attn_implementation("sdpa")
    n = len(contexts)
    p, a = min(plain), min(read)
    print(f"(1) {n} needle_en prompts of {min(n_tokens)}-{max(n_tokens)} tokens (depths {depths}), batched as in a run, "
          f"{GEN_TOKENS} tokens to answer, best of {rounds}:")
    print(f"    plain (sdpa)          {p:7.1f} s  ({p / n:.1f} s a prompt)   rounds: {', '.join(f'{t:.1f}' for t in plain)}")
    print(f"    --attention (eager)   {a:7.1f} s  ({a / n:.1f} s a prompt)   rounds: {', '.join(f'{t:.1f}' for t in read)}")
    print(f"    cost of --attention:  {a / p:.2f}x the plain run; responses identical: {same}")
    for doc, step in zip(docs, got):
        print(f"    depth {doc['depth']:<4}  needle_attn {step.attention.span('needle_attn'):.4f}  "
              f"sink_rate {step.attention.sink_rate():.3f}")


def child_peak(cmd: list[str]) -> tuple[int, float, int, str]:
    """(peak RSS in bytes, wall s, exit code, last line) of `cmd`, measured in a wrapper of its own."""
    wrapper = ("import resource, subprocess, sys, time\n"
               "t = time.perf_counter(); p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
               "last = (p.stdout.strip().splitlines() or [''])[0] if p.returncode == 0 else p.stderr[-300:]\n"
               "print(peak, time.perf_counter() - t, p.returncode, last, sep='\\t')\n")
    out = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    peak, wall, rc, last = out.stdout.strip().split("\t", 3)
    return int(peak), float(wall), int(rc), last


def peak_rss(length: int, depths: list[float], batch_size: int | None = None) -> None:
    script = Path(sys.executable).parent / "evalkit"
    exe = [str(script)] if script.exists() else [sys.executable, "-c", "from evalkit.cli import main; main()"]
    batch = ["--batch-size", str(batch_size)] if batch_size else []
    print(f"(2) peak RSS of whole runs (child processes), needle_en at {length} tokens, depths {depths}:")
    with tempfile.TemporaryDirectory(prefix="evalkit-attn-") as tmp:
        for extra in ([], ["--attention"]):
            cmd = [*exe, "run", "--tasks", "needle_en", "--needle-lengths", str(length), "--needle-depths",
                   ",".join(f"{d:g}" for d in depths), "--device", "cpu", "--db", str(Path(tmp) / "runs.duckdb"),
                   *batch, *extra]
            peak, wall, rc, last = child_peak(cmd)
            shown = " ".join(["evalkit", *cmd[len(exe):-2 - len(batch) - len(extra)], *batch, *extra])
            if rc != 0:
                print(f"    `{shown}` failed (exit {rc}): {last}")
                continue
            verdict = "ok" if peak < BUDGET_BYTES else "OVER BUDGET"
            print(f"    `{shown}`: {wall:.0f} s wall, peak RSS {peak / 1e9:.3f} GB   target < 2 GB: {verdict}")


def long_grid(lm) -> None:
    from evalkit.engines.transformers import firststep as engine

    print("(3) the long preset, one plain prompt per length (prefill + answer, batch 1):")
    for length in (2048, 4096, 7680):
        _, (context,) = needle_contexts(lm.tokenizer, length, [0.5])
        s, _ = timed(engine.probe, lm.model, lm.tokenizer, [context], max_new_tokens=GEN_TOKENS, stop=UNTIL,
                     batch_size=1)
        print(f"    {length:>5} tokens: {s:6.1f} s a prompt -> {11 * s / 60:5.1f} min for the 11 depths of one task")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--depths", default="0,0.5,1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rss-depths", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7",
                        help="depths of the whole runs of (2): 8 = the default batch size")
    parser.add_argument("--rss-batch-size", type=int, default=None, help="--batch-size of the whole runs of (2)")
    parser.add_argument("--device", default="cpu", help="where (1) and (3) run: cpu, cuda ... ((2) measures CPU RSS)")
    parser.add_argument("--skip-time", action="store_true", help="leave out (1), the timed paths")
    parser.add_argument("--skip-rss", action="store_true", help="leave out (2), the two whole runs")
    parser.add_argument("--long-grid", action="store_true", help="also (3), the cost of the long preset")
    args = parser.parse_args()
    depths = [float(d) for d in args.depths.split(",")]
    if not args.skip_time or args.long_grid:
        t0 = time.perf_counter()
        lm = load_model(args.device)
        print(f"model loaded in {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} CPUs")
        if not args.skip_time:
            time_paths(lm, args.length, depths, args.rounds)
        if args.long_grid:
            long_grid(lm)
        del lm
    if not args.skip_rss:
        peak_rss(args.length, [float(d) for d in args.rss_depths.split(",")], args.rss_batch_size)
    print(f"this process: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
