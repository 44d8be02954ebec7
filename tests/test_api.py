"""The Python API (`evalkit.run`, `evalkit.connect`, `evalkit.gate`), as a notebook uses it."""

from __future__ import annotations

import duckdb
import pytest

import evalkit
from evalkit.errors import BadInput


def test_run_connect_gate(tmp_path):
    db = tmp_path / "api.duckdb"
    run = evalkit.run(tasks="firsttoken", model="evalkit-fake", model_args="mode=hit", limit=3, db=db)
    assert run.status == "done" and run.n_samples == 6 and run.db == db
    frame = run.metrics_frame()
    row = frame[(frame.task == "firsttoken_en") & (frame.metric == "ft_hit")].iloc[0]
    ci_lo = row.get("ci_lo")
    assert row.value == 1.0 and row.n == 3 and (ci_lo is None or ci_lo != ci_lo)  # no interval from 3 prompts
    assert len(run.samples_frame()) == 6

    con = evalkit.connect(db)
    try:
        # the relational API the README shows: no result of the checks on open is left pending
        assert con.sql("SELECT model, task, metric, value FROM leaderboard").df().shape[0] > 0
        assert con.execute("SELECT count(*) FROM runs").fetchone() == (1,)
        with pytest.raises(duckdb.Error):
            con.execute("DELETE FROM runs")  # read-only
    finally:
        con.close()

    other = evalkit.run(["firsttoken"], "evalkit-fake", model_args="mode=other", limit=3, db=db)
    assert evalkit.gate(run.id, run.id, db=db).passed
    verdict = evalkit.gate(other.id, run.id, db=db)
    assert not verdict.passed and any("ft_hit" in r for r in verdict.verdict.reasons)


def test_bad_input_raises(tmp_path):
    with pytest.raises(BadInput, match="unknown run option 'limt'"):
        evalkit.run(tasks="firsttoken", model="evalkit-fake", limt=3, db=tmp_path / "x.duckdb")
    with pytest.raises(BadInput, match="no evalkit database"):
        evalkit.connect(tmp_path / "missing.duckdb")
    assert not (tmp_path / "x.duckdb").exists()


def test_needle_lengths_take_a_preset_name_as_the_cli_does():
    from evalkit.api import _config
    from evalkit.prompts.presets import LENGTH_PRESETS

    assert _config("needle_en", "hf", None, {"needle_lengths": "long"}).needle_lengths == list(LENGTH_PRESETS["long"])
    assert _config("needle_en", "hf", None, {"needle_lengths": "256, 512"}).needle_lengths == [256, 512]
    assert _config("needle_en", "hf", None, {"needle_lengths": [1024]}).needle_lengths == [1024]
    with pytest.raises(BadInput, match="needle_lengths: expected numbers or one of default, long, got 'longer'"):
        _config("needle_en", "hf", None, {"needle_lengths": "longer"})


def test_promote_tags_a_done_run(tmp_path):
    db = tmp_path / "api.duckdb"
    run = evalkit.run(tasks="firsttoken", model="evalkit-fake", model_args="mode=hit", limit=3, db=db)
    assert evalkit.promote(run.id, "prod", db=db) is True
    assert evalkit.promote(run.id, "prod", db=db) is False
    assert evalkit.gate(run.id, "tag:prod", db=db).outcome == "pass"
    with pytest.raises(BadInput, match="bad tag name"):
        evalkit.promote(run.id, "has space", db=db)


@pytest.mark.slow
def test_the_readmes_python_example_runs_as_written(default_model_available, tmp_path):
    """The README's Python API block, verbatim, in a fresh folder with no EVALKIT_DB: the default
    model at --limit 20 into ./reports/evalkit.duckdb, promoted, and gated against itself."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    env = {k: v for k, v in os.environ.items() if k != "EVALKIT_DB"}
    env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "reports" / "evalkit.duckdb").is_file()
    assert re.search(r"^\S+ done 40$", out.stdout, re.M), out.stdout
    assert out.stdout.strip().splitlines()[-1] == "pass []"


def test_metrics_frame_prints_every_column_even_on_a_narrow_terminal(monkeypatch):
    """On a terminal pandas fits a frame to its width by hiding middle columns ("..."): metric and value
    were hidden. The frame puts them first and prints whole, wrapped."""
    import os

    import pandas as pd

    from evalkit.api import Run

    monkeypatch.setattr("shutil.get_terminal_size", lambda fallback=None: os.terminal_size((60, 24)))
    run = Run(id="r", status="done", n_samples=2, duration_s=1.0, db=None, metrics=[
        {"task": "firsttoken_en", "metric": "ft_hit_prob", "filter": "none", "value": 0.4321, "stderr": 0.01,
         "ci_lo": 0.41, "ci_hi": 0.45, "n": 230},
        {"task": "firsttoken_zh", "metric": "opener_mass", "filter": "none", "value": 0.0123, "stderr": 0.002,
         "ci_lo": 0.009, "ci_hi": 0.016, "n": 240}])
    frame = run.metrics_frame()
    assert list(frame.columns) == ["task", "metric", "value", "ci_lo", "ci_hi", "n", "stderr", "filter"]
    with pd.option_context("display.max_columns", 4):  # what a narrow terminal gives a plain DataFrame
        assert "..." in repr(pd.DataFrame(run.metrics))  # the bug as it was
        shown = repr(frame)
    assert "..." not in shown and "opener_mass" in shown and "0.4321" in shown and "filter" in shown
    assert max(len(line) for line in shown.splitlines()) <= 60
    assert frame[frame.metric == "ft_hit_prob"].value.iloc[0] == 0.4321  # still a DataFrame to compute with
