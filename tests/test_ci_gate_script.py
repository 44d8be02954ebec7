"""examples/ci-gate.sh, the gate step of examples/ci-gate.yml: its logic, not only its YAML.

With a fake `evalkit` on PATH (each case sets what `query` and `gate` answer, and every call is
logged), then with the real CLI on a small DB of fake-LM runs. The promise: nothing is promoted
without a gate; a missing baseline fails the job with one line unless the user declared the first
baseline; gate exit 0 promotes, 3 warns and does not, anything else fails the job.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "ci-gate.sh"
FAKE = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$1" in
  query) if [ "$FAKE_TAGS" = error ]; then echo "evalkit: error: not a DuckDB file: reports/x.duckdb" >&2; exit 2; fi
         printf 'n\\n%s\\n' "$FAKE_TAGS" ;;
  gate) echo "## evalkit gate: whatever"; exit "$FAKE_GATE" ;;
  *) exit 99 ;;
esac
"""


def run_script(tmp_path, env_extra, path_dir):
    out, summary = tmp_path / "out.txt", tmp_path / "summary.md"
    for f in (out, summary):
        f.write_text("")
    env = {**os.environ, "GITHUB_OUTPUT": str(out), "GITHUB_STEP_SUMMARY": str(summary),
           "PATH": f"{path_dir}{os.pathsep}{os.environ['PATH']}", **env_extra}
    env.pop("FIRST_BASELINE", None) if "FIRST_BASELINE" not in env_extra else None
    res = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return res, out.read_text().splitlines(), summary.read_text()


