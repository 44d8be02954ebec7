"""`evalkit run --metrics gate|all|NAME,...`: the selection, what a skipped metric becomes, and the gate on it."""

from __future__ import annotations

import json
import re

import duckdb
import pytest

from evalkit.contract import FirstStepResult
from evalkit.errors import BadInput
from evalkit.release.decide import RunData, decide
from evalkit.release.rules import DEFAULT_RULES, parse_rules
from evalkit.scoring import registry, selection
from evalkit.scoring.firsttoken import score

# ---------------------------------------------------------------------------- parsing


def test_gate_is_what_the_default_rules_read():
    """Every default rule's metric is computed by `--metrics gate`, or read through what stands for it: its
    exact twin, which a default rule checks too, or its stand-in, which the gate checks in its place; and
    gate computes nothing no rule reads."""
    gate = selection.parse("gate")
    ruled = [r.metric for r in (*DEFAULT_RULES.thresholds, *DEFAULT_RULES.regressions)]
    read = set()
    for metric in ruled:
        reads = registry.gate_reads(metric)
        assert gate.computes(reads), f"--metrics gate does not compute {reads}, which the rule on {metric} reads"
        known = registry.METRICS[metric]
        twin = registry.METRICS[known.twin] if known.twin else None
        assert reads == metric or (twin and reads in (twin.name, twin.stand_in) and twin.name in ruled) \
            or reads == known.stand_in, metric
        if reads != metric:
            assert not gate.computes(metric), f"gate computes {metric} and a stand-in for it"
        read.add(reads)
    assert set(registry.GATE_METRICS) == read


def test_gate_skips_the_decode_and_units_of_first_token_prompts():
    gate = selection.parse("gate")
    for phase in ("response", "answer", "units"):
        assert not gate.runs(phase, "firsttoken"), phase
    assert gate.runs("response", "needle")  # needle_recall reads the needle documents' responses
    assert not gate.runs("opener_trie", "firsttoken")  # opener_start_mass stands in for opener_mass
    assert gate.runs("response", None)  # lm-eval's own tasks score their text
    for phase in ("first_step", "start_trie", "answer_trie"):
        assert gate.runs(phase, "firsttoken")
    assert gate.computes("opener_start_mass") and not gate.computes("opener_mass")


@pytest.mark.parametrize("text, everything, names", [
    (None, True, None),
    ("all", True, None),
    (" ft_hit_prob , js_div,ft_hit_prob", False, {"ft_hit_prob", "js_div"}),
    ("needle_recall@depth0.5", False, {"needle_recall@depth{D}"}),
    ("gate,entropy", False, set(registry.GATE_METRICS) | {"entropy"}),
])
def test_parse(text, everything, names):
    chosen = selection.parse(text)
    assert chosen.everything is everything
    if names is not None:
        assert chosen.metrics == names
    assert "first_step" in chosen.phases


@pytest.mark.parametrize("text, words", [
    ("ft_hitt", "unknown metric 'ft_hitt' (did you mean ft_hit?)"),
    ("gates", "unknown metric 'gates'"),
    ("needle_recall@depth2", "unknown metric 'needle_recall@depth2'"),
    (" , ", "--metrics is empty"),
])
def test_a_name_that_matches_nothing_is_refused_with_the_known_names(text, words):
    with pytest.raises(BadInput) as info:
        selection.parse(text)
    assert words in str(info.value)
    if "unknown" in words:
        assert "known: gate, all, ft_hit, " in str(info.value)


def test_skipped_metrics_say_why():
    skipped = selection.parse("ft_hit_prob").skipped()
    assert skipped["opener_mass"].startswith("not computed: --metrics ft_hit_prob skips the candidate trie of "
                                             "the opener lexicon")
    assert "answer_hit" in skipped and "ft_hit_prob" not in skipped and "entropy" not in skipped
    assert selection.EVERYTHING.skipped() == {}


# ---------------------------------------------------------------------------- NULL, never 0


def _result(text, skipped=(), metrics=None, answer=None):
    return FirstStepResult(text=text, first_token_id=5, first_token="Par", first_unit=None if text is None else "P",
                           metrics=metrics or {}, answer_text=answer, skipped=tuple(skipped))


def test_a_skipped_metric_is_absent_never_zero():
    doc = {"kind": "firsttoken", "answers": ["Paris"], "answers_full": ["Paris"]}
    skipped = selection.parse("gate").skipped()
    values = score(doc, _result(None, skipped, {"ft_hit_prob": 0.2, "opener_start_mass": 0.01, "answer_prob": 0.3,
                                                "ft_token_hit": 1.0}), ["Sure"])
    assert values == {"ft_hit_prob": 0.2, "opener_start_mass": 0.01, "answer_prob": 0.3, "ft_token_hit": 1.0}
    # a value an engine gave for a metric the selection skips is not kept either
    assert "opener_mass" not in score(doc, _result(None, skipped, {"opener_mass": 0.0}), ["Sure"])
    # a response decoded without its answer continuation: answer_hit is not read off the short response
    values = score(doc, _result("Paris", selection.parse("ft_hit").skipped()), ["Sure"])
    assert values["ft_hit"] == 1.0 and "answer_hit" not in values and "ft_answer_mismatch" not in values


