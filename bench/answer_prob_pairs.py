"""answer_prob (and ft_hit_prob) of every checkable first-token prompt under several --quant variants of
the default model, without the greedy decode: the numbers the gate's answer_prob rule sees, fast.

A full `evalkit run` also decodes 16 tokens a prompt and 48 for the checkable ones (answer_hit);
answer_prob needs only the prefill and the candidate trie. This bench asks `EvalkitHFLM` (the
transformers engine evalkit runs) for one token a prompt with answer_max_tokens=0, on the prompts
with `answers_full`, under the chat template, and writes {variant: {task/doc_id: {answer_prob,
ft_hit_prob}}} as JSON, for bench/gate_calibration.py --pairs-json (answer_prob's rule alone).

    python bench/answer_prob_pairs.py --quant q4_1,bf16,int8-weight,int8-dynamic,llamacpp [--limit 100] --out FILE

(`llamacpp`: the same GGUF on the llama.cpp engine, when llama-cpp-python is installed.)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def docs(limit: int | None) -> list[tuple[str, dict]]:
    out = []
    for lang in ("en", "zh"):
        path = ROOT / "tasks" / "firsttoken" / "data" / f"firsttoken_{lang}.jsonl"
        lines = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
        out += [(f"firsttoken_{lang}", {"kind": "firsttoken", **d}) for d in lines[:limit] if d.get("answers_full")]
    return out


def measure(quant: str, items, batch_size: int) -> dict[str, dict[str, float]]:
    from lm_eval.api.instance import Instance

    from evalkit.engines.transformers.convert import cached_args
    from evalkit.engines.transformers.model import EvalkitHFLM
    from evalkit.engines.plan import default_model_args

    lm: Any
    if quant == "llamacpp":  # the same GGUF on the llama.cpp engine
        from evalkit.engines.llamacpp.model import EvalkitLlamaCpp
        from evalkit.engines.plan import DEFAULT_GGUF, default_model_dir

        lm = EvalkitLlamaCpp(str(default_model_dir() / DEFAULT_GGUF), n_ctx=512, answer_max_tokens=0,
                             batch_size=batch_size)
    else:
        lm = EvalkitHFLM(**cached_args(default_model_args()), device="cpu", quant=quant, batch_size=batch_size,
                         answer_max_tokens=0)
    gen = {"until": ["\n\n"], "max_gen_toks": 1, "do_sample": False}
    reqs = []
    for i, (task, doc) in enumerate(items):
        ctx = lm.tokenizer.apply_chat_template([{"role": "user", "content": doc["prompt"]}], tokenize=False,
                                               add_generation_prompt=True)
        reqs.append(Instance("generate_until", doc, (ctx, dict(gen)), i, metadata=(task, i, 1)))
    results = lm.generate_until(reqs, disable_tqdm=True)
    return {f"{task}/{doc['id']}": {m: r.metrics[m] for m in ("answer_prob", "ft_hit_prob") if m in r.metrics}
            for (task, doc), r in zip(items, results)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quant", default="q4_1,bf16")
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts of each task (then checkable)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    items = docs(args.limit)
    out: dict = {}
    if Path(args.out).is_file():
        out = json.loads(Path(args.out).read_text())
    for quant in args.quant.split(","):
        start = time.perf_counter()
        out[quant] = measure(quant, items, args.batch_size)
        Path(args.out).write_text(json.dumps(out, indent=1, sort_keys=True))
        print(f"{quant}: {len(out[quant])} checkable prompts in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
