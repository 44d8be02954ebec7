"""What a run is asked to do (`RunConfig`), and every check that needs no model.

Owns: `RunConfig` (stored as JSON in `runs.config`), `RunPlan` (the config resolved:
model plan, template, lexicon, task names) and `plan_run`, which refuses bad input
with one line before anything is loaded or written — numbers that are not finite or
do not fit the columns that store them, names with control characters, unknown or
shadowed task names, a prompts file that does not read or encode, model files that do
not read (a GGUF header, config.json, an architecture that is no causal LM) and model
args the model does not take (`engines.resolve`), a device that does not exist here, a
DB the run could not write. The checks that need the loaded
model (vocabulary, context length) are `runner.checks`. Does not: load or run anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from evalkit.engines.resolve import ModelPlan, resolve
from evalkit.defaults import (
    AUTO_BATCH,
    DEFAULT_BATCH_SIZE,
    DEFAULT_METRICS,
    DEFAULT_MODEL,
    DEFAULT_SEED,
    DEFAULT_TEMPERATURE,
    DEFAULT_TEMPLATE,
    DEFAULT_TOP_K,
    MAX_BATCH_SIZE,
    MIN_TOP_K,
)
from evalkit.errors import BadInput
from evalkit.labels import MAX_LABEL, check_label
from evalkit.prompts import catalog
from evalkit.prompts.templates import Template, get_template
from evalkit.scoring.lexicon import Lexicon, load_lexicon
from evalkit.scoring.selection import Selection

INT32_MAX = 2**31 - 1  # INTEGER columns (seed, batch_size, sample_limit, top_k, needle_length)
MAX_BATCH = MAX_BATCH_SIZE
MAX_NAME = MAX_LABEL


@dataclass
class RunConfig:
    """Everything that defines a run; stored as JSON in `runs.config`."""

    tasks: list[str]
    model: str = DEFAULT_MODEL
    model_args: str | None = None
    template: str = DEFAULT_TEMPLATE
    templates_file: str | None = None
    quant: str | None = None
    limit: int | None = None
    seed: int = DEFAULT_SEED
    # prompts a batch, or "auto": derived from the model's shapes and the memory budget (`engines.caps`)
    batch_size: int | Literal["auto"] = DEFAULT_BATCH_SIZE
    name: str | None = None
    db: str | None = None
    prompts_file: str | None = None
    top_k: int = DEFAULT_TOP_K
    temperature: float = DEFAULT_TEMPERATURE
    first_temperature: float | None = None
    ban_openers: bool = False
    needle_lengths: list[int] | None = None
    needle_depths: list[float] | None = None
    device: str | None = None
    include_path: str | None = None
    kv_cache: str | None = None  # --kv-cache as given: one policy, or a comma list `runner.sweep` splits into runs
    attention: bool = False
    # drift by position (docs/drift.md): "first" = the sweep's first variant is the base, else a stored
    # base run (id, prefix, latest, tag:NAME) that kept its distributions; None: no drift pass
    drift_base: str | None = None
    keep_distributions: bool = False  # store this run's compact distributions as a drift base
    metrics: str = DEFAULT_METRICS  # --metrics as given: gate, all, or metric names (`scoring.selection`)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, ensure_ascii=False)


@dataclass(frozen=True)
class RunPlan:
    """A run's configuration, checked and resolved."""

    cfg: RunConfig
    model: ModelPlan
    template: Template
    lexicon: Lexicon
    tasks: list[str]  # lm-eval task and group names, in the order asked (`--prompts` adds its task)
    prompts: list[dict] | None  # the `--prompts` file's docs
    selection: Selection  # what the run computes (--metrics)

    @property
    def has_needle(self) -> bool:
        """Needle or needle_conflict tasks: documents built at load time in the model's tokens."""
        return any(t.startswith("needle") for t in self.tasks)


