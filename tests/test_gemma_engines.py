"""Gemma-3-270M (sliding-window layers, QK norms, a scaled embedding, 262k tied embeddings) on both engines.

- The hf engine's first step, candidate trie and greedy continuation on a batch that mixes prompt lengths
  (left padding; one prompt longer than the 512-token sliding window) against a plain, independent
  computation written here: `softmax(model(ids).logits[0, -1])` of each prompt alone, no padding, no
  cache, transformers' own masks.
- llama.cpp (the GGUF natively, Q4_K_M kernels) against transformers (the same GGUF dequantized to
  float32) on 40 English prompts "<bos>Question: ...\\nAnswer:": the greedy first token and the top-k
  log-probabilities.

The BOS is fed by hand ("<bos>" at the start of the text). Skips with tests/gemma.py's reason without
the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.gemma import gemma_path, missing

pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing() is not None, reason=missing() or "")]

torch = pytest.importorskip("torch")

BOS = "<bos>"
BOS_ID = 2
PROMPTS = Path(__file__).resolve().parents[1] / "tasks" / "firsttoken" / "data" / "firsttoken_en.jsonl"
# hf engine against the plain forward, float32 both: batching, left padding and the explicit masks only
# reassociate sums (measured: max |Δ log p| 6.3e-5 over the whole 262k vocabulary of the five prompts)
PLAIN_ATOL = 2e-4
# llama.cpp's Q4_K_M kernels (activations rounded to 8 bits for the matmuls, an f16 KV cache) against the
# same weights dequantized to float32 in transformers, on the 40 prompts (measured): KL(llama.cpp || hf)
# mean 0.0072 nats, max 0.042; |Δ log p| over llama.cpp's top 10 mean 0.090, max 0.46; the greedy first
# token the same on 34 of 40 with llama.cpp's default f16 cache and 36 (90 %) with an f32 cache, the like of
# transformers' own, every other one a near tie: hf puts llama.cpp's choice within 0.25 nats of its own.
# Stated with room where they were measured below 90 %:
ENGINE_AGREE = 0.85  # f16 cache, llama.cpp as deployed
ENGINE_AGREE_F32 = 0.90  # f32 cache: both engines keep keys and values in float32
ENGINE_TOPK, ENGINE_ATOL, ENGINE_MEAN = 10, 0.75, 0.15
ENGINE_KL, NEAR_TIE = 0.02, 0.25


def qa_prompts(n: int = 40) -> list[str]:
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines()[:n]]
    return [f"{BOS}Question: {r['prompt']}\nAnswer:" for r in rows]


@pytest.fixture(scope="module")
def hf(model_cache):
    """Gemma in transformers, loaded as evalkit's hf engine loads it (the GGUF converted once, float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evalkit.engines.transformers.convert import cached_args

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EVALKIT_CACHE", str(model_cache))
        args = cached_args({"pretrained": str(gemma_path().parent), "gguf_file": gemma_path().name})
    kw = {"gguf_file": args["gguf_file"]} if "gguf_file" in args else {}
    tok = AutoTokenizer.from_pretrained(args["pretrained"], **kw)
    model = AutoModelForCausalLM.from_pretrained(args["pretrained"], dtype=torch.float32, **kw).eval()
    return model, tok


@pytest.fixture(scope="module")
def cpp():
    pytest.importorskip("llama_cpp")
    from evalkit.engines.llamacpp.firststep import LlamaCppEngine

    engine = LlamaCppEngine(str(gemma_path()), n_ctx=2048)
    yield engine
    engine.close()


