"""The first-step engine against independent references on the tiny random Llama."""

from __future__ import annotations

import doctest
import inspect
import math

import pytest
import torch

from evalkit.engines.transformers import firststep as engine
from evalkit.engines.transformers.firststep import candidate_ids, first_unit_ids, probe, top_mass, topk_dict
from tests.tiny import build_tiny_model, load_tiny

REASSOCIATION = 1e-4  # nats: the engine's stated float-reassociation tolerance

QUESTIONS = [
    "What is recursion?",
    "法国的首都是哪里？请简短回答。",
    "Hi",
    "Explain the capital of France and of Japan in a long answer, with many words please.",
    "用一个词回答：递归是什么？",
    "Say hello.",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model, tokenizer = load_tiny(build_tiny_model(tmp_path_factory.mktemp("tiny")))
    return model, tokenizer


@pytest.fixture(scope="module")
def contexts(tiny):
    _, tokenizer = tiny
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reference_logprobs(model, ids):
    """Plain forward on unpadded ids, no cache: (len(ids), V) float32 log-softmax."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_tiny_tokenizer_splits_chinese_into_bytes(tiny):
    _, tokenizer = tiny
    ids = ids_of(tokenizer, "递归")
    assert len(ids) > 2
    assert "\ufffd" in tokenizer.decode(ids[:1])
    assert tokenizer.decode(ids) == "递归"
    assert tokenizer.eos_token == "<|im_end|>"


def test_topk_matches_plain_forward(tiny, contexts):
    model, tokenizer = tiny
    steps = probe(model, tokenizer, contexts, top_k=20, max_new_tokens=0, batch_size=4)
    for context, step in zip(contexts, steps):
        ids = ids_of(tokenizer, context)
        assert step.context_ids == ids
        ref = reference_logprobs(model, ids)[-1]
        values, indices = torch.topk(ref, 20)
        assert step.topk_ids == indices.tolist()
        # the batch's shared head is prefilled apart from the rest: float reassociation, within the
        # engine's stated tolerance (tests/test_engine_equivalence.py)
        assert step.topk_logprobs == pytest.approx(values.tolist(), abs=REASSOCIATION)
        assert torch.allclose(step.logprobs, ref, atol=REASSOCIATION)
        assert step.entropy == pytest.approx(float(-(ref.exp() * ref).sum()), abs=REASSOCIATION)
        assert step.first_token_id == step.topk_ids[0]


def test_candidate_probs_match_plain_softmax_product(tiny, contexts):
    model, tokenizer = tiny
    context = contexts[0]
    greedy = probe(model, tokenizer, [context], max_new_tokens=3)[0]
    likely = tokenizer.decode(greedy.response_ids)  # high-probability candidate
    cands = ["Recursion", "递归", likely, "Recursion"]
    step = probe(model, tokenizer, [context], [cands], max_new_tokens=0)[0]
    assert set(step.candidate_probs) == {"Recursion", "递归", likely}

    ctx_ids = ids_of(tokenizer, context)
    for cand in ["Recursion", "递归", likely]:
        full = ids_of(tokenizer, context + cand)
        assert full[: len(ctx_ids)] == ctx_ids
        assert candidate_ids(tokenizer, context, cand) == full[len(ctx_ids) :]
        with torch.no_grad():
            logits = model(torch.tensor([full])).logits[0]
        expected = 1.0
        for i in range(len(ctx_ids), len(full)):
            expected *= float(torch.softmax(logits[i - 1].float(), dim=-1)[full[i]])
        got = step.candidate_probs[cand]
        assert got == pytest.approx(expected, abs=1e-5)
        assert math.log(got) == pytest.approx(math.log(expected), abs=1e-4)  # tiny probabilities too
    assert len(candidate_ids(tokenizer, context, "递归")) >= 4  # several byte tokens
    assert step.candidate_probs[likely] > 1e-3


def test_candidate_tokenised_alone_when_context_merges():
    class Chars:  # a tokenizer that merges "ab" into one token
        def __call__(self, text, add_special_tokens=False):
            out, i = [], 0
            while i < len(text):
                if text[i : i + 2] == "ab":
                    out.append(1000)
                    i += 2
                else:
                    out.append(ord(text[i]))
                    i += 1
            return {"input_ids": out}

    tok = Chars()
    assert candidate_ids(tok, "xa", "b") == [ord("b")]
    assert candidate_ids(tok, "x ", "ab") == [1000]


def test_batches_are_cut_by_padded_positions():
    from evalkit.engines.transformers.firststep import _batches

    lengths = [2048, 2048, 2048, 2048, 2048, 1000, 1000, 30, 30, 30]
    order = list(range(len(lengths)))  # longest first, as probe orders them
    assert _batches(order, lengths, 8, 8192) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert _batches(order, lengths, 3, 10**6) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert _batches([0, 1], [9000, 9000], 8, 8192) == [[0], [1]]  # one prompt longer than the budget runs alone
    assert all(len(b) * lengths[b[0]] <= 8192 for b in _batches(order, lengths, 8, 8192))


def test_a_token_budget_changes_the_batches_not_the_results(tiny, contexts):
    model, tokenizer = tiny
    wide = probe(model, tokenizer, contexts, top_k=10, max_new_tokens=4, batch_size=6)
    longest = max(len(s.context_ids) for s in wide)
    narrow = probe(model, tokenizer, contexts, top_k=10, max_new_tokens=4, batch_size=6, batch_tokens=longest)
    for a, b in zip(wide, narrow):
        assert a.topk_ids == b.topk_ids and a.response_ids == b.response_ids
        assert a.topk_logprobs == pytest.approx(b.topk_logprobs, abs=1e-5)
    with pytest.raises(ValueError, match="batch_tokens"):
        probe(model, tokenizer, contexts, batch_tokens=0)


def test_trie_positions_change_the_trie_forwards_not_the_results(tiny, contexts):
    """`trie_positions` (the caps' trie-level size) only cuts the batch's candidate rows into more groups."""
    model, tokenizer = tiny
    cands = [["Sure", "The capital", "Of course", "好的", "当然", "Recursion is"]] * len(contexts)

    def run(**caps):
        prober = engine.Prober(model, tokenizer, top_k=10, max_new_tokens=2, batch_size=6, tolerance=0.0, **caps)
        forward, calls = prober.engine.forward, []

        def counted(input_ids, *args, **kwargs):
            calls.append(int(input_ids.shape[0]))
            return forward(input_ids, *args, **kwargs)

        prober.engine.forward = counted
        prober.submit(None, contexts, cands)
        ((_, steps),) = prober.finish()
        return steps, len(calls)

    wide, n_wide = run()
    narrow, n_narrow = run(trie_positions=4)
    assert n_narrow > n_wide  # more, smaller level forwards
    for a, b in zip(wide, narrow):
        assert a.topk_ids == b.topk_ids and a.response_ids == b.response_ids
        assert a.candidate_positions == b.candidate_positions
        for c in a.candidate_probs:
            assert b.candidate_probs[c] == pytest.approx(a.candidate_probs[c], rel=1e-4, abs=1e-9)
    with pytest.raises(ValueError, match="trie_positions"):
        engine.Prober(model, tokenizer, trie_positions=0)


def test_batched_and_unbatched_agree(tiny, contexts):
    model, tokenizer = tiny
    cands = [["Recursion", "递归", "Paris"], ["巴黎", "递归"], ["Hello", "Hi there"], ["Paris"], ["递归"], ["Hello"]]
    batched = probe(model, tokenizer, contexts, cands, top_k=10, max_new_tokens=8, batch_size=4)
    single = probe(model, tokenizer, contexts, cands, top_k=10, max_new_tokens=8, batch_size=1)
    assert len({len(s.context_ids) for s in single}) > 3  # really different lengths
    for a, b in zip(batched, single):
        assert a.context_ids == b.context_ids
        assert a.topk_ids == b.topk_ids
        assert a.topk_logprobs == pytest.approx(b.topk_logprobs, abs=1e-5)
        assert a.candidate_probs.keys() == b.candidate_probs.keys()
        for cand in a.candidate_probs:
            assert a.candidate_probs[cand] == pytest.approx(b.candidate_probs[cand], abs=1e-5)
            assert math.log(a.candidate_probs[cand]) == pytest.approx(math.log(b.candidate_probs[cand]), abs=1e-4)
        assert a.response_ids == b.response_ids
        assert len(a.response_ids) == 8
    # scoring candidates must not disturb the cache the generation continues from
    plain = probe(model, tokenizer, contexts, top_k=10, max_new_tokens=8, batch_size=4)
    assert [s.response_ids for s in plain] == [s.response_ids for s in batched]
    assert all(s.candidate_probs == {} for s in plain)


def test_tolerance_bounds_the_shortfall_of_every_sum(tiny, contexts):
    """Left-out prefixes cost at most `tolerance` on any sum of prefix-free candidates,
    every candidate still scored keeps its exact value, and fewer positions are forwarded."""
    from evalkit.scoring.lexicon import load_lexicon

    model, tokenizer = tiny
    cands = [["Recursion", "Paris", "递归"] + load_lexicon().entries] * len(contexts)
    exact = probe(model, tokenizer, contexts, cands, max_new_tokens=0, batch_size=3)
    assert all(s.unscored_mass == 0.0 for s in exact)
    lenient = probe(model, tokenizer, contexts, cands, max_new_tokens=0, batch_size=3, tolerance=0.05)
    saved = 0
    for a, b in zip(exact, lenient):
        assert 0.0 <= b.unscored_mass <= 0.05
        dropped = [c for c in a.candidate_probs if b.candidate_probs[c] == 0.0 < a.candidate_probs[c]]
        for cand, p in a.candidate_probs.items():
            if cand not in dropped:
                assert b.candidate_probs[cand] == pytest.approx(p, rel=1e-4, abs=1e-9)
        shortfall = sum(a.candidate_probs.values()) - sum(b.candidate_probs.values())
        assert -1e-6 <= shortfall <= b.unscored_mass + 1e-6
        saved += a.candidate_positions - b.candidate_positions
        assert b.candidate_positions <= a.candidate_positions
    assert saved > 0  # the random tiny model spreads mass thinly: many prefixes fit in 0.05
    with pytest.raises(ValueError, match="tolerance"):
        probe(model, tokenizer, contexts[:1], cands[:1], tolerance=1.0)


class Sharpened(torch.nn.Module):
    """The tiny model with its logits multiplied by `factor`: greedy continuations become nearly certain."""

    def __init__(self, inner, factor):
        super().__init__()
        self.inner, self.factor = inner, factor
        self.generation_config = inner.generation_config
        self.cache_kw = "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None, cache=None,
                logits_to_keep=0):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=use_cache, logits_to_keep=logits_to_keep, **{self.cache_kw: cache})
        out.logits = out.logits * self.factor
        return out


def test_tolerance_shortfall_is_the_mass_left_out_and_exact_candidates_stay_exact(tiny, contexts):
    """A string whose first token is unlikely but whose continuation is nearly certain: leaving
    its first token out loses almost all of the unscored mass, which is that token's probability."""
    model, tokenizer = Sharpened(tiny[0], 8.0), tiny[1]
    context = contexts[0]
    ctx_ids = ids_of(tokenizer, context)
    first = reference_logprobs(model, ctx_ids)[-1]
    for t in torch.argsort(first, descending=True).tolist()[1:50]:
        cont, lp_cont = [], 0.0
        for _ in range(3):
            lp = reference_logprobs(model, [*ctx_ids, t, *cont])[-1]
            cont.append(int(lp.argmax()))
            lp_cont += float(lp.max())
        text = tokenizer.decode([t, *cont])
        if candidate_ids(tokenizer, context, text) == [t, *cont] and lp_cont > math.log(0.5):
            break
    else:
        pytest.fail("no unlikely first token with a likely continuation in the tiny model")
    p_first = math.exp(float(first[t]))
    (exact,) = probe(model, tokenizer, [context], [[text]], max_new_tokens=0)
    assert exact.candidate_probs[text] == pytest.approx(p_first * math.exp(lp_cont), rel=1e-3)
    (lenient,) = probe(model, tokenizer, [context], [[text]], max_new_tokens=0, tolerance=1.5 * p_first)
    assert lenient.candidate_probs[text] == 0.0
    assert lenient.unscored_mass == pytest.approx(p_first, rel=1e-4)  # the prefix left out, not the tolerance
    shortfall = exact.candidate_probs[text] - lenient.candidate_probs[text]
    assert 0.5 * lenient.unscored_mass < shortfall <= lenient.unscored_mass * (1 + 1e-6)
    assert lenient.candidate_positions == 0 < exact.candidate_positions
    (kept,) = probe(model, tokenizer, [context], [[text]], max_new_tokens=0, tolerance=1.5 * p_first,
                    exact_candidates=[[text]])
    assert kept.candidate_probs[text] == pytest.approx(exact.candidate_probs[text], rel=1e-5)
    assert kept.unscored_mass == 0.0


def test_greedy_matches_generate(tiny, contexts):
    model, tokenizer = tiny
    eos = {tokenizer.eos_token_id}
    for context in contexts[:3]:
        ids = ids_of(tokenizer, context)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False, max_new_tokens=16, pad_token_id=tokenizer.pad_token_id,
            )
        expected = out[0, len(ids) :].tolist()
        if expected and expected[-1] in eos:
            expected = expected[:-1]
        step = probe(model, tokenizer, [context], max_new_tokens=16)[0]
        assert step.response_ids == expected
        assert step.first_token_id == step.response_ids[0] == step.topk_ids[0]


def test_generation_stops_at_stop_string(tiny, contexts):
    model, tokenizer = tiny
    full = probe(model, tokenizer, [contexts[0]], max_new_tokens=12)[0].response_ids
    stop_text = tokenizer.decode(full[4:5])
    cut = probe(model, tokenizer, [contexts[0]], max_new_tokens=12, stop=[stop_text])[0].response_ids
    assert stop_text in tokenizer.decode(cut)
    assert stop_text not in tokenizer.decode(cut[:-1])
    assert cut == full[: len(cut)] and len(cut) <= 5


def test_banned_first_ids_apply_to_step_one_only(tiny, contexts):
    model, tokenizer = tiny
    checked_later_use = False
    for context in contexts:
        base = probe(model, tokenizer, [context], max_new_tokens=0)[0]
        banned = base.topk_ids[0]
        step = probe(model, tokenizer, [context], max_new_tokens=32, banned_first_ids={banned})[0]
        assert step.first_token_id == step.response_ids[0] == base.topk_ids[1]
        assert step.topk_ids == base.topk_ids  # the reported distribution is the model's own
        # later steps: plain greedy from context + the chosen first token
        ids = ids_of(tokenizer, context) + [step.first_token_id]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=31, pad_token_id=tokenizer.pad_token_id)
        rest = out[0, len(ids) :].tolist()
        if rest and rest[-1] == tokenizer.eos_token_id:
            rest = rest[:-1]
        assert step.response_ids[1:] == rest
        checked_later_use |= banned in rest
    assert checked_later_use  # at least one prompt used the banned token after step 1


