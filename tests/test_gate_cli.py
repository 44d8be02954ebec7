"""`evalkit gate` and `evalkit promote` end to end, on runs stored by the fake LM.

Baseline: mode=hit (every first word hits); degraded candidate: mode=other (none
does, every response opens with an opener); equal candidate: mode=hit again; all on 200
prompts a task, where "no discordant pair" shows a drop below the 0.05 margin. A 20-prompt
equal run ("small") cannot show that: it is inconclusive (exit 3).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def stored(fake_run, tmp_path_factory):
    """A DB with three done fake-LM runs (baseline, degraded, equal) and two odd ones."""
    from evalkit.store import db as store_db
    from evalkit.store import runs

    db = tmp_path_factory.mktemp("gate") / "runs.duckdb"
    ids = {"base": fake_run(db, "hit", name="baseline", limit=200),
           "bad": fake_run(db, "other", name="degraded", limit=200),
           "equal": fake_run(db, "hit", name="equal", limit=200),
           "small": fake_run(db, "hit", limit=20, name="small")}
    # a done run on prompts no other run has, and a failed run
    for key, status in (("elsewhere", "done"), ("failed", "failed")):
        run_id = f"9999-{key}"
        runs.insert_run(db, {"id": run_id, "created_at": store_db.now(), "status": "running", "model": "synthetic",
                              "tasks": ["custom"]})
        samples = [{"run_id": run_id, "task": "custom", "doc_id": f"c-{i}", "ft_hit": 1.0} for i in range(5)]
        metrics = [{"run_id": run_id, "task": "custom", "metric": "ft_hit", "filter": "none", "value": 1.0,
                    "stderr": 0.0, "n": 5}]
        runs.finish_run(db, run_id, metrics=metrics, samples=samples, topk=[], status=status)
        ids[key] = run_id
    return db, ids


@pytest.fixture
def runs(stored):
    """This test's own copy of the stored DB (at $EVALKIT_DB) and the run ids."""
    src, ids = stored
    shutil.copy(src, os.environ["EVALKIT_DB"])
    return ids


def digest(path=None):
    return hashlib.sha256(Path(path or os.environ["EVALKIT_DB"]).read_bytes()).hexdigest()


def one_error_line(res, fragment, prefix="evalkit: error:"):
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(prefix) and fragment in lines[0], lines[0]


# ----------------------------------------------------------------------- verdicts


def test_degraded_candidate_fails_with_exit_1(invoke, runs):
    res = invoke("gate", "--candidate", runs["bad"], "--baseline", runs["base"])
    assert res.exit_code == 1
    assert "## evalkit gate: FAIL" in res.stdout
    assert re.search(r"\| \*\*FAIL\*\* \| regression \| firsttoken_en \| ft_hit \|", res.stdout)
    assert "n = 200) lies wholly past the margin 0.05" in res.stdout
    assert "Holm's correction over the" in res.stdout
    one_error_line(res, f"gate failed for candidate {runs['bad']}")


def test_equal_candidate_on_few_prompts_is_inconclusive_with_exit_3(invoke, runs):
    res = invoke("gate", "--candidate", runs["small"], "--baseline", runs["base"])
    assert res.exit_code == 3, res.output
    assert "## evalkit gate: INCONCLUSIVE" in res.stdout
    assert "| *inconclusive* | regression | firsttoken_en | ft_hit |" in res.stdout
    assert "about 73 prompts would decide it" in res.stdout  # 0 discordant pairs of 20
    # a verdict, not an error: no "error:" in the line a CI log shows
    one_error_line(res, f"for candidate {runs['small']}", prefix="evalkit: gate inconclusive for candidate")
    assert "error" not in res.stderr.split(":", 2)[1]


