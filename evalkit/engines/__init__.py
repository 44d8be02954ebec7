"""Model backends: the lm-eval model types evalkit runs, and the first-step engine behind them.

Owns: the list of evalkit's own lm-eval model types (`BACKENDS`: which lm-eval names
each one answers to, the package it needs, whether it holds Hugging Face weights in
this process); `engine` (one prefill and everything read off the first step), `hf`
(`evalkit-hf`), `vllm` (`evalkit-vllm`), `llamacpp` (`evalkit-llamacpp`, a GGUF on llama.cpp's own
kernels, through `llamacpp_engine`) and `server` (`evalkit-server`, an OpenAI-compatible
server's logprobs), model resolution and loading (`models`),
weight quantization (`quant`) and the model type names lm-eval registers (`catalog`).
Does not: score text or store anything. Importing this package imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from evalkit.install import install_hint
from evalkit.kinds import Engine


@dataclass(frozen=True)
class Backend:
    name: str  # evalkit's lm-eval model type
    module: str  # the module whose import registers it with lm-eval
    aliases: tuple[str, ...]  # lm-eval model types evalkit runs as this backend
    package: str | None  # the package it needs beyond evalkit's own requirements
    in_process_hf: bool  # Hugging Face weights in this process: --quant, first-step interventions, tolerance
    journal: bool = False  # replays and journals its batches (`lm.journal`), so its runs resume (`--resume`)
    engine: Engine | None = None  # what computes the numbers: runs.engine, a run dimension
    install: str | None = None  # how to install `package` (default: pip install PACKAGE)


BACKENDS = (
    Backend("evalkit-hf", "evalkit.engines.transformers.model", ("hf", "hf-auto", "huggingface"), None, True, journal=True,
            engine="transformers"),
    Backend("evalkit-vllm", "evalkit.engines.vllm.model", ("vllm",), "vllm", False, engine="vllm"),
    Backend("evalkit-llamacpp", "evalkit.engines.llamacpp.model", ("llamacpp", "llama-cpp"), "llama_cpp", False,
            journal=True, engine="llama.cpp", install=install_hint("llamacpp")),
    Backend("evalkit-server", "evalkit.engines.server.model", ("server", "openai-server"), None, False,
            engine="openai-server"),
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
