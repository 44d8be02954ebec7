"""What a model's own files say it is: its name, architecture and file type, for every run's row.

Owns: reading a GGUF header's key-value pairs without the gguf package (`gguf_metadata`: strings,
numbers and booleans; arrays skipped), the quantization name of a GGUF file type (`file_type_name`,
llama.cpp's LLAMA_FTYPE numbering as the gguf package names it), and `model_identity(args)`: the
name, architecture and file type of the model a plan's args name — a GGUF's `general.basename` /
`general.name` with its `general.size_label`, `general.architecture`, `general.file_type`; a
Hugging Face folder's config.json `_name_or_path` (else the folder's name), `model_type` and
`torch_dtype`. Does not: load a model, or refuse one (the resolvers check files; a file that does
not read here leaves the identity unknown).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evalkit.errors import BadInput

HEADER_BYTES = 64 << 20  # a GGUF header is far smaller than this for any vocabulary
MAX_CONFIG_BYTES = 16 << 20  # a config.json: kB
# GGUF metadata value types -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
IDENTITY_KEYS = ("general.name", "general.basename", "general.size_label", "general.finetune",
                 "general.architecture", "general.file_type")


def gguf_metadata(path: Path, keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The header's scalar and string values (`keys`: only those, reading stops once all are found;
    None: every one), arrays skipped; BadInput naming the path for a file that is not a GGUF or
    whose header does not read.

    Reads the header only: the gguf package's full reader takes seconds on a big vocabulary."""
    from evalkit.paths import ANY_SIZE, open_input

    with open_input(path, "GGUF file", ANY_SIZE) as fh:  # a regular file; a FIFO is never waited on
        data = fh.read(HEADER_BYTES)
    if data[:4] != b"GGUF":
        raise BadInput(f"{path} is not a GGUF file (no GGUF magic)")
    wanted = set(keys) if keys is not None else None
    found: dict[str, Any] = {}
    at = 24

    def value(kind: int) -> Any:
        nonlocal at
        if kind in _SCALARS:
            got = struct.unpack_from("<" + _SCALARS[kind], data, at)[0]
            at += struct.calcsize(_SCALARS[kind])
            return got
        if kind == 8:
            size = struct.unpack_from("<Q", data, at)[0]
            text = data[at + 8: at + 8 + size].decode("utf-8", "replace")
            at += 8 + size
            return text
        if kind == 9:
            inner, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if inner in _SCALARS:
                at += count * struct.calcsize(_SCALARS[inner])
            else:
                for _ in range(count):
                    value(inner)
            return None
        raise ValueError(f"unknown metadata type {kind}")

    try:
        n_kv = struct.unpack_from("<Q", data, 16)[0]
        for _ in range(n_kv):
            size = struct.unpack_from("<Q", data, at)[0]
            key = data[at + 8: at + 8 + size].decode("utf-8", "replace")
            at += 8 + size
            kind = struct.unpack_from("<I", data, at)[0]
            at += 4
            got = value(kind)
            if wanted is None or key in wanted:
                found[key] = got
                if wanted is not None and wanted <= set(found):
                    break
    except (struct.error, ValueError, OverflowError, RecursionError) as exc:  # Overflow: an offset past any file
        raise BadInput(f"{path}: the GGUF header does not read ({exc})") from None
    return found


def gguf_add_bos(path) -> bool | None:
    """A GGUF file's `tokenizer.ggml.add_bos_token` (None: the file does not say): the declaration the hf
    engine feeds by (`prompts.encoding.set_feed`) where transformers' conversion of the file drops it."""
    value = gguf_metadata(Path(path), ("tokenizer.ggml.add_bos_token",)).get("tokenizer.ggml.add_bos_token")
    return None if value is None else bool(value)


def file_type_name(value: int | None) -> str:
    """A GGUF `general.file_type` as llama.cpp names it, in upper case (Q4_K_M, Q4_1, F16); "unknown"
    when the header has none.

    >>> file_type_name(15), file_type_name(3), file_type_name(None), file_type_name(999)
    ('Q4_K_M', 'Q4_1', 'unknown', 'FILE_TYPE_999')
    """
    if value is None:
        return "unknown"
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(value)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"FILE_TYPE_{value}"


