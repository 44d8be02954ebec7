"""The first-step engine against its reference: the pre-speed-work engine (`tests/reference_engine.py`).

The engine now prefills a batch's shared head once, scores each batch's candidate trie in groups of
rows with like node counts (each on its own copy of the prompt cache, the output head applied apart to
the real node positions only), feeds the first-unit nodes in the trie's own level forwards, tokenises
candidates once per template frame, and steps the continuations of several batches together. None of that may
change a number beyond float reassociation. Stated tolerance (docs/performance.md): log-probabilities
within REASSOCIATION (absolute, nats), candidate probabilities within REASSOCIATION relative; token
choices (top-k order, greedy responses, first units, which trie prefixes the tolerance leaves out)
identical.
"""

from __future__ import annotations

import pytest
import torch

from evalkit.engines.transformers import firststep as engine
from evalkit.engines.transformers import prefill
from evalkit.engines.transformers.decoder import _Decoder, _Row
from evalkit.engines.kvpolicy import parse
from evalkit.scoring.lexicon import load_lexicon
from tests import reference_engine
from tests.test_firststep import QUESTIONS
from tests.tiny import build_tiny_model, load_tiny

REASSOCIATION = 1e-4  # nats; what a different matmul blocking moves a float32 log-probability by, with margin


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(build_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def contexts(tiny):
    _, tokenizer = tiny
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS * 2]


def assert_same(new: list[engine.FirstStep], old: list[engine.FirstStep]) -> None:
    assert len(new) == len(old)
    for a, b in zip(new, old):
        assert a.context_ids == b.context_ids
        assert a.topk_ids == b.topk_ids
        assert a.topk_logprobs == pytest.approx(b.topk_logprobs, abs=REASSOCIATION)
        assert torch.allclose(a.logprobs, b.logprobs, atol=REASSOCIATION)
        assert a.entropy == pytest.approx(b.entropy, abs=REASSOCIATION)
        assert a.candidate_tokens == b.candidate_tokens
        assert set(a.candidate_probs) == set(b.candidate_probs)
        for cand, p in b.candidate_probs.items():
            assert a.candidate_probs[cand] == pytest.approx(p, rel=REASSOCIATION, abs=1e-12), cand
        assert a.unscored_mass == pytest.approx(b.unscored_mass, rel=REASSOCIATION, abs=1e-12)
        assert a.candidate_positions == b.candidate_positions
        assert a.units == b.units
        assert a.first_token_id == b.first_token_id
        assert a.response_ids == b.response_ids
        assert a.answer_ids == b.answer_ids


def both(model, tokenizer, contexts, **kwargs):
    return (engine.probe(model, tokenizer, contexts, **kwargs),
            reference_engine.probe(model, tokenizer, contexts, **kwargs))


@pytest.mark.parametrize("batch_size", [1, 3, 12])
@pytest.mark.parametrize("tolerance", [0.0, 1e-4, 0.05])
def test_every_field_matches_the_reference(tiny, contexts, batch_size, tolerance):
    model, tokenizer = tiny
    cands = [["Recursion", "Paris", "递归", "巴黎"] + load_lexicon().entries for _ in contexts]
    exact = [c[:2] for c in cands]
    new, old = both(model, tokenizer, contexts, candidates=cands, exact_candidates=exact, top_k=50,
                    max_new_tokens=6, batch_size=batch_size, tolerance=tolerance, unit_ranks=engine.UNIT_RANKS,
                    answer_tokens=[12 if i % 2 else 0 for i in range(len(contexts))], stop=["\n\n"])
    assert_same(new, old)
    assert any(s.units for s in new) and any(s.candidate_positions for s in new)


@pytest.mark.parametrize("policy", ["window:8", "sinkwindow:2:8", "fp8"])
def test_cache_policies_match_the_reference(tiny, contexts, policy):
    model, tokenizer = tiny
    cands = [["Recursion", "递归"] + load_lexicon().entries[:30] for _ in contexts]
    new, old = both(model, tokenizer, contexts, candidates=cands, top_k=20, max_new_tokens=4, batch_size=4,
                    unit_ranks=5, kv_policy=parse(policy))
    assert_same(new, old)


def test_the_shared_head_is_prefilled_once(tiny, contexts, monkeypatch):
    """A batch of chat prompts shares the template's head: the prefill feeds it once, not once a row."""
    model, tokenizer = tiny
    fed: list[int] = []
    forward = engine._Engine.forward

    def counting(self, input_ids, *args, **kwargs):
        fed.append(int(input_ids.numel()))
        return forward(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(engine._Engine, "forward", counting)
    engine.probe(model, tokenizer, contexts[:4], max_new_tokens=0, batch_size=4)
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in contexts[:4]]
    head = 0
    while all(len(i) > head + 1 and i[head] == ids[0][head] for i in ids):
        head += 1
    assert head >= prefill.MIN_SHARED_HEAD
    assert fed == [head, 4 * max(len(i) - head for i in ids)]


