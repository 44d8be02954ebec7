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


def test_cjk_text_is_drawn_with_a_cjk_font_where_one_is_installed_else_escaped(tmp_path):
    import warnings

    families, drawable = plots.plot_fonts()
    if len(families) == 1:  # no CJK font installed: escapes, as before
        assert plots.plot_label("递归") == "\\u9012\\u5f52"
        return
    assert families[0] == "DejaVu Sans" and families[1] in plots.CJK_FAMILIES
    assert plots.plot_label("递归") == "递归" and ord("递") in drawable
    prompts = [{"title": "firsttoken_zh / zh-1", "question": "中国的首都是哪里？",
                "tokens": [plots.token_label("北"), plots.token_label(" Sure")], "probs": {"base": [0.7, 0.2]}}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns "Glyph ... missing from font(s)" for a glyph it cannot draw
        plots.draw_with_fonts(partial(plots.first_token_plot, prompts, ["base"], tmp_path / "zh.png"))
    assert (tmp_path / "zh.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(len(plots.plot_fonts()[0]) == 1, reason="no CJK font installed (apt-get install fonts-wqy-microhei)")
def test_a_cjk_font_is_found():
    assert len(plots.plot_fonts()[0]) == 2
