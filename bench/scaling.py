"""How the transformers engine's cost grows with the model: seconds and positions a prompt, peak RSS, caps.

Runs a few `firsttoken` prompts through the real `evalkit.run` path on models of public shapes, each
in its own process (so each peak RSS is its own):

  SmolLM2-135M   the default model itself (SmolLM2-135M-Instruct, Q4_1 dequantized to fp32);
  Qwen2.5-0.5B   hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151,936, tied;
  Llama-3.2-1B   hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, vocabulary 128,256, tied;
  Gemma-3-270M   hidden 640, 18 layers, 4 heads, 1 KV head of 256, MLP 2048, vocabulary 262,144,
                 tied (a small body under the largest vocabulary users run).

All but the first are random-weight models built from their shapes (Qwen2 and Llama architectures;
the Gemma shape on the Llama architecture, which computes the same matmuls at these lengths) and
saved in fp32 with SmolLM2's tokenizer; the embedding rows past the tokenizer's 49,152 tokens are
zeroed, so every vocabulary position is computed but never chosen. They are made peaked like a
trained model: the final norm's weight is set so the logits spread with a standard deviation of
`--logit-std` (4) whatever the hidden size, so one token leads each step. What random weights cannot
imitate is which candidate prefixes a trained model makes likely: a trained model carries a
multi-token opener on ("Cert" → "ainly"), a random one gives every continuation about 1/vocabulary,
so under evalkit's tolerance (1e-4) a random model's trie stops after its first level (12–15
positions a prompt here, against about 136 for SmolLM2). So every model here runs the trie exact
(`--tolerance 0`: every prefix of every candidate forced, the most a prompt's trie can cost,
the same prefixes for every model since all use SmolLM2's tokenizer); `--tolerance default` runs
evalkit's. Random weights never end a response, so decode runs to its cap: the task's 16 tokens,
48 where an answer is continued (a trained model often stops before).

For each model it prints: wall and CPU seconds a prompt (the eval alone, not the load), the positions
the engine computed a prompt (prefill, trie, decode: the engine's forwards counted as bench/phases.py
counts them), peak RSS of the process, and the caps the run chose and stored (`runs.batch_size`,
`batch_positions`, `trie_positions`). The machine is shared: CPU seconds and the load average are
printed beside every figure.

    python bench/scaling.py                         # 4 prompts a task (8 a model), every model
    python bench/scaling.py --models qwen2.5-0.5b   # one model
    python bench/scaling.py --limit 2 --markdown    # fewer prompts; a markdown table at the end
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# name -> (architecture, config keywords); None: the default model itself
MODELS: dict[str, tuple[str, dict] | None] = {
    "smollm2-135m": None,
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                                   tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                                   tie_word_embeddings=True, max_position_embeddings=131072, rope_theta=5e5)),
    "gemma-3-270m": ("llama", dict(hidden_size=640, num_hidden_layers=18, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=256, intermediate_size=2048, vocab_size=262144,
                                   tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6)),
    # not in the table: a 2-layer body under SmolLM2's vocabulary, to choose --logit-std in seconds
    "calibration": ("llama", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=128, vocab_size=49152, tie_word_embeddings=True,
                                  max_position_embeddings=8192)),
}
LOGIT_STD = 4.0
TABLE = ("smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b", "gemma-3-270m")


def tokenizer_folder() -> str:
    """The default model's converted folder (its fast tokenizer and weights), converting it if needed."""
    from evalkit.engines.plan import default_model_args
    from evalkit.engines.transformers.convert import cached_args

    return str(cached_args(default_model_args())["pretrained"])


def build(name: str, folder: Path, logit_std: float) -> None:
    """Save a random-weight, peaked model of `name`'s shapes and SmolLM2's tokenizer in `folder`: the final
    norm's weight is set so the logits over the tokenizer's tokens spread with standard deviation
    `logit_std` whatever the hidden size (a unit-RMS hidden state times the embedding rows)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    arch, shape = MODELS[name]  # type: ignore[misc]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder())
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(0)
    model = model_cls(config_cls(**shape, **ids, dtype="float32"))
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[len(tokenizer):] = 0  # ids past the tokenizer: computed, never chosen
        scale = float(emb[:len(tokenizer)].std()) * emb.shape[1] ** 0.5  # a logit's spread at norm weight 1
        model.model.norm.weight.fill_(logit_std / scale)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def measure(name: str, folder: str | None, limit: int, tolerance: float | None) -> dict:
    """One model's run, in this process: the figures `main` prints."""
    from bench.phases import instrument
    import duckdb
    import evalkit

    meter, steps, undo = instrument("after")
    args = ([f"pretrained={folder}"] if folder else []) + ([f"tolerance={tolerance}"] if tolerance is not None else [])
    options = {"model_args": ",".join(args)} if args else {}
    with tempfile.TemporaryDirectory(prefix="evalkit-scaling-") as tmp:
        db = Path(tmp) / "runs.duckdb"
        c0 = time.process_time()
        try:
            run = evalkit.run(tasks="firsttoken", db=db, limit=limit, device="cpu", **options)
        finally:
            undo()
        cpu = time.process_time() - c0
        con = duckdb.connect(str(db), read_only=True)
        row = con.execute("SELECT batch_size, batch_positions, trie_positions FROM runs").fetchone()
        con.close()
    prompts = run.n_samples  # the content-free prior's probes are computed, not counted as prompts
    fed = {p: meter.fed[p] for p in ("prefill", "trie", "decode")}
    return {
        "model": name, "prompts": prompts, "load_s": run.load_s, "eval_s": run.eval_s,
        "eval_cpu_s": meter.cpu["prefill"] + meter.cpu["trie"] + meter.cpu["decode"], "cpu_s": cpu,
        "fed": fed, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "caps": {"batch_prompts": row[0], "batch_positions": row[1], "trie_positions": row[2]},
        "params": _params(folder),
    }


