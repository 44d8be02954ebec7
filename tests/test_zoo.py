"""evalkit on real tokenizers: the model zoo (tests/zoo.py) run end to end.

Every model is a tiny peaked random-weight one on a real vocabulary (Llama 2's SentencePiece, Llama 3's
128k BPE, Qwen2's 152k byte-level BPE, Phi-3's, Gemma 4's 262k), beside its permuted-id twin, which
says exactly what its base says through other token ids. What is checked:
- every first-token metric runs on each model, under its chat template (where the tokenizer has one)
  and under `--template plain`;
- ft_hit_prob, answer_prob and opener_mass equal a brute-force teacher-forced computation written
  here (docs/metrics.md §1.1, §1.2), English and Chinese prompts alike;
- each twin against its base: js_div 0, flip rate 0, the gate passes under both rule sets; two
  families against each other: js_div on text (a twin reads the same against a third model as its
  base does), finite;
- the llama.cpp engine on the same weights written into a GGUF: its top-1 and log-probabilities
  agree with transformers'.
Every model's runs go into one DuckDB file per module, made once and shared.
"""

from __future__ import annotations

import json
import math
import re

import duckdb
import pytest
import torch

from evalkit.defaults import DEFAULT_TOLERANCE
from tests import zoo as zoo_module

FAMILIES = zoo_module.FAMILIES
# 12 English and 12 Chinese prompts: enough for the gate's paired tests to decide (the paired
# bootstrap needs 20 prompts), with accepted starts of one and several tokens, checkable answers
# on most and none on a few
PROMPTS = [
    ("What is the capital of France?", ["Paris", "The capital"], ["Paris"], "en"),
    ("What is the capital of Japan?", ["Tokyo"], ["Tokyo"], "en"),
    ("What is 6 times 7?", ["42", "Forty"], ["42", "forty-two"], "en"),
    ("Name the largest planet in the solar system.", ["Jupiter"], ["Jupiter"], "en"),
    ("Who wrote Hamlet?", ["Shakespeare", "William Shakespeare"], ["Shakespeare"], "en"),
    ("What is recursion?", ["Recursion"], None, "en"),
    ("Which gas do plants absorb from the air?", ["Carbon dioxide", "CO2"], ["carbon dioxide", "CO2"], "en"),
    ("How many legs does a spider have?", ["Eight", "8"], ["eight", "8"], "en"),
    ("What colour is the sky on a clear day?", ["Blue"], ["blue"], "en"),
    ("Translate 'bonjour' into English.", ["Hello", "Good morning"], ["hello", "good morning"], "en"),
    ("What is the boiling point of water in Celsius?", ["100"], ["100"], "en"),
    ("Say hello.", ["Hello", "Hi"], None, "en"),
    ("中国的首都是哪里？", ["北京", "中国的首都"], ["北京"], "zh"),
    ("日本的首都是哪里？", ["东京"], ["东京"], "zh"),
    ("六乘以七等于多少？", ["42", "四十二"], ["42", "四十二"], "zh"),
    ("太阳系最大的行星是哪一颗？", ["木星"], ["木星"], "zh"),
    ("《哈姆雷特》的作者是谁？", ["莎士比亚"], ["莎士比亚"], "zh"),
    ("什么是递归？", ["递归"], None, "zh"),
    ("植物从空气中吸收什么气体？", ["二氧化碳"], ["二氧化碳"], "zh"),
    ("蜘蛛有几条腿？", ["八", "8"], ["八", "8"], "zh"),
    ("晴天的天空是什么颜色？", ["蓝色", "蓝"], ["蓝"], "zh"),
    ("请用中文说你好。", ["你好"], ["你好"], "zh"),
    ("水的沸点是多少摄氏度？", ["100", "一百"], ["100", "一百"], "zh"),
    ("法国的首都是哪里？", ["巴黎"], ["巴黎"], "zh"),
]
# the brute force runs in float64 on the model's float32 logits; evalkit's float32 log-softmax and
# its batched, cached forwards differ from it by up to 1.6e-5 relative on these models, whose logits
# are large (bench/zoo.py measures it per vocabulary)
EXACT_RTOL = 1e-4
# llama.cpp against transformers on the same F32 weights and tokens: log-probabilities within this.
# llama.cpp keeps its KV cache in f16, and these models' logits are large (the final norm scaled
# by 40), so its first-step log-probabilities sit up to 0.004 from transformers' (measured on
# phi-3); the real SmolLM2 GGUF agrees to 1e-4 (tests/test_llamacpp.py)
LLAMACPP_ATOL = 0.02


