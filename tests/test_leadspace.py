"""The whitespace-led first-token event (docs/metrics.md "One event for text and probability") against a
brute force written here: every token path enumerated, each step a plain `softmax(model(ids).logits[0, -1])`.

The brute force does not use the engines' trie, `engines.leadspace` or `engines.vocab`: it finds the
whitespace-only tokens and the leading whitespace of mixed tokens by decoding every token, enumerates the
whitespace prefixes, tokenises each string after the context and the prefix, keeps each token sequence once,
and drops a path under a path of a string that covers it as text (the `drop_covered` rule).
"""

from __future__ import annotations

import inspect
import itertools
import math

import numpy as np
import pytest
import torch

from evalkit.engines import leadspace
from evalkit.engines.transformers import firststep as engine
from evalkit.engines.transformers.model import candidate_metrics
from evalkit.scoring.text import covers
from tests.gemma import gemma_path, missing
from tests.tiny import build_tiny_model, load_tiny

LEVELS = 2  # whitespace tokens a path may begin with, in these tests (the tiny vocabulary has 10: 10 + 100 nodes)
ANSWERS = ["Paris", "Tokyo"]
OPENERS = ["Sure", "Sure thing", "So", "Sorry", "Well", "好的", "好"]
QUESTIONS = ["What is the capital of France?", "法国的首都是哪里？", "Say hello."]
SHIPPED = (leadspace.WS_LEVELS, leadspace.WS_NODES)  # what a run uses, before `two_levels` widens them


@pytest.fixture(scope="module")
def flat_tiny(tmp_path_factory):
    """The tiny random Llama with its output head scaled down: a flat enough first step that whitespace
    tokens and the paths after them carry mass a wrong sum would miss."""
    model, tokenizer = load_tiny(build_tiny_model(tmp_path_factory.mktemp("tiny")))
    with torch.no_grad():
        model.lm_head.weight.mul_(0.05)
    return model, tokenizer


@pytest.fixture(autouse=True)
def two_levels(monkeypatch):
    monkeypatch.setattr(leadspace, "WS_LEVELS", LEVELS)
    monkeypatch.setattr(leadspace, "WS_NODES", 10_000)  # no cap on a level's nodes: tolerance 0 is exact


def _probe(model, tokenizer, contexts, cands, tolerance, lead_space=True):
    extra = {"first_char": False} if "first_char" in inspect.signature(engine.probe).parameters else {}
    return engine.probe(model, tokenizer, contexts, cands, max_new_tokens=0, tolerance=tolerance,
                        lead_space=lead_space, exact_candidates=[ANSWERS] * len(contexts), **extra)


def _ids(tokenizer, text):
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _whitespace(tokenizer):
    """(whitespace-only token ids, leading whitespace strings of mixed tokens), by decoding each token."""
    specials = set(tokenizer.all_special_ids)
    ws, spaces = [], set()
    for i in range(len(tokenizer)):
        if i in specials:
            continue
        text = tokenizer.decode([i])
        if not text or "\ufffd" in text:
            continue
        if text.isspace():
            ws.append(i)
        elif text[0].isspace():
            spaces.add(text[: len(text) - len(text.lstrip())])
    return ws, sorted(spaces)


class Brute:
    """Token paths and their probabilities by plain forwards, one per distinct prefix."""

    def __init__(self, model, tokenizer, context):
        self.model, self.tok, self.context = model, tokenizer, context
        self.ctx_ids = _ids(tokenizer, context)
        self.ws, self.spaces = _whitespace(tokenizer)
        self.memo: dict[tuple[int, ...], torch.Tensor] = {}

    def step(self, prefix):
        if prefix not in self.memo:
            with torch.no_grad():
                logits = self.model(torch.tensor([self.ctx_ids + list(prefix)])).logits[0, -1].double()
            self.memo[prefix] = torch.softmax(logits, dim=-1)
        return self.memo[prefix]

    def prob(self, path):
        return math.prod(float(self.step(tuple(path[:k]))[path[k]]) for k in range(len(path)))

    def paths(self, s):
        out = set()
        for n in range(LEVELS + 1):
            for q in itertools.product(self.ws, repeat=n):
                for omega in ["", *self.spaces]:
                    joint = _ids(self.tok, self.context + self.tok.decode(list(q)) + omega + s)
                    base = self.ctx_ids + list(q)
                    tail = joint[len(base):] if joint[: len(base)] == base and len(joint) > len(base) else _ids(self.tok, omega + s)
                    path = tuple(q) + tuple(tail)
                    lead = next((k for k, t in enumerate(path) if t not in self.ws), len(path))
                    if lead < len(path) and lead <= LEVELS:
                        out.add(path)
        return out

    def event(self, strings):
        owned = {}
        for s in dict.fromkeys(strings):
            for p in self.paths(s):
                owned.setdefault(p, []).append(s)
        total = 0.0
        for p, who in owned.items():
            if all(any(o != s and covers(o, s) for k in range(1, len(p) + 1) for o in owned.get(p[:k], ())) for s in who):
                continue
            total += self.prob(p)
        return total

    def beyond(self):
        """The mass of whitespace runs longer than LEVELS tokens: what the engine leaves unscored at tolerance 0."""
        return sum(self.prob(q) * sum(float(self.step(q)[w]) for w in self.ws)
                   for q in itertools.product(self.ws, repeat=LEVELS))


