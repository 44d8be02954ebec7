"""`plots.render`: a report's figures drawn in forked workers, the same bytes as drawn one by one."""

from __future__ import annotations

import datetime as dt
import os
import threading
from functools import partial

import pytest

from evalkit.report import plots


def write_pid(path) -> None:
    path.write_text(str(os.getpid()))


def fail(message: str) -> None:
    raise ValueError(message)


@pytest.fixture
def two_cpus(monkeypatch):
    """Two CPUs and no other thread (earlier tests' runs leave tqdm's idle monitor thread behind)."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(threading, "active_count", lambda: 1)


def figures(out) -> list:
    """Three figures of the report's kinds, as (file, draw) pairs."""
    runs = ["base", "new"]
    entries = [{"metric": m, "task": t, "run": r, "value": v, "lo": v - 0.05, "hi": v + 0.05}
               for m in ("ft_hit", "opener_rate") for t in ("firsttoken_en", "firsttoken_zh")
               for r, v in zip(runs, (0.6, 0.4))]
    prompts = [{"title": "firsttoken_zh / zh-1", "tokens": [plots.token_label("递"), plots.token_label(" Sure")],
                "probs": {"base": [0.7, 0.2], "new": [0.3, 0.6]}}]
    t0 = dt.datetime(2026, 1, 1)
    series = [{"task": "firsttoken_en", "metric": m, "points": [(t0 + dt.timedelta(hours=h), v + h / 10, None, None)
                                                                for h in range(3)]}
              for m, v in (("ft_hit", 0.5), ("entropy", 2.0))]
    return [(out / "leaderboard.png", partial(plots.leaderboard_plot, entries, runs, out / "leaderboard.png")),
            (out / "first_token.png", partial(plots.first_token_plot, prompts, runs, out / "first_token.png")),
            (out / "trend.png", partial(plots.trend_plot, series, out / "trend.png", "model: 3 runs"))]


def test_render_draws_in_workers_the_same_pngs_as_one_by_one(tmp_path, two_cpus):
    for _, draw in figures(tmp_path / "serial"):
        plots.draw_with_fonts(draw)
    marks = [tmp_path / f"pid{i}" for i in range(4)]
    drawn = figures(tmp_path / "workers")
    plots.render([draw for _, draw in drawn] + [partial(write_pid, m) for m in marks])
    for f, _ in drawn:
        assert f.read_bytes() == (tmp_path / "serial" / f.name).read_bytes(), f.name
    assert str(os.getpid()) not in {m.read_text() for m in marks}  # drawn in forked workers


def test_render_raises_a_figures_error(tmp_path, two_cpus):
    with pytest.raises(ValueError, match="no data"):
        plots.render([partial(write_pid, tmp_path / "a"), partial(fail, "no data")])


def test_render_stays_in_process_beside_other_threads(tmp_path, monkeypatch):
    """A forked child could inherit a lock another thread holds: with threads running, no fork."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        plots.render([partial(write_pid, tmp_path / "a"), partial(write_pid, tmp_path / "b")])
    finally:
        stop.set()
        other.join()
    assert {(tmp_path / n).read_text() for n in "ab"} == {str(os.getpid())}


def test_cjk_text_is_drawn_with_the_shipped_cjk_font(tmp_path):
    import warnings

    from evalkit.report import fonts

    families, drawable = plots.plot_fonts()
    assert families == ("DejaVu Sans", "WenQuanYi Micro Hei")  # shipped: the same on every machine
    assert fonts.font_path(fonts.CJK).is_file() and "site-packages" in str(fonts.font_path(fonts.CJK))
    assert plots.plot_label("递归") == "递归" and ord("递") in drawable and ord("ל") in drawable
    prompts = [{"title": "firsttoken_zh / zh-1", "question": "中国的首都是哪里？",
                "tokens": [plots.token_label("北"), plots.token_label("ל"), plots.token_label(" Sure")],
                "probs": {"base": [0.7, 0.2, 0.1]}}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns "Glyph ... missing from font(s)" for a glyph it cannot draw
        plots.draw_with_fonts(partial(plots.first_token_plot, prompts, ["base"], tmp_path / "zh.png"))
    assert (tmp_path / "zh.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_right_to_left_labels_are_drawn_in_reading_order():
    """matplotlib draws a string's characters left to right as stored: a Hebrew token is put in the order
    it is read (the Unicode bidirectional algorithm), the quotes and neighbouring Latin text kept in place."""
    shalom = "\u05e9\u05dc\u05d5\u05dd"  # shin lamed vav final-mem, read right to left
    assert plots.token_label(shalom) == "'" + shalom[::-1] + "'"
    assert plots.plot_label(f"he-1 {shalom}") == f"he-1 {shalom[::-1]}"
    assert plots.plot_label("Paris 0.5") == "Paris 0.5" and plots.plot_label("递归") == "递归"
    assert plots.plot_label("\u0378") == "\\u0378"  # drawn by neither font: escaped


def _crowded(fig) -> list[str]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    gap = plots.TICK_GAP_PT * fig.dpi / 72
    return [f"{ax.get_title()}:{axis.axis_name}" for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
            if plots.crowded_ticks(axis, renderer, gap)]


def test_every_axis_has_legible_ticks(monkeypatch, tmp_path):
    """Small values on a narrow panel (opener_mass: 0.0000 0.0025 0.0050 ...) ran their tick labels
    together; `save_figure` now thins every crowded numeric axis until no two labels touch."""
    entries = [{"metric": m, "task": t, "run": r, "value": v * scale, "lo": v * scale * 0.8, "hi": v * scale * 1.2}
               for m, scale in (("ft_hit", 1.0), ("opener_mass", 0.0158), ("opener_rate", 0.00131))
               for t in ("firsttoken_en", "firsttoken_zh") for r, v in (("a", 0.9), ("b", 0.4))]
    figures = []
    real = plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, **kw: figures.append(fig) or real(fig, path, **kw))
    monkeypatch.setattr(plots, "legible_ticks", lambda fig, gap_pt=0: None)
    plots.draw_with_fonts(partial(plots.leaderboard_plot, entries, ["a", "b"], tmp_path / "lb0.png"))
    assert {"opener_mass:x", "opener_rate:x"} <= set(_crowded(figures[-1]))  # as it was: this check can fail
    monkeypatch.undo()
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, **kw: figures.append(fig) or real(fig, path, **kw))
    plots.draw_with_fonts(partial(plots.leaderboard_plot, entries, ["a", "b"], tmp_path / "lb.png"))
    assert _crowded(figures[-1]) == []
    opener = next(ax for ax in figures[-1].axes if ax.get_title() == "opener_mass")
    assert len([v for v in opener.get_xticks() if 0 <= v <= opener.get_xlim()[1]]) >= 3  # thinned, not emptied
