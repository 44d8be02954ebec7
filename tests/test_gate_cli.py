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


def test_junit_shows_inconclusive_checks_as_errors(invoke, runs, tmp_path):
    junit = tmp_path / "gate.xml"
    assert invoke("gate", "--candidate", runs["small"], "--baseline", runs["base"], "--junit", junit).exit_code == 3
    suite = ET.parse(junit).getroot()
    errors = [c for c in suite.findall("testcase") if c.find("error") is not None]
    assert errors and int(suite.get("errors")) == len(errors)
    assert {c.find("error").get("type") for c in errors} == {"inconclusive"}
    assert {p.get("name"): p.get("value") for p in suite.iter("property")}["outcome"] == "inconclusive"


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


def test_gate_only_reads_the_db(invoke, runs):
    before = digest()
    invoke("gate", "--candidate", runs["bad"], "--baseline", runs["base"])
    invoke("gate", "--candidate", runs["equal"], "--baseline", runs["base"])
    assert digest() == before


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
    assert props == {"candidate": runs["bad"], "baseline": runs["base"], "outcome": "fail", "rules": "built-in rules 'same'"}


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
    assert "--name candidate" in script
    # the gate step's logic lives in examples/ci-gate.sh (tests/test_ci_gate_script.py runs it)
    assert script.index("bash examples/ci-gate.sh") < script.index("evalkit promote latest")
    script += "\n" + (EXAMPLES / "ci-gate.sh").read_text(encoding="utf-8")
    assert 'evalkit gate --candidate latest --baseline "tag:$tag" --rules "$rules" --junit gate.xml' in script
    assert 'rules="${EVALKIT_RULES-examples/gate-rules.yaml}"' in script
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
