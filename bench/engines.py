"""transformers against llama.cpp on the same GGUF: speed, and whether the two engines agree.

Runs, in one process and one DuckDB file, the default SmolLM2-135M-Instruct Q4_1 GGUF
through `--model hf` (transformers: the GGUF dequantized to float32) and `--model llamacpp`
(llama.cpp's own Q4_1 kernels), and prints:

- decode ms/token at batch 1: one chat prompt's greedy continuation of 1 and of 33 tokens
  through each engine's first-step probe, (t33 − t1) / 32, best of `--repeats`;
- the whole `firsttoken` suite (470 prompts; `--limit N` per task for a quick look) with every
  metric, as `evalkit run --tasks firsttoken` runs it: load, eval and total wall seconds, the
  process's CPU seconds (steadier than wall time on a shared machine), and per prompt;
- the ratios hf / llamacpp, against the budget (llama.cpp >= 2x faster, docs/SPEC §4);
- engine agreement (`evalkit compare HF LLAMACPP`): top-1 agreement, flip rate, JS divergence,
  Δ ft_hit_prob with its paired bootstrap 95 % CI, and answer agreement (the share of prompts with
  checkable answers whose answer_hit is the same in both, and the share whose response is the same text).

    python bench/engines.py [--limit N] [--db PATH] [--out FILE.md] [--repeats 3] [--threads N]
                            [--gguf FILE.gguf | --requantize q4_0|q8_0]

`--gguf` runs both engines on another GGUF file (default: the embedded SmolLM2 Q4_1). `--requantize
TYPE` first writes the embedded file requantized to TYPE with llama.cpp's own `llama_model_quantize`
(into the bench's temporary folder) and runs on that: the speed of a file type llama.cpp has batched
CPU kernels for (Q4_0, Q8_0: llamafile's tinyBLAS) — Q4_1 has none on x86, which is what holds the
default file's prefill and candidate trie to torch's speed. A requantized file is for speed only:
its numbers are a Q4_1 model rounded twice, not a Q4_0 made from the original weights.

llama.cpp's threads busy-wait at their barriers: on a machine whose cores other processes
share, `--threads 1` is the steadier measurement (see docs/engines.md).
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

PROMPT = "What is the capital of France?"
DECODE_TOKENS = 32


def model_args(engine_name: str, gguf: Path | None, threads: int | None) -> str | None:
    """The `--model-args` of `engine_name` for `gguf` (None: the embedded file) and llama.cpp's threads."""
    args = []
    if gguf is not None:
        args.append(f"pretrained={gguf.parent},gguf_file={gguf.name}" if engine_name == "hf" else f"model={gguf}")
    if threads and engine_name == "llamacpp":
        args.append(f"n_threads={threads}")
    return ",".join(args) or None


