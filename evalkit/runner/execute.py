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

import atexit
import contextlib
import datetime as dt
import functools
import json
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import duckdb

from evalkit import envvars, redact
from evalkit.engines import resolve as models
from evalkit.errors import BadInput, DatabaseBusy, ResultsKept, RunFailed, StorageFault
from evalkit.prompts.catalog import task_manager
from evalkit.runner.checks import check_against_model
from evalkit.runner.config import RunConfig, RunPlan, plan_run
from evalkit.runner.liveness import Heartbeat, exit_on_signals
from evalkit.store import rows, runs, spool
from evalkit.store.db import db_path, now
from evalkit.store.journal import Journal
from evalkit.version import __version__

__all__ = ["RunConfig", "RunResult", "execute", "execute_all"]


@dataclass
class RunResult:
    run_id: str
    status: str
    metrics: list[dict[str, Any]]
    n_samples: int
    load_s: float = 0.0
    eval_s: float = 0.0
    duration_s: float = 0.0
    lead: list[dict[str, Any]] = field(default_factory=list)  # the leading-indicator rows
    replayed: int | None = None  # a resumed run: batches replayed from its journal (None: not resumed)
    computed: int | None = None  # a resumed run: batches computed now
    prompts_computed: int | None = None  # prompts this process computed (its share under a launch); None: unknown
    degenerate: list[dict[str, Any]] = field(default_factory=list)  # the flagged `degenerate` rows (`scoring.degenerate`)


def _quiet_lm_eval() -> None:
    """lm-eval's logging down to errors, a label on its one unlabelled progress bar (building a
    task's requests; into a log, a line only when it lasts `progress.LOG_TICK_S`), and its git lookup silenced (it prints "fatal: not a git repository" to the
    terminal outside a checkout; the run row records evalkit's own commit)."""
    import functools

    import lm_eval.api.task
    import lm_eval.evaluator
    from evalkit.progress import bar

    for name in ("lm-eval", "lm_eval", "lm_eval.api.task", "lm_eval.evaluator", "lm_eval.models.huggingface"):
        logging.getLogger(name).setLevel(logging.ERROR)
    lm_eval.api.task.tqdm = functools.partial(bar, desc="building requests", leave=False, quiet=True)
    lm_eval.evaluator.get_git_commit_hash = _git_commit


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
    """Only rank 0 writes to DuckDB under `accelerate launch` / torchrun (`envvars.rank`)."""
    return envvars.rank() == 0


def not_stored(result: RunResult) -> RunResult:
    """What a non-zero rank reports: it stored nothing, so no samples, no metrics and no `done`."""
    share = f", which computed {result.prompts_computed} prompts" if result.prompts_computed is not None else ""
    status = f"not stored: this is rank {envvars.rank()} of {envvars.world_size()}{share}; rank 0 stores the run"
    return RunResult(result.run_id, status, [], 0, result.load_s, result.eval_s, result.duration_s,
                     prompts_computed=result.prompts_computed)


def attn_implementation(plan: RunPlan, lm) -> str | None:
    """The attention implementation the loaded model runs (in-process hf models only)."""
    if not plan.model.in_process_hf:
        return None
    from evalkit.engines.transformers.attention import implementation

    return implementation(getattr(lm, "model", None))


def doc_kinds(plan: RunPlan) -> set[str | None]:
    """The kinds of document the run's tasks hold (`contract.DOC_KINDS`; None: lm-eval's own tasks)."""
    from evalkit.contract import CONFLICT, FIRSTTOKEN, NEEDLE
    from evalkit.prompts import lm_eval_tasks

    others = set(lm_eval_tasks.not_evalkits(plan.tasks, plan.cfg.include_path))
    return {None if t in others else CONFLICT if t.startswith("needle_conflict") else NEEDLE
            if t.startswith("needle") else FIRSTTOKEN for t in plan.tasks}