def test_first_temperature_sampling(tiny, contexts):
    model, tokenizer = tiny
    context, n = contexts[0], 300
    base = probe(model, tokenizer, [context], max_new_tokens=0)[0]
    top = base.topk_ids[0]

    def draws(temperature, seed):
        steps = probe(model, tokenizer, [context] * n, max_new_tokens=0, batch_size=100,
                      first_temperature=temperature, seed=seed)
        return [s.first_token_id for s in steps]

    first = draws(0.5, 3)
    assert first == draws(0.5, 3)
    assert first != draws(0.5, 4)
    assert draws(0.0, 3) == [top] * n  # temperature 0 is argmax
    for temperature in (0.5, 1.0):
        p_top = float(torch.softmax(base.logprobs / temperature, dim=-1)[top])
        freq = draws(temperature, 0).count(top) / n
        assert freq == pytest.approx(p_top, abs=0.08)
    assert top_mass(base.logprobs, 1, 0.5) - top_mass(base.logprobs, 1, 1.0) > 0.3  # the two differ
    # independent of batch composition: the same prompt index draws the same token
    alone = probe(model, tokenizer, [context] * 5, max_new_tokens=0, batch_size=2, first_temperature=1.0, seed=7)
    together = probe(model, tokenizer, [context] * 5, max_new_tokens=0, batch_size=5, first_temperature=1.0, seed=7)
    assert [s.first_token_id for s in alone] == [s.first_token_id for s in together]


