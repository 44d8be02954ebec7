"""KV-cache policies (`--kv-cache`) in the first-step engine, on the tiny random Llama (2 layers).

The references are independent of the engine's masks: a token-by-token loop whose cache
physically holds only the keys the policy keeps for the next query (original positions),
and the layer-0 keys of a plain full-cache prefill rounded by hand.
"""

from __future__ import annotations

import doctest
import inspect

import pytest
import torch

from evalkit.engines.transformers import firststep as engine
from evalkit.engines.transformers import kvcache, prefill
from evalkit.engines import resolve as models
from evalkit.engines import kvpolicy
from evalkit.engines.kvpolicy import FULL, parse
from evalkit.errors import BadInput
from tests.tiny import build_tiny_model, load_tiny

N_LAYERS = 2  # tests/tiny.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def chat(tokenizer, text):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def contexts(tiny):
    _, tok = tiny
    return [
        chat(tok, "The access code is 7391-2046. " + "A quick brown fox jumps over the lazy dog. " * 3
             + "What is the access code?"),
        chat(tok, "Hi"),
        chat(tok, "法国的首都是哪里？请简短回答。"),
    ]


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def evicting_reference(model, ids, policy, n_new=0, forced=None):
    """Feed `ids` one token at a time; before each step drop from the cache every key the
    policy hides from that query (positions stay the original ones). Returns the log-softmax
    after the last prompt token, the greedy continuation of `n_new` tokens, and the
    teacher-forced log P of `forced` (a token list) after the prompt."""
    from transformers import DynamicCache

    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def run(tokens):
        cache, held, lps = DynamicCache(), [], []
        for t, tok in enumerate(tokens):
            keep = [i for i, p in enumerate(held) if policy.visible(t, p)]
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
            held = [held[i] for i in keep]
            with torch.no_grad():
                out = model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[t]]), use_cache=True,
                            **{kw: cache})
            held.append(t)
            lps.append(torch.log_softmax(out.logits[0, -1].float(), -1))
        return lps

    lps = run(list(ids))
    first = lps[-1]
    response, seq = [], list(ids)
    for _ in range(n_new):
        seq.append(int(torch.argmax(run(seq)[-1] if response else first)))
        response.append(seq[-1])
    forced_lp = None
    if forced:
        steps = run(list(ids) + list(forced[:-1]))[len(ids) - 1:]
        forced_lp = sum(float(steps[i][forced[i]]) for i in range(len(forced)))
    return first, response, forced_lp


@pytest.mark.parametrize("spec", ["window:6", "sinkwindow:2:6", "window:1", "sinkwindow:3:4"])
def test_masks_equal_physical_eviction(tiny, contexts, spec):
    """Prefill, candidate trie and greedy decoding under the policy's masks (batched, left
    padded) equal a token-by-token cache that really drops the evicted keys."""
    model, tok = tiny
    policy = parse(spec)
    cands = [["Sure", "The access", "好的"]] * len(contexts)
    steps = engine.probe(model, tok, contexts, cands, max_new_tokens=4, batch_size=3, kv_policy=policy)
    for ctx, step in zip(contexts, steps):
        ids = ids_of(tok, ctx)
        forced = engine.candidate_ids(tok, ctx, "The access", ids)
        ref_first, ref_response, ref_forced = evicting_reference(model, ids, policy, n_new=4, forced=forced)
        assert torch.allclose(step.logprobs, ref_first, atol=1e-4)
        assert step.response_ids == ref_response[: len(step.response_ids)]
        assert step.candidate_probs["The access"] == pytest.approx(torch.tensor(ref_forced).exp().item(), rel=1e-3)


def perturbed(tokenizer, ctx, position, other=None):
    """The context's ids with the token at `position` replaced by another token."""
    ids = ids_of(tokenizer, ctx)
    new = list(ids)
    new[position] = other if other is not None else (ids[position] + 7) % (len(tokenizer) - 3) + 3
    assert new[position] != ids[position]
    return ids, new


