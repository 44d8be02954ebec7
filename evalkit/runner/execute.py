"""One evaluation run: validate, record, evaluate through lm-eval, store.

Owns: `RunConfig` (the one object that describes a run), the order of a run
(validate everything → insert the run row as `running` → load the model →
`lm_eval.simple_evaluate` → one write of metrics, samples and top-k rows →
`done`), and marking a run `failed` or `interrupted`. Does not: parse the
command line, compute metric values (tasks and `metrics.py` do), or format
output.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import math
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evalkit import __version__
from evalkit.errors import BadInput, RunFailed
from evalkit.prompts.catalog import PROMPTS_TASK, task_manager, task_names, tasks_path
from evalkit.store import db as store


@dataclass
class RunConfig:
    """Everything that defines a run; stored as JSON in `runs.config`."""

    tasks: list[str]
    model: str = "hf"
    model_args: str | None = None
    template: str = "chat"
    templates_file: str | None = None
    quant: str | None = None
    limit: int | None = None
    seed: int = 1234
    batch_size: int = 8
    name: str | None = None
    db: str | None = None
    prompts_file: str | None = None
    top_k: int = 50
    temperature: float = 0.8
    first_temperature: float | None = None
    ban_openers: bool = False
    needle_lengths: list[int] | None = None
    needle_depths: list[float] | None = None
    device: str | None = None
    include_path: str | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, ensure_ascii=False)


@dataclass
class RunResult:
    run_id: str
    status: str
    metrics: list[dict[str, Any]]
    n_samples: int
    load_s: float = 0.0
    eval_s: float = 0.0
    duration_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _quiet_lm_eval() -> None:
    for name in ("lm-eval", "lm_eval", "lm_eval.api.task", "lm_eval.evaluator", "lm_eval.models.huggingface"):
        logging.getLogger(name).setLevel(logging.ERROR)


def validate(cfg: RunConfig) -> dict[str, Any]:
    """Check every input before anything is written; return what the run needs."""
    from evalkit.backends import catalog, models
    from evalkit.prompts.templates import get_template
    from evalkit.scoring.lexicon import load_lexicon

    if not cfg.tasks and not cfg.prompts_file:
        raise BadInput("no tasks given: use --tasks firsttoken (or --prompts FILE)")
    if cfg.limit is not None and cfg.limit <= 0:
        raise BadInput(f"--limit must be a positive number of prompts, got {cfg.limit}")
    if cfg.batch_size <= 0:
        raise BadInput(f"--batch-size must be positive, got {cfg.batch_size}")
    if cfg.top_k < 50:
        raise BadInput(f"--top-k must be at least 50 (SPEC 1.3), got {cfg.top_k}")
    if not cfg.temperature > 0:
        raise BadInput(f"--temperature must be > 0, got {cfg.temperature}")
    if cfg.first_temperature is not None and cfg.first_temperature < 0:
        raise BadInput(f"--first-temperature must be >= 0, got {cfg.first_temperature}")
    template = get_template(cfg.template, cfg.templates_file)
    models.check_quant(cfg.quant)
    lexicon = load_lexicon()

    model_args = models.parse_model_args(cfg.model_args)
    hf = cfg.model in models.HF_TYPES
    named = [k for k in models.IDENTITY_ARGS if k in model_args]
    default_model = hf and not named
    if hf and named and "pretrained" not in model_args:
        raise BadInput(f"--model-args {named[0]}=... needs pretrained=... too (give none of them for the embedded model)")
    if default_model:  # the embedded SmolLM2, with any other model args the user gave
        if "dtype" in model_args:
            raise BadInput("the embedded model's dtype is set with --quant (fp32, bf16, ...), not --model-args dtype=")
        model_args = {**models.default_model_args(), **model_args}
        quant = cfg.quant or "q4_1"
    else:
        quant = cfg.quant
        if cfg.quant and not hf:
            raise BadInput(f"--quant applies to the hf backend only (got --model {cfg.model})")
    pretrained = model_args.get("pretrained")
    if isinstance(pretrained, str) and pretrained.startswith(("/", "./", "../", "~")) and not os.path.exists(
        os.path.expanduser(pretrained)
    ):
        raise BadInput(f"model path not found: {pretrained}")
    if not catalog.is_model_type(cfg.model):
        raise BadInput(f"unknown model type {cfg.model!r} (lm-eval has no model registered under that name)")
    catalog.check_installed(cfg.model)
    if cfg.model in ("vllm", "evalkit-vllm"):
        if "pretrained" not in model_args:
            raise BadInput(f"--model {cfg.model} needs --model-args pretrained=MODEL (a local folder or a hub id)")
        if cfg.first_temperature is not None or cfg.ban_openers:
            raise BadInput(f"--first-temperature and --ban-openers apply to the hf backend only (got --model {cfg.model})")
    if hf and model_args.get("trust_remote_code") is None:
        model_args["trust_remote_code"] = False
    if hf and "prune_below" in model_args:
        raise BadInput("--model-args prune_below is gone: tolerance=P bounds the opener probability left unscored per prompt")
    if hf:
        model_args.setdefault("tolerance", models.DEFAULT_TOLERANCE)  # recorded in the run row
        try:
            tolerance = float(model_args["tolerance"])
        except (TypeError, ValueError):
            tolerance = math.nan
        if not 0 <= tolerance < 1:
            raise BadInput(f"--model-args tolerance must be a probability in [0, 1), got {model_args['tolerance']!r}")

    prompts = None
    if cfg.prompts_file:
        from evalkit.prompts.jsonl import load_prompts

        prompts = load_prompts(cfg.prompts_file)

    folders = [tasks_path()] + ([Path(cfg.include_path)] if cfg.include_path else [])
    available = task_names(folders)
    names = list(dict.fromkeys(cfg.tasks))
    unknown = [t for t in names if t not in available]
    if unknown:
        known = sorted(t for t in available if t not in ("evalkit", PROMPTS_TASK))
        raise BadInput(f"unknown task {unknown[0]!r} (known: {', '.join(known)})")
    if prompts is not None:
        names.append(PROMPTS_TASK)
    if any(t.startswith("needle") for t in names):
        from evalkit.prompts.needle_task import check_lengths

        check_lengths(cfg.needle_lengths or [], None)  # the context check follows once the model is known
        for depth in cfg.needle_depths or []:
            if not 0.0 <= depth <= 1.0:
                raise BadInput(f"--needle-depths must lie in [0, 1], got {depth}")
    return {
        "template": template,
        "lexicon": lexicon,
        "model_args": model_args,
        "quant": quant,
        "default_model": default_model,
        "task_names": names,
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parents[2]), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=5,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for col, pkg in (("lm_eval_version", "lm_eval"), ("transformers_version", "transformers"), ("torch_version", "torch")):
        try:
            out[col] = version(pkg)
        except PackageNotFoundError:
            out[col] = None
    return out


def new_run_id() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%y%m%d%H%M") + "-" + uuid.uuid4().hex[:6]


def is_main_rank() -> bool:
    """Only rank 0 writes to DuckDB under `accelerate launch` / torchrun."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0) == 0