@pytest.mark.parametrize("choice, code", [("pass", 0), ("fail", 1)])
def test_on_inconclusive_maps_exit_3(invoke, runs, choice, code):
    res = invoke("gate", "--candidate", runs["small"], "--baseline", runs["base"], "--on-inconclusive", choice)
    assert res.exit_code == code, res.output
    assert "## evalkit gate: INCONCLUSIVE" in res.stdout
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("evalkit: note:" if choice == "pass" else "evalkit: error:")
    assert f"gate inconclusive for candidate {runs['small']}" in line and f"(--on-inconclusive {choice}" in line
    # a clear verdict is not touched by the option
    assert invoke("gate", "--candidate", runs["bad"], "--baseline", runs["base"], "--on-inconclusive",
                  "pass").exit_code == 1
    assert invoke("gate", "--candidate", runs["equal"], "--baseline", runs["base"], "--on-inconclusive",
                  "fail").exit_code == 0


def test_junit_shows_inconclusive_checks_as_skipped_with_their_reason(invoke, runs, tmp_path):
    junit = tmp_path / "gate.xml"
    assert invoke("gate", "--candidate", runs["small"], "--baseline", runs["base"], "--junit", junit).exit_code == 3
    suite = ET.parse(junit).getroot()
    cases = suite.findall("testcase")
    skipped = [c.find("skipped") for c in cases if c.find("skipped") is not None]
    inconclusive = [s for s in skipped if s.get("type") == "inconclusive"]
    assert inconclusive and all("would decide it" in s.get("message") for s in inconclusive)
    assert int(suite.get("skipped")) == len(skipped) and suite.get("errors") == "0"
    assert suite.findall("testcase/error") == [] and suite.findall("testcase/failure") == []
    passed = [c for c in cases if len(c.findall("./*")) == 0 or c[0].tag == "system-out"]
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["outcome"] == "inconclusive"
    assert (int(props["pass"]), int(props["inconclusive"])) == (len(passed), len(inconclusive))
    assert len(passed) + len(skipped) == int(suite.get("tests"))


def test_equal_candidate_passes_with_exit_0(invoke, runs):
    res = invoke("gate", "--candidate", runs["equal"], "--baseline", runs["base"])
    assert res.exit_code == 0, res.output
    assert "## evalkit gate: PASS" in res.stdout
    assert "| pass | regression | firsttoken_zh | ft_hit |" in res.stdout
    # the group task "firsttoken" has aggregates but no samples: not a regression check
    assert "| firsttoken | ft_hit |" not in res.stdout
    assert res.stderr == ""


@pytest.mark.parametrize("who", ["base", "bad"])
def test_a_run_gated_against_itself_passes(invoke, runs, who):
    res = invoke("gate", "--candidate", runs[who], "--baseline", runs[who])
    assert res.exit_code == 0, res.output
    assert "PASS" in res.stdout


def test_rules_check_thresholds_and_regressions(invoke, runs, tmp_path):
    """Text-level rules on the fake LM's runs (the shipped example is for a model with logprobs:
    tests/test_integration_smollm2.py runs it on the default model)."""
    from evalkit.release.rules import load_rules

    assert load_rules(EXAMPLES / "gate-rules.yaml").regressions
    rules = tmp_path / "rules.yaml"
    rules.write_text('thresholds:\n  ft_hit: ">= 0.5"\n  firsttoken_zh/opener_rate: "<= 0.2"\n'
                     "regressions:\n  ft_hit: 0.05\n  opener_rate: default\n", encoding="utf-8")
    ok = invoke("gate", "--candidate", runs["equal"], "--baseline", runs["base"], "--rules", rules)
    assert ok.exit_code == 0, ok.output
    assert "| pass | threshold | firsttoken_en | ft_hit |" in ok.stdout
    bad = invoke("gate", "--candidate", runs["bad"], "--baseline", runs["base"], "--rules", rules)
    assert bad.exit_code == 1
    assert "| **FAIL** | threshold | firsttoken_zh | opener_rate |" in bad.stdout


