"""Static reports of stored runs: ``index.html``, ``summary.md`` and PNG plots next to them.

Owns: which runs a report covers, the SQL behind each section — every number is
read from the ``leaderboard``, ``needle_heatmap``, ``needle_gaps``,
``needle_attention``, ``attention_sink`` and ``conflict_table`` views or the
``runs``, ``samples`` and ``first_token_topk`` tables, aggregated inside DuckDB so
sample rows never reach Python — and rendering the sections as offline HTML (no
external CSS, JS or fonts; images are relative PNG files) and markdown. A
section without data is left out with a one-line reason.
Does not: compute metrics or statistics, draw (``evalkit.report.plots``,
``evalkit.report.needle_plot``), print, or write to the DB (it opens it read-only and
closes it before plotting).
"""

from __future__ import annotations

import datetime as dt
import html
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from evalkit.errors import BadInput
from evalkit.paths import check_output_dir, write_file
from evalkit.scoring import registry
from evalkit.store.db import db_path, open_reader
from evalkit.store.queries import resolve_run

MAX_DEFAULT_RUNS = 12
MAX_PLOT_METRICS = 6  # panels of the leaderboard plot
MAX_HEATMAPS = 3  # needle heatmaps, newest runs first (each costs ~0.4 s of CPU)
MAX_ATTENTION_PLOTS = 3  # recall-and-needle_attn figures, newest runs first
MAX_SINK_PANELS = 6  # runs in the per-layer sink figure, newest first
MAX_PROMPTS = 50  # --prompts: first-token prompts charted
# every file a report may write into --out
MAX_ROC_RUNS = 3  # ROC figures, newest runs with checkable answers first
MAX_POLICY_RUNS = 6  # needle runs compared across KV-cache policies (one heatmap column each)
REPORT_FILES = ("index.html", "summary.md", "leaderboard.png", "first_token.png", "trend.png", "reliability.png",
                "sink.png", *(f"roc_{k + 1}.png" for k in range(MAX_ROC_RUNS)),
                *(f"needle_{k + 1}.png" for k in range(MAX_HEATMAPS)), "needle_kv_cache.png",
                "needle_kv_cache_depth.png", *(f"needle_attn_{k + 1}.png" for k in range(MAX_ATTENTION_PLOTS)))
TOKENS_PER_PROMPT = 8  # bars per prompt in the first-token plot
TABLE_RANKS = 5  # ranks per run in the first-token tables
_IDS = "(SELECT unnest(?::VARCHAR[]))"


# ------------------------------------------------------------------ the report


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


@dataclass
class Report:
    out_dir: Path
    files: list[Path]  # everything written, index.html first
    sections: list[Section]
    run_ids: list[str]


def parse_run_refs(values: Iterable[str] | None) -> list[str]:
    """Run references from repeated and/or comma-separated --runs values.

    >>> parse_run_refs(["a,b", " c ", ""])
    ['a', 'b', 'c']
    """
    refs = []
    for value in values or ():
        refs.extend(part.strip() for part in value.split(",") if part.strip())
    return refs


def build_report(db=None, runs: Iterable[str] | None = None, out: str | Path = "reports",
                 prompts: int = 4) -> Report:
    """Write the report of ``runs`` (default: the newest done runs, at most 12) into ``out``.

    Raises BadInput for an unknown run, a DB without finished runs (when no runs
    are named), a negative ``prompts``, or an ``out`` that is a file.
    """
    if isinstance(prompts, bool) or not 0 <= prompts <= MAX_PROMPTS:
        raise BadInput(f"--prompts must be a whole number from 0 to {MAX_PROMPTS}, got {prompts}")
    out_dir = check_output_dir(out, "--out", REPORT_FILES, protect=[db_path(db)])
    refs = parse_run_refs(runs)
    with open_reader(db) as con:
        data = _read(con, refs, prompts)
    data.db = str(db_path(db))
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"cannot create the report folder {out_dir}: {exc.strerror or exc}") from None

    sections = [
        _runs_section(data),
        _leaderboard_section(data, out_dir),
        _first_token_section(data, out_dir, prompts),
        _lead_section(data, out_dir),
        _needle_section(data, out_dir),
        _attention_section(data, out_dir),
        _conflict_section(data),
        _trend_section(data, out_dir),
    ]
    from evalkit.report.plots import render

    render([image.draw for s in sections for image in s.images])  # the figures, several at a time
    images = [out_dir / image.name for s in sections for image in s.images]
    index = write_file(out_dir / "index.html", to_html(data, sections), "report file")
    summary = write_file(out_dir / "summary.md", to_markdown(data, sections), "report file")
    return Report(out_dir=out_dir, files=[index, summary, *images], sections=sections,
                  run_ids=[r["id"] for r in data.runs])


# ------------------------------------------------------------------ reading


@dataclass
class _Data:
    runs: list[dict]  # report order (oldest first), with a display label
    done: list[str]  # ids of the done runs among them
    leaderboard: list[dict]
    ft_runs: list[str]  # done runs with first_token_topk rows
    ft_prompts: list[dict]
    needle_cells: list[dict]
    needle_summary: list[dict]
    lead: list[dict]  # lead_indicators rows (category '*') of the done runs
    answers: list[dict]  # per checkable prompt: run, task, answer_hit and the first-token signals
    reliability: list[dict]  # per run and ft_hit_prob decile: mean ft_hit_prob, answer accuracy, n
    generated: dt.datetime
    needle_gaps: list[dict] = field(default_factory=list)
    needle_attention: list[dict] = field(default_factory=list)
    sink_layers: list[dict] = field(default_factory=list)
    sink_runs: list[dict] = field(default_factory=list)
    conflict: list[dict] = field(default_factory=list)
    db: str = ""


