"""Input files of every size and kind, and faults after a commit (issue 36, classes 6 and 7).

Every file evalkit reads goes through `paths.open_input` (a regular file, a size limit, never
a wait on a FIFO) and is read whole (`read_input`) or line by line (`read_lines`): the
journal is streamed, so a 4 GB journal is refused after its first MiB instead of read whole;
`drift-corpus /dev/zero` and `drift-corpus FIFO` are one line. A refused resume writes
nothing (the journal's cut last line stays until the resumed run writes), and names what
changed whole; a resume that loses the race to another is one line; a kept run that came in
but whose file cannot be removed is a warning, not an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from pathlib import Path

import pytest

from evalkit.contract import FirstStepResult
from evalkit.errors import BadInput
from evalkit.paths import open_input, read_input, read_lines
from evalkit.store import journal, spool


def ident() -> spool.Identity:
    return spool.Identity(secrets.token_hex(16), secrets.token_hex(32))


def result(text: str) -> FirstStepResult:
    return FirstStepResult(text=text, first_token_id=1, first_token=text[:1], first_unit=text[:1],
                           topk=[(1, text[:1], -0.5)], entropy=1.0)


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def written(tmp_path):
    """A journal of two batches whose last line a crash cut short: (db, identity, run id, path)."""
    db, me = tmp_path / "evalkit.duckdb", ident()
    j = journal.Journal.create(db, me, "r1", {"seed": 1, "config": {"batch_size": 2, "model": "x" * 200}})
    j.batch(["b", 0], lambda: [result("Paris")])
    j.batch(["b", 1], lambda: [result("Rome")])
    j.close()
    path = journal.path_in(spool.spool_dir(db), "r1")
    path.write_bytes(path.read_bytes()[:-20])
    return db, me, "r1", path


# ----------------------------------------------------------------------- the reader


def test_read_input_refuses_every_kind_but_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "link").symlink_to(tmp_path / "file")
    (tmp_path / "file").write_bytes(b"x" * 10)
    for path, phrase in ((fifo, "a FIFO"), ("/dev/zero", "a character device"), (tmp_path, "a folder"),
                         (tmp_path / "missing", "No such file")):
        with pytest.raises(BadInput, match=phrase):
            read_input(path, "input", 100)
    with pytest.raises(BadInput, match="10 bytes; at most 9"):
        read_input(tmp_path / "file", "input", 9)
    with pytest.raises(BadInput, match="symbolic link"), open_input(tmp_path / "link", "input", 100, follow_links=False):
        pass
    assert read_input(tmp_path / "link", "input", 100) == b"x" * 10


def test_read_input_stops_at_its_limit_when_the_file_grows(tmp_path, monkeypatch):
    path = tmp_path / "grows"
    path.write_bytes(b"a" * 10)
    real_fstat = os.fstat
    monkeypatch.setattr(os, "fstat", lambda fd: real_fstat(fd))  # the size seen before it grew
    with open_input(path, "input", 15) as fh:
        with open(path, "ab") as grow:
            grow.write(b"b" * 100)
        with pytest.raises(BadInput, match="over 15 bytes"):
            fh.read()


def test_read_lines_never_holds_an_endless_line(tmp_path):
    path = tmp_path / "one-line"
    path.write_bytes(b"ok\n" + b"z" * 5000)
    with open_input(path, "journal", 10_000) as fh:
        lines = read_lines(fh, "journal", path, 1000)
        assert next(lines) == b"ok\n"
        with pytest.raises(BadInput, match="a line longer than 1,000 bytes"):
            next(lines)


# ----------------------------------------------------------------------- the journal


def test_a_4gb_journal_is_refused_without_being_read(tmp_path):
    """A sparse 4 GiB file of zeros: before, read whole (MemoryError); now refused at its header."""
    me = ident()
    path = tmp_path / "r1.journal"
    with open(path, "wb") as fh:
        fh.truncate(4 << 30)
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(BadInput, match="no header line within its first 1,048,576 bytes"):
        journal.Journal.resume(path, me, "r1")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: never read whole
    assert path.stat().st_size == 4 << 30


@pytest.mark.parametrize("kind", ["fifo", "link", "folder"])
def test_a_journal_that_is_no_regular_file_is_refused(tmp_path, kind):
    path = tmp_path / "r1.journal"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        (tmp_path / "real").write_text("{}\n")
        path.symlink_to(tmp_path / "real")
    else:
        path.mkdir()
    with pytest.raises(BadInput, match="resume refused|not a regular file"):
        journal.Journal.resume(path, ident(), "r1")


def test_a_verified_journal_is_not_written_until_the_resumed_run_writes(written):
    db, me, run_id, path = written
    folder = spool.spool_dir(db)
    before = digest(folder)
    opened, fingerprint = journal.Journal.resume(path, me, run_id)
    assert len(opened.batches) == 1 and fingerprint["seed"] == 1
    opened.close()  # a refused resume: nothing was written
    assert digest(folder) == before
    opened, _ = journal.Journal.resume(path, me, run_id)
    assert [r.text for r in opened.batch(["b", 0], lambda: pytest.fail("replayed, not computed"))] == ["Paris"]
    assert digest(folder) == before  # a replayed batch writes nothing either
    opened.batch(["b", 1], lambda: [result("Roma")])  # the first computed batch: the cut line goes, this one comes
    opened.close()
    again, _ = journal.Journal.resume(path, me, run_id)
    assert sorted(r[0]["text"] for r in again.batches.values()) == ["Paris", "Roma"]


def test_a_journal_swapped_after_it_was_verified_is_left_alone(written, caplog):
    db, me, run_id, path = written
    opened, _ = journal.Journal.resume(path, me, run_id)
    os.replace(path, path.with_suffix(".old"))
    path.write_bytes(b"someone else's file\n")
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        opened.batch(["b", 1], lambda: [result("Roma")])
    assert path.read_bytes() == b"someone else's file\n"
    assert "changed after it was verified" in caplog.text


def test_differences_name_each_changed_entry_whole():
    long = "/models/" + "x" * 300 + "/model.gguf"
    stored = {"config": {"batch_size": 2, "model_args": f"pretrained={long}", "seed": 1}, "versions": {"torch": "2.1"}}
    current = {"config": {"batch_size": 2, "model_args": f"pretrained={long}2", "seed": 1}, "versions": {"torch": "2.2"},
               "prompts_sha256": "ab"}
    changed = journal.differences(stored, current)
    assert changed == [f"config.model_args: pretrained={long} -> pretrained={long}2", "prompts_sha256: (none) -> ab",
                       "versions.torch: 2.1 -> 2.2"]


# ----------------------------------------------------------------------- races and faults after a commit


def test_a_resume_that_loses_the_race_is_one_line_and_changes_nothing(fake_run, tmp_path):
    import duckdb

    from evalkit.store import rows, runs

    db = tmp_path / "evalkit.duckdb"
    run_id = fake_run(db)
    con = duckdb.connect(str(db))
    con.execute("UPDATE runs SET status = 'running', pid = ?, host = ?, pid_start = ? WHERE id = ?",
                [os.getpid(), rows.this_process()["host"], rows.this_process().get("pid_start"), run_id])
    con.close()
    before = digest(tmp_path)
    with pytest.raises(BadInput, match=f"run {run_id} was resumed by another process"):
        runs.restart_run(db, run_id)
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT status FROM runs WHERE id = ?", [run_id]).fetchall() == [("running",)]
    con.close()
    assert set(digest(tmp_path)) == set(before)


def test_two_resumes_at_once_one_wins(fake_run, tmp_path):
    """restart_run in two processes on one interrupted run: exactly one takes it (and stays alive a while,
    as a resumed run does), the other is one line."""
    import subprocess
    import sys

    import duckdb

    db = tmp_path / "evalkit.duckdb"
    run_id = fake_run(db)
    con = duckdb.connect(str(db))
    con.execute("UPDATE runs SET status = 'interrupted' WHERE id = ?", [run_id])
    con.close()
    code = ("import sys\nfrom evalkit.errors import BadInput\nfrom evalkit.store import runs\n"
            "import time\ntry:\n    runs.restart_run(sys.argv[1], sys.argv[2]); print('took it', flush=True); time.sleep(6)\n"
            "except BadInput as exc:\n    print(exc)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(db), run_id], stdout=subprocess.PIPE, text=True,
                              env=env) for _ in range(2)]
    outcomes = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert outcomes[-1] == "took it" and "resumed by another process" in outcomes[0], outcomes


def test_ingest_from_a_folder_it_cannot_write_commits_and_warns(invoke, tmp_path, monkeypatch, caplog):
    import re
    import tempfile

    import duckdb

    import evalkit.store.runs as runs_module

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    db = tmp_path / "evalkit.duckdb"
    real = runs_module.finish_run
    monkeypatch.setattr(runs_module, "finish_run",
                        lambda *a, **k: (_ for _ in ()).throw(duckdb.IOException("No space left on device")))
    res = invoke("run", "--model", "evalkit-fake", "--model-args", "mode=hit", "--tasks", "firsttoken",
                 "--limit", "2", "--db", db)
    monkeypatch.setattr(runs_module, "finish_run", real)
    assert res.exit_code == 1, res.output
    kept = Path(re.search(r"kept in (\S+) and", res.stderr).group(1))
    run_id = kept.name[: -len(spool.SUFFIX)]
    real_unlink = Path.unlink

    def read_only_folder(self, *args, **kwargs):
        if self.parent == kept.parent:
            raise PermissionError(13, "Permission denied", str(self))
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", read_only_folder)
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        res = invoke("ingest", kept, "--db", db)
    assert res.exit_code == 0, res.output
    assert f"ingested 1 run(s): {run_id}" in res.stdout
    assert "could not be removed (Permission denied)" in caplog.text
    assert kept.is_file()
    monkeypatch.setattr(Path, "unlink", real_unlink)
    res = invoke("ingest", "--db", db)  # the run is in: the leftover file only goes now
    assert res.exit_code == 0, res.output
    assert not kept.exists() and not spool.manifest_of(kept).exists()
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT status, (SELECT count(*) FROM samples WHERE run_id = ?) FROM runs WHERE id = ?",
                       [run_id, run_id]).fetchall() == [("done", 4)]
    con.close()


# ----------------------------------------------------------------------- drift-corpus


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "folder", "too-big"])
def test_drift_corpus_refuses_a_file_of_the_wrong_kind_or_size(invoke, tmp_path, kind, monkeypatch):
    from evalkit.runner import corpus

    if kind == "fifo":
        path = tmp_path / "corpus.txt"
        os.mkfifo(path)  # no writer: open used to wait for ever
    elif kind == "folder":
        path = tmp_path
    elif kind == "too-big":
        path = tmp_path / "big.txt"
        path.write_text("word " * 100)
        monkeypatch.setattr(corpus, "MAX_CORPUS_BYTES", 100)
        monkeypatch.setattr(corpus.read_text, "__defaults__", (100,))
    else:
        path = Path(kind)
    res = invoke("drift-corpus", path, "--quant", "fp32,bf16")
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2, res.output
    expect = {"/dev/zero": "a character device, not a regular file", "fifo": "a FIFO, not a regular file",
              "folder": "is a directory", "too-big": "at most 100 are read"}[kind]
    assert len(lines) == 1 and lines[0].startswith("evalkit: error: ") and expect in lines[0], lines


def test_a_spool_manifest_that_is_a_fifo_is_refused_without_waiting(tmp_path):
    me = ident()
    kept = tmp_path / "r1.duckdb"
    kept.write_bytes(b"x")
    os.mkfifo(spool.manifest_of(kept))
    with pytest.raises(BadInput, match="a FIFO, not a regular file"):
        spool.verify(kept, me)


# ----------------------------------------------------------------------- a prompt at a time


def test_prompts_are_journaled_as_they_finish_and_a_batch_replays_once_all_are_in(tmp_path):
    """A kill loses only the prompts in flight: each finished prompt is a signed line of its own.
    A batch replays only whole (its numbers depend on its padding); one known in part runs again,
    and its journaled prompts are not written twice."""
    db, me = tmp_path / "evalkit.duckdb", ident()
    j = journal.Journal.create(db, me, "r1", {"seed": 1})
    j.record_row(["b", 0], 1, 3, result("Rome"))  # rows finish in any order
    j.record_row(["b", 0], 0, 3, result("Paris"))
    j.record_row(["b", 8], 0, 1, result("Oslo"))  # a batch of one: complete at once
    j.close()
    path = journal.path_in(spool.spool_dir(db), "r1")
    assert len(path.read_bytes().splitlines()) == 4  # the header and one line per prompt

    opened, _ = journal.Journal.resume(path, me, "r1")
    assert opened.prompts == 3 and list(opened.rows.values()) == [{1: journal.encode(result("Rome")),
                                                                   0: journal.encode(result("Paris"))}]
    assert opened.held(["b", 8])[0].text == "Oslo"
    assert opened.held(["b", 0]) is None  # two of three: run again, whole
    again = [result("Paris"), result("Rome"), result("Bern")]
    opened.record_row(["b", 0], 0, 3, again[0])  # held already: not written twice
    opened.record_row(["b", 0], 2, 3, again[2])
    opened.record(["b", 0], again)  # the batch done: nothing left to write
    opened.close()
    assert len(path.read_bytes().splitlines()) == 5
    back, _ = journal.Journal.resume(path, me, "r1")
    assert [r.text for r in back.held(["b", 0])] == ["Paris", "Rome", "Bern"] and back.rows == {}


def test_a_changed_or_reordered_prompt_line_is_refused(tmp_path):
    db, me = tmp_path / "evalkit.duckdb", ident()
    j = journal.Journal.create(db, me, "r1", {"seed": 1})
    j.record_row(["b", 0], 0, 2, result("Paris"))
    j.record_row(["b", 0], 1, 2, result("Rome"))
    j.close()
    path = journal.path_in(spool.spool_dir(db), "r1")
    header, first, second = path.read_bytes().splitlines()
    for lines, why in (([header, first.replace(b'"row":0', b'"row":1'), second], "line 2's signature"),
                       ([header, second, first], "line 2's signature"),
                       ([header, first.replace(b'"of":2', b'"of":"2"'), second], "line 2 is not a journal entry")):
        path.write_bytes(b"\n".join(lines) + b"\n")
        with pytest.raises(BadInput, match=why):
            journal.Journal.resume(path, me, "r1")
