"""The needle metrics (docs/metrics.md §1.6): did the response give the key, and recall by depth and length.

Owns: `needle_recall` (the key in the response, digits, separators, width and case
normalised), `start_gap`, `middle_gap`, and `derived_metrics` (a run's recall per depth
and per length, and its gaps — overall and per length for start_gap — as metric rows). Does not: build needle documents
(`prompts.needle`) or plot them (`report.needle_plot`).
"""

from __future__ import annotations

import re
import unicodedata
from collections import defaultdict

from evalkit.defaults import MIDDLE_BAND
from evalkit.scoring.stats import interval, mean_stderr

# Separators that may sit between the digits of a key: horizontal whitespace,
# underscore, and dashes (hyphen, the Unicode dashes, minus sign, wave dash).
# Newlines, dots, commas and slashes are not separators.
_SEP = r"[^\S\r\n]|[_\-\u2010-\u2015\u2212\u2e3a\u2e3b\u301c\ufe58\ufe63\uff0d]"
_SEP_RUN = re.compile(rf"(?:{_SEP})+")
_SEP_BETWEEN_DIGITS = re.compile(rf"(?<=[0-9])(?:{_SEP})+(?=[0-9])")
_DIGIT_RUN = re.compile(r"[0-9]+")


def normalize_key(text: str) -> str:
    """NFKC, casefold, and drop separators that sit between digits.

    Separators are horizontal whitespace, ``_`` and dashes (``-``, the Unicode
    dashes such as en dash and em dash, minus sign); newlines, dots, commas and
    slashes are kept. Examples: "2025-0419", "2025 0419", "２０２５-０４１９",
    "2025–0419" and "2025_0419" all -> "20250419";
    "The Code is 2025-0419." -> "the code is 20250419.".
    """
    text = unicodedata.normalize("NFKC", text).casefold()
    return _SEP_BETWEEN_DIGITS.sub("", text)


def needle_recall(response: str, key: str) -> float:
    """1.0 if the key's digits appear in the response as whole digit chunks, else 0.0.

    Both sides go through NFKC and casefold. The key reduces to its digit string
    ("2025-0419" -> "20250419"). The response's digits form chunks (maximal runs
    of 0-9); chunks joined only by separators (see ``normalize_key``) form a
    group. It is a hit when some consecutive chunks of one group concatenate to
    exactly the key's digits, so extra digits glued to either end never count.

    Examples with key "2025-0419":
    "The code is 2025-0419." -> 1.0; "编号是２０２５０４１９" -> 1.0;
    "2025 – 0419" -> 1.0; "2025-0419 2025-0419" -> 1.0 (chunks 2025, 0419 match);
    "12025-0419" -> 0.0 (chunk 12025); "2025-04190" -> 0.0; "2025-0418" -> 0.0;
    "2025.0419" -> 0.0 (a dot is not a separator).
    """
    want = re.sub(r"[^0-9]", "", normalize_key(key))
    if not want:
        raise ValueError(f"needle key {key!r} has no digits")
    text = unicodedata.normalize("NFKC", response).casefold()
    groups: list[list[str]] = []  # chunks joined by separators only
    prev_end = None
    for m in _DIGIT_RUN.finditer(text):
        if prev_end is not None and _SEP_RUN.fullmatch(text, prev_end, m.start()):
            groups[-1].append(m.group())
        else:
            groups.append([m.group()])
        prev_end = m.end()
    for chunks in groups:
        for i in range(len(chunks)):
            joined = ""
            for chunk in chunks[i:]:
                joined += chunk
                if joined == want:
                    return 1.0
                if len(joined) >= len(want):
                    break
    return 0.0