def test_gate_with_no_record_only_reads_the_db(invoke, runs):
    before = digest()
    assert invoke("gate", "--candidate", runs["bad"], "--baseline", runs["base"], "--no-record").exit_code == 1
    assert invoke("gate", "--candidate", runs["equal"], "--baseline", runs["base"], "--no-record").exit_code == 0
    assert digest() == before


def _tables(db=None) -> dict[str, list]:
    """Every base table's rows, sorted, keyed by table name."""
    import duckdb

    con = duckdb.connect(str(db or os.environ["EVALKIT_DB"]), read_only=True)
    try:
        names = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables() "
                                           "WHERE database_name = current_database()").fetchall()]
        return {n: sorted(con.execute(f'SELECT * FROM "{n}"').fetchall(), key=repr) for n in names}
    finally:
        con.close()


def test_gate_records_its_decision_and_writes_nothing_else(invoke, runs, tmp_path):
    before = _tables()
    summary = tmp_path / "summary.md"
    res = invoke("gate", "--candidate", runs["small"], "--baseline", runs["base"],
                 env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert res.exit_code == 3, res.output
    after = _tables()
    changed = {t for t in after if after[t] != before.get(t)}
    assert changed == {"gates", "gate_checks"}, changed
    from evalkit.store.promotions import CHECK_COLUMNS, GATE_COLUMNS

    (gate,) = [dict(zip(GATE_COLUMNS, r)) for r in after["gates"]]
    checks = [dict(zip(CHECK_COLUMNS, r)) for r in after["gate_checks"]]
    assert (gate["candidate"], gate["baseline"], gate["baseline_ref"]) == (runs["small"], runs["base"], runs["base"])
    assert gate["verdict"] == "inconclusive" and gate["rules_name"] == "built-in rules 'same'"
    assert len(gate["rules_digest"]) == 16 and gate["evalkit_version"]
    statuses = [c["status"] for c in sorted(checks, key=lambda c: c["position"])]
    assert (gate["n_pass"], gate["n_fail"], gate["n_inconclusive"], gate["n_skipped"]) == tuple(
        statuses.count(s) for s in ("pass", "fail", "inconclusive", "skipped"))
    assert {c["gate_id"] for c in checks} == {gate["id"]} and gate["n_inconclusive"] >= 1
    # the table printed, then where it is kept; the step summary links to the report's section
    assert f"Recorded as gate {gate['id']}" in res.stdout
    assert f"gate `{gate['id']}`" in summary.read_text() and "DIR/index.html under Promotions and gates" in summary.read_text()
    assert "](" not in summary.read_text().split("Recorded as gate", 1)[1]  # no relative link, dead in GitHub's view
    # the same rules spelled in a file get the default rules' digest only when they mean the same
    rules = tmp_path / "rules.yaml"
    rules.write_text("regressions:\n  ft_hit: 0.05\n", encoding="utf-8")
    assert invoke("gate", "--candidate", runs["equal"], "--baseline", runs["base"], "--rules", rules).exit_code == 0
    gates = {r[0]: dict(zip(GATE_COLUMNS, r)) for r in _tables()["gates"]}
    newer = [g for k, g in gates.items() if k != gate["id"]][0]
    assert newer["rules_name"] == str(rules) and newer["rules_digest"] != gate["rules_digest"]


def test_a_decision_that_cannot_be_recorded_keeps_its_verdict_and_exit_code(invoke, runs, monkeypatch):
    from evalkit.errors import DatabaseBusy
    from evalkit.release import db as release_db

    def busy(*args, **kwargs):
        raise DatabaseBusy("the DB is locked by another process (waited 0 s)")

    monkeypatch.setattr(release_db, "record_gate", busy)
    before = digest()
    res = invoke("gate", "--candidate", runs["bad"], "--baseline", runs["base"])
    assert res.exit_code == 1 and "## evalkit gate: FAIL" in res.stdout
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith("evalkit: warning: the decision was not recorded in the DB: the DB is locked")
    assert lines[1].startswith("evalkit: error: gate failed") and len(lines) == 2
    assert digest() == before


def test_recording_never_migrates(tmp_path):
    """An older schema is refused with the line naming `evalkit migrate`, the file unchanged."""
    from evalkit.errors import BadInput
    from evalkit.store.migrations import MIGRATIONS
    from evalkit.store.promotions import GateRecord, record_gate

    path = tmp_path / "older.duckdb"
    import duckdb

    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, name VARCHAR NOT NULL, "
                "applied_at TIMESTAMP NOT NULL)")
    for version, m in enumerate(MIGRATIONS[:-1], start=1):  # everything but the gates table
        m(con)
        con.execute("INSERT INTO schema_version VALUES (?, ?, now())", [version, m.__name__])
    con.close()
    before = digest(path)
    with pytest.raises(BadInput, match="evalkit migrate"):
        record_gate(path, GateRecord({"id": "g1"}))
    assert digest(path) == before
    with pytest.raises(BadInput, match="no evalkit database"):
        record_gate(tmp_path / "missing.duckdb", GateRecord({"id": "g1"}))
    assert not (tmp_path / "missing.duckdb").exists()


