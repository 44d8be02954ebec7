"""`evalkit compare` and `compare_runs` on synthetic runs written straight into the DB."""

from __future__ import annotations

import json
import math

import pytest

from evalkit.compare import ALL_TASKS, compare_runs
from evalkit.store import db as store_db
from evalkit.store import runs, sandbox


def _log2(x):
    return math.log(x, 2)


def make_run(run_id, samples, topk=None, created="2025-01-01 00:00:00"):
    """samples: {(task, doc_id): {metric: value}}; topk: {(task, doc_id): [(token_id, prob), ...]}."""
    runs.insert_run(None, {"id": run_id, "created_at": created, "status": "running", "model": "synthetic"})
    sample_rows = [{"run_id": run_id, "task": t, "doc_id": d, **vals} for (t, d), vals in samples.items()]
    topk_rows = [
        {"run_id": run_id, "task": t, "doc_id": d, "rank": r, "token_id": tid, "token": f"t{tid}",
         "logprob": math.log(p)}
        for (t, d), toks in (topk or {}).items()
        for r, (tid, p) in enumerate(toks)
    ]
    runs.finish_run(None, run_id, metrics=[], samples=sample_rows, topk=topk_rows, status="done")
    return run_id


def ranked(*ids, head=0.4):
    """A top-k list over `ids`, most likely first: head, then equal shares of 0.5 (rest 0.1)."""
    tail = 0.5 / (len(ids) - 1)
    return [(ids[0], head)] + [(i, tail) for i in ids[1:]]


EN = [("firsttoken_en", f"en-{i}") for i in range(6)]
ZH = [("firsttoken_zh", f"zh-{i}") for i in range(4)]
KEYS = EN + ZH


def base_samples(hit=lambda k: 1.0 if k[1].endswith(("0", "2")) else 0.0):
    return {k: {"ft_hit": hit(k), "top3_mass": 0.5 + 0.01 * i, "entropy": 2.0} for i, k in enumerate(KEYS)}


def base_topk():
    return {k: ranked(10 + i, 1, 2, 3, 4, 5, 6) for i, k in enumerate(KEYS)}


def by_task(rows):
    return {r.task: r for r in rows}


def test_identical_runs_have_no_drift_and_zero_deltas():
    a = make_run("aaaa-1", base_samples(), base_topk())
    b = make_run("bbbb-1", base_samples(), base_topk(), created="2025-01-02 00:00:00")
    c = compare_runs(None, a, b)
    assert (c.run_a, c.run_b, c.n_shared) == (a, b, len(KEYS))
    assert c.drift_note is None
    drift = by_task(c.drift)
    assert set(drift) == {"firsttoken_en", "firsttoken_zh", ALL_TASKS}
    assert drift[ALL_TASKS].n == len(KEYS) and drift["firsttoken_en"].n == len(EN)
    for row in c.drift:
        assert row.top5_overlap == 1.0
        assert row.js_div == pytest.approx(0.0, abs=1e-12)
        assert row.flip_rate == 0.0
        assert row.top5_mass_a == pytest.approx(0.4 + 4 * 0.5 / 6)
        assert row.top5_mass_a == row.top5_mass_b
    assert {d.metric for d in c.deltas} == {"ft_hit", "top3_mass", "entropy"}
    for d in c.deltas:
        assert (d.delta, d.lo, d.hi) == (0.0, None, None)  # 10 pairs: no interval (a bootstrap needs 20)
        assert d.mean_a == d.mean_b


def test_flips_are_counted_exactly_and_overlap_follows_top5():
    topk_a = base_topk()
    topk_b = base_topk()
    flipped = [EN[0], EN[3], ZH[1]]
    for k in flipped:  # swap rank 0 and rank 1: a flip, same top-5 set
        (t0, p0), (t1, p1) = topk_b[k][0], topk_b[k][1]
        topk_b[k] = [(t1, p0), (t0, p1)] + topk_b[k][2:]
    # a prompt whose top-5 shares only its top-1 with A (no flip): overlap 1/5
    topk_b[EN[5]] = [topk_a[EN[5]][0]] + [(100 + j, 0.5 / 6) for j in range(6)]
    a = make_run("aaaa-2", base_samples(), topk_a)
    b = make_run("bbbb-2", base_samples(), topk_b)
    drift = by_task(compare_runs(None, a, b).drift)
    assert drift[ALL_TASKS].flip_rate == pytest.approx(3 / 10)
    assert drift["firsttoken_en"].flip_rate == pytest.approx(2 / 6)
    assert drift["firsttoken_zh"].flip_rate == pytest.approx(1 / 4)
    assert drift["firsttoken_en"].top5_overlap == pytest.approx((5 * 1.0 + 0.2) / 6)
    assert drift["firsttoken_zh"].top5_overlap == 1.0
    assert drift["firsttoken_zh"].js_div > 0  # the swapped probabilities moved


