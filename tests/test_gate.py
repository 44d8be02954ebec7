"""evalkit.release: pure-logic tests of rules parsing, decide() and the verdict's renderings."""

import copy
import re
import xml.etree.ElementTree as ET

import pytest

from evalkit.errors import BadInput
from evalkit.release.decide import RunData, decide
from evalkit.release.render import to_junit, to_markdown
from evalkit.scoring import registry
from evalkit.release.rules import DEFAULT_RULES, HEADLINE_METRICS, Regression, Rules, Threshold, load_rules, parse_rules


def make_run(run_id, per_task):
    """per_task: task -> list of {metric: value} per doc (doc ids 0..n-1); aggregates = means."""
    samples = {}
    metrics = {}
    for task, docs in per_task.items():
        sums = {}
        for i, values in enumerate(docs):
            samples[(task, str(i))] = dict(values)
            for m, v in values.items():
                if v is not None:
                    sums.setdefault(m, []).append(v)
        for m, vs in sums.items():
            metrics[(task, m)] = sum(vs) / len(vs)
    return RunData(run_id=run_id, metrics=metrics, samples=samples)


def hits(n, n_hit, metric="ft_hit", offset=0):
    """n docs, docs offset..offset+n_hit-1 hit."""
    return [{metric: 1.0 if offset <= i < offset + n_hit else 0.0} for i in range(n)]


def only(verdict, kind=None, metric=None, task=None):
    return [
        r
        for r in verdict.rows
        if (kind is None or r.kind == kind)
        and (metric is None or r.metric == metric)
        and (task is None or r.task == task)
    ]


# ----------------------------------------------------------------------- thresholds


@pytest.mark.parametrize(
    "op, limit, status",
    [
        (">=", 0.5, "pass"),
        (">=", 0.6, "fail"),
        (">", 0.4, "pass"),
        (">", 0.5, "fail"),
        ("<=", 0.5, "pass"),
        ("<=", 0.4, "fail"),
        ("<", 0.6, "pass"),
        ("<", 0.5, "fail"),
        ("==", 0.5, "pass"),
        ("==", 0.4, "fail"),
    ],
)
def test_threshold_operators(op, limit, status):
    run = RunData("c", {("firsttoken_en", "ft_hit"): 0.5}, {})  # no interval: compared as a point
    rules = parse_rules({"thresholds": {"ft_hit": f"{op} {limit}"}})
    verdict = decide(run, None, rules)
    (row,) = verdict.rows
    assert (row.kind, row.task, row.metric, row.status) == ("threshold", "firsttoken_en", "ft_hit", status)
    assert row.observed == 0.5 and row.op == op and row.limit == limit
    assert verdict.passed is (status == "pass")
    assert "compared as a point" in row.reason and row.p_fail is None


def test_threshold_equality_allows_float_noise():
    run = RunData("c", {("t", "ft_hit"): 0.1 + 0.2}, {})
    assert decide(run, None, parse_rules({"thresholds": {"ft_hit": "== 0.3"}})).passed


def test_threshold_plain_metric_applies_to_every_task():
    run = make_run("c", {"firsttoken_en": hits(100, 80), "firsttoken_zh": hits(100, 30)})
    verdict = decide(run, None, parse_rules({"thresholds": {"ft_hit": ">= 0.5"}}))
    assert {r.task: r.status for r in verdict.rows} == {"firsttoken_en": "pass", "firsttoken_zh": "fail"}
    assert not verdict.passed
    assert len(verdict.reasons) == 1 and "firsttoken_zh" in verdict.reasons[0]


def test_threshold_per_task_key_checks_one_task():
    run = make_run("c", {"firsttoken_en": hits(100, 80), "firsttoken_zh": hits(100, 30)})
    verdict = decide(run, None, parse_rules({"thresholds": {"firsttoken_en/ft_hit": ">= 0.5"}}))
    (row,) = verdict.rows
    assert (row.task, row.status) == ("firsttoken_en", "pass")
    assert verdict.passed


def test_threshold_missing_metric_fails():
    run = make_run("c", {"firsttoken_en": hits(10, 8)})
    rules = parse_rules({"thresholds": {"opener_rate": "<= 0.2", "firsttoken_zh/ft_hit": ">= 0.5"}})
    verdict = decide(run, None, rules)
    assert not verdict.passed
    assert [r.status for r in verdict.rows] == ["fail", "fail"]
    assert all("metric missing" in r.reason for r in verdict.rows)


