"""Runs on different tokenizers: the tokenizer identity, compare and the gate on what tokens say
(docs/metrics.md "Across tokenizers"), the K cut, a missing side, and the two shipped rule sets.

Runs are written straight into the DB; tokenizers are built in-process with `tokenizers`."""

from __future__ import annotations

import math
import random

import pytest

from evalkit.compare import compare_runs, prompt_drift
from evalkit.errors import BadInput
from evalkit.release.db import gate_runs
from evalkit.release.rules import DEFAULT_RULES, load_rules, parse_rules
from evalkit.scoring import registry, textspace
from evalkit.store import runs

# texts a first token may add: whole words, cut words, CJK, whitespace, a byte fragment
TEXTS = [" Paris", " Par", " London", " Lon", "Sure", " Well", "中", "中国", "好的", "\n", " ", "\ufffd",
         " Berlin", " Rome", " Tokyo", "Yes", " No", "The", " the", "A"]
N_PROMPTS = 24
TASK = "firsttoken_en"


def _dist(rng: random.Random, k: int) -> list[tuple[int, float]]:
    """k distinct text indices with peaked probabilities summing to less than 1 (a rest bucket)."""
    picks = rng.sample(range(len(TEXTS)), k)
    w = sorted((rng.random() ** 4 for _ in picks), reverse=True)
    total = sum(w) / rng.uniform(0.7, 0.95)
    return [(i, x / total) for i, x in zip(picks, w)]


def distributions(seed: int = 7, k: int = 8) -> dict[tuple[str, str], list[tuple[int, float]]]:
    rng = random.Random(seed)
    return {(TASK, f"d{i}"): _dist(rng, k) for i in range(N_PROMPTS)}


def store(run_id: str, dists, *, vocab: dict[int, int] | None = None, tokenizer: str | None = None,
          fingerprint: str | None = None, top_k: int | None = None, created: str = "2025-01-01 00:00:00",
          texts: list[str] = TEXTS, topk: bool = True, metrics=None) -> str:
    """Store a run whose prompt (task, doc) puts probability p on TEXTS[i] for each (i, p) of dists;
    `vocab`: text index -> token id (default: the index itself)."""
    vocab = vocab or {i: i for i in range(len(texts))}
    runs.insert_run(None, {"id": run_id, "created_at": created, "status": "running", "model": "synthetic",
                           "tokenizer_hash": tokenizer, "model_fingerprint": fingerprint,
                           "top_k": top_k if top_k is not None else (len(next(iter(dists.values()))) if topk else None)})
    samples = [{"run_id": run_id, "task": t, "doc_id": d, **(metrics(t, d) if metrics else
                {"ft_hit": float(int(d[1:]) % 2), "ft_hit_prob": 0.1 + 0.01 * int(d[1:])})} for (t, d) in dists]
    rows = [{"run_id": run_id, "task": t, "doc_id": d, "rank": r, "token_id": vocab[i], "token": texts[i],
             "unit": "中" if texts[i] == "\ufffd" else None, "logprob": math.log(p)}
            for (t, d), toks in dists.items() for r, (i, p) in enumerate(toks)] if topk else []
    runs.finish_run(None, run_id, metrics=[], samples=samples, topk=rows, status="done")
    return run_id


def permutation(seed: int = 3) -> dict[int, int]:
    ids = list(range(len(TEXTS)))
    random.Random(seed).shuffle(ids)
    return {i: 1000 + ids[i] for i in range(len(TEXTS))}


def by_id_means(a, b) -> dict[str, float]:
    """What evalkit computed before it told tokenizers apart: every prompt compared by token id."""
    out = {"js_div": 0.0, "flipped": 0.0, "top5_overlap": 0.0}
    for key in a:
        d = prompt_drift(([i for i, _ in a[key][0]], [math.log(p) for _, p in a[key][0]]),
                         ([i for i, _ in b[key][0]], [math.log(p) for _, p in b[key][0]]))
        for m in out:
            out[m] += d[m] / len(a)
    return out


# --- the event space ------------------------------------------------------------------------


def test_event_is_the_first_visible_character_and_bytes_go_by_their_lead_byte():
    assert {textspace.event(t) for t in (" Paris", " Par", "Paris", "\tPar")} == {"P"}
    assert textspace.event("\n") == textspace.event("") == textspace.WHITESPACE
    assert textspace.event("\ufffd", unit="中") == "byte:E4" != textspace.event("中")  # conservative, documented
    assert textspace.event("\ufffd", unit=None) == textspace.BYTE_UNKNOWN


