"""The `--quant` variants: what each one does to a model's weights, checked and applied in one place.

Owns: the list of variants (`QUANTS`), refusing one that cannot apply (unknown name, a
backend that holds no weights in this process, a device it does not run on), the dtype
a run records for it, and applying it to a loaded model. Does not: load models
(`models.load` does, and calls `apply` right after).
"""

from __future__ import annotations

from dataclasses import dataclass

from evalkit.errors import BadInput


@dataclass(frozen=True)
class Quant:
    name: str
    meaning: str
    dtype: str  # the compute dtype a run records in runs.dtype
    cpu_only: bool = False


QUANTS = {q.name: q for q in (
    # transformers dequantizes GGUF weights to float32: the Q4_1 rounding is kept, compute is fp32
    Quant("q4_1", "GGUF Q4_1 weights as loaded: 4-bit rounding kept, dequantized to fp32 for compute", "float32"),
    Quant("fp32", "weights and compute in float32 (no change for a GGUF model)", "float32"),
    Quant("bf16", "weights and compute cast to bfloat16", "bfloat16"),
    Quant("int8-dynamic", "torch dynamic int8 quantization of every nn.Linear (int8 weights, activations "
          "quantized per batch)", "float32", cpu_only=True),
)}
DEFAULT_EMBEDDED = "q4_1"  # the embedded SmolLM2 GGUF, as shipped


def check(name: str | None, *, in_process_hf: bool, model_type: str, device: str | None = None) -> None:
    """Refuse a `--quant` that cannot apply here, before anything is loaded or written."""
    if name is None:
        return
    if name not in QUANTS:
        raise BadInput(f"unknown --quant {name!r} (known: {', '.join(QUANTS)})")
    if not in_process_hf:
        raise BadInput(f"--quant applies to the hf backend only (got --model {model_type})")
    if QUANTS[name].cpu_only and device and not str(device).startswith("cpu"):
        raise BadInput(f"--quant {name} runs on the CPU only (got --device {device})")


def dtype(name: str | None, model_dtype: str | None) -> str | None:
    """The dtype a run records: the variant's compute dtype, else the model args' dtype."""
    return QUANTS[name].dtype if name in QUANTS else model_dtype


def apply(model, name: str | None):
    """Return the model changed as `name` says (in place where torch allows)."""
    import torch

    if name in (None, "q4_1"):
        return model
    if name == "fp32":
        return model.to(torch.float32)
    if name == "bf16":
        return model.to(torch.bfloat16)
    if name == "int8-dynamic":
        model = model.to(torch.float32)
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    raise BadInput(f"unknown --quant {name!r} (known: {', '.join(QUANTS)})")
