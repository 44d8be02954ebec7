"""`evalkit run` end to end on the fake LM, and `runs` / `show` / `query` on what it stored."""

from __future__ import annotations

import csv
import io
import json
import re

import duckdb
import pytest

from evalkit.defaults import DEFAULT_BATCH_SIZE
from evalkit.prompts.templates import get_template
from evalkit.scoring.lexicon import load_lexicon
from tests import fake_lm

FAKE = ["--model", "evalkit-fake"]


class Run:
    """One `evalkit run` through the CLI: its result, its id and the prompts the fake LM was sent."""

    def __init__(self, invoke, db, *args):
        start = len(fake_lm.CALLS)
        self.result = invoke("run", *FAKE, "--db", db, *args)
        assert self.result.exit_code == 0, self.result.output
        self.calls = fake_lm.CALLS[start:]
        match = re.search(r"^run (\S+)  done  (\d+) samples", self.result.stdout, re.M)
        assert match, self.result.stdout
        self.id, self.n_samples = match.group(1), int(match.group(2))
        self.db = db

    def rows(self, sql, *params):
        con = duckdb.connect(str(self.db), read_only=True)
        try:
            cur = con.execute(sql, list(params))
            cols = [d[0] for d in cur.description]
            return [dict(zip(cols, r)) for r in cur.fetchall()]
        finally:
            con.close()

    def run_row(self):
        (row,) = self.rows("SELECT * FROM runs WHERE id = ?", self.id)
        return row

    def metrics(self):
        return {(r["task"], r["metric"]): r for r in self.rows("SELECT * FROM metrics WHERE run_id = ?", self.id)}

    def samples(self):
        return self.rows("SELECT * FROM samples WHERE run_id = ? ORDER BY task, doc_id", self.id)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return tmp_path_factory.mktemp("cli_run") / "runs.duckdb"


@pytest.fixture(scope="module")
def hit_run(invoke, db):
    return Run(invoke, db, "--model-args", "mode=hit", "--tasks", "firsttoken", "--limit", 5)


@pytest.fixture(scope="module")
def opener_run(invoke, db, hit_run):
    return Run(invoke, db, "--model-args", "mode=opener", "--tasks", "firsttoken", "--limit", 3, "--name", "openers")


@pytest.fixture(scope="module")
def plain_run(invoke, db, opener_run):
    return Run(invoke, db, "--model-args", "mode=hit", "--tasks", "firsttoken_en", "--limit", 2, "--template", "plain")


@pytest.fixture(scope="module")
def direct_run(invoke, db, plain_run):
    return Run(invoke, db, "--model-args", "mode=hit", "--tasks", "firsttoken_zh", "--limit", 2, "--template", "direct")


USER_PROMPTS = [
    {"id": "u-1", "lang": "en", "category": "factual", "prompt": "Name the largest planet.", "answers": ["Jupiter"]},
    {"id": "u-2", "lang": "zh", "prompt": "太阳系最大的行星是哪个？", "answers": ["木星"]},
    {"lang": "en", "prompt": "What colour is a clear daytime sky?", "answers": ["Blue", "Light blue"]},
]


@pytest.fixture(scope="module")
def prompts_run(invoke, db, direct_run, tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "mine.jsonl"
    path.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in USER_PROMPTS), encoding="utf-8")
    return Run(invoke, db, "--model-args", "mode=hit", "--prompts", path)


@pytest.fixture(scope="module")
def all_runs(hit_run, opener_run, plain_run, direct_run, prompts_run):
    return [hit_run, opener_run, plain_run, direct_run, prompts_run]


# ---- run ---------------------------------------------------------------------------------


def test_run_prints_id_and_metric_table(hit_run):
    out = hit_run.result.stdout
    assert re.fullmatch(r"\d{10}-[0-9a-f]{6}", hit_run.id)
    assert hit_run.n_samples == 10
    assert f"run {hit_run.id} started" in hit_run.result.stderr
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == ["task", "metric", "value", "95%", "CI", "n"])
    table = [line.split() for line in lines[header + 2 :]]
    # direction arrows from the registry; n on every row; a Wilson interval inside [0, 1] from 10 prompts
    # (the group, both tasks: 10 of 10), none from the 5 of one task (too few, as the gate)
    assert ["firsttoken_en", "ft_hit", "↑", "1.0000", "5"] in table
    assert ["firsttoken_zh", "ft_hit", "↑", "1.0000", "5"] in table
    assert ["firsttoken_en", "opener_rate", "↓", "0.0000", "5"] in table
    assert ["firsttoken", "ft_hit", "↑", "1.0000", "[0.7225,", "1.0000]", "10"] in table
    assert any(line.startswith("no 95% CI from too few prompts: a share needs 10") for line in lines)
    assert any("evalkit metrics" in line for line in lines) and any(line.startswith("next: ") for line in lines)


