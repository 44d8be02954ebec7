"""The test suite's children end with it: stopping pytest (Ctrl-C, or a kill of pytest alone)
leaves no `python -m tests.fake_cli run` running (tests/children.py, conftest's finalizer)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import children

ROOT = Path(__file__).resolve().parents[1]
PIDFILE = "EVALKIT_TEST_CHILD_PIDFILE"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.environ.get(PIDFILE), reason="run by test_stopping_pytest_ends_its_children only")
def test_a_child_that_would_outlive_its_test(tmp_path):
    """Starts a slow `evalkit run` child the way the suite does, says its pid, and waits."""
    from tests.test_interrupts import evalkit_process

    proc = evalkit_process(["run", "--model", "evalkit-fake", "--model-args", "mode=hit", "--tasks", "firsttoken",
                            "--limit", "200"], tmp_path / "slow.duckdb", delay=5.0,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    Path(os.environ[PIDFILE]).write_text(str(proc.pid), encoding="utf-8")
    time.sleep(600)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_stopping_pytest_ends_its_children(tmp_path, sig):
    """SIGINT (what Ctrl-C sends) or SIGKILL to the pytest process alone, not to its process group,
    so the child gets no signal of its own: it must still end, by the session's finalizer (SIGINT)
    or the kernel's parent-death signal (SIGKILL, where no finalizer runs)."""
    pidfile = tmp_path / "child.pid"
    env = {**os.environ, PIDFILE: str(pidfile), "PYTHONPATH": str(ROOT)}
    outer = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "tests/test_children.py::test_a_child_that_would_outlive_its_test"],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, preexec_fn=children.preexec())
    try:
        deadline = time.monotonic() + 120
        while not pidfile.exists() or not pidfile.read_text():
            assert outer.poll() is None and time.monotonic() < deadline, outer.communicate()[0]
            time.sleep(0.2)
        child = int(pidfile.read_text())
        assert alive(child)
        time.sleep(1.0)
        outer.send_signal(sig)
        out, _ = outer.communicate(timeout=60)
        deadline = time.monotonic() + 20
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(child), f"the child {child} outlived pytest:\n{out}"
    finally:
        if outer.poll() is None:
            outer.kill()