def _rows(con, sql: str, params: list | None = None) -> list[dict]:
    cur = con.execute(sql, params or [])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]


def _select_runs(con, refs: list[str]) -> list[str]:
    if refs:
        return list(dict.fromkeys(resolve_run(con, ref) for ref in refs))
    ids = [r[0] for r in con.execute(
        "SELECT id FROM runs WHERE status = 'done' ORDER BY created_at DESC, id DESC LIMIT ?",
        [MAX_DEFAULT_RUNS],
    ).fetchall()]
    if not ids:
        raise BadInput("no finished runs to report on: store one with `evalkit run` first")
    return ids


def _read(con, refs: list[str], prompts: int) -> _Data:
    ids = _select_runs(con, refs)
    runs = _rows(con, f"""
        SELECT r.id, r.name, r.status, r.model, r.model_name, r.model_args, r.model_fingerprint, r.quant,
               r.quant_detail, r.kv_cache, r.template, r.tasks, r.created_at, r.duration_s,
               coalesce(s.n, 0) AS n_samples
        FROM runs r
        LEFT JOIN (SELECT run_id, count(*) AS n FROM samples WHERE run_id IN {_IDS} GROUP BY run_id) s
          ON s.run_id = r.id
        WHERE r.id IN {_IDS}
        ORDER BY r.created_at, r.id
    """, [ids, ids])
    _label_runs(runs)
    done = [r["id"] for r in runs if r["status"] == "done"]

    leaderboard = _rows(con, f"""
        SELECT run_id, task, metric, value, stderr, ci_lo, ci_hi, n
        FROM leaderboard WHERE run_id IN {_IDS}
        ORDER BY task, metric
    """, [done])

    ft_runs = [r[0] for r in con.execute(
        f"SELECT DISTINCT run_id FROM first_token_topk WHERE run_id IN {_IDS}", [done]
    ).fetchall()]
    ft_runs = [i for i in done if i in set(ft_runs)]
    ft_prompts = _first_token_prompts(con, ft_runs, prompts) if ft_runs and prompts else []

    needle_cells = _rows(con, f"""
        SELECT run_id, lang, hint, depth, length, recall, n FROM needle_heatmap
        WHERE run_id IN {_IDS} ORDER BY run_id, lang, hint, length, depth
    """, [done])
    needle_summary = _rows(con, f"""
        SELECT run_id, lang, hint, sum(n) AS n, sum(recall * n) / sum(n) AS recall
        FROM needle_heatmap WHERE run_id IN {_IDS}
        GROUP BY run_id, lang, hint ORDER BY run_id, lang, hint
    """, [done])
    needle_gaps = _rows(con, f"""
        SELECT run_id, task, lang, hint, length, recall_start, recall_after, start_gap, middle_gap
        FROM needle_gaps WHERE run_id IN {_IDS} ORDER BY run_id, task, length
    """, [done])
    needle_attention = _rows(con, f"""
        SELECT run_id, task, lang, hint, depth, length, recall, needle_attn, n FROM needle_attention
        WHERE run_id IN {_IDS} ORDER BY run_id, task, length, depth
    """, [done])
    sink_layers = _rows(con, f"""
        SELECT run_id, layer, sink_rate, sink_score, n FROM attention_sink
        WHERE run_id IN {_IDS} ORDER BY run_id, layer
    """, [done])
    sink_runs = _rows(con, f"""
        SELECT run_id, count(*) AS n, avg(sink_rate) AS sink_rate FROM samples
        WHERE run_id IN {_IDS} AND sink_rate IS NOT NULL GROUP BY run_id ORDER BY run_id
    """, [done])
    conflict = _rows(con, f"""
        SELECT run_id, task, lang, length, n, first_wins, last_wins, picked_both, picked_neither,
               recency_index, pairs, order_flip_rate
        FROM conflict_table WHERE run_id IN {_IDS} ORDER BY run_id, task, length
    """, [done])
    lead = _rows(con, f"""
        SELECT run_id, task, signal, auroc, ci_lo, ci_hi, n, n_right, base_rate, reason
        FROM lead_indicators WHERE run_id IN {_IDS} AND category = '*' ORDER BY run_id, task
    """, [done])
    from evalkit.scoring.lead import SIGNALS

    answers = _rows(con, f"""
        SELECT run_id, task, answer_hit, {', '.join(SIGNALS)} FROM samples
        WHERE run_id IN {_IDS} AND answer_hit IS NOT NULL
    """, [done])
    reliability = _rows(con, f"""
        WITH d AS (
            SELECT run_id, ft_hit_prob, answer_hit,
                   ntile(10) OVER (PARTITION BY run_id ORDER BY ft_hit_prob) AS decile
            FROM samples WHERE run_id IN {_IDS} AND answer_hit IS NOT NULL AND ft_hit_prob IS NOT NULL
        )
        SELECT run_id, decile, avg(ft_hit_prob) AS ft_hit_prob, avg(answer_hit) AS accuracy, count(*) AS n
        FROM d GROUP BY run_id, decile ORDER BY run_id, decile
    """, [done])
    return _Data(runs=runs, done=done, leaderboard=leaderboard, ft_runs=ft_runs,
                 ft_prompts=ft_prompts, needle_cells=needle_cells, needle_summary=needle_summary,
                 lead=lead, answers=answers, reliability=reliability,
                 generated=dt.datetime.now(dt.timezone.utc).replace(microsecond=0),
                 needle_gaps=needle_gaps, needle_attention=needle_attention, sink_layers=sink_layers,
                 sink_runs=sink_runs, conflict=conflict)