def _whole(option: str, value: Any, lo: int, hi: int = INT32_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadInput(f"{option} must be a whole number from {lo} to {hi}, got {value!r}")


def _finite(option: str, value: Any, *, above: float | None = None, at_least: float | None = None) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (above is None or value > above) and (at_least is None or value >= at_least)
    if not ok:
        bound = f"> {above:g}" if above is not None else f">= {at_least:g}" if at_least is not None else "finite"
        raise BadInput(f"{option} must be a finite number {bound}, got {value!r}")


def check_text(option: str, value: str, *, max_len: int = MAX_NAME) -> str:
    """A label the user gives (`--name`): `labels.check_label`, the rule run names and tags share."""
    return check_label(option, value, max_len=max_len)


def check_run_name(name: str) -> str:
    """`--name`, checked as a label (`check_text`) and refused when no command could address the run
    by it (`latest`, `tag:...`: `store.queries.unaddressable_name`)."""
    from evalkit.store.queries import unaddressable_name

    text = check_text("--name", name)
    why = unaddressable_name(text)
    if why is not None:
        raise BadInput(f"--name {text!r} could never name this run: {why}; choose another name")
    return text


def check_device(device: str | None) -> None:
    """Refuse a device torch does not know or this machine does not have."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise BadInput(f"unknown --device {device!r} (cpu, cuda, cuda:0, mps ...)") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BadInput(f"--device {device}: this torch sees no CUDA device (torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise BadInput(f"--device {device}: only {torch.cuda.device_count()} CUDA devices here")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise BadInput(f"--device {device}: MPS is not available here")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise BadInput(f"unsupported --device {device!r} (cpu, cuda, cuda:0, mps)")


def _check_numbers(cfg: RunConfig) -> None:
    if cfg.limit is not None:
        _whole("--limit", cfg.limit, 1)
    if cfg.batch_size != AUTO_BATCH:
        if isinstance(cfg.batch_size, str):
            raise BadInput(f"--batch-size must be a whole number from 1 to {MAX_BATCH} or {AUTO_BATCH!r}, "
                           f"got {cfg.batch_size!r}")
        _whole("--batch-size", cfg.batch_size, 1, MAX_BATCH)
    _whole("--seed", cfg.seed, 0)
    _whole("--top-k", cfg.top_k, MIN_TOP_K)  # the prior-drift support rule needs k >= 50; the vocabulary caps it later
    _finite("--temperature", cfg.temperature, above=0)
    if cfg.first_temperature is not None:
        _finite("--first-temperature", cfg.first_temperature, at_least=0)
    for length in cfg.needle_lengths or []:
        _whole("--needle-lengths", length, 1)
    for depth in cfg.needle_depths or []:
        _finite("--needle-depths", depth)
        if not 0.0 <= depth <= 1.0:
            raise BadInput(f"--needle-depths must lie in [0, 1], got {depth}")
    for option, values in (("--needle-lengths", cfg.needle_lengths), ("--needle-depths", cfg.needle_depths)):
        if values is not None and len(set(values)) != len(values):
            raise BadInput(f"{option} names a value twice: {values}")
        if values is not None and not values:
            raise BadInput(f"{option} is empty")


def _check_tasks(cfg: RunConfig) -> list[str]:
    if not cfg.tasks and not cfg.prompts_file:
        raise BadInput("no tasks given: use --tasks firsttoken (or --prompts FILE)")
    builtin = catalog.task_names([catalog.tasks_path()])
    available = set(builtin)
    if cfg.include_path:
        extra = catalog.task_names([Path(cfg.include_path)])
        clash = sorted(extra & (builtin - {catalog.GROUP_TAG}))
        if clash:
            raise BadInput(f"--include-path {cfg.include_path} declares {clash[0]!r}, a name of evalkit's own tasks; "
                           "rename it there")
        available |= extra
    names = list(dict.fromkeys(cfg.tasks))
    others = [n for n in names if n not in available]  # lm-eval's own tasks, or unknown
    if others:
        from evalkit.prompts import lm_eval_tasks

        lm_eval_tasks.check_names(others, sorted(t for t in available
                                                 if t not in (catalog.GROUP_TAG, catalog.PROMPTS_TASK)))
    if catalog.PROMPTS_TASK in names:
        raise BadInput(f"{catalog.PROMPTS_TASK} is the task of your own prompts: give them with --prompts FILE")
    if cfg.prompts_file:
        names.append(catalog.PROMPTS_TASK)
    return names


def check_selection(cfg: RunConfig) -> Selection:
    """`--metrics` read against the registry (an unknown name is BadInput listing the known ones), and
    refused beside an option that reads what it skips: drift by position teacher-forces the greedy
    responses, which a selection without the decode does not generate."""
    from evalkit.scoring import selection

    chosen = selection.parse(cfg.metrics)
    if cfg.drift_base is not None or cfg.keep_distributions:
        option = "--keep-distributions" if cfg.drift_base is None else "--drift" if cfg.drift_base == "first" \
            else "--drift-base"
        lacking = [m for m in ("drift_kld@0",) if not chosen.computes(m)]
        if lacking:
            raise BadInput(f"{option} reads the greedy responses, which --metrics {chosen.spec} does not generate; "
                           f"add {lacking[0]} to --metrics, or leave --metrics at all")
    return chosen


def lead_by_template(template, model) -> None:
    """A template that puts the answer after a delimiter (`target_delimiter`: qa's " ", lm-eval's own word)
    says the answer starts after whitespace: on the engines that teacher-force (hf, llama.cpp), the
    probability metrics then score the whitespace-led event (`lead_space=true`, put in the model args, so the
    run row says it), unless the model args set it. Other templates keep it off by default: under `chat` it
    moves `ft_hit_prob` by about 1e-4 on the default model and costs 2x its CPU (docs/metrics.md)."""
    if (template.target_delimiter and model.backend is not None and model.backend.teacher_forces
            and "lead_space" not in model.args):
        model.args["lead_space"] = True


def plan_run(cfg: RunConfig) -> RunPlan:
    """Check everything that needs no model, and resolve the run; raises BadInput, writes nothing."""
    from evalkit.store.db import check_writable

    _check_numbers(cfg)
    chosen = check_selection(cfg)
    if cfg.name is not None:
        cfg.name = check_run_name(cfg.name)
    template = get_template(cfg.template, cfg.templates_file)
    lexicon = load_lexicon()
    tasks = _check_tasks(cfg)
    prompts = None
    if cfg.prompts_file:
        from evalkit.prompts.jsonl import load_prompts

        prompts = load_prompts(cfg.prompts_file)
    model = resolve(cfg.model, cfg.model_args, quant_name=cfg.quant, device=cfg.device, top_k=cfg.top_k,
                    temperature=cfg.temperature, first_temperature=cfg.first_temperature,
                    ban_openers=cfg.ban_openers, seed=cfg.seed, kv_cache=cfg.kv_cache, attention=cfg.attention)
    lead_by_template(template, model)
    check_device(cfg.device)
    check_writable(cfg.db)
    from evalkit.prompts import lm_eval_tasks

    lm_eval_tasks.check_data(lm_eval_tasks.not_evalkits(tasks, cfg.include_path))  # their datasets load
    return RunPlan(cfg=cfg, model=model, template=template, lexicon=lexicon, tasks=tasks, prompts=prompts,
                   selection=chosen)
