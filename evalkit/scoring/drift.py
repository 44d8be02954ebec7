"""Drift by position (docs/drift.md, SPEC §1.11): how far a candidate's next-token distribution is
from a base's, position by position, in the statistics llama.cpp's `llama-perplexity
--kl-divergence` prints.

Owns, on plain numpy values:
- `compact`: a base distribution kept as its top tokens covering all but `eps` of the mass plus
  one tail bucket (`Compact`), and `compare_position`: KL(base ‖ candidate) in nats against the
  candidate's full distribution, same top-1, Δp of a token, and the bound on how much the
  tail bucket hides (`tail_bound`);
- `summary`: llama.cpp's summary of a set of positions (mean ± uncertainty, percentiles, RMS Δp,
  same-top share ± error, and the perplexity lines when the scored tokens' log-probs are given),
  with its exact formulas (`_mean_and_uncertainty`, `_percentile`);
- `bucket` / `BUCKETS`: the position buckets 0, 1, 2-3, 4-7, 8-15, 16+;
- `first_ratio`: mean KLD at position 0 over mean KLD at positions >= 1, with a percentile
  bootstrap CI over prompts;
- `format_summary`: the summary as llama.cpp's lines.

Does not: run a model (`engines.transformers.teacher`), read or write the DB (`store.drift`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

DEFAULT_EPS = 1e-4  # the base mass a compact distribution may leave to its tail bucket
# (label, lowest position, highest position or None) — position 0 is the first response token
BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("0", 0, 0), ("1", 1, 1), ("2-3", 2, 3), ("4-7", 4, 7), ("8-15", 8, 15), ("16+", 16, None),
)
ALL = "all"  # the bucket label of the overall summary
KLD_FRACTIONS = (0.999, 0.99, 0.95, 0.90, 0.10, 0.05, 0.01, 0.001)  # besides max, median and min
DP_FRACTIONS = (0.999, 0.99, 0.95, 0.90, 0.75, 0.25, 0.10, 0.05, 0.01, 0.001)


def bucket(position: int) -> str:
    """The bucket label of a response position.

    >>> [bucket(p) for p in (0, 1, 2, 3, 4, 7, 8, 15, 16, 47)]
    ['0', '1', '2-3', '2-3', '4-7', '4-7', '8-15', '8-15', '16+', '16+']
    """
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    for label, lo, hi in BUCKETS:
        if position >= lo and (hi is None or position <= hi):
            return label
    raise AssertionError("the buckets cover every position")  # pragma: no cover


# --- the compact base distribution ---------------------------------------------------


@dataclass(frozen=True)
class Compact:
    """A distribution kept as its likeliest tokens plus one tail bucket.

    `ids[i]` has natural log-probability `logprobs[i]` (likeliest first); `tail` is the exact
    mass of every other token together (computed from the full distribution, in float64).
    """

    ids: np.ndarray  # (k,) int32
    logprobs: np.ndarray  # (k,) float32
    tail: float  # 1 - sum of the listed probabilities, <= eps

    @property
    def top(self) -> int:
        return int(self.ids[0])

    def nbytes(self) -> int:
        """Bytes of the stored values: 4 per id, 4 per log-prob, 8 for the tail."""
        return int(self.ids.size * 8 + 8)


def compact(logprobs: np.ndarray, eps: float = DEFAULT_EPS, keep: int | None = None) -> Compact:
    """The fewest likeliest tokens whose mass is at least 1 - eps, plus the tail bucket.

    `logprobs`: (V,) natural log-probabilities (a log-softmax). Ties are broken by token id.
    `keep`: a token listed too, after the others, when the cover leaves it in the tail (corpus
    mode's scored token, whose Δp needs its probability); the tail then excludes it.

    >>> c = compact(np.log(np.array([0.1, 0.6, 0.29995, 0.00005])), eps=1e-4)
    >>> c.ids.tolist(), round(c.tail, 6)
    ([1, 2, 0], 5e-05)
    >>> compact(np.log(np.array([0.5, 0.5])), eps=0.0).ids.tolist()
    [0, 1]
    """
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    lp = np.asarray(logprobs, dtype=np.float64).reshape(-1)
    if lp.size == 0:
        raise ValueError("compact: empty distribution")
    order = np.lexsort((np.arange(lp.size), -lp))  # descending log-prob, then id
    p = np.exp(lp[order])
    # tail mass after the first j tokens, summed from the small end (no cancellation)
    tails = np.concatenate([np.cumsum(p[::-1])[::-1], [0.0]])  # tails[j] = mass of order[j:]
    k = int(np.argmax(tails <= eps))  # the first j whose tail fits in eps (exists: tails[-1] = 0)
    k = max(k, 1)  # the top token is always kept (same top, Δp of the greedy token)
    return with_kept(order[:k].astype(np.int32), lp[order[:k]].astype(np.float32), float(tails[k]), lp, keep)


def with_kept(ids: np.ndarray, logprobs: np.ndarray, tail: float, full: np.ndarray, keep: int | None) -> Compact:
    """A Compact of these listed tokens, with `keep` appended (and taken out of the tail) when missing."""
    if keep is not None and not np.any(ids == keep):
        lp_keep = float(full[int(keep)])
        ids = np.append(ids, np.int32(keep)).astype(np.int32)
        logprobs = np.append(logprobs, np.float32(lp_keep)).astype(np.float32)
        tail = max(0.0, tail - math.exp(lp_keep))
    return Compact(ids, logprobs, tail)


def kld_full(p_logprobs: np.ndarray, q_logprobs: np.ndarray) -> float:
    """KL(P ‖ Q) in nats over the whole vocabulary, both given as log-probabilities.

    >>> round(kld_full(np.log([0.5, 0.5]), np.log([0.9, 0.1])), 6)
    0.510826
    """
    lp = np.asarray(p_logprobs, dtype=np.float64)
    lq = np.asarray(q_logprobs, dtype=np.float64)
    p = np.exp(lp)
    mask = p > 0
    return float(np.sum(p[mask] * (lp[mask] - lq[mask])))


@dataclass(frozen=True)
class PositionDrift:
    """One position: KL(base ‖ candidate), same top-1, Δp of the base's token, the tail bound."""

    kld: float  # nats, over the base's listed tokens plus its tail bucket (a lower bound on the exact KLD)
    same_top: bool  # argmax of the candidate == the base's top token
    dp: float  # Q(y) - P(y) for the scored token y
    bound: float  # exact KLD - kld lies in [0, bound]
    nll: float = math.nan  # -log Q(y)
    nll_base: float = math.nan  # -log P(y)


def tail_bound(base: Compact, q_logprobs: np.ndarray) -> float:
    """The most the tail bucket can hide: exact KLD - compact KLD lies in [0, this].

    With S the listed tokens, T the base's tail mass and Q_T = Q(not S):
    exact - compact = T · KL(P|tail ‖ Q|tail) >= 0 (the log-sum inequality), and, since every
    tail probability of P is at most T (so P(i)/T <= 1),
    KL(P|tail ‖ Q|tail) <= max over the tail of log(P(i)/T) - log(Q(i)/Q_T) <= log(Q_T / min Q(tail)).
    So the bound is T · log(Q_T / min over the tail of Q(i)); 0 when nothing is in the tail.
    """
    if base.tail <= 0.0:
        return 0.0
    lq = np.asarray(q_logprobs, dtype=np.float64)
    mask = np.ones(lq.size, dtype=bool)
    mask[base.ids] = False
    if not mask.any():
        return 0.0
    tail_lq = lq[mask]
    log_qt = _logsumexp(tail_lq)
    return float(base.tail * max(0.0, log_qt - float(tail_lq.min())))


def compare_position(base: Compact, q_logprobs: np.ndarray, token: int | None = None) -> PositionDrift:
    """Compare a compact base distribution with a candidate's full one at one position.

    KLD = sum over listed i of P(i) (log P(i) - log Q(i)) + T (log T - log Q_T), the KL divergence
    of the two distributions coarsened to (listed tokens, tail), which is at most the exact one
    (`tail_bound` says by how much). `token` (default: the base's top token, its greedy choice):
    the token whose Δp = Q(token) - P(token) is taken; it must be listed.

    >>> p = np.log(np.array([0.7, 0.2, 0.1])); q = np.log(np.array([0.5, 0.3, 0.2]))
    >>> d = compare_position(compact(p, eps=0.0), q)
    >>> round(d.kld, 6) == round(kld_full(p, q), 6), d.same_top, round(d.dp, 6), d.bound
    (True, True, -0.2, 0.0)
    """
    lq = np.asarray(q_logprobs, dtype=np.float64).reshape(-1)
    lp = base.logprobs.astype(np.float64)
    p = np.exp(lp)
    lq_s = lq[base.ids]
    kld = float(np.sum(p * (lp - lq_s)))
    if base.tail > 0.0:
        q_tail = max(0.0, 1.0 - float(np.exp(lq_s).sum()))
        if q_tail <= 0.0:  # float noise: recompute the candidate's tail mass directly
            mask = np.ones(lq.size, dtype=bool)
            mask[base.ids] = False
            q_tail = float(np.exp(_logsumexp(lq[mask]))) if mask.any() else 0.0
        kld += base.tail * (math.log(base.tail) - math.log(q_tail)) if q_tail > 0 else math.inf
    y = base.top if token is None else int(token)
    where = np.nonzero(base.ids == y)[0]
    if where.size == 0:
        raise ValueError(f"token {y} is not among the base's listed tokens")
    lp_y = float(base.logprobs[where[0]])
    return PositionDrift(
        kld=max(kld, 0.0) if kld > -1e-12 else kld,
        same_top=int(np.argmax(lq)) == base.top,
        dp=math.exp(float(lq[y])) - math.exp(lp_y),
        bound=tail_bound(base, lq),
        nll=-float(lq[y]),
        nll_base=-lp_y,
    )


def _logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    return m + math.log(float(np.sum(np.exp(x - m))))


# --- llama.cpp's summary -------------------------------------------------------------


def _mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    """llama.cpp's `mean_and_uncertainty`: the mean and sqrt((E[x²] - mean²) / (count - 1)), the
    uncertainty 0 unless that variance is positive and count > 10.

    >>> _mean_and_uncertainty(10.0, 10.0, 10)
    (1.0, 0.0)
    >>> _mean_and_uncertainty(0.0, 0.0, 0)
    (0.0, 0.0)
    """
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    df = math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0
    return f, df


def _covariance(sum_a: float, sum_b: float, sum_ab: float, count: int) -> float:
    """llama.cpp's `covariance` of two means (0 under 10 values)."""
    if count < 10:
        return 0.0
    return (sum_ab / count - (sum_a / count) * (sum_b / count)) / (count - 1)


def _percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's `percentile`: linear interpolation at fraction · (n - 1) of the sorted values.

    >>> _percentile(np.array([0.0, 1.0, 2.0, 3.0]), 0.5), _percentile(np.array([0.0, 10.0]), 0.999)
    (1.5, 9.99)
    """
    v = sorted_values
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = fraction * (v.size - 1)
    ip = int(p)
    p -= ip
    return float((1 - p) * v[ip] + p * v[min(ip + 1, v.size - 1)])


def _median(sorted_values: np.ndarray) -> float:
    n = sorted_values.size
    return float(0.5 * (sorted_values[n // 2] + sorted_values[n // 2 - 1]) if n % 2 == 0 else sorted_values[n // 2])


@dataclass(frozen=True)
class Summary:
    """llama.cpp's `--kl-divergence` statistics over a set of scored positions."""

    n: int
    kld_mean: float
    kld_unc: float
    kld_pct: dict[str, float]  # "max", "99.9", ..., "median", ..., "min"
    dp_mean: float
    dp_unc: float
    dp_pct: dict[str, float]
    dp_rms: float
    dp_rms_unc: float
    same_top: float
    same_top_unc: float
    kld_bound_max: float = 0.0  # the largest per-position tail bound (compact base distributions)
    ppl: dict[str, float] = field(default_factory=dict)  # perplexity lines, when the tokens' nll are given

    def to_row(self) -> dict[str, float | int]:
        """Flat columns for `drift_summary` (percentiles as kld_p999, dp_p75 ...)."""
        row: dict[str, float | int] = {
            "n": self.n, "kld_mean": self.kld_mean, "kld_unc": self.kld_unc, "dp_mean": self.dp_mean,
            "dp_unc": self.dp_unc, "dp_rms": self.dp_rms, "dp_rms_unc": self.dp_rms_unc,
            "same_top": self.same_top, "same_top_unc": self.same_top_unc, "kld_bound_max": self.kld_bound_max,
        }
        for prefix, pct in (("kld", self.kld_pct), ("dp", self.dp_pct)):
            for label, value in pct.items():
                row[f"{prefix}_{_column(label)}"] = value
        return row


def _column(label: str) -> str:
    """A percentile's column suffix: 'max', 'p999' (99.9 %), 'p99', 'median', 'p01' (0.1 %), 'min'.

    >>> [_column(x) for x in ("max", "99.9", "99", "median", "5", "0.1", "min")]
    ['max', 'p999', 'p99', 'median', 'p5', 'p01', 'min']
    """
    return label if not label[0].isdigit() else "p" + label.replace(".", "")


def _label(fraction: float) -> str:
    """A percentile's label: 0.999 -> '99.9', 0.99 -> '99', 0.05 -> '5', 0.001 -> '0.1'."""
    return f"{100 * fraction:.1f}".removesuffix(".0")


def summary(kld: Sequence[float], dp: Sequence[float], same_top: Sequence[bool],
            nll: Sequence[float] | None = None, nll_base: Sequence[float] | None = None,
            bound: Sequence[float] | None = None) -> Summary:
    """The statistics of `llama-perplexity --kl-divergence` over these positions, its formulas exactly.

    Sums are accumulated as llama.cpp accumulates them (sum, sum of squares; Δp² and Δp⁴ for
    the RMS); uncertainties are `_mean_and_uncertainty`'s; the same-top error is
    sqrt(p (1 - p) / (n - 1)); the RMS error is 0.5 / rms · the MSE's uncertainty. With `nll`
    and `nll_base` (-log Q(y), -log P(y) of the scored tokens) the perplexity lines are added.
    """
    k = np.asarray(kld, dtype=np.float64)
    d = np.asarray(dp, dtype=np.float64)
    s = np.asarray(same_top, dtype=bool)
    n = int(k.size)
    if n == 0:
        raise ValueError("summary: no positions")
    if d.size != n or s.size != n:
        raise ValueError("summary: kld, dp and same_top differ in length")
    kld_mean, kld_unc = _mean_and_uncertainty(float(k.sum()), float((k * k).sum()), n)
    d2 = d * d
    dp_mean, dp_unc = _mean_and_uncertainty(float(d.sum()), float(d2.sum()), n)
    mse, mse_unc = _mean_and_uncertainty(float(d2.sum()), float((d2 * d2).sum()), n)
    rms = math.sqrt(mse)
    rms_unc = 0.5 / rms * mse_unc if rms > 0 else 0.0
    top = float(s.sum()) / n
    top_unc = math.sqrt(top * (1.0 - top) / (n - 1)) if n > 1 else 0.0
    ks, ds = np.sort(k), np.sort(d)
    kld_pct = {"max": float(ks[-1])}
    kld_pct.update({_label(f): _percentile(ks, f) for f in KLD_FRACTIONS[:4]})
    kld_pct["median"] = _median(ks)
    kld_pct.update({_label(f): _percentile(ks, f) for f in KLD_FRACTIONS[4:]})
    kld_pct["min"] = float(ks[0])
    dp_pct = {"max": float(ds[-1])}
    dp_pct.update({_label(f): _percentile(ds, f) for f in DP_FRACTIONS[:5]})
    dp_pct["median"] = _median(ds)
    dp_pct.update({_label(f): _percentile(ds, f) for f in DP_FRACTIONS[5:]})
    dp_pct["min"] = float(ds[0])
    ppl: dict[str, float] = {}
    if nll is not None and nll_base is not None:
        ppl = _ppl_lines(np.asarray(nll, dtype=np.float64), np.asarray(nll_base, dtype=np.float64))
    bmax = float(np.max(bound)) if bound is not None and len(bound) else 0.0
    return Summary(n, kld_mean, kld_unc, kld_pct, dp_mean, dp_unc, dp_pct, rms, rms_unc, top, top_unc, bmax, ppl)


def _ppl_lines(nll: np.ndarray, nll_base: np.ndarray) -> dict[str, float]:
    """llama.cpp's perplexity statistics of the candidate (Q) and the base over the scored tokens."""
    n = int(nll.size)
    lq = _mean_and_uncertainty(float(nll.sum()), float((nll * nll).sum()), n)
    lb = _mean_and_uncertainty(float(nll_base.sum()), float((nll_base * nll_base).sum()), n)
    cov = _covariance(float(nll.sum()), float(nll_base.sum()), float((nll * nll_base).sum()), n)
    ppl, ppl_unc = math.exp(lq[0]), math.exp(lq[0]) * lq[1]
    ppl_b, ppl_b_unc = math.exp(lb[0]), math.exp(lb[0]) * lb[1]
    cor = cov / (lq[1] * lb[1]) if lq[1] > 0 and lb[1] > 0 else math.nan
    ratio = lq[0] - lb[0]
    ratio_unc = math.sqrt(max(0.0, lq[1] ** 2 + lb[1] ** 2 - 2.0 * cov))
    diff_unc = math.sqrt(max(0.0, ppl_unc ** 2 + ppl_b_unc ** 2 - 2.0 * ppl * ppl_b * cov))
    return {"ppl": ppl, "ppl_unc": ppl_unc, "ppl_base": ppl_b, "ppl_base_unc": ppl_b_unc, "cor": cor,
            "ln_ratio": ratio, "ln_ratio_unc": ratio_unc, "ratio": math.exp(ratio),
            "ratio_unc": math.exp(ratio) * ratio_unc, "diff": ppl - ppl_b, "diff_unc": diff_unc}


def format_summary(s: Summary) -> str:
    """The summary as `llama-perplexity --kl-divergence` prints it (its labels and number formats)."""
    lines = []
    if s.ppl:
        p = s.ppl
        lines += [
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {p['ppl']:10.6f} ± {p['ppl_unc']:10.6f}",
            f"Mean PPL(base)                : {p['ppl_base']:10.6f} ± {p['ppl_base_unc']:10.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100.0 * p['cor']:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {p['ln_ratio']:10.6f} ± {p['ln_ratio_unc']:10.6f}",
            f"Mean PPL(Q)/PPL(base)         : {p['ratio']:10.6f} ± {p['ratio_unc']:10.6f}",
            f"Mean PPL(Q)-PPL(base)         : {p['diff']:10.6f} ± {p['diff_unc']:10.6f}",
            "",
        ]
    lines += ["====== KL divergence statistics ======", f"Mean    KLD: {s.kld_mean:10.6f} ± {s.kld_unc:10.6f}"]
    for label, value in s.kld_pct.items():
        lines.append(f"{_head(label)} KLD: {value:10.6f}")
    lines += ["", "====== Token probability statistics ======",
              f"Mean    Δp: {100 * s.dp_mean:6.3f} ± {100 * s.dp_unc:5.3f} %"]
    for label, value in s.dp_pct.items():
        lines.append(f"{_head(label)} Δp: {100 * value:6.3f}%")
    lines += [f"RMS Δp    : {100 * s.dp_rms:6.3f} ± {100 * s.dp_rms_unc:5.3f} %",
              f"Same top p: {100 * s.same_top:6.3f} ± {100 * s.same_top_unc:5.3f} %"]
    if s.kld_bound_max > 0:
        lines.append(f"KLD tail bound (max over positions): {s.kld_bound_max:.3g}")
    return "\n".join(lines)


def _head(label: str) -> str:
    """llama.cpp's row heads: 'Maximum', '99.9%  ', ' 5.0%  ', 'Median ', 'Minimum'."""
    names = {"max": "Maximum", "median": "Median ", "min": "Minimum"}
    return names.get(label) or f"{float(label):4.1f}%  "


# --- by position -----------------------------------------------------------------------


@dataclass(frozen=True)
class Ratio:
    """drift_first_ratio: mean KLD at position 0 / mean KLD at positions >= 1, with its CI."""

    value: float
    lo: float
    hi: float
    n: int  # prompts with a position 0 and at least one later position
    kld0: float  # mean KLD at position 0
    kld_rest: float  # mean KLD over all positions >= 1


def first_ratio(prompts: Sequence[Sequence[float]], *, n_boot: int = 2000, seed: int = 0,
                alpha: float = 0.05) -> Ratio:
    """Mean KLD at position 0 / mean KLD at positions >= 1, and its percentile bootstrap CI over prompts.

    `prompts[i]` are prompt i's per-position KLDs, position 0 first. Both means pool positions:
    the numerator is the mean over prompts of their position-0 KLD, the denominator the mean over
    every (prompt, position >= 1) pair; a resample draws whole prompts with replacement and
    recomputes both. Prompts with fewer than two positions are left out.

    >>> r = first_ratio([[2.0, 1.0, 1.0], [4.0, 2.0]], n_boot=200)
    >>> r.value, r.kld0, round(r.kld_rest, 4), r.n
    (2.25, 3.0, 1.3333, 2)
    """
    rows = [list(map(float, p)) for p in prompts if len(p) >= 2]
    if not rows:
        raise ValueError("first_ratio: no prompt has a first and a later position")
    if n_boot < 1 or not 0 < alpha < 1:
        raise ValueError("first_ratio: n_boot must be >= 1 and alpha in (0, 1)")
    s0 = np.array([r[0] for r in rows])
    s1 = np.array([sum(r[1:]) for r in rows])
    n1 = np.array([len(r) - 1 for r in rows], dtype=np.float64)
    n = len(rows)
    kld0, rest = float(s0.mean()), float(s1.sum() / n1.sum())
    value = kld0 / rest if rest > 0 else math.inf
    rng = np.random.default_rng(seed)
    w = rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)  # n_boot × n prompt counts
    num = (w @ s0) / n
    den = (w @ s1) / (w @ n1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(den > 0, num / den, np.inf)
    lo, hi = np.quantile(ratios, [alpha / 2, 1 - alpha / 2])
    return Ratio(value, float(lo), float(hi), n, kld0, rest)


def by_bucket(positions: Sequence[int], kld: Sequence[float], dp: Sequence[float], same_top: Sequence[bool],
              bound: Sequence[float] | None = None) -> dict[str, Summary]:
    """`summary` overall (ALL) and per position bucket that holds at least one position, in BUCKETS order."""
    pos = np.asarray(positions)
    k, d, s = np.asarray(kld, float), np.asarray(dp, float), np.asarray(same_top, bool)
    b = np.asarray(bound, float) if bound is not None else np.zeros(k.size)
    out = {ALL: summary(k, d, s, bound=b)}
    labels = np.array([bucket(int(p)) for p in pos])
    for label, _, _ in BUCKETS:
        m = labels == label
        if m.any():
            out[label] = summary(k[m], d[m], s[m], bound=b[m])
    return out