def fake_evalkit(tmp_path, script: str):
    """An `evalkit` executable in tmp_path/bin running `script` (a fake, or the real CLI), and an empty
    log file a fake appends its arguments to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "evalkit"
    exe.write_text(script)
    exe.chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")
    return bin_dir, log


@pytest.fixture
def fake(tmp_path):
    bin_dir, log = fake_evalkit(tmp_path, FAKE)

    def go(tags, gate=0, **extra):
        res, out, summary = run_script(tmp_path, {"FAKE_LOG": str(log), "FAKE_TAGS": str(tags),
                                                  "FAKE_GATE": str(gate), **extra}, bin_dir)
        return res, out, summary, log.read_text().splitlines()

    return go


def test_a_missing_baseline_fails_the_job_with_one_line_and_no_gate_no_promotion(fake):
    res, out, summary, calls = fake(0)
    assert res.returncode == 1
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("ci-gate: error: no run is tagged prod") and "first_baseline=true" in line
    assert out == [] and "not run" in summary
    assert not any(c.startswith("gate") for c in calls)


@pytest.mark.parametrize("value", ["false", "", "1", "yes", "TRUE"])
def test_only_an_explicit_first_baseline_skips_the_gate(fake, value):
    res, out, _, _ = fake(0, FIRST_BASELINE=value)
    assert res.returncode == 1 and out == []


def test_a_declared_first_baseline_is_promoted_and_says_so(fake):
    res, out, summary, calls = fake(0, FIRST_BASELINE="true")
    assert res.returncode == 0 and out == ["promote=true"]
    assert "declared the first baseline" in summary
    assert not any(c.startswith("gate") for c in calls)


def test_first_baseline_does_not_skip_the_gate_once_a_baseline_exists(fake):
    res, out, _, calls = fake(1, gate=1, FIRST_BASELINE="true")
    assert res.returncode == 1 and out == []
    assert any(c.startswith("gate --candidate latest --baseline tag:prod") for c in calls)


@pytest.mark.parametrize("gate, code, promote", [(0, 0, ["promote=true"]), (3, 0, ["promote=false"]),
                                                 (1, 1, []), (2, 2, []), (137, 137, [])])
def test_the_gate_decides(fake, gate, code, promote):
    res, out, _, calls = fake(1, gate=gate)
    assert res.returncode == code and out == promote
    if gate == 3:
        assert "::warning::evalkit gate is inconclusive" in res.stdout
    (call,) = [c for c in calls if c.startswith("gate")]
    assert call == "gate --candidate latest --baseline tag:prod --junit gate.xml"  # the default rules


@pytest.mark.parametrize("rules", ["", None])
def test_default_rules_when_no_rules_file_is_named(fake, rules):
    _, _, _, calls = fake(1, **({} if rules is None else {"EVALKIT_RULES": rules}))
    assert [c for c in calls if c.startswith("gate")] == ["gate --candidate latest --baseline tag:prod --junit gate.xml"]


def test_a_named_rules_file_is_passed_on(fake):
    _, _, _, calls = fake(1, EVALKIT_RULES="examples/gate-rules.yaml")
    assert [c for c in calls if c.startswith("gate")] == [
        "gate --candidate latest --baseline tag:prod --rules examples/gate-rules.yaml --junit gate.xml"]


def test_an_unreadable_db_fails_with_one_line_and_promotes_nothing(fake):
    res, out, _, calls = fake("error", FIRST_BASELINE="true")  # not a first baseline: an unreadable one
    assert res.returncode == 2 and out == []
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("ci-gate: error: could not read the tags") and "not a DuckDB file" in line


def test_the_workflow_calls_the_script_and_promotes_only_on_its_word():
    flow = yaml.safe_load((ROOT / "examples" / "ci-gate.yml").read_text(encoding="utf-8"))
    steps = {s.get("name"): s for s in flow["jobs"]["gate"]["steps"]}
    gate = steps["Gate the candidate against production"]
    assert gate["run"].strip() == "bash examples/ci-gate.sh" and gate["id"] == "gate"
    assert "inputs.first_baseline" in gate["env"]["FIRST_BASELINE"]
    assert "workflow_dispatch" in gate["env"]["FIRST_BASELINE"]  # never on a push or a pull request
    for name in ("Promote on pass", "Keep the promoted history beyond the cache"):
        assert "steps.gate.outputs.promote == 'true'" in steps[name]["if"]
    names = list(steps)
    assert names.index("Gate the candidate against production") < names.index("Promote on pass")
    on = flow.get("on", flow.get(True))  # YAML 1.1 reads a bare `on` as True
    assert on["workflow_dispatch"]["inputs"]["first_baseline"]["default"] is False


def test_with_the_real_cli_on_a_small_db(fake_run, tmp_path):
    """The real evalkit: no baseline fails; the declared first baseline is promoted; the same run gated
    against itself passes and is promoted; the rules file of the example is the one the step uses."""
    db = tmp_path / "reports" / "evalkit.duckdb"
    db.parent.mkdir()
    fake_run(db, "hit", name="candidate", limit=20)
    bin_dir, _ = fake_evalkit(tmp_path, f'#!/usr/bin/env bash\nexec "{sys.executable}" -m evalkit "$@"\n')
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {"EVALKIT_DB": str(db), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    before = db.read_bytes()

    res, out, _ = run_script(tmp_path, env, bin_dir)
    assert res.returncode == 1 and out == [], res.stderr
    assert res.stderr.startswith("ci-gate: error: no run is tagged prod") and len(res.stderr.splitlines()) == 1
    assert db.read_bytes() == before  # the step only reads

    res, out, _ = run_script(tmp_path, {**env, "FIRST_BASELINE": "true"}, bin_dir)
    assert res.returncode == 0 and out == ["promote=true"], res.stderr
    promoted = subprocess.run([str(bin_dir / "evalkit"), "promote", "latest", "--tag", "prod"], env={**os.environ, **env},
                              capture_output=True, text=True)
    assert promoted.returncode == 0, promoted.stderr

    res, out, _ = run_script(tmp_path, env, bin_dir)  # the candidate is the baseline: passes by identity
    assert res.returncode == 0 and out == ["promote=true"], res.stdout + res.stderr
    assert "PASS" in res.stdout and (tmp_path / "gate.xml").is_file()


# ---- the candidate step: examples/ci-candidate.sh -------------------------------------------------

CANDIDATE = ROOT / "examples" / "ci-candidate.sh"
FAKE_RUNS = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_LOG"
case "$1" in
  query) if [ "$FAKE_LAST" = error ]; then echo "evalkit: error: locked" >&2; exit 1; fi
         printf 'x\\n%s\\n' "$FAKE_LAST" ;;
  run) if [ "$2" = --resume ]; then exit "$FAKE_RESUME"; fi; exit 0 ;;
  *) exit 99 ;;
esac
"""