def test_merge_does_not_depend_on_list_order():
    toks = [textspace.TopToken(t, None, math.log(p)) for t, p in ((" Par", 0.1), (" Paris", 0.2), (" Lo", 0.3),
                                                                   ("P", 0.05), (" L", 0.15))]
    assert textspace.merge(toks) == textspace.merge(toks[::-1])


# --- compare -------------------------------------------------------------------------------


def test_permuted_twin_reads_zero_on_text_and_was_wrong_by_id():
    d = distributions()
    a = store("base-1", d, tokenizer="h-base")
    b = store("twin-1", d, vocab=permutation(), tokenizer="h-twin", created="2025-01-02 00:00:00")
    c = compare_runs(None, a, b)
    row = c.drift[-1]
    assert (row.js_div, row.flip_rate, row.top5_overlap, row.space) == (0.0, 0.0, 1.0, "first_char")
    assert "different tokenizers" in c.tokenizers and "first non-whitespace character" in c.drift_note
    before = by_id_means({k: (v,) for k, v in d.items()},
                         {k: ([(permutation()[i], p) for i, p in v],) for k, v in d.items()})
    assert before["js_div"] > 0.5 and before["flipped"] == pytest.approx(1.0) and before["top5_overlap"] == 0.0


def test_permuted_twin_without_stored_hashes_is_told_apart_by_its_texts():
    d = distributions()
    a = store("base-2", d)
    b = store("twin-2", d, vocab=permutation(), created="2025-01-02 00:00:00")
    c = compare_runs(None, a, b)
    assert c.drift[-1].js_div == 0.0 and c.drift[-1].space == "first_char"
    assert "tokenizer unknown" in c.tokenizers


def test_colliding_ids_with_different_texts_are_not_identical():
    d = distributions()
    other = [t.strip().upper() + "x" if t.strip() else "!" for t in TEXTS]  # same ids, other texts
    a = store("base-3", d, tokenizer="h-a")
    b = store("other-3", d, tokenizer="h-b", texts=other, created="2025-01-02 00:00:00")
    c = compare_runs(None, a, b)
    assert c.drift[-1].js_div > 0.05 and c.drift[-1].space == "first_char"
    # the same without hashes: token 0 is " Paris" in one run and "PARISx" in the other
    a2 = store("base-4", d)
    b2 = store("other-4", d, texts=other, created="2025-01-02 00:00:00")
    c2 = compare_runs(None, a2, b2)
    assert c2.drift[-1].js_div > 0.05 and "the text" in c2.tokenizers


def test_same_tokenizer_compares_by_id_as_before():
    d, d2 = distributions(1), distributions(2)
    a = store("base-5", d, tokenizer="h")
    b = store("cand-5", d2, tokenizer="h", created="2025-01-02 00:00:00")
    c = compare_runs(None, a, b)
    before = by_id_means({k: (v,) for k, v in d.items()}, {k: (v,) for k, v in d2.items()})
    assert c.drift[-1].space == "token_id" and c.drift[-1].js_div == pytest.approx(before["js_div"], abs=1e-15)


def test_different_k_is_cut_to_the_shorter_and_says_so():
    d3 = distributions(k=3)
    d1 = {k: v[:1] for k, v in d3.items()}  # the same distribution served with K = 1
    a = store("base-6", d3, tokenizer="h")
    b = store("cand-6", d1, tokenizer="h", created="2025-01-02 00:00:00")
    c = compare_runs(None, a, b)
    assert c.drift[-1].js_div == 0.0 and c.drift[-1].k == 1
    assert "cut to the shorter K = 1" in c.drift_note


def test_missing_side_is_named_metric_missing():
    d = distributions()
    a = store("base-7", d, tokenizer="h")
    b = store("text-7", d, tokenizer="h", topk=False, created="2025-01-02 00:00:00")
    c = compare_runs(None, a, b)
    assert c.drift == [] and "metric missing" in c.drift_note and "text-7" in c.drift_note


# --- the gate ----------------------------------------------------------------------------


