"""Models on different tokenizers, compared: a tiny random-weight Qwen2 on Qwen2's real vocabulary, its
permuted-id twin (every regular token id permuted in the tokenizer and in the embedding and head rows
alike, so it says exactly what the base says), and a tiny Llama on Phi-3's vocabulary.

Prints, for the twin and for the other family against the base: js_div, flip_rate and top5_overlap
by token id (what evalkit computed before it told tokenizers apart) and as `evalkit compare` computes
them now, and the gate's verdict under `--rules same` and `--rules upgrade`.

    python bench/cross_tokenizer.py [--vocab DIR]   # DIR holds ggml-vocab-qwen2.gguf, ggml-vocab-phi-3.gguf

The vocabulary GGUFs come with the llama-cpp-python sdist (vendor/llama.cpp/models/). Does not run
the evalkit pipeline: the first-token top-k (k = 50) and ft_hit_prob of each prompt are computed
here with transformers and written into a temporary DB as a run would write them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

PROMPTS = ["What is the capital of France?", "What is the capital of Japan?", "Who wrote Hamlet?", "What is 2 + 2?",
           "What colour is the sky?", "Name a prime number.", "What is the largest planet?",
           "What language is spoken in Brazil?", "What is water made of?", "Who painted the Mona Lisa?",
           "What is the boiling point of water?", "What is recursion?", "中国的首都是哪里？", "日本的首都是哪里？",
           "什么是递归？", "一加一等于几？", "天空是什么颜色？", "谁写了红楼梦？", "What is the speed of light?",
           "How many legs does a spider have?", "What is the chemical symbol for gold?", "Which ocean is the largest?",
           "What is the square root of 9?", "Who discovered penicillin?", "What is DNA?", "法国的首都是哪里？",
           "水是由什么组成的？", "What is an atom?", "What gas do plants absorb?", "What is gravity?"]
ANSWERS = [" Paris", " Tokyo", " Shakespeare", " 4", " Blue", " 2", " Jupiter", " Portuguese", " Hydrogen",
           " Leonardo", " 100", " Recursion", "北京", "东京", "递归", "二", "蓝色", "曹雪芹", " 300", " 8", " Au",
           " Pacific", " 3", " Alexander", " DNA", "巴黎", "氢", " An", " Carbon", " Gravity"]
K = 50


def tiny(cls, config_cls, n_vocab: int, seed: int):
    """A 2-layer, 64-wide random model; its final norm scaled by 40 so its first steps are peaked."""
    import torch

    torch.manual_seed(seed)
    cfg = config_cls(vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     tie_word_embeddings=False)
    model = cls(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(40.0)
    return model


def first_steps(model, tok) -> list[dict]:
    """Per prompt: the top-K first tokens (id, text, logprob) and P(answer) teacher-forced."""
    import torch

    out = []
    for question, answer in zip(PROMPTS, ANSWERS):
        text = f"Question: {question}\nAnswer:"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        answer_ids = tok(text + answer, add_special_tokens=False)["input_ids"][len(ids):]
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids + answer_ids])).logits[0].double(), -1)
        top = torch.topk(lp[len(ids) - 1], K)
        prob = math.exp(sum(float(lp[len(ids) - 1 + j, t]) for j, t in enumerate(answer_ids)))
        out.append({"top": [(int(t), tok.decode([int(t)], skip_special_tokens=False), float(v))
                            for v, t in zip(top.values, top.indices)], "ft_hit_prob": prob})
    return out


def build(vocab: Path) -> dict[str, dict]:
    import torch
    from tokenizers import Tokenizer
    from transformers import (AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
                              Qwen2ForCausalLM)

    from evalkit.engines.tokenizer_id import identify

    qwen = AutoTokenizer.from_pretrained(vocab, gguf_file="ggml-vocab-qwen2.gguf")
    phi = AutoTokenizer.from_pretrained(vocab, gguf_file="ggml-vocab-phi-3.gguf")
    data = json.loads(qwen.backend_tokenizer.to_str())
    regular = data["model"]["vocab"]
    perm = torch.randperm(len(regular), generator=torch.Generator().manual_seed(0)).tolist()  # old id -> new id
    data["model"]["vocab"] = {t: perm[i] for t, i in regular.items()}
    twin_tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)))
    base, twin = tiny(Qwen2ForCausalLM, Qwen2Config, len(qwen), 1), tiny(Qwen2ForCausalLM, Qwen2Config, len(qwen), 1)
    new_to_old = list(range(len(qwen)))
    for old, new in enumerate(perm):
        new_to_old[new] = old
    with torch.no_grad():  # the twin's row for new id j is the base's row for the id j replaced
        twin.model.embed_tokens.weight.copy_(base.model.embed_tokens.weight[new_to_old])
        twin.lm_head.weight.copy_(base.lm_head.weight[new_to_old])
    family = tiny(LlamaForCausalLM, LlamaConfig, len(phi), 2)
    runs = {}
    for name, model, tok in (("qwen2", base, qwen), ("twin", twin, twin_tok), ("phi3", family, phi)):
        tid = identify(tok, f"transformers {name}")
        runs[name] = {"hash": tid.hash, "source": tid.source, "prompts": first_steps(model, tok)}
    return runs


def store(runs: dict[str, dict]) -> None:
    from evalkit.store import runs as store_runs

    for i, (name, r) in enumerate(runs.items()):
        store_runs.insert_run(None, {"id": name, "created_at": f"2025-01-0{i + 1} 00:00:00", "status": "running",
                                     "model": name, "model_fingerprint": f"fingerprint-{name}", "top_k": K,
                                     "tokenizer_hash": r["hash"], "tokenizer_source": r["source"]})
        samples = [{"run_id": name, "task": "firsttoken_en", "doc_id": f"d{j}", "ft_hit_prob": p["ft_hit_prob"]}
                   for j, p in enumerate(r["prompts"])]
        topk = [{"run_id": name, "task": "firsttoken_en", "doc_id": f"d{j}", "rank": k, "token_id": t, "token": text,
                 "logprob": lp} for j, p in enumerate(r["prompts"]) for k, (t, text, lp) in enumerate(p["top"])]
        store_runs.finish_run(None, name, metrics=[], samples=samples, topk=topk, status="done")


def by_id(runs, a: str, b: str) -> dict[str, float]:
    """Mean js_div, flip rate and top-5 overlap pairing top-k rows by token id (evalkit's numbers before)."""
    from evalkit.compare import prompt_drift

    ds = [prompt_drift(([t for t, _, _ in pa["top"]], [lp for _, _, lp in pa["top"]]),
                       ([t for t, _, _ in pb["top"]], [lp for _, _, lp in pb["top"]]))
          for pa, pb in zip(runs[a]["prompts"], runs[b]["prompts"])]
    return {m: sum(d[m] for d in ds) / len(ds) for m in ("js_div", "flipped", "top5_overlap")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=Path, default=Path.home() / ".cache" / "evalkit-test" / "vocab")
    args = parser.parse_args()
    runs = build(args.vocab)
    os.environ["EVALKIT_DB"] = str(Path(tempfile.mkdtemp()) / "cross.duckdb")
    store(runs)
    from evalkit.compare import compare_runs
    from evalkit.release.db import gate_runs

    for cand in ("twin", "phi3"):
        before = by_id(runs, "qwen2", cand)
        row = compare_runs(None, "qwen2", cand).drift[-1]
        print(f"{cand} against qwen2 ({len(PROMPTS)} prompts, top-{K})")
        print(f"  by token id:  js_div {before['js_div']:.4f}  flip_rate {before['flipped']:.3f}  "
              f"top5_overlap {before['top5_overlap']:.3f}")
        print(f"  now ({row.space}):  js_div {row.js_div:.4f}  flip_rate {row.flip_rate:.3f}  "
              f"top5_overlap {row.top5_overlap:.3f}")
        for rules in ("same", "upgrade"):
            g = gate_runs(None, cand, "qwen2", rules)
            js = next((r for r in g.verdict.rows if r.metric == "js_div"), None)
            shown = f"js_div {js.drop:.4f} [{js.ci[0]:.4f}, {js.ci[1]:.4f}]" if js and js.ci else "no js_div check"
            print(f"  gate --rules {rules}: {g.outcome.upper()}  ({shown})")


if __name__ == "__main__":
    main()
