"""evalkit.scoring.stats: checked against plain numpy formulas, not against itself."""

import math
import time

import numpy as np
import pytest

from evalkit.scoring import stats
from evalkit.scoring.stats import Delta, jsd, mean_stderr, paired_bootstrap, prior_drift, top_overlap


def _entropy2(x):
    x = np.asarray(x, dtype=float)
    x = x[x > 0]
    return float(-(x * np.log2(x)).sum())


def _reference_jsd(p_vec, q_vec):
    """JSD₂ = H(M) − (H(P) + H(Q)) / 2, a different formula from the one jsd() uses."""
    m = (np.asarray(p_vec) + np.asarray(q_vec)) / 2
    return _entropy2(m) - (_entropy2(p_vec) + _entropy2(q_vec)) / 2


def _random_topk(rng, vocab=40, k=8, mass=0.9):
    ids = rng.choice(vocab, size=k, replace=False)
    probs = rng.dirichlet(np.ones(k)) * mass
    return {int(i): float(p) for i, p in zip(ids, probs)}


# ---------------------------------------------------------------------------- jsd


def test_jsd_identical_is_zero():
    p = {1: 0.5, 2: 0.3, 3: 0.1}
    assert jsd(p, dict(p)) == 0.0


def test_jsd_disjoint_full_mass_is_one():
    assert jsd({1: 1.0}, {2: 1.0}) == pytest.approx(1.0)
    assert jsd({1: 0.5, 2: 0.5}, {3: 0.25, 4: 0.75}) == pytest.approx(1.0)


def test_jsd_symmetric_and_bounded():
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = _random_topk(rng, mass=rng.uniform(0.3, 1.0))
        q = _random_topk(rng, mass=rng.uniform(0.3, 1.0))
        a, b = jsd(p, q), jsd(q, p)
        assert a == pytest.approx(b, abs=1e-12)
        assert 0.0 <= a <= 1.0


def test_jsd_matches_hand_computation_with_rest_buckets():
    p = {10: 0.5, 11: 0.2}  # rest 0.3
    q = {10: 0.4, 12: 0.4}  # rest 0.2
    # support [10, 11, 12, rest]
    p_vec = [0.5, 0.2, 0.0, 0.3]
    q_vec = [0.4, 0.0, 0.4, 0.2]
    assert jsd(p, q) == pytest.approx(_reference_jsd(p_vec, q_vec), abs=1e-12)
    # the same numbers by hand: M = (0.45, 0.1, 0.2, 0.25)
    by_hand = 0.5 * (
        0.5 * math.log2(0.5 / 0.45) + 0.2 * math.log2(0.2 / 0.1) + 0.3 * math.log2(0.3 / 0.25)
    ) + 0.5 * (
        0.4 * math.log2(0.4 / 0.45) + 0.4 * math.log2(0.4 / 0.2) + 0.2 * math.log2(0.2 / 0.25)
    )
    assert jsd(p, q) == pytest.approx(by_hand, abs=1e-12)


def test_jsd_matches_reference_on_random_pairs():
    rng = np.random.default_rng(1)
    for _ in range(50):
        p = _random_topk(rng, mass=0.8)
        q = _random_topk(rng, mass=0.95)
        support = sorted(set(p) | set(q))
        p_vec = [p.get(t, 0.0) for t in support] + [1 - sum(p.values())]
        q_vec = [q.get(t, 0.0) for t in support] + [1 - sum(q.values())]
        assert jsd(p, q) == pytest.approx(_reference_jsd(p_vec, q_vec), abs=1e-9)


def test_jsd_missing_key_mass_sits_in_rest_bucket():
    # p does not list token 2: its 0.4 is p's rest, a separate outcome from q's token 2.
    assert jsd({1: 0.6}, {1: 0.6, 2: 0.4}) == pytest.approx(0.4)


def test_jsd_tolerates_float_noise_above_one():
    p = {1: 0.7, 2: 0.3 + 1e-9}
    assert 0.0 <= jsd(p, {1: 0.7, 2: 0.3}) < 1e-6


@pytest.mark.parametrize(
    "p, q, match",
    [
        ({}, {1: 1.0}, "empty"),
        ({1: 1.0}, {}, "empty"),
        ({1: 0.8, 2: 0.5}, {1: 1.0}, "sums to"),
        ({1: -0.1}, {1: 1.0}, "negative"),
        ({1: float("nan")}, {1: 1.0}, "non-finite"),
    ],
)
def test_jsd_rejects_bad_input(p, q, match):
    with pytest.raises(ValueError, match=match):
        jsd(p, q)