def probe_ids(model, tokenizer, id_lists, policy, cands=("Sure", "The access")):
    """probe on token lists (decoded and re-encoded is not safe for perturbed ids, so the
    tokenizer's encoding is bypassed)."""

    class Ids:
        def __init__(self, inner):
            self.inner = inner
            self.pad_token_id, self.eos_token_id = inner.pad_token_id, inner.eos_token_id
            self.unk_token_id = getattr(inner, "unk_token_id", None)

        def __call__(self, text, add_special_tokens=False):
            if text in texts:
                return {"input_ids": texts[text]}
            for key, ids in texts.items():  # context + candidate: the context's ids, then the candidate's
                if text.startswith(key):
                    return {"input_ids": ids + self.inner(text[len(key):], add_special_tokens=False)["input_ids"]}
            return self.inner(text, add_special_tokens=add_special_tokens)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    # one prompt a batch: two rows of one batch may differ in the last bits even when identical
    texts = {f"<ctx{i}>": list(ids) for i, ids in enumerate(id_lists)}
    return engine.probe(model, Ids(tokenizer), list(texts), [list(cands)] * len(texts), max_new_tokens=4,
                        batch_size=1, kv_policy=policy)


def same_step(a, b):
    return (torch.equal(a.logprobs, b.logprobs) and a.response_ids == b.response_ids
            and a.candidate_probs == b.candidate_probs)


def test_window_makes_the_output_independent_of_evicted_tokens(tiny, contexts):
    """window:W — a token more than L·(W−1) positions before the last prompt token (L layers:
    the receptive field of sliding-window attention) cannot change anything the engine
    reads: first-step distribution, candidate probabilities, greedy response. A token
    just inside that field does, so the bound is tight and the test is not vacuous."""
    model, tok = tiny
    W = 5
    n = len(ids_of(tok, contexts[0]))
    field = N_LAYERS * (W - 1)
    out_of_reach = n - 1 - field - 1
    assert out_of_reach > 5
    policy = parse(f"window:{W}")
    for position in (0, 3, out_of_reach):
        ids, new = perturbed(tok, contexts[0], position)
        a, b = probe_ids(model, tok, [ids, new], policy)
        assert same_step(a, b), position
    ids, new = perturbed(tok, contexts[0], out_of_reach + 1)
    a, b = probe_ids(model, tok, [ids, new], policy)
    assert not torch.equal(a.logprobs, b.logprobs)
    # under the full cache the first token matters
    ids, new = perturbed(tok, contexts[0], 0)
    a, b = probe_ids(model, tok, [ids, new], FULL)
    assert not torch.equal(a.logprobs, b.logprobs)


def test_sinkwindow_keeps_exactly_the_first_s_positions(tiny, contexts):
    """sinkwindow:S:W — position S−1 (a sink) changes the output; position S, evicted and
    out of the window's reach, changes nothing."""
    model, tok = tiny
    S, W = 3, 4
    n = len(ids_of(tok, contexts[0]))
    assert n - 1 - N_LAYERS * (W - 1) > S + 1
    policy = parse(f"sinkwindow:{S}:{W}")
    ids, new = perturbed(tok, contexts[0], S - 1)
    a, b = probe_ids(model, tok, [ids, new], policy)
    assert not torch.equal(a.logprobs, b.logprobs)
    ids, new = perturbed(tok, contexts[0], S)
    a, b = probe_ids(model, tok, [ids, new], policy)
    assert same_step(a, b)
    # without sinks position S−1 is evicted like any other
    ids, new = perturbed(tok, contexts[0], S - 1)
    a, b = probe_ids(model, tok, [ids, new], parse(f"window:{W}"))
    assert same_step(a, b)


def test_full_runs_the_unchanged_path(tiny, contexts, monkeypatch):
    """`full` builds no custom mask and no special cache: the same results, bit for bit, as
    the engine without a policy."""
    model, tok = tiny
    plain = engine.probe(model, tok, contexts, [["Sure", "好的"]] * 3, max_new_tokens=5, batch_size=2)

    def refuse(*args, **kwargs):
        raise AssertionError("full must not build a custom mask or cache")

    monkeypatch.setattr(engine._Engine, "policy_mask", refuse)
    monkeypatch.setattr(prefill, "new_cache", refuse)
    full = engine.probe(model, tok, contexts, [["Sure", "好的"]] * 3, max_new_tokens=5, batch_size=2, kv_policy=FULL)
    for a, b in zip(plain, full):
        assert same_step(a, b) and a.topk_ids == b.topk_ids and a.entropy == b.entropy


def test_a_window_longer_than_the_prompt_matches_full(tiny, contexts):
    """The 4-D mask path with nothing evicted gives the causal path's numbers."""
    model, tok = tiny
    cands = [["Sure", "好的"]] * 3
    full = engine.probe(model, tok, contexts, cands, max_new_tokens=5, batch_size=3)
    wide = engine.probe(model, tok, contexts, cands, max_new_tokens=5, batch_size=3, kv_policy=parse("window:100000"))
    for a, b in zip(full, wide):
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert a.response_ids == b.response_ids
        assert a.candidate_probs == pytest.approx(b.candidate_probs, rel=1e-4, abs=1e-12)


