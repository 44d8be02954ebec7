"""`evalkit report` end to end: files, sections from SQL, graceful omissions, headless Chromium."""

from __future__ import annotations

import math
import os
import html
import re
import shutil
import subprocess
from pathlib import Path

import pytest

PNG = b"\x89PNG\r\n\x1a\n"
FAKE = " · evalkit-fake · chat"  # the configuration in a fake-LM run's label: model · template (no quant, engine)
CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


def unmd(markdown: str) -> str:
    """summary.md's text as a reader sees it: backslash escapes and entities resolved (its escaping
    is tested in tests/test_textsafe.py; these tests read what it says)."""
    return html.unescape(re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", markdown))


def plain(text: str) -> str:
    """Text without its direction isolates: <bdi> tags (HTML) and FSI ... PDI marks (markdown)."""
    return re.sub(r"</?bdi>|[\u2068\u2069]", "", text)


@pytest.fixture(scope="module")
def stored(fake_run, tmp_path_factory):
    """Three done fake-LM runs: two of the same model (mode=hit) and a degraded one (mode=other)."""
    db = tmp_path_factory.mktemp("report") / "runs.duckdb"
    ids = {"base": fake_run(db, "hit", name="baseline", limit=10),
           "bad": fake_run(db, "other", name="degraded", limit=10),
           "again": fake_run(db, "hit", name="again", limit=10)}
    return db, ids


@pytest.fixture
def runs(stored):
    src, ids = stored
    shutil.copy(src, os.environ["EVALKIT_DB"])
    return ids


@pytest.fixture
def report(invoke):
    """`report(out, *args)`: `evalkit report --out OUT ARGS`; (files written, index.html, summary.md)."""

    def write(out, *args):
        res = invoke("report", "--out", out, *args)
        assert res.exit_code == 0, res.output
        files = [Path(line) for line in res.stdout.splitlines()]
        assert files[:2] == [Path(out) / "index.html", Path(out) / "summary.md"]
        assert all(f.exists() for f in files)
        return files, (Path(out) / "index.html").read_text("utf-8"), unmd((Path(out) / "summary.md").read_text("utf-8"))

    return write


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


def test_report_writes_html_markdown_and_pngs(report, runs, tmp_path):
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
    assert not re.search(r"""(src|href)=["']?(https?:|//)|@import|url\((?!data:font/woff;base64,)""", page)


def test_leaderboard_numbers_come_from_the_view(report, runs, tmp_path):
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
    degraded = next(ln for ln in md.splitlines() if ln.startswith("| firsttoken_en |") and f"| degraded{FAKE} |" in ln)
    assert "**" not in degraded
    assert "ft_hit ↑" in md and "opener_rate ↓" in md


def test_sections_without_data_are_omitted_with_a_reason(report, runs, tmp_path):
    files, page, md = report(tmp_path / "rep")
    assert "Omitted: no first_token_topk rows for the selected runs" in page
    assert "_Omitted: no first_token_topk rows for the selected runs" in md
    assert "Omitted: no needle rows in the selected runs" in page
    assert "_Omitted: no needle rows in the selected runs" in md
    assert "Omitted: no attention rows in the selected runs (run with --attention, hf backend)" in page
    assert "_Omitted: no needle_conflict rows in the selected runs (run --tasks needle_conflict)._" in md
    assert not any(f.name.startswith(("first_token", "needle", "sink")) for f in files)


def test_first_token_bars_pick_the_prompts_where_runs_disagree(report, runs, tmp_path):
    add_topk(runs)
    files, page, _md = report(tmp_path / "rep", "--prompts", 2)
    assert (tmp_path / "rep" / "first_token.png").read_bytes()[:8] == PNG
    assert "first_token.png" in {f.name for f in files}
    assert "Omitted: no first_token_topk" not in page
    captions = [plain(c) for c in re.findall(r'<p class="caption">(.*?)</p>', page) if c.startswith("firsttoken")]
    picked = [c.split(":")[0] for c in captions]
    # en-0002 is the only prompt whose top-1 tokens differ; next comes the widest top-1 spread
    assert picked == ["firsttoken_en / en-0002", "firsttoken_en / en-0001"]
    assert "What is the capital of France?" in captions[0] and "accepted: Paris" in captions[0]
    # a token isolated (<bdi>) from the probability beside it only where it holds RTL text (a Hebrew token
    # cannot swap places with it); Latin ones carry no marks, which would show in terminals and grep
    assert "&#x27; Paris&#x27; 0.900" in page and "&#x27; Sure&#x27; 0.800" in page and "<bdi>&#x27; Paris" not in page
    # three prompts, CJK tokens shown as text in the page
    _, page3, _ = report(tmp_path / "rep3", "--prompts", 3)
    assert "&#x27;递&#x27; 0.600" in plain(page3)
    # byte tokens of split characters show as the units they start, told apart, marked *
    assert "&#x27;归&#x27;* 0.050" in plain(page3) and "&#x27;当&#x27;* 0.040" in plain(page3)
    assert "\ufffd" not in page3.split("First-token distributions", 1)[1].split("Needle", 1)[0]


def test_prompts_zero_leaves_the_distributions_out(report, runs, tmp_path):
    add_topk(runs)
    files, page, _md = report(tmp_path / "rep", "--prompts", "0")
    assert "Omitted: no prompts asked for (--prompts 0)" in page
    assert "first_token.png" not in {f.name for f in files}


def test_needle_heatmap_when_needle_rows_exist(report, runs, tmp_path):
    add_needle(runs["base"])
    _files, page, md = report(tmp_path / "rep")
    assert (tmp_path / "rep" / "needle_1.png").read_bytes()[:8] == PNG
    assert "Omitted: no needle rows" not in page
    assert f"| baseline{FAKE} | en | no | 6 | 0.667 |" in md
    # start_gap first, then middle_gap, then recall
    # 12 prompts with a stored stderr and no stored interval: no value ± 1.96 stderr ([0.803, 1.031],
    # past 1) from fewer than 20 prompts
    assert f"| baseline{FAKE} | needle_en | 0.250 | 0.500 | 0.917 |" in md
    # per length from the needle_gaps view: depth 0 and 1 found, the middle lost without the hint
    assert f"| baseline{FAKE} | needle_en | no | 256 | 1.000 | 0.500 | -0.500 | 1.000 |" in md
    assert f"| baseline{FAKE} | needle_en | yes | 512 | 1.000 | 1.000 | 0.000 | 0.000 |" in md
    assert md.index("start_gap by length") < md.index("recall by language and hint")
    assert "Omitted: no attention rows" in page


def test_attention_section_reads_the_attention_views(report, runs, tmp_path):
    add_needle(runs["base"])
    add_attention(runs["base"])
    files, page, md = report(tmp_path / "rep")
    names = {f.name for f in files}
    assert {"needle_attn_1.png", "sink.png"} <= names
    for name in ("needle_attn_1.png", "sink.png"):
        assert (tmp_path / "rep" / name).read_bytes()[:8] == PNG
    assert "Omitted: no attention rows" not in page
    # 24 prompts, sink_rate 0.75 each; layer 1 is the strongest (1.0)
    assert f"| baseline{FAKE} | 24 | 0.750 | 2 | 1 (1.000) |" in md
    # recall · needle_attn at depth 0, 0.5 and 1 (needle_attn = 0.02 + 0.1 d)
    assert f"| baseline{FAKE} | needle_en | no | 256 | 1.00 · 0.020 | 0.00 · 0.070 | 1.00 · 0.120 |" in md
    assert f"| baseline{FAKE} | needle_en | yes | 256 | 1.00 · 0.020 | 1.00 · 0.070 | 1.00 · 0.120 |" in md
    assert f"Runs without attention rows (not run with --attention): degraded{FAKE}, again{FAKE}." in md


def test_conflict_table_with_recency_index_by_length(report, runs, tmp_path):
    add_conflict(runs["bad"])
    _files, page, md = report(tmp_path / "rep")
    assert "Omitted: no needle_conflict rows" not in page
    # 256: the last sentence always wins, and the answer flips with the order in both pairs
    assert f"| degraded{FAKE} | needle_conflict_en | 256 | 4 | 0.000 | 1.000 | 0.000 | 0.000 | 1.000 | 1.000 | 2 |" in md
    # 512: the first sentence wins; one complete pair, which flips too
    assert f"| degraded{FAKE} | needle_conflict_en | 512 | 3 | 1.000 | 0.000 | 0.000 | 0.000 | -1.000 | 1.000 | 1 |" in md


def test_trend_needs_two_runs_of_one_configuration(report, runs, tmp_path):
    files, page, md = report(tmp_path / "rep", "--runs", f"{runs['base']},{runs['bad']}")
    assert "Omitted: no configuration (model x model_fingerprint x " in page
    assert "trend.png" not in {f.name for f in files}
    files, page, md = report(tmp_path / "rep2", "--runs", runs["base"], "--runs", runs["again"])
    assert "trend.png" in {f.name for f in files}
    assert "evalkit-fake · chat: 2 runs" in md
    assert runs["bad"] not in page


@pytest.mark.parametrize("column, value", [("first_temperature", 0.7), ("ban_openers", True)])
def test_trend_never_joins_runs_that_compare_calls_different(report, runs, tmp_path, column, value):
    """The trend key is compare's run dimensions: a first-step temperature or an opener ban
    makes another configuration, as `evalkit compare` says."""
    from evalkit.compare import DIMENSIONS
    from evalkit.store.db import transaction

    assert column in DIMENSIONS
    with transaction(None) as con:
        con.execute(f"UPDATE runs SET {column} = ? WHERE id = ?", [value, runs["again"]])
    files, page, md = report(tmp_path / "rep", "--runs", runs["base"], "--runs", runs["again"])
    assert "trend.png" not in {f.name for f in files}
    assert f"x {column}" in page


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


def test_bad_input_exits_2(invoke, runs, tmp_path):
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


def test_no_finished_runs_is_bad_input(invoke, tmp_path):
    res = invoke("report", "--out", tmp_path / "rep")
    assert res.exit_code == 2 and "no evalkit database" in res.stderr
    from evalkit.store.db import open_writer

    with open_writer(None):
        pass
    res = invoke("report", "--out", tmp_path / "rep")
    assert res.exit_code == 2 and "no finished runs to report on" in res.stderr
    assert "store one with `evalkit run` first" in res.stderr


def test_with_only_an_interrupted_run_the_report_names_the_resume_command(invoke, tmp_path):
    from evalkit.store import db as store_db
    from evalkit.store import runs as store_runs

    store_runs.insert_run(None, {"id": "2612050900-abcdef", "created_at": store_db.now(), "status": "running",
                                 "model": "hf", "tasks": ["firsttoken"]})
    store_runs.mark_interrupted(None, "2612050900-abcdef", "interrupted (SIGTERM)", 12.0)
    res = invoke("report", "--out", tmp_path / "rep")
    assert res.exit_code == 2
    (line,) = res.stderr.strip().splitlines()
    assert line == ("evalkit: error: no finished runs to report on: run 2612050900-abcdef is interrupted; "
                    "finish it with `evalkit run --resume 2612050900-abcdef`")


def test_promotions_and_gates_section(report, invoke, runs, tmp_path):
    files, page, md = report(tmp_path / "none")
    assert "Omitted: no run was promoted" in page
    for run in (runs["base"], runs["again"], runs["base"]):  # a promotion, another, a rollback
        assert invoke("promote", run, "--tag", "prod").exit_code == 0
    assert invoke("gate", "--candidate", runs["bad"], "--baseline", "tag:prod").exit_code == 1
    files, page, md = report(tmp_path / "rep")
    assert '<section id="promotions"><h2>Promotions and gates</h2>' in page
    assert "[Promotions and gates](#promotions-and-gates)" in md.split("\n## ")[0]  # summary.md links to it
    section = md.split("## Promotions and gates")[1].split("\n## ")[0]
    tag_rows = [line for line in section.splitlines() if line.startswith("| 20")]
    promoted = [line.split(" | ")[1] for line in tag_rows[:3]]
    assert promoted == [runs["base"], runs["again"], f"**{runs['base']}**"]  # the current one in bold
    (gate_row,) = tag_rows[3:]
    cells = [c.strip() for c in gate_row.strip("|").split("|")]
    assert cells[1:4] == ["**fail**", runs["bad"], f"{runs['base']} (tag:prod)"]
    assert cells[4].startswith("built-in rules 'same' · ") and cells[5].startswith("g") and int(cells[7]) >= 1


# ----------------------------------------------------------------------- in a browser


def chromium(*args, tmp_path):
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_report_renders_in_headless_chromium(report, runs, tmp_path):
    """Every section rendered and screenshot whole; with EVALKIT_REPORT_SHOTS=DIR the screenshot is kept
    as DIR/report.png, with the report's files beside it, to look at."""
    add_topk(runs)
    add_needle(runs["base"])
    add_attention(runs["base"])
    add_conflict(runs["bad"])
    out = Path(os.environ["EVALKIT_REPORT_SHOTS"]) if os.environ.get("EVALKIT_REPORT_SHOTS") else tmp_path / "rep"
    files, _page, _md = report(out)
    url = (out / "index.html").resolve().as_uri()

    dom = chromium("--dump-dom", url, tmp_path=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert html.count("<table") >= 4  # runs, leaderboard, one per first-token prompt
    imgs = re.findall(r'<img src="([^"]+)"', html)
    assert set(imgs) == {f.name for f in files if f.suffix == ".png"}
    assert "<h2>Leaderboard</h2>" in html and "<h2>First-token distributions: where the runs disagree most</h2>" in html

    shot = out / "report.png" if os.environ.get("EVALKIT_REPORT_SHOTS") else tmp_path / "shot.png"
    res = chromium(f"--screenshot={shot}", "--hide-scrollbars", "--window-size=1280,12000", url, tmp_path=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert shot.read_bytes()[:8] == PNG and shot.stat().st_size > 20_000


# ----------------------------------------------------------------------- readability (issue 26, item 10)


@pytest.mark.parametrize("context, system, asked", [
    ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
     "<|im_start|>user\nWhat is recursion?<|im_end|>\n<|im_start|>assistant\n", None, "What is recursion?"),
    ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
     "<|end_header_id|>\n\n中国的首都是哪里？<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n", None,
     "中国的首都是哪里？"),
    ("<bos><start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n", None, "Name a colour."),
    ("<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nName a colour. [/INST]", None, "Name a colour."),
    ("Answer directly.\n\nWhat is 2+2?", "Answer directly.", "What is 2+2?"),
    ("What is 2+2?", None, "What is 2+2?"),
])
def test_question_is_the_users_turn_not_the_template(context, system, asked):
    from evalkit.report.reading import question

    assert question(context, system) == asked


def test_prompt_headings_show_the_question(report, runs, tmp_path):
    """A heading is task / id and the user's question, never the chat template's system text."""
    from evalkit.store.db import transaction

    add_topk(runs)
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face. " * 3
    with transaction(None) as con:
        con.execute("UPDATE samples SET prompt = ? WHERE doc_id = 'en-0002'",
                    [f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                     "<|im_end|>\n<|im_start|>assistant\n"])
    _files, page, md = report(tmp_path / "rep", "--prompts", 3)
    captions = [c for c in re.findall(r'<p class="caption">(.*?)</p>', page) if c.startswith("firsttoken")]
    assert captions[0] == "firsttoken_en / en-0002: “What is the capital of France?” — accepted: Paris"  # no RTL: no marks
    assert not any("SmolLM" in c or "&lt;" in c for c in captions), captions
    assert "*firsttoken_en / en-0002: “What is the capital of France?” — accepted: Paris*" in plain(md)


def test_short_text_keeps_the_start_and_the_end():
    from evalkit.report.sections import short_text

    text = "Q: " + "filler " * 100 + "What is the secret number?"
    short = short_text(text, 60)
    assert len(short) == 60 and short.startswith("Q: filler") and short.endswith("secret number?")


def test_runs_are_labelled_model_quant_template_engine(report, runs, tmp_path):
    from evalkit.store.db import transaction

    with transaction(None) as con:
        con.execute("UPDATE runs SET quant = 'q4_1', engine = 'llama.cpp', model_name = 'SmolLM2-360M' WHERE id = ?",
                    [runs["bad"]])
        con.execute("UPDATE runs SET name = NULL WHERE id IN (?, ?)", [runs["base"], runs["again"]])
    _files, page, md = report(tmp_path / "rep")
    assert "| firsttoken_en | degraded · SmolLM2-360M · q4_1 · chat · llama.cpp |" in md
    # two unnamed runs of one configuration: told apart by the end of their ids
    for key in ("base", "again"):
        assert f"| firsttoken_en | evalkit-fake · chat · {runs[key][-6:]} |" in md
    assert "| id | name | status | model | quant | quant applied | kv cache | template | engine |" in md


def test_one_run_reads_1_run(report, runs, tmp_path):
    _files, page, md = report(tmp_path / "rep", "--runs", runs["base"])
    assert "1 run from" in page and "1 run from" in md and "1 run, done." in md
    assert "1 runs" not in page and "1 runs" not in md
    _files, page, md = report(tmp_path / "rep2")
    assert "3 runs from" in md and "3 runs, all done." in md


def test_one_run_shows_its_least_certain_prompts(report, runs, tmp_path):
    add_topk(runs)
    _files, page, md = report(tmp_path / "rep", "--runs", runs["base"], "--prompts", 2)
    assert "## First-token distributions: the least certain prompts" in md
    assert "disagree most" not in md.split("## First-token", 1)[1].split("## Does", 1)[0]
    captions = [c for c in re.findall(r'<p class="caption">(.*?)</p>', page) if c.startswith("firsttoken")]
    # top-1 probabilities of the base run: zh-0001 0.6, en-0001 0.7, en-0002 0.9
    assert [c.split(":")[0] for c in captions] == ["firsttoken_zh / zh-0001", "firsttoken_en / en-0001"]


def _lead_images(runs_db_ids, tmp_path):
    from evalkit.report.build import build_report

    rep = build_report(None, runs_db_ids, tmp_path / "rep", prompts=0)
    return {i.name: i for s in rep.sections for i in s.images}


def test_roc_panels_name_the_task_n_and_right_answers(runs, tmp_path):
    from evalkit.store.db import transaction
    from evalkit.store.sandbox import read_query

    with transaction(None) as con:  # one wrong answer, so firsttoken_en has both classes
        con.execute("UPDATE samples SET answer_hit = false WHERE run_id = ? AND doc_id = (SELECT min(doc_id) FROM "
                    "samples WHERE run_id = ? AND task = 'firsttoken_en' AND answer_hit)", [runs["base"], runs["base"]])
    images = _lead_images([runs["base"], runs["bad"]], tmp_path)
    panels = images["roc_1.png"].draw.args[0]
    _, rows = read_query(None, "SELECT task, count(*), sum(answer_hit::INT) FROM samples WHERE run_id = "
                               f"'{runs['base']}' AND answer_hit IS NOT NULL GROUP BY task ORDER BY task")
    assert [p["title"] for p in panels] == [f"{t}: n = {n}, {k} right" for t, n, k in rows]
    assert "baseline · evalkit-fake · chat" in images["roc_1.png"].draw.keywords["title"]
    assert (tmp_path / "rep" / "roc_1.png").read_bytes()[:8] == PNG
    # the degraded run gets every answer wrong: a note, not a figure of empty panels
    assert "roc_2.png" not in images
    md = unmd((tmp_path / "rep" / "summary.md").read_text("utf-8"))
    assert "No ROC curve to draw for degraded · evalkit-fake · chat: in each task every checkable answer" in md


def _reliability_db(n_prompts):
    import duckdb

    con = duckdb.connect()
    con.execute("CREATE TABLE samples (run_id VARCHAR, task VARCHAR, doc_id VARCHAR, ft_hit_prob DOUBLE, "
                "answer_hit BOOLEAN)")
    con.executemany("INSERT INTO samples VALUES ('r', 't', ?, ?, ?)",
                    [(f"d{i:04d}", i / n_prompts, i % 3 != 0) for i in range(n_prompts)])
    return con


@pytest.mark.parametrize("n_prompts, bins", [(7, 1), (45, 2), (250, 10), (1000, 10)])
def test_reliability_bins_hold_equal_counts_of_at_least_the_minimum(n_prompts, bins):
    from evalkit.report.reading import MIN_BIN_SIZE, _reliability

    rows = _reliability(_reliability_db(n_prompts), ["r"])
    assert len(rows) == bins and sum(r["n"] for r in rows) == n_prompts
    sizes = [r["n"] for r in rows]
    assert max(sizes) - min(sizes) <= 1
    assert min(sizes) >= min(MIN_BIN_SIZE, n_prompts)
    xs = [r["ft_hit_prob"] for r in rows]
    assert xs == sorted(xs)
    for r in rows:
        assert r["accuracy"] == pytest.approx(r["n_right"] / r["n"])
        from evalkit.scoring.stats import interval

        if r["n"] < 10:  # a bin of 7 prompts: no interval from too few (the gate's count)
            assert r["ci_lo"] is None and r["ci_hi"] is None
            continue
        assert r["ci_lo"] <= r["accuracy"] <= r["ci_hi"]
        assert (r["ci_lo"], r["ci_hi"]) == interval([1] * r["n_right"] + [0] * (r["n"] - r["n_right"]), binary=True)


def test_reliability_plot_draws_bins_with_intervals(tmp_path):
    from evalkit.report.plots import reliability_plot
    from evalkit.report.reading import MIN_BIN_SIZE, _reliability

    rows = _reliability(_reliability_db(250), ["r"])
    path = reliability_plot({"a · SmolLM2 · chat": rows}, tmp_path / "reliability.png", min_bin=MIN_BIN_SIZE)
    assert path.read_bytes()[:8] == PNG


def test_trend_has_a_panel_per_metric_and_a_line_per_task(runs, tmp_path):
    from evalkit.report.build import build_report
    from evalkit.report.plots import _line_style
    from evalkit.report.sections import MAX_TREND_TASKS

    rep = build_report(None, [runs["base"], runs["again"]], tmp_path / "rep", prompts=0)
    trend = next(i for s in rep.sections for i in s.images if i.name == "trend.png")
    series = trend.draw.args[0]
    metrics = list(dict.fromkeys(s["metric"] for s in series))
    assert [s["metric"] for s in series] == sorted((s["metric"] for s in series), key=metrics.index)  # grouped
    for metric in metrics:
        tasks = [s["task"] for s in series if s["metric"] == metric]
        assert len(tasks) == len(set(tasks)) <= MAX_TREND_TASKS
    styles = [tuple(sorted(_line_style(i).items())) for i in range(MAX_TREND_TASKS)]
    assert all(a != b for a, b in zip(styles, styles[1:]))
    assert "evalkit-fake · chat: 2 runs" in trend.draw.keywords["title"]


def test_trend_leaves_out_a_metric_of_one_run(report, runs, tmp_path):
    add_needle(runs["base"])  # needle metrics in the baseline run only
    files, page, md = report(tmp_path / "rep", "--runs", f"{runs['base']},{runs['again']}")
    assert "trend.png" in {f.name for f in files}
    assert "_Left out of the plot, with a value in one run only for some task: middle_gap, needle_recall, start_gap._" in md


# ----------------------------------------------------------------------- any script, no system fonts (issue 38)

FONTS_CONF = """<?xml version="1.0"?>
<!DOCTYPE fontconfig SYSTEM "fonts.dtd">
<fontconfig><dir>{fonts}</dir><cachedir>{cache}</cachedir></fontconfig>
"""
# once the page's fonts are in: the faces the browser loaded, and where the two sections are
PROBE = """document.fonts.ready.then(() => {
  const box = id => { const r = document.getElementById(id).getBoundingClientRect();
                      return [r.left + scrollX, r.top + scrollY, r.right + scrollX, r.bottom + scrollY]; };
  return {fonts: [...document.fonts].map(f => [f.family, f.status]),
          boxes: {'first-token': box('first-token'), leaderboard: box('leaderboard')}};
})"""


def _ink(png: Path, box) -> int:
    """Dark pixels (text, lines) of a screenshot inside box (left, top, right, bottom in CSS pixels)."""
    from PIL import Image as PILImage

    with PILImage.open(png) as im:
        gray = im.convert("L").crop(tuple(int(v) for v in box))
        return sum(1 for v in gray.tobytes() if v < 128)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (bash scripts/test-deps.sh)")
def test_report_reads_in_chinese_and_hebrew_on_a_machine_without_fonts(report, runs, tmp_path):
    """Chromium on a machine whose only font is a Latin one (fontconfig pointed at a folder holding DejaVu
    Sans alone, as most servers are: no CJK font): the page's Chinese is drawn with the CJK font embedded in
    it; a Hebrew token is isolated (<bdi>) from its probability; sections without data are listed apart in
    the contents. With EVALKIT_REPORT_SHOTS=DIR the screenshots of the first-token and leaderboard sections
    are kept there (first-token.png, leaderboard.png) to look at. (With no font at all, headless Chromium
    fails some web-font loads at random, so the machine keeps one Latin font.)"""
    from evalkit.store.db import transaction

    add_topk(runs)
    with transaction(None) as con:  # a Hebrew token beside Chinese ones
        con.execute("INSERT INTO first_token_topk VALUES (?, 'firsttoken_zh', 'zh-0001', 4, 41, 'ל', ?, NULL)",
                    [runs["base"], math.log(0.021)])
    out = tmp_path / "rep"
    _files, page, _md = report(out, "--prompts", 3)
    assert "<bdi>&#x27;ל&#x27;</bdi> 0.021" in page
    nav = page.split("<nav>", 1)[1].split("</nav>", 1)[0]
    shown, left_out = nav.split('<p class="left-out">')
    assert 'href="#first-token"' in shown and 'href="#leaderboard"' in shown
    assert 'href="#drift"' in left_out and 'href="#drift"' not in shown  # no drift rows: apart

    import matplotlib

    conf, latin = tmp_path / "fonts.conf", tmp_path / "latin-only"
    latin.mkdir()
    shutil.copy(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf", latin)
    conf.write_text(FONTS_CONF.format(fonts=latin, cache=tmp_path / "fc-cache"))
    env_no_fonts = {**os.environ, "FONTCONFIG_FILE": str(conf)}
    if shutil.which("fc-list"):  # one font, and no CJK font, for Chromium to fall back to
        listed = subprocess.run(["fc-list"], env=env_no_fonts, capture_output=True, text=True).stdout
        assert listed.count("\n") == 1 and "DejaVuSans.ttf" in listed, listed
        assert subprocess.run(["fc-list", ":lang=zh"], env=env_no_fonts, capture_output=True,
                              text=True).stdout.strip() == ""

    from tests.cdp import Browser

    shot = tmp_path / "shot.png"
    with Browser(CHROMIUM, tmp_path / "chromium-profile", env=env_no_fonts) as browser:
        browser.open((out / "index.html").resolve().as_uri())
        probe = browser.evaluate(PROBE)
        # the browser drew the Chinese with the embedded face: no system font could
        cjk_drawn = browser.evaluate("document.fonts.check('16px \"evalkit WenQuanYi Micro Hei\"', '递')")
        browser.screenshot(shot)
    status = dict(probe["fonts"])
    assert status["evalkit WenQuanYi Micro Hei"] == "loaded", probe["fonts"]
    assert status["evalkit DejaVu Sans"] != "error", probe["fonts"]  # loaded, or not needed by this page
    assert cjk_drawn is True
    boxes = probe["boxes"]
    for box in boxes.values():
        assert _ink(shot, box) > 2000  # the section is drawn, text and plot
    keep = os.environ.get("EVALKIT_REPORT_SHOTS")
    if keep:
        from PIL import Image as PILImage

        Path(keep).mkdir(parents=True, exist_ok=True)
        with PILImage.open(shot) as im:
            for section, box in boxes.items():
                im.crop(tuple(int(v) for v in box)).save(Path(keep) / f"{section}.png")

