"""GGUF models converted once: dequantised weights and a fast tokenizer kept in a cache folder.

Loading a GGUF through transformers parses and dequantises every tensor and converts the
tokenizer, every time (25-35 s for the 98 MB default model on 2 cores). The first load of
a GGUF file here saves what transformers made of it — the weights as safetensors, the
config, the generation config and the fast tokenizer — in `$EVALKIT_CACHE/models/<sha256
of the file>/`, and later loads read that folder instead: the same tensors, a few seconds.

Owns: where the cache lives (`$EVALKIT_CACHE`, default `$XDG_CACHE_HOME/evalkit` or
`~/.cache/evalkit`; `none` turns it off), the conversion (written to a temporary folder
and renamed when complete, so two processes converting at once never see half a folder),
and `cached_args`, which swaps a GGUF's model args for the converted folder. Does not:
load the model for a run (`models.load` does, through lm-eval's HFLM).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from evalkit import envvars
from evalkit.errors import BadInput

DONE = "evalkit-converted.txt"  # written last: the folder is complete


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


def sha256(path: Path) -> str:
    """The file's sha256, read once per process while the file is unchanged."""
    st = path.stat()
    return _sha256(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert(gguf: Path, folder: Path, trust_remote_code: bool = False) -> Path:
    """Load `gguf` with transformers and save its model and tokenizer as a plain folder at `folder`."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    folder.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  trust_remote_code=trust_remote_code)
        # transformers keeps a GGUF model marked as quantized (its quantizer refuses to save), though
        # its weights are plain dequantised tensors: unmark it so they save as they are
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(work, safe_serialization=True)
        tokenizer.save_pretrained(work)
        (work / DONE).write_text(f"converted from {gguf}\n", encoding="utf-8")
        try:
            os.replace(work, folder)
        except OSError:  # another process finished the same conversion first: keep theirs
            if not (folder / DONE).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def cached_args(args: dict[str, Any]) -> dict[str, Any]:
    """`args` with a GGUF swapped for its converted folder (converting it on first use);
    `args` unchanged when the cache is off or they name no local GGUF file."""
    root, gguf = cache_root(), gguf_path(args)
    if root is None or gguf is None:
        return args
    folder = root / "models" / sha256(gguf)
    if not (folder / DONE).is_file():
        try:
            convert(gguf, folder, bool(args.get("trust_remote_code")))
        except OSError as exc:
            raise BadInput(f"cannot write the converted-model cache at {folder} ({exc.strerror or exc}); "
                           "set EVALKIT_CACHE to a writable folder, or EVALKIT_CACHE=none") from exc
    out = {k: v for k, v in args.items() if k not in ("gguf_file", "tokenizer")}
    out["pretrained"] = str(folder)
    return out
