"""What `--model vllm` takes, checked before anything loads, resolved into a `ModelPlan`.

Owns: the vLLM engine's resolver (`resolve_vllm`: a named model, its seed, the logprobs it is
asked for) and how many logprobs per step vLLM can return (`logprobs_k`). Its model args are
lm-eval's Hugging Face kind (`transformers.resolve.lm_eval_args`), without what only an
in-process model honours. Does not: import vLLM or load anything (`model`).
"""

from __future__ import annotations

from typing import Any

from evalkit.engines import EngineRecord
from evalkit.engines.plan import ModelPlan, ModelRequest
from evalkit.engines.transformers.resolve import lm_eval_args, lm_eval_plan
from evalkit.errors import BadInput

# vLLM's ModelConfig.max_logprobs default, "the default for the OpenAI Chat Completions API"
VLLM_MAX_LOGPROBS = 20


def logprobs_k(top_k: int, max_logprobs: int | None) -> int:
    """How many logprobs per step to ask vLLM for: top_k, capped by the engine (-1: no cap).

    >>> logprobs_k(50, 20), logprobs_k(50, None), logprobs_k(50, 100), logprobs_k(50, -1)
    (20, 20, 50, 50)
    """
    if max_logprobs is None:
        max_logprobs = VLLM_MAX_LOGPROBS
    if max_logprobs < 0:
        return top_k
    return min(top_k, max_logprobs)


def resolve_vllm(record: EngineRecord | None, ask: ModelRequest) -> ModelPlan:
    """The plan of a run on vLLM: a model must be named; K = min(--top-k, vLLM's max_logprobs)."""
    args, checked = lm_eval_args(record, ask)
    if "pretrained" not in args:
        raise BadInput(f"--model {ask.model_type} needs --model-args pretrained=MODEL (a local folder or a hub id)")
    if ask.first_temperature is not None or ask.ban_openers:
        raise BadInput(f"--first-temperature and --ban-openers apply to the hf backend only (got --model {ask.model_type})")
    backend_args: dict[str, Any] = {"top_k": ask.top_k, "temperature": ask.temperature}
    if "seed" not in args:  # vLLM's own seed (the sampled protocol) follows --seed
        backend_args["seed"] = ask.seed
    stored_k = logprobs_k(ask.top_k, _int_or_none(args.get("max_logprobs")))
    return lm_eval_plan(record, ask, args, checked, backend_args, stored_k)


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        raise BadInput(f"--model-args max_logprobs must be a whole number, got {value!r}") from None