def docs() -> list[dict]:
    out = []
    for i, (prompt, answers, full, lang) in enumerate(PROMPTS):
        doc = {"prompt": prompt, "answers": answers, "lang": lang, "id": f"{lang}-{i:02d}"}
        if full:
            doc["answers_full"] = full
        out.append(doc)
    return out


@pytest.fixture(scope="module")
def zoo_db(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo_runs") / "zoo.duckdb"


SMALL = slice(None, None, 6)  # 4 of the prompts, 2 of them Chinese: the runs every metric is checked on


@pytest.fixture(scope="module")
def zoo_prompts(tmp_path_factory):
    """{"all": the 24 prompts' JSONL, "small": every sixth of them}."""
    folder = tmp_path_factory.mktemp("zoo_prompts")
    files = {}
    for name, chosen in (("all", docs()), ("small", docs()[SMALL])):
        files[name] = folder / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in chosen), encoding="utf-8")
    return files


@pytest.fixture(scope="module")
def zoo_run(zoo, zoo_db, zoo_prompts, invoke):
    """`zoo_run(family, which="base", template=None, small=False)`: the run id of that model ("base" or
    "twin") under `template` (None: the chat template where the tokenizer has one, else plain), run
    once per module into `zoo_db`. `small`: the 4 prompts of SMALL with exact opener_mass
    (tolerance=0, so the brute force can check it); else all 24 prompts at the default tolerance
    (the gate's paired tests need 20). `first_char`: with the first-character distribution
    (first_char_topk)."""
    ids: dict = {}

    def run(family: str, which: str = "base", template: str | None = None, small: bool = False,
            first_char: bool = False) -> str:
        pair = zoo(family)
        if template == "chat" and not pair.chat:
            pytest.skip(f"the {family} tokenizer has no chat template")
        template = template or ("chat" if pair.chat else "plain")
        key = (family, which, template, small, first_char)
        if key not in ids:
            folder = pair.base if which == "base" else pair.twin
            # the answer continuation cut to the response's 16 tokens: a third of the decoding
            args = (f"pretrained={folder},answer_max_tokens=16" + (",tolerance=0" if small else "")
                    + (",first_char=true" if first_char else ""))
            name = f"{family}-{which}-{template}{'-small' if small else ''}{'-fc' if first_char else ''}"
            res = invoke("run", "--model", "hf", "--model-args", args,
                         "--prompts", zoo_prompts["small" if small else "all"], "--template", template,
                         "--device", "cpu", "--name", name, "--db", zoo_db, env={"HF_HUB_OFFLINE": "1"})
            assert res.exit_code == 0, res.output
            ids[key] = re.search(r"^run (\S+)\s+done", res.stdout, re.MULTILINE).group(1)
        return ids[key]

    return run


def query(db, sql: str, params=()):
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()


def first_token_metrics() -> list[str]:
    """Every metric a first-token run on a logprob backend reports (text and distribution levels)."""
    from evalkit.scoring.registry import all_metrics

    return [m.name for m in all_metrics() if m.level in ("text", "distribution") and "{" not in m.name]


# ---- every metric runs ------------------------------------------------------------------------