def _first_token_prompts(con, run_ids: list[str], limit: int) -> list[dict]:
    """The prompts shared by most runs where their top-1 first tokens disagree most (first-token
    prompts before needle documents), with each run's whole stored top-k (probabilities
    exp(logprob)) and its top-k mass."""
    chosen = _rows(con, f"""
        WITH top1 AS (
            SELECT run_id, task, doc_id, arg_min(token_id, rank) AS token_id,
                   exp(arg_min(logprob, rank)) AS p
            FROM first_token_topk WHERE run_id IN {_IDS}
            GROUP BY run_id, task, doc_id
        ), first_token AS (
            SELECT DISTINCT task, doc_id FROM samples WHERE run_id IN {_IDS} AND ft_outcome IS NOT NULL
        ), per_prompt AS (
            SELECT t.task, t.doc_id, count(*) AS n_runs, count(DISTINCT t.token_id) AS n_top1,
                   max(t.p) - min(t.p) AS p_spread, any_value(f.task IS NOT NULL) AS is_first_token
            FROM top1 t LEFT JOIN first_token f ON f.task = t.task AND f.doc_id = t.doc_id
            GROUP BY t.task, t.doc_id
        )
        SELECT task, doc_id, n_runs, n_top1, p_spread FROM per_prompt
        WHERE n_runs = (SELECT max(n_runs) FROM per_prompt)
        ORDER BY is_first_token DESC, n_top1 DESC, p_spread DESC, task, doc_id
        LIMIT ?
    """, [run_ids, run_ids, limit])
    if not chosen:
        return []
    tasks = [c["task"] for c in chosen]
    docs = [c["doc_id"] for c in chosen]
    wanted = "(SELECT unnest(?::VARCHAR[]) AS task, unnest(?::VARCHAR[]) AS doc_id)"
    dists = _rows(con, f"""
        SELECT t.run_id, t.task, t.doc_id, sum(exp(t.logprob)) AS mass,
               list(struct_pack(rank := t.rank, token_id := t.token_id, token := t.token, unit := t.unit,
                                p := exp(t.logprob)) ORDER BY t.rank) AS tokens
        FROM first_token_topk t JOIN {wanted} w ON t.task = w.task AND t.doc_id = w.doc_id
        WHERE t.run_id IN {_IDS}
        GROUP BY t.run_id, t.task, t.doc_id
        ORDER BY t.run_id, t.task, t.doc_id  -- fixes which of two equally likely tokens is listed first
    """, [tasks, docs, run_ids])
    texts = {(r["task"], r["doc_id"]): r for r in _rows(con, f"""
        SELECT s.task, s.doc_id, any_value(s.prompt) AS prompt, any_value(s.target) AS target
        FROM samples s JOIN {wanted} w ON s.task = w.task AND s.doc_id = w.doc_id
        WHERE s.run_id IN {_IDS}
        GROUP BY s.task, s.doc_id
    """, [tasks, docs, run_ids])}
    for c in chosen:
        key = (c["task"], c["doc_id"])
        c["prompt"] = (texts.get(key) or {}).get("prompt")
        c["target"] = (texts.get(key) or {}).get("target")
        c["runs"] = {d["run_id"]: d for d in dists if (d["task"], d["doc_id"]) == key}
    return chosen


def _model_label(model: str | None, model_args: str | None) -> str:
    """What a reader calls the model: the pretrained folder's name, else type + short args."""
    try:
        args = json.loads(model_args) if model_args else {}
    except (TypeError, ValueError):
        args = {}
    if not isinstance(args, dict):
        args = {}
    if args.get("pretrained"):
        name = str(args["pretrained"]).rstrip("/").rsplit("/", 1)[-1]
        if args.get("gguf_file"):
            name += f" ({args['gguf_file']})"
        return name
    noise = {"trust_remote_code", "device", "dtype", "batch_size"}
    shown = ",".join(f"{k}={v}" for k, v in sorted(args.items()) if k not in noise)
    label = f"{model} {shown}".strip() if shown else (model or "?")
    return label if len(label) <= 48 else label[:47] + "…"


def _label_runs(runs: list[dict]) -> None:
    """Give each run a short unique display label: its name, else its id."""
    base = [r["name"] or r["id"] for r in runs]
    for r, b in zip(runs, base):
        r["label"] = b if base.count(b) == 1 or b == r["id"] else f"{b} · {r['id'][-6:]}"
        r["model_label"] = r["model_name"] or _model_label(r["model"], r["model_args"])
        # one configuration: trend lines never join runs of another model, quant, KV cache or template
        r["config_key"] = (r["model"], r["model_fingerprint"] or r["model_args"] or "", r["quant"], r["kv_cache"],
                           r["template"])
        r["quant_applied"] = _quant_applied(r.get("quant"), r.get("quant_detail"))


