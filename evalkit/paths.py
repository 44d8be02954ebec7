"""Files evalkit writes for the user: checked before any work, then written without following links.

Owns: `check_output_file` (`--junit`, `$GITHUB_STEP_SUMMARY`) and `check_output_dir`
(`report --out`, `export --parquet`, `needle-heatmap --out`): a path that is a folder
where a file is wanted (or the reverse), whose folder is missing or not writable, that
is the DB, its WAL or an input file of the same command, or that holds any DuckDB file
is refused with one line (BadInput), before anything is read or written. An output is a
regular file, a link (replaced itself) or absent: a device (`/dev/null`), a FIFO, a socket
or a folder where a file is wanted is refused (`special_kind`), by the checks and again by
the writers at the moment they write, so even a path that changed kind after the check is
never replaced or written into.

And the three ways an output is written, none of which opens an existing path for writing:

- `write_file(path, data)`: the data goes to a new file (O_CREAT|O_EXCL, so never a link)
  in the same folder, is flushed to disk, then `os.replace`s `path`. A link at `path` is
  replaced itself, its target never touched; a failure leaves the old file and no temporary.
- `append_file(path, text)`: appends with O_NOFOLLOW; a link at `path` is refused. Used for
  `$GITHUB_STEP_SUMMARY`, a file the CI runner owns and reads back after the step: appending
  keeps earlier steps' text and the file itself, which a read-and-replace could race with.
- `atomic_folder(path)`: a new sibling folder to fill; on success it takes `path`'s place
  whole (the old folder renamed aside, the new one renamed in, the old one removed), so a
  reader finds the old contents or the new ones, never a mix. A kill -9 between the two
  renames leaves no folder at `path` and the old one beside it as `.NAME.old-*`.

An OSError while writing (disk full, permission denied, read-only file system) is one
BadInput line naming the path. Does not: decide what is written, or clean up temporaries
a killed process left (they are dot-files beside the output, never the output).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from evalkit.errors import BadInput

_NAME_KEEP = 180  # characters of the output's name kept in a temporary's name (NAME_MAX is 255)


def special_kind(path: str | os.PathLike) -> str | None:
    """What is at `path` when it is neither absent, a regular file nor a symbolic link (which
    is not followed): "a folder", "a FIFO", "a character device", ...; else None.

    >>> special_kind("/dev/null"), special_kind("/no/such/file")
    ('a character device', None)
    """
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # absent, or its folder is not one: the write says why
        return None
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        return None
    return kind_of(mode)


def kind_of(mode: int) -> str:
    """The kind of a file from its `st_mode`, as a phrase ("a file" for a regular one, "a FIFO", ...)."""
    for test, name in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def refuse_special(path: Path, what: str) -> None:
    """BadInput when `path` is a device, FIFO, socket or folder: evalkit writes only regular files."""
    kind = special_kind(path)
    if kind is not None:
        raise BadInput(f"{what} {path} is {kind}, not a regular file; evalkit writes only regular files "
                       "(choose a new path)")


def _same(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return a.resolve() == b.resolve()


def _protected(paths: Iterable[str | os.PathLike | None]) -> list[Path]:
    out = []
    for p in paths:
        if p:
            p = Path(p)
            out += [p, Path(str(p) + ".wal")]
    return out


def is_duckdb_file(path: Path) -> bool:
    """A DuckDB file is a regular file carrying the magic bytes 'DUCK' at offset 8; an empty file,
    a FIFO (opened without waiting, never read) or a device is not one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.pread(fd, 12, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return len(head) == 12 and head[8:12] == b"DUCK"


def _refuse_overwrite(path: Path, what: str, protected: list[Path]) -> None:
    for p in protected:
        if _same(path, p):
            raise BadInput(f"{what} {path} is {p}, which this command reads; choose another path")
    if path.is_file():
        if is_duckdb_file(path):
            raise BadInput(f"{what} {path} is a DuckDB database; evalkit does not overwrite one")


def check_output_file(path: str | os.PathLike, what: str, protect: Iterable[str | os.PathLike | None] = (),
                      append: bool = False) -> Path:
    """Refuse an output file path that cannot or must not be written; return it as a Path.

    append: the file is appended to (`append_file`), so a link there is refused; otherwise
    it is replaced (`write_file`), which needs its folder writable.
    """
    path = Path(path)
    if append and path.is_symlink():
        raise BadInput(f"{what} {path} is a symbolic link; evalkit does not append through links")
    if path.is_dir():
        raise BadInput(f"{what} {path} is a folder, not a file")
    refuse_special(path, what)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise BadInput(f"cannot write {what} {path}: its folder does not exist")
    _refuse_overwrite(path, what, _protected(protect))
    if append:
        writable = os.access(path, os.W_OK) if path.exists() else os.access(parent, os.W_OK)
    else:  # a link is replaced, whatever its target allows
        writable = os.access(parent, os.W_OK) and (path.is_symlink() or not path.exists()
                                                   or os.access(path, os.W_OK))
    if not writable:
        raise BadInput(f"cannot write {what} {path}: permission denied")
    return path


def check_output_dir(path: str | os.PathLike, what: str, names: Iterable[str] = (),
                     protect: Iterable[str | os.PathLike | None] = (), whole: bool = False) -> Path:
    """Refuse an output folder (created if missing) that cannot hold `names` without
    overwriting the DB or an input; return it as a Path.

    whole: the folder is replaced as a whole (`atomic_folder`), so it may hold nothing but
    `names`, must not be a link to nothing, and the folder it sits in must be writable.
    """
    path = Path(path)
    names = list(names)
    if path.exists() and not path.is_dir():
        kind = kind_of(path.stat().st_mode)
        raise BadInput(f"{what} {path} is {kind}, not a folder")
    if whole and path.is_symlink() and not path.exists():
        raise BadInput(f"{what} {path} is a symbolic link to nothing; remove it or choose another folder")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if whole and existing == path:  # the folder is renamed, so the one above it is written
        existing = Path(os.path.realpath(path)).parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise BadInput(f"cannot write {what} {path}: {existing} is not a writable folder")
    if whole and path.is_dir():
        strangers = sorted(set(os.listdir(path)) - set(names))
        if strangers:
            raise BadInput(f"cannot write {what} {path}: it holds {strangers[0]}, which is not part of what "
                           f"evalkit writes there and would be removed; choose an empty or new folder")
    protected = _protected(protect)
    for name in names:
        target = path / name
        if target.is_dir() and not target.is_symlink():
            raise BadInput(f"cannot write {what} {path}: {target} is a folder")
        refuse_special(target, what)
        _refuse_overwrite(target, what, protected)
    return path


# ------------------------------------------------------------------ writing


def _cannot(what: str, path: Path, exc: OSError) -> BadInput:
    reason = (exc.strerror or str(exc) or type(exc).__name__).replace("\n", " ")
    return BadInput(f"cannot write {what} {path}: {reason}")


def _temp_name(folder: Path, name: str, kind: str) -> Path:
    """A free-looking dot-name beside `name`: `.NAME.KIND-<random>` (created with O_EXCL or mkdir)."""
    return folder / f".{name[:_NAME_KEEP]}.{kind}-{secrets.token_hex(6)}"


def _fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable; some file systems cannot sync a folder, which is no error."""
    with contextlib.suppress(OSError):
        _fsync(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


def write_file(path: str | os.PathLike, data: str | bytes, what: str = "output") -> Path:
    """Write `data` (str as UTF-8) to `path` atomically, replacing a file or link there; return the path.

    Raises BadInput (one line naming the path) when it cannot be written, or when `path` is a
    device, FIFO, socket or folder (checked again just before the rename).
    """
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    folder = path.parent
    tmp = _temp_name(folder, path.name, "tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as exc:
        raise _cannot(what, path, exc) from None
    try:
        try:
            write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        refuse_special(path, what)  # again at the rename: a path that became a device is never replaced
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _cannot(what, path, exc) from None
        raise
    _fsync_folder(folder)
    return path


def append_file(path: str | os.PathLike, text: str, what: str = "output") -> Path:
    """Append `text` (UTF-8) to `path`, created if missing; a link, or anything but a regular
    file at `path` (a device, a FIFO: opened without waiting, then checked), is refused (BadInput)."""
    path = Path(path)
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_CLOEXEC", 0))
    refuse_special(path, what)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) or path.is_symlink():
            raise BadInput(f"{what} {path} is a symbolic link; evalkit does not append through links") from None
        refuse_special(path, what)  # a FIFO without a reader: ENXIO
        raise _cannot(what, path, exc) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise BadInput(f"{what} {path} is {kind_of(mode)}, not a regular file; evalkit writes only regular files "
                           "(choose a new path)")
        write_all(fd, text.encode("utf-8"))
    except OSError as exc:
        raise _cannot(what, path, exc) from None
    finally:
        os.close(fd)
    return path


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of `data` to the open file `fd` (os.write may take less than it is given)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _swap_in(new: Path, target: Path) -> None:
    """Put folder `new` at `target`: the old folder there renamed aside, `new` renamed in, the old removed."""
    aside = _temp_name(target.parent, target.name, "old") if os.path.lexists(target) else None
    if aside is not None:
        os.rename(target, aside)
    try:
        os.rename(new, target)
    except BaseException:
        if aside is not None and not os.path.lexists(target):
            os.rename(aside, target)
        raise
    _fsync_folder(target.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def atomic_folder(path: str | os.PathLike, what: str = "output") -> Iterator[Path]:
    """Yield a new empty folder beside `path` to fill; when the block ends without an error it
    replaces `path` whole (its files synced first), else it is removed and `path` is untouched.

    `path` may be a link to a folder: the folder it points to is replaced and the link kept.
    Check it first with `check_output_dir(..., whole=True)`. Raises BadInput (one line naming
    the path) when the folder cannot be made or swapped in; errors of the block pass unchanged.
    """
    path = Path(path)
    target = Path(os.path.realpath(path))
    if os.path.lexists(target) and not target.is_dir():  # a FIFO or device is never renamed aside and removed
        raise BadInput(f"{what} {path} is {kind_of(os.lstat(target).st_mode)}, not a folder")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        new = _temp_name(target.parent, target.name, "new")
        os.mkdir(new, 0o777)
        if target.is_dir():  # keep the folder's own permissions
            os.chmod(new, target.stat().st_mode & 0o7777)
    except OSError as exc:
        raise _cannot(what, path, exc) from None
    try:
        yield new
        try:
            for entry in new.iterdir():
                if entry.is_file():
                    _fsync(entry)
            _fsync_folder(new)
            _swap_in(new, target)
        except OSError as exc:
            raise _cannot(what, path, exc) from None
    finally:
        if new.exists():
            shutil.rmtree(new, ignore_errors=True)


MAX_YAML_BYTES = 4 << 20  # a templates file or an opener lexicon: small files a person writes


def shown(path: str | os.PathLike) -> str:
    """A path as a message shows it: a byte that is not UTF-8 as `\\xNN`, never a lone surrogate.

    >>> shown(os.fsdecode(b"/tmp/a\\xffb.duckdb"))
    '/tmp/a\\\\xffb.duckdb'
    """
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def utf8_path(path: str | os.PathLike, what: str) -> str:
    """`path` as text DuckDB can take: BadInput (one line) when it holds a byte that is not UTF-8,
    which DuckDB's own path handling cannot represent (it fails inside with std::bad_cast)."""
    text = os.fspath(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise BadInput(f"{what} {shown(path)} holds a byte that is not UTF-8; DuckDB opens only UTF-8 paths "
                       "(rename it, or choose another path)") from None
    return text


def distrust(st: os.stat_result, private: bool = False) -> str | None:
    """Why a file or folder (its `os.lstat`) is not one evalkit may take as its own: not this user's,
    or writable by others (`private`: open to them at all); None when it may. The one rule of
    evalkit's own folders and files: the spool's, every cache's (`cachedir`)."""
    uid = os.geteuid() if hasattr(os, "geteuid") else st.st_uid
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not {uid}"
    if st.st_mode & (0o077 if private else 0o022):
        return f"open to other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


@contextlib.contextmanager
def open_input(path: str | os.PathLike, what: str, limit: int, *, follow_links: bool = True,
               owned: bool = False) -> Iterator[_Capped]:
    """An input file the user (or another process) handed evalkit, open for reading in binary.

    The one door for untrusted input files: BadInput (one line naming `what` and the path)
    when it is missing or unreadable, a link and `follow_links` is off, not a regular file (a
    device such as /dev/zero, a FIFO, a socket, a folder: opened without waiting, never
    read), larger than `limit` bytes, or, when `owned` (a file evalkit wrote for itself: a
    cache entry), another user's or writable by others (`distrust`). Read it whole
    (`read_input`) or line by line (`read_lines`); both stop at `limit` even when the file
    grows while read.
    """
    p = Path(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)  # a FIFO opens without waiting for a writer
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(p, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:
            raise BadInput(f"cannot read {what} {p}: it is a symbolic link, not a regular file") from None
        raise BadInput(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"cannot read {what} {p}: it is {kind_of(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise BadInput(f"{what} {p} is {st.st_size:,} bytes; at most {limit:,} are read")
        why = distrust(st) if owned else None
        if why:
            raise BadInput(f"{what} {p} is {why}; evalkit reads only its own files here")
        os.set_blocking(fd, True)
        fh = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with fh:
        yield _Capped(fh, p, what, limit)


class _Capped:
    """A binary reader that refuses to go past `limit` bytes (a file that grew after its size was read)."""

    def __init__(self, fh: BinaryIO, path: Path, what: str, limit: int) -> None:
        self._fh, self._path, self._what, self._limit, self.consumed = fh, path, what, limit, 0

    def _count(self, data: bytes) -> bytes:
        self.consumed += len(data)
        if self.consumed > self._limit:
            raise BadInput(f"{self._what} {self._path} is over {self._limit:,} bytes")
        return data

    def read(self, size: int = -1) -> bytes:
        left = self._limit + 1 - self.consumed
        try:
            return self._count(self._fh.read(left if size < 0 else min(size, left)))
        except OSError as exc:
            raise BadInput(f"cannot read {self._what} {self._path}: {exc.strerror or exc}") from None

    def readline(self, size: int = -1) -> bytes:
        left = self._limit + 1 - self.consumed
        try:
            return self._count(self._fh.readline(left if size < 0 else min(size, left)))
        except OSError as exc:
            raise BadInput(f"cannot read {self._what} {self._path}: {exc.strerror or exc}") from None

    def fileno(self) -> int:
        return self._fh.fileno()


def read_input(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """A file the user names as input, read whole; BadInput (one line) when it is missing or
    unreadable, not a regular file (a device such as /dev/zero, a FIFO, a folder: never read,
    never waited on), or larger than `limit` bytes (see `open_input`)."""
    with open_input(path, what, limit) as fh:
        return fh.read()


def read_lines(fh: _Capped, what: str, path: str | os.PathLike, max_line: int) -> Iterator[bytes]:
    """The lines of a file from `open_input`, one at a time (each with its newline, the last one
    perhaps without); BadInput when a line is longer than `max_line` bytes, so a file of one
    endless line is never held whole."""
    while True:
        line = fh.readline(max_line + 1)
        if not line:
            return
        if len(line) > max_line and not line.endswith(b"\n"):
            raise BadInput(f"{what} {path} has a line longer than {max_line:,} bytes")
        yield line


ANY_SIZE = 1 << 62  # `open_input`'s limit for a file of any size (model weights: hashed, never held)


def file_sha256(path: str | os.PathLike, what: str = "file") -> str:
    """The SHA-256 of a file's bytes, read now in 1 MiB blocks (a kept run's, a converted model's,
    a model's weights); BadInput when it is not a regular file (`open_input`: a FIFO is never waited on)."""
    digest = hashlib.sha256()
    with open_input(path, what, ANY_SIZE) as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_input_path(path: str | os.PathLike, what: str, kind: str = "file",
                     limit: int | None = None) -> Path:
    """The door for inputs a library opens by path (transformers, tokenizers, gguf, llama.cpp): BadInput
    (one line naming `what` and the path) unless `path` is a regular file (`kind="file"`, at most
    `limit` bytes), a folder (`"folder"`) or either (`"either"`), links followed. A folder's own
    entries are checked too, since the library opens those by name: any that is a FIFO, a
    device or a socket is refused (a FIFO would hold the load forever, a device feed it without
    end). Returns the path as a Path.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as exc:
        raise BadInput(f"cannot read {what} {p}: {exc.strerror or exc}") from None
    wanted = {"file": (stat.S_ISREG,), "folder": (stat.S_ISDIR,), "either": (stat.S_ISREG, stat.S_ISDIR)}[kind]
    if not any(test(st.st_mode) for test in wanted):
        expected = {"file": "a regular file", "folder": "a folder", "either": "a regular file or a folder"}[kind]
        raise BadInput(f"cannot read {what} {p}: it is {kind_of(st.st_mode)}, not {expected}")
    if stat.S_ISREG(st.st_mode) and limit is not None and st.st_size > limit:
        raise BadInput(f"{what} {p} is {st.st_size:,} bytes; at most {limit:,} are read")
    if stat.S_ISDIR(st.st_mode):
        try:
            entries = list(os.scandir(p))
        except OSError as exc:
            raise BadInput(f"cannot read {what} {p}: {exc.strerror or exc}") from None
        for entry in sorted(entries, key=lambda e: e.name):
            try:
                mode = entry.stat().st_mode  # links followed: the library follows them too
            except OSError:
                continue  # a dangling link: the library names it when it needs it
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise BadInput(f"cannot read {what} {p}: {entry.name} in it is {kind_of(mode)}, not a regular file")
    return p
