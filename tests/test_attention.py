"""Attention read off the prefill (docs/metrics.md §1.8): the capture agrees with a direct computation
from transformers' own eager `output_attentions`, changes no output, and holds one block of weights at a time."""

from __future__ import annotations

import pytest
import torch

from evalkit.engines.transformers import attention
from evalkit.engines.transformers import firststep as engine
from tests.tiny import load_tiny

NEEDLE = "The access code is 7391-2046."
CONTEXTS = [
    # longer than T = 64 tokens, the needle in the middle
    "Hello, how are you today? " * 6 + NEEDLE + " A quick brown fox jumps over the lazy dog near the river bank. " * 3,
    NEEDLE + " Look at the first sentence.",  # short: T = its length, the needle first
    "今天天气很好，我们一起去公园散步吧。" + NEEDLE + "中国的首都是北京。",
]


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """(the tiny model switched to evalkit_eager, the same weights under transformers' eager, tokenizer)."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = load_tiny(tiny_model_dir)
    attention.install(model)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    return model, reference, tokenizer


def requests(tokenizer):
    out = []
    for text in CONTEXTS:
        start = text.index(NEEDLE)
        span = attention.token_span(tokenizer, text, start, start + len(NEEDLE))
        out.append(attention.Request({"needle_attn": span}, keep_last_row=True))
    return out


def direct(reference, tokenizer, text: str, span: tuple[int, int]):
    """α of the first token per layer and head, and the last position's needle mass, from output_attentions."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = reference(input_ids=torch.tensor([ids]), output_attentions=True)
    T = min(attention.SINK_TOKENS, len(ids))
    alpha = [(a[0, :, :T, 0].sum(-1) / T).tolist() for a in out.attentions]  # every query t < T, t = 0 included
    mass = [a[0, :, -1, span[0]:span[1]].sum(-1).tolist() for a in out.attentions]
    rows = [a[0, :, -1, :].mean(0).tolist() for a in out.attentions]
    return alpha, mass, rows, len(ids)


def flat(nested):
    return [x for row in nested for x in row]


def test_capture_equals_a_direct_computation_from_output_attentions(models, monkeypatch):
    model, reference, tokenizer = models
    monkeypatch.setattr(attention, "BLOCK_BYTES", 3 * 4 * 7 * 4)  # blocks of a few query rows
    reqs = requests(tokenizer)
    # one left-padded batch of three prompts of different lengths
    steps = engine.probe(model, tokenizer, CONTEXTS, max_new_tokens=0, batch_size=3, attention=reqs)
    lengths = []
    for text, req, step in zip(CONTEXTS, reqs, steps):
        alpha, mass, rows, n = direct(reference, tokenizer, text, req.spans["needle_attn"])
        got = step.attention
        lengths.append(n)
        assert got.n_tokens == n and got.sink_tokens == min(64, n) and got.n_layers == len(alpha)
        assert flat(got.sink_alpha) == pytest.approx(flat(alpha), abs=1e-5)
        assert flat(got.spans["needle_attn"]) == pytest.approx(flat(mass), abs=1e-5)
        assert flat(got.last_row) == pytest.approx(flat(rows), abs=1e-5)
        # the definitions on top: share of heads above ε, per layer and overall; span mass mean over heads
        heads = flat(alpha)
        ranked, k = sorted(heads), len(heads) // 2
        eps = (ranked[k - 1] + ranked[k]) / 2  # the tiny random model has no sink: split its heads in half
        assert got.sink_rate_by_layer(eps) == pytest.approx([sum(a > eps for a in h) / len(h) for h in alpha])
        assert got.sink_rate(eps) == pytest.approx(sum(a > eps for a in heads) / len(heads))
        assert got.span("needle_attn") == pytest.approx(sum(sum(h) / len(h) for h in mass) / len(mass), abs=1e-6)
    assert max(lengths) > 64 > min(lengths)  # T is capped at 64 and also shorter than 64


def test_reading_attention_changes_no_output(models, tiny_model_dir):
    """The first step and the greedy response under evalkit_eager (with and without a capture) are the sdpa run's."""
    model, _, tokenizer = models
    plain, _ = load_tiny(tiny_model_dir)
    assert attention.implementation(plain) == "sdpa" and attention.implementation(model) == attention.IMPLEMENTATION
    base = engine.probe(plain, tokenizer, CONTEXTS, max_new_tokens=8, batch_size=2)
    for reqs in (None, requests(tokenizer)):
        steps = engine.probe(model, tokenizer, CONTEXTS, max_new_tokens=8, batch_size=2, attention=reqs)
        for a, b in zip(base, steps):
            assert b.topk_ids[:5] == a.topk_ids[:5] and b.response_ids == a.response_ids
            assert torch.allclose(a.logprobs, b.logprobs, atol=1e-4)
            assert (b.attention is None) == (reqs is None)


