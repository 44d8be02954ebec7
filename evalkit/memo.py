"""Names that cost seconds of imports or parsing to learn, remembered on disk for as long as what they came from.

`--model-args` is checked before the model loads (SPEC §4: within 2 s), but the keys an hf model
takes come from importing lm-eval, transformers and torch (about 5 CPU-seconds): the parameters of
HFLM and `from_pretrained`, and the attributes of the model's config. They change only when those
packages, evalkit's own model class, or the model's config file change, so `names` computes them
once per such identity and keeps them in the cache folder (`EVALKIT_CACHE`); with the cache off it
computes them every time. `counts` keeps a GGUF's tensor types the same way (the run row's
`gguf_tensor_types`: parsing the file's metadata costs about 2 CPU-seconds a load), keyed by the
file's stamp. A file that does not read as what was written is recomputed and replaced, never
trusted; the folder and its files follow the rule of every cache evalkit keeps (`cachedir`: this
user's, writable by no one else, created without following links; what breaks it is ignored). Does not: decide anything about the names (the caller does, the same way either way).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from evalkit import cachedir
from evalkit.version import __version__

FORMAT = 1
MAX_BYTES = 1 << 20  # a remembered list is a few kB; anything larger is not one of ours


def package_version(name: str) -> str | None:
    """An installed distribution's version, read from its metadata (no import); None if absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def file_stamp(path: str | os.PathLike) -> dict[str, Any]:
    """What says a file is still the one a name list came from: its path, size and mtime (ns)."""
    st = os.stat(path)
    return {"path": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def module_stamp(module: str) -> dict[str, Any] | None:
    """`file_stamp` of a module's source, found without importing it (its parents are imported)."""
    spec = importlib.util.find_spec(module)
    return file_stamp(spec.origin) if spec and spec.origin and os.path.isfile(spec.origin) else None


def names(kind: str, identity: dict[str, Any], compute: Callable[[], Iterable[str]]) -> frozenset[str]:
    """`compute()`'s names, from the cache folder when they were computed for this very identity."""
    kept = _remembered(kind, identity, lambda: sorted(compute()),
                       lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v))
    return frozenset(kept)


def counts(kind: str, identity: dict[str, Any], compute: Callable[[], dict[str, int] | None]) -> dict[str, int] | None:
    """`compute()`'s {name: count}, from the cache folder when they were computed for this very identity;
    None (nothing to tell) is not kept."""
    return _remembered(kind, identity, compute,
                       lambda v: isinstance(v, dict) and all(isinstance(k, str) and type(n) is int for k, n in v.items()))


def entry(kind: str, identity: dict[str, Any]) -> tuple[Path | None, dict[str, Any]]:
    """Where the list of `kind` for `identity` is kept (None: the cache is off or ignored, see
    `cachedir`), and the identity as written beside it."""
    identity = {"format": FORMAT, "evalkit": __version__, "kind": kind, **identity}
    text = json.dumps(identity, sort_keys=True, default=str)
    try:
        folder = cachedir.folder("names")
    except OSError:  # cannot be made: computed every time
        folder = None
    path = None if folder is None else folder / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"
    return path, json.loads(text)


def _remembered(kind: str, identity: dict[str, Any], compute: Callable[[], Any], valid: Callable[[Any], bool]) -> Any:
    """`compute()`'s JSON value, kept under the cache folder's `names/` keyed by `identity`; a kept file
    that does not read as what was written for this identity, or whose value is not `valid`, is
    recomputed and replaced; one that breaks the cache's rule (`cachedir`) is ignored."""
    path, written = entry(kind, identity)
    if path is None:
        return compute()
    kept = _read(path, written)
    if kept is not None and valid(kept):
        return kept
    found = compute()
    if found is not None:
        _write(path, {"identity": written, "names": found})
    return found


def _read(path: Path, identity: dict[str, Any]) -> Any:
    raw = cachedir.read(path, MAX_BYTES)
    try:
        data = None if raw is None else json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("identity") != identity:
        return None
    return data.get("names")


def _write(path: Path, data: dict[str, Any]) -> None:
    """Best effort: a cache that cannot be written costs the next run the same seconds, nothing more."""
    try:
        cachedir.write(path, json.dumps(data).encode("utf-8"))
    except OSError:
        pass