@pytest.mark.parametrize("rules", ["same", "upgrade"])
def test_permuted_twin_on_the_stored_top_k(rules):
    """A permuted twin reads js_div 0 on the stored top-k. Its rest past K (5 to 30 % here), whitespace
    and fragment tokens are undecided there: under `same` the bound on js_div does not pass, so the gate
    is inconclusive and says why (it passed on the point value before the bound); `upgrade` has no js_div."""
    d = distributions()
    a = store(f"base-g{rules}", d, tokenizer="h-base", fingerprint="f-base")
    b = store(f"twin-g{rules}", d, vocab=permutation(), tokenizer="h-twin", fingerprint="f-twin",
              created="2025-01-02 00:00:00")
    result = gate_runs(None, b, a, rules)
    assert f"built-in rules '{rules}'" in result.markdown
    js = [r for r in result.verdict.rows if r.metric == "js_div"]
    assert (len(js), js[0].drop if js else None) == ((1, 0.0) if rules == "same" else (0, None))
    if rules == "upgrade":
        assert result.outcome == "pass", result.markdown
        return
    assert (result.outcome, js[0].status) == ("inconclusive", "inconclusive"), result.markdown
    assert "the mass the stored events leave undecided allows" in js[0].reason
    # different models under `same`: the verdict says how to ask the other question
    assert "--rules upgrade" in result.markdown and result.note
    assert "first non-whitespace character" in result.markdown


def test_a_twin_whose_top_k_decides_its_first_characters_passes():
    """The bound passes where the stored top-k leaves almost nothing undecided: whole characters only,
    99.9 % of the mass listed. The same twin with its rest at 10 % does not."""
    words = [" Paris", " London", "Sure", "中国", " Berlin", "Yes", "The", "A"]
    perm = {i: (i * 5 + 3) % 8 for i in range(8)}
    for rest, want in ((0.001, "pass"), (0.10, "inconclusive")):
        d = {}  # each prompt's listed mass scaled to leave a rest of about `rest` (0.5x to 1.5x), all definite
        rng = random.Random(5)
        for n in range(N_PROMPTS):
            left = rest * (0.5 + n / N_PROMPTS)
            w = sorted((rng.random() ** 4 + 1e-3 for _ in words), reverse=True)
            d[(TASK, f"d{n}")] = [(i, x * (1 - left) / sum(w)) for i, x in enumerate(w)]
        a = store(f"base-dec{rest}", d, tokenizer="h-base", texts=words)
        b = store(f"twin-dec{rest}", d, vocab=perm, tokenizer="h-twin", texts=words, created="2025-01-02 00:00:00")
        result = gate_runs(None, b, a, "same")
        row = next(r for r in result.verdict.rows if r.metric == "js_div")
        assert row.status == want, row.reason
        want_hi = sum(rest * (0.5 + n / N_PROMPTS) for n in range(N_PROMPTS)) / N_PROMPTS
        assert compare_runs(None, a, b).drift[-1].js_hi == pytest.approx(want_hi, rel=1e-6)


def test_missing_top_k_fails_js_div_under_same_and_not_under_upgrade():
    d = distributions()
    a = store("base-m", d, tokenizer="h")
    b = store("text-m", d, tokenizer="h", topk=False, created="2025-01-02 00:00:00")
    same = gate_runs(None, b, a, "same")
    row = next(r for r in same.verdict.rows if r.metric == "js_div")
    assert same.outcome == "fail" and row.status == "fail"
    assert row.reason.startswith("metric missing") and "text-m" in row.reason and "neither" not in row.reason
    assert gate_runs(None, b, a, "upgrade").outcome == "pass"
    # the baseline without a top-k fails the same way, naming the baseline
    back = gate_runs(None, a, b, "same")
    assert back.outcome == "fail" and "text-m" in next(r for r in back.verdict.rows if r.metric == "js_div").reason


def test_different_families_decide_on_quality_under_upgrade():
    d, d2 = distributions(1), distributions(2)
    other = [t + "!" for t in TEXTS]
    a = store("fam-a", d, tokenizer="h-a", fingerprint="fa")
    b = store("fam-b", d2, tokenizer="h-b", fingerprint="fb", texts=other, created="2025-01-02 00:00:00")
    same = gate_runs(None, b, a, "same")
    js = next(r for r in same.verdict.rows if r.metric == "js_div")
    assert math.isfinite(js.drop) and js.drop > 0.02 and js.status == "fail"
    up = gate_runs(None, b, a, "upgrade")
    assert up.outcome == "pass" and {r.metric for r in up.verdict.rows} <= set(registry.QUALITY_METRICS)


# --- the rule sets -----------------------------------------------------------------------------