def test_top_mass_examples():
    lp = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.1]))
    assert top_mass(lp, 3) == pytest.approx(0.9)
    assert top_mass(lp, 1) == pytest.approx(0.5)
    assert top_mass(lp, 1, temperature=0.5) == pytest.approx(0.25 / 0.36)
    assert top_mass(lp + 7.0, 2) == pytest.approx(0.8)  # logits work too
    assert top_mass(lp, 10) == pytest.approx(1.0)
    assert top_mass(lp, 2, temperature=0) == 1.0
    assert top_mass(torch.tensor([])) == 0.0
    assert top_mass(lp, 0) == 0.0


def test_topk_dict(tiny, contexts):
    model, tokenizer = tiny
    step = probe(model, tokenizer, contexts[:1], top_k=5, max_new_tokens=0)[0]
    d = topk_dict(step, 3)
    assert list(d) == step.topk_ids[:3]
    assert list(d.values()) == step.topk_logprobs[:3]
    assert topk_dict(step, 0) == {}


def test_first_unit_ids_on_chinese(tiny):
    _, tokenizer = tiny
    decode = tokenizer.decode
    ids = ids_of(tokenizer, "递归是")
    n_first = len(ids_of(tokenizer, "递"))
    assert n_first > 1
    text, n = first_unit_ids(decode, ids)
    assert (text, n) == ("递", n_first)
    for k in range(len(ids) + 1):
        text, n = first_unit_ids(decode, ids[:k])
        assert "\ufffd" not in text
    assert first_unit_ids(decode, ids[:1]) == ("", 1)
    english = ids_of(tokenizer, "  Paris is")
    text, n = first_unit_ids(decode, english)
    assert text.startswith("P") and text == decode(english[:n]).strip()
    assert decode(english[: n - 1]).strip() == ""  # shortest: one token fewer is only whitespace
    assert first_unit_ids(decode, []) == ("", 0)