def _quant_applied(quant: str | None, detail: str | None) -> str:
    """What `--quant` applied (library, bits, group size, modules), from runs.quant_detail."""
    import json

    from evalkit.compare import quant_summary

    try:
        parsed = json.loads(detail) if detail else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return ""
    return quant_summary(quant, parsed).split(": ", 1)[-1]


# ------------------------------------------------------------------ sections


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _with_ci(row: dict) -> str:
    text = _num(row["value"])
    if row.get("ci_lo") is not None and row.get("ci_hi") is not None:
        text += f"\n[{_num(row['ci_lo'])}, {_num(row['ci_hi'])}]"  # the interval under the value
    return text


def _is_breakdown(metric: str) -> bool:
    return "@" in metric  # needle_recall@depth0.1, needle_recall@len512 ...


def _runs_section(data: _Data) -> Section:
    rows = []
    for r in data.runs:
        created = r["created_at"].strftime("%Y-%m-%d %H:%M:%S") if r["created_at"] else ""
        rows.append([r["id"], r["name"] or "", r["status"], r["model_label"], r["quant"] or "", r["quant_applied"],
                     r["kv_cache"] or "", r["template"] or "", ", ".join(r["tasks"] or []), created,
                     str(r["n_samples"]), _num(r["duration_s"], 1)])
    table = Table(["id", "name", "status", "model", "quant", "quant applied", "kv cache", "template", "tasks",
                   "created (UTC)", "samples", "duration s"], rows, numeric_from=10)
    section = Section("runs", "Runs", tables=[table],
                      intro=f"{len(data.runs)} runs, {len(data.done)} of them done.")
    not_done = [r["label"] for r in data.runs if r["status"] != "done"]
    if not_done:
        section.notes.append(f"Not done, so left out of the sections below: {', '.join(not_done)}.")
    return section


def _leaderboard_section(data: _Data, out_dir: Path) -> Section:
    section = Section("leaderboard", "Leaderboard")
    if not data.done:
        section.omitted = "no done run among the selected runs"
        return section
    main = [r for r in data.leaderboard if not _is_breakdown(r["metric"])]
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
    arrows = {True: " ↑", False: " ↓", None: ""}
    columns = ["task", "run", "model · quant · template"] + [m + arrows[registry.higher_is_better(m)] for m in metrics]
    rows, strong = [], set()
    for task, run_id in keys:
        run = runs[run_id]
        row = [task, run["label"], _config_label(run)]
        row += [_with_ci(cells[(task, run_id, m)]) if (task, run_id, m) in cells else "" for m in metrics]
        rows.append(row)
    for j, metric in enumerate(metrics):
        better = registry.higher_is_better(metric)
        if better is None:
            continue
        for task in {k[0] for k in keys}:
            values = [(i, cells[(task, k[1], metric)]["value"]) for i, k in enumerate(keys)
                      if k[0] == task and (task, k[1], metric) in cells
                      and cells[(task, k[1], metric)]["value"] is not None]
            if len(values) < 2 or len({v for _, v in values}) == 1:
                continue
            best = max(v for _, v in values) if better else min(v for _, v in values)
            strong |= {(i, 3 + j) for i, v in values if v == best}
    section.intro = ("Each metric's value and its 95 % interval from the leaderboard view (Wilson for "
                     "proportions, bootstrap percentile for other means, so it stays inside the metric's "
                     "range); ↑ higher is better, ↓ lower is better; the best run per task is in bold.")
    section.tables.append(Table(columns, rows, numeric_from=3, strong=strong))
    breakdowns = sorted({r["metric"] for r in data.leaderboard if _is_breakdown(r["metric"])})
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


def _prompt_text(prompt: str | None, width: int = 160) -> str:
    text = " ".join((prompt or "").split())
    return text if len(text) <= width else "…" + text[-(width - 1):]


def _targets(target: str | None) -> str:
    try:
        values = json.loads(target) if target else []
    except (TypeError, ValueError):
        return target or ""
    return ", ".join(map(str, values)) if isinstance(values, list) else str(values)


def _first_token_section(data: _Data, out_dir: Path, prompts: int) -> Section:
    section = Section("first-token", "First-token distributions", side_by_side=True)
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
    section.intro = (
        f"{len(data.ft_prompts)} prompts shared by {n_runs} of the {len(data.ft_runs)} runs with top-k rows, "
        "those whose most likely first tokens disagree most (distinct top-1 tokens, then the spread of "
        "the top-1 probability). Probabilities are exp(logprob) from first_token_topk; a token outside "
        "a run's stored top-k shows as 0. A token marked * is only the first byte(s) of a character: it "
        "shows as the first unit it starts, the character greedy decoding completes it to."
    )
    from evalkit.report.plots import first_token_plot, token_label

    panels = []
    for prompt in data.ft_prompts:
        title = f"{prompt['task']} / {prompt['doc_id']}"
        # tokens: the union of each run's top ranks, most probable first
        best: dict[int, tuple[float, Any]] = {}
        for dist in prompt["runs"].values():
            for tok in dist["tokens"][:TOKENS_PER_PROMPT]:
                p = tok["p"]
                if tok["token_id"] not in best or p > best[tok["token_id"]][0]:
                    best[tok["token_id"]] = (p, tok)
        token_ids = sorted(best, key=lambda t: -best[t][0])[:TOKENS_PER_PROMPT]
        probs = {}
        for run_id, dist in prompt["runs"].items():
            by_id = {t["token_id"]: t["p"] for t in dist["tokens"]}
            probs[runs[run_id]["label"]] = [by_id.get(t, 0.0) for t in token_ids]
        panels.append({"title": title, "tokens": [token_label(*_shown_token(best[t][1])) for t in token_ids],
                       "probs": probs})

        order = [i for i in data.ft_runs if i in prompt["runs"]]
        columns = ["rank"] + [runs[i]["label"] for i in order]
        rows = []
        ranks = max(len(prompt["runs"][i]["tokens"]) for i in order)
        for rank in range(min(TABLE_RANKS, ranks)):
            row = [str(rank + 1)]
            for run_id in order:
                toks = prompt["runs"][run_id]["tokens"]
                row.append(f"{_token_text(toks[rank])} {_num(toks[rank]['p'])}" if rank < len(toks) else "")
            rows.append(row)
        rows.append(["top-k mass"] + [_num(prompt["runs"][i]["mass"]) for i in order])
        caption = f"{title}: “{_prompt_text(prompt['prompt'])}”"
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


