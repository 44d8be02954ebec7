"""The gate's statistics (evalkit.release.paired) against independent computations:
a numeric maximum likelihood, the score test inverted on a grid, simulation, scipy's
bootstrap and Wilson interval, and statsmodels' McNemar test and Holm correction."""

import math

import numpy as np
import pytest
from scipy.optimize import minimize_scalar
from scipy.stats import binomtest, bootstrap, norm

from evalkit.release import paired

Z = norm.ppf(0.975)


def _numeric_restricted_p21(b, c, n, delta):
    """Maximise the multinomial log-likelihood of the four cells (a, b, c, d) under p_b − p_c = delta.

    With p_c = x and p_b = x + delta, the other two cells share the rest; their split does not
    touch the constraint, so its maximum is their observed split of the rest: a profile over x.
    """
    a_plus_d = n - b - c

    def negloglik(x):
        pb, pc = x + delta, x
        rest = 1 - pb - pc
        if pb <= 0 or pc <= 0 or rest <= 0:
            return math.inf
        out = b * math.log(pb) + c * math.log(pc)
        if a_plus_d:
            out += a_plus_d * math.log(rest)
        return -out

    lo = max(0.0, -delta) + 1e-12
    hi = (1 - delta) / 2 - 1e-12
    return minimize_scalar(negloglik, bounds=(lo, hi), method="bounded", options={"xatol": 1e-12}).x


@pytest.mark.parametrize("b, c, n, delta", [
    (3, 1, 20, 0.0), (3, 1, 20, 0.2), (3, 1, 20, -0.1), (10, 0, 200, 0.02), (0, 7, 60, 0.05),
    (25, 12, 230, 0.05), (1, 1, 40, 0.1), (40, 0, 200, 0.3),
])
def test_tango_restricted_mle_matches_a_numeric_maximum(b, c, n, delta):
    assert paired.tango_restricted_p21(b, c, n, delta) == pytest.approx(_numeric_restricted_p21(b, c, n, delta),
                                                                        abs=1e-6)


@pytest.mark.parametrize("b, c, n", [(0, 0, 20), (3, 1, 20), (40, 0, 200), (5, 9, 60), (20, 20, 20), (0, 12, 12)])
def test_tango_interval_is_the_inverted_score_test(b, c, n):
    lo, hi = paired.tango_interval(b, c, n)
    assert -1 <= lo <= (b - c) / n <= hi <= 1
    for d in np.linspace(-0.999, 0.999, 1999):
        inside = abs(paired.tango_z(b, c, n, d)) <= Z
        if abs(d - lo) > 1e-6 and abs(d - hi) > 1e-6:
            assert inside == (lo < d < hi), (d, lo, hi)


def test_tango_interval_with_no_discordant_pair():
    # the score test at delta: Z = -sqrt(n delta / (1 - delta)), so the bound solves n d / (1 - d) = z²
    for n in (20, 73, 230):
        lo, hi = paired.tango_interval(0, 0, n)
        assert hi == pytest.approx(Z**2 / (n + Z**2), abs=1e-9) and lo == pytest.approx(-hi, abs=1e-9)


def test_tango_interval_covers_in_simulation():
    rng = np.random.default_rng(7)
    n, probs = 60, [0.5, 0.15, 0.05, 0.30]  # both hit, lost, gained, both miss: drop 0.10
    truth = probs[1] - probs[2]
    counts = rng.multinomial(n, probs, size=1000)
    covered = 0
    for _a, b, c, _d in counts:
        lo, hi = paired.tango_interval(b, c, n)
        covered += lo <= truth <= hi
    assert covered / 1000 >= 0.92


def test_mcnemar_matches_statsmodels():
    from statsmodels.stats.contingency_tables import mcnemar

    for b, c in [(0, 0), (6, 0), (3, 9), (20, 11), (1, 30)]:
        table = [[10, b], [c, 10]]
        assert paired.mcnemar_exact_p(b, c) == pytest.approx(mcnemar(table, exact=True).pvalue, rel=1e-9)


def test_holm_matches_statsmodels():
    from statsmodels.stats.multitest import multipletests

    rng = np.random.default_rng(3)
    for _ in range(40):  # statsmodels' multipletests takes ~0.1 s a call here
        m = int(rng.integers(1, 15))
        p = rng.uniform(0, 0.03, size=m) ** rng.uniform(0.5, 2)
        expected = multipletests(p, alpha=0.025, method="holm")[0]
        assert paired.holm(list(p), 0.025) == list(expected)