def test_run_row(hit_run):
    row = hit_run.run_row()
    assert row["status"] == "done"
    assert row["model"] == "evalkit-fake"
    assert json.loads(row["model_args"]) == {"mode": "hit"}
    assert row["template"] == "chat" and row["system_prompt"] is None
    assert json.loads(row["template_text"])["chat"] is True
    assert row["tasks"] == ["firsttoken"]
    assert row["opener_lexicon_version"] == load_lexicon().version
    assert row["sample_limit"] == 5 and row["seed"] == 1234 and row["batch_size"] == DEFAULT_BATCH_SIZE
    assert row["finished_at"] >= row["created_at"]
    assert row["duration_s"] > 0 and row["error"] is None
    assert row["lm_eval_version"] == "0.4.13"
    assert row["evalkit_version"] and row["torch_version"] and row["transformers_version"] and row["host"]
    config = json.loads(row["config"])
    assert config["tasks"] == ["firsttoken"] and config["limit"] == 5 and config["model"] == "evalkit-fake"


def test_run_metrics(hit_run):
    metrics = hit_run.metrics()
    for task in ("firsttoken_en", "firsttoken_zh"):
        assert metrics[(task, "ft_hit")]["value"] == 1.0
        assert metrics[(task, "opener_rate")]["value"] == 0.0
        assert metrics[(task, "ft_hit")]["n"] == 5
        assert metrics[(task, "ft_hit")]["stderr"] == 0.0
        assert metrics[(task, "ft_hit")]["filter"] == "none"
    assert metrics[("firsttoken", "ft_hit")]["value"] == 1.0
    # a text-only backend stores no distribution-level metrics (rather than zeros)
    assert not {m for _, m in metrics} & {"ft_hit_prob", "opener_mass", "prior_drift", "top3_mass"}


def test_run_samples(hit_run):
    samples = hit_run.samples()
    assert len(samples) == 10
    assert [s["task"] for s in samples] == ["firsttoken_en"] * 5 + ["firsttoken_zh"] * 5
    assert [s["doc_id"] for s in samples[:5]] == [f"en-000{i}" for i in range(1, 6)]
    for s in samples:
        assert s["ft_outcome"] == "hit"
        assert s["ft_hit"] == 1.0 and s["opener_rate"] == 0.0
        assert s["ft_hit_prob"] is None and s["opener_mass"] is None
        answers = json.loads(s["target"])
        assert s["response"] == f"{answers[0]} is the answer."
        assert s["prompt"].startswith("<user>") and s["prompt"].endswith("</user><assistant>")
        assert s["lang"] == s["task"][-2:]
        assert s["prompt_hash"]
        checkable = {"answer_hit": 1.0} if s["answer_hit"] is not None else {}  # answers_full: the answer is in it
        assert json.loads(s["metrics"]) == {"ft_hit": 1.0, "opener_rate": 0.0, **checkable}
    first = samples[0]
    assert first["prompt"] == "<user>What is recursion?</user><assistant>"
    assert first["first_unit"] == "recursion"
    zh = samples[5]
    assert zh["doc_id"] == "zh-0001" and zh["first_unit"] == "递"
    assert not hit_run.rows("SELECT * FROM first_token_topk WHERE run_id = ?", hit_run.id)  # no logprobs


def test_run_sends_the_chat_template(hit_run):
    contexts = [c for c, _ in hit_run.calls]
    assert len(contexts) == 10
    assert "<user>What is recursion?</user><assistant>" in contexts
    assert "<user>什么是递归？</user><assistant>" in contexts
    assert not any("<system>" in c for c in contexts)
    gen = hit_run.calls[0][1]
    assert gen["do_sample"] is False and gen["until"] == ["\n\n"]


