"""PNG plots of needle recall (docs/metrics.md §1.6): the depth x length heatmap, the recall-by-depth
curve, both across KV-cache policies (heatmaps side by side, one line per policy), and recall beside
attention on the needle by depth (§1.8).

Owns: averaging recall rows per cell and drawing them with matplotlib's Agg
backend. Does not: compute recall (``evalkit.prompts.needle``), read the store, or
write HTML (the report module embeds these PNGs).

A row is a dict ``{"lang", "hint", "depth", "length", "recall"}``; several rows
for the same cell are averaged.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from evalkit.report.plots import save_figure

_LANG_ORDER = {"en": 0, "zh": 1}


def _depth_tick(depth: float) -> str:
    return f"{depth:.1f}" if round(depth, 1) == depth else f"{depth:g}"


def _panel_title(lang: str, hint: bool) -> str:
    return f"{lang} · {'hint' if hint else 'no hint'}"


def _mean_cells(rows: Iterable[dict], keys: tuple[str, ...]) -> dict[tuple, float]:
    """(values of keys) -> mean recall over the rows sharing them."""
    rows = list(rows)
    if not rows:
        raise ValueError("no needle rows to plot")
    sums: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0])
    for row in rows:
        missing = [k for k in (*keys, "recall") if k not in row]
        if missing:
            raise ValueError(f"needle row lacks {', '.join(missing)}: {row!r}")
        cell = tuple(bool(row[k]) if k == "hint" else row[k] for k in keys)
        acc = sums[cell]
        acc[0] += float(row["recall"])
        acc[1] += 1
    return {cell: total / n for cell, (total, n) in sums.items()}


def _panels(cells: dict[tuple, float]) -> tuple[list[str], list[bool]]:
    langs = sorted({c[0] for c in cells}, key=lambda lang: (_LANG_ORDER.get(lang, 99), lang))
    hints = sorted({c[1] for c in cells})  # False ("no hint") left, True right
    return langs, hints


def _figure(width: float, height: float):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _recall_axis(ax, xlabel: str, title: str) -> None:
    """Recall (0..1) against needle depth (0..1), gridded."""
    ax.set_xlim(-0.03, 1.03)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("recall")
    ax.grid(alpha=0.3)
    ax.set_title(title)


def heatmap(rows: Iterable[dict], path: str | Path, title: str | None = None) -> Path:
    """Write a depth x length recall heatmap PNG, one panel per (lang, hint); return its path.

    Panels: a row per language, "no hint" left and "hint" right. x = depth,
    y = requested length in tokens, colour = mean recall on a fixed 0-1 scale,
    with the value written in each cell; cells without data are blank.
    """
    cells = _mean_cells(rows, ("lang", "hint", "depth", "length"))
    langs, hints = _panels(cells)
    depths = sorted({round(float(c[2]), 4) for c in cells})
    lengths = sorted({int(c[3]) for c in cells})
    grid = {(c[0], c[1], round(float(c[2]), 4), int(c[3])): v for c, v in cells.items()}
    # each panel at least 1.3 in tall, so the rotated axis label never reaches the panel below
    fig = _figure(0.55 * len(depths) * len(hints) + 2.5, max(0.45 * len(lengths), 1.3) * len(langs) + 1.6)
    axes = fig.subplots(len(langs), len(hints), squeeze=False)
    image = None
    for i, lang in enumerate(langs):
        for j, hint in enumerate(hints):
            image = _heatmap_panel(axes[i][j], grid, lang, hint, depths, lengths, _panel_title(lang, hint))
            if i < len(langs) - 1:  # axis labels on the outer panels only
                axes[i][j].set_xlabel("")
            if j > 0:
                axes[i][j].set_ylabel("")
    fig.colorbar(image, ax=axes.ravel().tolist(), label="recall")
    if title:
        fig.suptitle(title)
    return save_figure(fig, path, dpi=120)


def _heatmap_panel(ax, grid: dict, lang: str, hint: bool, depths: list, lengths: list, title: str):
    """One depth x length panel; rows: lengths (smallest at the bottom), columns: depths."""
    import numpy as np

    values = np.full((len(lengths), len(depths)), np.nan)
    for y, length in enumerate(lengths):
        for x, depth in enumerate(depths):
            value = grid.get((lang, hint, depth, length))
            if value is not None:
                values[y, x] = value
                ax.text(x, y, f"{value:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if value >= 0.5 else "white")
    image = ax.imshow(np.ma.masked_invalid(values), cmap="viridis", vmin=0.0, vmax=1.0,
                      origin="lower", aspect="auto")
    ax.set_xticks(range(len(depths)), [_depth_tick(d) for d in depths], fontsize=7)
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
    ax.set_xlabel("needle depth")
    ax.set_ylabel("length (tokens)")
    ax.set_title(title, fontsize=9)
    return image


def policy_heatmaps(groups: Sequence[tuple[str, Iterable[dict]]], path: str | Path, title: str | None = None) -> Path:
    """Heatmaps side by side: one column per group (a run, named by its KV-cache policy), one
    row per (lang, hint) any group has, on one 0-1 colour scale; return the PNG's path."""
    if not groups:
        raise ValueError("no needle rows to plot")
    grids = []
    for name, rows in groups:
        cells = _mean_cells(rows, ("lang", "hint", "depth", "length"))
        grids.append((name, {(c[0], c[1], round(float(c[2]), 4), int(c[3])): v for c, v in cells.items()}))
    keys = [k for _, grid in grids for k in grid]
    panels = sorted({(k[0], k[1]) for k in keys}, key=lambda p: (_LANG_ORDER.get(p[0], 99), p[0], p[1]))
    depths = sorted({k[2] for k in keys})
    lengths = sorted({k[3] for k in keys})
    fig = _figure(0.45 * len(depths) * len(grids) + 2.5, 0.45 * len(lengths) * len(panels) + 1.8)
    axes = fig.subplots(len(panels), len(grids), squeeze=False)
    image = None
    for i, (lang, hint) in enumerate(panels):
        for j, (name, grid) in enumerate(grids):
            image = _heatmap_panel(axes[i][j], grid, lang, hint, depths, lengths,
                                   f"{name}\n{_panel_title(lang, hint)}")
    fig.colorbar(image, ax=axes.ravel().tolist(), label="recall")
    if title:
        fig.suptitle(title)
    return save_figure(fig, path, dpi=110)