def _unavailable(plan: RunPlan, lm: Any) -> str | None:
    """The metrics of the run's tasks it does not compute, with why, as JSON {metric: reason}; None: none.
    Those `--metrics` skipped (`Selection.skipped`, reasons beginning "not computed"), and those the loaded
    engine cannot compute (`lm.unavailable`)."""
    from evalkit.scoring import registry

    kinds = doc_kinds(plan)
    found = {m: why for m, why in plan.selection.skipped().items() if registry.METRICS[m].doc in kinds}
    engine = getattr(lm, "unavailable", None)
    if isinstance(engine, dict):
        found.update(engine)
    return json.dumps(found, sort_keys=True) if found else None


def select_metrics(plan: RunPlan, lm: Any) -> RunPlan:
    """Tell the loaded engine what to compute (`lm.select`, `evalkit run --metrics`); an engine that cannot
    skip anything computes every metric, which the run then records (`all`), saying so on stderr."""
    from evalkit.scoring.selection import EVERYTHING

    if callable(getattr(lm, "select", None)):
        lm.select(plan.selection)
        return plan
    if not plan.selection.everything:
        print(f"evalkit: note: the {plan.model.engine or plan.cfg.model} engine computes every metric; "
              f"--metrics {plan.selection.spec} is recorded as all", file=sys.stderr, flush=True)
    return replace(plan, selection=EVERYTHING)


