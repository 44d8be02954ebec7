"""Model backends: the lm-eval model types evalkit runs, and the first-step engine behind them.

Owns: the list of evalkit's own lm-eval model types (`BACKENDS`: which lm-eval names
each one answers to, the package it needs, whether it holds Hugging Face weights in
this process); `engine` (one prefill and everything read off the first step), `hf`
(`evalkit-hf`) and `vllm` (`evalkit-vllm`), model resolution and loading (`models`),
weight quantization (`quant`) and the model type names lm-eval registers (`catalog`).
Does not: score text or store anything. Importing this package imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    name: str  # evalkit's lm-eval model type
    module: str  # the module whose import registers it with lm-eval
    aliases: tuple[str, ...]  # lm-eval model types evalkit runs as this backend
    package: str | None  # the package it needs beyond evalkit's own requirements
    in_process_hf: bool  # Hugging Face weights in this process: --quant, first-step interventions, tolerance


BACKENDS = (
    Backend("evalkit-hf", "evalkit.backends.hf", ("hf", "hf-auto", "huggingface"), None, True),
    Backend("evalkit-vllm", "evalkit.backends.vllm", ("vllm",), "vllm", False),
)


def backend_for(model_type: str) -> Backend | None:
    """evalkit's backend for an lm-eval model type (`hf` -> evalkit-hf), None for any other type.

    >>> backend_for("hf").name, backend_for("evalkit-vllm").name, backend_for("openai-completions")
    ('evalkit-hf', 'evalkit-vllm', None)
    """
    for backend in BACKENDS:
        if model_type == backend.name or model_type in backend.aliases:
            return backend
    return None