def test_js_divergence_matches_a_hand_computation():
    key = ("firsttoken_en", "en-0")
    other = ("firsttoken_en", "en-1")
    a = make_run("aaaa-3", {key: {"ft_hit": 1.0}, other: {"ft_hit": 1.0}},
                 {key: [(1, 0.5), (2, 0.5)], other: [(1, 0.6)]})
    b = make_run("bbbb-3", {key: {"ft_hit": 1.0}, other: {"ft_hit": 1.0}},
                 {key: [(1, 1.0)], other: [(1, 0.6), (2, 0.4)]})
    # key: p = (1/2, 1/2), q = (1, 0), m = (3/4, 1/4)
    js_key = 0.5 * (0.5 * _log2(0.5 / 0.75) + 0.5 * _log2(0.5 / 0.25)) + 0.5 * (1.0 * _log2(1.0 / 0.75))
    # other: p = (0.6, 0, rest 0.4), q = (0.6, 0.4, rest 0), m = (0.6, 0.2, 0.2)
    js_other = 0.5 * (0.4 * _log2(0.4 / 0.2)) + 0.5 * (0.4 * _log2(0.4 / 0.2))
    assert js_key == pytest.approx(0.311278, abs=1e-6) and js_other == pytest.approx(0.4)
    row = by_task(compare_runs(None, a, b).drift)["firsttoken_en"]
    assert row.js_div == pytest.approx((js_key + js_other) / 2, abs=1e-9)
    assert row.flip_rate == 0.0
    assert row.top5_overlap == pytest.approx((1 / 5 + 1 / 5) / 2)
    assert row.top5_mass_a == pytest.approx((1.0 + 0.6) / 2)
    assert row.top5_mass_b == pytest.approx((1.0 + 1.0) / 2)


def test_metric_deltas_are_b_minus_a_with_a_ci():
    a = make_run("aaaa-4", base_samples(hit=lambda k: 0.0), base_topk())
    b = make_run("bbbb-4", base_samples(hit=lambda k: 1.0 if k in EN[:3] + ZH[:2] else 0.0), base_topk())
    deltas = {(d.task, d.metric): d for d in compare_runs(None, a, b).deltas}
    d = deltas[(ALL_TASKS, "ft_hit")]
    assert (d.n, d.mean_a, d.mean_b, d.delta) == (10, 0.0, 0.5, 0.5)
    assert d.lo is None and d.hi is None  # 10 pairs: too few for an interval, as the gate (20)
    en = deltas[("firsttoken_en", "ft_hit")]
    assert (en.n, en.delta) == (6, 0.5)
    # reversed: the delta flips its sign
    back = {(x.task, x.metric): x for x in compare_runs(None, b, a).deltas}[(ALL_TASKS, "ft_hit")]
    assert back.delta == -0.5 and back.mean_a == 0.5


def test_only_shared_prompts_count_and_text_only_runs_skip_the_distribution():
    samples_b = {k: {"ft_hit": 1.0, "opener_rate": 0.0} for k in KEYS[:7] + [("firsttoken_en", "new")]}
    a = make_run("aaaa-5", base_samples(), base_topk())
    b = make_run("bbbb-5", samples_b)  # text-only backend: no top-k rows
    c = compare_runs(None, a, b)
    assert c.n_shared == 7
    assert c.drift == []
    assert "omitted" in c.drift_note and "run B" in c.drift_note
    assert {d.metric for d in c.deltas} == {"ft_hit"}  # opener_rate only in B, top3_mass only in A
    assert {(d.task, d.n) for d in c.deltas} == {("firsttoken_en", 6), ("firsttoken_zh", 1), (ALL_TASKS, 7)}


