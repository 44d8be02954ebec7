"""The `--quant` variants: what each one does to a model's weights, and whether it can apply here.

Owns: the list of variants (`QUANTS`: one `Quant` record each, carrying its scheme, its
builder and what it adds to quant_detail) and the `NAME[:GROUP]` spelling of one (`parse`) or
a comma-separated sweep of them (`parse_sweep`); refusing one that cannot apply (unknown
name, a bad group size, a backend that holds no weights in this process, a device it
does not run on, a library that is not installed, a checkpoint of another kind); the
dtype a run records for it; each variant's library call (its builder), which `quantize` runs
around the load. What was applied, for the run row, is `quantdetail`'s.
Does not: load models or quantize them (`engines.resolve.load`, `transformers.model`, `quantize`).

How a variant reaches the weights (`Quant.how`):
- `cast`: torch casts (q4_1 as loaded, fp32, bf16) and torch's dynamic int8;
- `load`: a transformers quantization config given to `from_pretrained` (torchao,
  bitsandbytes), the way a user deploys the model;
- `after`: the library's own call on the loaded model (HQQ: transformers 5's `HqqConfig`
  cannot quantize on load, its quantizer has no quantize op);
- `checkpoint`: a GPTQ / AWQ checkpoint, loaded as it is (its config names the method).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evalkit.errors import BadInput
from evalkit.install import install_hint
from evalkit.kinds import QuantMethod

PIP_EXTRA = install_hint("quant")


# LLM.int8()'s outlier cut: an input feature with |x| above it stays in 16/32-bit (bitsandbytes' default)
INT8_LLM_THRESHOLD = 6.0


@dataclass(frozen=True)
class Quant:
    """One `--quant` variant, whole: what it means, what the run row records, and how it is built."""

    name: str
    meaning: str
    scheme: str  # the library call that builds it, recorded in quant_detail.scheme
    dtype: str | None  # the compute dtype a run records in runs.dtype (None: the model's own)
    cpu_only: bool = False
    how: QuantMethod = "cast"  # see the module docstring
    library: str = "torch"  # the distribution whose version the run row records
    needs: tuple[str, ...] = ()  # import names that must be installed
    install: str = PIP_EXTRA  # the pip command that installs them
    bits: int | None = None
    group_size: int | None = None  # default group size; None: not grouped
    grouped: bool = False  # takes NAME:GROUP
    gpu_only: str | None = None  # why it runs on a CUDA GPU only (the library's own reason)
    load_dtype: str | None = None  # a `from_pretrained` dtype the variant needs (tinygemm packs bfloat16 only)
    # how="load": the transformers quantization config of a Spec; how="cast"/"after": the model changed
    config: Callable[[Spec], Any] | None = field(default=None, repr=False)
    change: Callable[[Any, Spec], Any] | None = field(default=None, repr=False)
    # what quant_detail adds for this variant: (model, spec, gguf_file) -> fields
    detail: Callable[[Any, Spec, str | None], dict[str, Any]] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Spec:
    """One variant as asked: `int4-weight` or `int4-weight:64`."""

    quant: Quant
    group_size: int | None  # the group size used (the variant's default when none was asked)
    text: str  # as the run row stores it

    @property
    def name(self) -> str:
        return self.quant.name


# --- each variant's builders (imports stay inside: the libraries load only when a variant is used) ---


def _cast_to(dtype_name: str) -> Callable[[Any, Spec], Any]:
    def cast(model, spec: Spec):
        import torch

        return model.to(getattr(torch, dtype_name))
    return cast


def _int8_dynamic(model, spec: Spec):
    """torch's dynamic int8 quantization, with the activations' scale taken per token.

    `quantize_dynamic` rounds every nn.Linear's weights to int8 (one scale per tensor), and its
    modules then quantize each input with one scale for the whole input tensor: every row of the
    batch and every position, so a prompt's numbers would depend on what is batched with it and on
    the tokens after it. Each module is replaced by a `RowwiseDynamicLinear` that keeps those int8
    weights and takes each token's own scale: the same prompt gives the same numbers in any batch.
    """
    import torch

    class RowwiseDynamicLinear(torch.nn.Module):
        """An int8 dynamic linear layer whose activations are quantized token by token.

        Weights: the int8 values and scale torch's dynamic module holds, dequantized once. Input:
        each row of the last axis (one token) gets its own affine scale and zero point over
        [min(x, 0), max(x, 0)], in 7 bits as torch's x86 kernels take activations (reduce_range),
        is rounded and dequantized; the product is computed in float32. A row's output depends on
        that row alone."""

        weight: torch.Tensor  # (out, in) float32, the int8 weights dequantized
        bias: torch.Tensor | None

        def __init__(self, module):
            super().__init__()
            self.register_buffer("weight", module.weight().dequantize())
            bias = module.bias()
            self.register_buffer("bias", bias.detach().clone() if bias is not None else None)
            self.in_features, self.out_features = module.in_features, module.out_features

        def forward(self, x):
            lo = x.amin(dim=-1, keepdim=True).clamp(max=0)
            hi = x.amax(dim=-1, keepdim=True).clamp(min=0)
            scale = ((hi - lo) / INT8_DYNAMIC_LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
            zero = torch.round(-lo / scale).clamp(0, INT8_DYNAMIC_LEVELS)
            q = torch.clamp(torch.round(x / scale) + zero, 0, INT8_DYNAMIC_LEVELS)
            return torch.nn.functional.linear((q - zero) * scale, self.weight, self.bias)

    model = model.to(torch.float32)
    model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    dynamic = torch.ao.nn.quantized.dynamic.Linear
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, dynamic):
                setattr(module, name, RowwiseDynamicLinear(child))
    return model


INT8_DYNAMIC_LEVELS = 127  # activation levels of int8-dynamic: 7 bits, as torch's x86 int8 kernels take them


def _int8_weight(spec: Spec):
    from torchao.quantization import Int8WeightOnlyConfig, PerGroup, PerRow
    from transformers import TorchAoConfig

    granularity = PerGroup(spec.group_size) if spec.group_size else PerRow()
    return TorchAoConfig(Int8WeightOnlyConfig(granularity=granularity))


def _int4_weight(spec: Spec):
    import torch
    from torchao.quantization import IntxWeightOnlyConfig, MappingType, PerGroup
    from transformers import TorchAoConfig

    return TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4,  # type: ignore[attr-defined]
                                              granularity=PerGroup(spec.group_size),
                                              mapping_type=MappingType.SYMMETRIC))


def _int4_tinygemm(spec: Spec):
    from torchao.quantization import Int4WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int4WeightOnlyConfig(group_size=spec.group_size, int4_packing_format="tile_packed_to_4d"))


def _nf4(spec: Spec):
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)


def _int8_llm(spec: Spec):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=INT8_LLM_THRESHOLD)


def _hqq(model, spec: Spec):
    import hqq.models.base as hqq_base
    from hqq.core.quantize import BaseQuantizeConfig
    from hqq.models.hf.base import AutoHQQHFModel

    check_groups(model, spec.text)
    device = str(next(model.parameters()).device)
    config = BaseQuantizeConfig(nbits=spec.quant.bits, group_size=spec.group_size, axis=1)
    bar = hqq_base.tqdm
    hqq_base.tqdm = lambda *a, **k: bar(*a, **{**k, "disable": True})  # it draws a bar per pass on stderr
    try:
        AutoHQQHFModel.quantize_model(model, quant_config=config, compute_dtype=model.dtype, device=device)
    finally:
        hqq_base.tqdm = bar
    return model.eval()


def _q4_1_detail(model, spec: Spec, gguf_file: str | None) -> dict[str, Any]:
    if gguf_file:
        return {"group_size": 32}
    # q4_1 means "as loaded": a model that is not a GGUF file is left as it is
    return {"scheme": "as loaded (not a GGUF file: nothing was dequantized)", "bits": None}


def _int8_weight_detail(model, spec: Spec, gguf_file: str | None) -> dict[str, Any]:
    return {} if spec.group_size else {"group_size": None, "granularity": "per output channel"}


def _nf4_detail(model, spec: Spec, gguf_file: str | None) -> dict[str, Any]:
    return {"group_size": _bnb_blocksize(model)}


def _bnb_blocksize(model) -> int | None:
    for _, m in model.named_modules():
        state = getattr(getattr(m, "weight", None), "quant_state", None)
        if state is not None and getattr(state, "blocksize", None):
            return int(state.blocksize)
    return None


def _int8_llm_detail(model, spec: Spec, gguf_file: str | None) -> dict[str, Any]:
    return {"granularity": f"per output row; outlier input features (|x| > {INT8_LLM_THRESHOLD}) in float",
            "activations": "cast to float16 for the int8 matmul (bitsandbytes MatMul8bitLt)"}


QUANTS = {q.name: q for q in (
    # transformers dequantizes GGUF weights to float32: the Q4_1 rounding is kept, compute is fp32
    Quant("q4_1", "GGUF Q4_1 weights as loaded: 4-bit rounding kept, dequantized to fp32 for compute",
          "GGUF Q4_1 (blocks of 32, scale and minimum per block), dequantized to float32 by transformers",
          "float32", library="transformers", bits=4, detail=_q4_1_detail),
    Quant("fp32", "weights and compute in float32 (no change for a GGUF model)", "cast to float32", "float32",
          bits=32, change=_cast_to("float32")),
    Quant("bf16", "weights and compute cast to bfloat16", "cast to bfloat16", "bfloat16", bits=16,
          change=_cast_to("bfloat16")),
    Quant("int8-dynamic", "torch dynamic int8 quantization of every nn.Linear (int8 weights, activations "
          "quantized per token, so a prompt's numbers do not depend on its batch)",
          "torch.ao.quantization.quantize_dynamic(nn.Linear, qint8) weights; activations 7-bit affine per token",
          "float32",
          cpu_only=True, bits=8, change=_int8_dynamic),
    Quant("int8-weight", "torchao int8 weight-only, symmetric, per output channel (per group with :G)",
          "torchao Int8WeightOnlyConfig (symmetric)", None,
          how="load", library="torchao", needs=("torchao",), bits=8, grouped=True,
          config=_int8_weight, detail=_int8_weight_detail),
    Quant("int4-weight", "torchao int4 weight-only, symmetric, per group of G input weights (default 32)",
          "torchao IntxWeightOnlyConfig(weight_dtype=torch.int4, symmetric, PerGroup)", None,
          how="load", library="torchao", needs=("torchao",), bits=4, group_size=32, grouped=True,
          config=_int4_weight),
    Quant("int4-tinygemm", "torchao Int4WeightOnlyConfig: int4 weight-only, asymmetric, per group (default 128), "
          "packed for the tinygemm CUDA kernel, bf16 compute",
          "torchao Int4WeightOnlyConfig(int4_packing_format=tile_packed_to_4d)", "bfloat16",
          how="load", library="torchao", needs=("torchao",), bits=4, group_size=128, grouped=True,
          load_dtype="bfloat16", config=_int4_tinygemm,
          gpu_only="torchao packs Int4WeightOnlyConfig for CUDA kernels only (tile_packed_to_4d: tinygemm, "
                   "'Torch not compiled with CUDA enabled'; plain: mslk; plain_int32: XPU/NPU)"),
    Quant("nf4", "bitsandbytes 4-bit NormalFloat, blocks of 64 weights, compute in the model's dtype",
          "bitsandbytes BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=nf4)", None,
          how="load", library="bitsandbytes", needs=("bitsandbytes",), bits=4, config=_nf4, detail=_nf4_detail),
    Quant("int8-llm", f"bitsandbytes LLM.int8(): int8 weights per row, outlier features "
          f"(|x| > {INT8_LLM_THRESHOLD:g}) in 16/32-bit",
          f"bitsandbytes BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold={INT8_LLM_THRESHOLD})", None,
          how="load", library="bitsandbytes", needs=("bitsandbytes",), bits=8,
          config=_int8_llm, detail=_int8_llm_detail),
    Quant("hqq4", "HQQ 4-bit, asymmetric, per group (default 64), zero and scale optimised without data",
          "hqq AutoHQQHFModel.quantize_model(BaseQuantizeConfig(nbits=4, axis=1))", None,
          how="after", library="hqq", needs=("hqq",), bits=4, group_size=64, grouped=True, change=_hqq),
    Quant("hqq8", "HQQ 8-bit, asymmetric, per group (default 64), zero and scale optimised without data",
          "hqq AutoHQQHFModel.quantize_model(BaseQuantizeConfig(nbits=8, axis=1))", None,
          how="after", library="hqq", needs=("hqq",), bits=8, group_size=64, grouped=True, change=_hqq),
    Quant("gptq", "a GPTQ checkpoint, loaded as it is (bits and groups from its config)",
          "GPTQ checkpoint (transformers GptqHfQuantizer, gptqmodel kernels)", None,
          how="checkpoint", library="gptqmodel", needs=("gptqmodel", "optimum"),
          install="pip install gptqmodel optimum"),
    Quant("awq", "an AWQ checkpoint, loaded as it is (bits and groups from its config)",
          "AWQ checkpoint (transformers AwqQuantizer, gptqmodel kernels)", None,
          how="checkpoint", library="gptqmodel", needs=("gptqmodel",), install="pip install gptqmodel"),
)}
DEFAULT_EMBEDDED = "q4_1"  # the embedded SmolLM2 GGUF, as shipped
MAX_GROUP = 1 << 16


def _known() -> str:
    return ", ".join(QUANTS)


def parse(text: str | None) -> Spec | None:
    """`NAME` or `NAME:GROUP` → Spec; raises BadInput for an unknown name or a bad group size.

    >>> parse("int4-weight").group_size, parse("int4-weight:64").text, parse("bf16").group_size
    (32, 'int4-weight:64', None)
    """
    if text is None:
        return None
    raw = text.strip()
    if "," in raw:
        raise BadInput(f"--quant {text!r} names several variants: a sweep is for `evalkit run` only")
    name, sep, group = raw.partition(":")
    name = name.strip()
    if name not in QUANTS:
        raise BadInput(f"unknown --quant {name!r} (known: {_known()})")
    q = QUANTS[name]
    if not sep:
        return Spec(q, q.group_size, name)
    if not q.grouped:
        raise BadInput(f"--quant {name} takes no group size (got {raw!r}); grouped variants: "
                       f"{', '.join(n for n, v in QUANTS.items() if v.grouped)}")
    group = group.strip()
    if not group.isdigit() or not 1 <= int(group) <= MAX_GROUP:
        raise BadInput(f"--quant {raw!r}: the group size must be a whole number from 1 to {MAX_GROUP}")
    size = int(group)
    return Spec(q, size, f"{name}:{size}")


def parse_sweep(text: str | None) -> list[str | None]:
    """A `--quant` value as the runs it asks for: one entry, or one per comma-separated variant.

    >>> parse_sweep("bf16, int8-weight,int4-weight:64"), parse_sweep(None)
    (['bf16', 'int8-weight', 'int4-weight:64'], [None])
    """
    if text is None or "," not in text:
        return [text]
    parts = [p.strip() for p in text.split(",")]
    if any(not p for p in parts):
        raise BadInput(f"--quant {text!r} has an empty entry: give variants as bf16,int8-weight,int4-weight")
    specs = [spec for p in parts if (spec := parse(p)) is not None]  # a non-empty name parses or raises
    seen: set[str] = set()
    for spec in specs:
        if spec.text in seen:
            raise BadInput(f"--quant {text!r} names {spec.text} twice")
        seen.add(spec.text)
    return [s.text for s in specs]


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def check(name: str | None, *, in_process_hf: bool, model_type: str, device: str | None = None) -> None:
    """Refuse a `--quant` that cannot apply here, before anything is loaded or written."""
    spec = parse(name)
    if spec is None:
        return
    q = spec.quant
    if not in_process_hf:
        raise BadInput(f"--quant applies to the hf backend only (got --model {model_type})")
    on_cpu = bool(device) and str(device).startswith("cpu")
    if q.cpu_only and device and not on_cpu:
        raise BadInput(f"--quant {q.name} runs on the CPU only (got --device {device})")
    missing = [m for m in q.needs if not installed(m)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise BadInput(f"--quant {q.name} needs {' and '.join(missing)}, which {verb} not installed: {q.install}")
    if q.gpu_only and (on_cpu or not _cuda_available()):
        where = f"--device {device}" if on_cpu else "this torch sees no CUDA device"
        raise BadInput(f"--quant {q.name} needs a CUDA GPU ({where}): {q.gpu_only}")


def check_model(name: str | None, *, embedded: bool, args: dict[str, Any]) -> None:
    """Refuse a variant that cannot apply to this model (before it loads)."""
    spec = parse(name)
    if spec is None or spec.quant.how != "checkpoint":
        return
    if embedded:
        raise BadInput(f"--quant {spec.name} loads a {spec.name.upper()} checkpoint as it is; the embedded model is "
                       "a GGUF file: give --model-args pretrained=YOUR_CHECKPOINT")
    method = checkpoint_method(args.get("pretrained"))
    if method is not None and method != spec.name:
        found = method or "no quantization_config"
        raise BadInput(f"--quant {spec.name}: {args.get('pretrained')} is not a {spec.name.upper()} checkpoint "
                       f"(its config.json has {found})")


def checkpoint_method(pretrained) -> str | None:
    """The quant_method of a local checkpoint's config.json ('' when it has none; None when unknown)."""
    import json

    if not isinstance(pretrained, str):
        return None
    from evalkit.paths import read_input

    config = Path(pretrained).expanduser() / "config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(read_input(config, "model config", 16 << 20).decode("utf-8"))
    except (BadInput, ValueError, RecursionError):  # the resolver refuses such a file with its reason
        return None
    if not isinstance(data, dict):
        return None
    text_config = data.get("text_config")
    text_config = text_config if isinstance(text_config, dict) else {}
    qc = data.get("quantization_config") or text_config.get("quantization_config") or {}
    return str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""