def test_paired_bootstrap_matches_scipy():
    rng = np.random.default_rng(11)
    base = rng.beta(2, 8, size=120)
    cand = np.clip(base - rng.normal(0.01, 0.05, size=120), 0, 1)
    t = paired.paired_continuous(list(cand), list(base), higher_is_better=True, delta=0.02, n_boot=20000)
    ref = bootstrap((base, cand), lambda x, y: np.mean(x - y), paired=True, vectorized=False,
                    n_resamples=20000, method="percentile", random_state=0).confidence_interval
    assert t.estimate == pytest.approx(float(np.mean(base - cand)))
    assert t.lo == pytest.approx(ref.low, abs=0.002) and t.hi == pytest.approx(ref.high, abs=0.002)


def test_relative_margin_tests_the_ratio_with_the_baselines_noise():
    rng = np.random.default_rng(5)
    base = rng.beta(2, 10, size=200)
    kept = base * 0.5  # the candidate keeps half the baseline's mass on every prompt
    t = paired.paired_continuous(list(kept), list(base), higher_is_better=True, relative=0.1)
    assert t.status == "fail" and t.limit == pytest.approx(0.1 * base.mean())
    assert t.estimate == pytest.approx(0.5 * base.mean())
    close = paired.paired_continuous(list(base * 0.99), list(base), higher_is_better=True, relative=0.1)
    assert close.status == "pass"
    # lower is better (opener_mass): an increase of 50 % fails a 25 % margin, one of 5 % passes
    more = paired.paired_continuous(list(base * 1.5), list(base), higher_is_better=False, relative=0.25)
    less = paired.paired_continuous(list(base * 1.05), list(base), higher_is_better=False, relative=0.25)
    assert (more.status, less.status) == ("fail", "pass")


def test_wilson_matches_scipy():
    for k, n in [(0, 20), (1, 10), (7, 20), (20, 20), (113, 230)]:
        ci = binomtest(k, n).proportion_ci(method="wilson")
        assert paired.wilson(k, n) == pytest.approx((ci.low, ci.high), abs=1e-9)


@pytest.mark.parametrize("b, c, n, margin", [(2, 0, 20, 0.05), (0, 0, 20, 0.05), (9, 3, 80, 0.05), (6, 1, 40, 0.1)])
def test_prompts_to_decide_is_where_the_interval_leaves_the_margin(b, c, n, margin):
    cand = [0.0] * b + [1.0] * c + [1.0] * (n - b - c)
    base = [1.0] * b + [0.0] * c + [1.0] * (n - b - c)
    t = paired.paired_binary(cand, base, higher_is_better=True, margin=margin)
    assert t.status == "inconclusive" and t.decide_n is not None and t.decide_n > n

    def decided(m):
        lo, hi = paired.tango_interval(b * m / n, c * m / n, m)
        return hi < margin if t.estimate < margin else lo > margin

    assert decided(t.decide_n) and not decided(t.decide_n - 1)


def test_no_discordant_pair_of_20_needs_about_73_prompts():
    t = paired.paired_binary([1.0] * 20, [1.0] * 20, higher_is_better=True, margin=0.05)
    assert t.status == "inconclusive" and t.hi == pytest.approx(0.161, abs=1e-3)
    assert t.decide_n == 73  # n·0.05 / 0.95 > 3.84


def test_threshold_tests():
    assert paired.threshold_binary([1.0] * 18 + [0.0] * 2, ">=", 0.5).status == "pass"
    assert paired.threshold_binary([1.0] * 2 + [0.0] * 18, ">=", 0.5).status == "fail"
    mid = paired.threshold_binary([1.0] * 11 + [0.0] * 9, ">=", 0.5)
    assert mid.status == "inconclusive" and mid.decide_n > 20
    rng = np.random.default_rng(0)
    vals = list(rng.uniform(0.3, 0.5, size=100))
    assert paired.threshold_continuous(vals, "<=", 0.5).status == "pass"
    assert paired.threshold_continuous(vals, ">=", 0.5).status == "fail"
    stored = paired.threshold_stored(0.62, 0.55, 0.69, ">=", 0.6, 100)
    assert stored.status == "inconclusive" and stored.p_fail > 0.5
    assert paired.threshold_stored(0.52, 0.45, 0.59, ">=", 0.7, 100).p_fail < 1e-4


def test_fail_p_values_agree_with_the_intervals():
    # a check whose interval lies wholly past its limit has a one-sided p below 2.5 %, and back
    rng = np.random.default_rng(9)
    for _ in range(30):
        n = int(rng.integers(20, 300))
        b, c = (int(x) for x in rng.multinomial(n, [0.15, 0.05, 0.8])[:2])
        cand = [0.0] * b + [1.0] * c + [1.0] * (n - b - c)
        base = [1.0] * b + [0.0] * c + [1.0] * (n - b - c)
        t = paired.paired_binary(cand, base, higher_is_better=True, margin=0.05)
        assert (t.status == "fail") == (t.p_fail < 0.025)
