"""Kept runs are bound to their DB: nothing planted in a spool folder is brought in, another DB's
kept run stays where it is, and `evalkit ingest` never deletes a file it did not write.

A run whose results cannot be written (a full disk, simulated) is kept in `<db>.spool/` with a
signed manifest; these tests plant, truncate, change and misplace such files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import tempfile
from pathlib import Path

import duckdb
import pytest

from evalkit.store import spool
from tests.test_trust import rows

FAKE_RUN = ["run", "--model", "evalkit-fake", "--model-args", "mode=hit", "--tasks", "firsttoken"]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The fallback folders go under this test's own temporary folder."""
    folder = tmp_path / "systmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture
def kept_run(invoke, monkeypatch):
    """`kept_run(db)`: a run whose final write fails (a full disk): its results are kept; (run id, file)."""
    import evalkit.store.runs as runs

    def run(db: Path) -> tuple[str, Path]:
        real = runs.finish_run

        def full_disk(*args, **kwargs):
            raise duckdb.IOException("Could not write file: No space left on device")

        monkeypatch.setattr(runs, "finish_run", full_disk)
        res = invoke(*FAKE_RUN, "--limit", "2", "--db", db)
        monkeypatch.setattr(runs, "finish_run", real)
        assert res.exit_code == 1, res.output
        run_id = re.search(r"run (\S+) finished", res.stderr).group(1)
        kept = Path(re.search(r"kept in (\S+) and", res.stderr).group(1))
        assert kept.is_file() and spool.manifest_of(kept).is_file()
        return run_id, kept

    return run


def test_a_planted_db_file_never_replaces_the_prod_run(invoke, fake_run, tmp_path, private_tmp, caplog):
    db = tmp_path / "evalkit.duckdb"
    prod = fake_run(db)
    assert invoke("promote", prod, "--tag", "prod").exit_code == 0
    before = rows(db, "SELECT model, status FROM runs WHERE id = ?", prod), \
        rows(db, "SELECT count(*), sum(value) FROM metrics WHERE run_id = ?", prod)

    # a colleague's DB, its run renamed to the prod run's id and its metrics inflated
    other = tmp_path / "other.duckdb"
    forged = fake_run(other)
    con = duckdb.connect(str(other))
    for table, key in (("runs", "id"), ("metrics", "run_id"), ("samples", "run_id"),
                       ("first_token_topk", "run_id"), ("lead_indicators", "run_id")):
        con.execute(f"UPDATE {table} SET {key} = ? WHERE {key} = ?", [prod, forged])
    con.execute("UPDATE runs SET model = 'forged', status = 'running'")
    con.execute("UPDATE metrics SET value = 1.0")
    con.close()
    folder = spool.spool_dir(db)
    folder.mkdir()
    shutil.copy(other, folder / f"{prod}.duckdb")  # no manifest
    shutil.copy(other, folder / "second.duckdb")
    (folder / "second.duckdb.spool.json").write_text(json.dumps(  # a manifest with a made-up signature
        {"format": 1, "db_uuid": "0" * 32, "run_id": "second", "sha256": sha(other), "signature": "ab" * 32}))

    with caplog.at_level(logging.WARNING, logger="evalkit"):
        fake_run(db)  # any writer looks at the spool folder
    after = rows(db, "SELECT model, status FROM runs WHERE id = ?", prod), \
        rows(db, "SELECT count(*), sum(value) FROM metrics WHERE run_id = ?", prod)
    assert after == before
    assert sorted(p.name for p in folder.iterdir()) == [f"{prod}.duckdb.bad", "second.duckdb.bad",
                                                         "second.duckdb.spool.json.bad"]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "has no manifest" in said and "was kept for another DB" in said and "set aside" in said