def _whole_or_none(value: Any) -> int | None:
    """A backend's own batch size when it is a number (llama.cpp's under `auto`), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def tokenizer_columns(lm: Any) -> dict[str, str | None]:
    """The tokenizer identity the engine computed at load (`engines.tokenizer_id`); NULL when it gave none."""
    tid = getattr(lm, "tokenizer_id", None)
    return {"tokenizer_hash": getattr(tid, "hash", None), "tokenizer_source": getattr(tid, "source", None)}


def feed_columns(lm: Any) -> dict[str, str | None]:
    """What the engine feeds before every prompt's text (`prompts.encoding.Feed`): `fed` says it (and
    whether the tokenizer declared it or add_bos_token chose), `fed_note` is set when the first fed
    token is not the one the tokenizer declares. NULL for an engine that gives no feed."""
    feed = getattr(lm, "feed", None)
    if feed is None:
        return {"fed": None, "fed_note": None}
    return {"fed": feed.describe(), "fed_note": feed.note()}


def identity_columns(model: Any) -> dict[str, Any]:
    """The model as its own files name it (`engines.modelid`): `model_name` (the GGUF's basename and
    size label, a config's `_name_or_path`; the plan's label where the file says none, and the embedded
    model's own label), `model_arch`, `model_file_type` (Q4_K_M ...), and `quant`: the `--quant` asked
    for, else a GGUF's own type, lower case as llama.cpp runs store it (the weights as loaded)."""
    from evalkit.engines.modelid import model_identity

    ident = model_identity(model.args)
    gguf = ident.file_type is not None and ident.arch is not None and any(
        str(model.args.get(k) or "").endswith(".gguf") for k in ("model", "gguf_file"))
    return {"model_name": model.label if model.embedded or not ident.name else redact.text(ident.name),
            "model_arch": ident.arch, "model_file_type": ident.file_type,
            "quant": model.quant or (ident.file_type.lower() if gguf and ident.file_type else None)}


def run_row(plan: RunPlan, run_id: str, lm: Any = None) -> dict[str, Any]:
    """The `runs` row of a run as it starts (`lm`: the loaded model, which says what `--quant` applied
    and which attention implementation it runs)."""
    cfg, model = plan.cfg, plan.model
    detail = getattr(lm, "quant_detail", None)
    caps = getattr(lm, "caps", None)  # an in-process engine's `engines.caps.Caps`, derived at load
    return redact.value({  # credentials in a URL (base_url=http://user:pass@...) are never stored
        "id": run_id,
        "created_at": now(),
        "status": "running",
        "name": cfg.name,
        "model": model.label if model.embedded else cfg.model,
        "model_args": json.dumps(model.args, sort_keys=True, default=str),
        "model_fingerprint": models.fingerprint(model.args),
        "dtype": model.dtype or (detail or {}).get("compute_dtype"),
        **identity_columns(model),
        "quant_detail": json.dumps(detail, sort_keys=True) if isinstance(detail, dict) else None,
        "kv_cache": model.kv_cache,
        "template": plan.template.name,
        "template_text": json.dumps(plan.template.to_dict(), ensure_ascii=False),
        "system_prompt": plan.template.system,
        "tasks": plan.tasks,
        "seed": cfg.seed,
        # the prompts a batch held: what `--batch-size auto` chose, else as asked (NULL: auto, left to the backend)
        "batch_size": caps.batch_prompts if caps is not None else cfg.batch_size if isinstance(cfg.batch_size, int)
        else _whole_or_none(getattr(lm, "batch_size", None)),
        "batch_positions": caps.batch_positions if caps is not None else None,
        "trie_positions": caps.trie_positions if caps is not None else None,
        "memory_budget": caps.budget if caps is not None else None,
        "sample_limit": cfg.limit,
        "top_k": model.top_k,  # top-k rows stored per prompt (NULL: the backend stores none)
        "first_temperature": cfg.first_temperature,
        "ban_openers": cfg.ban_openers,
        "opener_lexicon_version": plan.lexicon.version,
        "evalkit_version": __version__,
        "git_commit": _git_commit(),
        "config": cfg.to_json(),
        "attention": cfg.attention,
        "attn_implementation": attn_implementation(plan, lm),
        "engine": model.engine,
        "unavailable": _unavailable(plan, lm),
        "metric_selection": plan.selection.spec,
        **tokenizer_columns(lm),
        **feed_columns(lm),
        **_versions(),
        **rows.this_process(),
    })


def execute(cfg: RunConfig, *, on_start: Callable[[str], None] | None = None) -> RunResult:
    """Run an evaluation end to end and store it; returns the stored run's summary.

    Raises BadInput before anything is written when the configuration is invalid (the
    checks against the model come after the model loads, still before the run row),
    RunFailed when the run fails at run time (the run row is then `failed`), and
    ResultsKept when it finished but its results wait in a spool file. `cfg.kv_cache`
    names one policy here; `runner.sweep` splits a comma list into one config each.
    """
    from evalkit.engines import kvpolicy as kvcache

    if len(kvcache.parse_list(cfg.kv_cache)) != 1:  # the list's own reading, as runner.sweep splits it
        raise BadInput("execute runs one --kv-cache policy; runner.sweep.execute_sweep runs a list")
    return execute_all([cfg], on_start=on_start)[0]


def execute_all(cfgs: Sequence[RunConfig], *, on_start: Callable[[str], None] | None = None,
                on_done: Callable[[RunResult], None] | None = None) -> list[RunResult]:
    """`execute` for each of `cfgs` in turn, one stored run each, on one loaded model: the
    configs of one `--quant` variant, differing in their `--kv-cache` policy only
    (`runner.sweep.sweep_configs`).

    Every configuration is checked (`plan_run`, which resolves its policy) before the model
    loads, so a bad policy anywhere in the list writes nothing; the model is loaded once and
    each plan's resolved policy switched in between runs. Stops at the first run that fails
    (its exception propagates).
    """
    t0 = time.monotonic()
    plans = [plan_run(c) for c in cfgs]
    lm = models.load(plans[0].model, batch_size=plans[0].cfg.batch_size)
    load_s = time.monotonic() - t0
    out = []
    for i, plan in enumerate(plans):
        if i:
            lm.set_kv_policy(plan.model.kv_policy)
            t0, load_s = time.monotonic(), 0.0
        result = _execute_plan(plan, lm, t0, load_s, on_start)
        out.append(result)
        if on_done:
            on_done(result)
    return out


@dataclass(frozen=True)
class Resumed:
    """A stored run to continue: its id, when it was first created, and its verified journal."""

    run_id: str
    created_at: dt.datetime
    journal: Journal


# what must not change between a run and its resume: what decides its numbers (the run row's
# identity columns hold the model file's hash, the template's text, the versions)
FINGERPRINT_COLUMNS = ("model_fingerprint", "model_args", "quant", "kv_cache", "template_text",
                       "opener_lexicon_version", "evalkit_version", "lm_eval_version", "transformers_version",
                       "torch_version")


def fingerprint(plan: RunPlan, row: dict[str, Any]) -> dict[str, Any]:
    """What a resume must match: the configuration (all but its name and DB), the model file's
    hash, the template, the versions, and the `--prompts` file's content."""
    from evalkit.paths import file_sha256

    config = json.loads(plan.cfg.to_json())
    for key in ("name", "db"):
        config.pop(key, None)
    out = redact.value({"config": config, **{c: row.get(c) for c in FINGERPRINT_COLUMNS}})
    if plan.cfg.prompts_file:
        out["prompts_sha256"] = file_sha256(Path(plan.cfg.prompts_file))
    return out


def resume_hint(journal: Journal | None, run_id: str) -> str:
    """What to say at the end of a run that stopped: how to continue it, when it has a journal."""
    if journal is None or journal.path is None:
        return ""
    return (f"; {len(journal.batches)} batches ({journal.prompts} prompts) are in its journal: "
            f"`evalkit run --resume {run_id}` continues it")


def keeps_journal(lm) -> bool:
    """Whether a loaded backend replays and journals its batches (a `journal` attribute): evalkit-hf does."""
    return any("journal" in vars(c) for c in type(lm).__mro__)


def _execute_plan(plan: RunPlan, lm, t0: float, load_s: float,
                  on_start: Callable[[str], None] | None, resumed: Resumed | None = None) -> RunResult:
    """One run of a loaded model: the checks against it, the run row, lm-eval, the results.

    `resumed`: continue that stored run (same id, its journal replayed) instead of starting a new one.
    """
    cfg = plan.cfg
    check_against_model(plan, lm)
    plan = select_metrics(plan, lm)

    writer = is_main_rank()
    run_id = resumed.run_id if resumed else new_run_id()
    row = run_row(plan, run_id, lm)
    if writer and row.get("fed_note"):  # said once, as the run starts (and kept in the run row)
        print(f"evalkit: note: {row['fed_note']}", file=sys.stderr, flush=True)
    ident = None  # the DB's identity: a kept run and a journal are bound to it
    journal = resumed.journal if resumed else None
    if writer and resumed:
        row["created_at"] = resumed.created_at
        ident = runs.restart_run(cfg.db, run_id)
    elif writer:
        ident = runs.insert_run(cfg.db, row)
        if ident is not None and plan.model.backend and plan.model.backend.journal and keeps_journal(lm):
            journal = Journal.create(db_path(cfg.db), ident, run_id, fingerprint(plan, row))
    if on_start and writer:  # a non-zero rank's id names no stored run
        on_start(run_id)

    restore = exit_on_signals(cfg.db, run_id, t0, writer, note=lambda: resume_hint(journal, run_id))
    beat = Heartbeat(cfg.db, run_id).start() if writer else None
    status, error = "failed", None
    if journal is not None:
        lm.journal = journal
    try:
        result, rows = _evaluate(plan, lm, run_id, load_s, t0)
        if beat:
            beat.stop()
        if writer and rows is not None:
            final = {"status": "done", "finished_at": now(), "duration_s": time.monotonic() - t0}
            _store(cfg.db, ident, {**row, **final}, rows)
        status = "done"
        if journal is not None:
            journal.discard()  # the results are stored: nothing is left to resume
        if resumed:
            result = replace(result, replayed=journal.replayed, computed=journal.computed)
        return result if writer else not_stored(result)
    except ResultsKept:
        status = "kept"
        if journal is not None:
            journal.discard()  # the kept file holds the whole run
        raise
    except KeyboardInterrupt:  # only when the handlers could not be installed (not the main thread)
        status, error = "interrupted", "interrupted by SIGINT"
        raise
    except BadInput as exc:
        error = str(exc)
        raise
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}{resume_hint(journal, run_id)}"
        raise RunFailed(f"run {run_id} failed: {error}") from exc
    finally:
        if beat:
            beat.stop()
        restore()
        if journal is not None:
            journal.close()
            lm.journal = None
        if writer and status not in ("done", "kept"):
            try:
                runs.update_run(cfg.db, run_id, status=status, error=error, finished_at=now(),
                                duration_s=time.monotonic() - t0)
            except DatabaseBusy:  # the row stays `running`; once this process ends readers see it abandoned
                pass