def test_rule_sets_are_built_from_the_registry():
    assert load_rules(None) is DEFAULT_RULES is load_rules("same")
    assert [r.metric for r in load_rules("same").regressions] == list(registry.HEADLINE_METRICS)
    assert [r.metric for r in load_rules("upgrade").regressions] == list(registry.QUALITY_METRICS)
    assert "js_div" not in registry.QUALITY_METRICS
    assert all(r.margin == registry.METRICS[r.metric].margin for r in load_rules("upgrade").regressions)


def test_unknown_rule_set_is_bad_input_listing_the_sets(invoke):
    with pytest.raises(BadInput, match=r"neither a shipped rule set \(did you mean same\?\) \(same, upgrade\)"):
        load_rules("sam")
    d = distributions()
    store("base-u", d)
    store("cand-u", d, created="2025-01-02 00:00:00")
    res = invoke("gate", "--candidate", "cand-u", "--baseline", "base-u", "--rules", "nosuchset")
    assert res.exit_code == 2 and "same, upgrade" in res.output


def test_a_rules_file_extends_a_set():
    r = parse_rules({"extends": "upgrade", "regressions": {"ft_hit": 0.1}}, source="f.yaml")
    assert r.extends == "upgrade" and r.shipped is None and r.question == "upgrade"
    margins = {g.metric: str(g.margin) for g in r.regressions}
    assert margins["ft_hit"] == "0.1" and set(margins) == set(registry.QUALITY_METRICS)
    with pytest.raises(BadInput, match="extends: 'faster' is not a shipped rule set"):
        parse_rules({"extends": "faster", "regressions": {"ft_hit": 0.1}}, source="f.yaml")


# --- same tokenizer: today's numbers, bit for bit ----------------------------------------------


def _seeded_topk(seed, k=8, n=12, vocab=40):
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        ids = rng.sample(range(vocab), k)
        w = sorted((rng.random() ** 3 for _ in ids), reverse=True)
        tot = sum(w) / rng.uniform(0.6, 0.95)
        out[("firsttoken_en" if i % 3 else "firsttoken_zh", f"d{i}")] = [(t, x / tot) for t, x in zip(ids, w)]
    return out


def _store_ids(run_id, topk, created, tokenizer=None):
    runs.insert_run(None, {"id": run_id, "created_at": created, "status": "running", "model": "synthetic",
                           "top_k": 8, "tokenizer_hash": tokenizer})
    samples = [{"run_id": run_id, "task": t, "doc_id": d, "ft_hit": float(len(d) % 2)} for (t, d) in topk]
    rows = [{"run_id": run_id, "task": t, "doc_id": d, "rank": r, "token_id": tid, "token": f"t{tid}",
             "logprob": math.log(p)} for (t, d), toks in topk.items() for r, (tid, p) in enumerate(toks)]
    runs.finish_run(None, run_id, metrics=[], samples=samples, topk=rows, status="done")


# compare_runs's drift rows and the gate's per-prompt js_div on this fixture, computed by evalkit
# before it stored tokenizer identities (float.hex, so equality is to the bit)
SNAPSHOT_ROWS = [
    ["firsttoken_en", 8, "0x1.88cc391f9ef24p-1", "0x1.71b67270c762fp-1", "0x1.3333333333334p-4",
     "0x1.70ab454b112c0p-1", "0x1.0000000000000p+0"],
    ["firsttoken_zh", 4, "0x1.91bbd30605ea8p-1", "0x1.925e24bbfc505p-1", "0x1.3333333333334p-3",
     "0x1.675153c09f4ddp-1", "0x1.0000000000000p+0"],
    ["all", 12, "0x1.8bc6c1c1c1450p-1", "0x1.7c99033483b21p-1", "0x1.9999999999999p-4",
     "0x1.6d8d4a1ceb374p-1", "0x1.0000000000000p+0"],
]
SNAPSHOT_GATE = {
    ("firsttoken_en", "d1"): "0x1.72221f3133e90p-1", ("firsttoken_en", "d10"): "0x1.013f57b8c2095p-1",
    ("firsttoken_en", "d11"): "0x1.8139fd5f8d688p-1", ("firsttoken_en", "d2"): "0x1.74a43c4a97c9cp-1",
    ("firsttoken_en", "d4"): "0x1.7fca9218e32bap-1", ("firsttoken_en", "d5"): "0x1.2b3f715e5d81dp-1",
    ("firsttoken_en", "d7"): "0x1.9d510a4d049b0p-1", ("firsttoken_en", "d8"): "0x1.d3bf6c0028f32p-1",
    ("firsttoken_zh", "d0"): "0x1.7993fb705c6a0p-1", ("firsttoken_zh", "d3"): "0x1.506c842a79411p-1",
    ("firsttoken_zh", "d6"): "0x1.927f697f2d9b4p-1", ("firsttoken_zh", "d9"): "0x1.40c565e879f10p-1",
}