def plain_logprobs(model, ids: list[int]) -> torch.Tensor:
    """The independent reference: one prompt alone, no padding, no cache, the model's own masks."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits[0, -1]
    return torch.log_softmax(logits.double(), dim=-1)


def test_the_model_has_sliding_window_layers(hf):
    """What this file is about: full and sliding layers mixed, a window shorter than the long prompt below."""
    from evalkit.engines.transformers.windows import windows_of

    found = windows_of(hf[0])
    assert found is not None and found.mixed and found.window == 512


def test_hf_engine_first_step_matches_the_plain_forward_on_a_mixed_length_batch(hf):
    """Left padding (lengths 8 to ~700 tokens in one batch, the longest past the sliding window), the
    trie and the decoder on a model with sliding layers, each against the plain forward."""
    from evalkit.engines.transformers import firststep

    model, tok = hf
    long_text = " ".join(f"Sentence {i} says that the river runs east of the old mill." for i in range(60))
    contexts = [
        f"{BOS}What is the capital of Japan?",
        f"{BOS}Question: Name a primary color.\nAnswer:",
        f"{BOS}{long_text}\nQuestion: Which way does the river run?\nAnswer:",
        f"{BOS}Question: What is the chemical symbol for gold? Give the symbol only.\nAnswer:",
        f"{BOS}Hi",
    ]
    cands = [["Tokyo", "The capital"], ["Red", "Blue"], ["East", "The river"], ["Au"], ["Hello"]]
    steps = firststep.probe(model, tok, contexts, cands, max_new_tokens=5, batch_size=8)
    lengths = [len(s.context_ids) for s in steps]
    assert lengths[2] > 512 > max(lengths[:2] + lengths[3:]) and min(lengths) < 10  # padding and the window
    for s in steps:
        assert s.context_ids[0] == BOS_ID and s.context_ids.count(BOS_ID) == 1
        ref = plain_logprobs(model, s.context_ids)
        assert (s.logprobs.double() - ref).abs().max().item() < PLAIN_ATOL
        assert s.topk_ids[:5] == torch.topk(ref, 5).indices.tolist()
        for cand, toks in s.candidate_tokens.items():  # ft_hit_prob's terms: teacher forcing, token by token
            logp = sum(plain_logprobs(model, s.context_ids + toks[:j])[t].item() for j, t in enumerate(toks))
            assert s.candidate_probs[cand] == pytest.approx(float(torch.tensor(logp).exp()), rel=1e-3, abs=1e-9)
        ids, greedy = list(s.context_ids), []
        for _ in range(len(s.response_ids)):  # the greedy continuation, one plain forward a token
            t = int(torch.argmax(plain_logprobs(model, ids)))
            greedy.append(t)
            ids.append(t)
        assert s.response_ids == greedy


def test_engines_agree_on_40_prompts(hf, cpp):
    """llama.cpp and transformers on the same GGUF: the same fed ids (one BOS first), the greedy first token
    on >= ENGINE_AGREE of 40 prompts and a near tie wherever they differ, the log-probabilities of
    llama.cpp's top 10 within ENGINE_ATOL (mean ENGINE_MEAN), the whole distributions within ENGINE_KL."""
    from evalkit.engines.llamacpp import probe as llamacpp
    from evalkit.engines.transformers import firststep

    model, tok = hf
    contexts = qa_prompts()
    # 4 a batch, as the caps give a 262k-vocabulary model (a batch of 32 past them peaks near 1 GB a prompt)
    a = firststep.probe(model, tok, contexts, max_new_tokens=0, batch_size=4)
    cpp.set_kv_type("f32")
    try:
        b32 = llamacpp.probe(cpp, contexts, max_new_tokens=0)
    finally:
        cpp.set_kv_type("f16")
    assert sum(x.topk_ids[0] == y.topk_ids[0] for x, y in zip(a, b32)) / len(contexts) >= ENGINE_AGREE_F32
    b = llamacpp.probe(cpp, contexts, max_new_tokens=0)
    same, diffs, kls = 0, [], []
    for x, y in zip(a, b):
        assert x.context_ids == y.context_ids and x.context_ids[0] == BOS_ID and x.context_ids.count(BOS_ID) == 1
        hf_lp, cpp_lp = x.logprobs.double(), y.logprobs.double()
        if x.topk_ids[0] == y.topk_ids[0]:
            same += 1
        else:  # a near tie in transformers' own distribution
            assert hf_lp[x.topk_ids[0]] - hf_lp[y.topk_ids[0]] < NEAR_TIE
        top = y.topk_ids[:ENGINE_TOPK]
        diffs += (hf_lp[top] - torch.tensor(y.topk_logprobs[:ENGINE_TOPK], dtype=torch.float64)).abs().tolist()
        kls.append(float((cpp_lp.exp() * (cpp_lp - hf_lp)).sum()))
    assert same / len(contexts) >= ENGINE_AGREE
    assert max(diffs) < ENGINE_ATOL and sum(diffs) / len(diffs) < ENGINE_MEAN
    assert sum(kls) / len(kls) < ENGINE_KL
