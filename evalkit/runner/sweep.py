"""A quantization sweep: `--quant bf16,int8-weight,int4-weight` as one run per variant.

Owns: turning one `RunConfig` whose `quant` names several variants into one config per
variant (same tasks, prompts, seed and every other setting; a `--name` gets the
variant appended), checking all of them before any model is loaded or anything is
written (the group sizes against the model's layer widths too), then executing them
one after another, one model load per variant. Does not: run a single variant
(`execute` does) or compare the runs (`evalkit compare BASELINE CAND ...` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from evalkit.backends import quant
from evalkit.errors import BadInput, RunFailed
from evalkit.runner.config import RunConfig, RunPlan, check_text, plan_run
from evalkit.runner.execute import RunResult, execute


def variant_configs(cfg: RunConfig) -> list[RunConfig]:
    """One config per `--quant` variant (a single one when `quant` names one); checks none of them."""
    variants = quant.parse_sweep(cfg.quant)
    if len(variants) == 1:
        return [cfg]
    name = check_text("--name", cfg.name) if cfg.name is not None else None
    return [dataclasses.replace(cfg, quant=v, name=f"{name}-{v}" if name else None) for v in variants]


def plan_sweep(cfg: RunConfig) -> list[RunPlan]:
    """Check every variant of a sweep as `plan_run` checks one run; raises BadInput, writes nothing."""
    plans = [plan_run(c) for c in variant_configs(cfg)]
    if len(plans) > 1:
        check_group_sizes(plans)
    return plans


def check_group_sizes(plans: list[RunPlan]) -> None:
    """Refuse a grouped variant whose group size does not divide the model's layer widths,
    read from the model's config (no weights loaded), before the first run starts."""
    grouped = [p for p in plans if p.model.in_process_hf and p.model.quant
               and quant.parse(p.model.quant).quant.grouped]
    if not grouped:
        return
    skeleton = _skeleton(grouped[0].model.args)
    if skeleton is None:  # checked again when each variant loads
        return
    for p in grouped:
        quant.check_groups(skeleton, p.model.quant)


def _skeleton(args: dict):
    """The model of these model args on the meta device (its config only), or None when unreadable."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {k: args[k] for k in ("gguf_file", "revision", "subfolder", "trust_remote_code") if k in args}
    try:
        with quant.quiet_imports():  # transformers may import torchao, which warns on import
            config = AutoConfig.from_pretrained(args["pretrained"], **kwargs)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001  (no config to read here: each variant checks as it loads)
        return None


def execute_sweep(cfg: RunConfig, *, on_start: Callable[[str], None] | None = None,
                  on_done: Callable[[RunResult], None] | None = None) -> list[RunResult]:
    """Run every variant of `cfg.quant` in order, after checking all of them; return their results.

    A variant that fails stops the sweep (RunFailed, naming the runs already stored)."""
    if len(quant.parse_sweep(cfg.quant)) == 1:  # one run: `execute` checks it
        result = execute(cfg, on_start=on_start)
        if on_done:
            on_done(result)
        return [result]
    plans = plan_sweep(cfg)
    results: list[RunResult] = []
    for plan in plans:
        try:
            result = execute(plan.cfg, on_start=on_start)
        except (BadInput, RunFailed) as exc:
            if not results:
                raise
            done = ", ".join(r.run_id for r in results)
            raise RunFailed(f"sweep stopped at --quant {plan.cfg.quant} ({exc}); runs stored: {done}") from exc
        results.append(result)
        if on_done:
            on_done(result)
    return results