# ----------------------------------------------------------------------- outputs


def test_junit_file_parses_and_counts_failures(invoke, runs, tmp_path):
    junit = tmp_path / "out" / "gate.xml"
    junit.parent.mkdir()
    res = invoke("gate", "--candidate", runs["bad"], "--baseline", runs["base"], "--junit", junit)
    assert res.exit_code == 1
    suite = ET.parse(junit).getroot()
    assert suite.tag == "testsuite" and suite.get("name") == "evalkit-gate"
    cases = suite.findall("testcase")
    failed = [c for c in cases if c.find("failure") is not None]
    assert int(suite.get("tests")) == len(cases) and int(suite.get("failures")) == len(failed) >= 4
    assert {c.get("name") for c in failed} >= {"firsttoken_en/ft_hit", "firsttoken_zh/opener_rate"}
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert {k: props.pop(k) for k in ("candidate", "baseline", "outcome", "rules")} == {
        "candidate": runs["bad"], "baseline": runs["base"], "outcome": "fail", "rules": "built-in rules 'same'"}
    counts = {k: int(v) for k, v in props.items()}  # each status's count, and nothing else
    assert set(counts) == {"pass", "fail", "inconclusive", "skipped"} and sum(counts.values()) == len(cases)
    assert counts["fail"] == len(failed) and suite.get("errors") == "0"


def test_github_step_summary_is_appended(invoke, runs, tmp_path):
    summary = tmp_path / "summary.md"
    summary.write_text("# earlier step\n", encoding="utf-8")
    env = {"GITHUB_STEP_SUMMARY": str(summary)}
    assert invoke("gate", "--candidate", runs["equal"], "--baseline", runs["base"], env=env).exit_code == 0
    assert invoke("gate", "--candidate", runs["bad"], "--baseline", runs["base"], env=env).exit_code == 1
    text = summary.read_text(encoding="utf-8")
    assert text.startswith("# earlier step\n")
    assert text.index("## evalkit gate: PASS") < text.index("## evalkit gate: FAIL")


