"""Does the first token predict the answer (docs/metrics.md §1.7): `answer_hit`, the checkable
prompts' data, and the leading-indicator AUROC against independent computations."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from evalkit.prompts.catalog import FIRSTTOKEN_DATA, data_path
from evalkit.prompts.jsonl import load_prompts
from evalkit.scoring.answers import answer_hit
from evalkit.scoring.lead import SIGNALS, auroc, bootstrap_interval, lead_table
from evalkit.scoring.text import starts_with


@pytest.mark.parametrize("response, answers, expected", [
    ("The capital is Paris.", ["Paris"], 1.0),
    ("Paris", ["Paris"], 1.0),
    ("PARIS!", ["paris"], 1.0),  # casing
    ("Parisian food is good.", ["Paris"], 0.0),  # a word boundary
    ("It is 42.", ["42"], 1.0),
    ("It is 420.", ["42"], 0.0),
    ("It is 4.2 or 1,042 or 42,000.", ["42"], 0.0),  # a number goes on through . and ,
    ("等于４２。", ["42"], 1.0),  # full-width digits
    ("The answer: forty-two.", ["forty-two"], 1.0),
    ("答案是七十二。", ["72", "七十二"], 1.0),  # Chinese numerals
    ("答案是九十一。", ["九"], 0.0),  # a numeral inside another number
    ("九。", ["九"], 1.0),
    ("二十", ["十"], 0.0),
    ("l'eau", ["eau"], 1.0),  # an apostrophe is not a word character
    ("La capitale est巴黎", ["巴黎"], 1.0),
    ("Yes, it is.", ["Yes"], 1.0),
    ("Yesterday it was.", ["Yes"], 0.0),
])
def test_answer_hit(response, answers, expected):
    assert answer_hit(response, answers) == expected


def test_answer_hit_needs_answers():
    with pytest.raises(ValueError):
        answer_hit("Paris", [])


def shipped_docs():
    return [d for task in FIRSTTOKEN_DATA for d in load_prompts(data_path(*FIRSTTOKEN_DATA[task]))]


def test_checkable_prompts_agree_with_their_accepted_starts():
    """At least 300 checkable prompts over both languages; for each: every answers_full string scores
    as a right answer, at least one begins with an accepted start, and none occurs in the prompt (a
    response that repeats the question must not count as right)."""
    docs = [d for d in shipped_docs() if d.get("answers_full")]
    by_lang = {lang: [d for d in docs if d["lang"] == lang] for lang in ("en", "zh")}
    assert len(docs) >= 300 and all(len(v) >= 140 for v in by_lang.values())
    assert {d["category"] for d in docs} == {"factual", "arithmetic", "yes_no", "translation"}
    for d in docs:
        for full in d["answers_full"]:
            assert answer_hit(f"{full}.", d["answers_full"]) == 1.0, d["id"]
        assert any(starts_with(full, start) or starts_with(start, full) for full in d["answers_full"]
                   for start in d["answers"]), d["id"]
        assert answer_hit(d["prompt"], d["answers_full"]) == 0.0, d["id"]


def pairwise_auroc(scores, labels):
    """The definition: the share of (right, wrong) pairs in which the right one scores higher, ties ½."""
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auroc_equals_the_pairwise_count_with_ties():
    rng = np.random.default_rng(5)
    for n in (5, 30, 200):
        labels = (rng.random(n) < 0.4).astype(float)
        labels[0], labels[1] = 1.0, 0.0
        scores = rng.integers(0, 6, n).astype(float)  # many ties
        assert auroc(scores, labels) == pytest.approx(pairwise_auroc(scores, labels), abs=1e-12)
    with pytest.raises(ValueError):
        auroc([0.1, 0.2], [1, 1])


def test_bootstrap_interval_covers_the_truth_at_about_the_nominal_rate():
    """Scores ~ N(0.5, 1) for right answers and N(0, 1) for wrong: the true AUROC is Φ(0.5/√2)."""
    from scipy.stats import norm

    truth = norm.cdf(0.5 / np.sqrt(2))
    rng = np.random.default_rng(7)
    covered, trials = 0, 200
    for t in range(trials):
        labels = (rng.random(120) < 0.5).astype(float)
        scores = rng.normal(0.5 * labels, 1.0)
        lo, hi = bootstrap_interval(scores, labels, n_boot=400, seed=t)
        covered += lo <= truth <= hi
    assert 0.88 <= covered / trials <= 0.99


def test_lead_table_orients_signals_and_gives_reasons():
    samples = []
    for i in range(20):
        right = float(i % 2)
        samples.append({"task": "t_en", "category": "factual" if i < 10 else "arithmetic", "answer_hit": right,
                        "ft_hit_prob": 0.1 + 0.8 * right, "entropy": 3.0 - 2.0 * right, "ft_hit": right,
                        "top1_prob": 0.5, "top3_mass": None})
    samples.append({"task": "t_en", "category": "factual", "answer_hit": None, "ft_hit_prob": 0.9})  # not checkable
    rows = lead_table("r1", samples, {"t": ["t_en"]})
    by = {(r["task"], r["category"], r["signal"]): r for r in rows}
    assert {r["signal"] for r in rows} == set(SIGNALS)
    assert by[("t_en", "*", "ft_hit_prob")]["auroc"] == 1.0
    assert by[("t_en", "*", "entropy")]["auroc"] == 1.0  # lower entropy on the right answers: oriented
    assert by[("t_en", "*", "top1_prob")]["auroc"] == 0.5  # all tied
    assert by[("t_en", "*", "top3_mass")]["auroc"] is None and "no top3_mass values" in by[
        ("t_en", "*", "top3_mass")]["reason"]
    row = by[("t", "*", "ft_hit_prob")]  # the group, pooled
    assert row["n"] == 20 and row["n_right"] == 10 and row["base_rate"] == 0.5
    lo, hi = row["ci_lo"], row["ci_hi"]
    assert lo <= 1.0 <= hi + 1e-12
    everyone_right = lead_table("r2", [{**s, "answer_hit": 1.0} for s in samples[:20]])
    assert all(r["auroc"] is None and r["reason"] == "every checkable answer is right"
               for r in everyone_right if r["n"])


def test_group_answer_hit_is_a_mean_over_the_checkable_prompts():
    """lm-eval weighs a group's subtasks by their prompt counts; answer_hit is defined on the
    checkable prompts only, so a group's value, stderr and n are pooled over those."""
    from evalkit.runner.collect import add_intervals

    en = [{"task": "t_en", "answer_hit": float(i < 6), "ft_hit": 1.0} for i in range(10)]  # 6 of 10 right
    zh = ([{"task": "t_zh", "answer_hit": float(i < 1), "ft_hit": 0.0} for i in range(4)]  # 1 of 4 right
          + [{"task": "t_zh", "answer_hit": None, "ft_hit": 0.0} for _ in range(16)])  # not checkable
    # what lm-eval hands over: subtask means over the values present, n from the prompt counts,
    # the group weighted by those counts (10 and 20)
    rows = [{"task": "t_en", "metric": "answer_hit", "value": 0.6, "stderr": 0.1, "n": 10},
            {"task": "t_zh", "metric": "answer_hit", "value": 0.25, "stderr": 0.2, "n": 20},
            {"task": "t", "metric": "answer_hit", "value": (0.6 * 10 + 0.25 * 20) / 30, "stderr": 0.1, "n": 30},
            {"task": "t", "metric": "ft_hit", "value": 10 / 30, "stderr": 0.08, "n": 30}]
    add_intervals(rows, en + zh, {"t": ["t_en", "t_zh"]})
    by = {(r["task"], r["metric"]): r for r in rows}
    pooled = [1.0] * 7 + [0.0] * 7
    assert by[("t", "answer_hit")]["value"] == pytest.approx(0.5) and by[("t", "answer_hit")]["n"] == 14
    assert by[("t", "answer_hit")]["stderr"] == pytest.approx(np.std(pooled, ddof=1) / np.sqrt(14))
    assert by[("t_zh", "answer_hit")]["value"] == pytest.approx(0.25) and by[("t_zh", "answer_hit")]["n"] == 4
    assert by[("t", "ft_hit")]["value"] == pytest.approx(10 / 30) and by[("t", "ft_hit")]["n"] == 30
    lo, hi = by[("t", "answer_hit")]["ci_lo"], by[("t", "answer_hit")]["ci_hi"]
    assert lo < 0.5 < hi and hi - lo > 0.4  # Wilson over 14 prompts, not 30