def requantize(kind: str, folder: Path) -> Path:
    """The embedded GGUF requantized to `kind` (q4_0, q8_0) by llama.cpp, written into `folder`."""
    import ctypes

    import llama_cpp

    from evalkit.engines.plan import default_model_args

    ftype = {"q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[kind]
    embedded = default_model_args()
    src = Path(embedded["pretrained"]) / embedded["gguf_file"]
    dst = folder / f"{src.stem}.requantized-{kind}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = ftype, True
    if llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not requantize {src} to {kind}")
    return dst


def decode_ms_per_token(repeats: int, threads: int | None, gguf: Path | None = None) -> dict[str, float]:
    """Batch-1 greedy decode cost of each engine on one chat prompt, ms per token (best of `repeats`)."""
    from evalkit.engines.transformers import firststep as engine
    from evalkit.engines.llamacpp import probe as llamacpp
    from evalkit.engines.resolve import load, resolve
    from evalkit.prompts.templates import get_template, render_prompt

    out = {}
    hf = load(resolve("hf", model_args("hf", gguf, None)), batch_size=1)
    context = render_prompt(hf.tokenizer, get_template("chat"), PROMPT)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    def hf_gen(n):
        return lambda: engine.probe(hf.model, hf.tokenizer, [context], top_k=50, max_new_tokens=n, batch_size=1)

    out["hf"] = 1000 * (best(hf_gen(DECODE_TOKENS + 1)) - best(hf_gen(1))) / DECODE_TOKENS
    del hf
    lc = load(resolve("llamacpp", model_args("llamacpp", gguf, threads)), batch_size=1)

    def lc_gen(n):
        return lambda: llamacpp.probe(lc.eng, [context], top_k=50, max_new_tokens=n)

    out["llamacpp"] = 1000 * (best(lc_gen(DECODE_TOKENS + 1)) - best(lc_gen(1))) / DECODE_TOKENS
    lc.eng.close()
    return out


def suite(engine_name: str, db: str, limit: int | None, threads: int | None, gguf: Path | None = None) -> dict:
    """One whole `firsttoken` run through `engine_name`, stored in `db`; its timings."""
    import evalkit

    args = model_args(engine_name, gguf, threads)
    cpu0, t0 = time.process_time(), time.perf_counter()
    run = evalkit.run(tasks="firsttoken", model=engine_name, model_args=args, limit=limit, db=db,
                      name=f"bench-{engine_name}")
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"id": run.id, "n": run.n_samples, "load_s": run.load_s, "eval_s": run.eval_s, "wall_s": wall,
            "cpu_s": cpu, "per_prompt_s": run.eval_s / max(run.n_samples, 1)}


def agreement(db: str, hf_run: str, lc_run: str) -> dict:
    """The engine-agreement numbers of `evalkit compare HF LLAMACPP`, plus answer agreement."""
    from evalkit.compare import ALL_TASKS, compare_runs
    from evalkit.store.db import open_reader

    c = compare_runs(db, hf_run, lc_run)
    drift = next(r for r in c.drift if r.task == ALL_TASKS)
    hit = next((d for d in c.deltas if d.task == ALL_TASKS and d.metric == "ft_hit_prob"), None)
    with open_reader(db) as con:
        answers = con.execute(
            """
            SELECT count(*), avg(CAST(a.answer_hit = b.answer_hit AS DOUBLE)), avg(a.answer_hit), avg(b.answer_hit)
            FROM samples a JOIN samples b ON a.task = b.task AND a.doc_id = b.doc_id
            WHERE a.run_id = ? AND b.run_id = ? AND a.answer_hit IS NOT NULL AND b.answer_hit IS NOT NULL
            """, [hf_run, lc_run]).fetchone()
        same_text = con.execute(
            """
            SELECT avg(CAST(a.response = b.response AS DOUBLE)), avg(CAST(a.first_unit = b.first_unit AS DOUBLE))
            FROM samples a JOIN samples b ON a.task = b.task AND a.doc_id = b.doc_id
            WHERE a.run_id = ? AND b.run_id = ?
            """, [hf_run, lc_run]).fetchone()
    return {"n": drift.n, "top1_agreement": 1 - drift.flip_rate, "flip_rate": drift.flip_rate,
            "js_div": drift.js_div, "top5_overlap": drift.top5_overlap,
            "d_ft_hit_prob": (hit.delta, hit.lo, hit.hi, hit.mean_a, hit.mean_b) if hit else None,
            "answers_n": answers[0], "answer_agreement": answers[1], "answer_hit_hf": answers[2],
            "answer_hit_llamacpp": answers[3], "same_response": same_text[0], "same_first_unit": same_text[1]}


