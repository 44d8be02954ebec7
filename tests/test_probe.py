"""The lm-eval model `evalkit-hf` on the tiny random Llama, against plain forwards computed here.

In process: lm-eval-like `generate_until` requests into `EvalkitHFLM`, whose dicts must agree with
an independent product of `softmax(model(ids).logits)` terms, batched or not, banned openers or not.
Through the CLI: what a `--model hf` run stores.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import duckdb
import pytest
import torch
from click.testing import CliRunner
from lm_eval.api.instance import Instance

from evalkit.engines.transformers.model import EvalkitHFLM
from evalkit.cli import cli
from evalkit.contract import FirstStepResult
from evalkit.scoring.lexicon import load_lexicon
from tests.tiny import load_tiny

DATA = Path(__file__).resolve().parents[1] / "tasks" / "firsttoken" / "data"
# two prompts of each language, and on en-0007 and zh-0010 the tiny model's argmax begins an opener
DOC_IDS = ["en-0001", "en-0002", "en-0007", "zh-0001", "zh-0002", "zh-0010"]
DOCS = sorted(
    ({"kind": "firsttoken", **doc} for path in DATA.glob("firsttoken_*.jsonl") for line in path.read_text(encoding="utf-8").splitlines()
     if line.strip() and (doc := json.loads(line))["id"] in DOC_IDS),
    key=lambda doc: DOC_IDS.index(doc["id"]),
)
GEN = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}
K = 50


# ---- the independent reference -----------------------------------------------------------------


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def last_logprobs(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def string_probs(model, tokenizer, context, strings) -> dict[str, float]:
    """P(response starts with s) = product of the softmax terms of s's tokens after the context,
    with s tokenised together with the context. Plain forwards, no cache; the strings go in one
    right-padded batch (causal attention: padding after a token cannot change its logits)."""
    ctx = ids_of(tokenizer, context)
    fulls = [ids_of(tokenizer, context + s) for s in strings]
    for s, full in zip(strings, fulls):
        assert full[: len(ctx)] == ctx and len(full) > len(ctx), s
    width = max(len(f) for f in fulls)
    batch = torch.tensor([f + [tokenizer.pad_token_id] * (width - len(f)) for f in fulls])
    with torch.no_grad():
        probs = torch.softmax(model(batch).logits.float(), dim=-1)  # (strings, width, V)
    out = {}
    for row, (s, full) in enumerate(zip(strings, fulls)):
        p = 1.0
        for i in range(len(ctx), len(full)):
            p *= float(probs[row, i - 1, full[i]])
        out[s] = p
    return out


def summed(strings, tokenizer=None, context=None):
    """docs/metrics.md §1.2, restated independently: a string is left out of a sum when another string of the
    set begins it as whole words (as characters, for Chinese) and, given a tokenizer, the other's
    tokens after the context are a prefix of its own (then its mass is already counted)."""
    def cjk(ch):
        return "\u4e00" <= ch <= "\u9fff"

    def word_start(o, s):
        return s.startswith(o) and (len(s) == len(o) or cjk(o[-1]) or not (s[len(o)].isalnum() or cjk(s[len(o)])))

    def toks(x):
        ctx = ids_of(tokenizer, context)
        return ids_of(tokenizer, context + x)[len(ctx):]

    uniq = list(dict.fromkeys(strings))
    return [s for s in uniq if not any(
        o != s and word_start(o, s) and (tokenizer is None or toks(s)[: len(toks(o))] == toks(o)) for o in uniq)]


def answer_strings(answers, tokenizer=None, context=None):
    """docs/metrics.md §1.1: the whole start when it holds CJK, its first word otherwise; then `summed`."""
    out = []
    for a in answers:
        cjk = any("\u4e00" <= ch <= "\u9fff" for ch in a)
        out.append(a if cjk else a.split()[0])
    return summed(out, tokenizer, context)


def opener_strings(tokenizer=None, context=None):
    """docs/metrics.md §1.2: every lexicon entry, less those another entry covers (see `summed`)."""
    return summed(load_lexicon().entries, tokenizer, context)


def opener_initial_ids(tokenizer, context) -> set[int]:
    """First token of each opener (with and without a leading space) tokenised after the context."""
    ctx = ids_of(tokenizer, context)
    out = set()
    for entry in load_lexicon().entries:
        for text in (entry, " " + entry):
            full = ids_of(tokenizer, context + text)
            assert full[: len(ctx)] == ctx
            out.add(full[len(ctx)])
    return out


# ---- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are far too small to share between threads; on a busy 2-core machine
    OpenMP's barriers make each one ~100x slower with two threads than with one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_tiny(tiny_model_dir)


@pytest.fixture(scope="module")
def contexts(tiny):
    _, tokenizer = tiny
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": d["prompt"]}], tokenize=False, add_generation_prompt=True
        )
        for d in DOCS
    ]


@pytest.fixture(scope="module")
def docs(tiny, contexts):
    """The task docs plus one answer the model finds likely (its argmax token's text), so that
    ft_hit_prob is compared on a sizeable probability and not only on tiny ones."""
    model, tokenizer = tiny
    out = []
    for doc, context in zip(DOCS, contexts):
        top = torch.topk(last_logprobs(model, ids_of(tokenizer, context)), 20).indices.tolist()
        likely = next(
            text for t in top
            if (text := tokenizer.decode([t]).strip()) and "\ufffd" not in text and " " not in text
            and text.isprintable()
        )
        out.append({**doc, "answers": doc["answers"] + [likely]})
    return out


def requests_for(docs, contexts):
    return [
        Instance("generate_until", doc, (context, dict(GEN)), i, metadata=("firsttoken_test", i, 1))
        for i, (doc, context) in enumerate(zip(docs, contexts))
    ]


def make_lm(tiny_model_dir, **kwargs):
    return EvalkitHFLM(pretrained=str(tiny_model_dir), device="cpu", tolerance=0, **kwargs)


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return make_lm(tiny_model_dir, batch_size=4)


@pytest.fixture(scope="module")
def batched(lm, docs, contexts):
    return lm.generate_until(requests_for(docs, contexts), disable_tqdm=True)


@pytest.fixture(scope="module")
def unbatched(tiny_model_dir, docs, contexts):
    lm = make_lm(tiny_model_dir, batch_size=1)
    return lm.generate_until(requests_for(docs, contexts), disable_tqdm=True)


@pytest.fixture(scope="module")
def banned(tiny_model_dir, docs, contexts):
    lm = make_lm(tiny_model_dir, batch_size=4, ban_openers=True)
    return lm.generate_until(requests_for(docs, contexts), disable_tqdm=True)


# ---- in process -------------------------------------------------------------------------------------


def test_result_shape(batched):
    assert len(batched) == len(DOCS)
    for res in batched:
        assert isinstance(res, FirstStepResult)
        assert set(res.metrics) >= {"ft_hit_prob", "opener_mass", "ft_token_hit", "prior_drift", "top3_mass",
                                       "unstable", "entropy"}
        assert len(res.topk) == K


def test_answers_that_extend_another_are_not_counted_twice(tiny, lm, contexts):
    """["Prime", "Primes"]: "Primes" starts with "Prime", so P(starts with "Prime") is the whole of ft_hit_prob."""
    model, tokenizer = tiny
    doc = {"kind": "firsttoken", "id": "en-prime", "prompt": "Name a kind of number.", "answers": ["Prime", "Primes", "prime"]}
    (res,) = lm.generate_until(requests_for([doc], contexts[:1]), disable_tqdm=True)
    probs = string_probs(model, tokenizer, contexts[0], ["Prime", "Primes", "prime"])
    assert probs["Primes"] > 0
    assert res.metrics["ft_hit_prob"] == pytest.approx(probs["Prime"] + probs["prime"], abs=1e-6)


def test_ft_hit_prob_and_opener_mass_match_plain_softmax_product(tiny, docs, contexts, batched):
    model, tokenizer = tiny
    openers = opener_strings()
    assert len(openers) > 50
    sizeable = 0
    for doc, context, res in zip(docs, contexts, batched):
        answers = answer_strings(doc["answers"], tokenizer, context)
        expected_hit = sum(string_probs(model, tokenizer, context, answers).values())
        expected_opener = sum(string_probs(model, tokenizer, context, opener_strings(tokenizer, context)).values())
        got_hit, got_opener = res.metrics["ft_hit_prob"], res.metrics["opener_mass"]
        assert got_hit == pytest.approx(expected_hit, abs=1e-5), doc["id"]
        assert math.log(got_hit) == pytest.approx(math.log(expected_hit), abs=1e-4), doc["id"]
        assert got_opener == pytest.approx(expected_opener, abs=1e-5), doc["id"]
        assert math.log(got_opener) == pytest.approx(math.log(expected_opener), abs=1e-4), doc["id"]
        sizeable += expected_hit > 1e-2
    assert sizeable >= 3  # the comparison is not only on near-zero numbers


def test_answer_prob_matches_plain_softmax_product(tiny, lm, docs, contexts):
    """answer_prob (docs/metrics.md §1.7): the checkable answers whole, as given and capitalised, each a
    plain product of softmax terms, summed over those no other covers; one answer the model finds
    likely, so the sum is not only near-zero numbers, and one of several words."""
    model, tokenizer = tiny
    likely = docs[0]["answers"][-1]
    full = [likely.lower(), "forty two", likely + " and more", "巴黎"]
    doc = {**docs[0], "answers_full": full}
    (res,) = lm.generate_until(requests_for([doc], contexts[:1]), disable_tqdm=True)
    strings = list(dict.fromkeys(x for a in full for x in (a, a[0].upper() + a[1:])))
    kept = summed(strings, tokenizer, contexts[0])
    assert likely + " and more" not in kept or likely not in kept
    expected = sum(string_probs(model, tokenizer, contexts[0], kept).values())
    assert expected > 1e-3
    assert res.metrics["answer_prob"] == pytest.approx(expected, abs=1e-5)
    assert math.log(res.metrics["answer_prob"]) == pytest.approx(math.log(expected), abs=1e-4)
    # ft_hit_prob still sums the accepted starts alone
    starts = answer_strings(doc["answers"], tokenizer, contexts[0])
    assert res.metrics["ft_hit_prob"] == pytest.approx(sum(string_probs(model, tokenizer, contexts[0], starts).values()),
                                                       abs=1e-5)


def test_no_answer_prob_without_checkable_answers(batched, docs):
    for doc, res in zip(docs, batched):
        assert ("answer_prob" in res.metrics) == bool(doc.get("answers_full")), doc["id"]


def test_topk_and_first_step_metrics_match_plain_forward(tiny, contexts, batched):
    model, tokenizer = tiny
    for context, res in zip(contexts, batched):
        lp = last_logprobs(model, ids_of(tokenizer, context))
        probs = torch.softmax(lp, dim=-1)
        top = torch.topk(probs, K)
        assert [t for t, _, _ in res.topk] == top.indices.tolist()
        assert [math.exp(lp_) for _, _, lp_ in res.topk] == pytest.approx(top.values.tolist(), abs=1e-5)
        assert [text for _, text, _ in res.topk] == [
            tokenizer.decode([t], skip_special_tokens=False) for t in top.indices.tolist()
        ]
        assert res.entropy == pytest.approx(float(-(probs * lp).sum()), abs=1e-4)
        top3_at_t = float(torch.topk(torch.softmax(lp / 0.8, dim=-1), 3).values.sum())
        assert res.metrics["top3_mass"] == pytest.approx(top3_at_t, abs=1e-5)
        assert res.metrics["unstable"] == (1.0 if top3_at_t < 0.7 else 0.0)
        assert res.first_token_id == top.indices[0].item()
        assert 0.0 <= res.metrics["prior_drift"] <= 1.0


def special_topk_entries(tokenizer, results):
    special = set(tokenizer.all_special_ids)
    return [(t, text) for res in results for t, text, _ in res.topk if t in special]


def test_special_tokens_reach_the_topk(tiny, batched):
    # the precondition of the test below: <|im_start|> / <|im_end|> are among the tiny model's top 50
    assert special_topk_entries(tiny[1], batched)


def test_topk_text_names_special_tokens(tiny, batched):
    _, tokenizer = tiny
    for token_id, text in special_topk_entries(tokenizer, batched):
        assert text == tokenizer.convert_ids_to_tokens(token_id)


def test_ft_token_hit(tiny, docs, contexts, batched):
    _, tokenizer = tiny
    for doc, context, res in zip(docs, contexts, batched):
        ctx = ids_of(tokenizer, context)
        firsts = {ids_of(tokenizer, context + a)[len(ctx)] for a in answer_strings(doc["answers"])}
        assert res.metrics["ft_token_hit"] == (1.0 if res.first_token_id in firsts else 0.0)
    # the model's own argmax is among the answers of at least one doc (see `docs`)
    assert any(res.metrics["ft_token_hit"] == 1.0 for res in batched)


def test_text_is_the_greedy_continuation(tiny, contexts, batched):
    model, tokenizer = tiny
    for context, res in zip(contexts, batched):
        ids = ids_of(tokenizer, context)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=GEN["max_gen_toks"],
                                 pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True).split("\n\n")[0]
        assert res.text == text


def test_first_unit_is_whole(batched):
    for doc, res in zip(DOCS, batched):
        unit = res.first_unit
        assert "\ufffd" not in unit, doc["id"]
        assert unit == unit.strip()
        if unit:
            assert res.text.lstrip().startswith(unit), doc["id"]


def test_batched_and_unbatched_agree(batched, unbatched):
    for a, b in zip(batched, unbatched):
        assert a.text == b.text and a.first_unit == b.first_unit
        assert a.first_token_id == b.first_token_id
        assert [t for t, _, _ in a.topk] == [t for t, _, _ in b.topk]
        # float32 noise of a left-padded batch: 1e-5 in probability, a few ulps in log space
        probs_a, probs_b = ([math.exp(lp) for _, _, lp in r.topk] for r in (a, b))
        assert probs_a == pytest.approx(probs_b, abs=1e-5)
        assert [lp for _, _, lp in a.topk] == pytest.approx([lp for _, _, lp in b.topk], rel=1e-5)
        assert a.metrics.keys() == b.metrics.keys()
        for name in a.metrics:
            assert a.metrics[name] == pytest.approx(b.metrics[name], abs=1e-5), name
        assert math.log(a.metrics["ft_hit_prob"]) == pytest.approx(math.log(b.metrics["ft_hit_prob"]), abs=1e-4)


def test_ban_openers_changes_only_the_first_token(tiny, contexts, batched, banned):
    _, tokenizer = tiny
    changed = 0
    for context, free, ban in zip(contexts, batched, banned):
        initial = opener_initial_ids(tokenizer, context)
        assert len(initial) > 10
        # the distribution and every distribution-level metric are the model's own
        assert [t for t, _, _ in ban.topk] == [t for t, _, _ in free.topk]
        assert [lp for _, _, lp in ban.topk] == pytest.approx([lp for _, _, lp in free.topk], abs=1e-6)
        for name in free.metrics:
            assert ban.metrics[name] == pytest.approx(free.metrics[name], abs=1e-6), name
        # the chosen first token is the most likely one that does not begin an opener
        assert ban.first_token_id not in initial
        assert ban.first_token_id == next(t for t, _, _ in free.topk if t not in initial)
        changed += free.first_token_id in initial
    assert changed >= 1  # on some prompt the free argmax did begin an opener


def test_plain_template_context(lm, docs):
    """The plain template: the context is the prompt itself, with no chat markup around it, so the
    content-free prior's frame is empty (its "" input leaves nothing to condition on)."""
    doc = docs[0]
    (res,) = lm.generate_until(requests_for([doc], [doc["prompt"]]), disable_tqdm=True)
    assert 0.0 <= res.metrics["prior_drift"] <= 1.0
    assert len(res.topk) == K


# ---- through the CLI ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_run(tiny_model_dir, tmp_path_factory):
    db = tmp_path_factory.mktemp("probe_cli") / "tiny.duckdb"
    result = CliRunner().invoke(
        cli,
        ["run", "--model", "hf", "--model-args", f"pretrained={tiny_model_dir}", "--device", "cpu",
         "--tasks", "firsttoken", "--limit", "3", "--ban-openers", "--db", str(db)],
        catch_exceptions=False,
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert result.exit_code == 0, result.output
    con = duckdb.connect(str(db), read_only=True)
    yield con
    con.close()


def test_cli_run_row(cli_run, tiny_model_dir):
    (row,) = cli_run.execute(
        "SELECT status, model, model_args, model_fingerprint, top_k, ban_openers, template FROM runs"
    ).fetchall()
    status, model, model_args, fingerprint, top_k, ban, template = row
    assert status == "done" and model == "hf" and template == "chat"
    assert json.loads(model_args)["pretrained"] == str(tiny_model_dir)
    assert json.loads(model_args)["trust_remote_code"] is False
    assert fingerprint.startswith("sha256:") and len(fingerprint) == 7 + 64
    assert top_k == K and ban is True


def test_cli_stores_topk_rows(cli_run):
    rows = cli_run.execute(
        "SELECT task, doc_id, count(*), min(rank), max(rank), count(DISTINCT token_id), sum(exp(logprob)) "
        "FROM first_token_topk GROUP BY task, doc_id ORDER BY task, doc_id"
    ).fetchall()
    assert len(rows) == 6
    for task, doc_id, n, lo, hi, distinct, mass in rows:
        assert n >= 50 and lo == 0 and hi == n - 1 and distinct == n, (task, doc_id)
        assert 0.0 < mass <= 1.0 + 1e-6
    descending = cli_run.execute(
        "SELECT count(*) FROM (SELECT logprob - lead(logprob) OVER (PARTITION BY task, doc_id ORDER BY rank) AS d "
        "FROM first_token_topk) WHERE d < 0"
    ).fetchone()[0]
    assert descending == 0


def test_cli_first_token_is_the_best_non_opener(cli_run, tiny):
    """--ban-openers: the stored distribution is the model's own; the chosen first token is its
    most likely token that does not begin an opener after the stored prompt (on these six prompts
    that is the top-1 itself; the in-process test above covers prompts where the ban bites)."""
    _, tokenizer = tiny
    samples = cli_run.execute("SELECT task, doc_id, prompt, first_token_id FROM samples").fetchall()
    assert len(samples) == 6
    for task, doc_id, prompt, first_id in samples:
        ranked = [r[0] for r in cli_run.execute(
            "SELECT token_id FROM first_token_topk WHERE task = ? AND doc_id = ? ORDER BY rank", [task, doc_id]
        ).fetchall()]
        initial = opener_initial_ids(tokenizer, prompt)
        assert first_id not in initial
        assert first_id == next(t for t in ranked if t not in initial), doc_id


def test_cli_stores_per_sample_values(cli_run):
    cur = cli_run.execute(
        "SELECT task, doc_id, ft_hit_prob, opener_mass, prior_drift, top3_mass, ft_token_hit, ft_hit, opener_rate, "
        "entropy, first_unit, first_token, response, ft_outcome, metrics, answer_prob FROM samples ORDER BY task, doc_id"
    )
    cols = [d[0] for d in cur.description]
    samples = [dict(zip(cols, r)) for r in cur.fetchall()]
    assert len(samples) == 6
    for s in samples:
        for name in ("ft_hit_prob", "opener_mass", "prior_drift", "top3_mass"):
            assert s[name] is not None and 0.0 <= s[name] <= 1.0, (s["doc_id"], name)
        assert s["ft_token_hit"] in (0.0, 1.0) and s["ft_hit"] in (0.0, 1.0)
        assert s["entropy"] > 0
        assert s["ft_outcome"] in ("hit", "opener", "other")
        assert "\ufffd" not in s["first_unit"]
        assert s["response"] is not None and s["first_token"] is not None
        stored = json.loads(s["metrics"])
        assert stored["ft_hit_prob"] == pytest.approx(s["ft_hit_prob"])
        assert stored["opener_mass"] == pytest.approx(s["opener_mass"])
        assert stored.get("answer_prob") == s["answer_prob"]  # its column, NULL where no answer is checkable
    assert sum(s["answer_prob"] is not None for s in samples) >= 2
    assert [s["task"] for s in samples] == ["firsttoken_en"] * 3 + ["firsttoken_zh"] * 3


def test_cli_metric_means(cli_run):
    for task in ("firsttoken_en", "firsttoken_zh"):
        for metric in ("ft_hit_prob", "opener_mass", "prior_drift", "top3_mass", "ft_hit", "opener_rate"):
            value, n = cli_run.execute(
                "SELECT value, n FROM metrics WHERE task = ? AND metric = ?", [task, metric]
            ).fetchone()
            mean = cli_run.execute(f"SELECT avg({metric}) FROM samples WHERE task = ?", [task]).fetchone()[0]
            assert n == 3
            assert value == pytest.approx(mean, abs=1e-9), (task, metric)
