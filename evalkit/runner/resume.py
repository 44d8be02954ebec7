"""`evalkit run --resume RUN`: continue a stored run that stopped before its end.

Owns: which runs may resume and why not (done, still running, no journal, a journal that
does not verify, a configuration that changed), rebuilding the run's configuration from
its row, and handing the run to `execute` with its journal, so only the batches the
journal lacks are computed. A run whose finished results wait in a spool file (`kept`)
resumes by bringing them in. Does not: read or write the journal's lines (`store.journal`).

The rows of a resumed run are those of an uninterrupted run: the backend forms the same
batches from the same requests and replays the journaled ones (tests/test_resume.py kills
runs at several points and compares every row).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from evalkit.errors import BadInput
from evalkit.runner.config import RunConfig, plan_run
from evalkit.runner.execute import (Resumed, RunResult, _execute_plan, fingerprint, keeps_journal, run_row,
                                     tokenizer_columns)
from evalkit.store import journal, rows, runs, spool
from evalkit.store.db import db_path, open_reader
from evalkit.store.runs import open_writer
from evalkit.store.queries import resolve_run


def _stored(db, ref: str) -> tuple[str, dict[str, Any], spool.Identity | None, bool]:
    """(run id, its row, the DB's identity, whether its finished results wait in a spool file)."""
    path = db_path(db)
    if not path.is_file():
        raise BadInput(f"no DB at {path}: nothing to resume")
    with open_reader(path) as con:
        run_id = resolve_run(con, ref)
        cur = con.execute("SELECT * FROM runs WHERE id = ?", [run_id])
        names = [d[0] for d in cur.description]
        row = dict(zip(names, cur.fetchone()))
        ident = spool.owned_identity(con, path)  # None too for a copy of another DB file not re-keyed yet
        copy = ident is None and spool.identity(con) is not None
    kept = run_id in spool.pending_ids(path)
    if copy and not kept and row["status"] != "done":
        _check_status(run_id, row)
        raise BadInput(f"{path} is a copy of another evalkit DB file: run {run_id}'s journal belongs to that "
                       "file; resume it there, or run it again here")
    return run_id, row, ident, kept


def _config(row: dict[str, Any], db) -> RunConfig:
    """The run's configuration, as stored in `runs.config`, writing to this DB."""
    try:
        stored = json.loads(row["config"])
        return RunConfig(**{**stored, "db": str(db_path(db))})
    except (TypeError, ValueError) as exc:
        raise BadInput(f"run {row['id']}'s stored configuration cannot be read back ({exc}); "
                       "it cannot be resumed") from None


def _check_status(run_id: str, row: dict[str, Any]) -> None:
    status = row["status"]
    if status == "running" and not rows.is_abandoned(status, row.get("host"), row.get("pid"),
                                                       row.get("pid_start"), row.get("heartbeat_at")):
        raise BadInput(f"run {run_id} is still running (pid {row.get('pid')} on {row.get('host')}); "
                       "resume it once it has stopped")
    if status == "done":
        raise BadInput(f"run {run_id} is done: there is nothing to resume")
    if status not in (*runs.RESUMABLE, "running"):
        raise BadInput(f"run {run_id} is {status}; only an interrupted, abandoned or failed run resumes")


def resume(db, ref: str, *, on_start: Callable[[str], None] | None = None) -> RunResult:
    """Continue the stored run `ref` (an id, prefix, name, `latest` or `tag:NAME`) from its journal.

    Everything is checked before the model loads: the run is resumable, its journal is this
    DB's journal of this run and verifies line by line, and the configuration it would run
    now has the fingerprint the journal recorded (model file, quant, template, KV policy,
    seed, prompts, versions); once the model is loaded, its tokenizer is the one the run started with.
    Raises BadInput naming what is wrong otherwise.
    """
    from evalkit.engines import resolve as models

    run_id, row, ident, kept = _stored(db, ref)
    if kept:  # finished, its results waiting in a spool file: a writer brings them in
        with open_writer(db_path(db)):
            pass
        return _finished(db, run_id)
    _check_status(run_id, row)
    if ident is None:
        raise BadInput(f"run {run_id} was stored by an evalkit that kept no journals; run it again")
    path = journal.find(db_path(db), ident, run_id)
    if path is None:
        raise BadInput(f"run {run_id} has no journal (in {spool.spool_dir(db_path(db))} or "
                       f"{spool.fallback_dir(ident)}); run it again")
    t0 = time.monotonic()
    cfg = _config(row, db)
    plan = plan_run(cfg)
    if not (plan.model.backend and plan.model.backend.journal):
        raise BadInput(f"run {run_id} ran on the model type {cfg.model!r}, whose backend keeps no journal; "
                       "run it again")
    opened, recorded = journal.Journal.resume(path, ident, run_id)
    try:
        changed = journal.differences(recorded, fingerprint(plan, run_row(plan, run_id)))
        if changed:
            raise BadInput(f"run {run_id} cannot resume: what it ran with has changed ({'; '.join(changed)})")
        lm = models.load(plan.model, batch_size=cfg.batch_size)
        if not keeps_journal(lm):
            raise BadInput(f"run {run_id}: the backend {type(lm).__name__} keeps no journal")
        _check_tokenizer(run_id, row, lm)
        load_s = time.monotonic() - t0
        result = _execute_plan(plan, lm, t0, load_s, on_start, Resumed(run_id, row["created_at"], opened))
    finally:
        opened.close()
    return result


def _check_tokenizer(run_id: str, row: dict[str, Any], lm: Any) -> None:
    """The loaded tokenizer is the one the run started with (`runs.tokenizer_hash`): the weights' hash
    in the fingerprint does not cover a model folder's tokenizer files or a separate `tokenizer=`, and
    rows tokenized two ways must not make one run."""
    started = row.get("tokenizer_hash")
    now = tokenizer_columns(lm)["tokenizer_hash"]
    if started is not None and now != started:
        raise BadInput(f"run {run_id} cannot resume: its tokenizer has changed (tokenizer_hash {started} at the "
                       f"start, {now or 'none'} now); run it again")


def _finished(db, run_id: str) -> RunResult:
    """A done run's stored summary as a RunResult (its metrics and sample count)."""
    with open_reader(db_path(db)) as con:
        status, duration = con.execute("SELECT status, duration_s FROM runs WHERE id = ?", [run_id]).fetchone()
        cur = con.execute("SELECT * FROM metrics WHERE run_id = ? ORDER BY task, metric", [run_id])
        names = [d[0] for d in cur.description]
        metrics = [dict(zip(names, r)) for r in cur.fetchall()]
        n = con.execute("SELECT count(*) FROM samples WHERE run_id = ?", [run_id]).fetchone()[0]
    return RunResult(run_id, status, metrics, n, duration_s=duration or 0.0)