def _needle_section(data: _Data, out_dir: Path) -> Section:
    section = Section("needle", "Needle recall by depth and length")
    if not data.needle_cells:
        section.omitted = "no needle rows in the selected runs (run the needle tasks, e.g. --tasks needle)"
        return section
    runs = {r["id"]: r for r in data.runs}
    section.intro = ("start_gap first: mean recall at depths 0.25–1 − recall at depth 0, positive when the fact "
                     "in the first sentence is what gets lost (middle_gap averages depth 0 with depth 1 and hides "
                     "it). Then mean needle_recall per depth × requested length from the needle_heatmap view, one "
                     "heatmap per run; middle_gap = recall at the edges (d ∈ {0, 1}) − recall in the middle "
                     "(d ∈ [0.3, 0.7]).")
    per_task = [r for r in data.leaderboard if r["metric"] in ("needle_recall", "start_gap", "middle_gap")]
    if per_task:
        cells = {(r["run_id"], r["task"], r["metric"]): r for r in per_task}
        keys = sorted({(r["run_id"], r["task"]) for r in per_task},
                      key=lambda k: (data.done.index(k[0]), k[1]))

        def value(key, metric, ci=False):
            row = cells.get((*key, metric))
            return "" if row is None else _with_ci(row) if ci else _num(row["value"])

        rows = [[runs[run_id]["label"], task, value((run_id, task), "start_gap"),
                 value((run_id, task), "middle_gap"), value((run_id, task), "needle_recall", ci=True)]
                for run_id, task in keys]
        section.tables.append(Table(["run", "task", "start_gap ↓", "middle_gap ↓", "needle_recall [95 % CI]"], rows,
                                    numeric_from=2, caption="per task, from the leaderboard view"))
    if data.needle_gaps:
        rows = [[runs[g["run_id"]]["label"], g["task"], "yes" if g["hint"] else "no", str(g["length"]),
                 _num(g["recall_start"]), _num(g["recall_after"]), _num(g["start_gap"]), _num(g["middle_gap"])]
                for g in sorted(data.needle_gaps, key=lambda g: (data.done.index(g["run_id"]), g["task"],
                                                                 bool(g["hint"]), g["length"]))]
        section.tables.append(Table(["run", "task", "hint", "length", "recall d=0", "recall d≥0.25", "start_gap",
                                     "middle_gap"], rows, numeric_from=3,
                                    caption="start_gap by length, from the needle_gaps view"))
    from evalkit.report.needle_plot import heatmap

    with_rows = [i for i in data.done if any(c["run_id"] == i for c in data.needle_cells)]
    drawn = with_rows[-MAX_HEATMAPS:]
    for k, run_id in enumerate(drawn):
        cells = [c for c in data.needle_cells if c["run_id"] == run_id]
        name = f"needle_{k + 1}.png"
        section.images.append(Image(name, f"needle recall heatmap of run {runs[run_id]['label']}",
                                    partial(heatmap, cells, out_dir / name,
                                            title=f"needle recall — {runs[run_id]['label']}")))
    if len(drawn) < len(with_rows):
        section.notes.append(f"Heatmaps of the {len(drawn)} newest of the {len(with_rows)} runs with needle rows; "
                             "the tables cover all of them.")
    _kv_cache_figures(section, data, with_rows, out_dir)
    rows = [[runs[r["run_id"]]["label"], r["lang"] or "", "yes" if r["hint"] else "no", str(r["n"]),
             _num(r["recall"])] for r in data.needle_summary]
    section.tables.append(Table(["run", "lang", "hint", "n", "recall"], rows, numeric_from=3,
                                caption="recall by language and hint"))
    return section


