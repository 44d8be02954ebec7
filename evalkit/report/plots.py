"""PNG plots of the report: leaderboard bars with CIs, first-token distributions, metric trends, the
attention sink per layer.

Owns: drawing already-computed numbers with matplotlib's Agg backend (imported
lazily, on a `Figure`, never pyplot's global state), and drawing a report's
figures side by side in worker processes (`render`). Does not: query the DB or
compute any statistic; the needle heatmap lives in `evalkit.report.needle_plot`.

Labels: every figure is drawn with the fonts evalkit ships (`report.fonts`: DejaVu Sans, then the
CJK font WenQuanYi Micro Hei glyph by glyph), whatever the machine has installed; characters that
neither draws are written as \\uXXXX escapes, and right-to-left text is put in the order it is read
(`plot_label`). Every axis gets as many ticks as fit without their labels touching (`legible_ticks`).
"""

from __future__ import annotations

import io
import math
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def _figure(width: float, height: float):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def plot_fonts() -> tuple[tuple[str, ...], frozenset[int]]:
    """(font families, in fallback order; the code points they draw): the fonts evalkit ships,
    DejaVu Sans and then WenQuanYi Micro Hei (`report.fonts`), the same on every machine."""
    from evalkit.report.fonts import register_with_matplotlib

    return register_with_matplotlib()


def draw_with_fonts(draw: Callable[[], Any]) -> Any:
    """Call `draw()` with the plot fonts (`plot_fonts`) as matplotlib's font family: text falls back
    from DejaVu Sans to the CJK font glyph by glyph."""
    import matplotlib

    with matplotlib.rc_context({"font.family": list(plot_fonts()[0])}):
        return draw()


