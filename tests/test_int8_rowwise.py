"""int8-dynamic quantizes activations per token: a prompt's numbers do not depend on its batch."""

from __future__ import annotations

import copy

import pytest
import torch

from evalkit.engines.transformers import firststep as engine
from evalkit.engines.transformers import quant
from tests.test_firststep import QUESTIONS
from tests.tiny import build_tiny_model, load_tiny


@pytest.fixture(scope="module")
def tiny_int8(tmp_path_factory):
    model, tokenizer = load_tiny(build_tiny_model(tmp_path_factory.mktemp("tiny")))
    return quant._int8_dynamic(model, quant.parse("int8-dynamic")), tokenizer


def test_one_token_matches_torchs_own_dynamic_kernel():
    """On a single row, torch's per-tensor scale is the row's scale: the two layers agree."""
    torch.manual_seed(0)
    linear = torch.nn.Sequential(torch.nn.Linear(64, 32))
    theirs = torch.ao.quantization.quantize_dynamic(copy.deepcopy(linear), {torch.nn.Linear}, dtype=torch.qint8)[0]
    ours = quant._int8_dynamic(copy.deepcopy(linear), quant.parse("int8-dynamic"))[0]
    x = torch.randn(1, 64) * 3
    assert torch.allclose(ours(x), theirs(x), atol=1e-3, rtol=1e-3)
    assert not torch.allclose(ours(x), linear[0](x), atol=1e-4)  # it does round


def test_a_rows_output_depends_on_that_row_alone():
    torch.manual_seed(1)
    layer = quant._int8_dynamic(torch.nn.Sequential(torch.nn.Linear(16, 8)), quant.parse("int8-dynamic"))[0]
    x = torch.randn(5, 16)
    loud = x.clone()
    loud[3] *= 100  # one row with a large range: under a per-tensor scale it would coarsen every row
    assert torch.allclose(layer(x)[:3], layer(loud)[:3], atol=1e-6)
    assert torch.allclose(layer(x[1:2]), layer(x)[1:2], atol=1e-6)  # the matmul itself may block differently


def test_the_same_prompt_gives_the_same_numbers_in_any_batch(tiny_int8):
    model, tokenizer = tiny_int8
    contexts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                              add_generation_prompt=True) for q in QUESTIONS]
    cands = [["Recursion", "递归", "Sure", "好的"]] * len(contexts)
    alone = [engine.probe(model, tokenizer, [c], [cs], top_k=10, max_new_tokens=4)[0] for c, cs in zip(contexts, cands)]
    batched = engine.probe(model, tokenizer, contexts, cands, top_k=10, max_new_tokens=4, batch_size=len(contexts))
    for a, b in zip(alone, batched):
        assert a.topk_ids == b.topk_ids
        assert a.topk_logprobs == pytest.approx(b.topk_logprobs, abs=1e-4)
        for c in a.candidate_probs:
            assert a.candidate_probs[c] == pytest.approx(b.candidate_probs[c], rel=1e-4, abs=1e-12)
        assert a.response_ids == b.response_ids
