"""The report's sections about where a fact sits in a long prompt: needle recall, attention, conflicts.

Owns: the sections Needle recall by depth and length (with the KV-cache policy figures),
Where the model looks (attention sink and attention on the needle) and Conflicting facts,
each a function of the `ReportData` that returns its `Section`. Does not: read the DB
(`report.reading`), draw (`report.needle_plot`, `report.plots`) or render (`report.rendering`).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from evalkit.defaults import MIDDLE_BAND, SINK_EPSILON, SINK_TOKENS
from evalkit.report.reading import ReportData
from evalkit.report.sections import Image, Section, Table, arrow, num, with_ci
from evalkit.scoring.needle import START_FROM

MAX_HEATMAPS = 3  # needle heatmaps, newest runs first (each costs ~0.4 s of CPU)
MAX_ATTENTION_PLOTS = 3  # recall-and-needle_attn figures, newest runs first
MAX_SINK_PANELS = 6  # runs in the per-layer sink figure, newest first
MAX_POLICY_RUNS = 6  # needle runs compared across KV-cache policies (one heatmap column each)


def needle_section(data: ReportData, out_dir: Path) -> Section:
    section = Section("needle", "Needle recall by depth and length")
    if not data.needle_cells:
        section.omitted = "no needle rows in the selected runs (run the needle tasks, e.g. --tasks needle)"
        return section
    runs = {r["id"]: r for r in data.runs}
    lo, hi = MIDDLE_BAND
    section.intro = (f"start_gap first: mean recall at depths {START_FROM:g}–1 − recall at depth 0, positive when "
                     "the fact in the first sentence is what gets lost (middle_gap averages depth 0 with depth 1 and "
                     "hides it). Then mean needle_recall per depth × requested length from the needle_heatmap view, "
                     "one heatmap per run; middle_gap = recall at the edges (d ∈ {0, 1}) − recall in the middle "
                     f"(d ∈ [{lo:g}, {hi:g}]).")
    per_task = [r for r in data.leaderboard if r["metric"] in ("needle_recall", "start_gap", "middle_gap")]
    if per_task:
        cells = {(r["run_id"], r["task"], r["metric"]): r for r in per_task}
        keys = sorted({(r["run_id"], r["task"]) for r in per_task},
                      key=lambda k: (data.done.index(k[0]), k[1]))

        def value(key, metric, ci=False):
            row = cells.get((*key, metric))
            return "" if row is None else with_ci(row) if ci else num(row["value"])

        rows = [[runs[run_id]["label"], task, value((run_id, task), "start_gap"),
                 value((run_id, task), "middle_gap"), value((run_id, task), "needle_recall", ci=True)]
                for run_id, task in keys]
        section.tables.append(Table(["run", "task", "start_gap" + arrow("start_gap"), "middle_gap" + arrow("middle_gap"),
                                     "needle_recall [95 % CI]"], rows,
                                    numeric_from=2, caption="per task, from the leaderboard view"))
    if data.needle_gaps:
        rows = [[runs[g["run_id"]]["label"], g["task"], "yes" if g["hint"] else "no", str(g["length"]),
                 num(g["recall_start"]), num(g["recall_after"]), num(g["start_gap"]), num(g["middle_gap"])]
                for g in sorted(data.needle_gaps, key=lambda g: (data.done.index(g["run_id"]), g["task"],
                                                                 bool(g["hint"]), g["length"]))]
        section.tables.append(Table(["run", "task", "hint", "length", "recall d=0", f"recall d≥{START_FROM:g}", "start_gap",
                                     "middle_gap"], rows, numeric_from=3,
                                    caption="start_gap by length, from the needle_gaps view"))
    from evalkit.report.needle_plot import heatmap

    with_rows = [i for i in data.done if any(c["run_id"] == i for c in data.needle_cells)]
    drawn = with_rows[-MAX_HEATMAPS:]
    for k, run_id in enumerate(drawn):
        run_cells = [c for c in data.needle_cells if c["run_id"] == run_id]
        name = f"needle_{k + 1}.png"
        section.images.append(Image(name, f"needle recall heatmap of run {runs[run_id]['label']}",
                                    partial(heatmap, run_cells, out_dir / name,
                                            title=f"needle recall — {runs[run_id]['label']}")))
    if len(drawn) < len(with_rows):
        section.notes.append(f"Heatmaps of the {len(drawn)} newest of the {len(with_rows)} runs with needle rows; "
                             "the tables cover all of them.")
    _kv_cache_figures(section, data, with_rows, out_dir)
    rows = [[runs[r["run_id"]]["label"], r["lang"] or "", "yes" if r["hint"] else "no", str(r["n"]),
             num(r["recall"])] for r in data.needle_summary]
    section.tables.append(Table(["run", "lang", "hint", "n", "recall"], rows, numeric_from=3,
                                caption="recall by language and hint"))
    return section


def _kv_cache_figures(section: Section, data: ReportData, with_rows: list[str], out_dir: Path) -> None:
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


def attention_section(data: ReportData, out_dir: Path) -> Section:
    section = Section("attention", "Where the model looks: attention sink and attention on the needle")
    if not data.sink_runs:
        section.omitted = "no attention rows in the selected runs (run with --attention, hf backend)"
        return section
    runs = {r["id"]: r for r in data.runs}
    with_attn = [i for i in data.done if any(r["run_id"] == i for r in data.sink_runs)]
    section.intro = ("Read off each prompt's prefill under eager attention (docs/metrics.md §1.8). sink_rate: the "
                     f"share of (layer, head) pairs whose first-token importance over the first {SINK_TOKENS} prompt "
                     f"tokens exceeds {SINK_EPSILON:g} (Gu et al. 2025); needle_attn: the attention mass the last prompt position puts "
                     "on the needle sentence, mean over heads and layers. From the attention_sink and "
                     "needle_attention views.")
    from evalkit.report.needle_plot import recall_attention_plot
    from evalkit.report.plots import sink_plot

    with_needle = [i for i in with_attn if any(r["run_id"] == i for r in data.needle_attention)]
    for k, run_id in enumerate(with_needle[-MAX_ATTENTION_PLOTS:]):
        run_rows = [r for r in data.needle_attention if r["run_id"] == run_id]
        name = f"needle_attn_{k + 1}.png"
        section.images.append(Image(name, f"recall and needle_attn by depth of run {runs[run_id]['label']}",
                                    partial(recall_attention_plot, run_rows, out_dir / name,
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
        rows.append([runs[run_id]["label"], str(overall[run_id]["n"]),
                     num(overall[run_id]["sink_rate"]), str(len(layers)),
                     f"{strongest['layer']} ({num(strongest['sink_rate'])})" if strongest else ""])
    section.tables.append(Table(["run", "prompts", "sink_rate", "layers", "strongest layer"], rows,
                                numeric_from=1, caption="sink_rate per run (mean over prompts)"))
    if data.needle_attention:
        depths = sorted({round(float(r["depth"]), 4) for r in data.needle_attention})
        cells: dict[tuple, dict] = {}
        for r in data.needle_attention:
            cells[(r["run_id"], r["task"], bool(r["hint"]), r["length"], round(float(r["depth"]), 4))] = r
        keys = sorted({k[:4] for k in cells}, key=lambda k: (data.done.index(k[0]), *k[1:]))
        rows = [[runs[k[0]]["label"], k[1], "yes" if k[2] else "no", str(k[3])]
                + [f"{num(c['recall'], 2)} · {num(c['needle_attn'])}" if (c := cells.get((*k, d))) else ""
                   for d in depths]
                for k in keys]
        section.tables.append(Table(["run", "task", "hint", "length"] + [f"d={d:g}" for d in depths], rows,
                                    numeric_from=3, caption="recall · needle_attn by depth, from the needle_attention view"))
    missing = [runs[i]["label"] for i in data.done if i not in with_attn]
    if missing:
        section.notes.append(f"Runs without attention rows (not run with --attention): {', '.join(missing)}.")
    return section


def conflict_section(data: ReportData) -> Section:
    section = Section("conflict", "Conflicting facts at the start and the end")
    if not data.conflict:
        section.omitted = "no needle_conflict rows in the selected runs (run --tasks needle_conflict)"
        return section
    runs = {r["id"]: r for r in data.runs}
    section.intro = ("One key, two values: the first sentence says A, the last sentence says B, both orders of every "
                     "pair (docs/metrics.md §1.9). recency_index = last_wins − first_wins (+1: the end always wins); "
                     "order_flip_rate: the share of pairs whose answer changes when the two sentences swap places. "
                     "From the conflict_table view.")
    rows = [[runs[c["run_id"]]["label"], c["task"], str(c["length"]), str(c["n"]), num(c["first_wins"]),
             num(c["last_wins"]), num(c["picked_both"]), num(c["picked_neither"]), num(c["recency_index"]),
             num(c["order_flip_rate"]), str(c["pairs"] or 0)]
            for c in sorted(data.conflict, key=lambda c: (data.done.index(c["run_id"]), c["task"], c["length"]))]
    section.tables.append(Table(["run", "task", "length", "n", "first_wins", "last_wins", "both", "neither",
                                 "recency_index", "order_flip_rate" + arrow("order_flip_rate"), "pairs"], rows, numeric_from=2,
                                caption="which value wins, by length"))
    return section