def dtype(name: str | None, model_dtype: str | None, *, embedded: bool = False) -> str | None:
    """The dtype a run records: the variant's compute dtype, else the model args' dtype
    (the embedded GGUF loads as float32)."""
    spec = parse(name)
    if spec is not None and spec.quant.dtype:
        return spec.quant.dtype
    return "float32" if embedded and not model_dtype else model_dtype


def check_groups(model, name: str | None) -> None:
    """Refuse a group size that does not divide the input width of every linear layer it would quantize."""
    spec = parse(name)
    if spec is None or not spec.quant.grouped or not spec.group_size:
        return
    import torch

    bad = sorted({(n, m.in_features) for n, m in _decoder_linears(model, torch.nn.Linear)
                  if m.in_features % spec.group_size}, key=lambda x: (x[1], x[0]))
    if bad:
        widths = sorted({w for _, w in bad})
        raise BadInput(f"--quant {spec.text}: group size {spec.group_size} does not divide the input width "
                       f"{', '.join(map(str, widths))} of {len(bad)} linear layers (e.g. {bad[0][0]}); "
                       f"choose a group size that divides it, e.g. {spec.name}:{_divisor(widths)}")


def _divisor(widths: list[int]) -> int:
    g = 128
    while g > 2 and any(w % g for w in widths):
        g //= 2
    return g


def _decoder_linears(model, cls):
    """(name, module) of the modules of class `cls` other than the output embedding (lm_head)."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for n, m in model.named_modules():
        if isinstance(m, cls) and m is not out_emb:
            yield n, m