def test_fp8_stores_rounded_keys_and_moves_the_logits_a_little(tiny, contexts):
    """fp8: layer 0's cached keys are exactly the full cache's keys rounded to e4m3 with a
    per-prompt scale (amax / 448); the first-step distribution moves by a nonzero amount
    (measured here; the default model's figures are in docs/quantization-kv-attention.md); and a prompt's result
    does not depend on the other prompts of its batch."""
    model, tok = tiny
    ctx = contexts[0]
    ids = torch.tensor([ids_of(tok, ctx)])
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=True).past_key_values if kw == "past_key_values" else \
            model(input_ids=ids, use_cache=True).cache
        cache = kvcache.new_cache(parse("fp8"), model, [0])
        model(input_ids=ids, use_cache=True, **{kw: cache})
    k = full.layers[0].keys
    scale = k.abs().amax().float() / 448.0
    expected = (k.float() / scale).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(cache.layers[0].keys, expected.to(k.dtype))
    from transformers.cache_utils import Fp8QuantizedLayer  # transformers' own fp8 rounding agrees

    theirs = Fp8QuantizedLayer()
    theirs.update(k, full.layers[0].values)
    assert torch.equal(theirs._dequantize(theirs._quantized_keys), cache.layers[0].keys)
    rel = ((cache.layers[0].keys - k).abs() / k.abs().clamp(min=1e-3)).max()
    assert 0 < rel <= 2**-3  # e4m3: 3 mantissa bits

    plain = engine.probe(model, tok, contexts, max_new_tokens=0, batch_size=3)
    fp8 = engine.probe(model, tok, contexts, max_new_tokens=0, batch_size=3, kv_policy=parse("fp8"))
    alone = engine.probe(model, tok, contexts, max_new_tokens=0, batch_size=1, kv_policy=parse("fp8"))
    for a, b, c in zip(plain, fp8, alone):
        # total variation; the tiny model's random, deliberately peaked weights make this large
        # (tens of percent), the default model's is small: test_fp8_on_the_default_model
        moved = (a.logprobs.exp() - b.logprobs.exp()).abs().sum() / 2
        assert moved > 0
        assert torch.allclose(b.logprobs, c.logprobs, atol=1e-5)


@pytest.mark.slow
def test_fp8_on_the_default_model(default_model_available):
    """fp8 on SmolLM2-135M (Q4_1 weights, fp32 compute): the first-step distribution moves
    by a small, nonzero total variation, measured on a few first-token prompts."""

    plan = models.resolve("hf", None, device="cpu")
    lm = models.load(plan, batch_size=1)
    tok = lm.tokenizer
    prompts = ["What is the capital of France?", "What is recursion?", "法国的首都是哪里？", "Name a prime number."]
    contexts = [chat(tok, p) for p in prompts]
    plain = engine.probe(lm.model, tok, contexts, max_new_tokens=0, batch_size=4)
    fp8 = engine.probe(lm.model, tok, contexts, max_new_tokens=0, batch_size=4, kv_policy=parse("fp8"))
    tv = [float((a.logprobs.exp() - b.logprobs.exp()).abs().sum() / 2) for a, b in zip(plain, fp8)]
    print("fp8 total variation per prompt:", [f"{x:.4f}" for x in tv])
    assert all(x > 0 for x in tv)
    assert max(tv) < 0.25


def test_groupwise_backends_when_installed(tiny, contexts):
    """quantized:quanto:4 / quantized:hqq:4 run the whole engine when their package is here."""
    model, tok = tiny
    ran = 0
    for spec in ("quantized:quanto:4", "quantized:hqq:4"):
        policy = parse(spec)
        try:
            kvpolicy.check_available(policy)
        except BadInput:
            continue
        plain = engine.probe(model, tok, contexts, [["Sure"]] * 3, max_new_tokens=4, batch_size=3)
        q = engine.probe(model, tok, contexts, [["Sure"]] * 3, max_new_tokens=4, batch_size=3, kv_policy=policy)
        assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(plain, q))
        ran += 1
    if not ran:
        pytest.skip("neither optimum-quanto nor hqq is installed (pip install -e '.[kvquant]')")


