"""Rendering rows for the terminal: aligned tables, CSV, JSON."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
from collections.abc import Sequence
from typing import Any

from evalkit.defaults import MIN_BOOTSTRAP_PROMPTS, MIN_SCORE_INTERVAL_PROMPTS
from evalkit.textsafe import term_json, term_line


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    return term_line(value)  # escape sequences and newlines shown, never obeyed


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]], max_width: int = 60) -> str:
    columns = [term_line(c) for c in columns]
    cells = [[_cell(v)[:max_width] for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    out = [line(columns), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def render(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str = "table", max_width: int = 60) -> str:
    if fmt == "json":
        return term_json(json.dumps([dict(zip(columns, r)) for r in rows], default=str, ensure_ascii=False, indent=2))
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(columns)
        w.writerows([[("" if v is None else v) for v in r] for r in rows])
        return buf.getvalue().rstrip("\n")
    return table(columns, rows, max_width)


def _ci(lo: Any, hi: Any) -> str:
    return "" if lo is None or hi is None else f"[{lo:.4f}, {hi:.4f}]"


def metric_table(rows: Sequence[dict[str, Any]]) -> str:
    """A run's metrics for the terminal: task, metric with its direction (↑ / ↓ from the registry),
    value, 95 % interval and n, in registry order within each task; then what it means and where
    to look next."""
    from evalkit.scoring import registry

    ordered = sorted(rows, key=lambda r: (r["task"], registry.sort_key(r["metric"])))
    body = []
    for r in ordered:
        better = registry.higher_is_better(r["metric"])
        arrow = "" if better is None else (" ↑" if better else " ↓")
        filt = r.get("filter") or "none"  # lm-eval's own tasks may name filters: gsm8k's strict-match
        label = r["metric"] + ("" if filt == "none" else f" ({filt})")
        body.append([r["task"], label + arrow, r["value"], _ci(r.get("ci_lo"), r.get("ci_hi")), r.get("n")])
    lines = [table(["task", "metric", "value", "95% CI", "n"], body)]
    lines.append("↑ higher is better, ↓ lower is better; what each metric means: `evalkit metrics` "
                 "or docs/metrics.md")
    if any(r.get("ci_lo") is None and r.get("n") is not None and r["n"] < MIN_BOOTSTRAP_PROMPTS for r in rows):
        lines.append(f"no 95% CI from too few prompts: a share needs {MIN_SCORE_INTERVAL_PROMPTS}, any other mean "
                     f"{MIN_BOOTSTRAP_PROMPTS} (the gate's rule)")
    from evalkit.scoring.firsttoken import whitespace_note

    lines += [note for r in ordered if r["metric"] == "ws_mass" and (note := whitespace_note(r["task"], r["value"]))]
    if any(r["metric"] == "ft_hit" for r in rows):
        lines.append("ft_hit counts a response only when its first word is an accepted start: "
                     "\"The capital of France is Paris.\" misses \"Paris\" by design")
    return "\n".join(lines)


def next_steps(run_id: str) -> str:
    return (f"next: `evalkit report` (HTML with plots) · `evalkit compare {run_id} <other run>` · "
            f"`evalkit gate --candidate {run_id} --baseline tag:prod`")


def lead_table(rows: Sequence[dict[str, Any]]) -> str:
    """The leading-indicator rows for the terminal: does the first token predict the answer?"""
    body = []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        if all(r["auroc"] is None for r in mine) and len({r["reason"] for r in mine}) == 1:  # one line says it
            body.append([task, "lead_auroc.*", None, "", max(r["n"] for r in mine), mine[0]["base_rate"],
                         mine[0]["reason"]])
            continue
        body += [[task, f"lead_auroc.{r['signal']}", r["auroc"], _ci(r["ci_lo"], r["ci_hi"]), r["n"],
                  r["base_rate"], r["reason"] or ""] for r in mine]
    return "\n".join([
        "does the first token predict the answer? AUROC of each first-token signal against answer_hit "
        "(0.5 = chance), over the checkable prompts",
        table(["task", "signal", "auroc", "95% CI", "n", "right", "why no value or interval"], body, max_width=70),
    ])