def test_prior_drift_is_one_minus_jsd():
    p = {1: 0.6, 2: 0.2}
    q = {1: 0.3, 3: 0.5}
    assert prior_drift(p, q) == pytest.approx(1 - jsd(p, q))
    assert prior_drift(p, p) == 1.0
    assert prior_drift({1: 1.0}, {2: 1.0}) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        prior_drift({}, q)


# ---------------------------------------------------------------------- top_overlap


def test_top_overlap():
    assert top_overlap([1, 2, 3, 4, 5], [1, 2, 3, 4, 5]) == 1.0
    assert top_overlap([1, 2, 3, 4, 5], [5, 4, 9, 8, 1]) == pytest.approx(0.6)
    assert top_overlap([1, 2, 3, 4, 5], [6, 7, 8, 9, 10]) == 0.0
    # only the first k of each list count
    assert top_overlap([1, 2, 3, 4, 5, 6], [6, 7, 8, 9, 10, 1]) == 0.0
    assert top_overlap([1, 2, 3], [3, 2, 1], k=2) == pytest.approx(0.5)
    # a short list still divides by k
    assert top_overlap([1, 2], [1, 2], k=5) == pytest.approx(0.4)


@pytest.mark.parametrize("a, b, k", [([], [1], 5), ([1], [], 5), ([1], [1], 0)])
def test_top_overlap_rejects_bad_input(a, b, k):
    with pytest.raises(ValueError):
        top_overlap(a, b, k=k)


# ------------------------------------------------------------------ paired_bootstrap


def test_bootstrap_deterministic_for_a_seed():
    rng = np.random.default_rng(2)
    a = rng.random(300)
    b = rng.random(300)
    assert paired_bootstrap(a, b, seed=7) == paired_bootstrap(a, b, seed=7)
    assert paired_bootstrap(a, b, seed=7) != paired_bootstrap(a, b, seed=8)
    hits_a = (rng.random(300) < 0.6).astype(float)
    hits_b = (rng.random(300) < 0.5).astype(float)
    assert paired_bootstrap(hits_a, hits_b, seed=3) == paired_bootstrap(hits_a, hits_b, seed=3)


def test_bootstrap_deterministic_across_chunks_and_threads():
    # large enough to be split into several chunks run on a thread pool
    rng = np.random.default_rng(3)
    a = rng.random(20_000)
    b = rng.random(20_000)
    first = paired_bootstrap(a, b, n_boot=300, seed=1)
    assert paired_bootstrap(a, b, n_boot=300, seed=1) == first


def test_bootstrap_fields():
    d = paired_bootstrap([1, 1, 0, 1], [1, 0, 0, 1], n_boot=500)
    assert isinstance(d, Delta)
    assert (d.mean_a, d.mean_b, d.delta, d.n) == (0.75, 0.5, 0.25, 4)
    assert d.lo <= d.delta <= d.hi


def test_bootstrap_identical_inputs_give_zero_interval():
    a = [0.1, 0.7, 0.3, 0.9]
    d = paired_bootstrap(a, list(a))
    assert (d.delta, d.lo, d.hi) == (0.0, 0.0, 0.0)
    hits = [1.0, 0.0, 1.0]
    d = paired_bootstrap(hits, hits)
    assert (d.delta, d.lo, d.hi) == (0.0, 0.0, 0.0)


def test_bootstrap_ci_covers_true_delta():
    # continuous per-prompt values with a real shift of 0.1: 95 % CIs should cover it
    true_delta = 0.1
    covered = 0
    trials = 40
    for t in range(trials):
        rng = np.random.default_rng(100 + t)
        base = rng.random(200)
        cand = base + true_delta + rng.normal(0, 0.3, size=200)
        d = paired_bootstrap(cand, base, n_boot=500, seed=t)
        covered += d.lo <= true_delta <= d.hi
        assert d.lo < d.delta < d.hi
    assert covered >= 0.85 * trials


def test_bootstrap_ci_on_binary_hits_matches_plain_resampling():
    # the grouped (multinomial) fast path must agree with index resampling
    rng = np.random.default_rng(5)
    base = (rng.random(400) < 0.8).astype(float)
    cand = base.copy()
    cand[rng.choice(np.flatnonzero(base), size=60, replace=False)] = 0.0
    d = paired_bootstrap(cand, base, n_boot=4000, seed=0)
    diff = cand - base
    idx = np.random.default_rng(9).integers(0, diff.size, size=(4000, diff.size))
    ref_lo, ref_hi = np.quantile(diff[idx].mean(axis=1), [0.025, 0.975])
    assert d.delta == pytest.approx(-0.15)
    assert d.lo == pytest.approx(ref_lo, abs=0.01)
    assert d.hi == pytest.approx(ref_hi, abs=0.01)
    # normal approximation as a second, independent reference
    se = diff.std() / math.sqrt(diff.size)
    assert d.lo == pytest.approx(d.delta - 1.96 * se, abs=0.01)