@pytest.mark.parametrize("template", ["chat", "plain"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_first_token_metric_runs(zoo_run, zoo_db, family, template):
    from evalkit.scoring.registry import get

    run = zoo_run(family, "base", template, small=True)
    values = dict(query(zoo_db, "SELECT metric, value FROM metrics WHERE run_id = ? AND task = 'firsttoken_user'", [run]))
    wanted = [m for m in first_token_metrics() if m != "top3_share"]  # top3_share: sampled backends only
    assert [m for m in wanted if values.get(m) is None] == []
    for m in wanted:
        assert math.isfinite(values[m]), m
    checkable = {d["id"] for d in docs() if d.get("answers_full")}
    rows = query(zoo_db, "SELECT doc_id, metrics FROM samples WHERE run_id = ?", [run])
    assert len(rows) == len(docs()[SMALL])
    for doc_id, blob in rows:
        per = json.loads(blob)
        need = [m for m in wanted if get(m).per_sample
                and (doc_id in checkable or m not in ("answer_hit", "answer_prob", "ft_answer_mismatch"))]
        assert [m for m in need if per.get(m) is None] == [], doc_id
    topk = query(zoo_db, "SELECT doc_id, count(*), sum(exp(logprob)) FROM first_token_topk WHERE run_id = ? "
                 "GROUP BY doc_id", [run])
    assert len(topk) == len(rows)
    assert all(n == 50 and 0 < mass <= 1 + 1e-6 for _, n, mass in topk)


def test_the_models_are_peaked_not_uniform(zoo_run, zoo_db):
    """The final norm's scale makes each first-token distribution peaked: a flat one over 150k
    tokens would make every comparison trivially 0."""
    for family in ("qwen2", "llama-spm"):
        run = zoo_run(family)
        (mass,) = query(zoo_db, "SELECT avg(m) FROM (SELECT sum(exp(logprob)) AS m FROM first_token_topk "
                        "WHERE run_id = ? AND rank < 5 GROUP BY doc_id)", [run])[0]
        assert 0.3 < mass < 0.999, (family, mass)


# ---- the exact metrics against brute force ----------------------------------------------------


def as_fed(tok, text: str) -> list[int]:
    """The ids a model is fed for `text`, lm-eval's HF rule written out: the tokenizer's own special tokens
    (add_special_tokens=True), unless the text already begins with the BOS token's spelling (a chat template
    that writes it, as phi-3's and Llama 3's do): then the text's own ids, the BOS not doubled."""
    spelled = bool(tok.bos_token) and text.startswith(tok.bos_token)
    return tok(text, add_special_tokens=not spelled)["input_ids"]


def in_context(tok, context: str, ctx_ids: list[int], s: str) -> list[int]:
    """`s`'s tokens after `context`: ids(context + s) past ids(context), or ids(s) alone when the
    joint tokenisation does not start with the context's (docs/metrics.md §1.1)."""
    joint = as_fed(tok, context + s)  # as fed: the declared BOS first, once
    if len(joint) > len(ctx_ids) and joint[: len(ctx_ids)] == ctx_ids:
        return joint[len(ctx_ids):]
    return tok(s, add_special_tokens=False)["input_ids"]


def brute_force(model, tok, context: str, strings: list[str]) -> float:
    """P(the response begins with one of `strings`): per distinct string, the product of plain
    softmax terms of its tokens teacher-forced after the context, summed over the strings that
    do not begin (as a whole word or character, and in tokens) with another string of the set.
    One forward of every context + string sequence, right-padded side by side (the padding comes
    after every position read, so the causal model's logits there are the unpadded ones); the
    output head is applied only at the positions read (what `model(ids).logits` computes there,
    without the full (strings x positions x vocabulary) tensor)."""
    from evalkit.scoring.text import covers

    ctx = as_fed(tok, context)  # as fed: the BOS the tokenizer declares first, once
    toks = {s: in_context(tok, context, ctx, s) for s in dict.fromkeys(x for x in strings if x)}
    kept = [s for s in toks
            if not any(o != s and covers(o, s) and toks[s][: len(toks[o])] == toks[o] for o in toks)]
    seqs = [ctx + toks[s] for s in kept]
    width = max(map(len, seqs))
    ids = torch.tensor([q + [0] * (width - len(q)) for q in seqs])
    mask = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs])
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        at = torch.cat([hidden[row, len(ctx) - 1 : len(ctx) - 1 + len(toks[s])] for row, s in enumerate(kept)])
        wanted = torch.tensor([t for s in kept for t in toks[s]])
        terms = []
        for lo in range(0, len(at), 64):  # 64 rows of the vocabulary at a time: Gemma's is 262k wide
            logits = model.lm_head(at[lo : lo + 64]).double()
            chosen = logits.gather(1, wanted[lo : lo + 64, None])[:, 0]
            terms += (chosen - logits.logsumexp(-1)).exp().tolist()
    total, i = 0.0, 0
    for s in kept:
        total += math.prod(terms[i : i + len(toks[s])])
        i += len(toks[s])
    return total


