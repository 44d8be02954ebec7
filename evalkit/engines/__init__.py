"""The engines evalkit runs, one folder each, and the registry that names them.

Owns: `ENGINES`, one record per engine (`EngineRecord`): evalkit's lm-eval model type and the
types it answers to, the module whose import registers it with lm-eval, the package it needs,
whether it holds Hugging Face weights in this process, whether its runs journal (`--resume`),
what it is called as a run dimension (`runs.engine`), how to install it, the function that
resolves its model args into a `ModelPlan` (named, imported only when a model of it is
resolved) and what it refuses (option -> why). `engine_for` finds the record of an lm-eval
model type. This is the one place that names the engines; the layers above read it.

The folders: `transformers` (`evalkit-hf`), `llamacpp` (`evalkit-llamacpp`), `server`
(`evalkit-server`), `vllm` (`evalkit-vllm`); each holds its lm-eval model type (`model`), its
first-step engine (`firststep`) and its model args and resolution (`resolve`). Beside them,
what every engine shares: the first step's result, candidate and unit ids and the trie's rule
(`firststep`), the `--kv-cache` grammar (`kvpolicy`), a model request and its plan (`plan`),
resolution and loading (`resolve`), lm-eval's model type names (`catalog`) and the check of
every engine's numbers (`validate`).
Does not: import an engine. Importing this package imports nothing heavy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from evalkit.errors import BadInput
from evalkit.install import install_hint
from evalkit.kinds import Engine

# (record, plan.ModelRequest) -> plan.ModelPlan: resolves a request of one engine (record None: an
# lm-eval model type evalkit does not wrap); typed loosely, as this module imports nothing below it
Resolver = Callable[["EngineRecord | None", Any], Any]


@dataclass(frozen=True)
class EngineRecord:
    name: str  # evalkit's lm-eval model type
    module: str  # the module whose import registers it with lm-eval
    aliases: tuple[str, ...]  # lm-eval model types evalkit runs on this engine
    package: str | None  # the package it needs beyond evalkit's own requirements
    in_process_hf: bool  # Hugging Face weights in this process: --quant, first-step interventions, tolerance
    engine: Engine  # what computes the numbers: runs.engine, a run dimension
    resolver: str  # "module:function" that resolves its model args (a `Resolver`)
    journal: bool = False  # replays and journals its batches (`lm.journal`), so its runs resume (`--resume`)
    install: str | None = None  # how to install `package` (default: pip install PACKAGE)
    refusals: Mapping[str, str] = field(default_factory=dict)  # option -> why this engine cannot run it
    summary: str = ""  # what `--model ALIAS` runs, in `evalkit run --help` (empty: the alias says it)
    teacher_forces: bool = False  # can teacher-force a base's tokens in this process (drift by position)

    @property
    def model_type(self) -> str:
        """The name users give `--model` (its first alias: hf, llamacpp, server, vllm)."""
        return self.aliases[0]

    def resolve_with(self) -> Resolver:
        """Its resolver, imported now (the engine's own folder; nothing heavy at module level)."""
        return load_resolver(self.resolver)

    def refuse(self, option: str, model_type: str) -> BadInput:
        """The one line an option this engine refuses prints (`refusals`)."""
        return BadInput(f"{option} cannot run with --model {model_type}: {self.refusals[option]}")


def load_resolver(dotted: str) -> Resolver:
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


ENGINES = (
    EngineRecord("evalkit-hf", "evalkit.engines.transformers.model", ("hf", "hf-auto", "huggingface"), None, True,
                 "transformers", "evalkit.engines.transformers.resolve:resolve_hf", journal=True, teacher_forces=True),
    EngineRecord("evalkit-llamacpp", "evalkit.engines.llamacpp.model", ("llamacpp", "llama-cpp"), "llama_cpp", False,
                 "llama.cpp", "evalkit.engines.llamacpp.resolve:resolve_llamacpp", journal=True,
                 install=install_hint("llamacpp"), summary="a GGUF on llama.cpp", teacher_forces=True, refusals={
                     "--quant": "the --quant variants re-quantize weights inside transformers; llama.cpp runs the "
                                "GGUF's own quantization: pick the GGUF file (Q4_1, Q8_0, Q4_K_M ...) instead",
                     "--attention": "llama.cpp does not expose attention weights (run --attention with --model hf)",
                     "--device": "this llama.cpp build runs on the CPU",
                 }),
    EngineRecord("evalkit-server", "evalkit.engines.server.model", ("server", "openai-server"), None, False,
                 "openai-server", "evalkit.engines.server.resolve:resolve_server",
                 summary="an OpenAI-compatible server's logprobs", refusals={
                     "--quant": "the server holds the weights: quantize what it serves",
                     "--attention": "a server returns no attention weights",
                     "--kv-cache": "the server owns its KV cache: set it where the server starts",
                     "--first-temperature": "the first step is the server's: evalkit cannot sample it apart",
                     "--ban-openers": "the first step is the server's: evalkit cannot mask it",
                 }),
    EngineRecord("evalkit-vllm", "evalkit.engines.vllm.model", ("vllm",), "vllm", False, "vllm",
                 "evalkit.engines.vllm.resolve:resolve_vllm"),
)
# lm-eval model types evalkit does not wrap (openai-completions, ...) take lm-eval's own model args,
# checked as the transformers engine checks its own, less what only an in-process model honours
OTHER_RESOLVER = "evalkit.engines.transformers.resolve:resolve_other"


def engine_for(model_type: str) -> EngineRecord | None:
    """evalkit's engine for an lm-eval model type (`hf` -> evalkit-hf), None for any other type.

    >>> engine_for("hf").name, engine_for("evalkit-vllm").engine, engine_for("openai-completions")
    ('evalkit-hf', 'vllm', None)
    """
    for record in ENGINES:
        if model_type == record.name or model_type in record.aliases:
            return record
    return None


def model_help() -> str:
    """`--model`'s help, from the registry.

    >>> model_help()
    "lm-eval model type: hf, llamacpp (a GGUF on llama.cpp), server (an OpenAI-compatible server's logprobs), vllm, ... (docs/engines.md)."
    """
    named = [f"{r.model_type} ({r.summary})" if r.summary else r.model_type for r in ENGINES]
    return f"lm-eval model type: {', '.join(named)}, ... (docs/engines.md)."


def refusal_table() -> list[tuple[Engine, str, str]]:
    """(engine, option, why) for every option an engine refuses with its own line, in registry order.

    >>> [(e, o) for e, o, _ in refusal_table()][:2]
    [('llama.cpp', '--quant'), ('llama.cpp', '--attention')]
    """
    return [(record.engine, option, why) for record in ENGINES for option, why in record.refusals.items()]