def render(draws: Sequence[Callable[[], Any]]) -> None:
    """Call each `draw()` (each draws and saves one figure), several at a time where that is safe.

    matplotlib draws on one core and a report's figures are independent, so with two or
    more CPUs they are drawn in forked worker processes, which inherit the imported
    matplotlib (imported here first, once) and take the next figure as they finish one.
    Drawn one by one in this process: a single figure, one CPU, no fork (not Linux), or
    other Python threads running (a forked child could inherit a lock one of them holds).
    A figure that fails raises its error here.
    """
    workers = min(len(draws), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
    if workers < 2 or not sys.platform.startswith("linux") or threading.active_count() > 1:
        for draw in draws:
            draw_with_fonts(draw)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    _figure(1, 1)  # import matplotlib and pick Agg before forking
    plot_fonts()  # find the fonts once, before forking
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        for done in [pool.submit(draw_with_fonts, draw) for draw in draws]:
            done.result()


def _grid(n: int, ncols: int, panel_w: float, panel_h: float, *, left: float, right: float = 0.3,
          top: float = 0.45, bottom: float = 0.5, wgap: float = 0.35, hgap: float = 0.75, foot: float = 0.0):
    """A figure with n panels on a fixed grid (sizes in inches; no layout engine: it is slow).

    `left` and `wgap` hold the y tick labels, `foot` a legend under the panels.
    Returns (figure, list of n axes).
    """
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    width = left + ncols * panel_w + (ncols - 1) * (wgap + left) + right
    height = top + nrows * panel_h + (nrows - 1) * hgap + bottom + foot
    fig = _figure(width, height)
    grid = fig.add_gridspec(nrows, ncols, left=left / width, right=1 - right / width, top=1 - top / height,
                            bottom=(bottom + foot) / height, wspace=(wgap + left) / panel_w,
                            hspace=hgap / panel_h)
    return fig, [fig.add_subplot(grid[i // ncols, i % ncols]) for i in range(n)]


def save_figure(fig, path: str | Path, dpi: int = 100) -> Path:
    """Write `fig` as a PNG at `path` (its folder made as needed) with `paths.write_file`: a link
    at `path` is replaced, never written through; return the path."""
    from evalkit.paths import write_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    legible_ticks(fig)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=dpi, pil_kwargs={"compress_level": 1})  # zlib level 1: encoding is the slow part
    return write_file(path, png.getvalue(), "plot")


TICK_GAP_PT = 3.0  # the least space between two tick labels of an axis, in points


def crowded_ticks(axis, renderer, gap_px: float) -> int:
    """How many neighbouring pairs of `axis`'s visible tick labels come closer than `gap_px` (0: legible).
    The figure must have been drawn (or laid out) first."""
    boxes = [t.label1.get_window_extent(renderer) for t in axis.get_major_ticks()
             if t.label1.get_visible() and t.label1.get_text() and t.get_visible()]
    lo, hi = sorted(axis.get_view_interval())
    boxes = [b for b, v in zip(boxes, axis.get_majorticklocs()) if lo - 1e-12 * abs(hi - lo) <= v <= hi + 1e-12 * abs(hi - lo)]
    horizontal = axis.axis_name == "x"
    spans = sorted((b.x0, b.x1) if horizontal else (b.y0, b.y1) for b in boxes)
    return sum(1 for (_, end), (start, _) in zip(spans, spans[1:]) if start < end + gap_px)


def legible_ticks(fig, gap_pt: float = TICK_GAP_PT) -> None:
    """Give every numeric axis of `fig` as many ticks as fit with `gap_pt` between their labels.

    matplotlib picks the number of ticks from the axis's length and the font size, not from the
    labels' widths, so a narrow panel of small values (0.0000 0.0025 0.0050 ...) runs its labels
    together. Axes whose tick labels touch get fewer ticks until none do: a MaxNLocator (matplotlib's
    default) fewer bins, a date or log locator fewer ticks. Fixed ticks (categories, tokens) are left
    as placed.
    """
    from matplotlib import dates
    from matplotlib.ticker import FixedLocator, LogLocator, MaxNLocator

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)  # a Figure() has no renderer of its own to measure text with
    gap_px = gap_pt * fig.dpi / 72
    for _ in range(8):
        fig.draw_without_rendering()
        renderer = fig.canvas.get_renderer()
        changed = False
        for ax in fig.axes:
            for axis in (ax.xaxis, ax.yaxis):
                if not crowded_ticks(axis, renderer, gap_px):
                    continue
                locator = axis.get_major_locator()
                shown = max(2, len([v for v in axis.get_majorticklocs()
                                    if min(axis.get_view_interval()) <= v <= max(axis.get_view_interval())]))
                if isinstance(locator, FixedLocator):
                    continue
                if isinstance(locator, MaxNLocator):
                    locator.set_params(nbins=max(1, shown - 2))
                elif isinstance(locator, LogLocator):
                    locator.set_params(numticks=max(2, shown - 1))
                elif isinstance(locator, dates.AutoDateLocator):
                    fewer = dates.AutoDateLocator(maxticks=max(2, shown - 1))
                    axis.set_major_locator(fewer)
                    if isinstance(axis.get_major_formatter(), dates.ConciseDateFormatter):
                        axis.set_major_formatter(dates.ConciseDateFormatter(fewer))
                else:
                    continue
                changed = True
        if not changed:
            return


def plot_label(text: str, max_len: int = 40) -> str:
    """Text safe for the plot fonts (`plot_fonts`): truncated, right-to-left runs in the order they
    are read (`fonts.visual_order`: the label alone is the paragraph, isolated from its neighbours),
    characters no font draws as \\uXXXX, `$` escaped.

    >>> plot_label("Paris"), plot_label("\\u0378")
    ('Paris', '\\\\u0378')
    """
    from evalkit.report.fonts import visual_order

    ok = plot_fonts()[1]
    if len(text) > max_len:
        text = text[: max_len - 1] + "…"
    out = []
    for ch in visual_order(text):
        if ch == "$":
            out.append(r"\$")
        elif ord(ch) in ok and ch.isprintable():
            out.append(ch)
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}")
    joined = "".join(out)
    return joined if len(joined) <= max_len else joined[: max_len - 1] + "…"


def token_label(token: str | None, token_id: int | None = None, completed: bool = False) -> str:
    """A first-token label with its spaces visible: repr-quoted, or #id when the text is missing;
    `completed`: the text is the unit a partial token starts, marked with a *."""
    if token is None:
        return f"#{token_id}"
    return plot_label(repr(token), 24) + ("*" if completed else "")


def run_colors(n: int) -> list:
    """One distinct colour per run, in report order."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _err(value: float, lo: float | None, hi: float | None) -> tuple[float, float]:
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return 0.0, 0.0
    return max(0.0, value - lo), max(0.0, hi - value)


def _hbars(ax, ys: Sequence[float], widths: Sequence[float], height: float, colors: Sequence) -> None:
    """Horizontal bars from 0 as one PolyCollection (barh makes an artist per bar: slow).

    The caller sets the axis limits.
    """
    from matplotlib.collections import PolyCollection

    h = height / 2
    verts = [[(0.0, y - h), (w, y - h), (w, y + h), (0.0, y + h)] for y, w in zip(ys, widths)]
    ax.add_collection(PolyCollection(verts, facecolors=list(colors), edgecolors="none"), autolim=False)


def leaderboard_plot(entries: Sequence[dict], runs: Sequence[str], path: str | Path) -> Path:
    """Horizontal bars with 95 % CI whiskers: one panel per metric, a bar per (task, run).

    entries: dicts {metric, task, run (a label in `runs`), value, lo, hi}; runs
    fixes the colours and order. Values are written at the bars when they are few.
    """
    metrics = list(dict.fromkeys(e["metric"] for e in entries))
    tasks = sorted({e["task"] for e in entries})
    colors = dict(zip(runs, run_colors(len(runs))))
    # y position of each (task, run): runs stacked within a task, a gap between tasks
    slots: dict[tuple[str, str], float] = {}
    ticks: dict[str, float] = {}
    extent = 0.0
    for task in tasks:
        present = [r for r in runs if any(e["task"] == task and e["run"] == r for e in entries)]
        for run in present:
            slots[(task, run)] = extent
            extent += 1
        ticks[task] = extent - (len(present) + 1) / 2
        extent += 0.6
    label_bars = len(slots) <= 16
    fig, axes = _grid(len(metrics), 3, 3.2, 0.16 * len(slots) + 0.4, left=1.5, foot=_legend_height(runs))
    for ax, metric in zip(axes, metrics):
        mine = [e for e in entries if e["metric"] == metric]
        # one collection of bars and one of whiskers per panel: far cheaper than an artist per bar
        ys = [slots[(e["task"], e["run"])] for e in mine]
        errs = [_err(e["value"], e.get("lo"), e.get("hi")) for e in mine]
        _hbars(ax, ys, [e["value"] for e in mine], 0.8, [colors[e["run"]] for e in mine])
        whiskers = [(y, e["value"] - lo, e["value"] + hi) for y, e, (lo, hi) in zip(ys, mine, errs) if lo or hi]
        if whiskers:
            ax.hlines([w[0] for w in whiskers], [w[1] for w in whiskers], [w[2] for w in whiskers],
                      color="black", linewidth=0.9)
        right = 0.0
        for slot, e, (_, hi) in zip(ys, mine, errs):
            end = max(e["value"], 0.0) + hi
            right = max(right, end)
            if label_bars:
                ax.text(end, slot, f" {e['value']:.3g}", va="center", fontsize=7)
        shown = [t for t in tasks if any(e["task"] == t for e in mine)]
        ax.set_yticks([ticks[t] for t in shown], [plot_label(t, 22) for t in shown], fontsize=8)
        ax.set_ylim(extent - 0.6 - 0.4, -0.6)  # same scale in every panel, first task on top
        left = min([0.0] + [e["value"] - lo for e, (lo, _) in zip(mine, errs)])
        ax.set_xlim(left * 1.05, max(right, 1e-9) * (1.15 if label_bars else 1.05))
        ax.set_title(plot_label(metric), fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    _legend(fig, [r for r in runs if any(e["run"] == r for e in entries)], colors)
    return save_figure(fig, path)


LEGEND_LABEL = 72  # characters of a run label in a legend


def _legend_cols(labels: Sequence[str]) -> int:
    """Legend columns under a figure: four short labels a row, two long ones (run labels), one longer."""
    longest = max((len(x) for x in labels), default=0)
    per_row = 4 if longest <= 24 else 2 if longest <= 48 else 1
    return max(1, min(per_row, len(labels)))


def _legend_height(labels: Sequence[str]) -> float:
    """Inches under the panels for `_legend` of these labels."""
    return 0.22 * math.ceil(len(labels) / _legend_cols(labels)) + 0.15


def _legend(fig, labels: Sequence[str], colors: dict) -> None:
    """One legend entry per run drawn in this figure (runs without data in it are not listed)."""
    from matplotlib.patches import Patch

    handles = [Patch(color=colors[r], label=plot_label(r, LEGEND_LABEL)) for r in labels]
    fig.legend(handles=handles, loc="lower center", ncols=_legend_cols(labels), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.0))


def first_token_plot(prompts: Sequence[dict], runs: Sequence[str], path: str | Path) -> Path:
    """Grouped bars of first-token probabilities, one panel per prompt, a bar per run.

    prompts: dicts {title, question (optional, under the title), tokens: [label, ...], probs: {run: [p per token]}};
    a run missing from probs has no top-k rows for that prompt.
    """
    colors = dict(zip(runs, run_colors(len(runs))))
    per_panel = max(len(p["tokens"]) for p in prompts) * max(1, len(runs))
    fig, axes = _grid(len(prompts), 2, 4.6, 0.065 * per_panel + 0.7, left=1.6, bottom=0.6, top=0.65, hgap=0.95,
                      foot=_legend_height(runs))
    width = 0.8 / max(1, len(runs))
    for ax, prompt in zip(axes, prompts):
        n = len(prompt["tokens"])
        ys, ps, cs = [], [], []
        for j, run in enumerate(runs):
            probs = prompt["probs"].get(run)
            if probs is not None:
                ys += [t + j * width - 0.4 + width / 2 for t in range(n)]
                ps += list(probs)
                cs += [colors[run]] * n
        _hbars(ax, ys, ps, width, cs)
        ax.set_yticks(range(n), prompt["tokens"], fontsize=8)
        ax.set_ylim(n - 0.5, -0.5)
        ax.set_xlim(0, 1)
        ax.set_xlabel("probability of the first token", fontsize=8)
        question = plot_label(prompt["question"], 64) if prompt.get("question") else ""
        ax.set_title(plot_label(prompt["title"], 60) + (f"\n“{question}”" if question else ""), fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    _legend(fig, [r for r in runs if any(r in p["probs"] for p in prompts)], colors)
    return save_figure(fig, path)


LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P")


def _line_style(i: int) -> dict:
    """The i-th line of a panel: colour, marker and dash all differ between neighbours."""
    return {"marker": MARKERS[i % len(MARKERS)], "linestyle": LINE_STYLES[i % len(LINE_STYLES)]}


def trend_plot(series: Sequence[dict], path: str | Path, title: str) -> Path:
    """Metric values over run time: one panel per metric, one line per task (CI as whiskers).

    series: dicts {task, metric, points: [(created_at, value, lo, hi), ...]}, in panel order.
    Each task keeps its colour, marker and dash in every panel; the legend under the panels
    names them. A metric whose values stay in [0, 1] is drawn on a 0-1 axis.
    """
    from matplotlib import dates
    from matplotlib.lines import Line2D

    metrics = list(dict.fromkeys(s["metric"] for s in series))
    tasks = list(dict.fromkeys(s["task"] for s in series))
    style = {t: {"color": c, **_line_style(i)} for i, (t, c) in enumerate(zip(tasks, run_colors(len(tasks))))}
    fig, axes = _grid(len(metrics), 3, 3.6, 2.2, left=0.5, right=0.3, top=0.75, bottom=0.45, wgap=0.25,
                      hgap=0.85, foot=_legend_height(tasks))
    for ax, metric in zip(axes, metrics):
        mine = [s for s in series if s["metric"] == metric]
        unit = all(0.0 <= p[1] <= 1.0 for s in mine for p in s["points"])
        for s in mine:
            pts = sorted(s["points"], key=lambda p: p[0])
            errs = [_err(p[1], p[2], p[3]) for p in pts]
            xs = [p[0] for p in pts]
            st = style[s["task"]]
            ax.plot(xs, [p[1] for p in pts], markersize=4, linewidth=1.3, **st)
            ax.vlines(xs, [p[1] - lo for p, (lo, _) in zip(pts, errs)], [p[1] + hi for p, (_, hi) in zip(pts, errs)],
                      color=st["color"], linewidth=0.8, alpha=0.7)
        if unit:
            ax.set_ylim(-0.03, 1.03)
        ax.set_title(plot_label(metric), fontsize=10)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        locator = dates.AutoDateLocator()
        ax.xaxis.set_major_locator(locator)
        ax.xaxis.set_major_formatter(dates.ConciseDateFormatter(locator))
    handles = [Line2D([], [], markersize=4, label=plot_label(t), **style[t]) for t in tasks]
    fig.legend(handles=handles, loc="lower center", ncols=_legend_cols(tasks), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.0), title="one line per task", title_fontsize=8)
    fig.suptitle(plot_label(title, 100), fontsize=11)
    return save_figure(fig, path)


def sink_plot(panels: Sequence[dict], path: str | Path) -> Path:
    """Bars of sink_rate per layer, one panel per run (docs/metrics.md §1.8).

    panels: dicts {title, layers: [layer index, ...], values: [sink_rate per layer], overall}.
    """
    fig, axes = _grid(len(panels), 2, 4.6, 2.2, left=0.6, bottom=0.55, top=0.5, hgap=0.85)
    colors = run_colors(len(panels))
    for ax, panel, color in zip(axes, panels, colors):
        layers, values = list(panel["layers"]), list(panel["values"])
        verts = [[(x - 0.4, 0.0), (x + 0.4, 0.0), (x + 0.4, v), (x - 0.4, v)] for x, v in zip(layers, values)]
        from matplotlib.collections import PolyCollection
        from matplotlib.ticker import MaxNLocator

        ax.add_collection(PolyCollection(verts, facecolors=[color] * len(verts), edgecolors="none"), autolim=False)
        ax.axhline(panel["overall"], color="black", linewidth=0.8, linestyle="--")
        ax.set_xlim(min(layers) - 0.7, max(layers) + 0.7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers are whole numbers
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("layer", fontsize=8)
        ax.set_ylabel("sink_rate", fontsize=8)
        ax.set_title(plot_label(f"{panel['title']} — sink_rate {panel['overall']:.3f}", 70), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(labelsize=8)
    return save_figure(fig, path)


def roc_plot(panels: Sequence[dict], signals: Sequence[str], path: str | Path, title: str) -> Path:
    """ROC curves of first-token signals against answer_hit (scikit-learn's roc_curve): one panel per
    task, one line per signal that has values and both classes; lower-is-better signals enter negated.

    panels: dicts {title (the task, its n and right answers), samples: [{answer_hit, signal: value}, ...]}.
    A panel without both right and wrong answers says so instead of a curve.
    """
    import numpy as np
    from matplotlib.lines import Line2D
    from sklearn.metrics import roc_curve

    from evalkit.scoring import registry

    shown = ["−" + s if registry.higher_is_better(s) is False else s for s in signals]
    fig, axes = _grid(len(panels), 3, 3.2, 3.0, left=0.6, top=0.75, bottom=0.55, wgap=0.2, hgap=0.8,
                      foot=_legend_height(shown))
    colors = dict(zip(signals, run_colors(len(signals))))
    drawn: set[str] = set()
    for ax, panel in zip(axes, panels):
        hits = [float(s["answer_hit"]) for s in panel["samples"]]
        curves = 0
        for signal in signals:
            pairs = [(float(s[signal]), float(s["answer_hit"])) for s in panel["samples"] if s.get(signal) is not None]
            labels = np.array([y for _, y in pairs])
            if len(pairs) < 2 or labels.min() == labels.max():
                continue
            sign = -1.0 if registry.higher_is_better(signal) is False else 1.0
            fpr, tpr, _ = roc_curve(labels, sign * np.array([x for x, _ in pairs]))
            ax.plot(fpr, tpr, color=colors[signal], linewidth=1.2, **_line_style(signals.index(signal)),
                    markersize=0)
            drawn.add(signal)
            curves += 1
        if not curves:
            why = ("every answer " + ("right" if hits[0] else "wrong") if hits and min(hits) == max(hits)
                   else "no values of the signals")
            ax.text(0.5, 0.6, why + ":\nno ROC curve", ha="center", va="center", fontsize=9, color="#59636e",
                    transform=ax.transAxes)
        ax.plot([0, 1], [0, 1], color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_aspect("equal")
        ax.set_xlabel("false positive rate", fontsize=8)
        ax.set_ylabel("true positive rate", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.set_title(plot_label(panel["title"], 56), fontsize=9)
    legend = [(s, label) for s, label in zip(signals, shown) if s in drawn]
    if legend:
        handles = [Line2D([], [], color=colors[s], linewidth=1.2, **_line_style(signals.index(s)), markersize=0,
                          label=plot_label(label)) for s, label in legend]
        fig.legend(handles=handles, loc="lower center", ncols=_legend_cols(shown), fontsize=8, frameon=False,
                   bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(plot_label(title, 100), fontsize=10)
    return save_figure(fig, path)


def reliability_plot(series: Mapping[str, Sequence[dict]], path: str | Path, min_bin: int) -> Path:
    """Answer accuracy in equal-count ft_hit_prob bins: one line per run, a point per bin (x = its mean
    ft_hit_prob) with its 95 % Wilson interval as a whisker; the legend gives each run's n and bins.

    series: run label -> rows {bin, ft_hit_prob, n, n_right, accuracy, ci_lo, ci_hi}
    (`report.reading._reliability`); bins hold at least `min_bin` prompts unless a run has fewer.
    """
    fig, axes = _grid(1, 1, 5.6, 3.8, left=0.7, right=0.4, top=0.5, foot=_legend_height(list(series)))
    ax = axes[0]
    for i, (color, (label, points)) in enumerate(zip(run_colors(len(series)), series.items())):
        pts = sorted(points, key=lambda p: p["bin"])
        xs, ys = [p["ft_hit_prob"] for p in pts], [p["accuracy"] for p in pts]
        errs = [_err(p["accuracy"], p.get("ci_lo"), p.get("ci_hi")) for p in pts]
        n = sum(p["n"] for p in pts)
        sizes = sorted({p["n"] for p in pts})
        each = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        ax.errorbar(xs, ys, yerr=[[lo for lo, _ in errs], [hi for _, hi in errs]], color=color, marker="o",
                    markersize=4, linewidth=1.2, capsize=2, elinewidth=0.8, linestyle=LINE_STYLES[i % 4],
                    label=plot_label(f"{label}: n = {n}, {'1 bin' if len(pts) == 1 else f'{len(pts)} bins'} of {each}",
                                     LEGEND_LABEL + 24))
    ax.plot([0, 1], [0, 1], color="grey", linewidth=0.8, linestyle=":")
    xs = [p["ft_hit_prob"] for points in series.values() for p in points if p["ft_hit_prob"] > 0]
    log_x = bool(xs) and max(xs) / min(xs) > 100  # bins of a small probability crowd at 0 on a linear axis
    if log_x:  # symmetric log, so a bin whose mean is exactly 0 keeps its point
        ax.set_xscale("symlog", linthresh=min(xs))
    else:
        ax.set_xlim(-0.02, 1.02)
    ax.set_xlabel("mean ft_hit_prob of the bin" + (" (log scale)" if log_x else ""), fontsize=8)
    ax.set_ylabel("share of answers right (answer_hit)", fontsize=8)
    ax.set_ylim(-0.03, 1.03)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(f"answer accuracy by ft_hit_prob\nequal-count bins of at least {min_bin} prompts, 95 % Wilson "
                 "intervals", fontsize=9)
    fig.legend(loc="lower center", ncols=1, fontsize=8, frameon=False, bbox_to_anchor=(0.5, 0.0))
    return save_figure(fig, path)