@pytest.fixture(scope="module")
def contexts(flat_tiny):
    _, tok = flat_tiny
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS]


def test_the_vocabulary_read_matches_decoding(flat_tiny):
    _, tok = flat_tiny
    ws, spaces = _whitespace(tok)
    lv = leadspace.lead_vocab(tok)
    assert sorted(lv.ws_ids) == sorted(ws) and list(lv.spaces) == spaces and " " in spaces


def test_exact_event_equals_brute_force(flat_tiny, contexts):
    model, tok = flat_tiny
    steps = _probe(model, tok, contexts, [ANSWERS + OPENERS] * len(contexts), tolerance=0.0)
    plain = _probe(model, tok, contexts, [ANSWERS + OPENERS] * len(contexts), tolerance=0.0, lead_space=False)
    moved = 0.0
    for context, step, old in zip(contexts, steps, plain):
        brute = Brute(model, tok, context)
        got = candidate_metrics(tok, context, step, ANSWERS, OPENERS, None, ANSWERS)
        want_hit, want_open = brute.event(ANSWERS), brute.event(OPENERS)
        assert got["ft_hit_prob"] == pytest.approx(want_hit, rel=1e-4)
        assert got["answer_prob"] == pytest.approx(want_hit, rel=1e-4)
        assert got["opener_mass"] == pytest.approx(want_open, rel=1e-4)
        for s in ANSWERS + OPENERS:  # each string's own event, and its paths each once
            assert len(step.candidate_paths[s]) == len(set(step.candidate_paths[s]))
            assert set(step.candidate_paths[s]) == brute.paths(s)
            assert step.candidate_probs[s] == pytest.approx(sum(brute.prob(p) for p in brute.paths(s)), rel=1e-4)
        assert step.unscored_mass == pytest.approx(brute.beyond(), rel=1e-4)
        ws = float(sum(brute.step(())[w] for w in brute.ws))
        assert got["ws_mass"] == pytest.approx(ws, rel=1e-5)
        old_hit = candidate_metrics(tok, context, old, ANSWERS, OPENERS, None, ANSWERS)["ft_hit_prob"]
        moved = max(moved, got["ft_hit_prob"] / old_hit)
    assert moved > 1.5  # the whitespace-led paths carry mass on this flat model: the old event misses it


def test_tolerance_bounds_what_is_left_out(flat_tiny, contexts):
    model, tok = flat_tiny
    tolerance = 2e-3
    steps = _probe(model, tok, contexts, [ANSWERS + OPENERS] * len(contexts), tolerance=tolerance)
    for context, step in zip(contexts, steps):
        brute = Brute(model, tok, context)
        got = candidate_metrics(tok, context, step, ANSWERS, OPENERS, None, ANSWERS)
        for metric, strings in (("ft_hit_prob", ANSWERS), ("opener_mass", OPENERS)):
            want = brute.event(strings)
            assert want - step.unscored_mass - 1e-9 <= got[metric] <= want * (1 + 1e-4) + 1e-12
        assert step.unscored_mass >= brute.beyond() * (1 - 1e-4)
        assert step.candidate_positions < 600  # the cut left most whitespace prefixes out


def test_one_path_reached_two_ways_counts_once():
    # " Paris" tokenised as [" ", "Paris"] is the path the whitespace node " " then "Paris" also reaches
    toks = {((), "Paris"): [5], ((), " Paris"): [1, 5], ((1,), "Paris"): [5], ((1,), " Paris"): [1, 5]}
    paths = leadspace.lead_paths(["Paris"], [" "], {(1,): " ", (1, 1): "  "}, {1},
                                 lambda n, s: toks.get((n, s), [5]))
    assert paths == {"Paris": [(5,), (1, 5), (1, 1, 5)]}


