"""The SQL views that restate a Python metric agree with it on the same samples.

`needle_gaps` restates `scoring.needle.start_gap` and `middle_gap` (the middle band
`defaults.MIDDLE_BAND`, the start depths from `START_FROM`), and `conflict_table` restates
`scoring.conflict`'s first_wins, last_wins, recency_index and order_flip_rate (a pair flips
when the value given changes with the order). Random samples, seeded, go into a fresh DB;
each view row is checked against the Python functions run on the very same rows.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest

from evalkit.defaults import MIDDLE_BAND
from evalkit.scoring import conflict, needle
from evalkit.store.db import transaction

DEPTHS = (0.0, 0.1, 0.25, MIDDLE_BAND[0], 0.5, MIDDLE_BAND[1], 0.9, 1.0)
PICKS = ("first", "last", "both", "neither")


def _needle_samples(rng: random.Random) -> list[dict]:
    rows = []
    for run_id in ("r1", "r2"):
        for lang in ("en", "zh"):
            for hint in (False, True):
                for length in (256, 512):
                    # a grid that lacks the middle band or depth 0 sometimes: the gap is then undefined
                    depths = [d for d in DEPTHS if rng.random() < 0.85]
                    for depth in depths:
                        for k in range(rng.randint(1, 3)):
                            rows.append({"run_id": run_id, "task": f"needle_{lang}" + ("_hint" if hint else ""),
                                         "doc_id": f"{lang}-{hint}-{length}-{depth}-{k}", "lang": lang,
                                         "needle_hint": hint, "needle_length": length, "needle_depth": depth,
                                         "needle_recall": float(rng.random() < 0.6)})
    return rows


def _conflict_samples(rng: random.Random) -> list[dict]:
    rows = []
    for run_id in ("r1", "r2"):
        for lang in ("en", "zh"):
            for length in (256, 1024):
                for pair in range(rng.randint(3, 8)):
                    for order in ("ab", "ba"):
                        if rng.random() < 0.15:
                            continue  # a --limit that cut one order of a pair
                        rows.append({"run_id": run_id, "task": f"needle_conflict_{lang}",
                                     "doc_id": f"{lang}-L{length}-p{pair}-{order}", "lang": lang,
                                     "needle_length": length, "conflict_pick": rng.choice(PICKS),
                                     "conflict_pair": f"{lang}-L{length}-p{pair}", "conflict_order": order})
    return rows


def _insert(rows: list[dict]) -> None:
    cols = sorted({k for r in rows for k in r})
    with transaction(None) as con:
        con.executemany(f"INSERT INTO samples ({', '.join(cols)}) VALUES ({', '.join('?' for _ in cols)})",
                        [[r.get(c) for c in cols] for r in rows])


def _view(sql: str) -> list[dict]:
    with transaction(None) as con:
        cur = con.execute(sql)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]


def _gap(fn, by_depth: dict[float, float]) -> float | None:
    try:
        return fn(by_depth)
    except ValueError:
        return None


def _same(sql_value, py_value) -> bool:
    if sql_value is None or py_value is None:
        return sql_value is None and py_value is None
    return math.isclose(sql_value, py_value, abs_tol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_needle_gaps_view_is_start_gap_and_middle_gap(seed):
    samples = _needle_samples(random.Random(seed))
    _insert(samples)
    cells: dict[tuple, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        key = (s["run_id"], s["task"], s["lang"], s["needle_hint"], s["needle_length"])
        cells[key][s["needle_depth"]].append(s["needle_recall"])
    rows = _view("SELECT run_id, task, lang, hint, length, start_gap, middle_gap FROM needle_gaps")
    assert len(rows) == len(cells)
    for row in rows:
        by_depth = {d: sum(v) / len(v) for d, v in cells[(row["run_id"], row["task"], row["lang"], row["hint"],
                                                          row["length"])].items()}
        assert _same(row["start_gap"], _gap(needle.start_gap, by_depth)), (row, by_depth)
        assert _same(row["middle_gap"], _gap(needle.middle_gap, by_depth)), (row, by_depth)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_conflict_table_view_is_the_conflict_metrics(seed):
    samples = _conflict_samples(random.Random(seed))
    _insert(samples)
    python: dict[tuple, float] = {}
    for run_id in {s["run_id"] for s in samples}:
        for m in conflict.derived_metrics(run_id, [s for s in samples if s["run_id"] == run_id]):
            python[(run_id, m["task"], m["metric"])] = m["value"]
    rows = _view("SELECT run_id, task, length, n, first_wins, last_wins, recency_index, pairs, order_flip_rate "
                 "FROM conflict_table")
    assert rows
    for row in rows:
        at = f"@len{row['length']}"
        for metric in ("first_wins", "last_wins", "recency_index", "order_flip_rate"):
            assert _same(row[metric], python.get((row["run_id"], row["task"], metric + at))), (row, metric)
        group = [s for s in samples if (s["run_id"], s["task"], s["needle_length"]) ==
                 (row["run_id"], row["task"], row["length"])]
        orders: dict[str, set[str]] = defaultdict(set)
        for s in group:
            orders[s["conflict_pair"]].add(s["conflict_order"])
        assert row["n"] == len(group)
        assert (row["pairs"] or 0) == sum(len(o) == 2 for o in orders.values())
