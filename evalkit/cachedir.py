"""Every cache evalkit keeps on disk, under one rule: the name lists and GGUF stamps (`memo`, in
`names/`) and the converted models (`engines.transformers.convert`, in `models/`), all under
`$EVALKIT_CACHE` (`envvars.cache`).

The rule, the spool folder's (`paths.distrust`): a cache folder or file is evalkit's own only
when it is of this user's and writable by no one else; `names/`, `models/` and everything under
them must be real folders and regular files, not links (the cache root itself may be a link the
user made). What fails is **ignored**, with one warning line: it is never read, written into or
removed (a cache file evalkit writes in its own folder replaces one by rename), and the run goes
on as with the cache off for what it would have held (a name list computed again, a GGUF
converted in memory at each load). Files are created with
O_CREAT|O_EXCL|O_NOFOLLOW (mode 0600) under a random name and renamed into place, so a planted
link is never followed and its target never written; they are read through `paths.open_input`
(not through a link, not a FIFO, this user's, size-limited).

Owns: `folder`, `read`, `write`, `create`, `problem`. Does not: decide what is kept or when it
is stale (`memo` and `convert` do).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from pathlib import Path

from evalkit import envvars
from evalkit.errors import BadInput
from evalkit.paths import distrust, kind_of, open_input, write_all

log = logging.getLogger(__name__)
_warned: set[str] = set()
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def warn(text: str) -> None:
    """One warning line per distinct message per process: a cache ignored is said once, not per read."""
    if text not in _warned:
        _warned.add(text)
        log.warning("evalkit: %s", text)


def _why(path: Path, st: os.stat_result, want_folder: bool) -> str | None:
    if want_folder and not stat.S_ISDIR(st.st_mode) or not want_folder and not stat.S_ISREG(st.st_mode):
        return f"{kind_of(st.st_mode)}, not {'a folder' if want_folder else 'a regular file'}"
    return distrust(st)


def _ignored(path: Path, why: str) -> None:
    warn(f"the cache entry {path} is {why}; evalkit ignores it (remove it, or fix its owner and mode)")


def folder(kind: str, make: bool = True) -> Path | None:
    """`$EVALKIT_CACHE/<kind>`, made (mode 0700) when missing and `make`; None when the cache is off,
    when it is missing and not `make`, or (one warning) when it or the cache root breaks the rule.
    OSError when it cannot be made."""
    root = envvars.cache()
    if root is None:
        return None
    sub = root / kind
    if make:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileExistsError):
            os.mkdir(sub, 0o700)
    try:
        why = _why(root, os.stat(root), True)  # the root: links followed, the user may have made one
        where = root
        if why is None:
            why, where = _why(sub, os.lstat(sub), True), sub
    except FileNotFoundError:
        return None
    if why:
        _ignored(where, why)
        return None
    return sub


def problem(path: Path) -> str | None:
    """Why the cache entry at `path` (a file, or a folder and every file in it) breaks the rule
    (one warning, as it is then ignored); None when it keeps it, or when it is absent."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    why = _why(path, st, stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode))
    if why is None and stat.S_ISDIR(st.st_mode):
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            inner = _why(Path(entry.path), entry.stat(follow_symlinks=False), False)
            if inner:
                why = f"a folder holding {entry.name}, which is {inner}"
                break
    if why:
        _ignored(path, why)
    return why


def read(path: Path, limit: int) -> bytes | None:
    """The bytes of the cache file at `path`; None when it is absent, or (one warning) when it breaks
    the rule: a link, not a regular file (a FIFO is never waited on), another user's, writable by
    others, or over `limit` bytes."""
    try:
        with open_input(path, "cache entry", limit, follow_links=False, owned=True) as fh:
            return fh.read()
    except BadInput as exc:
        if os.path.lexists(path):
            warn(f"{exc}; evalkit ignores it")
        return None


def create(path: Path, data: bytes) -> None:
    """Create the file `path` with `data` (mode 0600): O_CREAT|O_EXCL|O_NOFOLLOW, so whatever is at
    `path` already — a planted link above all — is an error (FileExistsError), never followed."""
    fd = os.open(path, _CREATE, 0o600)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def write(path: Path, data: bytes) -> None:
    """Put `data` at `path` in a cache folder: `create`d under a new random name beside it, then renamed
    over `path` (a link there is replaced itself, its target untouched). OSError when it cannot."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        create(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
