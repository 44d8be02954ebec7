"""No verdict from too little data (docs/gate.md "Too few prompts"): pure-logic tests of decide().

A check on fewer prompts than its method needs (`paired.MIN_PROMPTS`) is inconclusive and says
how many it needs; so is a bootstrap interval of width 0 that does not come from identical
values, and a stored interval of width 0. No PASS or FAIL rests on one prompt.
"""

import random

import pytest

from evalkit.release import paired
from evalkit.release.decide import RunData, decide
from evalkit.release.rules import DEFAULT_RULES, parse_rules


def run(run_id, per_task):
    """per_task: task -> list of {metric: value} per doc; aggregates are the means."""
    samples, metrics = {}, {}
    for task, docs in per_task.items():
        for i, values in enumerate(docs):
            samples[(task, str(i))] = dict(values)
        for m in {m for d in docs for m in d}:
            vals = [d[m] for d in docs if d.get(m) is not None]
            metrics[(task, m)] = sum(vals) / len(vals)
    return RunData(run_id=run_id, metrics=metrics, samples=samples)


def row(verdict, metric, task="t"):
    (r,) = [r for r in verdict.rows if r.metric == metric and r.task == task]
    return r


def test_the_issues_one_prompt_fail_is_now_inconclusive_and_says_how_many_it_needs():
    """One prompt a task: ft_hit_prob fell 0.5012 and opener_mass rose 0.003 (issue 35). A bootstrap of one
    value is not an interval: neither may fail, and the gate is inconclusive."""
    base = run("b", {"t": [{"ft_hit_prob": 0.6012, "opener_mass": 0.010, "ft_hit": 1.0}]})
    cand = run("c", {"t": [{"ft_hit_prob": 0.1000, "opener_mass": 0.013, "ft_hit": 0.0}]})
    verdict = decide(cand, base, DEFAULT_RULES)
    assert verdict.outcome == "inconclusive"
    for metric, need in (("ft_hit_prob", 20), ("opener_mass", 20), ("ft_hit", 10)):
        r = row(verdict, metric)
        assert r.status == "inconclusive" and r.p_fail is None, r
        assert f"needs at least {need} prompts, this check has 1" in r.reason
        assert f"about {need} prompts would decide it" in r.reason
        assert r.decide_n == need
    assert verdict.family == 0  # nothing undecidable enters Holm's family


@pytest.mark.parametrize("n, status", [(9, "inconclusive"), (10, "fail")])
def test_paired_binary_needs_ten_pairs(n, status):
    base = run("b", {"t": [{"ft_hit": 1.0}] * n})
    cand = run("c", {"t": [{"ft_hit": 0.0}] * n})
    r = row(decide(cand, base, parse_rules({"regressions": {"ft_hit": 0.05}})), "ft_hit")
    assert r.status == status
    assert r.method == "Tango score interval"


def _spread(n, drop, seed=0):
    rng = random.Random(seed)
    base = [rng.uniform(0.3, 0.7) for _ in range(n)]
    return [{"ft_hit_prob": b} for b in base], [{"ft_hit_prob": b * (1 - drop) + rng.uniform(-0.01, 0.01)} for b in base]


@pytest.mark.parametrize("n, status", [(19, "inconclusive"), (20, "fail")])
def test_paired_bootstrap_needs_twenty_prompts(n, status):
    b, c = _spread(n, 0.5)  # halved: far past a 10 % margin
    r = row(decide(run("c", {"t": c}), run("b", {"t": b}), DEFAULT_RULES), "ft_hit_prob")
    assert r.status == status, r.reason
    if status == "inconclusive":
        assert "the paired bootstrap needs at least 20 prompts, this check has 19" in r.reason


def test_a_width_zero_interval_from_different_values_decides_nothing():
    """Every prompt lost exactly 0.1: the bootstrap's resamples all have the same mean, a 'certain' drop
    that only says the spread could not be seen."""
    base = [{"prior_drift": 0.3 + 0.01 * i} for i in range(50)]
    cand = [{"prior_drift": 0.3 + 0.01 * i + 0.1} for i in range(50)]
    r = row(decide(run("c", {"t": cand}), run("b", {"t": base}), parse_rules({"regressions": {"prior_drift": 0.02}})),
            "prior_drift")
    assert r.status == "inconclusive" and r.ci[0] == pytest.approx(r.ci[1], abs=1e-12)
    assert "a bootstrap interval of width 0 measures no spread" in r.reason and r.p_fail is None


@pytest.mark.parametrize("n, status", [(3, "inconclusive"), (9, "inconclusive"), (10, "pass"), (200, "pass")])
def test_identical_values_pass_only_on_enough_prompts(n, status):
    docs = [{"ft_hit_prob": 0.01 * (i + 1)} for i in range(n)]
    r = row(decide(run("c", {"t": docs}), run("b", {"t": docs}), DEFAULT_RULES), "ft_hit_prob")
    assert (r.status, r.method) == (status, "identical on every prompt")


def test_the_same_run_passes_by_identity_at_any_size():
    docs = [{"ft_hit_prob": 0.3, "ft_hit": 1.0}]
    assert decide(run("a", {"t": docs}), run("a", {"t": docs}), DEFAULT_RULES).outcome == "pass"


@pytest.mark.parametrize("values, op", [([1.0], ">= 0.05"), ([0.0], ">= 0.9"), ([1.0] * 9, ">= 0.05"),
                                        ([0.9], ">= 0.1"), ([0.9] * 19, ">= 0.1")])
