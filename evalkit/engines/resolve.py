"""Which model a run evaluates, resolved once: `resolve(...) -> ModelPlan`, then `load(plan)`.

Owns: the order of resolution every engine shares (the model type known to lm-eval and its
package installed, `--kv-cache` parsed once), handing the request to its engine's resolver
through the registry (`EngineRecord.resolver`; `OTHER_RESOLVER` for lm-eval model types evalkit
does not wrap), and loading a plan the same way for `evalkit run` and `evalkit inspect`
(`model_class`, `load`). Does not: know any engine's model args or refusals (each engine's
`resolve` does) or run the model (the engines do).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from typing import Any

from evalkit.defaults import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MODEL,
    DEFAULT_SEED,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
)
from evalkit.engines import OTHER_RESOLVER, engine_for, kvpolicy, load_resolver
from evalkit.engines.plan import (  # noqa: F401  (fingerprint: read as resolve.fingerprint by the runner)
    ModelPlan,
    ModelRequest,
    check_local_files,
    fingerprint,
    is_local,
    local_files,
    parse_model_args,
)
from evalkit import redact
from evalkit.errors import BadInput
from evalkit.prompts.encoding import parse_add_bos
from evalkit.loaderrors import loading


def resolve(model_type: str = DEFAULT_MODEL, model_args: str | None = None, *, quant_name: str | None = None,
            device: str | None = None, top_k: int = DEFAULT_TOP_K, temperature: float = DEFAULT_TEMPERATURE,
            first_temperature: float | None = None, ban_openers: bool = False, seed: int = DEFAULT_SEED,
            kv_cache: str | None = None, attention: bool = False) -> ModelPlan:
    """Check a model request and resolve it into a `ModelPlan`; nothing is loaded.

    Raises BadInput for an unknown model type or a missing engine package here, and, from the
    engine's resolver, for malformed or contradictory model args, a missing local model path,
    local model files that do not read, a model arg nothing takes, or a `--quant`,
    `--kv-cache`, `--attention` or first-step option the engine cannot honour (`kv_cache` is
    one policy, `kvpolicy.parse`). With an hf model type and no model named in `model_args`,
    the plan is the embedded SmolLM2, with the other model args applied to it.
    """
    from evalkit.engines import catalog

    if not catalog.is_model_type(model_type):
        raise BadInput(f"unknown model type {model_type!r} (lm-eval has no model registered under that name)")
    catalog.check_installed(model_type)
    record = engine_for(model_type)
    policy = kvpolicy.parse(kv_cache) if kv_cache else None  # the one parse of one --kv-cache policy
    ask = ModelRequest(model_type=model_type, model_args=model_args, quant_name=quant_name, device=device,
                       top_k=top_k, temperature=temperature, first_temperature=first_temperature,
                       ban_openers=ban_openers, seed=seed, kv_policy=policy, attention=attention)
    resolver = record.resolve_with() if record is not None else load_resolver(OTHER_RESOLVER)
    check_local_files(parse_model_args(model_args))  # before any resolver reads a file named there
    parse_add_bos(parse_model_args(model_args).get("add_bos_token"))  # true|false, before anything loads
    plan = resolver(record, ask)
    check_local_files(plan.args)
    return dataclasses.replace(plan, label=redact.text(plan.label))  # shown in bars, stored in the row


def model_class(name: str):
    """The lm-eval model class for `--model NAME`; `hf`, `vllm`, `llamacpp` and `server` get evalkit's engines."""
    from lm_eval.api.registry import get_model

    from evalkit.engines.catalog import check_installed

    check_installed(name)
    record = engine_for(name)
    if record is not None:
        importlib.import_module(record.module)  # registers the model type (imports torch / vllm)
        name = record.name
    try:
        return get_model(name)
    except (ValueError, KeyError) as exc:
        raise BadInput(f"unknown model type {name!r} (lm-eval has no model registered under that name)") from exc
    except ImportError as exc:
        raise BadInput(f"model type {name!r} needs a package that is not installed: {exc}") from exc


def load(plan: ModelPlan, *, batch_size: int | str = DEFAULT_BATCH_SIZE):
    """The lm-eval LM of a plan, loaded (the same way for `evalkit run` and `evalkit inspect`): its
    local files through the door first (`check_local_files`), and any exception the load raises on
    them (a config, a tokenizer, weights, a GGUF, a missing optional package) one BadInput line
    naming the model and its path (`loaderrors.loading`). `batch_size` "auto" goes to the model type as
    lm-eval's own "auto" (evalkit-hf derives it, `engines.caps`)."""
    from evalkit.progress import phases
    from evalkit.threads import announce, settle_wait_policy

    settle_wait_policy()  # before torch loads (a run settled it before planning): threads sleep, not spin,
    announce()  # on a CPU other jobs fill
    if is_local(plan.args):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_local_files(plan.args)  # again: the files may have changed since the plan was made
    files = local_files(plan.args)
    variant = f" ({plan.quant})" if plan.quant else ""
    with phases(f"loading {plan.label}{variant}", ["loading the model"]) as step, \
            loading(f"model {plan.label}", files[0][1] if files and not plan.embedded else None):
        step("loading the model")
        lm = model_class(plan.model_type).create_from_arg_obj(
            {**plan.args, **plan.backend_args}, {"batch_size": batch_size, "device": plan.device},
        )
    check_context_fields(getattr(getattr(lm, "model", None), "config", None), f"model {plan.label}")
    return lm


CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def check_context_fields(config: Any, what: str) -> None:
    """Refuse a loaded model whose config gives its context as anything but a whole number above 0
    (`max_position_embeddings: 0` would leave every prompt-fits check without a length): one line
    naming the model and the field, before any run row is written."""
    if config is None:
        return
    for name in CONTEXT_FIELDS:
        value = getattr(config, name, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadInput(f"{what}: its config gives {name} = {value!r}; a model's context is a whole number of "
                           "positions above 0 (fix config.json)")