def test_no_step_summary_without_the_variable(invoke, runs, tmp_path, monkeypatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert invoke("gate", "--candidate", runs["equal"], "--baseline", runs["base"]).exit_code == 0
    assert list(cwd.iterdir()) == []


# ----------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "case, args, fragment",
    [
        ("unknown-candidate", ["--candidate", "zz-nope", "--baseline", "{base}"], "unknown run 'zz-nope'"),
        ("unknown-tag", ["--candidate", "{bad}", "--baseline", "tag:nope"], "no run has the tag 'nope'"),
        ("no-shared-prompts", ["--candidate", "{elsewhere}", "--baseline", "{base}"], "share no prompts"),
        ("failed-run", ["--candidate", "{failed}", "--baseline", "{base}"], "status 'failed'"),
        ("rules-missing", ["--candidate", "{bad}", "--baseline", "{base}", "--rules", "{tmp}/nope.yaml"],
         "cannot read rules file"),
        ("rules-not-yaml", ["--candidate", "{bad}", "--baseline", "{base}", "--rules", "{tmp}/broken.yaml"],
         "is not valid YAML"),
        ("rules-unknown-key", ["--candidate", "{bad}", "--baseline", "{base}", "--rules", "{tmp}/unknown.yaml"],
         "unknown top-level key 'limits'"),
        ("rules-bad-op", ["--candidate", "{bad}", "--baseline", "{base}", "--rules", "{tmp}/badop.yaml"],
         "bad operator"),
    ],
)
def test_bad_input_exits_2_and_leaves_the_db_alone(invoke, runs, tmp_path, case, args, fragment):
    (tmp_path / "broken.yaml").write_text("thresholds: [unclosed\n", encoding="utf-8")
    (tmp_path / "unknown.yaml").write_text("limits:\n  ft_hit: 0.1\n", encoding="utf-8")
    (tmp_path / "badop.yaml").write_text('thresholds:\n  ft_hit: "=> 0.5"\n', encoding="utf-8")
    junit = tmp_path / "gate.xml"
    before = digest()
    res = invoke("gate", *[a.format(tmp=tmp_path, **runs) for a in args], "--junit", junit)
    assert res.exit_code == 2, res.output
    one_error_line(res, fragment)
    assert res.stdout == ""
    assert not junit.exists()
    assert digest() == before


def test_junit_into_a_missing_folder_is_bad_input(invoke, runs, tmp_path):
    res = invoke("gate", "--candidate", runs["equal"], "--baseline", runs["base"], "--junit", tmp_path / "no" / "g.xml")
    assert res.exit_code == 2
    one_error_line(res, "its folder does not exist")


def test_gate_needs_both_runs(invoke, runs):
    res = invoke("gate", "--candidate", runs["bad"])
    assert res.exit_code == 2
    assert "--baseline" in res.stderr


# ----------------------------------------------------------------------- promote


def test_promote_then_gate_against_the_tag(invoke, runs):
    res = invoke("promote", runs["base"], "--tag", "prod")
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == f"run {runs['base']} tagged prod"
    again = invoke("promote", runs["base"], "--tag", "prod")
    assert again.stdout.strip() == f"run {runs['base']} already tagged prod"

    res = invoke("gate", "--candidate", runs["equal"], "--baseline", "tag:prod")
    assert res.exit_code == 0, res.output
    assert f"vs baseline {runs['base']}" in res.stdout
    assert invoke("gate", "--candidate", runs["bad"], "--baseline", "tag:prod").exit_code == 1

    # promoting a newer run moves tag:prod to it; the first keeps its row
    assert invoke("promote", runs["equal"], "--tag", "prod").exit_code == 0
    from evalkit.store.db import open_reader
    from evalkit.store.queries import resolve_run

    with open_reader(None) as con:
        assert resolve_run(con, "tag:prod") == runs["equal"]
        tagged = {r[0] for r in con.execute("SELECT run_id FROM tags WHERE tag = 'prod'").fetchall()}
    assert tagged == {runs["base"], runs["equal"]}
    show = invoke("show", "tag:prod")
    assert show.exit_code == 0 and runs["equal"] in show.stdout