def _attention_section(data: _Data, out_dir: Path) -> Section:
    section = Section("attention", "Where the model looks: attention sink and attention on the needle")
    if not data.sink_runs:
        section.omitted = "no attention rows in the selected runs (run with --attention, hf backend)"
        return section
    runs = {r["id"]: r for r in data.runs}
    with_attn = [i for i in data.done if any(r["run_id"] == i for r in data.sink_runs)]
    section.intro = ("Read off each prompt's prefill under eager attention (docs/metrics.md §1.8). sink_rate: the "
                     "share of (layer, head) pairs whose first-token importance over the first 64 prompt tokens "
                     "exceeds 0.3 (Gu et al. 2025); needle_attn: the attention mass the last prompt position puts "
                     "on the needle sentence, mean over heads and layers. From the attention_sink and "
                     "needle_attention views.")
    from evalkit.report.needle_plot import recall_attention_plot
    from evalkit.report.plots import sink_plot

    with_needle = [i for i in with_attn if any(r["run_id"] == i for r in data.needle_attention)]
    for k, run_id in enumerate(with_needle[-MAX_ATTENTION_PLOTS:]):
        rows = [r for r in data.needle_attention if r["run_id"] == run_id]
        name = f"needle_attn_{k + 1}.png"
        section.images.append(Image(name, f"recall and needle_attn by depth of run {runs[run_id]['label']}",
                                    partial(recall_attention_plot, rows, out_dir / name,
                                            title=f"recall and needle_attn — {runs[run_id]['label']}")))
    sink_ids = [i for i in with_attn if any(r["run_id"] == i for r in data.sink_layers)][-MAX_SINK_PANELS:]
    overall = {r["run_id"]: r for r in data.sink_runs}
    panels = [{"title": runs[i]["label"], "overall": overall[i]["sink_rate"],
               "layers": [r["layer"] for r in data.sink_layers if r["run_id"] == i],
               "values": [r["sink_rate"] for r in data.sink_layers if r["run_id"] == i]} for i in sink_ids]
    if panels:
        section.images.append(Image("sink.png", "sink_rate per layer of each run with attention rows",
                                    partial(sink_plot, panels, out_dir / "sink.png")))
    rows = []
    for run_id in with_attn:
        layers = [r for r in data.sink_layers if r["run_id"] == run_id]
        strongest = max(layers, key=lambda r: (r["sink_rate"], -r["layer"]), default=None)
        rows.append([runs[run_id]["label"], _config_label(runs[run_id]), str(overall[run_id]["n"]),
                     _num(overall[run_id]["sink_rate"]), str(len(layers)),
                     f"{strongest['layer']} ({_num(strongest['sink_rate'])})" if strongest else ""])
    section.tables.append(Table(["run", "model · quant · template", "prompts", "sink_rate", "layers",
                                 "strongest layer"], rows,
                                numeric_from=2, caption="sink_rate per run (mean over prompts)"))
    if data.needle_attention:
        depths = sorted({round(float(r["depth"]), 4) for r in data.needle_attention})
        cells: dict[tuple, dict] = {}
        for r in data.needle_attention:
            cells[(r["run_id"], r["task"], bool(r["hint"]), r["length"], round(float(r["depth"]), 4))] = r
        keys = sorted({k[:4] for k in cells}, key=lambda k: (data.done.index(k[0]), *k[1:]))
        rows = [[runs[k[0]]["label"], k[1], "yes" if k[2] else "no", str(k[3])]
                + [f"{_num(c['recall'], 2)} · {_num(c['needle_attn'])}" if (c := cells.get((*k, d))) else ""
                   for d in depths]
                for k in keys]
        section.tables.append(Table(["run", "task", "hint", "length"] + [f"d={d:g}" for d in depths], rows,
                                    numeric_from=3, caption="recall · needle_attn by depth, from the needle_attention view"))
    missing = [runs[i]["label"] for i in data.done if i not in with_attn]
    if missing:
        section.notes.append(f"Runs without attention rows (not run with --attention): {', '.join(missing)}.")
    return section


def _conflict_section(data: _Data) -> Section:
    section = Section("conflict", "Conflicting facts at the start and the end")
    if not data.conflict:
        section.omitted = "no needle_conflict rows in the selected runs (run --tasks needle_conflict)"
        return section
    runs = {r["id"]: r for r in data.runs}
    section.intro = ("One key, two values: the first sentence says A, the last sentence says B, both orders of every "
                     "pair (docs/metrics.md §1.9). recency_index = last_wins − first_wins (+1: the end always wins); "
                     "order_flip_rate: the share of pairs whose answer changes when the two sentences swap places. "
                     "From the conflict_table view.")
    rows = [[runs[c["run_id"]]["label"], c["task"], str(c["length"]), str(c["n"]), _num(c["first_wins"]),
             _num(c["last_wins"]), _num(c["picked_both"]), _num(c["picked_neither"]), _num(c["recency_index"]),
             _num(c["order_flip_rate"]), str(c["pairs"] or 0)]
            for c in sorted(data.conflict, key=lambda c: (data.done.index(c["run_id"]), c["task"], c["length"]))]
    section.tables.append(Table(["run", "task", "length", "n", "first_wins", "last_wins", "both", "neither",
                                 "recency_index", "order_flip_rate ↓", "pairs"], rows, numeric_from=2,
                                caption="which value wins, by length"))
    return section


