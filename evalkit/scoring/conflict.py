"""The conflicting-facts metrics (docs/metrics.md §1.9): which of two values the response gives.

Owns: `conflict_pick` (first / last / both / neither, each value matched as
`needle_recall` matches a key), its per-sample values (`first_wins`, `last_wins`,
`conflict_both`), `order_flip` (does a pair's answer change when its two sentences swap
places) and `derived_metrics` (recency_index and order_flip_rate per task, and all four
per length, as metric rows). Does not: build documents (`prompts.conflict`).
"""

from __future__ import annotations

from collections import defaultdict

from evalkit.scoring.needle import needle_recall
from evalkit.scoring.stats import mean_stderr

PICKS = ("first", "last", "both", "neither")


def conflict_pick(response: str, first_key: str, last_key: str) -> str:
    """Which value the response gives: "first", "last", "both" or "neither".

    >>> conflict_pick("The code is 1234-5678.", "1234-5678", "9012-3456")
    'first'
    >>> conflict_pick("9012 3456, or 1234-5678", "1234-5678", "9012-3456")
    'both'
    >>> conflict_pick("I do not know.", "1234-5678", "9012-3456")
    'neither'
    """
    first, last = needle_recall(response, first_key), needle_recall(response, last_key)
    if first and last:
        return "both"
    return "first" if first else "last" if last else "neither"


def pick_values(pick: str) -> dict[str, float]:
    """The per-sample metric values of a pick.

    >>> pick_values("last")
    {'first_wins': 0.0, 'last_wins': 1.0, 'conflict_both': 0.0}
    """
    if pick not in PICKS:
        raise ValueError(f"unknown conflict pick {pick!r}")
    return {"first_wins": float(pick == "first"), "last_wins": float(pick == "last"),
            "conflict_both": float(pick == "both")}


def pick_of(values: dict) -> str | None:
    """A sample's pick read back from its values (None when it holds none of them).

    >>> pick_of({"first_wins": 0.0, "last_wins": 0.0, "conflict_both": 0.0})
    'neither'
    """
    if any(values.get(k) is None for k in ("first_wins", "last_wins", "conflict_both")):
        return None
    if values["conflict_both"]:
        return "both"
    return "first" if values["first_wins"] else "last" if values["last_wins"] else "neither"


def _value(pick: str, order: str) -> str:
    """The value a pick names: A or B for first / last (by the document's order), else the pick."""
    if pick == "first":
        return "A" if order == "ab" else "B"
    if pick == "last":
        return "B" if order == "ab" else "A"
    return pick


def order_flip(pick_ab: str, pick_ba: str) -> bool:
    """Did the answer change when the two sentences swapped places?

    The answer is the value given (A, B, both or neither): a model that always takes the
    last sentence answers B, then A — a flip; one that always says A does not flip.

    >>> order_flip("last", "last"), order_flip("first", "last"), order_flip("both", "both")
    (True, False, False)
    """
    return _value(pick_ab, "ab") != _value(pick_ba, "ba")


def recency_index(first_wins: float, last_wins: float) -> float:
    """last_wins - first_wins: +1 the end always wins, -1 the start always wins, 0 balanced (or never decided)."""
    return last_wins - first_wins


def derived_metrics(run_id: str, samples: list[dict]) -> list[dict]:
    """Per conflict task: recency_index and order_flip_rate, and per length first_wins, last_wins,
    recency_index and order_flip_rate (metric rows). Pairs with one order missing (a --limit
    that cut a pair) do not count towards order_flip_rate."""
    by_task: dict[str, list[dict]] = defaultdict(list)
    for s in samples:
        if s.get("conflict_pick") is not None:
            by_task[s["task"]].append(s)
    rows = []
    for task, items in sorted(by_task.items()):
        def add(metric, value, stderr, n, task=task):
            rows.append({"run_id": run_id, "task": task, "metric": metric, "filter": "none",
                         "value": value, "stderr": stderr, "n": n})

        def summary(group: list[dict], suffix: str) -> None:
            first = sum(s["conflict_pick"] == "first" for s in group) / len(group)
            last = sum(s["conflict_pick"] == "last" for s in group) / len(group)
            if suffix:
                for name, key in (("first_wins", "first"), ("last_wins", "last")):
                    mean, se = mean_stderr([float(s["conflict_pick"] == key) for s in group])
                    add(f"{name}{suffix}", mean, se, len(group))
            add(f"recency_index{suffix}", recency_index(first, last), None, len(group))
            pairs: dict[str, dict[str, str]] = defaultdict(dict)
            for s in group:
                pairs[s["conflict_pair"]][s["conflict_order"]] = s["conflict_pick"]
            flips = [float(order_flip(p["ab"], p["ba"])) for p in pairs.values() if "ab" in p and "ba" in p]
            if flips:
                mean, se = mean_stderr(flips)
                add(f"order_flip_rate{suffix}", mean, se, len(flips))

        summary(items, "")
        by_length: dict[int, list[dict]] = defaultdict(list)
        for s in items:
            by_length[int(s["needle_length"])].append(s)
        for length, group in sorted(by_length.items()):
            summary(group, f"@len{length}")
    return rows
