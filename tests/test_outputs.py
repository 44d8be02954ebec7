"""Outputs never follow links: report, needle-heatmap, gate --junit, $GITHUB_STEP_SUMMARY, export --parquet.

A link planted in an output folder (to a file outside it, or to nothing) is replaced
itself; the file outside stays byte for byte and a dangling target is never created.
The step summary, appended to, refuses a link. A failed or interrupted export leaves the
earlier export whole, and a full disk is one line on stderr, exit 2.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path

import duckdb
import pytest

from evalkit.errors import BadInput
from evalkit.paths import append_file, write_file
from evalkit.store.sandbox import TABLES, merged_query

PNG = b"\x89PNG\r\n\x1a\n"
SECRET = "outside the output folder: must stay as it is\n"


def add_needle(db, run_id):
    """Needle samples for one run: recall 1 at the edges, 0 in the middle without the hint."""
    from evalkit.store.db import transaction

    rows = [(run_id, "needle_en", f"en-{hint}-{length}-{depth}", "en", depth, length, length - 3, hint,
             0.0 if depth == 0.5 and not hint else 1.0)
            for hint in (False, True) for length in (256, 512) for depth in (0.0, 0.5, 1.0)]
    with transaction(db) as con:
        con.executemany("INSERT INTO samples (run_id, task, doc_id, lang, needle_depth, needle_length, "
                        "needle_tokens, needle_hint, needle_recall) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)


@pytest.fixture(scope="module")
def stored(fake_run, tmp_path_factory):
    """Two done fake-LM runs on the same prompts; the baseline also has needle samples."""
    db = tmp_path_factory.mktemp("outputs") / "runs.duckdb"
    ids = {"base": fake_run(db, "hit", name="baseline"), "cand": fake_run(db, "other", name="candidate")}
    add_needle(db, ids["base"])
    return db, ids


@pytest.fixture
def runs(stored):
    """This test's own copy of the stored DB, at $EVALKIT_DB."""
    src, ids = stored
    shutil.copy(src, os.environ["EVALKIT_DB"])
    return ids