def _lead_section(data: _Data, out_dir: Path) -> Section:
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
        "every one wrong, or no values of the signal).")
    with_answers = [i for i in data.done if any(a["run_id"] == i for a in data.answers)]
    from evalkit.report.plots import reliability_plot, roc_plot

    for k, run_id in enumerate(with_answers[-MAX_ROC_RUNS:]):
        name = f"roc_{k + 1}.png"
        mine = [a for a in data.answers if a["run_id"] == run_id]
        section.images.append(Image(name, f"ROC curves of the first-token signals, run {runs[run_id]['label']}",
                                    partial(roc_plot, mine, SIGNALS, out_dir / name,
                                            title=f"ROC against answer_hit — {runs[run_id]['label']}")))
    if data.reliability:
        series = {runs[r]["label"]: [x for x in data.reliability if x["run_id"] == r]
                  for r in with_answers if any(x["run_id"] == r for x in data.reliability)}
        section.images.append(Image("reliability.png", "answer accuracy by ft_hit_prob decile, per run",
                                    partial(reliability_plot, series, out_dir / "reliability.png")))
    columns = ["run", "task", "n", "right"] + [f"lead_auroc.{s}" for s in SIGNALS]
    keys = sorted({(r["run_id"], r["task"]) for r in data.lead}, key=lambda k: (data.done.index(k[0]), k[1]))
    cells = {(r["run_id"], r["task"], r["signal"]): r for r in data.lead}
    rows = []
    for run_id, task in keys:
        first = next(cells[(run_id, task, s)] for s in SIGNALS if (run_id, task, s) in cells)
        row = [runs[run_id]["label"], task, str(first["n"]), _num(first["base_rate"])]
        for s in SIGNALS:
            c = cells.get((run_id, task, s))
            row.append(_with_ci({"value": c["auroc"], "ci_lo": c["ci_lo"], "ci_hi": c["ci_hi"]})
                       if c and c["auroc"] is not None else "")
        rows.append(row)
    section.tables.append(Table(columns, rows, numeric_from=2, caption="lead_auroc per run and task"))
    undefined = sorted({r["reason"] for r in data.lead if r["auroc"] is None and r["reason"]})
    if undefined:
        section.notes.append("Undefined cells: " + "; ".join(undefined) + ".")
    if len(with_answers) > MAX_ROC_RUNS:
        section.notes.append(f"ROC curves of the {MAX_ROC_RUNS} newest of the {len(with_answers)} runs with "
                             "checkable answers; the table covers all of them.")
    return section


def _config_label(run: dict) -> str:
    """A run's configuration in one cell: the model, and under it quant · KV cache · template."""
    config = " · ".join(x for x in (run["quant"], _kv_label(run["kv_cache"]), run["template"]) if x)
    return f"{run['model_label']}\n{config}"


def _kv_label(policy: str | None) -> str:
    """A run's KV-cache policy in a configuration label: empty for the full cache (the default)."""
    return "" if policy in (None, "full") else f"kv {policy}"


def _kv_cache_figures(section: Section, data: _Data, with_rows: list[str], out_dir: Path) -> None:
    """Where the needle runs differ in KV-cache policy: their heatmaps side by side, one column a
    run, and their recall by depth, one line a run, on one axis (depth 0 is where eviction hurts)."""
    from evalkit.report.needle_plot import policy_depth_lines, policy_heatmaps

    runs = {r["id"]: r for r in data.runs}
    if len({runs[i]["kv_cache"] for i in with_rows}) < 2:
        return
    chosen = with_rows[-MAX_POLICY_RUNS:]
    names = [runs[i]["kv_cache"] or "(backend's own)" for i in chosen]
    groups = [(name if names.count(name) == 1 else f"{name} · {runs[i]['label']}",
               [c for c in data.needle_cells if c["run_id"] == i]) for i, name in zip(chosen, names)]
    section.images.append(Image("needle_kv_cache.png", "needle recall heatmaps side by side, one column per "
                                "KV-cache policy", partial(policy_heatmaps, groups, out_dir / "needle_kv_cache.png",
                                                           title="needle recall per KV-cache policy")))
    section.images.append(Image("needle_kv_cache_depth.png", "needle recall by depth, one line per KV-cache policy",
                                partial(policy_depth_lines, groups, out_dir / "needle_kv_cache_depth.png")))
    if len(chosen) < len(with_rows):
        section.notes.append(f"KV-cache figures: the {len(chosen)} newest of the {len(with_rows)} runs with needle rows.")


def _trend_section(data: _Data, out_dir: Path) -> Section:
    section = Section("trend", "Trend across runs of one configuration")
    done = [r for r in data.runs if r["status"] == "done"]
    groups: dict[tuple, list[dict]] = {}
    for r in done:
        groups.setdefault(r["config_key"], []).append(r)
    if not groups or max(len(g) for g in groups.values()) < 2:
        section.omitted = ("no configuration (model x quant x KV cache x template) has two or more done runs among the "
                           "selected runs")
        return section
    # the configuration with the most runs; ties go to the one run most recently
    group = max(groups.values(), key=lambda g: (len(g), max(r["created_at"] for r in g)))
    ids = {r["id"]: r for r in group}
    series: dict[tuple[str, str], list] = {}
    for row in data.leaderboard:
        if row["run_id"] in ids and not _is_breakdown(row["metric"]) and row["value"] is not None:
            series.setdefault((row["task"], row["metric"]), []).append(
                (ids[row["run_id"]]["created_at"], row["value"], row["ci_lo"], row["ci_hi"]))
    if not series:
        section.omitted = f"the runs of {group[0]['model_label']} have no metric rows"
        return section
    from evalkit.report.plots import trend_plot

    ordered = sorted(series.items(), key=lambda kv: (kv[0][0], registry.sort_key(kv[0][1])))
    model = " · ".join(x for x in (group[0]["model_label"], group[0]["quant"], group[0]["template"]) if x)
    first, last = min(r["created_at"] for r in group), max(r["created_at"] for r in group)
    draw = partial(trend_plot, [{"task": t, "metric": m, "points": pts} for (t, m), pts in ordered],
                   out_dir / "trend.png", title=f"{model}: {len(group)} runs")
    section.intro = (f"{model}: {len(group)} runs from {first:%Y-%m-%d %H:%M} to {last:%Y-%m-%d %H:%M} UTC "
                     "(x = run start). Only runs of this one configuration are joined by lines. One panel "
                     "per task, one line per metric, whiskers = 95 % CI; metrics outside [0, 1] use the "
                     "right-hand axis, dashed.")
    section.images.append(Image("trend.png", f"metric trend across the runs of {model}", draw))
    return section