@pytest.mark.skipif(missing() is not None, reason=missing() or "")
def test_gemma_llamacpp_event_equals_brute_force():
    pytest.importorskip("llama_cpp")
    from evalkit.engines.llamacpp.firststep import LlamaCppEngine, log_softmax
    from evalkit.engines.llamacpp.probe import engine_vocab, probe

    eng = LlamaCppEngine(str(gemma_path()), n_ctx=1024)
    try:
        lv = engine_vocab(eng)
        contexts = ["<bos>Question: What is the capital of France?\nAnswer:", "<bos>What is the capital of Japan?"]
        cands = [["Paris"], ["Tokyo"]]
        # one prompt a call: the brute force prefills one prompt (Gemma's batched prefill on llama.cpp rounds
        # its first step differently, up to 0.7 nats, whatever the event)
        steps = [probe(eng, [c], [s], max_new_tokens=0, tolerance=1e-4, exact_candidates=[s], lead_space=True)[0]
                 for c, s in zip(contexts, cands)]
        for context, (s,), step in zip(contexts, cands, steps):
            ids = eng.tokenize(context)
            memo = {}

            def lp(prefix):
                if prefix not in memo:
                    memo[prefix] = log_softmax(eng.prefill(ids + list(prefix)))
                return memo[prefix]

            paths = step.candidate_paths[s]
            assert len(paths) == len(set(paths)) and len(paths) > 1

            def brute(p):
                return math.exp(sum(float(lp(tuple(p[:k]))[p[k]]) for k in range(len(p))))

            # llama.cpp's batched tree and a one-prompt prefill of a 4-bit model round differently: 2 %
            scored = [p for p in paths if step.path_probs[p] > 0]
            assert step.candidate_probs[s] == pytest.approx(sum(brute(p) for p in scored), rel=2e-2)
            assert sum(brute(p) for p in paths if p not in scored) <= 1.05 * step.unscored_mass + 1e-12
            # the whitespace-led paths are the model's own answers after "Answer:" (" Paris") and "\n\n" alike
            plain = math.exp(sum(float(lp(tuple(step.candidate_tokens[s][:k]))[step.candidate_tokens[s][k]])
                                 for k in range(len(step.candidate_tokens[s]))))
            assert step.candidate_probs[s] > 10 * plain
            ws = float(np.exp(lp(())[list(lv.ws_ids)]).sum())
            assert leadspace.ws_mass(step.logprobs, lv) == pytest.approx(ws, rel=1e-3)
    finally:
        eng.close()


@pytest.mark.skipif(missing() is not None, reason=missing() or "")
def test_gemma_opener_probabilities_equal_brute_force(monkeypatch):
    """Every string of the opener lexicon on Gemma under qa (llama.cpp, the whitespace-led event): each string's
    probability is the sum over its scored paths of one-prompt prefills, within 2 % (a batched tree and a lone
    prefill of a 4-bit model round differently) plus 1e-5; opener_mass is these, summed under the covering rule
    checked on the tiny model above. Measured: 132 strings, 1,765 paths, worst excess 4.5e-6."""
    pytest.importorskip("llama_cpp")
    from evalkit.engines.llamacpp.firststep import LlamaCppEngine, log_softmax
    from evalkit.engines.llamacpp.probe import probe
    from evalkit.scoring.lexicon import load_lexicon

    monkeypatch.setattr(leadspace, "WS_LEVELS", SHIPPED[0])  # as a run scores it (the whole lexicon after
    monkeypatch.setattr(leadspace, "WS_NODES", SHIPPED[1])  # every whitespace node would be hours)
    openers = list(dict.fromkeys(load_lexicon().entries))
    context = "<bos>Question: What is the capital of France?\nAnswer:"
    eng = LlamaCppEngine(str(gemma_path()), n_ctx=4096)
    try:
        (step,) = probe(eng, [context], [openers], max_new_tokens=0, tolerance=1e-4, lead_space=True)
        ids = eng.tokenize(context)
        memo: dict = {}

        def lp(prefix):
            if prefix not in memo:
                memo[prefix] = log_softmax(eng.prefill(ids + list(prefix)))
            return memo[prefix]

        n = 0
        for s in openers:
            scored = [p for p in step.candidate_paths[s] if step.path_probs[p] > 0]
            want = sum(math.exp(sum(float(lp(tuple(p[:k]))[p[k]]) for k in range(len(p)))) for p in scored)
            assert abs(step.candidate_probs[s] - want) <= 0.02 * want + 1e-5, s
            n += len(scored)
        assert n > len(openers)  # the whitespace-led paths are there: more than one path a string
    finally:
        eng.close()


