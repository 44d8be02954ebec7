"""Small statistics on plain values: divergences between first-token distributions,
top-k overlap, the paired bootstrap and mean/stderr.

Owns: the maths behind prior drift (docs/metrics.md §1.3), drift between runs (1.5) and the
gate's regression test (2, ``gate``). Does not: read the DB, know about tasks or
runs, or decide pass/fail (that is ``evalkit.release.decide``).

Every function takes plain Python / numpy values, guards the empty case with a
``ValueError`` (never a silent 0) and is deterministic.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import TypeVar
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

Event = TypeVar("Event", int, str)  # what a distribution is over: token ids, or text events (`textspace`)
from evalkit.defaults import MIN_BOOTSTRAP_PROMPTS, MIN_SCORE_INTERVAL_PROMPTS

__all__ = [
    "Delta",
    "bootstrap_means",
    "interval",
    "min_prompts",
    "jsd",
    "mean_stderr",
    "paired_bootstrap",
    "prior_drift",
    "top_overlap",
]

# Mass a top-k list may exceed 1 by (float noise from exp(logprob)) before it is an error.
_MASS_TOL = 1e-6


def _dist_vector(dist: Mapping[Event, float], support: list[Event], side: str) -> np.ndarray:
    """``dist`` laid out over ``support`` plus a final rest bucket."""
    listed = np.array([float(dist.get(t, 0.0)) for t in support], dtype=np.float64)
    total = float(sum(float(v) for v in dist.values()))
    if not np.all(np.isfinite(listed)) or not math.isfinite(total):
        raise ValueError(f"jsd: distribution {side} has a non-finite probability")
    if np.any(listed < 0):
        raise ValueError(f"jsd: distribution {side} has a negative probability")
    if total > 1.0 + _MASS_TOL:
        raise ValueError(f"jsd: distribution {side} sums to {total:.6g} > 1")
    rest = max(0.0, 1.0 - total)
    return np.append(listed, rest)


def jsd(p: Mapping[Event, float], q: Mapping[Event, float]) -> float:
    """Jensen–Shannon divergence, base 2, between two top-k first-token distributions.

    ``p`` and ``q`` map token_id (or, across tokenizers, a text event: `textspace`) -> probability;
    each lists the top k tokens of
    one side, so each sums to at most 1. The support is the union of both key
    sets plus one "rest" bucket, which on each side holds
    ``1 − sum(listed probabilities)`` (clamped at 0), so both sides sum to 1.

    Approximation (docs/metrics.md §1.3): a token listed on one side but not the other gets
    probability 0 on the side that does not list it — its true mass there is
    somewhere inside that side's rest bucket, which is treated as one opaque
    outcome. With k ≥ 50 the rest buckets are small and the error is too.

    The result lies in [0, 1]: 0 for identical inputs, 1 for distributions with
    disjoint full-mass supports; it is symmetric in ``p`` and ``q``.

    Example::

        >>> jsd({1: 0.5, 2: 0.5}, {1: 0.5, 2: 0.5})
        0.0
        >>> jsd({1: 1.0}, {2: 1.0})
        1.0
        >>> round(jsd({1: 0.5, 2: 0.5}, {1: 1.0}), 4)   # m = (3/4, 1/4, 0)
        0.3113
        >>> round(jsd({1: 0.6}, {1: 0.6, 2: 0.4}), 4)   # p's 0.4 sits in its rest bucket
        0.4

    Raises ``ValueError`` when either side is empty, has a negative or
    non-finite probability, or sums to more than 1.
    """
    if not p or not q:
        side = "p" if not p else "q"
        raise ValueError(f"jsd: distribution {side} is empty (need at least one token)")
    support = sorted(set(p) | set(q))
    pv = _dist_vector(p, support, "p")
    qv = _dist_vector(q, support, "q")
    # A side summing to 1 + tiny noise: renormalise so the divergence stays in [0, 1].
    pv /= pv.sum()
    qv /= qv.sum()
    m = 0.5 * (pv + qv)

    def _kl_to_m(x: np.ndarray) -> float:
        nz = x > 0  # 0 · log 0 = 0; m > 0 wherever x > 0
        return float(np.sum(x[nz] * np.log2(x[nz] / m[nz])))

    value = 0.5 * _kl_to_m(pv) + 0.5 * _kl_to_m(qv)
    return float(min(1.0, max(0.0, value)))


def prior_drift(p_prompt: Mapping[int, float], p_cf: Mapping[int, float]) -> float:
    """``1 − jsd(p_prompt, p_cf)`` (docs/metrics.md §1.3): 1 means the prompt changed nothing.

    ``p_prompt`` is the prompt's top-k first-token distribution, ``p_cf`` the
    content-free prior under the same template (token_id -> probability).

    Example::

        >>> prior_drift({7: 0.9, 8: 0.1}, {7: 0.9, 8: 0.1})
        1.0
        >>> prior_drift({7: 1.0}, {8: 1.0})
        0.0

    Raises ``ValueError`` on an empty distribution (see ``jsd``).
    """
    return 1.0 - jsd(p_prompt, p_cf)


def top_overlap(a_ids: Sequence[int], b_ids: Sequence[int], k: int = 5) -> float:
    """``|topk_A ∩ topk_B| / k`` (docs/metrics.md §1.5 ``top5_overlap``).

    ``a_ids`` and ``b_ids`` are token ids ranked best first; only the first
    ``k`` of each count. A list shorter than ``k`` still divides by ``k``.

    Example::

        >>> top_overlap([1, 2, 3, 4, 5], [5, 4, 9, 8, 1])
        0.6
        >>> top_overlap([1, 2], [2, 3], k=2)
        0.5

    Raises ``ValueError`` when either list is empty or ``k < 1``.
    """
    if k < 1:
        raise ValueError(f"top_overlap: k must be >= 1, got {k}")
    if len(a_ids) == 0 or len(b_ids) == 0:
        side = "a_ids" if len(a_ids) == 0 else "b_ids"
        raise ValueError(f"top_overlap: {side} is empty (need at least one ranked token)")
    shared = set(list(a_ids)[:k]) & set(list(b_ids)[:k])
    return len(shared) / k


@dataclass(frozen=True)
class Delta:
    """A paired difference with its bootstrap CI; ``delta = mean_a − mean_b``."""

    mean_a: float  # candidate mean over the paired prompts
    mean_b: float  # baseline mean over the paired prompts
    delta: float  # mean_a − mean_b (= mean of the paired differences)
    lo: float  # lower percentile bound of delta
    hi: float  # upper percentile bound of delta
    n: int  # number of pairs


# Elements (pairs × bootstrap rows) resampled per chunk. Fixed, so that results
# never depend on the number of CPUs or threads.
_CHUNK_ELEMS = 1 << 20
# At most this many distinct paired differences → resample value counts instead of indices.
_MAX_GROUPED_VALUES = 512


def _finite_array(values: Sequence[float], name: str) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: values must be numbers ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a flat sequence of numbers, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: values must be finite (found NaN or inf)")
    return arr


def bootstrap_means(d: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """``n_boot`` means of ``d`` resampled with replacement (length ``len(d)``)."""
    n = d.size
    values, counts = np.unique(d, return_counts=True)
    if values.size <= _MAX_GROUPED_VALUES and values.size < n:
        # Few distinct values (0/1 hits give differences in {−1, 0, 1}): drawing n
        # indices uniformly is the same as drawing how often each distinct value is
        # drawn, Multinomial(n, counts / n) — exact, and O(n_boot · distinct).
        rng = np.random.default_rng(seed)
        drawn = rng.multinomial(n, counts / n, size=n_boot)  # n_boot × distinct
        return (drawn @ values) / n

    rows = max(1, _CHUNK_ELEMS // n)
    starts = list(range(0, n_boot, rows))
    # One independent stream per chunk: identical output whatever the thread count.
    streams = np.random.SeedSequence(seed).spawn(len(starts))
    out = np.empty(n_boot, dtype=np.float64)

    def _chunk(j: int) -> None:
        start = starts[j]
        stop = min(n_boot, start + rows)
        rng = np.random.default_rng(streams[j])
        idx = rng.integers(0, n, size=(stop - start, n))  # rows × n resampled positions
        out[start:stop] = np.take(d, idx, mode="clip").mean(axis=1)

    workers = min(len(starts), os.cpu_count() or 1, 8)
    if workers > 1:
        # numpy releases the GIL in integers() and take(), so threads do run in parallel.
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(_chunk, range(len(starts))))
    else:
        for j in range(len(starts)):
            _chunk(j)
    return out


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    *,
    n_boot: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
) -> Delta:
    """Percentile bootstrap CI of the mean paired difference ``a − b``.

    ``a`` holds the candidate's per-prompt values, ``b`` the baseline's, paired
    by position (same prompt). Prompts are resampled with replacement
    ``n_boot`` times; the CI is the ``alpha/2`` and ``1 − alpha/2`` percentiles
    of the resampled mean differences. Deterministic for a given ``seed``.

    Example::

        >>> d = paired_bootstrap([1, 1, 0, 1], [1, 0, 0, 1], n_boot=1000, seed=0)
        >>> (d.mean_a, d.mean_b, d.delta, d.n)
        (0.75, 0.5, 0.25, 4)
        >>> (d.lo, d.hi)
        (0.0, 0.75)
        >>> same = paired_bootstrap([0.3, 0.4], [0.3, 0.4])
        >>> (same.delta, same.lo, same.hi)
        (0.0, 0.0, 0.0)

    Raises ``ValueError`` when the inputs are empty, differ in length or hold
    non-finite values, or when ``n_boot < 1`` or ``alpha`` is not in (0, 1).
    """
    av = _finite_array(a, "paired_bootstrap: a")
    bv = _finite_array(b, "paired_bootstrap: b")
    if av.size != bv.size:
        raise ValueError(
            f"paired_bootstrap: a and b must be paired by position, got {av.size} and {bv.size} values"
        )
    if av.size == 0:
        raise ValueError("paired_bootstrap: no pairs (a and b are empty)")
    if n_boot < 1:
        raise ValueError(f"paired_bootstrap: n_boot must be >= 1, got {n_boot}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"paired_bootstrap: alpha must be in (0, 1), got {alpha}")

    d = av - bv  # per-prompt candidate − baseline
    means = bootstrap_means(d, n_boot, seed)
    lo, hi = np.quantile(means, [alpha / 2.0, 1.0 - alpha / 2.0])
    return Delta(
        mean_a=float(av.mean()),
        mean_b=float(bv.mean()),
        delta=float(d.mean()),
        lo=float(lo),
        hi=float(hi),
        n=int(av.size),
    )


def mean_stderr(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and standard error (sample std, ddof=1, over sqrt(n)); stderr is None for n < 2.

    Example::

        >>> mean_stderr([1.0, 2.0, 3.0])
        (2.0, 0.5773502691896258)
        >>> mean_stderr([4.0])
        (4.0, None)

    Raises ``ValueError`` on empty input or non-finite values.
    """
    arr = _finite_array(values, "mean_stderr")
    if arr.size == 0:
        raise ValueError("mean_stderr: no values (cannot take the mean of nothing)")
    mean = float(arr.mean())
    if arr.size < 2:
        return mean, None
    return mean, float(arr.std(ddof=1) / math.sqrt(arr.size))


