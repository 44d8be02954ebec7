"""The shared temp folder and copies of one DB (issue 36, classes 4 and 5).

The fallback spool folder `$TMPDIR/evalkit-spool-<uid>/<db_uuid>/` sits in a folder everyone
can write: both levels are created 0700 and checked before every use (a real folder, not a
link, this user's, closed to others); a folder that fails is never written or read. A copy
of a DB file shares its uuid and key: the writer's upkeep of a copy takes nothing from the
original's folder, and the copy's first write gives it an identity of its own.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

import duckdb
import pytest

from evalkit.store import spool

FAKE_RUN = ["run", "--model", "evalkit-fake", "--model-args", "mode=hit", "--tasks", "firsttoken", "--limit", "2"]


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    folder = tmp_path / "systmp"
    folder.mkdir(mode=0o1777)
    os.chmod(folder, 0o1777)  # like /tmp
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def identity_of(db: Path) -> spool.Identity:
    con = duckdb.connect(str(db), read_only=True)
    try:
        ident = spool.identity(con)
        assert ident is not None
        return ident
    finally:
        con.close()


def keep_in_fallback(invoke, db: Path, monkeypatch) -> tuple[str, Path]:
    """A finished run whose final write fails while `<db>.spool` is blocked: kept in the fallback folder."""
    import evalkit.store.runs as runs

    spool.spool_dir(db).write_text("a file in the way")
    real = runs.finish_run
    monkeypatch.setattr(runs, "finish_run",
                        lambda *a, **k: (_ for _ in ()).throw(duckdb.IOException("No space left on device")))
    res = invoke(*FAKE_RUN, "--db", db)
    monkeypatch.setattr(runs, "finish_run", real)
    assert res.exit_code == 1, res.output
    kept = Path(re.search(r"kept in (\S+) and", res.stderr).group(1))
    spool.spool_dir(db).unlink()
    return kept.name[: -len(spool.SUFFIX)], kept


def status(db: Path, run_id: str):
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute("SELECT status, (SELECT count(*) FROM metrics WHERE run_id = ?) FROM runs WHERE id = ?",
                           [run_id, run_id]).fetchall()
    finally:
        con.close()


# ----------------------------------------------------------------------- class 4: the shared folder


def test_the_fallback_folders_are_made_private(invoke, fake_run, tmp_path, private_tmp, monkeypatch):
    db = tmp_path / "y.duckdb"
    fake_run(db)
    run_id, kept = keep_in_fallback(invoke, db, monkeypatch)
    ident = identity_of(db)
    leaf = spool.fallback_dir(ident)
    assert kept.parent == leaf
    for level in (leaf.parent, leaf):
        st = os.lstat(level)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()


def _plant(level: Path, how: str) -> None:
    if how == "link":
        real = level.parent / "elsewhere"
        real.mkdir(mode=0o700)
        level.symlink_to(real)
    elif how == "open-mode":
        level.mkdir()
        os.chmod(level, 0o777)
    elif how == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("chown needs root")
        level.mkdir(mode=0o700)
        os.chown(level, 12345, 12345)


@pytest.mark.parametrize("level", ["base", "uuid"])
@pytest.mark.parametrize("how", ["link", "open-mode", "other-owner"])
def test_a_fallback_folder_that_fails_the_check_is_never_used(invoke, fake_run, tmp_path, private_tmp, monkeypatch,
                                                              caplog, level, how):
    db = tmp_path / "y.duckdb"
    fake_run(db)
    ident = identity_of(db)
    leaf = spool.fallback_dir(ident)
    if level == "uuid":
        leaf.parent.mkdir(mode=0o700)
    _plant(leaf if level == "uuid" else leaf.parent, how)
    before = sorted(str(p) for p in private_tmp.rglob("*"))
    spool.spool_dir(db).write_text("a file in the way")
    import evalkit.store.runs as runs

    monkeypatch.setattr(runs, "finish_run",
                        lambda *a, **k: (_ for _ in ()).throw(duckdb.IOException("No space left on device")))
    res = invoke(*FAKE_RUN, "--db", db)
    assert res.exit_code == 1 and "kept in" not in res.stderr, res.output  # nowhere to keep it: the run failed
    assert sorted(str(p) for p in private_tmp.rglob("*")) == before  # nothing written through it
    # a folder that fails is not read either: a signed file planted there stays out
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        assert spool.pending_files(db, ident) == []
    if level == "uuid" and how != "other-owner":
        assert "the spool folder" in caplog.text


# ----------------------------------------------------------------------- class 5: copies of one DB


def test_a_copy_never_takes_the_originals_kept_run(invoke, fake_run, tmp_path, private_tmp, monkeypatch, caplog):
    y = tmp_path / "y.duckdb"
    prod = fake_run(y)
    run_id, kept = keep_in_fallback(invoke, y, monkeypatch)
    a2 = tmp_path / "a2.duckdb"
    shutil.copy(y, a2)
    copy_bytes = a2.read_bytes()
    assert invoke("runs", "--db", a2).exit_code == 0 and a2.read_bytes() == copy_bytes  # a reader writes nothing
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        res = invoke("promote", prod, "--tag", "prod", "--db", a2)  # the writer's upkeep of the copy
    assert res.exit_code == 0, res.output
    assert kept.is_file(), "the copy took the original's kept run"
    assert status(a2, run_id)[0][1] == 0
    # the copy's first run gives it its own identity; the original keeps its own
    with caplog.at_level(logging.INFO, logger="evalkit"):
        assert invoke(*FAKE_RUN, "--db", a2).exit_code == 0
    assert "is a copy of another evalkit DB" in caplog.text
    assert identity_of(a2) != identity_of(y)
    assert invoke("ingest", kept, "--db", a2).exit_code == 2 and kept.is_file()
    # the original brings its run in
    res = invoke("ingest", "--db", y)
    assert res.exit_code == 0 and run_id in res.stdout, res.output
    assert status(y, run_id) == [("done", status(y, run_id)[0][1])] and status(y, run_id)[0][1] > 0


def test_ingest_of_a_copy_rekeys_it_first(invoke, fake_run, tmp_path, private_tmp, monkeypatch):
    y = tmp_path / "y.duckdb"
    fake_run(y)
    run_id, kept = keep_in_fallback(invoke, y, monkeypatch)
    a2 = tmp_path / "a2.duckdb"
    shutil.copy(y, a2)
    res = invoke("ingest", "--db", a2)
    assert res.exit_code == 0 and "ingested 0 run(s)" in res.stdout, res.output
    assert kept.is_file() and identity_of(a2).db_uuid != identity_of(y).db_uuid


def test_a_renamed_db_keeps_its_identity(invoke, fake_run, tmp_path, private_tmp, monkeypatch):
    y = tmp_path / "y.duckdb"
    fake_run(y)
    fake_run(y)  # file id recorded by the first run's write
    ident = identity_of(y)
    moved = tmp_path / "moved.duckdb"
    os.rename(y, moved)
    fake_run(moved)
    assert identity_of(moved) == ident


def test_a_copy_does_not_resume_from_the_originals_journal(invoke, fake_run, tmp_path):
    y = tmp_path / "y.duckdb"
    run_id = fake_run(y)
    fake_run(y)
    con = duckdb.connect(str(y))
    con.execute("UPDATE runs SET status = 'interrupted' WHERE id = ?", [run_id])
    con.close()
    a2 = tmp_path / "a2.duckdb"
    shutil.copy(y, a2)
    res = invoke("run", "--resume", run_id, "--db", a2)
    assert res.exit_code == 2 and "is a copy of another evalkit DB file" in res.stderr, res.output


# ----------------------------------------------------------------------- class 4: the key and `query`


@pytest.mark.parametrize("sql", ["SELECT * FROM evalkit_meta", "SELECT value FROM main.evalkit_meta",
                                 "SELECT * FROM evalkit_meta WHERE key = 'spool_key'"])
def test_query_does_not_print_the_signing_key(invoke, fake_run, tmp_path, sql):
    db = tmp_path / "y.duckdb"
    fake_run(db)
    key = identity_of(db).key
    before = db.read_bytes()
    res = invoke("query", sql, "--db", db, "--format", "csv")
    assert res.exit_code == 0, res.output
    assert key not in res.stdout and "spool_key" not in res.stdout
    assert db.read_bytes() == before
    if sql == "SELECT * FROM evalkit_meta":
        assert "db_uuid" in res.stdout and "application_id" in res.stdout  # the rest stays readable
