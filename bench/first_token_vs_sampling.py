"""The first-token budget: first-token metrics from one prefill vs the sampling protocol.

On the same prompts (5 en + 5 zh from tasks/firsttoken/data by default) and the
default SmolLM2-135M-Instruct (loaded ONCE, shared by every path), in one process:

  (a) lm-eval `generate_until` through `lm_eval.models.huggingface.HFLM` (the loaded
      model object and tokenizer, batch size 1): every prompt requested 20 times
      (`repeats: 20`), do_sample, temperature 0.8, max_gen_toks 4, until "\\n\\n";
  (b) evalkit's first-token metrics, the path `evalkit.engines.transformers.model.EvalkitHFLM` takes:
      `engine.probe` with the answers' candidate strings plus the lexicon candidates
      (tolerance 1e-4, as runs use), max_new_tokens 0, batch size 8, then top-k,
      top3_mass@0.8, ft_hit_prob, ft_token_hit, opener_mass and prior_drift (the
      content-free prior, once per template frame, is included in the time);
  (c) the distribution alone (`engine.probe`, no candidates, max_new_tokens 0).
  (b') a cross-check, untimed against the target: the same requests through
      `EvalkitHFLM.generate_until` itself (max_gen_toks 0); its metrics must equal (b)'s.

Every path sees the same chat-templated contexts (`evalkit.prompts.templates.render_prompt`,
the template `chat`). Prints wall times, per-prompt times, the ratios (a)/(b) and
(a)/(c) against the >= 50x target, and per prompt the sampled top-3 share of (a)
(over first units, and over first tokens re-tokenised in context) next to the exact
top3_mass@0.8 of (b).

    python bench/first_token_vs_sampling.py [--per-lang 5] [--repeats 20] [--device cuda]

Takes a few minutes on a laptop CPU, most of it in (a).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tasks" / "firsttoken" / "data"
TARGET = 50.0
TEMPERATURE = 0.8
MAX_GEN_TOKS = 4
UNTIL = ["\n\n"]


def load_docs(per_lang: int) -> list[dict]:
    from evalkit.prompts.jsonl import load_prompts

    return [doc for lang in ("en", "zh") for doc in load_prompts(DATA / f"firsttoken_{lang}.jsonl")[:per_lang]]


def sampled_path(lm, contexts: list[str], repeats: int, seed: int) -> list[list[str]]:
    """(a): lm-eval's generate_until with each request cloned `repeats` times, as the
    evaluator does for a task with `repeats: N`."""
    import torch
    from lm_eval.api.instance import Instance

    gen = {"until": UNTIL, "do_sample": True, "temperature": TEMPERATURE, "max_gen_toks": MAX_GEN_TOKS}
    requests = []
    for i, ctx in enumerate(contexts):
        req = Instance("generate_until", {}, (ctx, dict(gen)), idx=0, metadata=("bench", i, repeats))
        requests += [req] * repeats
    torch.manual_seed(seed)
    texts = lm.generate_until(requests, disable_tqdm=True)
    return [texts[i * repeats : (i + 1) * repeats] for i in range(len(contexts))]


def probe_path(model, tokenizer, contexts, docs, lexicon, *, with_candidates: bool, tolerance: float = 0.0) -> list[dict]:
    """(b) with candidates, (c) without: one prefill per prompt, metrics as EvalkitHFLM computes them."""
    from evalkit.engines.transformers import firststep as engine
    from evalkit.engines.transformers.model import candidate_metrics, content_free_prior
    from evalkit.scoring.firsttoken import candidate_strings

    cands, n_answers = [], []
    for doc in docs:
        answers = candidate_strings(doc["answers"]) if with_candidates else []
        cands.append(answers + (lexicon.entries if with_candidates else []))
        n_answers.append(len(answers))
    steps = engine.probe(model, tokenizer, contexts, cands if with_candidates else None, top_k=50,
                            max_new_tokens=0, stop=UNTIL, batch_size=8, tolerance=tolerance,
                            exact_candidates=[c[:n] for c, n in zip(cands, n_answers)])
    priors: dict[str, dict[int, float]] = {}
    out = []
    for ctx, doc, cand, n_ans, step in zip(contexts, docs, cands, n_answers, steps):
        m = {"top3_mass": engine.top_mass(step.logprobs, 3, TEMPERATURE), "entropy": step.entropy,
             "topk": list(zip(step.topk_ids, step.topk_logprobs)),
             "prompt_tokens": len(step.context_ids), "positions": step.candidate_positions,
             "unscored": step.unscored_mass}
        if with_candidates:
            frame = ctx.replace(doc["prompt"], "\x00")
            if frame not in priors:
                priors[frame] = content_free_prior(model, tokenizer, frame, 50)
            m.update(candidate_metrics(tokenizer, ctx, step, cand[:n_ans], cand[n_ans:], priors[frame]))
        out.append(m)
    return out


def evalkit_lm_path(lm, contexts, docs) -> list[dict]:
    """(b'): the same prompts through EvalkitHFLM.generate_until (greedy, max_gen_toks 0)."""
    from lm_eval.api.instance import Instance

    gen = {"until": UNTIL, "do_sample": False, "max_gen_toks": 0}
    requests = [Instance("generate_until", doc, (ctx, dict(gen)), idx=0, metadata=("bench", i, 1))
                for i, (ctx, doc) in enumerate(zip(contexts, docs))]
    return [r.metrics for r in lm.generate_until(requests, disable_tqdm=True)]


def first_token_in_context(tokenizer, context: str, text: str) -> int | None:
    from evalkit.engines.transformers import firststep as engine

    ids = engine.candidate_ids(tokenizer, context, text) if text else []
    return ids[0] if ids else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-lang", type=int, default=5, help="prompts per language (en, zh)")
    ap.add_argument("--repeats", type=int, default=20, help="samples per prompt in (a)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tolerance", type=float, default=1e-4,
                    help="candidate probability left unscored per prompt in (b), as the model arg (0: exact)")
    ap.add_argument("--device", default="cpu", help="where every path runs: cpu, cuda, cuda:1, mps ...")
    ap.add_argument("--model-args", default=None,
                    help="pretrained=DIR,... instead of the default SmolLM2 (for a quick smoke test)")
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("lm_eval", "lm-eval", "lm_eval.models.huggingface", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)

    import torch

    from evalkit.engines import plan as plan_defaults
    from evalkit.engines import resolve as models
    from evalkit.prompts.templates import get_template, render_prompt
    from evalkit.scoring.firsttoken import first_unit_text, top3_share
    from evalkit.scoring.lexicon import load_lexicon

    docs = load_docs(args.per_lang)
    t0 = time.perf_counter()
    plan = models.resolve("hf", args.model_args, device=args.device)
    label = plan.label + (f" ({plan_defaults.DEFAULT_GGUF})" if plan.embedded else "")
    lm = models.load(plan, batch_size=8)
    model, tokenizer = lm.model, lm.tokenizer
    load_s = time.perf_counter() - t0
    template = get_template("chat")
    contexts = [render_prompt(tokenizer, template, d["prompt"]) for d in docs]
    lexicon = load_lexicon()
    n = len(docs)
    print(f"model {label}, loaded once in {load_s:.1f} s; "
          f"torch {torch.__version__}, device {model.device}, {torch.get_num_threads()} threads; {n} prompts "
          f"({args.per_lang} en + {args.per_lang} zh), template chat; "
          f"{len(lexicon.entries)} lexicon candidates (version {lexicon.version})", flush=True)

    from lm_eval.models.huggingface import HFLM

    from evalkit.engines.transformers.model import EvalkitHFLM

    hflm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device=args.device)
    evalkit_lm = EvalkitHFLM(pretrained=model, tokenizer=tokenizer, batch_size=8, device=args.device,
                             temperature=TEMPERATURE, tolerance=args.tolerance,
                             lead_space=False)  # as a run under the chat template (runner.config.event_defaults)

    # warm-up (not timed): one prefill through each path's code
    probe_path(model, tokenizer, contexts[:1], docs[:1], lexicon, with_candidates=False)
    sampled_path(hflm, contexts[:1], 1, args.seed)

    def clock() -> float:
        """Wall time once the device has finished what was queued (CUDA runs asynchronously)."""
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        return time.perf_counter()

    timings = {}
    t = clock()
    exact = probe_path(model, tokenizer, contexts, docs, lexicon, with_candidates=True, tolerance=args.tolerance)
    timings["b"] = clock() - t
    t = clock()
    dist = probe_path(model, tokenizer, contexts, docs, lexicon, with_candidates=False)
    timings["c"] = clock() - t
    t = clock()
    via_lm = evalkit_lm_path(evalkit_lm, contexts, docs)
    timings["b2"] = clock() - t
    print(f"(b) done in {timings['b']:.2f} s, (c) in {timings['c']:.2f} s, (b') in {timings['b2']:.2f} s; "
          f"(a) running ({n} x {args.repeats} generations) ...", flush=True)
    t = clock()
    samples = sampled_path(hflm, contexts, args.repeats, args.seed)
    timings["a"] = clock() - t

    # (b') must agree with (b): same engine, same candidates, same pruning
    worst = max(abs(via_lm[i][k] - exact[i][k]) for i in range(n)
                for k in ("ft_hit_prob", "opener_mass", "top3_mass", "prior_drift"))
    same_topk = all(dist[i]["topk"][0][0] == exact[i]["topk"][0][0] for i in range(n))

    print()
    print(f"{'path':<58} {'wall s':>8} {'per prompt s':>13} {'(a)/this':>9}")
    rows = [
        ("a", f"(a) lm-eval HFLM generate_until, repeats {args.repeats}, T {TEMPERATURE}, "
              f"max_gen_toks {MAX_GEN_TOKS}, bs 1"),
        ("b", "(b) evalkit first-token metrics (candidates + lexicon), bs 8"),
        ("c", "(c) evalkit distribution only (top-k, top3_mass), bs 8"),
        ("b2", "(b') EvalkitHFLM.generate_until, max_gen_toks 0, bs 8"),
    ]
    for key, label in rows:
        ratio = timings["a"] / timings[key]
        print(f"{label[:58]:<58} {timings[key]:8.2f} {timings[key] / n:13.3f} {ratio:8.1f}x")
    rb, rc = timings["a"] / timings["b"], timings["a"] / timings["c"]
    print()
    print(f"(a)/(b) = {rb:.1f}x   target >= {TARGET:.0f}x   {'PASS' if rb >= TARGET else 'FAIL'}")
    print(f"(a)/(c) = {rc:.1f}x   target >= {TARGET:.0f}x   {'PASS' if rc >= TARGET else 'FAIL'}")
    print(f"(b') vs (b): max |metric difference| {worst:.2e}; same argmax in (b) and (c): {same_topk}")
    # where (b)'s time goes: positions through the model, prompt vs candidate trie
    prompt_pos = sum(m["prompt_tokens"] for m in exact) / n
    cand_pos = sum(m["positions"] for m in exact) / n
    per_pos = (timings["b"] - timings["c"]) / max(1.0, cand_pos * n)
    allowed = (timings["a"] / TARGET - timings["c"]) / n / per_pos if per_pos > 0 else float("inf")
    print(f"(b) forwards per prompt: {prompt_pos:.0f} prompt tokens + {cand_pos:.0f} candidate-trie positions "
          f"(tolerance {args.tolerance:g}: at most that much probability unscored, "
          f"largest {max(m['unscored'] for m in exact):.1e}); {1000 * per_pos:.2f} ms per trie position; "
          f"{TARGET:.0f}x would allow about {max(0.0, allowed):.0f} trie positions per prompt")

    print()
    print(f"sampled top-3 share ({args.repeats} samples at T {TEMPERATURE}, HF generate defaults otherwise) "
          f"vs exact top3_mass@{TEMPERATURE} from one prefill")
    print(f"{'id':<9} {'prompt':<34} {'share(units)':>12} {'share(tokens)':>13} {'exact':>7} "
          f"{'ft_hit_prob':>11} {'opener_mass':>11}  most frequent first units")
    errs_u, errs_t = [], []
    for doc, ctx, texts, m in zip(docs, contexts, samples, exact):
        units = [first_unit_text(s) for s in texts]
        firsts = [first_token_in_context(tokenizer, ctx, s) for s in texts]
        share_u = top3_share(units)
        share_t = top3_share(firsts)
        errs_u.append(abs(share_u - m["top3_mass"]))
        errs_t.append(abs(share_t - m["top3_mass"]))
        common = ", ".join(f"{u!r}x{c}" for u, c in Counter(units).most_common(3))
        prompt = doc["prompt"] if len(doc["prompt"]) <= 32 else doc["prompt"][:31] + "…"
        pad = 34 - sum(2 if ord(ch) > 0x2E7F else 1 for ch in prompt)
        print(f"{doc['id']:<9} {prompt}{' ' * max(1, pad)}{share_u:12.2f} {share_t:13.2f} {m['top3_mass']:7.3f} "
              f"{m['ft_hit_prob']:11.4f} {m['opener_mass']:11.4f}  {common}")
    print(f"mean |share - exact|: units {sum(errs_u) / n:.3f}, tokens {sum(errs_t) / n:.3f} "
          f"(at N = {args.repeats} the sampling sd alone is about "
          f"{math.sqrt(0.25 / args.repeats):.2f}; the empirical top 3 is biased upward)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
