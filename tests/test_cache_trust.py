"""Every cache evalkit keeps follows one rule (`evalkit/cachedir.py`), the spool folder's.

A cache file is created with O_CREAT|O_EXCL|O_NOFOLLOW under a random name and renamed into
place, so a link planted at its name or at a temporary's is never followed; a cache folder or
file of another user's, writable by others, a link or not a regular file (a FIFO) is
**ignored**, with one warning line: never read, never written into, and the run goes on as with
the cache off. Checked for the name lists (`memo`, `names/`) and the converted models
(`convert`, `models/`); the GGUF stamps are `memo.counts`, the same files.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest

from evalkit import cachedir, memo
from evalkit.engines.transformers import convert

ROOT = os.geteuid() == 0


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("EVALKIT_CACHE", str(folder))
    monkeypatch.setattr(cachedir, "_warned", set())
    return folder


def remember(value=("a", "b")):
    calls = []

    def compute():
        calls.append(1)
        return list(value)

    return memo.names("test-kind", {"x": 1}, compute), calls


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("evalkit") and r.levelno >= logging.WARNING]


def test_a_list_is_kept_private_and_read_back(cache):
    names, calls = remember()
    assert names == {"a", "b"} and calls == [1]
    path, _ = memo.entry("test-kind", {"x": 1})
    assert path is not None and path.is_file() and not path.is_symlink()
    assert oct(path.stat().st_mode & 0o777) == oct(0o600) and oct((cache / "names").stat().st_mode & 0o777) == oct(0o700)
    assert remember()[1] == []  # read back: not computed again


def test_a_link_planted_at_the_entry_is_replaced_not_followed(cache, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    path, _ = memo.entry("test-kind", {"x": 1})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(victim)
    names, calls = remember()
    assert calls == [1] and victim.read_text() == "precious\n"  # a link is never read as the list
    assert path.is_file() and not path.is_symlink()  # replaced itself by the rename


def test_a_link_planted_at_a_temporary_name_is_never_followed(cache, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    path, _ = memo.entry("test-kind", {"x": 1})
    path.parent.mkdir(parents=True, exist_ok=True)
    # the temporary name an older evalkit used (`.NAME.PID.tmp`, predictable), and create() itself
    Path(path.parent, f".{path.name}.{os.getpid()}.tmp").symlink_to(victim)
    remember()
    assert victim.read_text() == "precious\n"
    link = path.parent / "planted"
    link.symlink_to(victim)
    with pytest.raises(FileExistsError):
        cachedir.create(link, b"overwritten")
    dangling = path.parent / "dangling"
    dangling.symlink_to(tmp_path / "created-through-the-link")
    with pytest.raises(FileExistsError):
        cachedir.create(dangling, b"x")
    assert victim.read_text() == "precious\n" and not (tmp_path / "created-through-the-link").exists()


def _plant(cache: Path, names: list[str]) -> Path:
    """A well-formed list for the test identity, written as evalkit writes it; its path."""
    path, identity = memo.entry("test-kind", {"x": 1})
    remember(["a"])
    path.write_text(json.dumps({"identity": identity, "names": names}), encoding="utf-8")
    return path


def test_a_world_writable_list_is_ignored(cache, caplog):
    path = _plant(cache, ["planted"])
    assert remember()[0] == {"planted"}  # the rule's control: a private file is read
    path.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        names, calls = remember()
    assert names == {"a", "b"} and calls == [1]
    assert any("open to other users" in w and "ignores it" in w for w in warnings_of(caplog)), warnings_of(caplog)


@pytest.mark.skipif(not ROOT, reason="giving a file to another user needs root")
def test_a_list_of_another_users_is_ignored(cache, caplog):
    path = _plant(cache, ["planted"])
    os.chown(path, 12345, -1)
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        names, calls = remember()
    assert names == {"a", "b"} and calls == [1]
    assert any("owned by uid 12345" in w for w in warnings_of(caplog)), warnings_of(caplog)


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_names_folder_writable_by_others_is_ignored_whole(cache, caplog, mode):
    _plant(cache, ["planted"])
    (cache / "names").chmod(mode)
    before = sorted(p.name for p in (cache / "names").iterdir())
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        names, calls = remember()
        remember()
    assert names == {"a", "b"} and calls == [1]
    assert sorted(p.name for p in (cache / "names").iterdir()) == before  # nothing written there
    said = [w for w in warnings_of(caplog) if "open to other users" in w]
    assert len(said) == 1, warnings_of(caplog)  # once per process, not once per read


def test_a_names_folder_that_is_a_link_is_ignored(cache, tmp_path, caplog):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    cache.mkdir(mode=0o700)
    (cache / "names").symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        assert remember()[1] == [1]
    assert list(elsewhere.iterdir()) == []
    assert any("a symbolic link, not a folder" in w for w in warnings_of(caplog)), warnings_of(caplog)


def test_a_fifo_in_the_names_folder_is_ignored_without_waiting(cache, caplog):
    path, _ = memo.entry("test-kind", {"x": 1})
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        names, calls = remember()
    assert time.monotonic() - started < 5 and calls == [1]
    assert any("a FIFO" in w for w in warnings_of(caplog)), warnings_of(caplog)


def test_the_name_cache_fifo_through_the_cli_is_quick(invoke, tiny_model_dir, tmp_path, monkeypatch):
    """A FIFO at every kept list's name: the run's refusal of a bad key comes at once, one warning aside."""
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cachedir, "_warned", set())
    args = ["run", "--model", "hf", "--model-args", f"pretrained={tiny_model_dir},foo=1", "--tasks", "firsttoken",
            "--db", tmp_path / "e.duckdb"]
    assert invoke(*args).exit_code == 2  # computes and keeps the lists
    kept = sorted((tmp_path / "cache" / "names").glob("*.json"))
    assert kept
    for path in kept:
        path.unlink()
        os.mkfifo(path)
    started = time.monotonic()
    res = invoke(*args)
    assert res.exit_code == 2 and time.monotonic() - started < 60
    assert "unknown --model-args key 'foo'" in res.stderr and "Traceback" not in res.output


# ---- the converted models (`models/`): the same rule --------------------------------------------


def test_a_converted_folder_open_to_others_is_neither_read_nor_removed(cache, tmp_path, caplog):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    folder = convert.cached_folder(gguf, make=True)
    assert folder is not None and folder.parent == cache / "models"
    folder.mkdir(mode=0o700)
    (folder / "config.json").write_text("{}")
    (folder / convert.DONE).write_text("converted\n")
    assert convert.cached_folder(gguf) == folder  # the rule's control
    folder.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        assert convert.cached_folder(gguf) is None
        args = {"pretrained": str(tmp_path), "gguf_file": gguf.name}
        assert convert.cached_args(args) == args  # loaded from the GGUF itself, the folder left alone
    assert (folder / "config.json").exists()
    assert any("open to other users" in w for w in warnings_of(caplog)), warnings_of(caplog)
    folder.chmod(0o700)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(tmp_path / "m.gguf")
    assert convert.cached_folder(gguf) is None  # a link inside is no file of the cache's


def test_a_models_folder_writable_by_others_is_ignored(cache, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    assert convert.cached_folder(gguf, make=True) is not None
    (cache / "models").chmod(0o757)
    assert convert.cached_folder(gguf, make=True) is None
    cache.chmod(0o777)
    (cache / "models").chmod(0o700)
    assert convert.cached_folder(gguf, make=True) is None  # the root too