@pytest.mark.parametrize("tokenizer", [None, "h-same"])  # unknown on both sides (older runs), or one stored hash
def test_same_tokenizer_numbers_are_bit_identical_to_before(tokenizer):
    from evalkit.release.db import load_run_data, with_distances
    from evalkit.store.db import open_reader

    _store_ids("snap-a", _seeded_topk(1), "2025-01-01 00:00:00", tokenizer)
    _store_ids("snap-b", _seeded_topk(2), "2025-01-02 00:00:00", tokenizer)
    c = compare_runs(None, "snap-a", "snap-b")
    got = [[r.task, r.n, *(float(getattr(r, k)).hex() for k in ("top5_mass_a", "top5_mass_b", "top5_overlap",
                                                                   "js_div", "flip_rate"))] for r in c.drift]
    assert got == SNAPSHOT_ROWS and {r.space for r in c.drift} == {"token_id"}
    with open_reader(None) as con:
        cand, _ = with_distances(con, load_run_data(con, "snap-b"), load_run_data(con, "snap-a"))
    assert {k: v["js_div"].hex() for k, v in cand.samples.items() if "js_div" in v} == SNAPSHOT_GATE


# --- drift by position -------------------------------------------------------------------------


def test_drift_by_position_refuses_another_tokenizer():
    from types import SimpleNamespace

    from evalkit.engines.tokenizer_id import TokenizerId
    from evalkit.runner import drift

    s = drift.Session(db=None, compare=True, keep=False, base_run_id="base-run",
                      base_tokenizer=("a" * 64, "hf x: tokenizer.json"))
    drift._ACTIVE.append(s)
    try:
        drift.check_tokenizer(SimpleNamespace(tokenizer_id=TokenizerId("a" * 64, "hf y: tokenizer.json")))  # same
        # the same GGUF through llama.cpp: its vocabulary is hashed from another source, not refused
        drift.check_tokenizer(SimpleNamespace(tokenizer_id=TokenizerId("c" * 64, "llamacpp m.gguf: GGUF vocabulary")))
        with pytest.raises(BadInput, match="needs the base's tokenizer"):
            drift.check_tokenizer(SimpleNamespace(tokenizer_id=TokenizerId("b" * 64, "hf z: tokenizer.json")))
    finally:
        drift._ACTIVE.remove(s)


def test_a_twin_equal_up_to_rounding_reads_exactly_zero():
    lps = [math.log(p) for p in (0.5, 0.2, 0.1, 0.05)]
    a = [textspace.TopToken(t, None, lp) for t, lp in zip((" Paris", " London", "中", "\n"), lps)]
    # the twin's log-softmax summed in another order: every logprob one ulp off
    b = [textspace.TopToken(t.text, None, math.nextafter(t.logprob, 0.0)) for t in a]
    assert 0.0 < textspace.stats.jsd(textspace.merge(a), textspace.merge(b)) < 1e-12
    assert textspace.prompt_drift_text(a, b)["js_div"] == 0.0


def test_unknown_tokenizers_with_one_model_fingerprint_compare_by_id():
    d = distributions()
    a = store("fp-a", d, fingerprint="same-weights")
    b = store("fp-b", d, vocab=permutation(), fingerprint="same-weights", created="2025-01-02 00:00:00")
    c = compare_runs(None, a, b)
    assert c.drift[-1].space == "token_id" and "same model fingerprint" in c.tokenizers


def test_show_and_compare_print_the_tokenizer(invoke):
    d = distributions()
    store("show-a", d, tokenizer="ab" * 32)
    store("show-b", d, vocab=permutation(), tokenizer="cd" * 32, created="2025-01-02 00:00:00")
    res = invoke("show", "show-a")
    assert res.exit_code == 0 and "tokenizer_hash: " + "ab" * 32 in res.output
    res = invoke("compare", "show-a", "show-b")
    assert res.exit_code == 0, res.output
    assert "A tokenizer  abababababab" in res.output and "first_char" in res.output
    assert "tokenizer_hash abababababab -> cdcdcdcdcdcd" in res.output