def test_attention_and_the_answer_continuation_share_one_prefill(models, tiny_model_dir):
    """answer_tokens lets the greedy continuation run on past the response; reading the prefill's
    attention changes neither the response nor the answer."""
    model, _, tokenizer = models
    plain, _ = load_tiny(tiny_model_dir)
    answers = [12, 0, 12]
    base = engine.probe(plain, tokenizer, CONTEXTS, max_new_tokens=4, batch_size=3, answer_tokens=answers)
    steps = engine.probe(model, tokenizer, CONTEXTS, max_new_tokens=4, batch_size=3, answer_tokens=answers,
                         attention=requests(tokenizer))
    for n, a, b in zip(answers, base, steps):
        assert b.answer_ids == a.answer_ids and b.response_ids == a.response_ids
        assert bool(b.answer_ids) == bool(n) and b.attention is not None


def test_attention_under_an_evicting_kv_policy_is_what_the_model_read(models, tiny_model_dir):
    """Under window:W the last position reads only the last W keys: the captured row puts weight 0
    on every evicted position, and the outputs are those of the sdpa model under the same policy."""
    from evalkit.engines import kvpolicy

    model, _, tokenizer = models
    plain, _ = load_tiny(tiny_model_dir)
    policy, W = kvpolicy.parse("window:16"), 16
    text = CONTEXTS[0]
    base = engine.probe(plain, tokenizer, [text], max_new_tokens=6, batch_size=1, kv_policy=policy)[0]
    step = engine.probe(model, tokenizer, [text], max_new_tokens=6, batch_size=1, kv_policy=policy,
                        attention=[attention.Request(keep_last_row=True)])[0]
    assert step.response_ids == base.response_ids
    assert torch.allclose(step.logprobs, base.logprobs, atol=1e-4)
    read = step.attention
    assert read.n_tokens > 4 * W
    for row in read.last_row:
        assert sum(row[:-W]) == pytest.approx(0.0, abs=1e-6) and sum(row[-W:]) == pytest.approx(1.0, abs=1e-5)
    # the first token is seen by the first W query positions only: alpha <= W / T
    assert max(flat(read.sink_alpha)) <= W / read.sink_tokens + 1e-6


def test_a_layer_holds_one_block_of_weights(models, monkeypatch):
    model, _, tokenizer = models
    seen = []
    real = attention._eager_of

    def spy(module):
        fn = real(module)

        def wrapped(*args, **kwargs):
            out, weights = fn(*args, **kwargs)
            seen.append(weights.numel() * weights.element_size())
            return out, weights
        return wrapped

    monkeypatch.setattr(attention, "_eager_of", spy)
    long = " ".join(["The gardener came every morning with a wooden barrow."] * 15)
    n = len(tokenizer(long, add_special_tokens=False)["input_ids"])
    row = 2 * model.config.num_attention_heads * n * 4  # one query row of a layer, both prompts
    budget = 8 * row
    monkeypatch.setattr(attention, "BLOCK_BYTES", budget)
    engine.probe(model, tokenizer, [long, long[:100]], max_new_tokens=0, batch_size=2,
                 attention=[attention.Request(), attention.Request()])
    assert n * row > 40 * budget and max(seen) <= budget  # a whole layer's weights would be n rows


def test_token_span_covers_the_text(models):
    _, _, tokenizer = models
    text = CONTEXTS[0]
    start = text.index(NEEDLE)
    a, b = attention.token_span(tokenizer, text, start, start + len(NEEDLE))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert NEEDLE in tokenizer.decode(ids[a:b]) and NEEDLE not in tokenizer.decode(ids[a + 1:b])
    assert NEEDLE not in tokenizer.decode(ids[a:b - 1])
    assert attention.token_span(tokenizer, text, 5, 5) is None and attention.token_span(tokenizer, text, 0, 10**6) is None


def test_capture_without_the_implementation_is_an_error(tiny_model_dir):
    plain, tokenizer = load_tiny(tiny_model_dir)
    with pytest.raises(RuntimeError, match="evalkit_eager"):
        engine.probe(plain, tokenizer, CONTEXTS[:1], max_new_tokens=0, attention=[attention.Request()])


# ---- through `evalkit run --attention` ----------------------------------------------------------