def test_frame_tokenisation_equals_whole_context_tokenisation(tiny, contexts):
    """Candidates tokenised after the frame's tail are the tokens `candidate_ids` gives after the whole
    context, for every prompt (the shortcut is checked on each frame's first prompt, and here on all)."""
    model, tokenizer = tiny
    eng = engine._Engine(model, tokenizer, 5, 0, (), None, frozenset(), 0, False)
    for context in contexts:
        ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        for cand in ["Recursion", " Paris", "递归", "好的", "\n", "Sure!"] + load_lexicon().entries:
            assert eng.in_context(context, ids, cand) == engine.candidate_ids(tokenizer, context, cand, ids)
    assert eng.frame_cuts and eng.tail_ids  # the shortcut was taken, not dropped


def test_a_tokenizer_that_merges_across_its_added_tokens_drops_the_shortcut(tiny, contexts):
    model, tokenizer = tiny
    eng = engine._Engine(model, tokenizer, 5, 0, (), None, frozenset(), 0, False)
    eng.added_tokens = ["is"]  # not an added token at all: the cut would be wrong, and is noticed
    context = "This is"
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    got = [eng.in_context(context, ids, c) for c in ["land", "n't", " it"]]
    assert got == [engine.candidate_ids(tokenizer, context, c, ids) for c in ["land", "n't", " it"]]


@pytest.mark.parametrize("policy", ["full", "window:8", "fp8"])
def test_batches_submitted_apart_are_decoded_together_with_the_same_tokens(tiny, contexts, policy, monkeypatch):
    """A Prober's batches are prefilled and scored one at a time; their continuing rows join the rows of
    earlier batches still going (left-padded to one cache width) and share decode steps, except under a
    rounded cache (fp8), whose rows are finished before the next batch's join. Every response and answer
    is the reference engine's for that batch alone, and a batch is handed back only once all of it is done."""
    model, tokenizer = tiny
    stepped: list[set[int]] = []  # per decode step: the batches whose rows it fed
    step = _Decoder.step

    def spy(self):
        stepped.append({id(row.going) for row in self.rows})
        return step(self)

    monkeypatch.setattr(_Decoder, "step", spy)
    settings = dict(top_k=20, max_new_tokens=6, stop=["\n\n"], batch_size=4, kv_policy=parse(policy))
    chunks = [contexts[i:i + 4] for i in range(0, len(contexts), 4)]
    answers = [[12 if (k + i) % 2 else 0 for i in range(len(chunk))] for k, chunk in enumerate(chunks)]
    prober = engine.Prober(model, tokenizer, **settings)
    handed: dict[int, list[tuple[list[int], list[int]]]] = {}

    def keep(done):
        for k, steps in done:  # copied now: a batch handed back early would show unfinished rows
            handed[k] = [(list(s.response_ids), list(s.answer_ids)) for s in steps]

    for k, chunk in enumerate(chunks):
        prober.submit(k, chunk, answer_tokens=answers[k], seed=k)
        keep(prober.ready())
    keep(prober.finish())
    assert sorted(handed) == list(range(len(chunks)))
    for k, chunk in enumerate(chunks):
        old = reference_engine.probe(model, tokenizer, chunk, answer_tokens=answers[k], seed=k, **settings)
        assert handed[k] == [(s.response_ids, s.answer_ids) for s in old]
    together = max(len(batches) for batches in stepped)
    assert together == 1 if policy == "fp8" else together >= 2


def test_a_probe_with_nothing_to_continue_never_decodes(tiny, contexts, monkeypatch):
    model, tokenizer = tiny
    monkeypatch.setattr(_Decoder, "step", lambda self: pytest.fail("a decode step ran"))
    steps = engine.probe(model, tokenizer, contexts, max_new_tokens=0, batch_size=3)
    assert all(s.response_ids == [] and s.first_token_id >= 0 for s in steps)