def execute(cfg: RunConfig, *, on_start: Callable[[str], None] | None = None) -> RunResult:
    """Run an evaluation end to end and store it; returns the stored run's summary.

    Raises BadInput before touching the DB when the configuration is invalid,
    RunFailed when the run fails at run time (the run row is then `failed`).
    """
    t0 = time.monotonic()
    plan = validate(cfg)
    template = plan["template"]
    model_args = dict(plan["model_args"])
    from evalkit.backends import models

    if models.is_local(model_args):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    writer = is_main_rank()
    run_id = new_run_id()
    extra_args: dict[str, Any] = {}
    if cfg.model in models.HF_TYPES:
        extra_args = {
            "quant": plan["quant"], "top_k": cfg.top_k, "temperature": cfg.temperature,
            "first_temperature": cfg.first_temperature, "ban_openers": cfg.ban_openers,
            "probe_seed": cfg.seed,
        }
    elif cfg.model in ("vllm", "evalkit-vllm"):
        extra_args = {"top_k": cfg.top_k, "temperature": cfg.temperature}
        if "seed" not in model_args:  # vLLM's own seed (the sampled protocol) follows --seed
            extra_args["seed"] = cfg.seed
    dtype = model_args.get("dtype")
    if plan["quant"] == "bf16":
        dtype = "bfloat16"
    elif plan["quant"] in ("q4_1", "fp32", "int8-dynamic") and not dtype:
        dtype = "float32"
    row = {
        "id": run_id,
        "created_at": store._now(),
        "status": "running",
        "name": cfg.name,
        "model": cfg.model if not plan["default_model"] else models.DEFAULT_NAME,
        "model_args": json.dumps(model_args, sort_keys=True, default=str),
        "model_fingerprint": models.fingerprint(model_args),
        "dtype": dtype,
        "quant": plan["quant"],
        "template": template.name,
        "template_text": json.dumps(template.to_dict(), ensure_ascii=False),
        "system_prompt": template.system,
        "tasks": plan["task_names"],
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "sample_limit": cfg.limit,
        "top_k": cfg.top_k,
        "first_temperature": cfg.first_temperature,
        "ban_openers": cfg.ban_openers,
        "opener_lexicon_version": plan["lexicon"].version,
        "evalkit_version": __version__,
        "git_commit": _git_commit(),
        "host": platform.node(),
        "config": cfg.to_json(),
        **_versions(),
    }
    if writer:
        store.insert_run(cfg.db, row)
    if on_start:
        on_start(run_id)

    restore = _exit_on_signals(cfg.db, run_id, t0, writer)
    status, error = "failed", None
    try:
        result = _evaluate(cfg, plan, model_args, extra_args, template, run_id, writer, t0)
        status = "done"
        return result
    except KeyboardInterrupt:  # only when the handlers could not be installed (not the main thread)
        status, error = "interrupted", "interrupted by SIGINT"
        raise
    except BadInput as exc:
        error = str(exc)
        raise
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise RunFailed(f"run {run_id} failed: {error}") from exc
    finally:
        restore()
        if writer and status != "done":
            store.update_run(
                cfg.db, run_id, status=status, error=error,
                finished_at=store._now(), duration_s=time.monotonic() - t0,
            )