def test_residual_buffer_is_flushed_after_128_tokens(tiny):
    """Group-wise backends keep the newest tokens unrounded until RESIDUAL of them, then round them."""
    policy = parse("quantized:hqq:4")
    try:
        kvpolicy.check_available(policy)
    except BadInput:
        pytest.skip("hqq is not installed")
    model, _ = tiny
    cache = kvcache.new_cache(policy, model, [0])
    layer0 = None
    with torch.no_grad():
        model(input_ids=torch.tensor([[5] * 10]), use_cache=True, cache=cache)
        layer0 = cache.layers[0]
        for t in range(kvcache.RESIDUAL - 1):
            model(input_ids=torch.tensor([[6]]), position_ids=torch.tensor([[10 + t]]), use_cache=True, cache=cache)
        assert layer0.tail == kvcache.RESIDUAL - 1
        model(input_ids=torch.tensor([[6]]), position_ids=torch.tensor([[137]]), use_cache=True, cache=cache)
    assert layer0.tail == 0


@pytest.mark.parametrize("text, spec", [
    ("full", "full"), ("", "full"), (None, "full"), ("window:256", "window:256"), ("WINDOW:8", "window:8"),
    ("sinkwindow:4:256", "sinkwindow:4:256"), ("fp8", "fp8"), ("quantized:fp8:8", "fp8"),
    ("quantized:quanto:2", "quantized:quanto:2"), ("quantized:hqq:8", "quantized:hqq:8"),
])
def test_parse(text, spec):
    assert parse(text).spec == spec


@pytest.mark.parametrize("text", [
    "window", "window:0", "window:-3", "window:1.5", "window:abc", "window:4:4", "sinkwindow:4", "sinkwindow:0:8",
    "sinkwindow:4:0", "fp16", "fp8:8", "quantized:quanto:3", "quantized:hqq:16", "quantized:int8:8",
    "quantized:fp8:4", "quantized:quanto", "window:99999999999", "full:1",
])
def test_parse_refuses(text):
    with pytest.raises(BadInput):
        parse(text)


def test_parse_list_refuses_a_policy_twice():
    assert [p.spec for p in kvpolicy.parse_list("full, window:8")] == ["full", "window:8"]
    with pytest.raises(BadInput, match="twice"):
        kvpolicy.parse_list("window:8,WINDOW:8")
    with pytest.raises(BadInput):
        kvpolicy.parse_list(" , ")


def hide_backends(monkeypatch):
    """Make optimum-quanto and hqq look uninstalled (whether they are here or not)."""
    real = kvpolicy.importlib.util.find_spec
    hidden = {b.module for b in kvpolicy.KV_BACKENDS.values()}
    monkeypatch.setattr(kvpolicy.importlib.util, "find_spec",
                        lambda name, *args: None if name in hidden else real(name, *args))


def test_missing_backend_names_the_pip_command(monkeypatch):
    hide_backends(monkeypatch)
    with pytest.raises(BadInput, match=r"pip install 'evalkit-firsttoken\[kvquant\]' \(in a clone: pip install -e '\.\[kvquant\]'\)"):
        kvpolicy.check_available(parse("quantized:quanto:4"))


def test_doctests():
    assert doctest.testmod(kvpolicy).failed == 0


# --- runs -------------------------------------------------------------------------------


def test_full_run_equals_a_run_without_the_option(tiny_model_dir, tmp_path):
    """`--kv-cache full` stores exactly the rows of a run without the option (EXCEPT ALL both
    ways over metrics, samples and first_token_topk), and the run row says `full`."""
    import duckdb

    from evalkit.runner.execute import RunConfig, execute
    from tests.test_determinism import TABLES, differences

    db = tmp_path / "evalkit.duckdb"
    common = dict(tasks=["firsttoken", "needle_en"], model="hf", model_args=f"pretrained={tiny_model_dir}",
                  device="cpu", limit=2, seed=5, db=str(db), needle_lengths=[160], needle_depths=[0.0, 1.0])
    before = execute(RunConfig(**common))
    full = execute(RunConfig(**common, kv_cache="full"))
    for table in TABLES:
        n_a, n_b, diff = differences(db, table, before.run_id, full.run_id)
        assert n_a == n_b > 0, (table, n_a, n_b)
        assert diff == [], f"{table} differ: {diff}"
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT DISTINCT kv_cache FROM runs").fetchall() == [("full",)]
    finally:
        con.close()


