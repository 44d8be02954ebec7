"""What a `--quant` variant did to the loaded model, for the run row's `quant_detail`.

Owns `describe`: the variant, its library and version, scheme, bits, group size, compute dtype, the
quantized modules as layer patterns with counts and the weight-holding modules left as they were, and,
for a GGUF model, the file's tensor types (`gguf_tensor_types`, remembered per file).
Does not: apply a variant (`quantize`) or refuse one (`quant`).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from evalkit import memo
from evalkit.engines.transformers.quant import parse


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


_QUANTIZED_FROM = ("bitsandbytes", "hqq", "gptqmodel", "torch.ao.nn.quantized", "torch.nn.quantized", "optimum",
                   "awq", "auto_gptq", "torchao")


def _is_quantized(module) -> bool:
    """A leaf module that holds quantized weights: a library's replacement of nn.Linear, or a
    Linear / Embedding whose weight is a quantized tensor subclass (torchao)."""
    import torch

    cls = type(module)
    if cls.__module__.startswith(_QUANTIZED_FROM):
        return not list(module.children())
    weight = getattr(module, "weight", None)
    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and weight is not None:
        return type(weight) not in (torch.Tensor, torch.nn.Parameter) or weight.dtype in (
            torch.int8, torch.uint8, torch.qint8)
    return False


def _pattern(name: str) -> str:
    """A module name with its layer index as `*`: model.layers.3.mlp.up_proj → model.layers.*.mlp.up_proj."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def module_summary(model) -> dict[str, Any]:
    """Which modules hold quantized weights ({pattern: count}) and which weight-holding ones do not."""
    import torch

    quantized: Counter[str] = Counter()
    kept: Counter[str] = Counter()
    for n, m in model.named_modules():
        if _is_quantized(m):
            quantized[_pattern(n)] += 1
        elif isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            kept[_pattern(n)] += 1
    return {"n_quantized": sum(quantized.values()), "quantized": dict(sorted(quantized.items())),
            "not_quantized": dict(sorted(kept.items()))}


def describe(model, name: str | None, *, gguf_file: str | None = None) -> dict[str, Any]:
    """What was applied to the loaded model, for the run row's `quant_detail` (JSON): the
    variant, library and version, scheme, bits, group size, compute dtype, the quantized
    modules as layer patterns with counts and the weight-holding modules left as they were."""
    import torch

    spec = parse(name)
    q = spec.quant if spec else None
    params = next(iter(model.parameters()), None)
    compute = getattr(model, "dtype", None) or (params.dtype if params is not None else None)
    detail: dict[str, Any] = {
        "variant": spec.text if spec else None,
        "library": q.library if q else None,
        "version": (_version(q.library) if q.library != "torch" else torch.__version__.split("+")[0]) if q else None,
        "scheme": q.scheme if q else "as loaded",
        "bits": q.bits if q else None,
        "group_size": spec.group_size if spec else None,
        "compute_dtype": str(compute).replace("torch.", "") if compute is not None else None,
    }
    if spec and spec.quant.detail:
        detail.update(spec.quant.detail(model, spec, gguf_file))
    qc = getattr(model.config, "quantization_config", None) if hasattr(model, "config") else None
    if spec and spec.quant.how == "checkpoint" and qc is not None:
        qd = qc if isinstance(qc, dict) else qc.to_dict()
        detail.update(bits=qd.get("bits"), group_size=qd.get("group_size"), checkpoint={
            k: qd.get(k) for k in ("quant_method", "bits", "group_size", "desc_act", "sym", "version", "format")
            if qd.get(k) is not None})
    elif not spec and qc is not None:  # a pre-quantized checkpoint loaded without --quant
        qd = qc if isinstance(qc, dict) else qc.to_dict()
        detail.update(scheme=f"checkpoint ({qd.get('quant_method')})", bits=qd.get("bits"),
                      group_size=qd.get("group_size"))
    detail.update(module_summary(model))
    if gguf_file:
        # every variant of a GGUF model starts from the file's values, dequantized to float32
        detail["source"] = f"GGUF file {Path(gguf_file).name}, dequantized to float32 by transformers"
        types = gguf_tensor_types(gguf_file)
        if types:
            detail["gguf_tensor_types"] = types
    return detail


def gguf_tensor_types(path) -> dict[str, int] | None:
    """{GGUF tensor type: count} of a GGUF file (which weights were Q4_1 before any variant), remembered
    for the file as it is (`memo.counts`: reading it parses the whole vocabulary, seconds a load)."""
    try:
        stamp = memo.file_stamp(path)
    except OSError:
        return None
    return memo.counts("gguf-tensor-types", {"file": stamp, "gguf": memo.package_version("gguf")},
                       lambda: _gguf_tensor_types(path))


def _gguf_tensor_types(path) -> dict[str, int] | None:
    try:
        from gguf import GGUFReader

        from evalkit.paths import check_input_path

        check_input_path(path, "GGUF file", "file")  # the reader maps the file: a FIFO would hold it
        reader = GGUFReader(str(path))
        return dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items()))
    except Exception:  # noqa: BLE001  (a detail for the record, never a reason to fail a run)
        return None