def test_threshold_null_aggregate_fails():
    run = RunData("c", {("t", "ft_hit"): float("nan")}, {})
    (row,) = decide(run, None, parse_rules({"thresholds": {"ft_hit": ">= 0"}})).rows
    assert row.status == "fail" and "metric missing" in row.reason


# ---------------------------------------------------------------------- regressions

REG = parse_rules({"regressions": {"ft_hit": 0.05}})


def test_regression_fails_for_degraded_candidate():
    base = make_run("base", {"firsttoken_en": hits(200, 160)})  # 0.80
    cand = make_run("cand", {"firsttoken_en": hits(200, 120)})  # loses 40 of the hits: 0.60
    verdict = decide(cand, base, REG)
    (row,) = verdict.rows
    assert row.status == "fail" and verdict.outcome == "fail" and not verdict.passed
    assert row.drop == pytest.approx(0.2)
    assert 0.05 < row.ci[0] < 0.2 < row.ci[1]
    assert (row.observed, row.baseline, row.n, row.limit) == (0.6, 0.8, 200, 0.05)
    assert "lies wholly past" in row.reason and "40 lost / 0 gained" in row.reason
    assert row.method == "Tango score interval"


def test_regression_passes_for_equal_candidate():
    base = make_run("base", {"firsttoken_en": hits(200, 160)})
    cand = make_run("cand", {"firsttoken_en": hits(200, 160)})
    verdict = decide(cand, base, REG)
    assert verdict.passed
    (row,) = verdict.rows
    # no discordant pair of 200: the drop may still be up to 3.84 / 203.84, below the margin
    assert row.drop == 0.0 and row.ci[1] == pytest.approx(3.8415 / 203.8415, abs=1e-4)


def test_regression_passes_for_small_noisy_difference():
    base_docs = hits(200, 160)
    cand_docs = copy.deepcopy(base_docs)
    for i in (0, 5, 9, 40, 77):  # five hits lost ...
        cand_docs[i]["ft_hit"] = 0.0
    for i in (170, 180, 190):  # ... three gained
        cand_docs[i]["ft_hit"] = 1.0
    base = make_run("base", {"firsttoken_en": base_docs})
    cand = make_run("cand", {"firsttoken_en": cand_docs})
    verdict = decide(cand, base, REG)
    (row,) = verdict.rows
    assert row.drop == pytest.approx(0.01)
    assert row.status == "pass" and verdict.passed


def test_regression_pairs_only_shared_prompts():
    base = make_run("base", {"t": hits(100, 80)})
    cand = make_run("cand", {"t": hits(50, 50)})  # docs 0..49, all hits in both runs
    assert base.metrics[("t", "ft_hit")] == 0.8  # the unpaired aggregate would show a gain
    (row,) = decide(cand, base, REG).rows
    assert (row.n, row.observed, row.baseline, row.drop) == (50, 1.0, 1.0, 0.0)


def test_regression_ignores_null_per_sample_values():
    base_docs = hits(20, 10)
    cand_docs = hits(20, 10)
    cand_docs[0]["ft_hit"] = None
    base_docs[1]["ft_hit"] = float("nan")
    base = make_run("base", {"t": base_docs})
    cand = make_run("cand", {"t": cand_docs})
    (row,) = decide(cand, base, REG).rows
    assert row.n == 18


def test_regression_lower_is_better_fails_on_increase():
    rules = parse_rules({"regressions": {"opener_rate": 0.02}})
    base = make_run("base", {"t": hits(200, 20, "opener_rate")})  # 0.10
    worse = make_run("worse", {"t": hits(200, 60, "opener_rate")})  # 0.30: more openers
    better = make_run("better", {"t": hits(200, 0, "opener_rate")})  # 0.00
    (row,) = decide(worse, base, rules).rows
    assert row.status == "fail" and not row.higher_is_better
    assert "increase" in row.reason
    assert decide(better, base, rules).passed


def test_regression_higher_is_better_direction_drops_fail():
    # ft_hit going down fails; going up passes
    base = make_run("base", {"t": hits(200, 100)})
    up = make_run("up", {"t": hits(200, 160)})
    assert decide(up, base, REG).passed
    assert not decide(base, up, REG).passed


