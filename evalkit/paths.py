"""Files evalkit writes for the user, checked before any work: never the DB, never an input.

Owns: `check_output_file` (`--junit`, `$GITHUB_STEP_SUMMARY`) and `check_output_dir`
(`report --out`, `export --parquet`, `needle-heatmap --out`): a path that is a folder
where a file is wanted (or the reverse), whose folder is missing or not writable, that
is the DB, its WAL or an input file of the same command, or that holds any DuckDB file
is refused with one line (BadInput), before anything is read or written. Does not:
write anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from evalkit.errors import BadInput


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


def _refuse_overwrite(path: Path, what: str, protected: list[Path]) -> None:
    for p in protected:
        if _same(path, p):
            raise BadInput(f"{what} {path} is {p}, which this command reads; choose another path")
    if path.is_file():
        from evalkit.store.db import is_duckdb_file

        if is_duckdb_file(path):
            raise BadInput(f"{what} {path} is a DuckDB database; evalkit does not overwrite one")


def check_output_file(path: str | os.PathLike, what: str, protect: Iterable[str | os.PathLike | None] = ()) -> Path:
    """Refuse an output file path that cannot or must not be written; return it as a Path."""
    path = Path(path)
    if path.is_dir():
        raise BadInput(f"{what} {path} is a folder, not a file")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise BadInput(f"cannot write {what} {path}: its folder does not exist")
    _refuse_overwrite(path, what, _protected(protect))
    if path.exists() and not os.access(path, os.W_OK) or not path.exists() and not os.access(parent, os.W_OK):
        raise BadInput(f"cannot write {what} {path}: permission denied")
    return path


def check_output_dir(path: str | os.PathLike, what: str, names: Iterable[str] = (),
                     protect: Iterable[str | os.PathLike | None] = ()) -> Path:
    """Refuse an output folder (created if missing) that cannot hold `names` without
    overwriting the DB or an input; return it as a Path."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise BadInput(f"{what} {path} is a file, not a folder")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise BadInput(f"cannot write {what} {path}: {existing} is not a writable folder")
    protected = _protected(protect)
    for name in names:
        target = path / name
        if target.is_dir():
            raise BadInput(f"cannot write {what} {path}: {target} is a folder")
        _refuse_overwrite(target, what, protected)
    return path