@pytest.fixture
def outside(tmp_path):
    """A folder beside the output folder, holding one file a planted link points to."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "secret.txt").write_text(SECRET, encoding="utf-8")
    return folder


def plant(folder: Path, outside: Path, existing: str, dangling: str) -> None:
    """`existing` links to outside/secret.txt, `dangling` to outside/<dangling> (which does not exist)."""
    folder.mkdir(exist_ok=True)
    (folder / existing).symlink_to(outside / "secret.txt")
    (folder / dangling).symlink_to(outside / dangling)


def assert_untouched(outside: Path) -> None:
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"], "a file was created outside"
    assert (outside / "secret.txt").read_text(encoding="utf-8") == SECRET


def assert_replaced(path: Path, starts: bytes) -> None:
    assert not path.is_symlink() and path.is_file(), path
    assert path.read_bytes().startswith(starts), path


def no_temporaries(folder: Path) -> None:
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []


def one_error_line(res, fragment):
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("evalkit: error:") and fragment in lines[0], lines[0]


def enospc_on(real, fragment):
    """A stand-in for os.replace / os.write that fails with a full disk when its path or fd matches."""
    def fake(*args, **kwargs):
        if fragment(*args):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)
    return fake


# ----------------------------------------------------------------------- the writers


def test_write_file_replaces_a_link_and_leaves_its_target(tmp_path, outside):
    out = tmp_path / "out"
    plant(out, outside, "a.txt", "b.txt")
    write_file(out / "a.txt", "new a")
    write_file(out / "b.txt", b"new b")
    assert_untouched(outside)
    assert (out / "a.txt").read_text() == "new a" and not (out / "a.txt").is_symlink()
    assert (out / "b.txt").read_bytes() == b"new b" and not (out / "b.txt").is_symlink()
    no_temporaries(out)


def test_write_file_failure_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "kept.txt"
    target.write_text("old")
    monkeypatch.setattr(os, "write", enospc_on(os.write, lambda fd, data: True))
    with pytest.raises(BadInput, match=r"^cannot write output .*kept\.txt: No space left on device$"):
        write_file(target, "new")
    assert target.read_text() == "old"
    no_temporaries(tmp_path)


def test_append_file_refuses_a_link_even_after_the_check(tmp_path, outside):
    """The check refuses a link first; the append itself refuses one planted after it (O_NOFOLLOW)."""
    plant(tmp_path, outside, "summary.md", "gone.md")
    for name in ("summary.md", "gone.md"):
        with pytest.raises(BadInput, match="is a symbolic link"):
            append_file(tmp_path / name, "## appended\n")
    assert_untouched(outside)


# ----------------------------------------------------------------------- report


def test_report_replaces_planted_links(invoke, runs, tmp_path, outside):
    out = tmp_path / "report"
    plant(out, outside, "index.html", "summary.md")
    (out / "leaderboard.png").symlink_to(outside / "secret.txt")
    res = invoke("report", "--out", out)
    assert res.exit_code == 0, res.output
    assert_untouched(outside)
    assert_replaced(out / "index.html", b"<!doctype html>")
    assert_replaced(out / "summary.md", b"# ")
    assert_replaced(out / "leaderboard.png", PNG)
    no_temporaries(out)


def test_report_on_a_full_disk_is_one_line_and_keeps_the_old_files(invoke, runs, tmp_path, monkeypatch):
    out = tmp_path / "report"
    assert invoke("report", "--out", out).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(os, "replace", enospc_on(os.replace, lambda src, dst: Path(dst).parent == out))
    res = invoke("report", "--out", out)
    assert res.exit_code == 2, res.output
    one_error_line(res, "No space left on device")
    assert str(out) in res.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    no_temporaries(out)


# ----------------------------------------------------------------------- needle-heatmap


def test_needle_heatmap_replaces_planted_links(invoke, runs, tmp_path, outside):
    out = tmp_path / "needle"
    names = [f"needle_heatmap_{runs['base']}.png", f"needle_by_depth_{runs['base']}.png"]
    plant(out, outside, *names)
    res = invoke("needle-heatmap", runs["base"], "--out", out)
    assert res.exit_code == 0, res.output
    assert_untouched(outside)
    for name in names:
        assert_replaced(out / name, PNG)
    no_temporaries(out)


# ----------------------------------------------------------------------- gate


@pytest.fixture
def gate(invoke, runs):
    """`gate(*args, env=None)`: `evalkit gate` of the candidate against the baseline run."""
    return lambda *args, env=None: invoke("gate", "--candidate", runs["cand"], "--baseline", runs["base"], *args,
                                          env=env)


@pytest.mark.parametrize("target", ["secret.txt", "missing.xml"], ids=["link-to-a-file", "dangling-link"])
def test_gate_junit_replaces_a_planted_link(gate, runs, tmp_path, outside, target):
    junit = tmp_path / "ci" / "gate.xml"
    junit.parent.mkdir()
    junit.symlink_to(outside / target)
    res = gate("--junit", junit)
    assert res.exit_code in (1, 3), res.output  # a verdict, whichever: the file is what matters
    assert_untouched(outside)
    assert_replaced(junit, b"<?xml")
    no_temporaries(junit.parent)


@pytest.mark.parametrize("target", ["secret.txt", "missing.md"], ids=["link-to-a-file", "dangling-link"])
def test_step_summary_through_a_link_is_refused(gate, runs, tmp_path, outside, target):
    summary = tmp_path / "summary.md"
    summary.symlink_to(outside / target)
    res = gate(env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert res.exit_code == 2, res.output
    one_error_line(res, "is a symbolic link")
    assert res.stdout == ""  # refused before any work
    assert_untouched(outside)
    assert summary.is_symlink()


def test_gate_on_a_full_disk_is_one_line(gate, runs, tmp_path, monkeypatch):
    junit, summary = tmp_path / "gate.xml", tmp_path / "summary.md"
    junit.write_text("old junit")
    summary.write_text("# earlier step\n")
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", enospc_on(os.replace, lambda src, dst: Path(dst) == junit))
        res = gate("--junit", junit)
    assert res.exit_code == 2, res.output
    one_error_line(res, f"cannot write --junit {junit}: No space left on device")
    assert junit.read_text() == "old junit"

    summary_fds = []  # the descriptors the summary was opened as
    real_open = os.open

    def recording_open(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        if Path(path) == summary:
            summary_fds.append(fd)
        return fd

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", recording_open)
        patch.setattr(os, "write", enospc_on(os.write, lambda fd, data: fd in summary_fds))
        res = gate(env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert res.exit_code == 2, res.output
    one_error_line(res, f"cannot write $GITHUB_STEP_SUMMARY {summary}: No space left on device")
    assert summary.read_text() == "# earlier step\n"


# ----------------------------------------------------------------------- export --parquet


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_export_replaces_planted_links(invoke, runs, tmp_path, outside):
    out = tmp_path / "export"
    plant(out, outside, "runs.parquet", "tags.parquet")
    res = invoke("export", "--parquet", out)
    assert res.exit_code == 0, res.output
    assert_untouched(outside)
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{t}.parquet" for t in TABLES)
    for table in TABLES:
        assert_replaced(out / f"{table}.parquet", b"PAR1")
    no_temporaries(tmp_path)


def test_export_through_a_folder_link_keeps_the_link(invoke, runs, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "exports").symlink_to(real)
    assert invoke("export", "--parquet", tmp_path / "exports").exit_code == 0
    assert (tmp_path / "exports").is_symlink()
    assert sorted(p.name for p in real.iterdir()) == sorted(f"{t}.parquet" for t in TABLES)


def test_export_refuses_a_folder_with_other_files(invoke, runs, tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    res = invoke("export", "--parquet", out)
    assert res.exit_code == 2, res.output
    one_error_line(res, "it holds notes.txt")
    assert snapshot(out) == {"notes.txt": b"mine"}


def failing_open_reader(real_open_reader, error, after=1):
    """open_reader whose connection raises `error` at the COPY after the first `after` tables."""

    class Connection:
        def __init__(self, con):
            self.con, self.copies = con, 0

        def execute(self, sql, *args):
            if sql.startswith("COPY"):
                if self.copies == after:
                    raise error
                self.copies += 1
            return self.con.execute(sql, *args)

    @contextlib.contextmanager
    def opener(*args, **kwargs):
        with real_open_reader(*args, **kwargs) as con:
            yield Connection(con)

    return opener


@pytest.mark.parametrize("error, code, fragment", [
    (KeyboardInterrupt(), 130, "interrupted"),
    (duckdb.IOException("IO Error: could not write file: No space left on device"), 2, "No space left on device"),
], ids=["interrupted", "disk-full"])
def test_failed_export_keeps_the_old_export(invoke, runs, tmp_path, monkeypatch, error, code, fragment):
    from evalkit.store import export
    from evalkit.store.db import transaction

    out = tmp_path / "export"
    assert invoke("export", "--parquet", out).exit_code == 0
    before = snapshot(out)
    renamed = "SELECT count(*) FROM runs WHERE name = 'renamed'"
    with transaction(None) as con:  # the next export differs from the first table on
        con.execute("UPDATE runs SET name = 'renamed' WHERE id = ?", [runs["base"]])
    with monkeypatch.context() as patch:
        patch.setattr(export, "open_reader", failing_open_reader(export.open_reader, error))
        res = invoke("export", "--parquet", out)
    assert res.exit_code == code, res.output
    one_error_line(res, fragment)
    assert snapshot(out) == before
    assert merged_query([], [out], renamed)[1][0][0] == 0
    no_temporaries(tmp_path)  # the half-written folder is gone
    assert invoke("export", "--parquet", out).exit_code == 0
    assert merged_query([], [out], renamed)[1][0][0] == 1


def test_export_swap_on_a_full_disk_is_one_line(invoke, runs, tmp_path, monkeypatch):
    out = tmp_path / "export"
    assert invoke("export", "--parquet", out).exit_code == 0
    before = snapshot(out)
    # the new folder cannot be renamed in; the old one, renamed aside, goes back
    monkeypatch.setattr(os, "rename", enospc_on(os.rename, lambda src, dst: Path(dst) == out and ".new-" in str(src)))
    res = invoke("export", "--parquet", out)
    assert res.exit_code == 2, res.output
    one_error_line(res, f"cannot write --parquet {out}: No space left on device")
    assert snapshot(out) == before
    no_temporaries(tmp_path)