def test_run_drift_view_agrees_with_compare():
    topk_b = base_topk()
    topk_b[EN[1]] = [(999, 0.9)]
    a = make_run("aaaa-6", base_samples(), base_topk())
    b = make_run("bbbb-6", base_samples(), topk_b)
    cols, rows = sandbox.read_query(
        None, f"SELECT task, n, top5_overlap, flip_rate, top5_mass_a, top5_mass_b FROM run_drift "
              f"WHERE run_a = '{a}' AND run_b = '{b}' ORDER BY task")
    drift = by_task(compare_runs(None, a, b).drift)
    assert [r[0] for r in rows] == ["firsttoken_en", "firsttoken_zh"]
    for task, n, overlap, flip, mass_a, mass_b in rows:
        assert n == drift[task].n
        assert overlap == pytest.approx(drift[task].top5_overlap)
        assert flip == pytest.approx(drift[task].flip_rate)
        assert mass_a == pytest.approx(drift[task].top5_mass_a)
        assert mass_b == pytest.approx(drift[task].top5_mass_b)


# --- CLI ---------------------------------------------------------------------------------


def test_cli_prints_drift_and_deltas(invoke):
    topk_b = base_topk()
    topk_b[EN[0]] = [(999, 0.9)]
    make_run("aaaa-7", base_samples(), base_topk(), created="2025-01-01 00:00:00")
    make_run("bbbb-7", base_samples(hit=lambda k: 1.0), topk_b, created="2025-01-02 00:00:00")
    with store_db.transaction() as con:
        con.execute("INSERT INTO tags VALUES ('prod', 'aaaa-7', now())")
    res = invoke("compare", "tag:prod", "latest")
    assert res.exit_code == 0, res.output
    out = res.output
    assert "A = aaaa-7   B = bbbb-7   shared prompts: 10" in out
    assert "first-token drift" in out and "js_div" in out and "flip_rate" in out
    assert "metric deltas B - A" in out and "ci_lo" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("all") and "flip" not in ln and len(ln.split()) == 8)
    assert line.split()[1] == "10" and float(line.split()[6]) == pytest.approx(0.1)

    res = invoke("compare", "aaaa", "bbbb", "--format", "json")
    data = json.loads(res.output)
    assert data["run_a"] == "aaaa-7" and data["n_shared"] == 10
    hit = next(d for d in data["deltas"] if d["task"] == "all" and d["metric"] == "ft_hit")
    assert hit["mean_a"] == pytest.approx(0.4) and hit["delta"] == pytest.approx(0.6)
    assert {"delta", "ci_lo", "ci_hi"} <= set(hit)

    res = invoke("compare", "aaaa", "bbbb", "--format", "csv")
    lines = res.output.splitlines()
    assert lines[0] == "task,metric,n,mean_a,mean_b,delta,ci_lo,ci_hi"
    assert any(ln.startswith("all,drift:flip_rate,10,") for ln in lines)
    assert any(ln.startswith("all,ft_hit,10,") for ln in lines)


def test_cli_no_shared_prompts_is_bad_input(invoke):
    make_run("aaaa-8", {("firsttoken_en", "en-0"): {"ft_hit": 1.0}})
    make_run("bbbb-8", {("firsttoken_zh", "zh-0"): {"ft_hit": 1.0}})
    res = invoke("compare", "aaaa-8", "bbbb-8")
    assert res.exit_code == 2
    assert "share no prompts" in res.output


def test_cli_unknown_run_is_bad_input(invoke):
    make_run("aaaa-9", {("firsttoken_en", "en-0"): {"ft_hit": 1.0}})
    res = invoke("compare", "aaaa-9", "nope")
    assert res.exit_code == 2
    assert "unknown run 'nope'" in res.output


def test_the_model_dimension_is_the_models_name_not_the_engine_it_was_asked_by():
    """A GGUF run through `--model llamacpp` stores `model` = llamacpp and its name (gemma-3-270M) apart:
    `compare` says the runs differ in model by the names `runs` shows."""
    a = make_run("aaaa-3", base_samples(), base_topk())
    b = make_run("bbbb-3", base_samples(), base_topk(), created="2025-01-02 00:00:00")
    with store_db.transaction() as con:
        con.execute("UPDATE runs SET model = 'llamacpp', model_name = 'gemma-3-270M' WHERE id = ?", [b])
        con.execute("UPDATE runs SET model_name = 'SmolLM2-135M-Instruct' WHERE id = ?", [a])
    assert compare_runs(None, a, b).dimensions["model"] == ("SmolLM2-135M-Instruct", "gemma-3-270M")