def test_the_run_summary_says_when_the_template_leaves_whitespace_first():
    from evalkit.cli.output import metric_table

    rows = [{"task": "firsttoken_en", "metric": "ws_mass", "value": 0.83, "ci_lo": None, "ci_hi": None, "n": 40},
            {"task": "firsttoken_zh", "metric": "ws_mass", "value": 0.02, "ci_lo": None, "ci_hi": None, "n": 40}]
    text = metric_table(rows)
    assert "firsttoken_en: mean ws_mass 0.830 > 0.5: the template leaves the model to open with whitespace" in text
    assert "firsttoken_zh: mean ws_mass" not in text


@pytest.mark.parametrize("template, args, want", [
    ("qa", "", True),  # a target_delimiter: the answer starts after whitespace
    ("qa", "lead_space=false", False),  # the model args say otherwise: kept
    ("plain", "", None),  # no delimiter: off, as before
    ("chat", "", None),
])
def test_a_template_with_a_delimiter_turns_the_whitespace_led_event_on(tmp_path, template, args, want):
    from evalkit.api import _config
    from evalkit.runner.config import plan_run

    for model in ("hf", "llamacpp"):  # llamacpp: the embedded GGUF
        extra = {"model_args": args} if args else {}
        plan = plan_run(_config("firsttoken", model, tmp_path / "t.duckdb", {"template": template, **extra}))
        got = plan.model.args.get("lead_space")
        assert (None if got is None else str(got).lower() == "true") == want, (model, got)


def test_opener_starts_hold_every_first_token_an_opener_path_can_have(flat_tiny, tmp_path):
    """`opener_start_mass` (what `--metrics gate` reads in place of opener_mass) bounds opener_mass only if its
    token set holds every first token an opener path can have. With the whitespace-led event those are the
    whitespace-only tokens and the first token of ω + entry for each leading whitespace ω, found here by
    decoding the vocabulary and tokenising after the context, not through `engines.leadspace`; without the
    event, the entries' own first tokens."""
    from evalkit.engines.transformers.model import EvalkitHFLM

    model, tokenizer = flat_tiny
    folder = tmp_path / "flat"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    ws, spaces = _whitespace(tokenizer)

    def first(context, text):
        ctx, ids = _ids(tokenizer, context), _ids(tokenizer, context + text)
        return ids[len(ctx)] if ids[:len(ctx)] == ctx and len(ids) > len(ctx) else _ids(tokenizer, text)[0]

    on = EvalkitHFLM(pretrained=str(folder), device="cpu", lead_space=True)
    off = EvalkitHFLM(pretrained=str(folder), device="cpu", lead_space=False)
    entries = on.lexicon.entries
    for context in QUESTIONS:
        plain = {first(context, e) for e in entries}
        led = plain | set(ws) | {first(context, omega + e) for omega in spaces for e in entries}
        assert on._opener_starts(context, {}) == led
        assert off._opener_starts(context, {}) == plain
        assert led - plain  # what the entries' own first tokens leave out


@pytest.mark.slow
@pytest.mark.skipif(missing() is not None, reason=missing() or "")
def test_gemma_under_qa_opener_start_mass_bounds_opener_mass(tmp_path, invoke):
    """Gemma-3-270M under `qa` answers after a lone space: its opener paths begin with whitespace tokens or
    " Sure"-like tokens, which the entries' own first tokens miss (the bound read 0.0009 against an
    opener_mass of 0.0099 on English prompts before it counted them, and failed here on both engines; the
    hf engine's run costs 4 minutes, so the flat tiny model above holds its code path)."""
    model = "llamacpp"
    import duckdb

    db = tmp_path / "g.duckdb"
    args = (f"model={gemma_path()}" if model == "llamacpp" else
            f"pretrained={gemma_path().parent},gguf_file={gemma_path().name}")
    res = invoke("run", "--model", model, "--model-args", args, "--template", "qa", "--tasks", "firsttoken_en",
                 "--limit", 2, "--metrics", "opener_mass,opener_start_mass", "--db", db, env={"HF_HUB_OFFLINE": "1"})
    assert res.exit_code == 0, res.output
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT opener_mass, opener_start_mass FROM samples WHERE opener_mass IS NOT NULL"
                           ).fetchall()
    assert len(rows) == 2 and all(start >= mass - 1e-6 for mass, start in rows), rows