def policy_depth_lines(groups: Sequence[tuple[str, Iterable[dict]]], path: str | Path, title: str | None = None) -> Path:
    """Recall by depth, one line per group (a run, named by its KV-cache policy) on one axis,
    each the mean over its languages, hint variants and lengths; return the PNG's path."""
    if not groups:
        raise ValueError("no needle rows to plot")
    fig = _figure(6.4, 4.0)
    ax = fig.subplots()
    for name, rows in groups:
        cells = _mean_cells(rows, ("depth",))  # a plain mean over the view's cells of each depth
        points = sorted((float(c[0]), v) for c, v in cells.items())
        ax.plot([d for d, _ in points], [v for _, v in points], marker="o", label=name)
    _recall_axis(ax, "needle depth (0 = the first sentence)", title or "needle recall by depth, per KV-cache policy")
    ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=120)


def recall_by_depth_plot(rows: Iterable[dict], path: str | Path, title: str | None = None) -> Path:
    """Write a recall-vs-depth line plot PNG, one line per (lang, hint), lengths pooled; return its path."""
    cells = _mean_cells(rows, ("lang", "hint", "depth"))
    langs, hints = _panels(cells)
    fig = _figure(6.4, 4.0)
    ax = fig.subplots()
    for lang in langs:
        for hint in hints:
            points = sorted((float(c[2]), v) for c, v in cells.items() if c[0] == lang and c[1] == hint)
            if points:
                ax.plot([d for d, _ in points], [v for _, v in points], marker="o",
                        linestyle="--" if hint else "-", label=_panel_title(lang, hint))
    _recall_axis(ax, "needle depth", title or "needle recall by depth")
    ax.legend()
    return save_figure(fig, path, dpi=120)


def recall_attention_plot(rows: Iterable[dict], path: str | Path, title: str | None = None) -> Path:
    """Write recall by depth (top row) and needle_attn by depth (bottom row), one column per
    language on a shared depth axis; return its path.

    rows: dicts {lang, hint, depth, length, recall, needle_attn}, one line per (hint, length) in
    its language's two panels, the same colour (length) and style (dashed: hint) in each, so a
    line reads across the two rows. Rows for the same cell are averaged.
    """
    rows = [r for r in rows if r.get("needle_attn") is not None]
    if not rows:
        raise ValueError("no needle rows with needle_attn to plot")
    recall = _mean_cells(rows, ("lang", "hint", "length", "depth"))
    attn = _mean_cells([{**r, "recall": r["needle_attn"]} for r in rows], ("lang", "hint", "length", "depth"))
    lines = sorted({c[:3] for c in recall}, key=lambda c: (_LANG_ORDER.get(c[0], 99), c[0], c[1], c[2]))
    langs = list(dict.fromkeys(lang for lang, _, _ in lines))
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    lengths = sorted({c[2] for c in lines})
    color = {n: cmap(i % cmap.N) for i, n in enumerate(lengths)}
    fig = _figure(3.6 * len(langs) + 1.6, 5.6)
    axes = fig.subplots(2, len(langs), sharex=True, sharey="row", squeeze=False)
    peak = max(attn.values())
    for col, lang in enumerate(langs):
        top, bottom = axes[0][col], axes[1][col]
        for _, hint, length in (line for line in lines if line[0] == lang):
            style = {"color": color[length], "linestyle": "--" if hint else "-", "marker": "o", "markersize": 3}
            label = f"{length} tokens" + (" · hint" if hint else "")
            for ax, cells in ((top, recall), (bottom, attn)):
                points = sorted((float(c[3]), v) for c, v in cells.items() if c[:3] == (lang, hint, length))
                ax.plot([d for d, _ in points], [v for _, v in points], label=label if ax is top else None, **style)
        top.set_title(lang, fontsize=9)
        top.set_ylim(-0.03, 1.03)
        bottom.set_ylim(0, max(peak * 1.15, 1e-3))
        bottom.set_xlim(-0.03, 1.03)
        bottom.set_xlabel("needle depth")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("recall")
    axes[1][0].set_ylabel("needle_attn")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:  # lengths or hints only one language has
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, fontsize=7, loc="outside right center", frameon=False)
    fig.suptitle(title or "recall and attention on the needle by depth", fontsize=10)
    return save_figure(fig, path, dpi=120)
