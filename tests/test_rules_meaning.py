"""Rules files whose meaning must not change quietly (issue 36, class 9): YAML 1.1's number and
boolean forms, numbers inside comparisons, known directions, and a task/metric rule beside a
metric rule (docs/gate.md, "The rules file": a task/metric rule may only tighten)."""

import pytest

from evalkit.errors import BadInput
from evalkit.release.decide import decide
from evalkit.release.rules import Regression, Threshold, load_rules, parse_rules
from tests.test_gate import hits, make_run


def rules_file(tmp_path, text):
    path = tmp_path / "rules.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("spec", ['">= 0_5"', '">= 1_000"', '">= 0x1"', '">= ５"', '">= 1e400"', '">= -inf"',
                                  '">= infinity"', '">= 0.5e"', '">= ."'])
def test_a_comparison_holds_a_plain_decimal_number_only(tmp_path, spec):
    # ">= 0_5" was read as ">= 5": Python's float() takes underscores, full-width digits and "inf"
    path = rules_file(tmp_path, f"thresholds:\n  ft_hit: {spec}\n")
    with pytest.raises(BadInput, match=r"thresholds\.ft_hit: bad number"):
        load_rules(path)


@pytest.mark.parametrize("spec, value", [('">= 0.5"', 0.5), ('">= .5"', 0.5), ('"<= 5."', 5.0),
                                         ('">= 1e-3"', 1e-3), ('"> -2.5E+2"', -250.0), ('">= 1e308"', 1e308)])
def test_a_comparison_reads_every_decimal_form(tmp_path, spec, value):
    # a metric the registry gives no range (a range would refuse most of these bounds)
    (rule,) = load_rules(rules_file(tmp_path, f"thresholds:\n  my_score: {spec}\n")).thresholds
    assert rule.value == value


@pytest.mark.parametrize("text, value", [("1e308", 1e308), ("2E-2", 0.02), ("0.02", 0.02), ("0", 0.0), (".5", 0.5),
                                         ("1", 1.0)])
def test_an_unquoted_margin_is_the_number_it_reads_as(tmp_path, text, value):
    # PyYAML (YAML 1.1) read 1e308 as a string and the user was told a number is not a number
    (rule,) = load_rules(rules_file(tmp_path, f"regressions:\n  my_score: {text}\n")).regressions
    assert rule.margin.value == value


@pytest.mark.parametrize("text", ["0_5", "010", "1:30", "0x1f", "0o7", "2020-01-01", "+.inf", ".nan", "1_0e-2"])
def test_yaml_1_1_number_forms_are_refused_not_reinterpreted(tmp_path, text):
    # YAML 1.1 reads 0_5 as 5, 010 as 8, 1:30 as 90, 0x1f as 31: none of them is what the user sees
    with pytest.raises(BadInput, match=r"regressions\.ft_hit") as info:
        load_rules(rules_file(tmp_path, f"regressions:\n  ft_hit: {text}\n"))
    assert "\n" not in str(info.value)


def test_a_quoted_number_margin_says_to_unquote_it(tmp_path):
    with pytest.raises(BadInput, match="quoted text; write the number unquoted"):
        load_rules(rules_file(tmp_path, "regressions:\n  ft_hit: '0.02'\n"))


@pytest.mark.parametrize("word", ["yes", "no", "on", "off", "y", "n", "Yes", "OFF"])
def test_a_direction_is_true_or_false_only(tmp_path, word):
    text = f"regressions:\n  my_metric: 0.02\nhigher_is_better:\n  my_metric: {word}\n"
    with pytest.raises(BadInput, match=r"higher_is_better\.my_metric: expected true or false"):
        load_rules(rules_file(tmp_path, text))


def test_flipping_a_known_direction_is_refused_from_a_file(tmp_path):
    # issue 36: higher_is_better {ft_hit: false} made a total loss pass
    text = "regressions:\n  ft_hit: 0.02\nhigher_is_better:\n  ft_hit: false\n"
    with pytest.raises(BadInput, match="never flips a known one"):
        load_rules(rules_file(tmp_path, text))


# -- a task/metric rule beside a metric rule: it may only tighten -----------------------------


@pytest.mark.parametrize("general, specific", [
    (0.02, 0.5), (0.02, 0.02), ({"relative": 0.1}, {"relative": 0.2}), ({"delta": 0.05}, 0.05)])
def test_a_looser_or_equal_task_rule_is_refused(general, specific):
    with pytest.raises(BadInput, match=r"regressions\.t/ft_hit: .* is not stricter than regressions\.ft_hit"):
        parse_rules({"regressions": {"ft_hit": general, "t/ft_hit": specific}})


def test_a_task_rule_of_another_margin_kind_is_refused():
    with pytest.raises(BadInput, match="cannot tell whether it is stricter"):
        parse_rules({"regressions": {"ft_hit": 0.02, "t/ft_hit": {"relative": 0.01}}})


