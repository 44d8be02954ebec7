"""Threads on a shared CPU: evalkit makes torch's OpenMP threads wait passively when the machine is
already busy as a model loads (measured 3.4x faster on 2 cores at load 9: bench/shared_cpu.py), and
leaves a policy the user chose, and a process whose torch is loaded, alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from evalkit import threads

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_torch(monkeypatch):
    """This process as if torch were not loaded yet, and no wait policy set."""
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)


def test_a_busy_machine_gets_passive_threads_and_a_note(no_torch, monkeypatch, capsys):
    monkeypatch.setattr(os, "getloadavg", lambda: (9.2, 8.0, 6.0))
    line = threads.settle_wait_policy()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert line == ("evalkit: note: load average 9.2 on 2 usable cores: compute threads wait passively "
                    "(OMP_WAIT_POLICY=PASSIVE; set OMP_WAIT_POLICY to choose)")
    assert capsys.readouterr().err == ""  # silent until the model loads: an option's error stays one line
    threads.announce()
    threads.announce()
    assert capsys.readouterr().err == line + "\n"  # once


@pytest.mark.parametrize("load", [0.0, 1.99])
def test_an_idle_machine_keeps_the_default(no_torch, monkeypatch, capsys, load):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    assert threads.settle_wait_policy() is None
    threads.announce()
    assert "OMP_WAIT_POLICY" not in os.environ and capsys.readouterr().err == ""


@pytest.mark.parametrize("chosen", ["ACTIVE", "passive", "active "])
def test_a_policy_the_user_set_is_theirs(no_torch, monkeypatch, chosen):
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setenv("OMP_WAIT_POLICY", chosen)
    assert threads.settle_wait_policy() is None and os.environ["OMP_WAIT_POLICY"] == chosen


def test_nothing_is_set_once_torch_is_loaded(monkeypatch):
    """libgomp read the environment when torch loaded: setting it now would claim what did not happen."""
    import torch  # noqa: F401

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    assert threads.settle_wait_policy() is None and "OMP_WAIT_POLICY" not in os.environ


def test_no_load_average_keeps_the_default(no_torch, monkeypatch):
    def unavailable():
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", unavailable)
    assert threads.settle_wait_policy() is None and "OMP_WAIT_POLICY" not in os.environ


def test_a_run_on_a_busy_machine_sets_it_before_torch_loads(tiny_model_dir, tmp_path):
    """A real `evalkit run` whose machine reads as busy: the note comes before the model loads, and torch,
    once loaded, runs in a process whose OMP_WAIT_POLICY is PASSIVE."""
    code = (
        "import os, sys, atexit\n"
        "os.getloadavg = lambda: (9.0, 9.0, 9.0)\n"
        "atexit.register(lambda: print('policy at exit:', os.environ.get('OMP_WAIT_POLICY'), "
        "'torch' in sys.modules, file=sys.stderr))\n"
        "from evalkit.cli import main\n"
        f"sys.argv = ['evalkit', 'run', '--model', 'hf', '--model-args', 'pretrained={tiny_model_dir}', "
        f"'--device', 'cpu', '--tasks', 'firsttoken_en', '--limit', '1', '--db', '{tmp_path / 'e.duckdb'}']\n"
        "main()\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stderr.splitlines()
    note = next(i for i, ln in enumerate(lines) if ln.startswith("evalkit: note: load average 9.0 on"))
    loading = next(i for i, ln in enumerate(lines) if ln.startswith("loading "))
    assert note < loading and lines[-1] == "policy at exit: PASSIVE True"
    assert sum(ln.startswith("evalkit: note: load average") for ln in lines) == 1


def test_an_options_error_on_a_busy_machine_stays_one_line(tmp_path):
    code = ("import os, sys\nos.getloadavg = lambda: (9.0, 9.0, 9.0)\nfrom evalkit.cli import main\n"
            f"sys.argv = ['evalkit', 'run', '--tasks', 'nope_no_such_task', '--db', '{tmp_path / 'e.duckdb'}']\n"
            "main()\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