@pytest.fixture
def candidate_step(tmp_path):
    bin_dir, log = fake_evalkit(tmp_path, FAKE_RUNS)

    def go(last=None, resume=0, db=True):
        log.write_text("")
        path = tmp_path / "reports" / "evalkit.duckdb"
        path.parent.mkdir(exist_ok=True)
        path.unlink(missing_ok=True)
        if db:
            path.write_bytes(b"")
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log),
               "FAKE_LAST": last or "", "FAKE_RESUME": str(resume), "EVALKIT_DB": str(path),
               "CANDIDATE_NAME": "candidate-abc123"}
        env.pop("EVALKIT_RUN_ARGS", None)
        res = subprocess.run(["bash", str(CANDIDATE)], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=60)
        return res, [c for c in log.read_text().splitlines() if not c.startswith("query")]

    return go


NEW_RUN = "run --tasks firsttoken --limit 100 --metrics gate --name candidate-abc123"


def test_the_first_workflow_run_runs_the_candidate(candidate_step):
    res, calls = candidate_step(db=False)
    assert res.returncode == 0 and calls == [NEW_RUN], res.stderr
    res, calls = candidate_step(last=None)  # a DB without a run of this commit
    assert res.returncode == 0 and calls == [NEW_RUN], res.stderr


def test_a_rerun_after_the_candidate_finished_runs_nothing(candidate_step):
    res, calls = candidate_step(last="2612051000-aaaaaa done")
    assert res.returncode == 0 and calls == [] and "done already" in res.stdout


@pytest.mark.parametrize("status", ["interrupted", "abandoned", "failed", "running"])
def test_a_rerun_finishes_the_stopped_run_from_its_journal(candidate_step, status):
    res, calls = candidate_step(last=f"2612051000-aaaaaa {status}")
    assert res.returncode == 0 and calls == ["run --resume 2612051000-aaaaaa"], res.stdout + res.stderr


def test_a_run_that_cannot_resume_is_run_again_and_a_failed_resume_fails_the_job(candidate_step):
    res, calls = candidate_step(last="2612051000-aaaaaa interrupted", resume=2)  # e.g. its journal is gone
    assert res.returncode == 0 and calls == ["run --resume 2612051000-aaaaaa", NEW_RUN]
    assert "::warning::could not resume 2612051000-aaaaaa" in res.stdout
    res, calls = candidate_step(last="2612051000-aaaaaa interrupted", resume=1)
    assert res.returncode == 1 and calls == ["run --resume 2612051000-aaaaaa"]


def test_a_db_that_cannot_be_read_fails_the_step(candidate_step):
    res, calls = candidate_step(last="error")
    assert res.returncode == 1 and calls == [] and "locked" in res.stderr


def test_the_workflow_caches_the_spool_beside_the_db():
    flow = yaml.safe_load((ROOT / "examples" / "ci-gate.yml").read_text(encoding="utf-8"))
    steps = {s.get("name"): s for s in flow["jobs"]["gate"]["steps"]}
    for name in ("Restore the run history", "Save the run history"):
        paths = steps[name]["with"]["path"].split()
        assert paths == ["reports/evalkit.duckdb", "reports/evalkit.duckdb.spool/"], name
        assert "github.run_attempt" in steps[name]["with"]["key"]  # a rerun saves its own attempt
    assert steps["Save the run history"]["if"].startswith("always()")  # a cancelled job's run too
    assert "github.run_id" in steps["Restore the run history"]["with"]["restore-keys"].splitlines()[0]

