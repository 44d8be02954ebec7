"""`evalkit report` end to end: files, sections from SQL, graceful omissions, headless Chromium."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from evalkit.cli import cli

PNG = b"\x89PNG\r\n\x1a\n"
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


def invoke(*args, env=None):
    return CliRunner(catch_exceptions=False).invoke(cli, [str(a) for a in args], env=env)


def fake_run(db, mode, name, limit=10):
    res = invoke("run", "--model", "evalkit-fake", "--model-args", f"mode={mode}", "--tasks", "firsttoken",
                 "--limit", limit, "--name", name, "--db", db, env={"HF_HUB_OFFLINE": "1"})
    assert res.exit_code == 0, res.output
    return re.search(r"^run (\S+)\s+done", res.stdout, re.MULTILINE).group(1)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """Three done fake-LM runs: two of the same model (mode=hit) and a degraded one (mode=other)."""
    db = tmp_path_factory.mktemp("report") / "runs.duckdb"
    ids = {"base": fake_run(db, "hit", "baseline"),
           "bad": fake_run(db, "other", "degraded"),
           "again": fake_run(db, "hit", "again")}
    return db, ids


@pytest.fixture
def runs(stored):
    src, ids = stored
    shutil.copy(src, os.environ["EVALKIT_DB"])
    return ids


def report(out, *args):
    res = invoke("report", "--out", out, *args)
    assert res.exit_code == 0, res.output
    files = [Path(line) for line in res.stdout.splitlines()]
    assert files[:2] == [Path(out) / "index.html", Path(out) / "summary.md"]
    assert all(f.exists() for f in files)
    return files, (Path(out) / "index.html").read_text("utf-8"), (Path(out) / "summary.md").read_text("utf-8")


def add_topk(ids):
    """Synthetic first_token_topk rows: base and bad disagree on en-0002's top-1 token only."""
    from evalkit.store.db import transaction

    dists = {
        "base": {("firsttoken_en", "en-0001"): [(11, " Recursion", 0.7), (12, " Sure", 0.2)],
                 ("firsttoken_en", "en-0002"): [(21, " Paris", 0.9), (12, " Sure", 0.05)],
                 ("firsttoken_zh", "zh-0001"): [(31, "递", 0.6), (32, "好", 0.3), (33, "\ufffd", 0.05, "归"),
                                                (34, "\ufffd", 0.04, "当")]},
        "bad": {("firsttoken_en", "en-0001"): [(11, " Recursion", 0.5), (12, " Sure", 0.4)],
                ("firsttoken_en", "en-0002"): [(12, " Sure", 0.8), (21, " Paris", 0.1)],
                ("firsttoken_zh", "zh-0001"): [(31, "递", 0.55), (32, "好", 0.35)]},
    }
    rows = []
    for who, prompts in dists.items():
        for (task, doc), toks in prompts.items():
            rows += [(ids[who], task, doc, rank, t[0], t[1], math.log(t[2]), t[3] if len(t) > 3 else None)
                     for rank, t in enumerate(toks)]
    with transaction(None) as con:
        con.executemany("INSERT INTO first_token_topk VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)


def add_needle(run_id):
    """Synthetic needle samples and metric rows for one run: recall 1 at the edges, 0 in the middle."""
    from evalkit.store.db import transaction

    rows = []
    for lang in ("en", "zh"):
        for hint in (False, True):
            for length in (256, 512):
                for depth in (0.0, 0.5, 1.0):
                    recall = 0.0 if depth == 0.5 and not hint else 1.0
                    rows.append((run_id, f"needle_{lang}", f"{lang}-{hint}-{length}-{depth}", lang, depth, length,
                                 length - 3, hint, recall))
    with transaction(None) as con:
        con.executemany("INSERT INTO samples (run_id, task, doc_id, lang, needle_depth, needle_length, "
                        "needle_tokens, needle_hint, needle_recall) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        con.executemany("INSERT INTO metrics (run_id, task, metric, filter, value, stderr, n) "
                        "VALUES (?, ?, ?, 'none', ?, ?, ?)",
                        [(run_id, "needle_en", "needle_recall", 0.917, 0.058, 12),
                         (run_id, "needle_en", "start_gap", 0.25, None, 12),
                         (run_id, "needle_en", "middle_gap", 0.5, None, 12)])


def add_attention(run_id):
    """Synthetic --attention rows: needle_attn on the needle samples of `add_needle`, two layers each."""
    from evalkit.store.db import transaction

    with transaction(None) as con:
        con.execute("UPDATE samples SET needle_attn = 0.02 + 0.1 * needle_depth, sink_rate = 0.75 "
                    "WHERE run_id = ? AND needle_depth IS NOT NULL", [run_id])
        con.execute("INSERT INTO attention_layers SELECT run_id, task, doc_id, layer, "
                    "CASE WHEN layer = 0 THEN 0.5 ELSE 1.0 END, 0.6, needle_attn, NULL "
                    "FROM samples, range(2) t(layer) WHERE run_id = ? AND needle_depth IS NOT NULL", [run_id])


def add_conflict(run_id):
    """Synthetic needle_conflict samples: the last value wins at 256 tokens, the first at 512, one pair cut."""
    from evalkit.store.db import transaction

    rows = []
    for length, (ab, ba) in ((256, ("last", "last")), (512, ("first", "first"))):
        for pair in range(2):
            for order, pick in (("ab", ab), ("ba", ba)):
                if length == 512 and pair == 1 and order == "ba":
                    continue  # a --limit that cut a pair
                rows.append((run_id, "needle_conflict_en", f"en-L{length}-p{pair}-{order}", "en", length,
                             length - 2, pick, f"en-L{length}-p{pair}", order))
    with transaction(None) as con:
        con.executemany("INSERT INTO samples (run_id, task, doc_id, lang, needle_length, needle_tokens, "
                        "conflict_pick, conflict_pair, conflict_order) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)


# ----------------------------------------------------------------------- files and sections


def test_report_writes_html_markdown_and_pngs(runs, tmp_path):
    out = tmp_path / "rep"
    files, page, md = report(out)
    names = {f.name for f in files}
    assert {"index.html", "summary.md", "leaderboard.png", "trend.png"} <= names
    for f in files:
        if f.suffix == ".png":
            assert f.read_bytes()[:8] == PNG, f
            assert f'src="{f.name}"' in page and f"]({f.name})" in md
    for run_id in runs.values():
        assert run_id in page and run_id in md
    # offline: nothing outside the folder
    assert not re.search(r"""(src|href)=["']?(https?:|//)|@import|url\(""", page)


def test_leaderboard_numbers_come_from_the_view(runs, tmp_path):
    _, _page, md = report(tmp_path / "rep")
    from evalkit.store.sandbox import read_query

    _, rows = read_query(None, "SELECT name, value, ci_lo, ci_hi FROM leaderboard "
                               "WHERE task = 'firsttoken_en' AND metric = 'ft_hit' ORDER BY name")
    assert [r[0] for r in rows] == ["again", "baseline", "degraded"]
    for name, value, lo, hi in rows:
        cell = f"{value:.3f} [{lo:.3f}, {hi:.3f}]"
        line = next(ln for ln in md.splitlines() if ln.startswith("| firsttoken_en |") and f"| {name}" in ln)
        assert cell in line
    # the best run per task is emphasised; the degraded run is not
    degraded = next(ln for ln in md.splitlines() if ln.startswith("| firsttoken_en |") and "| degraded |" in ln)
    assert "**" not in degraded
    assert "ft_hit ↑" in md and "opener_rate ↓" in md


def test_sections_without_data_are_omitted_with_a_reason(runs, tmp_path):
    files, page, md = report(tmp_path / "rep")
    assert "Omitted: no first_token_topk rows for the selected runs" in page
    assert "_Omitted: no first_token_topk rows for the selected runs" in md
    assert "Omitted: no needle rows in the selected runs" in page
    assert "_Omitted: no needle rows in the selected runs" in md
    assert "Omitted: no attention rows in the selected runs (run with --attention, hf backend)" in page
    assert "_Omitted: no needle_conflict rows in the selected runs (run --tasks needle_conflict)._" in md
    assert not any(f.name.startswith(("first_token", "needle", "sink")) for f in files)


def test_first_token_bars_pick_the_prompts_where_runs_disagree(runs, tmp_path):
    add_topk(runs)
    files, page, _md = report(tmp_path / "rep", "--prompts", 2)
    assert (tmp_path / "rep" / "first_token.png").read_bytes()[:8] == PNG
    assert "first_token.png" in {f.name for f in files}
    assert "Omitted: no first_token_topk" not in page
    captions = [c for c in re.findall(r'<p class="caption">(.*?)</p>', page) if c.startswith("firsttoken")]
    picked = [c.split(":")[0] for c in captions]
    # en-0002 is the only prompt whose top-1 tokens differ; next comes the widest top-1 spread
    assert picked == ["firsttoken_en / en-0002", "firsttoken_en / en-0001"]
    assert "What is the capital of France?" in captions[0] and "accepted: Paris" in captions[0]
    assert "&#x27; Paris&#x27; 0.900" in page and "&#x27; Sure&#x27; 0.800" in page
    # three prompts, CJK tokens shown as text in the page
    _, page3, _ = report(tmp_path / "rep3", "--prompts", 3)
    assert "&#x27;递&#x27; 0.600" in page3
    # byte tokens of split characters show as the units they start, told apart, marked *
    assert "&#x27;归&#x27;* 0.050" in page3 and "&#x27;当&#x27;* 0.040" in page3
    assert "\ufffd" not in page3.split("First-token distributions", 1)[1].split("Needle", 1)[0]


def test_prompts_zero_leaves_the_distributions_out(runs, tmp_path):
    add_topk(runs)
    files, page, _md = report(tmp_path / "rep", "--prompts", "0")
    assert "Omitted: no prompts asked for (--prompts 0)" in page
    assert "first_token.png" not in {f.name for f in files}


def test_needle_heatmap_when_needle_rows_exist(runs, tmp_path):
    add_needle(runs["base"])
    _files, page, md = report(tmp_path / "rep")
    assert (tmp_path / "rep" / "needle_1.png").read_bytes()[:8] == PNG
    assert "Omitted: no needle rows" not in page
    assert "| baseline | en | no | 6 | 0.667 |" in md
    # start_gap first, then middle_gap, then recall
    assert "| baseline | needle_en | 0.250 | 0.500 | 0.917 [0.803, 1.031] |" in md
    # per length from the needle_gaps view: depth 0 and 1 found, the middle lost without the hint
    assert "| baseline | needle_en | no | 256 | 1.000 | 0.500 | -0.500 | 1.000 |" in md
    assert "| baseline | needle_en | yes | 512 | 1.000 | 1.000 | 0.000 | 0.000 |" in md
    assert md.index("start_gap by length") < md.index("recall by language and hint")
    assert "Omitted: no attention rows" in page


def test_attention_section_reads_the_attention_views(runs, tmp_path):
    add_needle(runs["base"])
    add_attention(runs["base"])
    files, page, md = report(tmp_path / "rep")
    names = {f.name for f in files}
    assert {"needle_attn_1.png", "sink.png"} <= names
    for name in ("needle_attn_1.png", "sink.png"):
        assert (tmp_path / "rep" / name).read_bytes()[:8] == PNG
    assert "Omitted: no attention rows" not in page
    # 24 prompts, sink_rate 0.75 each; layer 1 is the strongest (1.0)
    assert "| baseline | evalkit-fake chat | 24 | 0.750 | 2 | 1 (1.000) |" in md
    # recall · needle_attn at depth 0, 0.5 and 1 (needle_attn = 0.02 + 0.1 d)
    assert "| baseline | needle_en | no | 256 | 1.00 · 0.020 | 0.00 · 0.070 | 1.00 · 0.120 |" in md
    assert "| baseline | needle_en | yes | 256 | 1.00 · 0.020 | 1.00 · 0.070 | 1.00 · 0.120 |" in md
    assert "Runs without attention rows (not run with --attention): degraded, again." in md


def test_conflict_table_with_recency_index_by_length(runs, tmp_path):
    add_conflict(runs["bad"])
    _files, page, md = report(tmp_path / "rep")
    assert "Omitted: no needle_conflict rows" not in page
    # 256: the last sentence always wins, and the answer flips with the order in both pairs
    assert "| degraded | needle_conflict_en | 256 | 4 | 0.000 | 1.000 | 0.000 | 0.000 | 1.000 | 1.000 | 2 |" in md
    # 512: the first sentence wins; one complete pair, which flips too
    assert "| degraded | needle_conflict_en | 512 | 3 | 1.000 | 0.000 | 0.000 | 0.000 | -1.000 | 1.000 | 1 |" in md


def test_trend_needs_two_runs_of_one_configuration(runs, tmp_path):
    files, page, md = report(tmp_path / "rep", "--runs", f"{runs['base']},{runs['bad']}")
    assert "Omitted: no configuration (model x quant x KV cache x template) has two or more done runs" in page
    assert "trend.png" not in {f.name for f in files}
    files, page, md = report(tmp_path / "rep2", "--runs", runs["base"], "--runs", runs["again"])
    assert "trend.png" in {f.name for f in files}
    assert "evalkit-fake · chat: 2 runs" in md
    assert runs["bad"] not in page


def test_default_is_the_newest_twelve_done_runs(tmp_path):
    from evalkit.report.build import build_report
    from evalkit.store import runs

    ids = []
    for i in range(14):
        run_id = f"2501010000-{i:06d}"
        runs.insert_run(None, {"id": run_id, "created_at": f"2025-01-01 00:{i:02d}:00", "status": "running",
                                "model": "synthetic", "name": f"r{i}"})
        status = "failed" if i == 13 else "done"
        runs.finish_run(None, run_id, metrics=[{"run_id": run_id, "task": "t", "metric": "ft_hit", "filter": "none",
                                                 "value": i / 13, "stderr": 0.01, "n": 100}],
                         samples=[], topk=[], status=status)
        ids.append(run_id)
    rep = build_report(None, None, tmp_path / "rep", prompts=4)
    assert rep.run_ids == ids[1:13]  # oldest first; the failed newest one is not a default
    assert "synthetic: 12 runs" in (tmp_path / "rep" / "summary.md").read_text("utf-8")


# ----------------------------------------------------------------------- bad input


def test_bad_input_exits_2(runs, tmp_path):
    import hashlib

    db = Path(os.environ["EVALKIT_DB"])
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    res = invoke("report", "--runs", "zz-nope", "--out", tmp_path / "rep")
    assert res.exit_code == 2 and "unknown run 'zz-nope'" in res.stderr
    (tmp_path / "file").write_text("x")
    res = invoke("report", "--out", tmp_path / "file")
    assert res.exit_code == 2 and "is a file" in res.stderr
    res = invoke("report", "--prompts", "-1", "--out", tmp_path / "rep")
    assert res.exit_code == 2 and "--prompts" in res.stderr
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


def test_no_finished_runs_is_bad_input(tmp_path):
    res = invoke("report", "--out", tmp_path / "rep")
    assert res.exit_code == 2 and "no evalkit database" in res.stderr
    from evalkit.store.db import open_writer

    with open_writer(None):
        pass
    res = invoke("report", "--out", tmp_path / "rep")
    assert res.exit_code == 2 and "no finished runs to report on" in res.stderr


# ----------------------------------------------------------------------- in a browser


def chromium(*args, tmp_path):
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_report_renders_in_headless_chromium(runs, tmp_path):
    add_topk(runs)
    out = tmp_path / "rep"
    files, _page, _md = report(out)
    url = (out / "index.html").resolve().as_uri()

    dom = chromium("--dump-dom", url, tmp_path=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert html.count("<table") >= 4  # runs, leaderboard, one per first-token prompt
    imgs = re.findall(r'<img src="([^"]+)"', html)
    assert set(imgs) == {f.name for f in files if f.suffix == ".png"}
    assert "<h2>Leaderboard</h2>" in html and "<h2>First-token distributions</h2>" in html

    shot = tmp_path / "shot.png"
    res = chromium(f"--screenshot={shot}", "--window-size=1280,2000", url, tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert shot.read_bytes()[:8] == PNG and shot.stat().st_size > 20_000