def exact_differences(pair, db, runs: list[str], every: int = 1) -> dict[str, float]:
    """Max relative difference of ft_hit_prob, answer_prob and opener_mass from `brute_force`, per
    metric, over every `every`-th sample (by doc id) of `runs` (runs of `pair`'s base or twin)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evalkit.scoring.firsttoken import answer_strings, candidate_strings
    from evalkit.scoring.lexicon import load_lexicon

    by_id = {d["id"]: d for d in docs()}
    openers = load_lexicon().entries
    worst = {"ft_hit_prob": 0.0, "answer_prob": 0.0, "opener_mass": 0.0}
    for run in runs:
        (name,) = query(db, "SELECT name FROM runs WHERE id = ?", [run])[0]
        folder = pair.twin if "-twin-" in name else pair.base
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tok = AutoTokenizer.from_pretrained(folder)
        rows = query(db, "SELECT doc_id, prompt, metrics FROM samples WHERE run_id = ? ORDER BY doc_id", [run])
        for doc_id, context, blob in rows[::every]:
            doc, got = by_id[doc_id], json.loads(blob)
            expected = {"ft_hit_prob": brute_force(model, tok, context, candidate_strings(doc["answers"])),
                        "opener_mass": brute_force(model, tok, context, openers)}
            if doc.get("answers_full"):
                expected["answer_prob"] = brute_force(model, tok, context, answer_strings(doc["answers_full"]))
            for metric, value in expected.items():
                assert value > 0, (metric, doc_id)
                worst[metric] = max(worst[metric], abs(got[metric] - value) / value)
    return worst


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_metrics_equal_brute_force(zoo, zoo_run, zoo_db, family):
    pair = zoo(family)
    runs = [zoo_run(family, "base", "plain", small=True)]
    if pair.chat:
        runs.append(zoo_run(family, "base", "chat", small=True))
    worst = exact_differences(pair, zoo_db, runs)
    assert all(v <= EXACT_RTOL for v in worst.values()), worst


@pytest.mark.parametrize("family", FAMILIES)
def test_a_twin_scores_what_its_base_scores(zoo_run, zoo_db, family):
    """The twin is the base under another numbering of its tokens: its per-prompt text metrics are the
    base's and its exact ones too, to float rounding (the vocabulary is summed in another order)."""
    rows = {}
    for which in ("base", "twin"):
        run = zoo_run(family, which)
        rows[which] = {d: (r, json.loads(m)) for d, r, m in
                       query(zoo_db, "SELECT doc_id, response, metrics FROM samples WHERE run_id = ?", [run])}
    assert rows["base"].keys() == rows["twin"].keys()
    for doc_id, (response, base) in rows["base"].items():
        twin_response, twin = rows["twin"][doc_id]
        assert twin_response == response, doc_id
        for metric in ("ft_hit", "opener_rate", "answer_hit", "ft_token_hit"):
            assert twin.get(metric) == base.get(metric), (doc_id, metric)
        for metric in ("ft_hit_prob", "answer_prob", "top1_prob", "entropy"):
            if metric in base:
                assert twin[metric] == pytest.approx(base[metric], rel=EXACT_RTOL, abs=1e-12), (doc_id, metric)
        # at the default tolerance opener_mass is exact to within that bound (the trie's pruning)
        assert twin["opener_mass"] == pytest.approx(base["opener_mass"], rel=EXACT_RTOL, abs=DEFAULT_TOLERANCE)


# ---- a twin against its base, two families against each other ---------------------------------


def compare(invoke, db, a: str, b: str) -> dict:
    res = invoke("compare", a, b, "--format", "json", "--db", db)
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def drift_row(out: dict) -> dict:
    return next(r for r in out["drift"] if r["task"] == "all")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_permuted_twin_reads_identical_to_its_base(zoo_run, zoo_db, invoke, family):
    base, twin = zoo_run(family), zoo_run(family, "twin")
    row = drift_row(compare(invoke, zoo_db, base, twin))
    assert row["n"] == len(PROMPTS)
    assert row["js_div"] == pytest.approx(0.0, abs=1e-6)
    assert row["flip_rate"] == 0.0
    assert row["top5_overlap"] == pytest.approx(1.0)
    assert row["top5_mass_a"] == pytest.approx(row["top5_mass_b"], rel=1e-5)