def test_a_truncated_or_empty_kept_file_is_set_aside_and_writers_go_on(fake_run, kept_run, tmp_path, private_tmp, monkeypatch, caplog):
    db = tmp_path / "evalkit.duckdb"
    run_id, kept = kept_run(db)
    data = kept.read_bytes()
    kept.write_bytes(data[: len(data) // 2])  # truncated
    (kept.parent / "empty.duckdb").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        fake_run(db)
        fake_run(db)
    assert rows(db, "SELECT status FROM runs WHERE id = ?", run_id) != [("done",)]
    assert rows(db, "SELECT count(*) FROM runs WHERE status = 'done'") == [(2,)]
    assert (kept.parent / f"{kept.name}.bad").is_file() and (kept.parent / "empty.duckdb.bad").is_file()
    assert "changed after it was kept" in " ".join(r.getMessage() for r in caplog.records)


def test_a_kept_run_comes_in_only_to_its_own_db(invoke, fake_run, kept_run, tmp_path, private_tmp, monkeypatch):
    """Two projects' DBs share a file name; the spool folder of the first cannot be made, so its kept run
    waits in the per-user folder named by its DB's uuid. The other DB's writers leave it there."""
    a, b = tmp_path / "a" / "evalkit.duckdb", tmp_path / "b" / "evalkit.duckdb"
    a.parent.mkdir()
    b.parent.mkdir()
    fake_run(a)
    fake_run(b)
    spool.spool_dir(a).write_text("a file in the way\n")
    run_id, kept = kept_run(a)
    assert kept.parent.parent.parent == private_tmp and kept.parent.name != "evalkit.duckdb"
    fake_run(b)
    assert invoke("ingest", "--db", b).exit_code == 0
    assert kept.is_file() and rows(b, "SELECT count(*) FROM runs WHERE id = ?", run_id) == [(0,)]
    assert rows(a, "SELECT status FROM runs WHERE id = ?", run_id) == [("running",)]
    res = invoke("ingest", "--db", a)
    assert res.exit_code == 0 and run_id in res.stdout, res.output
    assert rows(a, "SELECT status FROM runs WHERE id = ?", run_id) == [("done",)]
    assert not kept.exists() and not spool.manifest_of(kept).exists()


def test_ingest_refuses_another_db_and_the_db_itself_and_leaves_both(invoke, fake_run, tmp_path, private_tmp):
    db = tmp_path / "evalkit.duckdb"
    other = tmp_path / "colleague.duckdb"
    fake_run(db)
    fake_run(other)
    invoke("promote", "latest", "--tag", "theirs", "--db", other)
    for path, said in ((other, "not an evalkit spool file of this DB"), (db, "is the DB itself")):
        before = sha(path)
        res = invoke("ingest", path, "--db", db)
        assert res.exit_code == 2 and said in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.output
        assert path.is_file() and sha(path) == before
    assert rows(other, "SELECT count(*) FROM tags") == [(1,)]


def test_a_changed_kept_file_is_refused_by_ingest_and_left_as_it_is(invoke, kept_run, tmp_path, private_tmp, monkeypatch):
    db = tmp_path / "evalkit.duckdb"
    run_id, kept = kept_run(db)
    con = duckdb.connect(str(kept))
    con.execute("UPDATE metrics SET value = 1.0")
    con.execute("CHECKPOINT")
    con.close()
    changed = sha(kept)
    res = invoke("ingest", kept, "--db", db)
    assert res.exit_code == 2 and "changed after it was kept" in res.stderr, res.output
    assert kept.is_file() and sha(kept) == changed
    assert rows(db, "SELECT status FROM runs WHERE id = ?", run_id) == [("running",)]


def test_a_kept_file_never_replaces_a_done_run(invoke, fake_run, kept_run, tmp_path, private_tmp, monkeypatch, caplog):
    db = tmp_path / "evalkit.duckdb"
    run_id, kept = kept_run(db)
    con = duckdb.connect(str(db))
    con.execute("UPDATE runs SET status = 'done', model = 'the stored one' WHERE id = ?", [run_id])
    con.close()
    res = invoke("ingest", kept, "--db", db)
    assert res.exit_code == 2 and "already done" in res.stderr, res.output
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        fake_run(db)
    assert rows(db, "SELECT model FROM runs WHERE id = ?", run_id) == [("the stored one",)]
    assert (kept.parent / f"{kept.name}.bad").is_file()


def test_a_kept_run_still_lands_complete(invoke, fake_run, kept_run, tmp_path, private_tmp, monkeypatch):
    db = tmp_path / "evalkit.duckdb"
    run_id, kept = kept_run(db)
    listed = invoke("runs", "--db", db)
    assert re.search(rf"^{run_id}\s+\S+ \S+\s+kept\b", listed.stdout, re.M), listed.output
    fake_run(db)
    assert rows(db, "SELECT status, (SELECT count(*) FROM samples WHERE run_id = r.id) FROM runs r WHERE id = ?",
                run_id) == [("done", 4)]
    assert not kept.exists() and not list(spool.spool_dir(db).iterdir())