def test_higher_is_better_gives_an_unknown_metric_its_direction():
    rules = parse_rules(
        {"regressions": {"my_metric": 0.02}, "higher_is_better": {"my_metric": False}}
    )
    base = make_run("base", {"t": hits(200, 20, "my_metric")})
    more = make_run("more", {"t": hits(200, 60, "my_metric")})
    assert not decide(more, base, rules).passed
    assert decide(base, more, rules).passed
    per_task = parse_rules(
        {"regressions": {"my_metric": 0.02}, "higher_is_better": {"t/my_metric": False}}
    )
    assert per_task.is_higher_better("t", "my_metric") is False
    assert per_task.is_higher_better("u", "my_metric") is True


@pytest.mark.parametrize("key", ["ft_hit", "t/ft_hit", "opener_rate", "needle_recall@depth0.5"])
def test_higher_is_better_never_flips_a_known_metric(key):
    # issue 36 class 9: {ft_hit: false} let a total loss pass
    metric = key.rpartition("/")[2]
    flipped = not registry.higher_is_better(metric)
    with pytest.raises(BadInput, match=rf"higher_is_better\.{re.escape(key)}: evalkit knows {re.escape(metric)} as"):
        parse_rules({"regressions": {metric: 0.02}, "higher_is_better": {key: flipped}})
    # stating the known direction changes nothing and is accepted
    parse_rules({"regressions": {metric: 0.02}, "higher_is_better": {key: not flipped}})


def test_regression_metric_neither_run_has_is_skipped():
    base = make_run("base", {"t": hits(400, 300)})
    cand = make_run("cand", {"t": hits(400, 300)})
    verdict = decide(cand, base, parse_rules({"regressions": {"ft_hit": 0.02, "needle_recall": 0.02}}))
    (row,) = only(verdict, metric="needle_recall")
    assert row.status == "skipped" and row.task is None
    assert "neither run" in row.reason
    assert verdict.passed
    (row,) = decide(cand, base, parse_rules({"regressions": {"t/needle_recall": 0.02}})).rows
    assert (row.task, row.status) == ("t", "skipped")


def test_regression_metric_only_baseline_has_fails_only_candidate_has_skips():
    base = make_run("base", {"t": [{"ft_hit": 1.0, "ft_hit_prob": 0.9}] * 20})
    cand = make_run("cand", {"t": [{"ft_hit": 1.0, "opener_rate": 0.0}] * 20})
    rules = parse_rules({"regressions": {"ft_hit_prob": 0.02, "opener_rate": 0.02}})
    verdict = decide(cand, base, rules)
    (lost,) = only(verdict, metric="ft_hit_prob")
    (new,) = only(verdict, metric="opener_rate")
    assert lost.status == "fail" and "metric missing" in lost.reason
    assert new.status == "skipped"
    assert not verdict.passed


def test_regression_aggregate_only_metric_without_intervals_is_inconclusive():
    base = make_run("base", {"t": hits(20, 10)})
    cand = make_run("cand", {"t": hits(20, 10)})
    base.metrics[("t", "middle_gap")] = 0.1
    cand.metrics[("t", "middle_gap")] = 0.1
    verdict = decide(cand, base, parse_rules({"regressions": {"middle_gap": 0.02}}))
    (row,) = verdict.rows
    assert row.status == "inconclusive" and "nothing to test a drop with" in row.reason
    assert verdict.outcome == "inconclusive"


def test_regression_aggregate_only_metric_uses_the_stored_intervals():
    base = make_run("base", {"t": hits(20, 10)})
    worse = make_run("worse", {"t": hits(20, 10)})
    base.metrics[("t", "middle_gap")], base.intervals[("t", "middle_gap")] = 0.0, (-0.05, 0.05, 300)
    worse.metrics[("t", "middle_gap")], worse.intervals[("t", "middle_gap")] = 0.3, (0.25, 0.35, 300)
    rules = parse_rules({"regressions": {"middle_gap": 0.05}})
    (row,) = decide(worse, base, rules).rows  # middle_gap is lower-is-better: +0.3 is worse
    assert row.status == "fail" and row.method == "stored intervals, unpaired"
    assert row.drop == pytest.approx(0.3) and row.ci[0] == pytest.approx(0.3 - 1.96 * 0.05 * 2 ** 0.5 / 1.96, rel=1e-3)
    (row,) = decide(base, base, rules).rows
    assert row.status == "pass" and row.method == "identity"