def test_a_comma_list_runs_one_run_per_policy(tiny_model_dir, tmp_path):
    """One command, one run per policy, the same prompts; the leaderboard and compare carry the
    policy as a dimension; the report draws the per-policy needle figures."""
    import duckdb
    from click.testing import CliRunner

    from evalkit.cli import cli

    db = tmp_path / "evalkit.duckdb"
    result = CliRunner().invoke(cli, [
        "run", "--model-args", f"pretrained={tiny_model_dir}", "--device", "cpu", "--tasks", "needle_en",
        "--needle-lengths", "160", "--needle-depths", "0,1", "--kv-cache", "full,window:8,sinkwindow:2:8,fp8",
        "--name", "sweep", "--db", str(db)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute("SELECT name, kv_cache, seed FROM runs ORDER BY created_at, id").fetchall()
        prompts = con.execute("SELECT count(DISTINCT prompt_hash), count(*) FROM samples").fetchone()
        board = con.execute("SELECT DISTINCT kv_cache FROM leaderboard ORDER BY 1").fetchall()
    finally:
        con.close()
    assert rows == [("sweep (full)", "full", 1234), ("sweep (window:8)", "window:8", 1234),
                    ("sweep (sinkwindow:2:8)", "sinkwindow:2:8", 1234), ("sweep (fp8)", "fp8", 1234)]
    assert prompts == (2, 8)  # the same two needle prompts in every run
    assert board == [("fp8",), ("full",), ("sinkwindow:2:8",), ("window:8",)]

    out = CliRunner().invoke(cli, ["compare", "sweep (full)", "sweep (window:8)", "--db", str(db)])
    assert out.exit_code == 0, out.output
    assert "runs differ in: kv_cache full -> window:8" in out.output

    report = CliRunner().invoke(cli, ["report", "--db", str(db), "--out", str(tmp_path / "report")])
    assert report.exit_code == 0, report.output
    assert (tmp_path / "report" / "needle_kv_cache.png").stat().st_size > 0
    assert (tmp_path / "report" / "needle_kv_cache_depth.png").stat().st_size > 0
    assert "kv cache" in (tmp_path / "report" / "summary.md").read_text(encoding="utf-8")


def test_missing_backend_package_is_one_line_and_writes_nothing(tiny_model_dir, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from evalkit.cli import cli

    hide_backends(monkeypatch)
    db = tmp_path / "evalkit.duckdb"
    for command in (["run", "--model-args", f"pretrained={tiny_model_dir}", "--tasks", "firsttoken",
                     "--kv-cache", "full,quantized:hqq:4", "--db", str(db)],
                    ["inspect", "Hi", "--model-args", f"pretrained={tiny_model_dir}", "--kv-cache",
                     "quantized:quanto:2"]):
        result = CliRunner().invoke(cli, command)
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "pip install 'evalkit-firsttoken[kvquant]'" in lines[0], lines
    assert not db.exists()


def test_inspect_runs_under_a_policy(tiny_model_dir):
    from evalkit.inspection import inspect_prompt

    full = inspect_prompt("Hello, how are you today? " * 6, model_args=f"pretrained={tiny_model_dir}", device="cpu")
    window = inspect_prompt("Hello, how are you today? " * 6, model_args=f"pretrained={tiny_model_dir}",
                            device="cpu", kv_cache="window:4")
    assert (full.kv_cache, window.kv_cache) == ("full", "window:4")
    assert [t.prob for t in full.tokens] != [t.prob for t in window.tokens]


def test_a_policy_is_parsed_once_and_handed_over_resolved(tiny_model_dir, monkeypatch):
    """`--kv-cache` text becomes a KVPolicy once, in `models.resolve`: the plan carries it, the
    backend receives that object, and a comma list is split in `runner.sweep` into canonical specs."""
    from evalkit.runner.config import RunConfig
    from evalkit.runner.sweep import sweep_configs

    configs = sweep_configs(RunConfig(tasks=["firsttoken_en"], kv_cache="full, Window:8", name="x"))
    assert [(c.kv_cache, c.name) for c in configs] == [("full", "x (full)"), ("window:8", "x (window:8)")]

    calls = []
    parse = kvpolicy.parse
    monkeypatch.setattr(kvpolicy, "parse", lambda text: calls.append(text) or parse(text))
    plan = models.resolve("hf", f"pretrained={tiny_model_dir}", device="cpu", kv_cache=configs[1].kv_cache)
    assert calls == ["window:8"]
    assert plan.kv_policy == kvcache.KVPolicy("window", window=8) and plan.kv_cache == "window:8"
    assert plan.backend_args["kv_cache"] is plan.kv_policy  # the object, not its text
    assert kvpolicy.as_policy(plan.kv_policy) is plan.kv_policy and calls == ["window:8"]
    assert kvpolicy.as_policy("window:8") == plan.kv_policy  # plain lm-eval's text still parses
