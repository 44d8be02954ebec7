"""Reliability, signals: SIGINT / SIGTERM / SIGHUP mid-run leave a valid DB, the run `interrupted`, no partial metrics.

A real `evalkit run` process (tests.fake_cli, the fake LM slowed by
EVALKIT_FAKE_DELAY) is signalled once its run row reads 'running'. Exit codes
(evalkit.runner.execute's handler: mark the run, one line, os._exit): SIGINT → 130
("evalkit: error: interrupted"); SIGTERM → 143 and SIGHUP → 129 ("evalkit: terminated").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest

from tests import children

ROOT = Path(__file__).resolve().parents[1]


def evalkit_process(args: list[str], db: Path, delay: float = 0.0, env_extra: dict | None = None,
                    **popen) -> subprocess.Popen:
    """Start `evalkit ARGS --db DB` (fake LM registered) as a child with its own SIGINT handling."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EVALKIT_DB": str(db), "HF_HUB_OFFLINE": "1", **(env_extra or {})}
    if delay:
        env["EVALKIT_FAKE_DELAY"] = str(delay)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.fake_cli", *args, "--db", str(db)],
        cwd=ROOT, env=env, text=True,
        # its own SIGINT handling (a shell's background job ignores SIGINT, and children inherit
        # that), and it dies with the test run (tests/children.py)
        preexec_fn=children.preexec(),
        **popen,
    )


def read_status(db: Path, run_id: str, timeout: float = 30.0) -> str | None:
    """The run's status, read-only, retrying while a writer holds the file lock."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            con = duckdb.connect(str(db), read_only=True)
        except duckdb.Error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        try:
            row = con.execute("SELECT status FROM runs WHERE id = ?", [run_id]).fetchone()
            return row[0] if row else None
        finally:
            con.close()


class StderrLines:
    """Collect a child's stderr lines in a thread; wait for one that starts a run."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.started = threading.Event()
        self.run_id: str | None = None
        threading.Thread(target=self._read, args=(proc.stderr,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("run ") and line.rstrip().endswith(" started"):
                self.run_id = line.split()[1]
                self.started.set()

    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.mark.parametrize("sig, code, last_line", [
    (signal.SIGINT, 130, "evalkit: error: interrupted"),
    (signal.SIGTERM, 143, "evalkit: terminated"),
    (signal.SIGHUP, 129, "evalkit: terminated"),
], ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_signal_mid_run_marks_the_run_interrupted(sig, code, last_line, tmp_path):
    from evalkit.runner.execute import RunConfig, execute

    db = tmp_path / "evalkit.duckdb"
    proc = evalkit_process(
        ["run", "--model", "evalkit-fake", "--model-args", "mode=hit", "--tasks", "firsttoken", "--limit", "20"],
        db, delay=0.5, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    err = StderrLines(proc)
    try:
        assert err.started.wait(60), f"the run never started:\n{err.text()}"
        assert read_status(db, err.run_id) == "running"
        time.sleep(1.0)  # into lm-eval's evaluation (40 requests × 0.5 s)
        assert proc.poll() is None, f"the run ended before the signal:\n{err.text()}"
        proc.send_signal(sig)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.1)  # let the reader thread drain
    stderr = err.text()
    assert rc == code, f"exit {rc}, expected {code}:\n{stderr}"
    assert "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == last_line, stderr

    con = duckdb.connect(str(db), read_only=True)  # the DB is valid and opens
    try:
        status, finished, error = con.execute(
            "SELECT status, finished_at, error FROM runs WHERE id = ?", [err.run_id]
        ).fetchone()
        counts = [con.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?", [err.run_id]).fetchone()[0]
                  for t in ("metrics", "samples", "first_token_topk")]
        assert con.execute("SELECT count(*) FROM leaderboard WHERE run_id = ?", [err.run_id]).fetchone()[0] == 0
    finally:
        con.close()
    assert status == "interrupted", (status, error)
    assert finished is not None
    assert counts == [0, 0, 0], "partial results were stored for an interrupted run"

    result = execute(RunConfig(tasks=["firsttoken"], model="evalkit-fake", model_args="mode=hit", limit=2, db=str(db)))
    assert result.status == "done"
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT status, count(*) FROM runs GROUP BY status ORDER BY status").fetchall() == [
            ("done", 1), ("interrupted", 1),
        ]
        assert con.execute("SELECT count(*) FROM metrics WHERE run_id = ?", [result.run_id]).fetchone()[0] > 0
    finally:
        con.close()