@pytest.mark.parametrize("general, specific, ok", [
    (">= 0.5", ">= 0.6", True), (">= 0.5", "> 0.5", True), (">= 0.5", ">= 0.4", False), ("> 0.5", ">= 0.5", False),
    ("<= 0.2", "<= 0.1", True), ("<= 0.2", "< 0.2", True), ("<= 0.2", "<= 0.3", False), ("<= 0.2", "<= 0.2", False)])
def test_threshold_task_rules_may_only_tighten(general, specific, ok):
    doc = {"thresholds": {"ft_hit": general, "t/ft_hit": specific}}
    if ok:
        assert len(parse_rules(doc).thresholds) == 2
    else:
        with pytest.raises(BadInput, match=r"thresholds\.t/ft_hit: .* is not stricter"):
            parse_rules(doc)


@pytest.mark.parametrize("general, specific", [(">= 0.5", "<= 0.9"), (">= 0.5", "== 0.7"), ("== 0.5", ">= 0.5")])
def test_threshold_task_rules_on_another_side_are_refused(general, specific):
    with pytest.raises(BadInput, match="cannot tell whether it is stricter"):
        parse_rules({"thresholds": {"ft_hit": general, "t/ft_hit": specific}})


def test_a_stricter_task_rule_fails_what_the_metric_rule_passes():
    # the stricter binds on its task: a drop of 0.05 passes a 0.2 margin and fails a 0.01 one
    rules = parse_rules({"regressions": {"ft_hit": 0.2, "zh/ft_hit": 0.01}})
    assert rules.regressions == (Regression("ft_hit", 0.2), Regression("ft_hit", 0.01, task="zh"))
    base = make_run("base", {"zh": hits(2000, 1500), "en": hits(2000, 1500)})
    cand = make_run("cand", {"zh": hits(2000, 1400), "en": hits(2000, 1400)})
    verdict = decide(cand, base, rules)
    statuses = {(r.task, r.margin): r.status for r in verdict.rows}
    assert statuses[("zh", "0.01")] == "fail"
    assert statuses[("zh", "0.2")] == statuses[("en", "0.2")] == "pass"
    assert verdict.outcome == "fail"


def test_task_rules_without_a_metric_rule_are_independent():
    rules = parse_rules({"regressions": {"zh/ft_hit": 0.5, "en/ft_hit": 0.01},
                         "thresholds": {"zh/ft_hit": ">= 0.1", "en/ft_hit": "<= 0.9"}})
    assert len(rules.regressions) == 2 and len(rules.thresholds) == 2
    assert rules.thresholds[0] == Threshold("ft_hit", ">=", 0.1, task="zh")


@pytest.mark.parametrize("key, spec", [("ft_hit", ">= 1.01"), ("ft_hit", "> 1"), ("ft_hit_prob", "<= -0.1"),
                                       ("t/opener_mass", "== 1.5"), ("entropy", "< 0"), ("start_gap", ">= -1.5"),
                                       ("lead_auroc.entropy", ">= 2"), ("needle_recall@depth0.5", "<= -1"),
                                       ("answer_hit", "< 0")])
def test_a_bound_outside_the_metrics_range_is_refused(tmp_path, key, spec):
    # ft_hit >= 1.01 was decided as if a share could pass it
    with pytest.raises(BadInput, match=rf"thresholds\.{key}: {spec} is outside what .* can reach"):
        load_rules(rules_file(tmp_path, f'thresholds:\n  {key}: "{spec}"\n'))


@pytest.mark.parametrize("key, spec", [("ft_hit", ">= 1"), ("ft_hit", "<= 0"), ("ft_hit", ">= 0"), ("entropy", "<= 50"),
                                       ("start_gap", ">= -1"), ("drift_first_ratio", "<= 1000")])
def test_a_bound_at_the_edge_of_the_range_is_kept(tmp_path, key, spec):
    (rule,) = load_rules(rules_file(tmp_path, f'thresholds:\n  {key}: "{spec}"\n')).thresholds
    assert rule.metric == key


def test_a_drop_wider_than_the_range_is_refused(tmp_path):
    with pytest.raises(BadInput, match=r"regressions\.ft_hit: a margin of 1\.5 can never fail: the largest possible drop is 1"):
        load_rules(rules_file(tmp_path, "regressions:\n  ft_hit: 1.5\n"))
    assert load_rules(rules_file(tmp_path, "regressions:\n  start_gap: 1.9\n")).regressions[0].margin.value == 1.9
    with pytest.raises(BadInput, match="can never fail"):  # a drop equal to the whole width cannot exceed it
        load_rules(rules_file(tmp_path, "regressions:\n  start_gap: 2\n"))
