"""Sweeps: `--quant bf16,int8-weight` and `--kv-cache full,window:256` as one run per entry.

Owns: both splits of one `RunConfig` into the runs it asks for, in one place: one config
per `--quant` variant (`variant_configs`) and, inside each variant, one per `--kv-cache`
policy (`sweep_configs`); same tasks, prompts, seed and every other setting, a `--name`
gets the variant ("NAME-VARIANT") or the policy ("NAME (POLICY)") appended. Checking all
of them before any model is loaded or anything is written (the group sizes against the
model's layer widths too), then executing them one after another: one model load per
variant, whose policies share it (`execute_all`), so `--quant A,B --kv-cache P,Q` stores
A/P, A/Q, B/P, B/Q. Does not: resolve one policy (`engines.resolve` does, once, into the
`ModelPlan`), run one config (`execute_all` does) or compare the runs (`evalkit compare
BASELINE CAND ...` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from evalkit.engines import kvpolicy
from evalkit.engines.plan import check_local_files
from evalkit.engines.transformers import quant, quantize
from evalkit.errors import BadInput, RunFailed
from evalkit.runner.config import RunConfig, RunPlan, check_text, plan_run
from evalkit.runner.execute import RunResult, execute_all


def variant_configs(cfg: RunConfig) -> list[RunConfig]:
    """One config per `--quant` variant (a single one when `quant` names one); checks none of them."""
    variants = quant.parse_sweep(cfg.quant)
    if len(variants) == 1:
        return [cfg]
    name = check_text("--name", cfg.name) if cfg.name is not None else None
    return [dataclasses.replace(cfg, quant=v, name=f"{name}-{v}" if name else None) for v in variants]


def sweep_configs(cfg: RunConfig) -> list[RunConfig]:
    """One config per `--kv-cache` policy of a comma list (the same prompts and seed), each
    naming its policy's canonical text; with several, a `--name` gets the policy appended,
    "NAME (POLICY)". One policy (or none): `cfg` itself. A bad policy raises BadInput.

    >>> [c.kv_cache for c in sweep_configs(RunConfig(tasks=["firsttoken"], kv_cache="full, Window:256"))]
    ['full', 'window:256']
    """
    policies = kvpolicy.parse_list(cfg.kv_cache)
    if len(policies) == 1:
        return [cfg]
    return [dataclasses.replace(cfg, kv_cache=p.spec, name=f"{cfg.name.strip()} ({p.spec})" if cfg.name else None)
            for p in policies]


def all_configs(cfg: RunConfig) -> list[RunConfig]:
    """Every run the command asks for: each `--quant` variant under each `--kv-cache` policy."""
    return [c for v in variant_configs(cfg) for c in sweep_configs(v)]


def plan_sweep(cfg: RunConfig) -> list[RunPlan]:
    """Check every run of a sweep as `plan_run` checks one; raises BadInput, writes nothing."""
    plans = [plan_run(c) for c in all_configs(cfg)]
    if len(quant.parse_sweep(cfg.quant)) > 1:
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
    check_local_files(args)  # the door, before transformers opens anything named here
    try:
        with quantize.quiet_imports():  # transformers may import torchao, which warns on import
            config = AutoConfig.from_pretrained(args["pretrained"], **kwargs)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001  (no config to read here: each variant checks as it loads)
        return None


def execute_sweep(cfg: RunConfig, *, on_start: Callable[[str], None] | None = None,
                  on_done: Callable[[RunResult], None] | None = None) -> list[RunResult]:
    """Run every variant of `cfg.quant` in order (each under every `--kv-cache` policy), after
    checking all of them; return their results.

    A variant that fails stops the sweep (RunFailed, naming the runs already stored). With
    `cfg.drift_base` or `cfg.keep_distributions`, the runs go through drift by position
    (`runner.drift.session`)."""
    from evalkit.runner import drift

    with drift.session(cfg):
        return _execute_variants(cfg, on_start, on_done)


def _execute_variants(cfg: RunConfig, on_start, on_done) -> list[RunResult]:
    variants = variant_configs(cfg)
    if len(variants) == 1:  # one variant: `execute_all` checks its runs
        return execute_all(sweep_configs(cfg), on_start=on_start, on_done=on_done)
    plan_sweep(cfg)
    results: list[RunResult] = []

    def done(result: RunResult) -> None:
        results.append(result)
        if on_done:
            on_done(result)

    for variant in variants:
        try:
            execute_all(sweep_configs(variant), on_start=on_start, on_done=done)
        except (BadInput, RunFailed) as exc:
            if not results:
                raise
            stored = ", ".join(r.run_id for r in results)
            raise RunFailed(f"sweep stopped at --quant {variant.quant} ({exc}); runs stored: {stored}") from exc
    return results
