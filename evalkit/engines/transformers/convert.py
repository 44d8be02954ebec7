"""GGUF models converted once: dequantised weights and a fast tokenizer kept in a cache folder.

Loading a GGUF through transformers parses and dequantises every tensor and converts the
tokenizer, every time (25-35 s for the 98 MB default model on 2 cores). The first load of
a GGUF file here saves what transformers made of it — the weights as safetensors, the
config, the generation config and the fast tokenizer — in `$EVALKIT_CACHE/models/<sha256
of the file>/`, and later loads read that folder instead: the same tensors, a few seconds.

Owns: where the cache lives (`$EVALKIT_CACHE`, default `$XDG_CACHE_HOME/evalkit` or
`~/.cache/evalkit`; `none` turns it off), the conversion (written to a temporary folder
and renamed when complete, so two processes converting at once never see half a folder),
`cached_args`, which swaps a GGUF's model args for the converted folder, and reading a
GGUF's header (`gguf_model_type`: the `gguf` package's own parser) to refuse a file that is
not a GGUF transformers can load before anything is written. Does not: load the model for a
run (`engines.resolve.load` does, through lm-eval's HFLM).

Every use checks the folder against what was written. The conversion records, before its
DONE marker, a manifest (`evalkit-manifest.json`: each file's name, size, mtime_ns and
sha256); `cached_args` then rehashes every file on every load and compares it with the
manifest, and a changed, missing or added file, or a missing or unreadable manifest, has
the folder converted again from the GGUF (one warning line naming the file) — or, when it
cannot be rewritten, refused with BadInput. It rehashes every time rather than trusting an
unchanged size and mtime_ns, because a rewrite that restores both would pass a stat check,
and the hashes are cheap next to the load they guard: sha256 reads 100 MB in 0.09 s here
(2 loaded cores, SHA-NI), the default model's converted folder (538 MB of float32
safetensors) in 0.5 s, against a few seconds to load it. The stat fields are kept for a
reader of the manifest; only a size that differs skips the hash.

The folder follows the rule of every cache evalkit keeps (`cachedir`): `models/` and each
converted folder are this user's and writable by no one else, their files regular files (not
links); one that breaks it is ignored with one warning (the GGUF is then loaded and converted in
memory, never kept), neither read nor removed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from evalkit import cachedir, envvars
from evalkit.errors import BadInput
from evalkit.engines.plan import sha256
from evalkit.loaderrors import loading
from evalkit.paths import check_input_path, file_sha256

DONE = "evalkit-converted.txt"  # written last: the folder is complete
MANIFEST = "evalkit-manifest.json"  # written before DONE: {"files": {name: {size, mtime_ns, sha256}}}
MANIFEST_FORMAT = 1
MAX_MANIFEST_BYTES = 16 << 20  # a name, size, mtime and sha256 per file: kB for any model
# llama.cpp's architecture names that transformers spells otherwise (its load_gguf_checkpoint)
GGUF_ARCHITECTURES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss",
                      "minimax-m2": "minimax_m2"}
log = logging.getLogger(__name__)


def cache_root() -> Path | None:
    """The cache folder, or None when `EVALKIT_CACHE=none` (see `envvars.cache`)."""
    return envvars.cache()


def gguf_path(args: dict[str, Any]) -> Path | None:
    """The GGUF file named by `pretrained` + `gguf_file`, when it is a local file."""
    gguf, pretrained = args.get("gguf_file"), args.get("pretrained")
    if not gguf or not isinstance(pretrained, str):
        return None
    path = Path(gguf) if Path(gguf).is_absolute() else Path(pretrained) / gguf
    return path if path.is_file() else None


def gguf_model_type(path: Path) -> str:
    """The transformers model type of the GGUF file at `path`, read from its header with the
    `gguf` package's own reader; BadInput naming the path when the file is not a GGUF (a text
    file, a truncated download) or holds an architecture transformers cannot load."""
    st = path.stat()
    return _gguf_model_type(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _gguf_model_type(path: str, size: int, mtime_ns: int) -> str:
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    check_input_path(path, "GGUF file", "file")  # the reader maps the file: a FIFO or device is no GGUF
    try:
        architecture = GGUFReader(path).fields["general.architecture"].contents()
    except KeyError:
        raise BadInput(f"{path} is a GGUF file without general.architecture") from None
    except Exception as exc:  # noqa: BLE001  (whatever the parser fails on, the file is no GGUF it can read)
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadInput(f"{path} is not a readable GGUF file ({why})") from exc
    model_type = GGUF_ARCHITECTURES.get(str(architecture), str(architecture))
    if model_type not in GGUF_SUPPORTED_ARCHITECTURES or model_type in ("general", "tokenizer"):
        raise BadInput(f"{path}: transformers cannot load a GGUF of architecture {architecture!r}")
    return model_type


def write_manifest(folder: Path) -> None:
    """Record each file of `folder` (but the manifest and DONE): its size, mtime_ns and sha256."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.name in (MANIFEST, DONE):
            continue
        st = path.stat()
        files[path.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": file_sha256(path)}
    text = json.dumps({"format": MANIFEST_FORMAT, "files": files}, indent=1, sort_keys=True)
    cachedir.create(folder / MANIFEST, (text + "\n").encode("utf-8"))


def changed(folder: Path) -> str | None:
    """Why `folder` no longer holds what was written to it (a missing or unreadable manifest, a
    file missing, added or changed), or None when every file hashes as the manifest says.

    Every file is rehashed (see the module docstring); a size that differs skips the hash."""
    raw = cachedir.read(folder / MANIFEST, MAX_MANIFEST_BYTES)
    if raw is None and not os.path.lexists(folder / MANIFEST):
        return f"{MANIFEST} is missing"
    try:
        files = json.loads((raw or b"").decode("utf-8"))["files"]
        written = {name: (int(rec["size"]), str(rec["sha256"])) for name, rec in files.items()}
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return f"{MANIFEST} is unreadable"
    present = {p.name for p in folder.iterdir()} - {MANIFEST, DONE}
    missing, added = sorted(set(written) - present), sorted(present - set(written))
    if missing:
        return f"{missing[0]} is missing"
    if added:
        return f"{added[0]} was added"
    for name, (size, digest) in sorted(written.items()):
        path = folder / name
        try:
            same = path.is_file() and path.stat().st_size == size and file_sha256(path, "cached file") == digest
        except (OSError, BadInput):  # gone, or no longer a regular file
            same = False
        if not same:
            return f"{name} changed since it was written"
    return None


def convert(gguf: Path, folder: Path, trust_remote_code: bool = False) -> Path:
    """Load `gguf` with transformers and save its model and tokenizer as a plain folder at `folder`."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evalkit.progress import phases

    transformers.utils.logging.disable_progress_bar()
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        # the first load of a GGUF here: ~45 s on 2 idle cores for the default model, minutes under load
        with phases(f"converting {gguf.name} once into the model cache", CONVERT_STEPS) as step:
            step(CONVERT_STEPS[0])
            check_input_path(gguf, "GGUF file", "file")
            with _quiet_tensor_bar(), loading("GGUF model", gguf):
                model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                             trust_remote_code=trust_remote_code)
            step(CONVERT_STEPS[1])
            with loading("GGUF tokenizer", gguf):
                tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                          trust_remote_code=trust_remote_code)
            # transformers keeps a GGUF model marked as quantized (its quantizer refuses to save), though
            # its weights are plain dequantised tensors: unmark it so they save as they are
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            step(CONVERT_STEPS[2])
            model.save_pretrained(work, safe_serialization=True)
            tokenizer.save_pretrained(work)
            step(CONVERT_STEPS[3])
            for path in work.iterdir():  # the cache's rule: writable by no one else, whatever the umask
                path.chmod(path.stat().st_mode & ~0o022)
            write_manifest(work)
            cachedir.create(work / DONE, f"converted from {gguf}\n".encode("utf-8"))
        try:
            os.replace(work, folder)
        except OSError:  # another process finished the same conversion first: keep theirs
            if not (folder / DONE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


CONVERT_STEPS = ("reading and dequantizing the weights", "converting the tokenizer", "saving safetensors",
                 "hashing the files")


@contextlib.contextmanager
def _quiet_tensor_bar():
    """transformers' own bar over the GGUF's tensors (its last seconds only) off: the phase bar counts."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    real = getattr(gguf_utils, "tqdm", None)
    if real is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(real, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = real


def cached_folder(gguf: Path, make: bool = False) -> Path | None:
    """Where the GGUF file `gguf` is (or would be) kept converted; None when the cache is off, or
    when the models folder or this entry breaks the cache's rule (`cachedir`: one warning, and
    the GGUF is loaded without the cache). `make`: the models folder is made when missing (OSError
    when it cannot be)."""
    models = cachedir.folder("models", make)
    if models is None:
        return None
    folder = models / sha256(gguf)
    return None if cachedir.problem(folder) else folder


def cached_args(args: dict[str, Any]) -> dict[str, Any]:
    """`args` with a GGUF swapped for its converted folder (converting it on first use, and again
    when the folder no longer holds what was written: `changed`); `args` unchanged when the
    cache is off or they name no local GGUF file."""
    gguf = gguf_path(args)
    if gguf is None:
        return args
    try:
        folder = cached_folder(gguf, make=True)
    except OSError as exc:
        raise BadInput(f"cannot write the converted-model cache at {cache_root()} ({exc.strerror or exc}); "
                       "set EVALKIT_CACHE to a writable folder, or EVALKIT_CACHE=none") from exc
    if folder is None:
        return args
    why = changed(folder) if (folder / DONE).is_file() else None
    if why is not None:
        log.warning("evalkit: %s/%s; converting again", folder, why)
    if why is not None or not (folder / DONE).is_file():
        try:
            _discard(folder)
            convert(gguf, folder, bool(args.get("trust_remote_code")))
        except OSError as exc:
            raise BadInput(f"cannot write the converted-model cache at {folder} ({exc.strerror or exc}); "
                           "set EVALKIT_CACHE to a writable folder, or EVALKIT_CACHE=none") from exc
    out = {k: v for k, v in args.items() if k not in ("gguf_file", "tokenizer")}
    out["pretrained"] = str(folder)
    return out


def _discard(folder: Path) -> None:
    """Move `folder` aside and delete it (gone already: nothing to do); a process reading it
    keeps its open files."""
    if not folder.exists():
        return
    trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
    try:
        os.replace(folder, trash)
    except FileNotFoundError:  # another process discarded it first
        pass
    finally:
        shutil.rmtree(trash, ignore_errors=True)
