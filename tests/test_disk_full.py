"""Reliability, a full disk: every command that writes says so in one line and loses nothing.

On a real full file system where the test may mount one (a 6 MB tmpfs; root on Linux),
else skipped with the reason. A seeded DB is copied in, then the rest of the space is
filled. Writers (promote, run's start) refuse with exit 2 and one line naming the
DB, leaving it as it was; a run whose disk fills while it runs keeps its finished results
in the DB's own fallback folder (exit 1, one line saying where); outputs (export, report,
--junit) refuse with one line naming the output.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from evalkit.store import spool
from tests.test_interrupts import StderrLines, evalkit_process

ROOT = Path(__file__).resolve().parents[1]


def fake(args, db, **env):
    run_env = {**os.environ, "PYTHONPATH": str(ROOT), "EVALKIT_DB": str(db), "HF_HUB_OFFLINE": "1", **env}
    return subprocess.run([sys.executable, "-m", "tests.fake_cli", *args], cwd=ROOT, env=run_env,
                          capture_output=True, text=True, timeout=300)


def one_line(proc, code: int, fragment: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr
    assert lines and fragment in lines[-1], proc.stderr
    assert len([ln for ln in lines if ln.startswith("evalkit:")]) == 1, proc.stderr
    return lines[-1]


def fill(folder: Path) -> None:
    with open(folder / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * (1 << 16))
                fh.flush()
        except OSError:
            pass


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6M", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.fixture
def seeded(tmp_path):
    db = tmp_path / "seed.duckdb"
    proc = fake(["run", "--model", "evalkit-fake", "--tasks", "firsttoken_en", "--limit", "2"], db)
    assert proc.returncode == 0, proc.stderr
    return db


def snapshot(path: Path) -> bytes:
    return path.read_bytes()


def test_writers_on_a_full_disk_say_so_in_one_line_and_change_nothing(small_fs, seeded, tmp_path):
    db = small_fs / "evalkit.duckdb"
    shutil.copy(seeded, db)
    fill(small_fs)
    before = snapshot(db)
    for args in (["promote", "latest", "--tag", "prod"],
                 ["run", "--model", "evalkit-fake", "--tasks", "firsttoken_en", "--limit", "2"]):
        one_line(fake(args, db), 2, f"cannot write the DB {db}: No space left on device")
        assert snapshot(db) == before, args
    for args, fragment in ((["export", "--parquet", str(small_fs / "export")], "No space left on device"),
                           (["report", "--out", str(small_fs / "report")], "No space left on device"),
                           (["gate", "--candidate", "latest", "--baseline", "latest", "--junit",
                             str(small_fs / "gate.xml")], f"cannot write --junit {small_fs / 'gate.xml'}")):
        one_line(fake(args, db), 2, fragment)
    assert not (small_fs / "export").exists() and not (small_fs / "gate.xml").exists()
    (small_fs / "filler").unlink()
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM tags").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 1
    con.close()


def test_a_disk_that_fills_during_a_run_keeps_the_run_in_the_dbs_fallback_folder(small_fs, seeded, tmp_path):
    db = small_fs / "evalkit.duckdb"
    shutil.copy(seeded, db)
    proc = evalkit_process(["run", "--model", "evalkit-fake", "--tasks", "firsttoken_en", "--limit", "4"], db,
                           delay=0.5, env_extra={"TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    lines = StderrLines(proc)
    assert lines.started.wait(120), lines.text()
    fill(small_fs)
    assert proc.wait(120) == 1, lines.text()
    time.sleep(0.2)
    last = [ln for ln in lines.lines if ln.startswith("evalkit:")]
    assert len(last) == 1 and "No space left on device" in last[0] and "they are kept in" in last[0], lines.text()
    kept = Path(last[0].split("they are kept in ")[1].split(" and come in")[0])
    assert kept.is_file() and kept.parent.parent.parent == Path(tmp_path)  # <tmp>/evalkit-spool-UID/DB_UUID/
    (small_fs / "filler").unlink()
    assert fake(["ingest"], db, TMPDIR=str(tmp_path)).returncode == 0
    con = duckdb.connect(str(db), read_only=True)
    status = con.execute("SELECT status FROM runs WHERE id = ?", [lines.run_id]).fetchone()[0]
    n = con.execute("SELECT count(*) FROM samples WHERE run_id = ?", [lines.run_id]).fetchone()[0]
    con.close()
    assert (status, n) == ("done", 4)
    assert not kept.exists() and not spool.pending_ids(db)