def _evaluate(plan: RunPlan, lm, run_id: str, load_s: float, t0: float):
    """lm-eval over the run's tasks; (RunResult, (metrics, samples, topk, lead, attention) rows, or None off
    rank 0)."""
    _quiet_lm_eval()
    cfg, template = plan.cfg, plan.template
    metadata: dict[str, Any] = {"template": template.name}
    if template.doc_to_text is not None:  # evalkit's tasks show each doc as the template's doc_to_text makes it
        metadata["doc_to_text"] = template.doc_to_text
    if cfg.prompts_file:
        metadata["prompts_file"] = str(Path(cfg.prompts_file).resolve())
    if plan.has_needle:
        from evalkit.prompts.needle_task import needle_metadata

        metadata.update(needle_metadata(cfg, template, lm))
    tm = task_manager(cfg.include_path, metadata)
    t_eval = time.monotonic()
    # --limit caps the prompts of a first-token or conflict task (conflict documents are listed pair
    # by pair, so a limit keeps whole pairs); the needle grid runs whole (one document per length x
    # depth x hint cell), so lm-eval sees the needle tasks in a call of their own; lm-eval's own tasks
    # (gsm8k, mmlu ...) have a call of their own too, through its built-in index, answered as text
    from evalkit.prompts import lm_eval_tasks

    lm_eval_names = lm_eval_tasks.not_evalkits(plan.tasks, cfg.include_path)
    needle_tasks = [t for t in plan.tasks if t.startswith("needle") and not t.startswith("needle_conflict")
                    and t not in lm_eval_names]
    own = [t for t in plan.tasks if t not in needle_tasks and t not in lm_eval_names]
    calls = [(needle_tasks, None, tm), (own, cfg.limit, tm),
             (lm_eval_names, cfg.limit, lm_eval_tasks.index() if lm_eval_names else None)]
    parts = []
    before = getattr(lm, "prompts_computed", None)
    for tasks, limit, manager in calls:
        if not tasks:
            continue
        responses = lm_eval_tasks.text_responses(lm) if manager is not tm else contextlib.nullcontext()
        with responses:
            parts.append(_simple_evaluate(plan, lm, tasks, manager, limit, metadata))
    results = merge_results(parts)
    eval_s = time.monotonic() - t_eval
    computed = lm.prompts_computed - before if isinstance(before, int) else None
    if envvars.world_size() > 1 and computed is not None:  # each rank says what its share was
        print(f"evalkit: rank {envvars.rank()} of {envvars.world_size()} computed {computed} prompts",
              file=sys.stderr, flush=True)
    if envvars.world_size() > 1:
        _leave_process_group_at_exit()
    if results is None:  # non-zero ranks under a launch get None: rank 0 gathered their samples
        return RunResult(run_id, "done", [], 0, load_s, eval_s, time.monotonic() - t0,
                         prompts_computed=computed), None
    from evalkit.runner.collect import add_intervals, collect, first_step_metrics
    from evalkit.scoring.lead import lead_table

    metric_rows, sample_rows, topk_rows, attention_rows = collect(run_id, results)
    if lm_eval_names:  # their generating tasks' first-step means (evalkit's tasks say what they aggregate)
        leaves = set(lm_eval_tasks.not_evalkits({s["task"] for s in sample_rows}, cfg.include_path))
        metric_rows += first_step_metrics(run_id, [s for s in sample_rows if s["task"] in leaves], metric_rows)
    if any(s.get("needle_depth") is not None for s in sample_rows):
        from evalkit.scoring.needle import derived_metrics

        metric_rows += derived_metrics(run_id, sample_rows)
    if any(s.get("conflict_pick") is not None for s in sample_rows):
        from evalkit.scoring import conflict

        metric_rows += conflict.derived_metrics(run_id, sample_rows)
    add_intervals(metric_rows, sample_rows, results.get("group_subtasks") or {})
    from evalkit.runner import drift

    metric_rows += drift.observe(plan, lm, run_id, results)  # drift by position (--drift): [] otherwise
    lead_rows = lead_table(run_id, sample_rows, results.get("group_subtasks") or {})
    from evalkit.scoring.degenerate import task_rows

    groups = results.get("group_subtasks") or {}
    flag_rows = task_rows(run_id, sample_rows, groups)
    flagged = [r for r in flag_rows if r["degenerate"]]
    shown = [r for r in flagged if r["task"] not in groups] or flagged  # said per task; a group only alone
    result = RunResult(run_id, "done", metric_rows, len(sample_rows), load_s, eval_s, time.monotonic() - t0,
                       lead_rows, prompts_computed=computed, degenerate=shown)
    from evalkit.runner.collect import first_char_rows

    chars = first_char_rows(run_id, results)  # first_char_topk (`engines.firstchar`)
    return result, (metric_rows, sample_rows, topk_rows, lead_rows, attention_rows, flag_rows, chars)