def _exit_on_signals(db, run_id: str, t0: float, writer: bool) -> Callable[[], None]:
    """While a run is under way, SIGINT and SIGTERM mark it `interrupted` and end the process.

    The handler records the run and leaves with `os._exit(128 + signum)` rather than
    raising: an exception raised from a signal handler while torch or another native
    library is calling back into Python (an import, a forward hook) cannot unwind
    through C++ and aborts the process instead. Results not yet committed are simply
    never written, so no partial metrics exist. Returns the function that puts the
    previous handlers back.
    """
    def handler(signum, frame):
        name = signal.Signals(signum).name
        if writer:
            try:
                store.mark_interrupted(db, run_id, f"interrupted by {name}", time.monotonic() - t0)
            except BaseException:  # noqa: BLE001  (leaving is what matters now)
                pass
        sys.stderr.write("evalkit: error: interrupted\n" if signum == signal.SIGINT else "evalkit: terminated\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: Python delivers signals to the main thread only
        pass

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def _evaluate(cfg, plan, model_args, extra_args, template, run_id, writer, t0) -> RunResult:
    import lm_eval

    _quiet_lm_eval()
    metadata: dict[str, Any] = {"template": template.name}
    if cfg.prompts_file:
        metadata["prompts_file"] = str(Path(cfg.prompts_file).resolve())
    t_load = time.monotonic()
    from evalkit.backends import models

    lm = models.model_class(cfg.model).create_from_arg_obj(
        {**model_args, **{k: v for k, v in extra_args.items() if v is not None}},
        {"batch_size": cfg.batch_size, "device": cfg.device},
    )
    load_s = time.monotonic() - t_load
    if any(t.startswith("needle") for t in plan["task_names"]):
        from evalkit.prompts.needle_task import needle_metadata

        metadata.update(needle_metadata(cfg, template, lm))
    tm = task_manager(cfg.include_path, metadata)
    t_eval = time.monotonic()
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=plan["task_names"],
        task_manager=tm,
        limit=cfg.limit,
        log_samples=True,
        apply_chat_template=template.chat,
        system_instruction=template.system,
        random_seed=cfg.seed,
        numpy_random_seed=cfg.seed,
        torch_random_seed=cfg.seed,
        fewshot_random_seed=cfg.seed,
        bootstrap_iters=1000,  # means get an analytic stderr; nothing is resampled
        metadata=metadata,
    )
    eval_s = time.monotonic() - t_eval
    if results is None:  # non-zero ranks under accelerate get None
        return RunResult(run_id, "done", [], 0, load_s, eval_s, time.monotonic() - t0)
    from evalkit.runner.collect import collect

    metric_rows, sample_rows, topk_rows = collect(run_id, results)
    if any(s.get("needle_depth") is not None for s in sample_rows):
        from evalkit.prompts.needle_task import derived_metrics

        metric_rows += derived_metrics(run_id, sample_rows)
    duration = time.monotonic() - t0
    # top-k rows stored per prompt: fewer than --top-k where the backend caps it (vLLM's max_logprobs)
    stored_k = {"top_k": lm.logprobs_k} if isinstance(getattr(lm, "logprobs_k", None), int) else {}
    if writer:
        store.finish_run(
            cfg.db, run_id, metrics=metric_rows, samples=sample_rows, topk=topk_rows,
            status="done", finished_at=store._now(), duration_s=duration, **stored_k,
        )
    return RunResult(run_id, "done", metric_rows, len(sample_rows), load_s, eval_s, duration)
