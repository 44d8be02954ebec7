"""docs/metrics.md §1.4: the sampled top-3 share of the first token converges to the exact top3_mass@T
read off one forward pass (`engine.top_mass`)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from evalkit.engines.transformers import firststep as engine
from tests.tiny import load_tiny

PROMPTS = ["What is recursion?", "法国的首都是哪里？", "Say hello."]
TEMPERATURES = [0.8, 1.5]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_tiny(tiny_model_dir)


def chat(tokenizer, prompt):
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def top3_share(tokens) -> float:
    """Share of the three most frequent sampled tokens (the practitioners' hand test)."""
    tokens = list(tokens)
    return sum(n for _, n in Counter(tokens).most_common(3)) / len(tokens)


def plain_logits(model, tokenizer, context):
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def test_sampled_top3_share_converges_to_exact_top3_mass(tiny):
    model, tokenizer = tiny
    errors = {50: [], 2000: []}
    for prompt in PROMPTS:
        context = chat(tokenizer, prompt)
        step = engine.probe(model, tokenizer, [context], max_new_tokens=0)[0]
        logits = plain_logits(model, tokenizer, context)  # an independent forward: same distribution
        for t in TEMPERATURES:
            exact = engine.top_mass(step.logprobs, 3, t)
            probs = torch.softmax(logits / t, dim=-1)
            assert exact == pytest.approx(float(torch.topk(probs, 3).values.sum()), abs=1e-5)
            for n in errors:
                for rep in range(20):
                    g = torch.Generator().manual_seed(1000 * rep + n)
                    draws = torch.multinomial(probs, n, replacement=True, generator=g).tolist()
                    errors[n].append(abs(top3_share(draws) - exact))
    mean = {n: sum(e) / len(e) for n, e in errors.items()}
    assert mean[2000] < 0.03
    assert max(errors[2000]) < 0.05
    assert mean[2000] < mean[50] / 3  # the error shrinks roughly as 1 / sqrt(N)


def test_probe_first_temperature_samples_at_that_temperature(tiny):
    """The probe's own sampled first token (first_temperature=T, one seed per prompt index)
    gives the same top-3 share, within sampling error, as the exact mass."""
    model, tokenizer = tiny
    t, n = 0.8, 1000
    context = chat(tokenizer, PROMPTS[0])
    exact_step = engine.probe(model, tokenizer, [context], max_new_tokens=0)[0]
    exact = engine.top_mass(exact_step.logprobs, 3, t)
    p_top1 = float(torch.softmax(exact_step.logprobs / t, dim=-1)[exact_step.topk_ids[0]])
    steps = engine.probe(model, tokenizer, [context] * n, max_new_tokens=0, top_k=3,
                            first_temperature=t, seed=7, batch_size=250)
    firsts = [s.first_token_id for s in steps]
    assert len(set(firsts)) > 3  # really sampled, not argmax
    # binomial sd at n = 1000 is about 0.016: 0.05 is three of them
    assert abs(top3_share(firsts) - exact) < 0.05
    assert abs(Counter(firsts)[exact_step.topk_ids[0]] / n - p_top1) < 0.05