# ---------------------------------------------------------------------------- the gate


def _runs(n=40, seed=0):
    """(an all run, a gate run of the same model): the gate run lacks the decode's metrics, and says why."""
    import random

    rng = random.Random(seed)
    full, gated = {}, {}
    for i in range(n):
        p = rng.uniform(0.2, 0.8)
        values = {"ft_hit": float(rng.random() < p), "ft_hit_prob": p, "opener_rate": 0.0, "opener_mass": 0.01,
                  "opener_start_mass": 0.05, "answer_hit": float(rng.random() < p), "answer_prob": p / 2}
        full[("firsttoken_en", str(i))] = values
        gated[("firsttoken_en", str(i))] = {k: v for k, v in values.items()
                                            if k.endswith(("prob", "start_mass"))}
    why = {m: r for m, r in selection.parse("gate").skipped().items()}
    return RunData("full", {}, full), RunData("gate", {}, gated, not_computed=why)


def test_gate_on_a_gate_run_passes_itself_and_sees_every_rule():
    _, gated = _runs()
    verdict = decide(gated, gated, DEFAULT_RULES)
    assert verdict.outcome == "pass"
    rows = {r.metric: r for r in verdict.rows if r.task in ("firsttoken_en", None)}
    for metric in ("ft_hit_prob", "answer_prob", "opener_start_mass"):
        assert rows[metric].status == "pass", rows[metric]
    for metric, word in (("ft_hit", "exact twin ft_hit_prob"), ("answer_hit", "exact twin answer_prob"),
                         ("opener_rate", "stand-in opener_start_mass"), ("opener_mass", "stand-in opener_start_mass")):
        row = rows[metric]
        assert row.status == "skipped", row
        assert row.reason.startswith("not computed: run gate did not compute") and "--metrics gate skips" in row.reason
        assert f"its {word} passes" in row.reason, row.reason


def test_gate_says_when_the_candidate_did_not_compute_a_rules_metric():
    full, gated = _runs()
    verdict = decide(gated, full, DEFAULT_RULES)
    by = {(r.task, r.metric): r for r in verdict.rows}
    row = by[("firsttoken_en", "answer_hit")]
    assert row.status in ("skipped", "inconclusive") and row.status != "fail"
    assert "not computed: run gate did not compute 'answer_hit' (--metrics gate skips the answer continuation)" \
        in row.reason
    # a rules file reading a metric the candidate did not compute: inconclusive, never a fail, and said
    rules = parse_rules({"thresholds": {"ft_hit": ">= 0.1"}, "regressions": {"answer_hit": 0.05}}, source="r.yaml")
    verdict = decide(gated, full, rules)
    assert verdict.outcome == "inconclusive"
    assert {r.status for r in verdict.rows} == {"inconclusive"}
    assert all(r.reason.startswith("not computed: run gate did not compute") for r in verdict.rows)


# ---------------------------------------------------------------------------- end to end


def _run(invoke, model_dir, db, metrics):
    res = invoke("run", "--model", "hf", "--model-args", f"pretrained={model_dir}", "--device", "cpu",
                 "--tasks", "firsttoken", "--limit", 3, "--metrics", metrics, "--db", db)
    assert res.exit_code == 0, res.output
    return re.search(r"^run (\S+)\s+done", res.stdout, re.MULTILINE).group(1)