def test_no_shared_prompts_is_bad_input():
    base = make_run("base", {"firsttoken_en": hits(20, 10)})
    cand = make_run("cand", {"firsttoken_zh": hits(20, 10)})
    with pytest.raises(BadInput, match="runs cand and base share no prompts"):
        decide(cand, base, REG)


def test_regressions_without_baseline_is_bad_input():
    cand = make_run("cand", {"t": hits(20, 10)})
    with pytest.raises(BadInput, match="no baseline"):
        decide(cand, None, DEFAULT_RULES)


def test_self_gate_passes_with_default_rules():
    docs = [
        {
            "ft_hit": float(i % 3 == 0),
            "ft_hit_prob": (i % 7) / 7,
            "opener_rate": float(i % 4 == 0),
            "opener_mass": (i % 5) / 10,
            "answer_hit": float(i % 2 == 0),
            "answer_prob": (i % 9) / 9,
            "js_div": 0.0,  # a run's distance from itself (release.db.with_distances)
        }
        for i in range(100)
    ]
    run = make_run("r1", {"firsttoken_en": docs, "needle": hits(30, 20, "needle_recall")})
    verdict = decide(run, run, DEFAULT_RULES)
    assert verdict.passed
    checked = only(verdict, kind="regression")
    assert {r.metric for r in checked} == set(HEADLINE_METRICS)
    for r in checked:
        assert r.status == "pass" and r.method == "identity"
        assert r.drop == 0.0 and r.ci == (0.0, 0.0)


def test_decide_is_pure():
    base = make_run("base", {"t": hits(50, 40)})
    cand = make_run("cand", {"t": hits(50, 30)})
    before = (copy.deepcopy(cand), copy.deepcopy(base))
    rules = parse_rules({"thresholds": {"ft_hit": ">= 0.5"}, "regressions": {"ft_hit": 0.02}})
    first = decide(cand, base, rules)
    assert (cand, base) == before
    assert decide(cand, base, rules) == first


# ---------------------------------------------------------------------------- rules


def test_default_rules():
    assert load_rules(None) is DEFAULT_RULES
    assert DEFAULT_RULES.thresholds == ()
    assert {(r.metric, r.task, r.margin.kind, r.margin.value) for r in DEFAULT_RULES.regressions} == {
        ("ft_hit", None, "delta", 0.05), ("answer_hit", None, "delta", 0.05), ("needle_recall", None, "delta", 0.05),
        ("opener_rate", None, "delta", 0.05), ("ft_hit_prob", None, "relative", 0.15),
        ("opener_mass", None, "relative", 0.25), ("answer_prob", None, "relative", 0.20), ("js_div", None, "delta", 0.02),
    }
    assert {r.metric for r in DEFAULT_RULES.regressions} == set(HEADLINE_METRICS)
    assert all(r.margin.why for r in DEFAULT_RULES.regressions)
    for m in ("opener_rate", "opener_mass", "prior_drift", "flip_rate", "js_div", "unstable"):
        assert DEFAULT_RULES.is_higher_better(None, m) is False
    for m in ("ft_hit", "ft_hit_prob", "needle_recall", "top5_overlap"):
        assert DEFAULT_RULES.is_higher_better("t", m) is True


