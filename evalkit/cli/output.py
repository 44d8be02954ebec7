"""Rendering rows for the terminal: aligned tables, CSV, JSON."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from collections.abc import Sequence
from typing import Any


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    return str(value).replace("\n", "\\n")


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]], max_width: int = 60) -> str:
    cells = [[_cell(v)[:max_width] for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    out = [line(columns), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def render(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str = "table", max_width: int = 60) -> str:
    if fmt == "json":
        return json.dumps([dict(zip(columns, r)) for r in rows], default=str, ensure_ascii=False, indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(columns)
        w.writerows([[("" if v is None else v) for v in r] for r in rows])
        return buf.getvalue().rstrip("\n")
    return table(columns, rows, max_width)