def render(decode: dict, runs: dict, agree: dict, threads: int | None, gguf: Path | None = None) -> str:
    hf, lc = runs["hf"], runs["llamacpp"]
    lines = [
        f"## transformers vs llama.cpp on {os.cpu_count()} CPU cores (llama.cpp threads: {threads or 'all'}), "
        f"{gguf.name if gguf else 'the embedded SmolLM2 Q4_1 GGUF'}",
        "",
        "| | hf (transformers, fp32) | llamacpp (llama.cpp's kernels) | hf / llamacpp |",
        "|---|---|---|---|",
        f"| decode, batch 1 (ms/token) | {decode['hf']:.1f} | {decode['llamacpp']:.1f} | "
        f"{decode['hf'] / decode['llamacpp']:.2f}x |",
        f"| firsttoken, {hf['n']} prompts: eval wall (s) | {hf['eval_s']:.1f} | {lc['eval_s']:.1f} | "
        f"{hf['eval_s'] / lc['eval_s']:.2f}x |",
        f"| same: total wall incl. load (s) | {hf['wall_s']:.1f} | {lc['wall_s']:.1f} | {hf['wall_s'] / lc['wall_s']:.2f}x |",
        f"| same: process CPU (s) | {hf['cpu_s']:.1f} | {lc['cpu_s']:.1f} | {hf['cpu_s'] / lc['cpu_s']:.2f}x |",
        f"| per prompt, every metric (s) | {hf['per_prompt_s']:.3f} | {lc['per_prompt_s']:.3f} | "
        f"{hf['per_prompt_s'] / lc['per_prompt_s']:.2f}x |",
        "",
        f"budget (SPEC §4): llama.cpp >= 2x faster on the whole suite: "
        f"{'met' if hf['wall_s'] / lc['wall_s'] >= 2 else 'NOT met'} ({hf['wall_s'] / lc['wall_s']:.2f}x total wall)",
        "",
        f"## engine agreement (`evalkit compare {hf['id']} {lc['id']}`, {agree['n']} prompts)",
        "",
        "| measure | value |",
        "|---|---|",
        f"| top-1 agreement | {agree['top1_agreement']:.3f} |",
        f"| flip rate | {agree['flip_rate']:.3f} |",
        f"| JS divergence (bits, top-50 + rest) | {agree['js_div']:.4f} |",
        f"| top-5 overlap | {agree['top5_overlap']:.3f} |",
    ]
    d = agree["d_ft_hit_prob"]
    if d:
        lines.append(f"| Δ ft_hit_prob (llamacpp − hf) [95% CI] | {d[0]:+.4f} [{d[1]:+.4f}, {d[2]:+.4f}] "
                     f"(hf {d[3]:.4f}, llamacpp {d[4]:.4f}) |")
    if agree["answers_n"]:
        lines.append(f"| answer agreement (same answer_hit, {agree['answers_n']} checkable) | "
                     f"{agree['answer_agreement']:.3f} (answer_hit hf {agree['answer_hit_hf']:.3f}, "
                     f"llamacpp {agree['answer_hit_llamacpp']:.3f}) |")
    lines.append(f"| same response text | {agree['same_response']:.3f} |")
    lines.append(f"| same first unit | {agree['same_first_unit']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=None, help="prompts per task (default: the whole suite)")
    parser.add_argument("--db", default=None, help="DuckDB file for the two runs (default: a temporary one)")
    parser.add_argument("--out", default=None, help="also write the markdown here")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: the usable cores)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--gguf", type=Path, default=None, help="run both engines on this GGUF file")
    which.add_argument("--requantize", choices=("q4_0", "q8_0"), default=None,
                       help="run both engines on the embedded GGUF requantized to this type (speed only)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    db = args.db or str(Path(tempfile.mkdtemp(prefix="evalkit-engines-")) / "engines.duckdb")
    gguf = args.gguf.resolve() if args.gguf else None
    if args.requantize:
        gguf = requantize(args.requantize, Path(tempfile.mkdtemp(prefix="evalkit-requantized-")))
    if gguf is not None and not gguf.is_file():
        raise SystemExit(f"no GGUF file at {gguf}")
    decode = decode_ms_per_token(args.repeats, args.threads, gguf)
    print(f"decode ms/token: {decode}", file=sys.stderr, flush=True)
    runs = {}
    for name in ("hf", "llamacpp"):
        runs[name] = suite(name, db, args.limit, args.threads, gguf)
        print(f"{name}: {runs[name]}", file=sys.stderr, flush=True)
    text = render(decode, runs, agreement(db, runs["hf"]["id"], runs["llamacpp"]["id"]), args.threads, gguf)
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