def test_bootstrap_alpha_widens_interval():
    rng = np.random.default_rng(6)
    a, b = rng.random(300), rng.random(300)
    narrow = paired_bootstrap(a, b, alpha=0.5)
    wide = paired_bootstrap(a, b, alpha=0.01)
    assert wide.lo < narrow.lo < narrow.hi < wide.hi


@pytest.mark.parametrize(
    "a, b, kwargs, match",
    [
        ([], [], {}, "empty"),
        ([1.0, 2.0], [1.0], {}, "paired"),
        ([1.0, float("nan")], [1.0, 2.0], {}, "finite"),
        ([1.0], [1.0], {"n_boot": 0}, "n_boot"),
        ([1.0], [1.0], {"alpha": 1.5}, "alpha"),
    ],
)
def test_bootstrap_rejects_bad_input(a, b, kwargs, match):
    with pytest.raises(ValueError, match=match):
        paired_bootstrap(a, b, **kwargs)


def test_bootstrap_large_n_is_fast():
    rng = np.random.default_rng(4)
    n = 100_000
    # binary values take the exact grouped path
    hits_a = (rng.random(n) < 0.7).astype(float)
    hits_b = (rng.random(n) < 0.7).astype(float)
    # CPU time of this process, not wall time: other jobs on a shared box do not
    # count, and the margins still catch a quadratic resampler (minutes at this n)
    t0 = time.process_time()
    paired_bootstrap(hits_a, hits_b)
    assert time.process_time() - t0 < 2.0
    # continuous values resample indices; budget is 1 s on the reference machine
    a, b = rng.random(n), rng.random(n)
    t0 = time.process_time()
    d = paired_bootstrap(a, b)
    assert time.process_time() - t0 < 8.0
    assert d.n == n and d.lo < d.delta < d.hi


# ----------------------------------------------------------------------- mean_stderr


def test_mean_stderr():
    mean, se = mean_stderr([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert se == pytest.approx(np.std([1, 2, 3, 4], ddof=1) / 2)
    assert mean_stderr([3.0]) == (3.0, None)
    with pytest.raises(ValueError, match="no values"):
        mean_stderr([])


def test_module_docstring_examples():
    import doctest

    failures, _ = doctest.testmod(stats)
    assert failures == 0


def test_interval_stays_inside_the_range():
    from evalkit.scoring.stats import _interval, interval

    rng = np.random.default_rng(3)
    for n in (2, 3, 10, 160):
        for p in (0.0, 0.02, 0.5, 1.0):
            values = (rng.random(n) < p).astype(float)
            lo, hi = _interval(values, binary=True, confidence=0.95, n_boot=2000, seed=0)  # the formula at any n
            assert 0.0 <= lo <= values.mean() <= hi <= 1.0
        probs = rng.beta(0.3, 3.0, n)
        lo, hi = _interval(probs, binary=False, confidence=0.95, n_boot=2000, seed=0)
        assert probs.min() <= lo <= probs.mean() <= hi <= probs.max()
    # Wilson against its formula: k = 1 of n = 3 at 95 %
    z, k, n = 1.959963984540054, 1, 3
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert _interval(np.array([1.0, 0, 0]), binary=True, confidence=0.95, n_boot=1, seed=0) == pytest.approx(
        (centre - half, centre + half), abs=1e-9)
    assert interval([0.5], binary=False) is None


@pytest.mark.parametrize("binary, need", [(True, 10), (False, 20)])
def test_no_interval_from_too_few_prompts(binary, need):
    # 3 prompts printed a 95 % interval; the gate would not decide on it (docs/gate.md "Too few prompts")
    from evalkit.scoring.stats import interval

    values = [float(i % 2) for i in range(need)]
    assert interval(values[:-1], binary=binary) is None
    lo, hi = interval(values, binary=binary)
    assert lo < 0.5 < hi
    with pytest.raises(ValueError):
        interval([0.5, 1.0], binary=True)


def test_interval_covers_the_truth_at_about_the_nominal_rate():
    from evalkit.scoring.stats import interval

    rng = np.random.default_rng(11)
    hits = sum(lo <= 0.1 <= hi for lo, hi in (interval((rng.random(60) < 0.1).astype(float), binary=True)
                                               for _ in range(400)))
    assert 0.90 <= hits / 400 <= 0.99
