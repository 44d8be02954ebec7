"""Outputs are regular files or absent: a device, a FIFO, a socket or a folder at an output path
is one line and exit 2 before any work, and stays what it was (issue 36, class 1).

The checks (`check_output_file`, `check_output_dir`) refuse it before work, and the writers
(`write_file`, `append_file`) refuse it again at the moment they write, so a path that turns
into a FIFO after the check is still never replaced. The real /dev/null is only ever handed to
code whose `os.replace` is watched: a regression fails the test instead of replacing it.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import threading
from pathlib import Path

import pytest

from evalkit.errors import BadInput
from evalkit.paths import append_file, check_output_dir, check_output_file, special_kind, write_file
from tests.test_outputs import add_needle, one_error_line


@pytest.fixture(scope="module")
def stored(fake_run, tmp_path_factory):
    db = tmp_path_factory.mktemp("kinds") / "runs.duckdb"
    ids = {"base": fake_run(db, "hit", name="baseline"), "cand": fake_run(db, "other", name="candidate")}
    add_needle(db, ids["base"])
    return db, ids


@pytest.fixture
def runs(stored):
    src, ids = stored
    shutil.copy(src, os.environ["EVALKIT_DB"])
    return ids


@pytest.fixture
def guard_dev_null(monkeypatch):
    """os.replace / os.rename / os.unlink of /dev/null fail the test instead of happening."""
    for name in ("replace", "rename", "unlink"):
        real = getattr(os, name)

        def guarded(*args, _real=real, _name=name, **kwargs):
            if any(isinstance(a, (str, os.PathLike)) and os.path.abspath(os.fspath(a)) == "/dev/null"
                   for a in args[:2]):
                raise AssertionError(f"os.{_name} was called on /dev/null")
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, guarded)


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def char_device(path: Path) -> Path:
    """A character device node like /dev/null (1, 3) in a tmp folder; needs root."""
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("this container may not make device nodes")
    return path


def unix_socket(path: Path) -> Path:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()
    return path


SPECIAL = {"fifo": (fifo, "a FIFO"), "char-device": (char_device, "a character device"),
           "socket": (unix_socket, "a socket")}


def assert_kind(path: Path, test) -> None:
    assert test(os.lstat(path).st_mode), f"{path} changed kind"


def is_kind(name: str):
    return {"fifo": stat.S_ISFIFO, "char-device": stat.S_ISCHR, "socket": stat.S_ISSOCK}[name]


def no_temporaries(folder: Path) -> None:
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []


# ----------------------------------------------------------------------- the library


def test_special_kind_names_each_kind(tmp_path):
    assert special_kind(tmp_path / "absent") is None
    (tmp_path / "file").write_text("x")
    assert special_kind(tmp_path / "file") is None
    (tmp_path / "link").symlink_to("/dev/null")
    assert special_kind(tmp_path / "link") is None  # a link is replaced itself, never followed
    assert special_kind(tmp_path) == "a folder"
    assert special_kind(fifo(tmp_path / "p")) == "a FIFO"
    assert special_kind(unix_socket(tmp_path / "s")) == "a socket"
    assert special_kind("/dev/null") == "a character device"


@pytest.mark.parametrize("kind", SPECIAL)
def test_write_file_never_replaces_a_special_file(tmp_path, kind):
    make, phrase = SPECIAL[kind]
    path = make(tmp_path / "out.xml")
    with pytest.raises(BadInput, match=phrase):
        write_file(path, "<xml/>", "--junit")
    assert_kind(path, is_kind(kind))
    no_temporaries(tmp_path)


@pytest.mark.parametrize("kind", SPECIAL)
def test_checks_refuse_a_special_file(tmp_path, kind):
    make, phrase = SPECIAL[kind]
    path = make(tmp_path / "out.xml")
    with pytest.raises(BadInput, match=phrase):
        check_output_file(path, "--junit")
    with pytest.raises(BadInput, match=phrase):
        check_output_file(path, "$GITHUB_STEP_SUMMARY", append=True)
    with pytest.raises(BadInput, match=phrase):
        check_output_dir(tmp_path, "--out", ["out.xml"])
    with pytest.raises(BadInput, match=f"{phrase}, not a folder"):
        check_output_dir(path, "--out", [])
    assert_kind(path, is_kind(kind))


def test_the_real_dev_null_is_refused_by_every_writer(guard_dev_null):
    for check in (lambda: check_output_file("/dev/null", "--junit"),
                  lambda: check_output_file("/dev/null", "$GITHUB_STEP_SUMMARY", append=True),
                  lambda: write_file("/dev/null", "x", "--junit"),
                  lambda: append_file("/dev/null", "x", "$GITHUB_STEP_SUMMARY"),
                  lambda: check_output_dir("/dev", "--out", ["null"])):
        with pytest.raises(BadInput, match="a character device"):
            check()
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)


def test_append_to_a_fifo_with_a_reader_is_refused_not_written(tmp_path):
    """The FIFO opens (a reader waits on it), then fstat sees what it is: nothing is written."""
    path = fifo(tmp_path / "summary.md")
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(Path(path).read_bytes()))
    reader.start()
    try:
        with pytest.raises(BadInput, match="a FIFO"):
            append_file(path, "secret", "$GITHUB_STEP_SUMMARY")
    finally:
        with open(path, "wb", buffering=0):  # let the reader end
            pass
        reader.join(5)
    assert got == [b""]


def test_a_path_that_turns_into_a_fifo_after_the_check_is_not_replaced(tmp_path, monkeypatch):
    """The writer looks again just before its rename."""
    import evalkit.paths as paths

    path = tmp_path / "report.md"
    check_output_file(path, "--out")
    real_write = os.write

    def write_then_swap(fd, data):
        n = real_write(fd, data)
        if not path.exists():
            os.mkfifo(path)
        return n

    monkeypatch.setattr(paths.os, "write", write_then_swap)
    with pytest.raises(BadInput, match="a FIFO"):
        write_file(path, "text", "--out")
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    no_temporaries(tmp_path)


# ----------------------------------------------------------------------- every command that writes


@pytest.mark.parametrize("kind", ["fifo", "char-device"])
def test_gate_junit_on_a_special_file(invoke, runs, tmp_path, kind):
    make, phrase = SPECIAL[kind]
    path = make(tmp_path / "gate.xml")
    res = invoke("gate", "--candidate", runs["cand"], "--baseline", runs["base"], "--junit", path)
    assert res.exit_code == 2, res.output
    one_error_line(res, phrase)
    assert res.stdout == ""  # before any work
    assert_kind(path, is_kind(kind))


def test_gate_junit_dev_null(invoke, runs, guard_dev_null):
    res = invoke("gate", "--candidate", runs["cand"], "--baseline", runs["base"], "--junit", "/dev/null")
    assert res.exit_code == 2, res.output
    one_error_line(res, "/dev/null is a character device")
    assert stat.S_ISCHR(os.lstat("/dev/null").st_mode)


@pytest.mark.parametrize("target", ["/dev/null", "fifo"])
def test_step_summary_on_a_special_file(invoke, runs, tmp_path, guard_dev_null, target):
    path = "/dev/null" if target == "/dev/null" else str(fifo(tmp_path / "summary.md"))
    res = invoke("gate", "--candidate", runs["cand"], "--baseline", runs["base"],
                 env={"GITHUB_STEP_SUMMARY": path})
    assert res.exit_code == 2, res.output
    one_error_line(res, "$GITHUB_STEP_SUMMARY")
    assert res.stdout == ""
    assert not stat.S_ISREG(os.lstat(path).st_mode)


@pytest.mark.parametrize("name", ["index.html", "leaderboard.png"])
def test_report_with_a_fifo_among_its_files(invoke, runs, tmp_path, name):
    out = tmp_path / "report"
    out.mkdir()
    fifo(out / name)
    res = invoke("report", "--out", out)
    assert res.exit_code == 2, res.output
    one_error_line(res, "a FIFO")
    assert sorted(p.name for p in out.iterdir()) == [name] and stat.S_ISFIFO(os.lstat(out / name).st_mode)


@pytest.mark.parametrize("command", ["report", "needle-heatmap", "export"])
def test_a_folder_output_that_is_a_device_or_fifo(invoke, runs, tmp_path, command, guard_dev_null):
    target = fifo(tmp_path / "out")
    for path in (target, "/dev/null"):
        args = ["export", "--parquet", path] if command == "export" else [command, "--out", path]
        res = invoke(*args)
        assert res.exit_code == 2, res.output
        one_error_line(res, "not a folder")
    assert stat.S_ISFIFO(os.lstat(target).st_mode)


def test_needle_heatmap_with_a_fifo_in_place_of_its_plot(invoke, runs, tmp_path):
    out = tmp_path / "plots"
    out.mkdir()
    fifo(out / f"needle_by_depth_{runs['base']}.png")
    res = invoke("needle-heatmap", runs["base"], "--out", out)
    assert res.exit_code == 2, res.output
    one_error_line(res, "a FIFO")
    assert [p.name for p in out.iterdir()] == [f"needle_by_depth_{runs['base']}.png"]


def test_export_with_a_fifo_in_the_folder(invoke, runs, tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    fifo(out / "runs.parquet")
    res = invoke("export", "--parquet", out)
    assert res.exit_code == 2, res.output
    one_error_line(res, "a FIFO")
    assert stat.S_ISFIFO(os.lstat(out / "runs.parquet").st_mode)