def test_promoting_an_earlier_run_again_rolls_the_tag_back(invoke, runs):
    a, b = runs["base"], runs["equal"]
    assert invoke("promote", a, "--tag", "prod").stdout.strip() == f"run {a} tagged prod"
    assert invoke("promote", b, "--tag", "prod").stdout.strip() == f"run {b} tagged prod (was {a})"
    assert invoke("promote", a, "--tag", "prod").stdout.strip() == f"run {a} tagged prod (was {b})"
    show = invoke("show", "tag:prod")
    assert show.exit_code == 0 and re.search(rf"^\s+id: {a}$", show.stdout, re.M), show.stdout
    history = invoke("tags", "prod", "--format", "json")
    assert history.exit_code == 0, history.output
    import json

    rows = json.loads(history.stdout)
    assert [(r["run_id"], r["current"]) for r in rows] == [(a, False), (b, False), (a, True)]
    assert [r["promoted_at"] for r in rows] == sorted(r["promoted_at"] for r in rows)
    # the gate reads the rolled-back tag; a repeat promotion of the current run writes nothing
    assert f"vs baseline {a}" in invoke("gate", "--candidate", b, "--baseline", "tag:prod", "--no-record").stdout
    before = digest()
    assert invoke("promote", a, "--tag", "prod").stdout.strip() == f"run {a} already tagged prod"
    assert digest() == before
    table = invoke("tags").stdout.splitlines()
    assert table[0].split() == ["tag", "promoted_at", "run_id", "name", "model", "quant", "current", "dangling"]
    assert len(table) == 2 + 3 and table[-1].rstrip().endswith("*")


def test_tags_of_an_unknown_name_is_bad_input(invoke, runs):
    invoke("promote", runs["base"], "--tag", "prod")
    res = invoke("tags", "nope")
    assert res.exit_code == 2
    one_error_line(res, "no run has the tag 'nope' (tags: prod)")


def test_promote_by_unique_prefix(invoke, runs):
    prefix = runs["equal"][:-2]
    if sum(r.startswith(prefix) for r in runs.values()) != 1:
        pytest.skip("prefix not unique among the stored runs")
    res = invoke("promote", prefix, "--tag", "candidate-ok")
    assert res.exit_code == 0 and runs["equal"] in res.stdout


@pytest.mark.parametrize(
    "ref, tag, fragment",
    [
        ("zz-nope", "prod", "unknown run 'zz-nope'"),
        ("{failed}", "prod", "only a done run can be promoted"),
        ("{base}", "has space", "bad tag name"),
        ("{base}", "", "bad tag name"),
        ("tag:nope", "prod", "no run has the tag 'nope'"),
    ],
)
def test_promote_bad_input_exits_2_and_writes_nothing(invoke, runs, ref, tag, fragment):
    before = digest()
    res = invoke("promote", ref.format(**runs), "--tag", tag)
    assert res.exit_code == 2, res.output
    one_error_line(res, fragment)
    assert digest() == before


# ----------------------------------------------------------------------- help and examples


@pytest.mark.parametrize("command", ["gate", "promote", "report"])
def test_help_has_examples(invoke, command):
    res = invoke(command, "--help")
    assert res.exit_code == 0
    assert "Examples:" in res.stdout and f"evalkit {command}" in res.stdout


def test_ci_example_workflow_runs_gate_then_promote():
    flow = yaml.safe_load((EXAMPLES / "ci-gate.yml").read_text(encoding="utf-8"))
    steps = [s for job in flow["jobs"].values() for s in job["steps"]]
    script = "\n".join(s.get("run", "") for s in steps)
    assert "bash examples/ci-candidate.sh" in script  # the candidate step: a run, or a stopped one finished
    (run,) = [s for s in steps if s.get("run", "").strip() == "bash examples/ci-candidate.sh"]
    assert "--metrics gate" in run["env"]["EVALKIT_RUN_ARGS"] and "github.sha" in run["env"]["CANDIDATE_NAME"]
    # the gate step's logic lives in examples/ci-gate.sh (tests/test_ci_gate_script.py runs it)
    assert script.index("bash examples/ci-gate.sh") < script.index("evalkit promote latest")
    script += "\n" + (EXAMPLES / "ci-gate.sh").read_text(encoding="utf-8")
    assert 'evalkit gate --candidate latest --baseline "tag:$tag" --rules "$rules" --junit gate.xml' in script
    assert 'rules="${EVALKIT_RULES-}"' in script  # the calibrated default rules unless a file is named
    assert "evalkit promote latest --tag prod" in script
    # exit 3 (inconclusive) is handled: a warning, and no promotion
    assert '3) echo "::warning::' in script and "decide false" in script
    promote = [s for s in steps if s.get("name") == "Promote on pass"][0]
    assert "steps.gate.outputs.promote == 'true'" in promote["if"]


