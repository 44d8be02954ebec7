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


@pytest.fixture
def fake(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "evalkit"
    exe.write_text(FAKE)
    exe.chmod(0o755)
    log = tmp_path / "calls.log"
    log.write_text("")

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
    assert call == "gate --candidate latest --baseline tag:prod --rules examples/gate-rules.yaml --junit gate.xml"


def test_default_rules_when_no_rules_file_is_named(fake):
    _, _, _, calls = fake(1, EVALKIT_RULES="")
    assert [c for c in calls if c.startswith("gate")] == ["gate --candidate latest --baseline tag:prod --junit gate.xml"]


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
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "evalkit"
    exe.write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" -m evalkit "$@"\n')
    exe.chmod(0o755)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {"EVALKIT_DB": str(db), "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    before = db.read_bytes()

    res, out, _ = run_script(tmp_path, env, bin_dir)
    assert res.returncode == 1 and out == [], res.stderr
    assert res.stderr.startswith("ci-gate: error: no run is tagged prod") and len(res.stderr.splitlines()) == 1
    assert db.read_bytes() == before  # the step only reads

    res, out, _ = run_script(tmp_path, {**env, "FIRST_BASELINE": "true"}, bin_dir)
    assert res.returncode == 0 and out == ["promote=true"], res.stderr
    promoted = subprocess.run([str(exe), "promote", "latest", "--tag", "prod"], env={**os.environ, **env},
                              capture_output=True, text=True)
    assert promoted.returncode == 0, promoted.stderr

    res, out, _ = run_script(tmp_path, env, bin_dir)  # the candidate is the baseline: passes by identity
    assert res.returncode == 0 and out == ["promote=true"], res.stdout + res.stderr
    assert "PASS" in res.stdout and (tmp_path / "gate.xml").is_file()