@dataclass(frozen=True)
class ModelIdentity:
    """A model as its files name it (None: not said, or no file to read)."""

    name: str | None  # gemma-3-270m, SmolLM2-135M-Instruct
    arch: str | None  # gemma3, llama
    file_type: str | None  # Q4_K_M, Q4_1 (a GGUF), bfloat16 (a config's torch_dtype)


UNKNOWN = ModelIdentity(None, None, None)


def gguf_name(meta: dict[str, Any]) -> str | None:
    """A GGUF's model name: its basename with its size label and fine-tune (as the file's own name
    spells them, `gemma-3-270m`, `SmolLM2-135M-Instruct`), else general.name.

    >>> gguf_name({"general.basename": "gemma-3", "general.size_label": "270m"})
    'gemma-3-270m'
    >>> gguf_name({"general.basename": "SmolLM2", "general.size_label": "135M", "general.finetune": "Instruct"})
    'SmolLM2-135M-Instruct'
    >>> gguf_name({"general.name": "Tiny"}), gguf_name({})
    ('Tiny', None)
    """
    base = meta.get("general.basename")
    if isinstance(base, str) and base.strip():
        parts = [base.strip()] + [str(meta[k]).strip() for k in ("general.size_label", "general.finetune")
                                  if isinstance(meta.get(k), str) and str(meta[k]).strip()
                                  and str(meta[k]).strip().lower() not in base.lower()]
        return "-".join(parts)
    name = meta.get("general.name")
    return name.strip() if isinstance(name, str) and name.strip() else None


def gguf_identity(path: Path) -> ModelIdentity:
    """The identity a GGUF file's header gives (BadInput for a file that is not one)."""
    meta = gguf_metadata(path, IDENTITY_KEYS)
    arch = meta.get("general.architecture")
    return ModelIdentity(gguf_name(meta) or path.stem, arch if isinstance(arch, str) else None,
                         file_type_name(meta.get("general.file_type")))


def config_identity(folder: Path) -> ModelIdentity:
    """The identity a Hugging Face model folder's config.json gives: `_name_or_path`'s last part (a
    config saved by transformers keeps where it came from), else the folder's name; `model_type`;
    `torch_dtype` (or `dtype`) as the file type."""
    from evalkit.paths import read_input

    name: str | None = folder.name or None
    try:
        config = json.loads(read_input(folder / "config.json", "model config", MAX_CONFIG_BYTES).decode("utf-8"))
    except (OSError, BadInput, UnicodeDecodeError, ValueError, RecursionError):
        return ModelIdentity(name, None, None)
    if not isinstance(config, dict):
        return ModelIdentity(name, None, None)
    source = config.get("_name_or_path")
    if isinstance(source, str) and source.strip().rstrip("/"):
        name = source.strip().rstrip("/").rsplit("/", 1)[-1]
    arch = config.get("model_type")
    dtype = config.get("torch_dtype") or config.get("dtype")
    return ModelIdentity(name, arch if isinstance(arch, str) else None, dtype if isinstance(dtype, str) else None)


def model_identity(args: dict[str, Any]) -> ModelIdentity:
    """The identity of the model a plan's args name: the GGUF file (`model=` of llama.cpp, or
    `pretrained=` + `gguf_file=`), else a local model folder's config.json; a hub id gives its last
    part as the name. Never raises: a file that does not read leaves the identity unknown."""
    pretrained = args.get("pretrained")
    model = args.get("model")
    gguf: Path | None = None
    if isinstance(model, str) and model.endswith(".gguf"):
        gguf = Path(os.path.expanduser(model))
    elif isinstance(args.get("gguf_file"), str) and args["gguf_file"]:
        gguf = Path(os.path.expanduser(args["gguf_file"]))
        if not gguf.is_absolute() and isinstance(pretrained, str):
            gguf = Path(os.path.expanduser(pretrained)) / gguf
    if gguf is not None:
        try:
            return gguf_identity(gguf) if gguf.is_file() else UNKNOWN
        except (BadInput, OSError):
            return UNKNOWN
    if isinstance(pretrained, str) and pretrained.strip():
        folder = Path(os.path.expanduser(pretrained))
        if folder.is_dir():
            return config_identity(folder)
        return ModelIdentity(pretrained.rstrip("/").rsplit("/", 1)[-1] or None, None, None)
    return UNKNOWN