def test_opener_run(opener_run):
    assert opener_run.run_row()["name"] == "openers"
    metrics = opener_run.metrics()
    for task in ("firsttoken_en", "firsttoken_zh"):
        assert metrics[(task, "opener_rate")]["value"] == 1.0
        assert metrics[(task, "ft_hit")]["value"] == 0.0
    samples = opener_run.samples()
    assert len(samples) == 6
    assert {s["ft_outcome"] for s in samples} == {"opener"}
    assert {s["first_unit"] for s in samples} == {"sure"}


def test_plain_template(plain_run):
    row = plain_run.run_row()
    assert row["template"] == "plain" and row["system_prompt"] is None
    assert json.loads(row["template_text"])["chat"] is False
    contexts = [c for c, _ in plain_run.calls]
    assert contexts == ["What is recursion?", "What is the capital of France?"]  # the raw prompt, no markup
    assert [s["prompt"] for s in plain_run.samples()] == contexts
    assert plain_run.metrics()[("firsttoken_en", "ft_hit")]["value"] == 1.0


def test_direct_template(direct_run):
    system = get_template("direct").system
    assert system and "直接回答" in system
    row = direct_run.run_row()
    assert row["template"] == "direct" and row["system_prompt"] == system
    contexts = [c for c, _ in direct_run.calls]
    assert contexts[0] == f"<system>{system}</system><user>什么是递归？</user><assistant>"
    assert all(c.startswith(f"<system>{system}</system><user>") for c in contexts)
    assert [s["prompt"] for s in direct_run.samples()] == contexts


def test_user_templates_file(invoke, tmp_path):
    path = tmp_path / "templates.yaml"
    path.write_text("terse:\n  chat: true\n  system: Be terse.\n", encoding="utf-8")
    db = tmp_path / "t.duckdb"
    run = Run(invoke, db, "--model-args", "mode=hit", "--tasks", "firsttoken_en", "--limit", 1,
              "--template", "terse", "--templates-file", path)
    assert [c for c, _ in run.calls] == ["<system>Be terse.</system><user>What is recursion?</user><assistant>"]
    row = run.run_row()
    assert row["template"] == "terse" and row["system_prompt"] == "Be terse."


def test_user_prompts_file(prompts_run):
    row = prompts_run.run_row()
    assert row["tasks"] == ["firsttoken_user"]
    assert json.loads(row["config"])["prompts_file"].endswith("mine.jsonl")
    metrics = prompts_run.metrics()
    assert metrics[("firsttoken_user", "ft_hit")]["value"] == 1.0
    assert metrics[("firsttoken_user", "opener_rate")]["value"] == 0.0
    assert metrics[("firsttoken_user", "ft_hit")]["n"] == 3
    samples = {s["doc_id"]: s for s in prompts_run.samples()}
    assert set(samples) == {"u-1", "u-2", "mine-3"}  # a missing id defaults to FILE-LINE
    assert samples["u-1"]["prompt"] == "<user>Name the largest planet.</user><assistant>"
    assert samples["u-1"]["category"] == "factual" and samples["u-2"]["category"] == ""
    assert samples["u-2"]["lang"] == "zh" and samples["u-2"]["first_unit"] == "木"
    assert json.loads(samples["mine-3"]["target"]) == ["Blue", "Light blue"]
    assert {s["ft_outcome"] for s in samples.values()} == {"hit"}
    assert {s["task"] for s in samples.values()} == {"firsttoken_user"}


# ---- runs / show / query -------------------------------------------------------------------------


def test_runs_lists_every_run_newest_first(invoke, all_runs, db, monkeypatch):
    monkeypatch.setenv("EVALKIT_DB", str(db))  # the DB from the environment
    result = invoke("runs")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["id", "created_at", "status"]
    ids = [line.split()[0] for line in lines[2:]]
    assert ids == [r.id for r in reversed(all_runs)]
    assert all(" done " in line for line in lines[2:])

    result = invoke("runs", "--format", "json", "--limit", 2)
    listed = json.loads(result.stdout)
    assert [r["id"] for r in listed] == [all_runs[-1].id, all_runs[-2].id]
    assert listed[0]["tasks"] == ["firsttoken_user"] and listed[1]["template"] == "direct"