def _params(folder: str | None) -> int:
    """Parameters of the saved model (tied embeddings counted once)."""
    from safetensors import safe_open

    folder = folder or tokenizer_folder()
    total = 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                total += _prod(f.get_slice(key).get_shape())
    return total


def _prod(shape) -> int:
    out = 1
    for n in shape:
        out *= int(n)
    return out


def child(args) -> int:
    if args.build:
        build(args.model, Path(args.build), args.logit_std)
        return 0
    tolerance = None if args.tolerance == "default" else float(args.tolerance)
    print("RESULT " + json.dumps(measure(args.model, args.folder, args.limit, tolerance)), flush=True)
    return 0


def run_one(name: str, args) -> dict:
    """Build (in one process) and measure (in another) one model; returns its figures."""
    me = [sys.executable, str(Path(__file__).resolve()), "--model", name, "--limit", str(args.limit),
          "--tolerance", args.tolerance]
    with tempfile.TemporaryDirectory(prefix="evalkit-scaling-model-", dir=args.tmp) as tmp:
        folder = None
        if MODELS[name] is not None:
            folder = str(Path(tmp) / name)
            t0 = time.perf_counter()
            subprocess.run(me + ["--build", folder, "--logit-std", str(args.logit_std)], check=True)
            print(f"[{name}] built in {time.perf_counter() - t0:.0f} s", flush=True)
        load0 = os.getloadavg()[0]
        out = subprocess.run(me + (["--folder", folder] if folder else []), check=True, capture_output=True,
                             text=True)
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
        result = json.loads(line[len("RESULT "):])
        result["load_avg"] = (load0, os.getloadavg()[0])
        result["tolerance"] = args.tolerance
        return result


def row(r: dict) -> str:
    n = max(r["prompts"], 1)
    fed = r["fed"]
    caps = r["caps"]
    return (f"| {r['model']} | {r['params'] / 1e6:.0f} M | {r['eval_s'] / n:.2f} | {r['eval_cpu_s'] / n:.2f} | "
            f"{fed['prefill'] / n:.0f} / {fed['trie'] / n:.0f} / {fed['decode'] / n:.0f} | "
            f"{r['peak_rss'] / 1e9:.2f} GB | {caps['batch_prompts']} / {caps['batch_positions']} / "
            f"{caps['trie_positions']} | {r['load_avg'][0]:.1f}–{r['load_avg'][1]:.1f} |")


HEADER = ("| model | parameters | wall s / prompt | CPU s / prompt | positions / prompt (prefill / trie / decode) | "
          "peak RSS | caps (prompts / positions / trie) | load average |\n|---|---|---|---|---|---|---|---|")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(TABLE), help="comma list of " + ", ".join(MODELS))
    ap.add_argument("--limit", type=int, default=4, help="prompts a task (firsttoken has two: en, zh)")
    ap.add_argument("--logit-std", type=float, default=LOGIT_STD,
                    help="the random models' logits spread with this standard deviation (how peaked they are)")
    ap.add_argument("--tolerance", default="0",
                    help="the candidate trie's tolerance (default 0: every prefix forced, see above; "
                         "'default': evalkit's)")
    ap.add_argument("--tmp", default=None, help="where the built models are saved (default: the system's)")
    ap.add_argument("--markdown", action="store_true", help="print the table in markdown at the end")
    # one model, in a child process
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--build", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model:
        return child(args)
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)} (known: {', '.join(MODELS)})")
    results = []
    for name in names:
        r = run_one(name, args)
        results.append(r)
        print(f"[{name}] {json.dumps(r)}", flush=True)
    print("\n" + HEADER)
    for r in results:
        print(row(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
