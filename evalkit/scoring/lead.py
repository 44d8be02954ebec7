"""Does the first token predict the answer? AUROC of first-token signals against `answer_hit`.

Owns: the leading-indicator table of a run (docs/metrics.md §1.7): for each task (a group
pooled over its tasks), each category of it, and each first-token signal, the AUROC of the
signal against whether the whole answer was right, its 95 % bootstrap interval over
prompts, the number of checkable prompts and how many were right; undefined (NULL, with
the reason) when every checkable answer is right or every one wrong, or the run has no
values of the signal. The interval alone is NULL, and the reason says what it needs, when
fewer than `MIN_AUROC_CLASS` answers are right or wrong (`interval_need`): a bootstrap over
one right answer ranks it alike in every resample and gives a point, not an interval. Each signal is oriented by its registry direction, so that a
higher value means "this prompt looks better": `entropy`, `opener_mass` and
`prior_drift` enter negated. The AUROC is scikit-learn's `roc_auc_score`; the bootstrap
resamples prompts and ranks each resample with scipy's `rankdata` (the Mann–Whitney U),
which counts ties as ½ as the AUROC does. Does not: read or write the DB.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from evalkit.defaults import MIN_AUROC_CLASS, MIN_BOOTSTRAP_PROMPTS
from evalkit.scoring import registry

SIGNALS = registry.LEAD_SIGNALS  # first-token signals whose AUROC against answer_hit is reported
ALL = "*"  # the category of a row over all of a task's checkable prompts
N_BOOT = 1000
SEED = 0


def auroc(scores: Sequence[float], labels: Sequence[float]) -> float:
    """AUROC of `scores` for the 0/1 `labels` (ties count ½); ValueError unless both classes occur.

    >>> auroc([0.9, 0.8, 0.3, 0.1], [1, 1, 0, 0]), auroc([0.5, 0.5], [1, 0])
    (1.0, 0.5)
    """
    from sklearn.metrics import roc_auc_score

    y = np.asarray(labels, dtype=float)
    if y.size == 0 or y.min() == y.max():
        raise ValueError("auroc needs both right and wrong answers")
    return float(roc_auc_score(y, np.asarray(scores, dtype=float)))


def bootstrap_interval(scores: Sequence[float], labels: Sequence[float], *, n_boot: int = N_BOOT,
                       seed: int = SEED, confidence: float = 0.95) -> tuple[float, float] | None:
    """Percentile interval of the AUROC over prompts resampled with replacement (None when too few
    resamples hold both classes). Each resample's AUROC is its Mann–Whitney U over n₁·n₀, from
    scipy's tie-averaged ranks, all resamples at once."""
    from scipy.stats import rankdata

    s, y = np.asarray(scores, dtype=float), np.asarray(labels, dtype=float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, s.size, size=(n_boot, s.size))
    ys, ss = y[idx], s[idx]
    n1 = ys.sum(axis=1)
    n0 = s.size - n1
    ok = (n1 > 0) & (n0 > 0)
    if ok.sum() < n_boot // 2:
        return None
    ranks = rankdata(ss[ok], axis=1)
    u = (ranks * ys[ok]).sum(axis=1) - n1[ok] * (n1[ok] + 1) / 2
    values = u / (n1[ok] * n0[ok])
    alpha = (1 - confidence) / 2
    return float(np.quantile(values, alpha)), float(np.quantile(values, 1 - alpha))


def interval_need(n_right: int, n_wrong: int) -> str | None:
    """Why an AUROC over these answers gets no interval (the row says what it needs), None when it
    may have one: at least `MIN_AUROC_CLASS` right and as many wrong answers, and
    `MIN_BOOTSTRAP_PROMPTS` in all (the gate's rule for a bootstrap interval).

    >>> interval_need(1, 41)
    'no interval: needs 10 right and 10 wrong answers, has 1 right, 41 wrong'
    >>> interval_need(10, 10) is None
    True
    """
    if min(n_right, n_wrong) >= MIN_AUROC_CLASS and n_right + n_wrong >= MIN_BOOTSTRAP_PROMPTS:
        return None
    if min(n_right, n_wrong) >= MIN_AUROC_CLASS:
        return f"no interval: needs {MIN_BOOTSTRAP_PROMPTS} prompts, has {n_right + n_wrong}"
    return (f"no interval: needs {MIN_AUROC_CLASS} right and {MIN_AUROC_CLASS} wrong answers, "
            f"has {n_right} right, {n_wrong} wrong")


def _oriented(signal: str, value: float) -> float:
    return value if registry.higher_is_better(signal) is not False else -value


def indicator_rows(run_id: str, task: str, category: str, samples: Sequence[dict]) -> list[dict]:
    """One row per signal for these samples (those with an `answer_hit` value)."""
    checkable = [s for s in samples if s.get("answer_hit") is not None]
    labels_all = [float(s["answer_hit"]) for s in checkable]
    rows = []
    for signal in SIGNALS:
        pairs = [(_oriented(signal, float(s[signal])), float(s["answer_hit"])) for s in checkable
                 if s.get(signal) is not None]
        n_right = int(sum(y for _, y in pairs))
        row = {"run_id": run_id, "task": task, "category": category, "signal": signal, "auroc": None,
               "ci_lo": None, "ci_hi": None, "n": len(pairs), "n_right": n_right,
               "base_rate": (sum(labels_all) / len(labels_all)) if labels_all else None, "reason": None}
        if not pairs:
            row["reason"] = f"no {signal} values (a backend without logprobs, or no checkable prompts)"
        elif row["n_right"] == len(pairs):
            row["reason"] = "every checkable answer is right"
        elif row["n_right"] == 0:
            row["reason"] = "every checkable answer is wrong"
        else:
            scores, labels = [p for p, _ in pairs], [y for _, y in pairs]
            row["auroc"] = auroc(scores, labels)
            row["reason"] = interval_need(n_right, len(pairs) - n_right)
            ci = None if row["reason"] else bootstrap_interval(scores, labels)
            if ci:
                row["ci_lo"], row["ci_hi"] = ci
            elif not row["reason"]:
                row["reason"] = "no interval: too few bootstrap resamples held both right and wrong answers"
        rows.append(row)
    return rows


def lead_table(run_id: str, samples: Sequence[dict], group_subtasks: dict[str, list[str]] | None = None) -> list[dict]:
    """The leading-indicator rows of a run: per task (and per group, pooled), per category and over
    all of them (category `*`); tasks without checkable prompts give no rows."""
    by_task: dict[str, list[dict]] = {}
    for s in samples:
        if s.get("answer_hit") is not None:
            by_task.setdefault(s["task"], []).append(s)

    def members(task: str) -> list[str]:
        subs = (group_subtasks or {}).get(task)
        return [t for sub in subs for t in members(sub)] if subs else [task]

    scopes = dict(by_task)
    for group in group_subtasks or {}:
        pooled = [s for t in members(group) for s in by_task.get(t, [])]
        if pooled:
            scopes[group] = pooled
    rows = []
    for task in sorted(scopes):
        items = scopes[task]
        rows += indicator_rows(run_id, task, ALL, items)
        for category in sorted({s.get("category") or "" for s in items} - {""}):
            rows += indicator_rows(run_id, task, category, [s for s in items if s.get("category") == category])
    return rows