# ---- the gate reads lead_auroc per task ---------------------------------------------------------


def _run_with_lead(db, run_id: str, auroc_value):
    from evalkit.store import db as store_db
    from evalkit.store import runs

    runs.insert_run(db, {"id": run_id, "created_at": store_db.now(), "status": "running", "model": "synthetic",
                         "tasks": ["firsttoken_en"]})
    samples = [{"run_id": run_id, "task": "firsttoken_en", "doc_id": f"d{i}", "ft_hit": 1.0, "answer_hit": i % 2}
               for i in range(6)]
    metrics = [{"run_id": run_id, "task": "firsttoken_en", "metric": "ft_hit", "filter": "none", "value": 1.0,
                "stderr": 0.0, "n": 6}]
    lead = [{"run_id": run_id, "task": "firsttoken_en", "category": "*", "signal": s,
             "auroc": auroc_value if s == "ft_hit_prob" else None, "ci_lo": None, "ci_hi": None, "n": 6,
             "n_right": 3, "base_rate": 0.5, "reason": None if s == "ft_hit_prob" else "no values of the signal"}
            for s in SIGNALS]
    runs.finish_run(db, run_id, metrics=metrics, samples=samples, topk=[], lead=lead, status="done")


@pytest.mark.parametrize("value, passed", [(0.8, True), (0.55, False)])
def test_gate_threshold_on_lead_auroc(tmp_path, value, passed):
    from evalkit.api import gate

    db = tmp_path / "runs.duckdb"
    _run_with_lead(db, "r-base", 0.7)
    _run_with_lead(db, "r-cand", value)
    rules = tmp_path / "rules.yaml"
    rules.write_text('thresholds:\n  firsttoken_en/lead_auroc.ft_hit_prob: ">= 0.6"\n')
    result = gate("r-cand", "r-base", rules, db=db)
    assert result.passed is passed
    [row] = [r for r in result.verdict.rows if r.metric == "lead_auroc.ft_hit_prob"]
    assert row.status == ("pass" if passed else "fail") and row.observed == pytest.approx(value)