def test_load_rules_from_file(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(
        "thresholds:              # on the candidate alone\n"
        '  ft_hit: ">= 0.5"\n'
        '  firsttoken_zh/opener_rate: "<= 0.2"\n'
        "regressions:\n"
        "  ft_hit: 0.02\n"
        "  firsttoken_zh/needle_recall: 0\n"
        "higher_is_better:\n"
        "  opener_rate: false\n"
    )
    rules = load_rules(path)
    assert isinstance(rules, Rules)
    assert rules.thresholds == (
        Threshold("ft_hit", ">=", 0.5),
        Threshold("opener_rate", "<=", 0.2, task="firsttoken_zh"),
    )
    assert rules.regressions == (
        Regression("ft_hit", 0.02),
        Regression("needle_recall", 0.0, task="firsttoken_zh"),
    )
    assert rules.higher_is_better == {"opener_rate": False}
    assert rules.source == str(path)


MALFORMED = {
    "not_yaml": "thresholds: [unclosed\n",
    "unquoted_comparison": "thresholds:\n  ft_hit: >= 0.5\n",
    "not_mapping": "- ft_hit\n- opener_rate\n",
    "scalar": "just text\n",
    "empty": "",
    "unknown_top_level": "thresholds:\n  ft_hit: '>= 0.5'\nthreshold:\n  ft_hit: '>= 0.5'\n",
    "section_not_mapping": "thresholds:\n  - ft_hit\n",
    "bad_operator": "thresholds:\n  ft_hit: '=> 0.5'\n",
    "not_equal_operator": "thresholds:\n  ft_hit: '!= 0.5'\n",
    "no_operator": "thresholds:\n  ft_hit: 0.5\n",
    "bad_number": "thresholds:\n  ft_hit: '>= high'\n",
    "nan_number": "thresholds:\n  ft_hit: '>= nan'\n",
    "trailing_junk": "thresholds:\n  ft_hit: '>= 0.5 or so'\n",
    "negative_delta": "regressions:\n  ft_hit: -0.02\n",
    "negative_relative": "regressions:\n  ft_hit_prob: {relative: -0.1}\n",
    "unknown_margin_kind": "regressions:\n  ft_hit_prob: {ratio: 0.1}\n",
    "two_margin_kinds": "regressions:\n  ft_hit_prob: {delta: 0.1, relative: 0.1}\n",
    "string_relative": "regressions:\n  ft_hit_prob: {relative: ten}\n",
    "no_default_margin": "regressions:\n  entropy: default\n",
    "string_delta": "regressions:\n  ft_hit: '0.02'\n",
    "bool_delta": "regressions:\n  ft_hit: true\n",
    "inf_delta": "regressions:\n  ft_hit: .inf\n",
    "bad_key": "regressions:\n  a/b/c: 0.02\n",
    "key_with_space": "regressions:\n  ft hit: 0.02\n",
    "numeric_key": "regressions:\n  1: 0.02\n",
    "bad_direction": "regressions:\n  ft_hit: 0.02\nhigher_is_better:\n  ft_hit: maybe\n",
    "duplicate_key": "regressions:\n  ft_hit: 0.02\n  ft_hit: 0.5\n",
    "no_rules": "higher_is_better:\n  ft_hit: true\n",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_rules_are_bad_input(tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    path.write_text(MALFORMED[name])
    with pytest.raises(BadInput) as info:
        load_rules(path)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    assert info.value.exit_code == 2


@pytest.mark.parametrize(
    "name, key",
    [
        ("unknown_top_level", "threshold"),
        ("bad_operator", "thresholds.ft_hit"),
        ("bad_number", "thresholds.ft_hit"),
        ("negative_delta", "regressions.ft_hit"),
        ("negative_relative", "relative must be >= 0"),
        ("unknown_margin_kind", "regressions.ft_hit_prob: expected a number, {delta: X}"),
        ("no_default_margin", "no default margin for 'entropy'"),
        ("bad_direction", "higher_is_better.ft_hit"),
        ("bad_key", "a/b/c"),
        ("duplicate_key", "duplicate key"),
        ("not_yaml", "not valid YAML"),
        ("unquoted_comparison", "quote comparisons"),
    ],
)
def test_malformed_rules_name_the_key(tmp_path, name, key):
    path = tmp_path / "r.yaml"
    path.write_text(MALFORMED[name])
    with pytest.raises(BadInput, match=key.replace(".", r"\.")):
        load_rules(path)


def test_unreadable_rules_file_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="cannot read rules file"):
        load_rules(tmp_path / "missing.yaml")
    with pytest.raises(BadInput, match="cannot read rules file"):
        load_rules(tmp_path)  # a directory


# -------------------------------------------------------------------------- output


def _mixed_verdict():
    base = make_run("base", {"t": hits(200, 160)})
    cand = make_run("cand", {"t": hits(200, 120)})
    rules = parse_rules(
        {
            "thresholds": {"ft_hit": ">= 0.5", "t/opener_rate": "<= 0.2"},
            "regressions": {"ft_hit": 0.02, "needle_recall": 0.02},
        }
    )
    return decide(cand, base, rules)


def test_markdown_fail():
    verdict = _mixed_verdict()
    md = to_markdown(verdict, "cand", "base")
    header = md.splitlines()[0]
    assert "FAIL" in header and "PASS" not in header
    assert "candidate cand vs baseline base" in header
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert table[0].startswith("| status | kind | task | metric |")
    assert len(table) == 2 + len(verdict.rows)
    assert sum("**FAIL**" in line for line in table) == verdict.count("fail") == 2


def test_markdown_pass():
    run = make_run("r", {"t": hits(20, 10)})
    md = to_markdown(decide(run, run, REG), "r", "r")
    assert "PASS" in md.splitlines()[0] and "FAIL" not in md
    assert "| pass | regression | t | ft_hit |" in md


def test_junit_parses_with_right_counts():
    verdict = _mixed_verdict()
    xml = to_junit(verdict, "cand", "base")
    root = ET.fromstring(xml.encode("utf-8"))
    assert root.tag == "testsuite" and root.get("name") == "evalkit-gate"
    cases = root.findall("testcase")
    assert len(cases) == len(verdict.rows) == int(root.get("tests"))
    failures = [c for c in cases if c.find("failure") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    assert len(failures) == int(root.get("failures")) == verdict.count("fail") == 2
    assert len(skipped) == int(root.get("skipped")) == verdict.count("skipped") == 1
    names = {(c.get("classname"), c.get("name")) for c in failures}
    assert names == {("evalkit.gate.regression", "t/ft_hit"), ("evalkit.gate.threshold", "t/opener_rate")}


def test_junit_all_pass():
    run = make_run("r", {"t": hits(20, 10)})
    root = ET.fromstring(to_junit(decide(run, run, REG), "r", "r").encode("utf-8"))
    assert root.get("failures") == "0" and root.get("errors") == "0"
    assert root.findall("testcase/failure") == []
    assert root.find("properties/property[@name='outcome']").get("value") == "pass"


# ------------------------------------------------------------- three outcomes, Holm


def _probs(values):
    return [{"ft_hit_prob": v} for v in values]


def test_an_uncertain_drop_is_inconclusive_not_a_pass():
    """The case that once passed: 20 prompts, P(answer) down ~9x, ft_hit from 0.15 to 0.05."""
    base = [0.3, 0.25, 0.2, 0.18, 0.15, 0.12, 0.1, 0.1, 0.08, 0.07, 0.06, 0.05, 0.05, 0.04, 0.03, 0.02, 0.01,
            0.01, 0.005, 0.001]
    cand = [v / 9 for v in base]
    hit_b, hit_c = hits(20, 3), hits(20, 1)
    b = make_run("base", {"firsttoken_en": [{**h, **p} for h, p in zip(hit_b, _probs(base))]})
    c = make_run("cand", {"firsttoken_en": [{**h, **p} for h, p in zip(hit_c, _probs(cand))]})
    verdict = decide(c, b, DEFAULT_RULES)
    assert verdict.outcome == "fail" and not verdict.passed
    (prob,) = only(verdict, metric="ft_hit_prob")
    margin = registry.METRICS["ft_hit_prob"].margin.value
    assert prob.status == "fail" and prob.limit == pytest.approx(margin * sum(base) / 20)
    (hit,) = only(verdict, metric="ft_hit")
    assert hit.status == "inconclusive" and hit.decide_n > 20 and "prompts would decide it" in hit.reason
    # without the probabilities, the 0/1 drop alone cannot decide: inconclusive, never a pass
    only_hits = decide(make_run("cand", {"firsttoken_en": hit_c}), make_run("base", {"firsttoken_en": hit_b}),
                       DEFAULT_RULES)
    assert only_hits.outcome == "inconclusive"


def test_holm_turns_a_marginal_fail_into_inconclusive_among_many_checks():
    # one task with a marginal drop (one-sided p about 0.01), then nine more checks that pass
    lost = hits(200, 150)
    for i in range(5):  # 5 lost, 0 gained of 200: Tango's Z at no drop is about sqrt(5)
        lost[i]["ft_hit"] = 0.0
    base_docs, cand_docs = hits(200, 150), lost
    alone = decide(make_run("c", {"t0": cand_docs}), make_run("b", {"t0": base_docs}),
                   parse_rules({"regressions": {"ft_hit": 0.0}}))
    (row,) = alone.rows
    assert row.status == "fail" and 0.0025 < row.p_fail < 0.025
    many_c = {"t0": cand_docs, **{f"t{i}": hits(200, 150) for i in range(1, 10)}}
    many_b = {"t0": base_docs, **{f"t{i}": hits(200, 150) for i in range(1, 10)}}
    verdict = decide(make_run("c", many_c), make_run("b", many_b), parse_rules({"regressions": {"ft_hit": 0.0}}))
    (row,) = only(verdict, task="t0")
    assert verdict.family == 10
    assert row.status == "inconclusive" and "not after Holm over 10 checks" in row.reason
    assert verdict.outcome == "inconclusive"


def test_threshold_with_an_interval_is_inconclusive_near_its_bound():
    run = make_run("c", {"t": hits(20, 11)})  # 0.55, Wilson [0.34, 0.74]
    (row,) = decide(run, None, parse_rules({"thresholds": {"ft_hit": ">= 0.5"}})).rows
    assert row.status == "inconclusive" and row.method == "Wilson interval"
    assert row.ci[0] < 0.5 < row.ci[1] and row.decide_n > 20


def test_threshold_reads_a_stored_interval_when_there_are_no_samples():
    run = RunData("c", {("firsttoken", "lead_auroc.top3_mass"): 0.85}, {},
                  intervals={("firsttoken", "lead_auroc.top3_mass"): (0.7, 0.95, 150)})
    (row,) = decide(run, None, parse_rules({"thresholds": {"lead_auroc.top3_mass": ">= 0.6"}})).rows
    assert row.status == "pass" and row.method == "stored interval" and row.ci == (0.7, 0.95)
    (row,) = decide(run, None, parse_rules({"thresholds": {"lead_auroc.top3_mass": ">= 0.8"}})).rows
    assert row.status == "inconclusive"


def test_relative_margin_from_the_rules_file():
    base = [{"ft_hit_prob": 0.1 + 0.001 * i} for i in range(100)]
    slightly = [{"ft_hit_prob": v["ft_hit_prob"] * 0.97} for v in base]
    halved = [{"ft_hit_prob": v["ft_hit_prob"] * 0.5} for v in base]
    rules = parse_rules({"regressions": {"ft_hit_prob": {"relative": 0.1}}})
    b = make_run("b", {"t": base})
    (ok,) = decide(make_run("c", {"t": slightly}), b, rules).rows
    (bad,) = decide(make_run("c", {"t": halved}), b, rules).rows
    assert (ok.status, bad.status) == ("pass", "fail")
    assert ok.margin == "10 % of baseline" and ok.limit == pytest.approx(0.01495)


def test_markdown_and_junit_show_inconclusive():
    run = make_run("b", {"t": hits(20, 10)})
    verdict = decide(make_run("c", {"t": hits(20, 10)}), run, REG)
    md = to_markdown(verdict, "c", "b")
    assert md.splitlines()[0].startswith("## evalkit gate: INCONCLUSIVE")
    assert "| *inconclusive* | regression | t | ft_hit |" in md and "Holm's correction over the 1 checks" in md
    root = ET.fromstring(to_junit(verdict, "c", "b").encode("utf-8"))
    assert root.get("errors") == "1" and root.find("testcase/error").get("type") == "inconclusive"


def test_two_runs_identical_on_every_prompt_pass_the_default_rules_at_full_size_only():
    """q4_1 against fp32 on the default model: the same per-prompt values (transformers computes
    the dequantized weights in fp32 either way). On the firsttoken tasks' 230 / 240 prompts
    (161 / 148 with checkable answers) no discordant pair rules out a 0.05 drop; on 20 it does not."""

    def docs(n, n_checkable, offset):
        return [{"ft_hit": float((i + offset) % 9 == 0), "ft_hit_prob": ((i * 37 + offset) % 100) / 700,
                 "opener_rate": float((i + offset) % 25 == 0), "opener_mass": ((i * 13) % 50) / 1000,
                 **({"answer_hit": float(i % 3 == 0)} if i < n_checkable else {})} for i in range(n)]

    full = {"firsttoken_en": docs(230, 161, 0), "firsttoken_zh": docs(240, 148, 5)}
    verdict = decide(make_run("fp32", full), make_run("q4_1", full), DEFAULT_RULES)
    assert verdict.outcome == "pass", [r.reason for r in verdict.rows if r.status != "pass"]
    assert {r.method for r in verdict.rows if r.status == "pass"} == {"Tango score interval",
                                                                      "identical on every prompt"}
    small = {task: rows[:20] for task, rows in full.items()}
    assert decide(make_run("fp32", small), make_run("q4_1", small), DEFAULT_RULES).outcome == "inconclusive"
