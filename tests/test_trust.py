"""Reliability, trust: no finished run is lost, a dead run does not stay `running`, readers never write.

- A run that finishes while another process holds the DB past the lock timeout keeps its
  results in a spool file and lands, complete, on the next write or `evalkit ingest`.
- A run that cannot write its results for another reason (a full disk) is kept the same way.
- A run killed with SIGKILL is shown `abandoned` by readers (without writing) and recorded so
  by the next writer.
- Every read-only command leaves an empty DuckDB file, an older evalkit's DB and another
  program's DuckDB file byte-identical, with one line and exit 2.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from tests.test_bad_input import _special_dbs
from tests.test_interrupts import StderrLines, evalkit_process, read_status

ROOT = Path(__file__).resolve().parents[1]
FAKE_RUN = ["run", "--model", "evalkit-fake", "--model-args", "mode=hit", "--tasks", "firsttoken"]


def rows(db: Path, sql: str, *params):
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- no finished run is lost ------------------------------------------------------------------------


def test_a_run_that_finishes_behind_a_long_reader_is_kept_and_lands_after(invoke, tmp_path):
    """Timeline: the run starts; another process opens the DB read-only and holds it; the run finishes
    its 10 requests, waits 1 s (EVALKIT_LOCK_TIMEOUT) for the lock, keeps its results in the spool and
    exits 1 saying where; the reader lets go; readers show the run `kept`; `evalkit ingest` brings it
    in complete."""
    db = tmp_path / "evalkit.duckdb"
    assert invoke(*FAKE_RUN, "--limit", "1", "--db", db).exit_code == 0  # an existing DB with one run
    t0 = time.monotonic()
    timeline = []

    def mark(what):
        timeline.append(f"{time.monotonic() - t0:5.1f} s  {what}")

    proc = evalkit_process([*FAKE_RUN, "--limit", "5"], db, delay=0.3, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env_extra={"EVALKIT_LOCK_TIMEOUT": "1"})
    err = StderrLines(proc)
    reader = None
    try:
        assert err.started.wait(60), err.text()
        mark(f"run {err.run_id} started (row 'running')")
        reader = subprocess.Popen(
            [sys.executable, "-c", "import duckdb, sys, time\n"
             "con = duckdb.connect(sys.argv[1], read_only=True)\nprint('held', flush=True)\n"
             "sys.stdin.read()\ncon.close()\n", str(db)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert reader.stdout.readline().strip() == "held"
        mark("a reader holds the DB (read-only) until told to let go")
        rc = proc.wait(120)
        mark(f"the run exited {rc}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if reader is not None:
            reader.stdin.close()
    time.sleep(0.1)
    message = err.lines[-1]
    assert rc == 1, err.text()
    assert f"run {err.run_id} finished" in message and "evalkit ingest" in message, message
    kept = Path(re.search(r"kept in (\S+) and", message).group(1))
    assert kept.is_file() and kept.parent == Path(str(db) + ".spool")
    reader.wait(30)
    mark("the reader let go")
    assert rows(db, "SELECT status FROM runs WHERE id = ?", err.run_id) == [("running",)]
    listed = invoke("runs", "--db", db)
    assert re.search(rf"^{err.run_id}\s+\S+ \S+\s+kept\b", listed.stdout, re.M), listed.output
    assert "wait in" in listed.stderr
    mark("`evalkit runs` shows it `kept` and says where it waits")

    out = invoke("ingest", "--db", db)
    assert out.exit_code == 0 and err.run_id in out.stdout, out.output
    mark(f"`evalkit ingest`: {out.stdout.strip()}")
    assert not kept.exists()
    status, n_samples = rows(db, "SELECT status, (SELECT count(*) FROM samples WHERE run_id = r.id) FROM runs r "
                                 "WHERE id = ?", err.run_id)[0]
    assert (status, n_samples) == ("done", 10)
    assert rows(db, "SELECT count(*) FROM metrics WHERE run_id = ?", err.run_id)[0][0] > 0
    mark("the run is done with its 10 samples and its metrics")
    print("\n".join(timeline))


def test_kept_runs_come_in_with_the_next_write(invoke, tmp_path, monkeypatch):
    """A full disk (simulated: the final write raises DuckDB's IO error) keeps the results; the next
    run's first write brings the kept run in."""
    import evalkit.store.runs as runs

    db = tmp_path / "evalkit.duckdb"
    real = runs.finish_run

    def full_disk(*args, **kwargs):
        raise duckdb.IOException("Could not write file: No space left on device")

    monkeypatch.setattr(runs, "finish_run", full_disk)
    res = invoke(*FAKE_RUN, "--limit", "2", "--db", db)
    assert res.exit_code == 1 and "No space left on device" in res.stderr and "evalkit ingest" in res.stderr
    kept_id = re.search(r"run (\S+) finished", res.stderr).group(1)
    assert rows(db, "SELECT status FROM runs WHERE id = ?", kept_id) == [("running",)]
    monkeypatch.setattr(runs, "finish_run", real)
    assert invoke(*FAKE_RUN, "--limit", "1", "--db", db).exit_code == 0
    assert rows(db, "SELECT status, count(*) FROM runs GROUP BY ALL ORDER BY ALL") == [("done", 2)]
    assert rows(db, "SELECT count(*) FROM samples WHERE run_id = ?", kept_id) == [(4,)]
    assert not list(Path(str(db) + ".spool").glob("*.duckdb"))


# ---- a dead run does not stay `running` -----------------------------------------------------------


def test_a_killed_run_is_shown_abandoned_and_recorded_by_the_next_writer(invoke, tmp_path):
    db = tmp_path / "evalkit.duckdb"
    proc = evalkit_process([*FAKE_RUN, "--limit", "20"], db, delay=0.5, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    err = StderrLines(proc)
    try:
        assert err.started.wait(60), err.text()
        pid, host = rows(db, "SELECT pid, host FROM runs WHERE id = ?", err.run_id)[0]
        assert pid == proc.pid and host
        assert read_status(db, err.run_id) == "running"
        listed = invoke("runs", "--db", db)
        assert re.search(rf"^{err.run_id}\s+\S+ \S+\s+running\b", listed.stdout, re.M), listed.output
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    before = digest(tmp_path)
    listed = invoke("runs", "--db", db)
    assert re.search(rf"^{err.run_id}\s+\S+ \S+\s+abandoned\b", listed.stdout, re.M), listed.output
    assert "abandoned" in invoke("show", err.run_id, "--db", db).stdout
    assert digest(tmp_path) == before  # readers only show it
    assert read_status(db, err.run_id) == "running"
    assert invoke(*FAKE_RUN, "--limit", "1", "--db", db).exit_code == 0  # the next writer records it
    assert read_status(db, err.run_id) == "abandoned"


def test_liveness_rules():
    import datetime as dt
    import platform

    from evalkit.store.rows import STALE_AFTER, is_abandoned, process_start

    now = dt.datetime(2026, 12, 2, 12, 0)
    me, start = os.getpid(), process_start(os.getpid())
    assert not is_abandoned("running", platform.node(), me, start, now, now)  # this process lives
    assert is_abandoned("running", platform.node(), me, "1", now, now)  # the pid now runs another program
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert is_abandoned("running", platform.node(), child.pid, None, now, now)  # the process is gone
    assert not is_abandoned("done", platform.node(), child.pid, None, now, now)
    # on another host only the heartbeat tells
    assert not is_abandoned("running", "elsewhere", 1, None, now - STALE_AFTER / 2, now)
    assert is_abandoned("running", "elsewhere", 1, None, now - 2 * STALE_AFTER, now)
    assert not is_abandoned("running", "elsewhere", None, None, None, now)  # a row from before evalkit kept pids


def test_heartbeat_refreshes_the_row(tmp_path, monkeypatch):
    from evalkit.runner.liveness import Heartbeat
    from evalkit.store import runs
    from evalkit.store.db import now
    from evalkit.store.rows import this_process

    db = tmp_path / "evalkit.duckdb"
    runs.insert_run(db, {"id": "r1", "created_at": now(), "status": "running", "model": "m", **this_process()})
    first = rows(db, "SELECT heartbeat_at FROM runs")[0][0]
    monkeypatch.setenv("EVALKIT_HEARTBEAT_S", "0.2")
    beat = Heartbeat(db, "r1").start()
    time.sleep(1.0)
    beat.stop()
    assert rows(db, "SELECT heartbeat_at FROM runs")[0][0] > first


# ---- read-only commands never write ---------------------------------------------------------------

READERS = {
    "runs": ["runs"],
    "show": ["show", "latest"],
    "query": ["query", "SELECT count(*) FROM runs"],
    "compare": ["compare", "latest", "latest"],
    "report": ["report", "--out", "{out}"],
    "gate": ["gate", "--candidate", "latest", "--baseline", "latest"],
    "export": ["export", "--parquet", "{out}"],
    "needle-heatmap": ["needle-heatmap", "latest", "--out", "{out}"],
}
WANT = {"duckdb_empty": "empty DuckDB file", "older_db": "evalkit migrate", "foreign_db": "another program"}


@pytest.mark.parametrize("kind", list(WANT))
def test_read_only_commands_leave_other_files_alone(invoke, kind, tmp_path):
    dbs = _special_dbs(tmp_path)
    before = digest(tmp_path)
    seen = []
    for command, args in READERS.items():
        res = invoke(*[a.format(out=tmp_path / "out") for a in args], "--db", dbs[kind])
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and WANT[kind] in lines[0], (command, res.output)
        assert digest(tmp_path) == before, f"{command} changed a file"
        seen.append(f"{command:<15} exit {res.exit_code}: {lines[0]}")
    print(f"\n{kind}:\n" + "\n".join(seen))


def test_migrate_upgrades_an_older_db_that_readers_refuse(invoke, tmp_path):
    older = Path(_special_dbs(tmp_path)["older_db"])
    assert "evalkit migrate" in invoke("runs", "--db", older).stderr
    res = invoke("migrate", "--db", older)
    assert res.exit_code == 0 and "m009_run_liveness" in res.stdout, res.output
    listed = invoke("runs", "--db", older)
    assert listed.exit_code == 0 and "r-old" in listed.stdout
    assert "already up to date" in invoke("migrate", "--db", older).stdout