def test_thresholds_on_too_few_prompts_are_inconclusive(values, op):
    metric = "ft_hit" if set(values) <= {0.0, 1.0} else "ft_hit_prob"
    verdict = decide(run("c", {"t": [{metric: v} for v in values]}), None,
                     parse_rules({"thresholds": {metric: op}}))
    r = row(verdict, metric)
    assert r.status == "inconclusive" and "needs at least" in r.reason, r.reason


def test_a_stored_interval_of_width_zero_is_not_evidence():
    cand = RunData("c", {("g", "lead_auroc.ft_hit_prob"): 0.9}, {},
                   intervals={("g", "lead_auroc.ft_hit_prob"): (0.9, 0.9, 200)})
    r = row(decide(cand, None, parse_rules({"thresholds": {"g/lead_auroc.ft_hit_prob": ">= 0.6"}})),
            "lead_auroc.ft_hit_prob", task="g")
    assert r.status == "inconclusive" and "width 0" in r.reason


@pytest.mark.parametrize("seed", range(40))
def test_no_pass_or_fail_rests_on_one_prompt(seed):
    """Property: any two different runs of one prompt a task, any metric values, the default rules:
    every row is inconclusive (or skipped), never pass or fail."""
    rng = random.Random(seed)

    def doc():
        return {"ft_hit": float(rng.random() < 0.5), "ft_hit_prob": rng.random() ** 3,
                "answer_hit": float(rng.random() < 0.5), "answer_prob": rng.random() ** 2,
                "opener_rate": float(rng.random() < 0.3), "opener_mass": rng.random() / 10}

    base = run("b", {"en": [doc()], "zh": [doc()]})
    cand = run("c", {"en": [doc()], "zh": [doc()]})
    verdict = decide(cand, base, DEFAULT_RULES)
    assert {r.status for r in verdict.rows} <= {"inconclusive", "skipped"}, [(r.name, r.status) for r in verdict.rows]
    assert verdict.outcome == "inconclusive"


def test_every_method_has_a_stated_minimum():
    assert set(paired.MIN_PROMPTS) >= {"Tango score interval", "Wilson interval", "paired bootstrap",
                                       "bootstrap interval", "identical on every prompt"}
    assert min(paired.MIN_PROMPTS.values()) >= 2


# ------------------------------------------------------------------ exact twins (answer_hit -> answer_prob)


def _answers(n=56, lost=4, gained=3, drop=0.0, noise=0.01, seed=1):
    """n checkable prompts: answer_hit with a few discordant pairs (undecidable against 0.05 at this size),
    answer_prob paired and close (or scaled down by `drop`)."""
    rng = random.Random(seed)
    base, cand = [], []
    for i in range(n):
        hit = float(i % 3 == 0)
        c_hit = 0.0 if i < lost and hit else 1.0 if lost <= i < lost + gained and not hit else hit
        p = rng.uniform(0.05, 0.6)
        base.append({"answer_hit": hit, "answer_prob": p})
        cand.append({"answer_hit": c_hit, "answer_prob": max(0.0, p * (1 - drop) + rng.uniform(-noise, noise))})
    return run("c", {"t": cand}), run("b", {"t": base})


def test_under_the_default_rules_a_passing_answer_prob_speaks_for_an_undecidable_answer_hit():
    cand, base = _answers()
    verdict = decide(cand, base, DEFAULT_RULES)
    hit, prob = row(verdict, "answer_hit"), row(verdict, "answer_prob")
    assert prob.status == "pass"
    assert hit.status == "skipped" and hit.reason.startswith("left to its exact twin answer_prob, which passes")
    assert "prompts would decide it" in hit.reason  # what answer_hit alone would need stays visible
    assert verdict.outcome == "pass"
    # the same two runs, answer_hit alone: undecidable
    assert decide(cand, base, parse_rules({"regressions": {"answer_hit": "default"}})).outcome == "inconclusive"


def test_a_rules_file_gets_what_it_asked_for_twins_only_on_request():
    cand, base = _answers()
    rules = parse_rules({"regressions": {"answer_hit": "default", "answer_prob": "default"}})
    assert row(decide(cand, base, rules), "answer_hit").status == "inconclusive"
    assert row(decide(cand, base, rules, twins=True), "answer_hit").status == "skipped"


def test_a_twin_that_does_not_pass_leaves_the_zero_one_row_as_it_was():
    cand, base = _answers(drop=0.5)  # answer_prob halved: fails
    verdict = decide(cand, base, DEFAULT_RULES)
    assert row(verdict, "answer_prob").status == "fail"
    assert row(verdict, "answer_hit").status == "inconclusive" and verdict.outcome == "fail"
    cand, base = _answers(n=25, noise=0.3)  # answer_prob too noisy at 25 prompts: inconclusive
    verdict = decide(cand, base, DEFAULT_RULES)
    assert row(verdict, "answer_prob").status == "inconclusive"
    assert row(verdict, "answer_hit").status == "inconclusive" and verdict.outcome == "inconclusive"


def test_a_twin_speaks_only_for_its_own_task():
    cand, base = _answers()
    only_hits = {k: {"answer_hit": v["answer_hit"]} for k, v in cand.samples.items()}
    cand2 = RunData("c", {}, {**{("u", d): v for (_, d), v in only_hits.items()}, **cand.samples})
    base2 = RunData("b", {}, {**{("u", d): {"answer_hit": v["answer_hit"]} for (_, d), v in base.samples.items()},
                              **base.samples})
    verdict = decide(cand2, base2, DEFAULT_RULES)
    assert row(verdict, "answer_hit", task="t").status == "skipped"
    assert row(verdict, "answer_hit", task="u").status == "inconclusive"
