"""The report's sections about runs and first tokens, and the shape every section has.

Owns: `Table`, `Image` and `Section` (what a section holds: formatted cells, figures drawn
later, notes, or the one-line reason it is left out), the cell formats the sections share,
and the sections Runs, Leaderboard, First-token distributions, Does the first token
predict the answer? and Trend, each a function of the `ReportData` that returns its
`Section`. Does not: read the DB (`report.reading`), draw (`report.plots`; a section's
`Image` only holds the call), or render (`report.rendering`). The needle, attention and
conflict sections live in `report.needle_sections`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from evalkit.compare import DIMENSIONS
from evalkit.report.fonts import isolate
from evalkit.report.reading import MIN_BIN_SIZE, ReportData, config_line
from evalkit.scoring import registry
from evalkit.scoring.firsttoken import whitespace_note

MAX_PLOT_METRICS = 6  # panels of the leaderboard plot
MAX_TABLE_METRICS = 8  # metric columns of one leaderboard table: with the run and task columns, 1280 px wide
MAX_ROC_RUNS = 3  # ROC figures, newest runs with checkable answers first
MAX_TREND_TASKS = 6  # lines per trend panel (one per task)
TOKENS_PER_PROMPT = 8  # bars per prompt in the first-token plot
TABLE_RANKS = 5  # ranks per run in the first-token tables
FIRST_TOKEN_TITLE = "First-token distributions"
DEGENERATE_MARK = "⚠ degenerate"  # beside a leaderboard row whose task's output is degenerate (docs/report.md)


@dataclass
class Table:
    columns: list[str]
    rows: list[list[str]]  # formatted cells
    caption: str = ""
    numeric_from: int | None = None  # columns from this index on are right-aligned numbers
    strong: set[tuple[int, int]] = field(default_factory=set)  # (row, column) cells to emphasise


@dataclass
class Image:
    name: str  # PNG file next to index.html
    alt: str
    draw: Callable[[], Any]  # writes the file; called once every section is built (see build_report)


@dataclass
class Section:
    key: str
    title: str
    intro: str = ""
    tables: list[Table] = field(default_factory=list)
    images: list[Image] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    omitted: str | None = None  # one-line reason, when the section has no data
    side_by_side: bool = False  # lay the tables out in a wrapping row


def plural(n: int, noun: str) -> str:
    """A count and its noun, plural unless it is one.

    >>> plural(1, "run"), plural(3, "run"), plural(0, "prompt")
    ('1 run', '3 runs', '0 prompts')
    """
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def num(value: Any, digits: int = 3) -> str:
    """A cell of a number: floats to `digits` places, None empty.

    >>> num(0.12345), num(None), num(7), num(2.5, 1)
    ('0.123', '', '7', '2.5')
    """
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def with_ci(row: dict) -> str:
    """A value with its interval under it (a leaderboard row's value, ci_lo, ci_hi).

    >>> with_ci({"value": 0.5, "ci_lo": 0.25, "ci_hi": 0.75}), with_ci({"value": 0.5})
    ('0.500\\n[0.250, 0.750]', '0.500')
    """
    text = num(row["value"])
    if row.get("ci_lo") is not None and row.get("ci_hi") is not None:
        text += f"\n[{num(row['ci_lo'])}, {num(row['ci_hi'])}]"  # the interval under the value
    return text


def arrow(metric: str) -> str:
    """The registry's direction arrow, to follow a metric's name in a column header; none for a
    metric that describes without ranking or that the registry does not know.

    >>> arrow("ft_hit"), arrow("start_gap"), arrow("sink_rate"), arrow("my_metric")
    (' ↑', ' ↓', '', '')
    """
    spec = registry.get(metric)
    return f" {spec.arrow}" if spec is not None and spec.higher_is_better is not None else ""


def is_breakdown(metric: str) -> bool:
    return "@" in metric  # needle_recall@depth0.1, needle_recall@len512 ...


def runs_section(data: ReportData) -> Section:
    rows = []
    for r in data.runs:
        created = r["created_at"].strftime("%Y-%m-%d %H:%M:%S") if r["created_at"] else ""
        rows.append([r["id"], r["name"] or "", r["status"], r["model_label"], r["quant"] or "", r["quant_applied"],
                     r["kv_cache"] or "", r["template"] or "", r.get("engine") or "", ", ".join(r["tasks"] or []),
                     created, str(r["n_samples"]), num(r["duration_s"], 1)])
    table = Table(["id", "name", "status", "model", "quant", "quant applied", "kv cache", "template", "engine",
                   "tasks", "created (UTC)", "samples", "duration s"], rows, numeric_from=11)
    n, n_done = len(data.runs), len(data.done)
    done = ("done" if n == 1 else "all done") if n_done == n else f"{n_done} of them done"
    section = Section("runs", "Runs", tables=[table],
                      intro=f"{plural(n, 'run')}, {done}. The sections below name each run by its name (if it "
                            "has one) and its configuration: model · quant · KV cache (when not full) · template · "
                            "engine.")
    not_done = [r["label"] for r in data.runs if r["status"] != "done"]
    if not_done:
        section.notes.append(f"Not done, so left out of the sections below: {', '.join(not_done)}.")
    return section


def leaderboard_section(data: ReportData, out_dir: Path) -> Section:
    section = Section("leaderboard", "Leaderboard")
    if not data.done:
        section.omitted = "no done run among the selected runs"
        return section
    main = [r for r in data.leaderboard if not is_breakdown(r["metric"])]
    if not main:
        section.omitted = "no metric rows for the selected runs in the leaderboard view"
        return section
    metrics = sorted({r["metric"] for r in main}, key=registry.sort_key)
    runs = {r["id"]: r for r in data.runs}
    cells = {(r["task"], r["run_id"], r["metric"]): r for r in main}
    keys = sorted({(r["task"], r["run_id"]) for r in main},
                  key=lambda k: (k[0], runs[k[1]]["model_label"], runs[k[1]]["quant"] or "",
                                 runs[k[1]]["kv_cache"] or "", runs[k[1]]["template"] or "",
                                 runs[k[1]]["created_at"], k[1]))
    columns = ["task", "run: name · model · quant · template · engine"] + [m + arrow(m) for m in metrics]
    # (task, run) -> why its output is degenerate (`scoring.degenerate`): marked, and never ranked as best
    flagged = {(r["task"], r["run_id"]): r.get("degenerate_reason") or "" for r in main if r.get("degenerate")}
    rows, strong = [], set()
    for task, run_id in keys:
        run = runs[run_id]
        row = [task, run["label"] + (f" {DEGENERATE_MARK}" if (task, run_id) in flagged else "")]
        row += [with_ci(cells[(task, run_id, m)]) if (task, run_id, m) in cells else "" for m in metrics]
        rows.append(row)
    for j, metric in enumerate(metrics):
        better = registry.higher_is_better(metric)
        if better is None:
            continue
        for task in {k[0] for k in keys}:
            values = [(i, cells[(task, k[1], metric)]["value"]) for i, k in enumerate(keys)
                      if k[0] == task and (task, k[1], metric) in cells and k not in flagged
                      and cells[(task, k[1], metric)]["value"] is not None]
            if len(values) < 2 or len({v for _, v in values}) == 1:
                continue
            best = max(v for _, v in values) if better else min(v for _, v in values)
            strong |= {(i, 2 + j) for i, v in values if v == best}
    section.intro = ("Each metric's value and its 95 % interval from the leaderboard view (Wilson for "
                     "proportions, bootstrap percentile for other means, so it stays inside the metric's "
                     "range); ↑ higher is better, ↓ lower is better; the best run per task is in bold.")
    if flagged:
        section.intro += (f" A run marked {DEGENERATE_MARK} gave degenerate output on that task (mostly empty, "
                          "stopped at once, one token repeated, or its first-step mass on special tokens): its "
                          "values are shown, never bolded.")
    for (task, run_id, metric), cell in sorted(cells.items()):
        if metric == "ws_mass" and (note := whitespace_note(task, cell["value"])):
            section.notes.append(f"{runs[run_id]['label']} on {note}.")
    for (task, run_id), why in sorted(flagged.items()):
        section.notes.append(f"{DEGENERATE_MARK} {runs[run_id]['label']} on {task}: degenerate output, not ranked: "
                             f"{why}.")
    for a, b in column_chunks(len(metrics), MAX_TABLE_METRICS):  # tables that fit the page, never cut off
        caption = f"metrics {a + 1}-{b} of {len(metrics)}" if b - a < len(metrics) else ""
        section.tables.append(Table(columns[:2] + columns[2 + a:2 + b], [r[:2] + r[2 + a:2 + b] for r in rows],
                                    caption=caption, numeric_from=2,
                                    strong={(i, j - a) for i, j in strong if a + 2 <= j < b + 2}))
    breakdowns = sorted({r["metric"] for r in data.leaderboard if is_breakdown(r["metric"])})
    if breakdowns:
        section.notes.append(f"{len(breakdowns)} breakdown metrics (e.g. {breakdowns[0]}) are left out of this "
                             "table; see the needle section or query the leaderboard view.")

    from evalkit.report.plots import leaderboard_plot

    plotted = metrics[:MAX_PLOT_METRICS]
    entries = [{"metric": r["metric"], "task": r["task"], "run": runs[r["run_id"]]["label"],
                "value": r["value"], "lo": r["ci_lo"], "hi": r["ci_hi"]}
               for r in main if r["metric"] in plotted and r["value"] is not None]
    entries.sort(key=lambda e: registry.sort_key(e["metric"]))
    if entries:
        labels = [runs[i]["label"] for i in data.done if any(e["run"] == runs[i]["label"] for e in entries)]
        section.images.append(Image("leaderboard.png", "leaderboard: each metric per task and run with 95 % CI",
                                    partial(leaderboard_plot, entries, labels, out_dir / "leaderboard.png")))
        if len(metrics) > len(plotted):
            section.notes.append(f"The plot shows the first {len(plotted)} of {len(metrics)} metrics.")
    return section


def column_chunks(n: int, most: int) -> list[tuple[int, int]]:
    """[start, stop) ranges cutting n columns into the fewest tables of at most `most`, evenly.

    >>> column_chunks(12, 8), column_chunks(5, 8), column_chunks(17, 8)
    ([(0, 6), (6, 12)], [(0, 5)], [(0, 6), (6, 12), (12, 17)])
    """
    parts = max(1, -(-n // most))
    size = -(-n // parts)
    return [(a, min(n, a + size)) for a in range(0, n, size)]


def short_text(text: str | None, width: int = 160) -> str:
    """Text on one line, at most `width` characters: a longer one keeps its start and its end (a
    needle question follows a long document).

    >>> short_text("What  is\\nrecursion?"), short_text("a" * 10 + "b" * 10, 9)
    ('What is recursion?', 'aaaa…bbbb')
    """
    text = " ".join((text or "").split())
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return text[:head] + "…" + text[len(text) - (width - 1 - head):]


def _targets(target: str | None) -> str:
    try:
        values = json.loads(target) if target else []
    except (TypeError, ValueError):
        return isolate(target or "")
    return ", ".join(isolate(str(v)) for v in values) if isinstance(values, list) else isolate(str(values))


def first_token_section(data: ReportData, out_dir: Path, prompts: int) -> Section:
    section = Section("first-token", FIRST_TOKEN_TITLE, side_by_side=True)
    if prompts == 0:
        section.omitted = "no prompts asked for (--prompts 0)"
        return section
    if not data.ft_runs:
        section.omitted = ("no first_token_topk rows for the selected runs "
                           "(backends without logprobs store none)")
        return section
    if not data.ft_prompts:
        section.omitted = "the runs with first-token top-k rows share no prompt"
        return section
    runs = {r["id"]: r for r in data.runs}
    ft_labels = [runs[i]["label"] for i in data.ft_runs]
    n_runs = data.ft_prompts[0]["n_runs"]
    if n_runs == 1:
        section.title = FIRST_TOKEN_TITLE + ": the least certain prompts"
        who = "the run" if len(data.ft_runs) == 1 else "a run (the runs with top-k rows share no prompt)"
        picked = (f"{plural(len(data.ft_prompts), 'prompt')} where {who} was least sure of its first token "
                  "(the lowest top-1 probability; with one run there is no disagreement to pick by).")
    else:
        section.title = FIRST_TOKEN_TITLE + ": where the runs disagree most"
        picked = (f"{plural(len(data.ft_prompts), 'prompt')} shared by {n_runs} of the {len(data.ft_runs)} runs "
                  "with top-k rows, those whose most likely first tokens disagree most (distinct top-1 tokens, "
                  "then the spread of the top-1 probability, then the lowest top-1 probability).")
    section.intro = (
        picked + " Each heading is the task, the prompt's id and the user's question (the templated "
        "context the model saw is in samples.prompt). Probabilities are exp(logprob) from "
        "first_token_topk; a token outside a run's stored top-k shows as 0. A token marked * is only "
        "the first byte(s) of a character: it shows as the first unit it starts, the character greedy "
        "decoding completes it to."
    )
    from evalkit.report.plots import first_token_plot, token_label

    panels = []
    for prompt in data.ft_prompts:
        title = f"{prompt['task']} / {prompt['doc_id']}"
        asked = prompt.get("question") or ""
        # tokens: the union of each run's top ranks, most probable first; runs on different tokenizers
        # (runs.tokenizer_hash) share a bar where their tokens' texts are the same, not their ids
        by_text = len({runs[r].get("tokenizer_hash") for r in prompt["runs"]}) > 1
        key = (lambda t: t["token"]) if by_text else (lambda t: t["token_id"])
        best: dict[Any, tuple[float, Any]] = {}
        for dist in prompt["runs"].values():
            for tok in dist["tokens"][:TOKENS_PER_PROMPT]:
                p = tok["p"]
                if key(tok) not in best or p > best[key(tok)][0]:
                    best[key(tok)] = (p, tok)
        token_ids = sorted(best, key=lambda t: -best[t][0])[:TOKENS_PER_PROMPT]
        probs = {}
        for run_id, dist in prompt["runs"].items():
            by_id: dict[Any, float] = {}
            for t in dist["tokens"]:
                by_id[key(t)] = by_id.get(key(t), 0.0) + t["p"] if by_text else t["p"]
            probs[runs[run_id]["label"]] = [by_id.get(t, 0.0) for t in token_ids]
        panels.append({"title": title, "question": asked, "tokens": [token_label(*_shown_token(best[t][1])) for t in token_ids],
                       "probs": probs})

        order = [i for i in data.ft_runs if i in prompt["runs"]]
        columns = ["rank"] + [runs[i]["label"] for i in order]
        rows = []
        ranks = max(len(prompt["runs"][i]["tokens"]) for i in order)
        for rank in range(min(TABLE_RANKS, ranks)):
            row = [str(rank + 1)]
            for run_id in order:
                toks = prompt["runs"][run_id]["tokens"]
                row.append(f"{isolate(_token_text(toks[rank]))} {num(toks[rank]['p'])}" if rank < len(toks) else "")
            rows.append(row)
        rows.append(["top-k mass"] + [num(prompt["runs"][i]["mass"]) for i in order])
        caption = f"{title}: “{isolate(short_text(asked))}”"
        if prompt.get("target"):
            caption += f" — accepted: {_targets(prompt['target'])}"
        section.tables.append(Table(columns, rows, caption=caption))
    section.images.insert(0, Image("first_token.png", "first-token probabilities of the chosen prompts, per run",
                                   partial(first_token_plot, panels, ft_labels, out_dir / "first_token.png")))
    return section


def _shown_token(tok: dict) -> tuple[str | None, int, bool]:
    """(text, id, completed) of a top-k token as the report shows it: a token that is only part
    of a character (it decodes to U+FFFD alone) shows as the first unit it starts, completed."""
    token, unit = tok["token"], tok.get("unit")
    if token is not None and "\ufffd" in token and unit:
        return unit, tok["token_id"], True
    return token, tok["token_id"], False


def _token_text(tok: dict) -> str:
    text, token_id, completed = _shown_token(tok)
    return (repr(text) + ("*" if completed else "")) if text is not None else f"#{token_id}"


def lead_section(data: ReportData, out_dir: Path) -> Section:
    """Does the first token predict the answer? ROC curves, the AUROC table, a reliability plot."""
    from evalkit.scoring.lead import SIGNALS

    section = Section("lead", "Does the first token predict the answer?")
    if not data.answers:
        section.omitted = ("no run among the selected has checkable answers (prompts with answers_full, "
                           "e.g. the firsttoken tasks)")
        return section
    runs = {r["id"]: r for r in data.runs}
    section.intro = (
        "For the prompts whose whole answer can be checked (answers_full), how well does each first-token "
        "signal tell a right answer from a wrong one? AUROC against answer_hit, 0.5 = chance, 1 = perfect; "
        "signals that are better low (entropy, opener_mass, prior_drift) enter negated. Intervals: 95 % "
        "bootstrap over prompts. An empty cell: the AUROC is undefined (every checkable answer right, or "
        "every one wrong, or no values of the signal). The ROC figures have a panel per task, titled with its "
        "checkable prompts (n) and how many were answered right. The reliability plot sorts each run's "
        f"checkable prompts by ft_hit_prob into equal-count bins of at least {MIN_BIN_SIZE} prompts (at most "
        "10 bins; one bin when a run has fewer) and shows each bin's share of right answers with its 95 % "
        "Wilson interval.")
    with_answers = [i for i in data.done if any(a["run_id"] == i for a in data.answers)]
    from evalkit.report.plots import reliability_plot, roc_plot

    roc: list[tuple[str, list[dict]]] = []  # (run id, a panel per task), the newest runs with a curve to draw
    flat = []  # runs without one: every answer right, or every one wrong, in each task (or no signal values)
    for run_id in reversed(with_answers):
        mine = [a for a in data.answers if a["run_id"] == run_id]
        panels = []
        for task in sorted({a["task"] for a in mine}):
            asked = [a for a in mine if a["task"] == task]
            right = sum(1 for a in asked if a["answer_hit"])
            panels.append({"title": f"{task}: n = {len(asked)}, {right} right", "samples": asked,
                           "curve": 0 < right < len(asked) and any(a.get(s) is not None for a in asked for s in SIGNALS)})
        if not any(p["curve"] for p in panels):
            flat.append(runs[run_id]["label"])
        elif len(roc) < MAX_ROC_RUNS:
            roc.insert(0, (run_id, panels))
    for k, (run_id, panels) in enumerate(roc):
        name = f"roc_{k + 1}.png"
        section.images.append(Image(name, f"ROC curves of the first-token signals per task, run {runs[run_id]['label']}",
                                    partial(roc_plot, panels, SIGNALS, out_dir / name,
                                            title=f"ROC against answer_hit — {runs[run_id]['label']}")))
    if flat:
        section.notes.append("No ROC curve to draw for " + "; ".join(reversed(flat)) + ": in each task every "
                             "checkable answer is right, or every one wrong (or the run has no signal values).")
    if data.reliability:
        series = {runs[r]["label"]: [x for x in data.reliability if x["run_id"] == r]
                  for r in with_answers if any(x["run_id"] == r for x in data.reliability)}
        section.images.append(Image("reliability.png", "answer accuracy in equal-count ft_hit_prob bins, per run",
                                    partial(reliability_plot, series, out_dir / "reliability.png",
                                            min_bin=MIN_BIN_SIZE)))
    columns = ["run", "task", "n", "share right"] + [f"lead_auroc.{s}" for s in SIGNALS]
    keys = sorted({(r["run_id"], r["task"]) for r in data.lead}, key=lambda k: (data.done.index(k[0]), k[1]))
    cells = {(r["run_id"], r["task"], r["signal"]): r for r in data.lead}
    rows = []
    for run_id, task in keys:
        first = next(cells[(run_id, task, s)] for s in SIGNALS if (run_id, task, s) in cells)
        row = [runs[run_id]["label"], task, str(first["n"]), num(first["base_rate"])]
        for s in SIGNALS:
            c = cells.get((run_id, task, s))
            row.append(with_ci({"value": c["auroc"], "ci_lo": c["ci_lo"], "ci_hi": c["ci_hi"]})
                       if c and c["auroc"] is not None else "")
        rows.append(row)
    section.tables.append(Table(columns, rows, numeric_from=2, caption="lead_auroc per run and task"))
    undefined = sorted({r["reason"] for r in data.lead if r["auroc"] is None and r["reason"]})
    if undefined:
        section.notes.append("Undefined cells: " + "; ".join(undefined) + ".")
    no_interval = sorted({r["reason"] for r in data.lead if r["auroc"] is not None and r["reason"]})
    if no_interval:
        section.notes.append("Cells without an interval: " + "; ".join(no_interval) + ".")
    if len(with_answers) - len(flat) > MAX_ROC_RUNS:
        section.notes.append(f"ROC curves of the {MAX_ROC_RUNS} newest of the {len(with_answers) - len(flat)} runs "
                             "with a curve to draw; the table covers all of them.")
    return section


def trend_section(data: ReportData, out_dir: Path) -> Section:
    section = Section("trend", "Trend across runs of one configuration")
    done = [r for r in data.runs if r["status"] == "done"]
    groups: dict[tuple, list[dict]] = {}
    for r in done:
        groups.setdefault(r["config_key"], []).append(r)
    if not groups or max(len(g) for g in groups.values()) < 2:
        section.omitted = (f"no configuration ({' x '.join(DIMENSIONS)}) has two or more done runs among the "
                           "selected runs")
        return section
    # the configuration with the most runs; ties go to the one run most recently
    group = max(groups.values(), key=lambda g: (len(g), max(r["created_at"] for r in g)))
    ids = {r["id"]: r for r in group}
    series: dict[tuple[str, str], list] = {}
    for row in data.leaderboard:
        if row["run_id"] in ids and not is_breakdown(row["metric"]) and row["value"] is not None:
            series.setdefault((row["task"], row["metric"]), []).append(
                (ids[row["run_id"]]["created_at"], row["value"], row["ci_lo"], row["ci_hi"]))
    if not series:
        section.omitted = f"the runs of {group[0]['model_label']} have no metric rows"
        return section
    lone = sorted({m for (_, m), pts in series.items() if len(pts) < 2})  # one run's value is no trend
    series = {k: pts for k, pts in series.items() if len(pts) >= 2}
    if not series:
        section.omitted = f"no metric of the runs of {group[0]['model_label']} has values in two of them"
        return section
    from evalkit.report.plots import trend_plot

    tasks = sorted({t for t, _ in series})
    shown = tasks[:MAX_TREND_TASKS]
    ordered = sorted(((k, v) for k, v in series.items() if k[0] in shown),
                     key=lambda kv: (registry.sort_key(kv[0][1]), kv[0][0]))
    model = config_line(group[0])
    first, last = min(r["created_at"] for r in group), max(r["created_at"] for r in group)
    draw = partial(trend_plot, [{"task": t, "metric": m, "points": pts} for (t, m), pts in ordered],
                   out_dir / "trend.png", title=f"{model}: {plural(len(group), 'run')}")
    section.intro = (f"{model}: {plural(len(group), 'run')} from {first:%Y-%m-%d %H:%M} to {last:%Y-%m-%d %H:%M} "
                     "UTC (x = run start). Only runs of this one configuration are joined by lines. One panel "
                     "per metric, one line per task (colour, marker and dash tell them apart; the legend names "
                     "them), whiskers = 95 % CI.")
    if lone:
        section.notes.append(f"Left out of the plot, with a value in one run only for some task: {', '.join(lone)}.")
    if len(tasks) > len(shown):
        section.notes.append(f"The plot shows the first {len(shown)} of {len(tasks)} tasks; the leaderboard "
                             "view has them all.")
    section.images.append(Image("trend.png", f"metric trend across the runs of {model}", draw))
    return section