@pytest.mark.parametrize("rules", ["same", "upgrade"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_permuted_twin_passes_the_gate(zoo_run, zoo_db, invoke, family, rules):
    """With the first-character distribution of the whole vocabulary the twin reads what its base reads,
    and the bound on js_div passes too. (On the stored top-k alone, which leaves a random model's rest
    past K undecided, `same` cannot tell a twin from a model that differs there: tests/
    test_tokenizers_compare.py.)"""
    base, twin = zoo_run(family, first_char=True), zoo_run(family, "twin", first_char=True)
    res = invoke("gate", "--candidate", twin, "--baseline", base, "--rules", rules, "--db", zoo_db)
    assert res.exit_code == 0, res.output
    assert "PASS" in res.stdout
    if rules == "same":
        assert "whole next-token distribution" in res.stdout


def test_two_families_compare_on_text(zoo_run, zoo_db, invoke):
    """Qwen2 against Phi-3: js_div finite; and computed on what the tokens say, not on their ids:
    Qwen2's permuted twin reads exactly what Qwen2 reads against Phi-3."""
    phi3 = zoo_run("phi-3")
    row = drift_row(compare(invoke, zoo_db, phi3, zoo_run("qwen2")))
    twin_row = drift_row(compare(invoke, zoo_db, phi3, zoo_run("qwen2", "twin")))
    assert math.isfinite(row["js_div"]) and 0.0 <= row["js_div"] <= 1.0
    assert twin_row["js_div"] == pytest.approx(row["js_div"], abs=1e-6)
    assert twin_row["flip_rate"] == row["flip_rate"]


def test_the_upgrade_rules_decide_two_families_on_quality_alone(zoo_run, zoo_db, invoke):
    res = invoke("gate", "--candidate", zoo_run("qwen2"), "--baseline", zoo_run("phi-3"), "--rules", "upgrade",
                 "--db", zoo_db)
    assert res.exit_code in (0, 1, 3), res.output
    checked = {line.split("|")[4].strip() for line in res.stdout.splitlines()
               if line.startswith("| ") and line.count("|") > 5}
    assert checked and not checked & {"js_div", "top5_overlap", "flip_rate"}, checked


# ---- the llama.cpp engine on the same weights -------------------------------------------------

# two vocabularies whose GGUF holds exactly the tokens of transformers' tokenizer (Llama 3's gains a
# token in transformers' conversion, so its model has one row more than llama.cpp's vocabulary)
LLAMACPP_FAMILIES = ("llama-spm", "phi-3")


@pytest.fixture(scope="module")
def zoo_gguf(zoo, tmp_path_factory):
    pytest.importorskip("llama_cpp")
    paths: dict = {}

    def gguf(family: str):
        if family not in paths:
            pair = zoo(family)
            paths[family] = zoo_module.write_gguf(pair.base, family, tmp_path_factory.mktemp("gguf") / f"{family}.gguf")
        return paths[family]

    return gguf


@pytest.mark.parametrize("family", LLAMACPP_FAMILIES)
def test_llamacpp_agrees_with_transformers_on_the_same_weights(zoo, zoo_gguf, family):
    """Same tokens into both: llama.cpp's (the context tokenised by the GGUF's own vocabulary);
    its first-step top-1 and top-50 log-probabilities against transformers' plain softmax."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evalkit.engines.llamacpp import probe as llamacpp
    from evalkit.engines.llamacpp.firststep import LlamaCppEngine

    pair = zoo(family)
    model = AutoModelForCausalLM.from_pretrained(pair.base).eval()
    tok = AutoTokenizer.from_pretrained(pair.base)
    contexts = [d["prompt"] for d in docs()[::3]]  # English and Chinese
    eng = LlamaCppEngine(str(zoo_gguf(family)), n_ctx=512, n_threads=1)  # one thread: no busy-wait on shared cores
    try:
        steps = llamacpp.probe(eng, contexts, top_k=50, max_new_tokens=0)
        same_tokens = sum(s.context_ids == tok(c, add_special_tokens=True)["input_ids"] for s, c in zip(steps, contexts))
    finally:
        eng.close()
    for step in steps:
        with torch.no_grad():
            lp = model(torch.tensor([step.context_ids])).logits[0, -1].double().log_softmax(-1)
        assert step.topk_ids[0] == int(lp.argmax())
        assert max(abs(a - float(lp[t])) for t, a in zip(step.topk_ids, step.topk_logprobs)) < LLAMACPP_ATOL
    # the two tokenizers (transformers' conversion, llama.cpp's own) agree on most of these contexts
    assert same_tokens >= len(contexts) - 1, (family, same_tokens)


def test_llamacpp_run_matches_the_hf_run(zoo_gguf, zoo_run, zoo_db, zoo_prompts, invoke):
    """`evalkit run --model llamacpp` on the GGUF and `--model hf` on the folder: the same first token
    with the same log-probability on every prompt both tokenise alike."""
    family = "llama-spm"
    hf = zoo_run(family, "base", "plain")
    res = invoke("run", "--model", "llamacpp", "--model-args", f"model={zoo_gguf(family)},n_threads=1,answer_max_tokens=16", "--prompts",
                 zoo_prompts["all"], "--template", "plain",
                 "--name", f"{family}-llamacpp-plain", "--db", zoo_db, env={"HF_HUB_OFFLINE": "1"})
    assert res.exit_code == 0, res.output
    cpp = re.search(r"^run (\S+)\s+done", res.stdout, re.MULTILINE).group(1)
    top = "SELECT doc_id, token_id, logprob FROM first_token_topk WHERE run_id = ? AND rank = 0"
    a, b = dict((d, (t, lp)) for d, t, lp in query(zoo_db, top, [hf])), dict(
        (d, (t, lp)) for d, t, lp in query(zoo_db, top, [cpp]))
    assert a.keys() == b.keys()
    agree = [d for d in a if a[d][0] == b[d][0] and abs(a[d][1] - b[d][1]) < LLAMACPP_ATOL]
    assert len(agree) >= len(a) - 2, {d: (a[d], b[d]) for d in a if d not in agree}