# ------------------------------------------------------------ the first-token distance (js_div)


def _topk_run(db, run_id: str, dists: list[dict[int, float]]) -> str:
    """A done run of len(dists) prompts: one first-token distribution each (stored as top-k rows)."""
    import math

    from evalkit.store import db as store_db
    from evalkit.store import runs as store_runs

    store_runs.insert_run(db, {"id": run_id, "created_at": store_db.now(), "status": "running", "model": "synthetic",
                               "tasks": ["t"]})
    samples = [{"run_id": run_id, "task": "t", "doc_id": f"d{i}", "ft_hit_prob": 0.5} for i in range(len(dists))]
    topk = [{"run_id": run_id, "task": "t", "doc_id": f"d{i}", "rank": r, "token_id": tok, "token": f"w{tok}",
             "logprob": math.log(p), "unit": f"w{tok}"}
            for i, dist in enumerate(dists) for r, (tok, p) in enumerate(sorted(dist.items(), key=lambda x: -x[1]))]
    metrics = [{"run_id": run_id, "task": "t", "metric": "ft_hit_prob", "filter": "none", "value": 0.5,
                "stderr": 0.0, "n": len(dists)}]
    store_runs.finish_run(db, run_id, metrics=metrics, samples=samples, topk=topk, status="done")
    return run_id


def test_the_first_token_distance_passes_a_near_copy_and_fails_a_changed_distribution(invoke, tmp_path):
    db = os.environ["EVALKIT_DB"]
    base = [{1: 0.6, 2: 0.3, 3: 0.1} for _ in range(60)]
    e = [0.002 * (i % 7) for i in range(60)]  # each prompt moves its own amount
    near = [{1: 0.6 - x, 2: 0.3 + x, 3: 0.1} for x in e]  # JSD below 1e-4 bits a prompt
    moved = [{1: 0.3 - x, 2: 0.6 + x, 3: 0.1} for x in e]  # the top two swapped: about 0.07 bits a prompt
    ids = {name: _topk_run(db, f"26-{name}", dists) for name, dists in
           (("base", base), ("near", near), ("moved", moved))}
    res = invoke("gate", "--candidate", ids["near"], "--baseline", ids["base"])
    assert res.exit_code == 0, res.stdout
    row = next(line for line in res.stdout.splitlines() if "| js_div |" in line)
    assert row.startswith("| pass | regression | t | js_div |") and "margin 0.02" in row and "| 60 |" in row, row
    res = invoke("gate", "--candidate", ids["moved"], "--baseline", ids["base"])
    assert res.exit_code == 1, res.stdout
    row = next(line for line in res.stdout.splitlines() if "| js_div |" in line)
    assert row.startswith("| **FAIL** | regression | t | js_div |") and "lies wholly past the margin 0.02" in row, row
    # the candidate's mean probability did not move: only the distance saw the change
    assert re.search(r"\| pass \| regression \| t \| ft_hit_prob \|", res.stdout)
    # a run gated against itself: every distance is 0
    res = invoke("gate", "--candidate", ids["moved"], "--baseline", ids["moved"])
    assert res.exit_code == 0 and re.search(r"\| pass \| regression \| t \| js_div \| 0 \| 0 \|", res.stdout), res.stdout