def middle_gap(recall_by_depth: dict[float, float]) -> float:
    """Mean recall at the ends (d in {0.0, 1.0}) minus mean recall in the middle (MIDDLE_BAND: 0.3 <= d <= 0.7).

    Example: {0.0: 1.0, 0.1: 0.9, 0.3: 0.5, 0.5: 0.25, 0.7: 0.75, 1.0: 0.8}
    -> (1.0 + 0.8) / 2 - (0.5 + 0.25 + 0.75) / 3 = 0.9 - 0.5 = 0.4.
    Positive means lost in the middle. Raises ValueError if either group is empty.
    """
    eps = 1e-9
    ends = [r for d, r in recall_by_depth.items() if abs(d) <= eps or abs(d - 1.0) <= eps]
    lo, hi = MIDDLE_BAND
    middle = [r for d, r in recall_by_depth.items() if lo - eps <= d <= hi + eps]
    if not ends:
        raise ValueError("middle_gap needs recall at depth 0.0 or 1.0; none given")
    if not middle:
        raise ValueError(f"middle_gap needs recall at some depth in [{lo}, {hi}]; none given")
    return sum(ends) / len(ends) - sum(middle) / len(middle)


START_FROM = 0.25  # start_gap compares depth 0 with the depths from here to 1


def start_gap(recall_by_depth: dict[float, float]) -> float:
    """Mean recall at depths d in [0.25, 1] minus recall at d = 0 (docs/metrics.md §1.6).

    Positive means the fact in the first sentence is what gets lost. Example:
    {0.0: 0.0, 0.1: 1.0, 0.25: 1.0, 0.5: 1.0, 1.0: 0.5} -> (1 + 1 + 0.5) / 3 - 0 = 0.833
    (depth 0.1 is in neither group). Raises ValueError if either group is empty.
    """
    eps = 1e-9
    start = [r for d, r in recall_by_depth.items() if abs(d) <= eps]
    rest = [r for d, r in recall_by_depth.items() if START_FROM - eps <= d <= 1.0 + eps]
    if not start:
        raise ValueError("start_gap needs recall at depth 0.0; none given")
    if not rest:
        raise ValueError(f"start_gap needs recall at some depth in [{START_FROM}, 1]; none given")
    return sum(rest) / len(rest) - sum(start) / len(start)


def derived_metrics(run_id: str, samples: list[dict]) -> list[dict]:
    """Recall by depth and by length, start_gap (overall and per length) and middle_gap, per needle
    task (metric rows)."""
    by_task: dict[str, list[dict]] = defaultdict(list)
    for s in samples:
        if s.get("needle_depth") is not None and s.get("needle_recall") is not None:
            by_task[s["task"]].append(s)
    rows = []
    for task, items in sorted(by_task.items()):
        def add(metric, values, task=task):
            mean, se = mean_stderr(values)
            ci = interval(values, binary=True)
            rows.append({"run_id": run_id, "task": task, "metric": metric, "filter": "none",
                         "value": mean, "stderr": se, "n": len(values),
                         "ci_lo": ci[0] if ci else None, "ci_hi": ci[1] if ci else None})

        depth_groups: dict[float, list[float]] = defaultdict(list)
        length_groups: dict[int, list[float]] = defaultdict(list)
        for s in items:
            depth_groups[round(float(s["needle_depth"]), 3)].append(s["needle_recall"])
            length_groups[int(s["needle_length"])].append(s["needle_recall"])
        for depth, values in sorted(depth_groups.items()):
            add(f"needle_recall@depth{depth:g}", values)
        for length, values in sorted(length_groups.items()):
            add(f"needle_recall@len{length}", values)
        by_depth = {d: sum(v) / len(v) for d, v in depth_groups.items()}
        for name, gap_of in (("start_gap", start_gap), ("middle_gap", middle_gap)):
            try:
                gap = gap_of(by_depth)
            except ValueError:
                continue  # the grid lacks a depth group this gap needs: no gap to report
            rows.append({"run_id": run_id, "task": task, "metric": name, "filter": "none",
                         "value": gap, "stderr": None, "n": len(items)})
        for length in sorted(length_groups):
            cells: dict[float, list[float]] = defaultdict(list)
            for s in items:
                if int(s["needle_length"]) == length:
                    cells[round(float(s["needle_depth"]), 3)].append(s["needle_recall"])
            try:
                gap = start_gap({d: sum(v) / len(v) for d, v in cells.items()})
            except ValueError:
                continue
            rows.append({"run_id": run_id, "task": task, "metric": f"start_gap@len{length}", "filter": "none",
                         "value": gap, "stderr": None, "n": sum(len(v) for v in cells.values())})
    return rows
