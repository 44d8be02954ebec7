"""bench/gate_calibration.py on synthetic runs: its draws do what docs/gate.md says they do.

A/A swaps keep each prompt's pair of values; the planted drops are noisy and their mean is
k x the margin; a benign pair of near-identical runs passes, a 2x drop fails, and the table's
targets are marked where missed.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest

from evalkit.release.decide import RunData
from evalkit.scoring import registry

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gate_calibration", ROOT / "bench" / "gate_calibration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic(n=150, noise=0.02, seed=0):
    """A baseline and a benign candidate: probabilities within a few % per prompt, 0/1 outcomes that
    rarely differ."""
    rng = random.Random(seed)
    base, cand = {}, {}
    for task in ("en", "zh"):
        for i in range(n):
            p, q, o = rng.uniform(0.05, 0.8), rng.uniform(0.05, 0.8), rng.uniform(0.0, 0.05)
            hit = float(rng.random() < 0.6)
            b = {"ft_hit": hit, "ft_hit_prob": p, "answer_hit": hit, "answer_prob": q, "opener_rate": 0.0,
                 "opener_mass": o, "js_div": 0.0}  # the baseline's distance from itself
            c = {m: (v * (1 + rng.uniform(-noise, noise)) if m.endswith(("prob", "mass")) else v) for m, v in b.items()}
            c["js_div"] = rng.uniform(0.001, 0.006)  # a benign pair's first-token distance (bits)
            if rng.random() < 0.01:
                c["ft_hit"] = 1.0 - c["ft_hit"]
            base[(task, str(i))], cand[(task, str(i))] = b, c
    return RunData("base", {}, base), RunData("cand", {}, cand)


def test_aa_swaps_keep_every_prompts_pair(bench):
    base, cand = synthetic(20)
    rng = np.random.default_rng(0)
    picks = bench.draw(bench.shared_by_task(base, cand), None, rng)
    left, right = bench.aa_pair(base, cand, picks, rng)
    swapped = 0
    for task, doc, key in picks:
        for m in bench.HEADLINE:
            if m in base.samples[(task, doc)]:
                pair = {left.samples[(task, key)][m], right.samples[(task, key)][m]}
                assert pair == {base.samples[(task, doc)][m], cand.samples[(task, doc)][m]}
                swapped += left.samples[(task, key)][m] != base.samples[(task, doc)][m]
    assert swapped > 0


@pytest.mark.parametrize("k", [0.5, 2.0])
def test_planted_drops_are_noisy_with_the_mean_asked_for(bench, k):
    base, cand = synthetic(400)
    rng = np.random.default_rng(1)
    picks = bench.draw(bench.shared_by_task(base, cand), None, rng)
    planted, ref = bench.planted_pair(base, cand, picks, k, rng)
    c = np.array([planted.samples[key]["answer_prob"] for key in planted.samples])
    own = np.array([cand.samples[(key[0], key[1].split("#")[0])]["answer_prob"] for key in planted.samples])
    ratios = c / own
    assert ratios.std() > 0.1  # noisy, not an exact scaling
    margin = registry.METRICS["answer_prob"].margin.value
    assert c.mean() / own.mean() == pytest.approx(1 - k * margin, abs=0.05)
    js = np.array([planted.samples[key]["js_div"] for key in planted.samples])
    own_js = np.array([cand.samples[(key[0], key[1].split("#")[0])]["js_div"] for key in planted.samples])
    assert (js - own_js).std() > 0.001  # noisy, not one step for every prompt
    assert (js - own_js).mean() == pytest.approx(k * registry.METRICS["js_div"].margin.value, rel=0.1)
    hits = np.array([planted.samples[key]["ft_hit"] for key in planted.samples])
    own_hits = np.array([cand.samples[(key[0], key[1].split("#")[0])]["ft_hit"] for key in planted.samples])
    assert own_hits.mean() - hits.mean() == pytest.approx(k * 0.05, abs=0.03)


def test_a_benign_pair_passes_and_a_doubled_drop_fails(bench):
    base, cand = synthetic(150)
    # n_boot 2000: a bootstrap p-value is at least 1 / (n_boot + 1), and Holm over 12 checks needs 0.002
    table = bench.calibrate(base, {"benign": cand}, {}, [100], [2.0], reps=10, n_boot=2000, seed=0)
    (row,) = table
    assert sum(row["aa"].values()) == pytest.approx(1.0)
    assert row["aa"]["fail"] <= 0.1
    assert row["benign"]["pass"] >= 0.8, row
    assert row["k2"]["fail"] >= 0.8, row
    text = bench.markdown(table, [2.0], 10)
    assert "| benign | 100 |" in text and "(≥ 95 %)" in text


def test_the_table_marks_a_missed_target(bench):
    row = {"pair": "p", "n": 100, "tasks": {}, "aa": {"pass": 0, "inconclusive": 0.9, "fail": 0.1},
           "benign": {"pass": 0.5, "inconclusive": 0.5, "fail": 0}, "benign_why": "en/answer_hit inconclusive 0.5",
           "k2": {"pass": 0, "inconclusive": 0.2, "fail": 0.8}}
    line = bench.markdown([row], [2.0], 10).splitlines()[2]
    assert line.count("✗") == 3