def test_show_by_prefix_and_latest(invoke, all_runs, db):
    hit_run = all_runs[0]
    result = invoke("show", "zzzz", "--db", db)  # no id begins so
    assert result.exit_code == 2 and "unknown run" in result.stderr
    result = invoke("show", hit_run.id[:14], "--db", db)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert re.search(rf"^\s+id: {hit_run.id}$", out, re.M)
    assert re.search(r"^\s+status: done$", out, re.M)
    assert re.search(r"^\s+template: chat$", out, re.M)
    assert re.search(rf"^\s*opener_lexicon_version: {re.escape(load_lexicon().version)}$", out, re.M)
    table = [line.split() for line in out.splitlines()]
    assert ["firsttoken_en", "ft_hit", "↑", "1.0000", "5"] in table  # 5 prompts: no interval
    assert ["firsttoken_zh", "opener_rate", "↓", "0.0000", "5"] in table

    latest = invoke("show", "latest", "--db", db)
    assert latest.exit_code == 0
    assert re.search(rf"^\s+id: {all_runs[-1].id}$", latest.stdout, re.M)
    assert "firsttoken_user" in latest.stdout

    as_json = json.loads(invoke("show", hit_run.id, "--db", db, "--format", "json").stdout)
    values = {(r["task"], r["metric"]): r["value"] for r in as_json}
    assert values[("firsttoken_en", "ft_hit")] == 1.0 and values[("firsttoken_zh", "opener_rate")] == 0.0


def test_query_formats(invoke, all_runs, db):
    sql = (f"SELECT task, metric, value FROM metrics WHERE run_id = '{all_runs[1].id}' AND task = 'firsttoken_en' "
           "ORDER BY metric")
    table = invoke("query", sql, "--db", db)
    assert table.exit_code == 0
    assert [line.split() for line in table.stdout.splitlines()] == [
        ["task", "metric", "value"],
        ["-------------", "-----------", "------"],
        ["firsttoken_en", "answer_hit", "0.0000"],
        ["firsttoken_en", "ft_hit", "0.0000"],
        ["firsttoken_en", "opener_rate", "1.0000"],
    ]
    as_csv = invoke("query", sql, "--db", db, "--format", "csv")
    assert list(csv.reader(io.StringIO(as_csv.stdout))) == [
        ["task", "metric", "value"], ["firsttoken_en", "answer_hit", "0.0"], ["firsttoken_en", "ft_hit", "0.0"],
        ["firsttoken_en", "opener_rate", "1.0"],
    ]
    as_json = invoke("query", sql, "--db", db, "--format", "json")
    assert json.loads(as_json.stdout) == [
        {"task": "firsttoken_en", "metric": "answer_hit", "value": 0.0},
        {"task": "firsttoken_en", "metric": "ft_hit", "value": 0.0},
        {"task": "firsttoken_en", "metric": "opener_rate", "value": 1.0},
    ]
    counts = json.loads(invoke("query", "SELECT count(*) AS n FROM samples", "--db", db, "--format", "json").stdout)
    assert counts == [{"n": sum(r.n_samples for r in all_runs)}]


def test_query_refuses_writes(invoke, all_runs, db):
    result = invoke("query", "DELETE FROM runs", "--db", db)
    assert result.exit_code == 2
    assert "read-only" in result.stderr
    counts = json.loads(invoke("query", "SELECT count(*) AS n FROM runs", "--db", db, "--format", "json").stdout)
    assert counts == [{"n": len(all_runs)}]


def test_each_response_is_scored_once(invoke, tmp_path, monkeypatch):
    """The task's process_results scores a response; collecting the rows reads those values."""
    from evalkit.scoring import firsttoken

    calls = []
    real = firsttoken.score

    def counting(doc, resp, openers):
        calls.append(doc["id"])
        return real(doc, resp, openers)

    monkeypatch.setattr(firsttoken, "score", counting)
    run = Run(invoke, tmp_path / "once.duckdb", "--tasks", "firsttoken", "--limit", "3")
    assert run.n_samples == 6
    assert sorted(calls) == sorted(r["doc_id"] for r in run.samples())
    assert {r["ft_outcome"] for r in run.samples()} == {"hit"}