@pytest.mark.parametrize("policy", ["full", "sinkwindow:2:8"])
def test_a_merged_decode_step_gives_each_row_the_logits_it_gets_alone(tiny, contexts, policy, monkeypatch):
    """The decoder's merge itself, at the logits: two batches of different prompt widths stepped
    together give every row the next-token logits it gets stepped with its own batch only, before and
    after the wider batch's rows end and the columns only they read are cut off (the tiny model's greedy
    tokens alone would not notice a row reading another's padding)."""
    model, tokenizer = tiny
    seen: list[torch.Tensor] = []
    forward = engine._Engine.forward

    def keeping(self, *args, **kwargs):
        logits, cache = forward(self, *args, **kwargs)
        seen.append(logits[:, -1, :].clone())
        return logits, cache

    def queued(eng, chunk, limit):
        ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in chunk]
        steps, state = eng.run_batch(list(range(len(chunk))), chunk, ids, [[] for _ in chunk], None, [0] * len(chunk))
        return [_Row(s, i, set(), limit, False, False) for i, s in enumerate(steps)], state

    def stepped(*chunks):
        eng = engine._Engine(model, tokenizer, 5, 8, (), None, frozenset(), 0, False, kv_policy=parse(policy))
        decoder = _Decoder(eng)
        with torch.inference_mode():
            for chunk, limit in chunks:
                decoder.admit(*queued(eng, chunk, limit))
            monkeypatch.setattr(engine._Engine, "forward", keeping)
            seen.clear()
            decoder.run(0)
            monkeypatch.setattr(engine._Engine, "forward", forward)
        return [s.clone() for s in seen]

    a, b = (contexts[3:5], 2), (contexts[:3], 4)  # the long English prompt in a: a is the wider
    together, alone_a, alone_b = stepped(a, b), stepped(a), stepped(b)
    assert len(alone_a) == 1 and len(together) == len(alone_b) == 3  # a's rows end after one step
    assert torch.allclose(together[0], torch.cat([alone_a[0], alone_b[0]]), atol=REASSOCIATION)
    for t, alone in zip(together[1:], alone_b[1:]):
        assert torch.allclose(t, alone, atol=REASSOCIATION)


def test_the_trie_reads_the_same_with_the_head_applied_apart_or_whole(tiny, contexts, monkeypatch):
    """Where the head is applied apart (`head_split`: only real node positions, LSE_ROWS at a time) and
    where the model's whole forward gives every position's logits, the trie reads the same numbers."""
    model, tokenizer = tiny
    assert prefill.head_split(model) is not None  # the tiny Llama's logits are its head's
    cands = [["Recursion", "Paris", "递归", "巴黎"] + load_lexicon().entries for _ in contexts]
    kwargs = dict(candidates=cands, top_k=20, max_new_tokens=0, batch_size=6, tolerance=1e-4,
                  unit_ranks=engine.UNIT_RANKS)
    apart = engine.probe(model, tokenizer, contexts, **kwargs)
    monkeypatch.setitem(prefill._SPLITS, model, None)
    whole = engine.probe(model, tokenizer, contexts, **kwargs)
    assert_same(apart, whole)


def test_a_model_that_changes_its_logits_after_the_head_keeps_the_whole_forward(tiny):
    """A scale or soft cap after the head fails `head_split`'s check: no split, the whole forward."""
    model, _ = tiny

    class Capped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def get_decoder(self):
            return self.inner.get_decoder()

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def forward(self, **kwargs):
            out = self.inner(**kwargs)
            out.logits = out.logits * 0.0625  # Cohere-style logit scale
            return out

    assert prefill.head_split(Capped(model)) is None


def test_rows_still_decoding_count_against_the_next_batch_s_positions(tiny, contexts, monkeypatch):
    """`batch_tokens` bounds what the cache holds: before a batch is prefilled, the rows still decoding
    are stepped until their columns and the batch's padded positions fit it together (long prompts'
    continuations finish before the next batch of them comes in), and the tokens are the reference's."""
    model, tokenizer = tiny
    longest = max(len(tokenizer(c, add_special_tokens=False)["input_ids"]) for c in contexts)
    budget = 3 * longest  # room for 3 prompts at most, batches of up to 3
    held: list[int] = []
    run_batch = engine._Engine.run_batch

    def watching(self, indices, *args, **kwargs):
        decoder = prober.decoder
        held.append((len(decoder.rows) * decoder.mask.shape[1] if decoder.rows else 0)
                    + len(indices) * max(len(ids) for ids in args[1]))
        return run_batch(self, indices, *args, **kwargs)

    monkeypatch.setattr(engine._Engine, "run_batch", watching)
    settings = dict(top_k=20, max_new_tokens=6, stop=["\n\n"], batch_size=3)
    answers = [12] * len(contexts)
    prober = engine.Prober(model, tokenizer, batch_tokens=budget, **settings)
    prober.submit(0, contexts, answer_tokens=answers)
    ((_, steps),) = prober.finish()
    assert len(held) > 2 and max(held) <= budget
    old = reference_engine.probe(model, tokenizer, contexts, answer_tokens=answers, batch_tokens=budget, **settings)
    assert [(s.response_ids, s.answer_ids) for s in steps] == [(s.response_ids, s.answer_ids) for s in old]
