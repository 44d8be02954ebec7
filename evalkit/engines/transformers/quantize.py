"""A `--quant` variant applied: its quantization config given to the load, or its change made to the loaded model.

Owns the transformers `quantization_config` of the variants that quantize as the model loads
(`load_config`, with the `from_pretrained` arguments they need, `load_kwargs`), `requantize` for a model
already loaded from a GGUF file (which transformers will not quantize on load), applying the other
variants to a loaded model (`apply`), and keeping the libraries' per-call notices off stderr.
Does not: load models (`engines.resolve.load` and `transformers.model` do, calling these around the
load), say which variants exist or refuse one (`quant`), or describe what was applied (`quantdetail`).
"""

from __future__ import annotations

from typing import Any

from evalkit.engines.transformers.quant import check_groups, parse


def load_config(name: str | None):
    """The transformers quantization config of a variant that quantizes on load, else None."""
    spec = parse(name)
    if spec is None or spec.quant.how != "load":
        return None
    with quiet_imports():  # transformers imports the library with its quantization config classes
        build = spec.quant.config
        if build is None:  # pragma: no cover  (every how="load" record carries one)
            raise AssertionError(f"--quant {spec.name} has no load config")
        return build(spec)


class quiet_imports:
    """A context in which libraries import without their import-time warnings on stderr: torchao
    warns that its CUDA extensions (built for another Python) do not load, and torch that
    torchao registers enums as pytree constants. Whatever imports them (transformers may,
    while it loads a model) does so quietly. `also` names more loggers to hold at ERROR."""

    NAMES = ("torchao", "torch.utils._pytree")

    def __init__(self, also: tuple[str, ...] = ()):
        self.names = self.NAMES + also

    def __enter__(self):
        import logging

        self._loggers = [logging.getLogger(n) for n in self.names]
        self._levels = [lg.level for lg in self._loggers]
        for lg in self._loggers:
            lg.setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc):
        for lg, level in zip(self._loggers, self._levels):
            lg.setLevel(level)
        return False


def load_kwargs(name: str | None, model_dtype: Any) -> dict[str, Any]:
    """Extra `from_pretrained` arguments a load-time variant needs (tinygemm packs bfloat16 only)."""
    spec = parse(name)
    return {"dtype": spec.quant.load_dtype} if spec is not None and spec.quant.load_dtype else {}


def requantize(model, name: str | None):
    """A model already loaded (from a GGUF file, which transformers will not quantize on load),
    rebuilt through `from_pretrained` with the variant's quantization config from its own weights."""
    qc = load_config(name)
    if qc is None:
        return model
    check_groups(model, name)
    state = model.state_dict()
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dtype_ = load_kwargs(name, None).get("dtype", model.dtype)
    device = str(next(model.parameters()).device)  # where HFLM loaded it (device_map {"": device})
    out = type(model).from_pretrained(None, config=config, state_dict=state, quantization_config=qc, dtype=dtype_,
                                      device_map={"": device})
    return out.eval()


def apply(model, name: str | None):
    """Return the model changed as `name` says (in place where torch allows); load-time and
    checkpoint variants were applied as the model loaded and pass through unchanged."""
    spec = parse(name)
    if spec is None or spec.quant.change is None:  # as loaded (q4_1), or built while loading
        return model
    return spec.quant.change(model, spec)


def quiet_libraries() -> None:
    """Keep the libraries' per-call notices off stderr (what they say is in the run row's quant_detail)."""
    import logging

    # bitsandbytes warns on every int8 matmul that float32 inputs are cast to float16
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