# ------------------------------------------------------------------ rendering

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"Noto Sans","Noto Sans CJK SC",sans-serif;
 margin:0 auto;max-width:1240px;padding:1.2rem 1.5rem 3rem;color:#1f2328;line-height:1.45}
h1{font-size:1.6rem;margin:.2rem 0}h2{font-size:1.25rem;border-bottom:1px solid #d0d7de;padding-bottom:.3rem;
 margin-top:2.2rem}
.meta{color:#59636e;font-size:.9rem}nav a{margin-right:1rem}
.tbl{overflow-x:auto;margin:.8rem 0 1.2rem}.row{display:flex;flex-wrap:wrap;gap:0 2rem}
.row .tbl{max-width:calc(50% - 1rem);min-width:320px}
table{border-collapse:collapse;font-size:.85rem}
.caption{font-weight:600;margin:0 0 .3rem;color:#424a53;font-size:.9rem}
th,td{border:1px solid #d0d7de;padding:.25rem .55rem;white-space:pre-line;text-align:left}
th{background:#f6f8fa}tr:nth-child(even) td{background:#fbfcfd}td.num{text-align:right;
 font-variant-numeric:tabular-nums}strong{color:#0a3069}
img{max-width:100%;height:auto;border:1px solid #eaeef2;margin:.5rem 0}
.omitted{color:#8c959f;font-style:italic}.note{color:#59636e;font-size:.88rem}
code{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:.85em}
"""


def _html_table(t: Table) -> str:
    e = html.escape
    out = ['<div class="tbl">']
    if t.caption:
        out.append(f'<p class="caption">{e(t.caption)}</p>')
    out.append("<table>")
    # a header may break after an underscore (ft_hit_prob), never inside a word
    out.append("<thead><tr>" + "".join(f"<th>{e(c).replace('_', '_&#8203;')}</th>" for c in t.columns)
               + "</tr></thead><tbody>")
    for i, row in enumerate(t.rows):
        cells = []
        for j, cell in enumerate(row):
            cls = ' class="num"' if t.numeric_from is not None and j >= t.numeric_from else ""
            text = f"<strong>{e(cell)}</strong>" if (i, j) in t.strong else e(cell)
            cells.append(f"<td{cls}>{text}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table></div>")
    return "\n".join(out)


def to_html(data: _Data, sections: list[Section]) -> str:
    """The report as one self-contained HTML page (images are relative PNG paths)."""
    e = html.escape
    parts = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>evalkit report</title>", f"<style>{_CSS}</style></head><body>",
        "<header><h1>evalkit report</h1>",
        (f'<p class="meta">{len(data.runs)} runs from <code>{e(data.db)}</code>, '
         f"generated {data.generated:%Y-%m-%d %H:%M:%S} UTC.</p>"),
        "<nav>" + "".join(f'<a href="#{s.key}">{e(s.title)}</a>' for s in sections) + "</nav></header>",
    ]
    for s in sections:
        parts.append(f'<section id="{s.key}"><h2>{e(s.title)}</h2>')
        if s.omitted:
            parts.append(f'<p class="omitted">Omitted: {e(s.omitted)}.</p></section>')
            continue
        if s.intro:
            parts.append(f"<p>{e(s.intro)}</p>")
        for image in s.images:
            parts.append(f'<img src="{e(image.name)}" alt="{e(image.alt)}">')
        if s.side_by_side:
            parts.append('<div class="row">')
        parts.extend(_html_table(t) for t in s.tables)
        if s.side_by_side:
            parts.append("</div>")
        parts.extend(f'<p class="note">{e(n)}</p>' for n in s.notes)
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _md_cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _md_table(t: Table) -> str:
    out = []
    if t.caption:
        out += [f"*{_md_cell(t.caption)}*", ""]
    out.append("| " + " | ".join(_md_cell(c) for c in t.columns) + " |")
    out.append("|" + "|".join("---:" if t.numeric_from is not None and j >= t.numeric_from else "---"
                              for j in range(len(t.columns))) + "|")
    for i, row in enumerate(t.rows):
        cells = [f"**{_md_cell(c)}**" if (i, j) in t.strong and c else _md_cell(c) for j, c in enumerate(row)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def to_markdown(data: _Data, sections: list[Section]) -> str:
    """The report as markdown (summary.md), images as relative links."""
    lines = ["# evalkit report", "",
             f"{len(data.runs)} runs from `{data.db}`, generated {data.generated:%Y-%m-%d %H:%M:%S} UTC.", ""]
    for s in sections:
        lines += [f"## {s.title}", ""]
        if s.omitted:
            lines += [f"_Omitted: {s.omitted}._", ""]
            continue
        if s.intro:
            lines += [s.intro, ""]
        for image in s.images:
            lines += [f"![{image.alt}]({image.name})", ""]
        for t in s.tables:
            lines += [_md_table(t), ""]
        for n in s.notes:
            lines += [f"_{n}_", ""]
    return "\n".join(lines)