def min_prompts(*, binary: bool) -> int:
    """The fewest prompts an interval of a mean may rest on, printed or stored (the gate's rule,
    docs/gate.md "Too few prompts"): a proportion's score interval from `MIN_SCORE_INTERVAL_PROMPTS`,
    a bootstrap interval from `MIN_BOOTSTRAP_PROMPTS`.

    >>> min_prompts(binary=True), min_prompts(binary=False)
    (10, 20)
    """
    return MIN_SCORE_INTERVAL_PROMPTS if binary else MIN_BOOTSTRAP_PROMPTS


def interval(values: Sequence[float], *, binary: bool, confidence: float = 0.95,
             n_boot: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """A confidence interval for the mean of per-prompt values that stays inside their range.

    0/1 values (`binary`): the Wilson score interval of the proportion
    (`scipy.stats.binomtest(...).proportion_ci`); others: the bootstrap percentile interval
    (`scipy.stats.bootstrap`), which never leaves [min, max] of the values. None for fewer
    values than `min_prompts` (no interval from too few prompts: the gate's rule, everywhere).

    Example::

        >>> lo, hi = interval([1, 0, 0, 0, 0, 0, 0, 0, 0, 0], binary=True)
        >>> round(lo, 4), round(hi, 4)   # mean 0.1 ± 1.96·stderr would reach below 0
        (0.0179, 0.4042)
        >>> interval([1, 0, 0], binary=True) is None
        True
    """
    arr = _finite_array(values, "interval")
    if binary and not np.all((arr == 0) | (arr == 1)):
        raise ValueError("interval: binary=True needs values that are 0 or 1")
    if arr.size < min_prompts(binary=binary):
        return None
    return _interval(arr, binary=binary, confidence=confidence, n_boot=n_boot, seed=seed)


def _interval(arr: np.ndarray, *, binary: bool, confidence: float, n_boot: int, seed: int) -> tuple[float, float]:
    """`interval`'s computation on at least two values, whatever their count."""
    if binary:
        from scipy.stats import binomtest

        ci = binomtest(int(arr.sum()), int(arr.size)).proportion_ci(confidence_level=confidence, method="wilson")
        return float(ci.low), float(ci.high)
    if np.all(arr == arr[0]):
        return float(arr[0]), float(arr[0])
    from scipy.stats import bootstrap

    res = bootstrap((arr,), np.mean, n_resamples=n_boot, confidence_level=confidence, method="percentile",
                    random_state=seed, vectorized=True)
    return float(res.confidence_interval.low), float(res.confidence_interval.high)