@pytest.mark.parametrize("key, fragment", [
    ("lead_auroc.ft_hit_probb", "unknown metric 'lead_auroc.ft_hit_probb'"),  # a misspelled signal
    ("lead_auroc.", "unknown metric 'lead_auroc.'"),
])
def test_gate_refuses_a_lead_auroc_rule_on_no_signal(tmp_path, key, fragment):
    from evalkit.api import gate
    from evalkit.errors import BadInput

    db = tmp_path / "runs.duckdb"
    _run_with_lead(db, "r-base", 0.7)
    rules = tmp_path / "rules.yaml"
    rules.write_text(f'thresholds:\n  ft_hit: ">= 0.5"\n  {key}: ">= 0.6"\n')
    with pytest.raises(BadInput, match=fragment.replace(".", r"\.")):
        gate("r-base", "r-base", rules, db=db)


def test_gate_on_an_undefined_lead_auroc_is_not_a_pass(tmp_path):
    """A NULL AUROC (every answer right, say) leaves the rule nothing to check: it fails."""
    from evalkit.api import gate

    db = tmp_path / "runs.duckdb"
    _run_with_lead(db, "r-base", None)
    rules = tmp_path / "rules.yaml"
    rules.write_text('thresholds:\n  ft_hit: ">= 0.5"\n  firsttoken_en/lead_auroc.entropy: ">= 0.6"\n')
    result = gate("r-base", "r-base", rules, db=db)
    [row] = [r for r in result.verdict.rows if r.metric == "lead_auroc.entropy"]
    assert row.status == "fail" and "is null" in row.reason and not result.passed


@pytest.mark.parametrize("value, ok", [("0", True), ("48", True), ("4096", True), ("-1", False), ("4097", False),
                                       ("2.5", False), ("x", False)])
def test_answer_max_tokens_is_checked_before_the_model_loads(value, ok):
    """0 turns the continuation past the response off (bench/answer_cost.py's baseline); the rest is bad input."""
    from evalkit.engines import resolve as models
    from evalkit.errors import BadInput

    if ok:
        plan = models.resolve("hf", f"answer_max_tokens={value}", device="cpu")
        assert plan.args["answer_max_tokens"] == int(value)
    else:
        with pytest.raises(BadInput, match="answer_max_tokens must be a whole number from 0 to 4096"):
            models.resolve("hf", f"answer_max_tokens={value}", device="cpu")


def _one_right_of(n: int) -> list[dict]:
    """n checkable prompts, the first one right; every signal ranks it first."""
    return [{"task": "t", "answer_hit": float(i == 0), "ft_hit_prob": 0.9 if i == 0 else 0.1 + 0.01 * i,
             "top1_prob": 0.8 if i == 0 else 0.2, "entropy": 0.5 if i == 0 else 2.0, "top3_mass": 0.9,
             "opener_mass": 0.1, "prior_drift": 0.2, "ft_hit": float(i == 0)} for i in range(n)]


def test_lead_auroc_gives_no_interval_from_one_right_answer():
    # one right answer of 42 printed [1.0000, 1.0000]: every resample that holds it ranks it alike
    (row,) = [r for r in lead_table("r", _one_right_of(42)) if r["signal"] == "ft_hit_prob"]
    assert row["auroc"] == 1.0 and row["ci_lo"] is None and row["ci_hi"] is None
    assert row["reason"] == "no interval: needs 10 right and 10 wrong answers, has 1 right, 41 wrong"


def test_lead_auroc_has_an_interval_with_enough_of_each_class():
    samples = [{"task": "t", "answer_hit": float(i % 2), "ft_hit_prob": (i % 2) * 0.3 + 0.01 * i}
               for i in range(40)]
    (row,) = [r for r in lead_table("r", samples) if r["signal"] == "ft_hit_prob"]
    assert row["reason"] is None and row["ci_lo"] is not None and row["ci_lo"] <= row["auroc"] <= row["ci_hi"]
