"""One evaluation run, in order: check, load, record, evaluate through lm-eval, store.

Owns: the order of a run — every check that needs no model (`config.plan_run`), the
model load, the checks against the loaded model (`checks`), the run row written as
`running` with its process and heartbeat, `lm_eval.simple_evaluate`, one write of
metrics, samples and top-k rows, `done` — and its endings: `failed` on an error,
`interrupted` on a signal, and the results kept in a spool file beside the DB when the
DB cannot take them (a reader holding its lock past the timeout, a full disk). Does
not: parse the command line, compute metric values (tasks and `scoring` do), or
format output.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import subprocess
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from evalkit import __version__
from evalkit.backends import models
from evalkit.errors import BadInput, DatabaseBusy, ResultsKept, RunFailed
from evalkit.prompts.catalog import task_manager
from evalkit.runner.checks import check_against_model
from evalkit.runner.config import RunConfig, RunPlan, plan_run
from evalkit.runner.liveness import Heartbeat, exit_on_signals
from evalkit.store import runs, spool
from evalkit.store.db import db_path, now

__all__ = ["RunConfig", "RunResult", "execute"]


@dataclass
class RunResult:
    run_id: str
    status: str
    metrics: list[dict[str, Any]]
    n_samples: int
    load_s: float = 0.0
    eval_s: float = 0.0
    duration_s: float = 0.0


def _quiet_lm_eval() -> None:
    for name in ("lm-eval", "lm_eval", "lm_eval.api.task", "lm_eval.evaluator", "lm_eval.models.huggingface"):
        logging.getLogger(name).setLevel(logging.ERROR)


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


def run_row(plan: RunPlan, run_id: str, lm: Any = None) -> dict[str, Any]:
    """The `runs` row of a run as it starts (`lm`: the loaded model, which says what `--quant` applied)."""
    cfg, model = plan.cfg, plan.model
    detail = getattr(lm, "quant_detail", None)
    return {
        "id": run_id,
        "created_at": now(),
        "status": "running",
        "name": cfg.name,
        "model": model.label if model.embedded else cfg.model,
        "model_args": json.dumps(model.args, sort_keys=True, default=str),
        "model_fingerprint": models.fingerprint(model.args),
        "dtype": model.dtype or (detail or {}).get("compute_dtype"),
        "quant": model.quant,
        "quant_detail": json.dumps(detail, sort_keys=True) if isinstance(detail, dict) else None,
        "template": plan.template.name,
        "template_text": json.dumps(plan.template.to_dict(), ensure_ascii=False),
        "system_prompt": plan.template.system,
        "tasks": plan.tasks,
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "sample_limit": cfg.limit,
        "top_k": model.top_k,  # top-k rows stored per prompt (NULL: the backend stores none)
        "first_temperature": cfg.first_temperature,
        "ban_openers": cfg.ban_openers,
        "opener_lexicon_version": plan.lexicon.version,
        "evalkit_version": __version__,
        "git_commit": _git_commit(),
        "config": cfg.to_json(),
        **_versions(),
        **runs.this_process(),
    }


def execute(cfg: RunConfig, *, on_start: Callable[[str], None] | None = None) -> RunResult:
    """Run an evaluation end to end and store it; returns the stored run's summary.

    Raises BadInput before anything is written when the configuration is invalid (the
    checks against the model come after the model loads, still before the run row),
    RunFailed when the run fails at run time (the run row is then `failed`), and
    ResultsKept when it finished but its results wait in a spool file.
    """
    t0 = time.monotonic()
    plan = plan_run(cfg)
    _quiet_lm_eval()
    lm = models.load(plan.model, batch_size=cfg.batch_size)
    load_s = time.monotonic() - t0
    check_against_model(plan, lm)

    writer = is_main_rank()
    run_id = new_run_id()
    row = run_row(plan, run_id, lm)
    if writer:
        runs.insert_run(cfg.db, row)
    if on_start:
        on_start(run_id)

    restore = exit_on_signals(cfg.db, run_id, t0, writer)
    beat = Heartbeat(cfg.db, run_id).start() if writer else None
    status, error = "failed", None
    try:
        result, rows = _evaluate(plan, lm, run_id, load_s, t0)
        if beat:
            beat.stop()
        if writer and rows is not None:
            final = {"status": "done", "finished_at": now(), "duration_s": time.monotonic() - t0}
            _store(cfg.db, {**row, **final}, rows)
        status = "done"
        return result
    except ResultsKept:
        status = "kept"
        raise
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
        if beat:
            beat.stop()
        restore()
        if writer and status not in ("done", "kept"):
            try:
                runs.update_run(cfg.db, run_id, status=status, error=error, finished_at=now(),
                                duration_s=time.monotonic() - t0)
            except DatabaseBusy:  # the row stays `running`; once this process ends readers see it abandoned
                pass


def _evaluate(plan: RunPlan, lm, run_id: str, load_s: float, t0: float):
    """lm-eval over the run's tasks; (RunResult, (metrics, samples, topk) rows or None off rank 0)."""
    import lm_eval

    cfg, template = plan.cfg, plan.template
    metadata: dict[str, Any] = {"template": template.name}
    if cfg.prompts_file:
        metadata["prompts_file"] = str(Path(cfg.prompts_file).resolve())
    if plan.has_needle:
        from evalkit.prompts.needle_task import needle_metadata

        metadata.update(needle_metadata(cfg, template, lm))
    tm = task_manager(cfg.include_path, metadata)
    t_eval = time.monotonic()
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=plan.tasks,
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
        return RunResult(run_id, "done", [], 0, load_s, eval_s, time.monotonic() - t0), None
    from evalkit.runner.collect import collect

    metric_rows, sample_rows, topk_rows = collect(run_id, results)
    if any(s.get("needle_depth") is not None for s in sample_rows):
        from evalkit.scoring.needle import derived_metrics

        metric_rows += derived_metrics(run_id, sample_rows)
    result = RunResult(run_id, "done", metric_rows, len(sample_rows), load_s, eval_s, time.monotonic() - t0)
    return result, (metric_rows, sample_rows, topk_rows)


def _store(db, row: dict[str, Any], rows) -> None:
    """Write a finished run in one transaction; when the DB cannot take it, keep it in a spool file."""
    metrics, samples, topk = rows
    final = {k: row[k] for k in ("status", "finished_at", "duration_s")}
    try:
        runs.finish_run(db, row["id"], metrics=metrics, samples=samples, topk=topk, **final)
        return
    except (DatabaseBusy, duckdb.Error, OSError) as exc:
        reason = str(exc).splitlines()[0]
    try:
        kept = spool.keep(db_path(db), row, metrics=metrics, samples=samples, topk=topk)
    except OSError as exc:
        raise RunFailed(f"run {row['id']} finished but its results could not be written ({reason}) "
                        f"nor kept ({exc})") from exc
    raise ResultsKept(f"run {row['id']} finished, but {db_path(db)} could not take its results ({reason}); "
                      f"they are kept in {kept} and come in with the next write to the DB, "
                      f"or now with `evalkit ingest {kept}`")