@functools.cache
def _leave_process_group_at_exit() -> None:
    """Tear down the launch's process group as the process exits: one that exits with it still up can abort
    in its communication threads' teardown ("terminate called without an active exception", seen once in
    seven CI-size runs on a loaded machine). At exit, not after a run: the next `--kv-cache` policy or
    `--quant` variant of the same process gathers its samples through the same group."""
    atexit.register(_leave_process_group)


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _simple_evaluate(plan: RunPlan, lm, tasks: list[str], manager, limit: int | None, metadata: dict[str, Any]):
    """One `lm_eval.simple_evaluate` call of the run (None off rank 0). lm-eval's request cache stays
    off: it is keyed without the model."""
    import lm_eval

    cfg, template = plan.cfg, plan.template
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=manager,
        limit=limit,
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


def merge_results(parts: list[dict | None]) -> dict | None:
    """lm-eval results of several `simple_evaluate` calls as one (None on non-zero ranks)."""
    if not parts or any(p is None for p in parts):
        return None
    merged: dict = {}
    for part in parts:
        for key in ("results", "samples", "n-samples", "group_subtasks"):
            merged.setdefault(key, {}).update(part.get(key) or {})
    return merged


def _store(db, ident, row: dict[str, Any], rows) -> None:
    """Write a finished run in one transaction; when the DB cannot take it, keep it in a spool file."""
    metrics, samples, topk, lead, attention, flags, chars = rows
    final = {k: row[k] for k in ("status", "finished_at", "duration_s")}
    try:
        runs.finish_run(db, row["id"], metrics=metrics, samples=samples, topk=topk, lead=lead, attention=attention,
                        flags=flags, first_char=chars, **final)
        return
    except (DatabaseBusy, StorageFault, duckdb.Error, OSError) as exc:
        reason = str(exc).splitlines()[0]
    try:
        kept = spool.keep(db_path(db), ident, row, metrics=metrics, samples=samples, topk=topk, lead=lead,
                          attention=attention, flags=flags, first_char=chars)
    except OSError as exc:
        raise RunFailed(f"run {row['id']} finished but its results could not be written ({reason}) "
                        f"nor kept ({exc})") from exc
    raise ResultsKept(f"run {row['id']} finished, but {db_path(db)} could not take its results ({reason}); "
                      f"they are kept in {kept} and come in with the next write to the DB, "
                      f"or now with `evalkit ingest {kept}`")