@pytest.fixture(scope="module")
def attention_run(tiny_model_dir, tmp_path_factory):
    import duckdb
    from click.testing import CliRunner

    from evalkit.cli import cli

    db = tmp_path_factory.mktemp("attention_run") / "runs.duckdb"
    result = CliRunner().invoke(
        cli, ["run", "--model", "hf", "--model-args", f"pretrained={tiny_model_dir}", "--device", "cpu",
              "--tasks", "firsttoken_en,needle_en,needle_conflict_en", "--needle-lengths", "160",
              "--needle-depths", "0,1", "--limit", "2", "--attention", "--db", str(db)],
        catch_exceptions=False, env={"HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 0, result.output
    con = duckdb.connect(str(db), read_only=True)
    yield con
    con.close()


def test_the_run_row_says_it_read_attention(attention_run):
    assert attention_run.execute("SELECT attention, attn_implementation FROM runs").fetchall() == [
        (True, attention.IMPLEMENTATION)]


def test_per_layer_rows_and_per_sample_values_agree(attention_run):
    samples = attention_run.execute(
        "SELECT task, doc_id, sink_rate, needle_attn, question_attn FROM samples ORDER BY task, doc_id").fetchall()
    assert [s[0] for s in samples] == ["firsttoken_en"] * 2 + ["needle_conflict_en"] * 2 + ["needle_en"] * 2
    for task, doc_id, sink, needle, question in samples:
        layers = attention_run.execute(
            "SELECT layer, sink_rate, needle_attn, question_attn FROM attention_layers "
            "WHERE task = ? AND doc_id = ? ORDER BY layer", [task, doc_id]).fetchall()
        assert [r[0] for r in layers] == [0, 1]  # the tiny model's two layers
        assert sink == pytest.approx(sum(r[1] for r in layers) / 2)
        assert 0.0 <= sink <= 1.0
        if task == "needle_en":
            assert needle == pytest.approx(sum(r[2] for r in layers) / 2) and 0.0 < needle < 1.0
            assert question is None
        elif task == "firsttoken_en":
            assert question == pytest.approx(sum(r[3] for r in layers) / 2) and 0.0 < question < 1.0
            assert needle is None
        else:  # conflict documents: the sink only
            assert needle is None and question is None
    # the metric means are the samples' means
    for task, metric in (("needle_en", "needle_attn"), ("firsttoken_en", "question_attn"),
                         ("needle_conflict_en", "sink_rate")):
        value = attention_run.execute("SELECT value FROM metrics WHERE task = ? AND metric = ?",
                                      [task, metric]).fetchone()[0]
        mean = attention_run.execute(f"SELECT avg({metric}) FROM samples WHERE task = ?", [task]).fetchone()[0]
        assert value == pytest.approx(mean)


def test_the_views_read_the_run(attention_run):
    sink = attention_run.execute("SELECT layer, n FROM attention_sink ORDER BY layer").fetchall()
    assert sink == [(0, 6), (1, 6)]
    cells = attention_run.execute("SELECT depth, length, n FROM needle_attention ORDER BY depth").fetchall()
    assert cells == [(0.0, 160, 1), (1.0, 160, 1)]
    (row,) = attention_run.execute("SELECT length, n, pairs FROM conflict_table").fetchall()
    assert row == (160, 2, 1)
    picks = attention_run.execute("SELECT conflict_pick, first_wins, last_wins, conflict_both, conflict_order "
                                  "FROM samples WHERE task = 'needle_conflict_en' ORDER BY doc_id").fetchall()
    assert [p[4] for p in picks] == ["ab", "ba"]
    for pick, first, last, both, _ in picks:
        assert pick == {(1, 0, 0): "first", (0, 1, 0): "last", (0, 0, 1): "both", (0, 0, 0): "neither"}[
            (first, last, both)]


def test_install_fixes_the_mmap_threshold_under_glibc():
    """The blocks' large temporaries are given back when freed (glibc); elsewhere nothing is set."""
    import platform
    import sys

    expected = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert attention.fix_mmap_threshold() is expected


def test_only_the_captured_prefill_runs_eager(models, tiny_model_dir, monkeypatch):
    """Outside a capture, evalkit_eager hands the forward to the implementation the model ran
    before (sdpa): the decode steps, the trie and the prior make no weights. With a capture,
    each layer of the one prefill runs the eager function (one block here), and nothing else does."""
    model, _, tokenizer = models
    plain, _ = load_tiny(tiny_model_dir)
    eager_calls = []
    real = attention._eager_of

    def counting(module):
        fn = real(module)

        def eager(*args, **kwargs):
            eager_calls.append(module.layer_idx)
            return fn(*args, **kwargs)
        return eager

    monkeypatch.setattr(attention, "_eager_of", counting)
    base = engine.probe(plain, tokenizer, CONTEXTS[1:2], max_new_tokens=6)
    steps = engine.probe(model, tokenizer, CONTEXTS[1:2], max_new_tokens=6)
    assert eager_calls == []  # no capture: every forward ran sdpa
    assert steps[0].response_ids == base[0].response_ids and torch.equal(steps[0].logprobs, base[0].logprobs)
    steps = engine.probe(model, tokenizer, CONTEXTS[1:2], max_new_tokens=6, attention=requests(tokenizer)[1:2])
    assert eager_calls == list(range(model.config.num_hidden_layers))  # the prefill's layers, once each
    assert steps[0].response_ids == base[0].response_ids and steps[0].attention is not None


def test_an_eager_model_keeps_eager_outside_a_capture(tiny_model_dir):
    """A model that ran eager before install is not handed to sdpa (its mask is eager's to build)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    attention.install(model)
    assert attention._PLAIN[id(model.config)] == "eager" and "eager" not in attention.DELEGATES