def test_a_gate_run_stores_nulls_with_reasons_and_gates(invoke, tiny_model_dir, tmp_path):
    db = tmp_path / "g.duckdb"
    gate_id = _run(invoke, tiny_model_dir, db, "gate")
    all_id = _run(invoke, tiny_model_dir, db, "all")
    with duckdb.connect(str(db), read_only=True) as con:
        selected, unavailable = con.execute("SELECT metric_selection, unavailable FROM runs WHERE id = ?",
                                            [gate_id]).fetchone()
        rows = con.execute("SELECT ft_hit, opener_rate, answer_hit, response, first_unit, ft_outcome, opener_mass, "
                           "ft_hit_prob, opener_start_mass, first_token FROM samples WHERE run_id = ?",
                           [gate_id]).fetchall()
        answer_probs = con.execute("SELECT count(answer_prob) FROM samples WHERE run_id = ?", [gate_id]).fetchone()
        units = con.execute("SELECT count(unit) FROM first_token_topk WHERE run_id = ?", [gate_id]).fetchone()
        metrics = {m for (m,) in con.execute("SELECT DISTINCT metric FROM metrics WHERE run_id = ?",
                                             [gate_id]).fetchall()}
        full = con.execute("SELECT metric_selection, unavailable FROM runs WHERE id = ?", [all_id]).fetchone()
        bounds = con.execute("SELECT opener_mass, opener_start_mass FROM samples WHERE run_id = ? AND task LIKE "
                             "'firsttoken%'", [all_id]).fetchall()
    assert selected == "gate" and full == ("all", None)
    # the stand-in bounds opener_mass from above on every prompt (docs/metrics.md §1.2)
    assert bounds and all(start >= mass - 1e-6 for mass, start in bounds), bounds
    reasons = json.loads(unavailable)
    assert reasons["ft_hit"] == "not computed: --metrics gate skips the greedy response"
    assert reasons["answer_hit"] == "not computed: --metrics gate skips the answer continuation"
    assert "needle_recall" not in reasons  # not a metric of these tasks
    assert rows and all(r[:7] == (None,) * 7 for r in rows)  # NULL, never 0 or ""
    assert all(r[7] is not None and r[8] is not None and r[9] for r in rows)
    assert answer_probs[0] > 0 and units == (0,)
    assert not metrics & {"ft_hit", "opener_rate", "answer_hit", "opener_mass"}
    assert {"ft_hit_prob", "opener_start_mass"} <= metrics

    res = invoke("gate", "--candidate", gate_id, "--baseline", gate_id, "--db", db)
    assert res.exit_code == 0, res.output
    for metric in ("ft_hit", "answer_hit", "opener_rate", "opener_mass"):
        assert re.search(rf"{metric} .*not computed: run {gate_id} did not compute", res.output), res.output
    # the gate run against the full one: every rule is either checked or said not computed, none fails on it
    res = invoke("gate", "--candidate", gate_id, "--baseline", all_id, "--db", db)
    assert "metric missing" not in res.output
    assert f"not computed: run {gate_id} did not compute 'ft_hit'" in res.output


def test_an_unknown_metric_name_is_exit_2_and_writes_nothing(invoke, tmp_path):
    db = tmp_path / "none.duckdb"
    res = invoke("run", "--model", "evalkit-fake", "--tasks", "firsttoken", "--metrics", "ft_hit_prob,opener_mas",
                 "--db", db)
    assert res.exit_code == 2
    assert "unknown metric 'opener_mas' (did you mean opener_mass?)" in res.output
    assert not db.exists()


def test_drift_needs_the_responses(invoke, tiny_model_dir, tmp_path):
    res = invoke("run", "--model", "hf", "--model-args", f"pretrained={tiny_model_dir}", "--tasks", "firsttoken",
                 "--metrics", "gate", "--keep-distributions", "--db", tmp_path / "d.duckdb")
    assert res.exit_code == 2 and "--keep-distributions reads the greedy responses" in res.output


def test_compare_says_which_metrics_a_run_did_not_compute(invoke, tiny_model_dir, tmp_path):
    db = tmp_path / "c.duckdb"
    gate_id = _run(invoke, tiny_model_dir, db, "gate")
    all_id = _run(invoke, tiny_model_dir, db, "all")
    res = invoke("compare", all_id, gate_id, "--db", db)
    assert res.exit_code == 0, res.output
    assert (f"ft_hit: not computed: run {gate_id} did not compute it (--metrics gate skips the greedy response)"
            in res.output)
    assert "ft_hit_prob: not computed" not in res.output


def test_the_server_engine_asks_for_one_token_and_no_echo_it_does_not_read(tiny_model_dir):
    """Under `--metrics ft_hit_prob`, the server engine asks for one token where no response is read, sends the
    accepted starts' echo but not the checkable answers', and leaves the response NULL."""
    from transformers import AutoTokenizer

    from evalkit.engines.server.model import ECHO_PROBE, EvalkitServer, piece_ids
    from tests.fake_server import FakeServer, healthy

    ids = piece_ids(AutoTokenizer.from_pretrained(tiny_model_dir))
    words = [t for t in ids if t.strip().isalpha() and len(t.strip()) > 2][:3]
    sent: list[dict] = []
    inner = healthy({words[0]: -0.3, words[1]: -2.5, words[2]: -3.0})

    def answer(method, path, body):
        if isinstance(body, dict) and not str(body.get("prompt", "")).startswith(ECHO_PROBE):
            sent.append(body)
        return inner(method, path, body)

    doc = {"kind": "firsttoken", "prompt": "a question", "answers": [words[0].strip()], "answers_full": ["Paris"]}
    with FakeServer(answer) as url:
        lm = EvalkitServer(url, tokenizer=str(tiny_model_dir), retries=0, timeout=5, top_k=3, top_logprobs=3,
                           temperature=1.0)
        lm.select(selection.parse("ft_hit_prob"))
        result = lm._one("Q: a question\nA:", {"until": ["\n"], "max_gen_toks": 16}, doc)
    completions = [b for b in sent if not b.get("echo")]
    echoes = [b for b in sent if b.get("echo")]
    assert [b["max_tokens"] for b in completions] == [1]
    assert all("Paris" not in b["prompt"] for b in echoes)  # (none at all where the echo check failed)
    assert result.text is None and result.answer_text is None and "answer_prob" not in result.metrics
    assert "answer_hit" in result.skipped and "ft_hit_prob" not in result.skipped