def test_docstring_examples():
    assert doctest.testmod(engine).failed == 0


def test_empty_and_bad_input(tiny):
    model, tokenizer = tiny
    assert probe(model, tokenizer, []) == []
    with pytest.raises(ValueError):
        probe(model, tokenizer, ["a", "b"], [["x"]])
    with pytest.raises(ValueError):
        probe(model, tokenizer, [""])


def reference_unit(model, tokenizer, ids, token):
    """The first unit greedy decoding reaches after `token`, by plain forwards without a cache."""
    seq = [token]
    while True:
        unit, n = first_unit_ids(lambda x: tokenizer.decode(x, skip_special_tokens=False), seq)
        if unit or len(seq) == engine.UNIT_TOKENS:
            return unit
        nxt = int(torch.argmax(reference_logprobs(model, list(ids) + seq)[-1]))
        if nxt == tokenizer.eos_token_id:
            return ""
        seq.append(nxt)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_units_complete_split_characters_as_greedy_decoding_does(tiny, contexts, batch_size):
    model, tokenizer = tiny
    steps = probe(model, tokenizer, contexts, top_k=50, max_new_tokens=4, batch_size=batch_size, unit_ranks=20)
    completed = 0
    for ctx, step in zip(contexts, steps):
        assert set(step.units) == set(step.topk_ids[:20])
        ids = ids_of(tokenizer, ctx)
        for t, unit in step.units.items():
            alone = tokenizer.decode([t], skip_special_tokens=False)
            if "\ufffd" in alone or not alone.strip():
                completed += 1
                assert unit == reference_unit(model, tokenizer, ids, t), (t, alone)
            else:
                assert unit == alone.strip()
            assert "\ufffd" not in unit
    assert completed >= 5  # the test saw split characters and bare spaces, not only whole tokens
    # the completion leaves the rest of the step as it was
    plain = probe(model, tokenizer, contexts, top_k=50, max_new_tokens=4, batch_size=batch_size)
    for a, b in zip(steps, plain):
        assert a.topk_ids == b.topk_ids and a.response_ids == b.response_ids and not b.units
