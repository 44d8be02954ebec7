"""The Python API, for notebooks and scripts: `run` (`run_all`), `connect`, `promote`, `gate` (the CLI is built on it).

    >>> import evalkit
    >>> r = evalkit.run(tasks="firsttoken", limit=20)          # doctest: +SKIP
    >>> r.metrics_frame()                                       # doctest: +SKIP
    >>> con = evalkit.connect()                                 # doctest: +SKIP
    >>> con.sql("SELECT * FROM leaderboard").df()               # doctest: +SKIP
    >>> evalkit.gate(r.id, "tag:prod").passed                   # doctest: +SKIP

Owns: the three entry points and the `Run` they return. Each starts by checking the
environment (`envvars.check_environment`), before any row is written or model loaded.
Errors are evalkit's own (`evalkit.errors.BadInput` for bad input, `RunFailed` when a
run fails), raised, never printed. Does not: do anything the library modules do not
(`runner`, `store`, `gate`).
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evalkit import envvars
from evalkit.defaults import DEFAULT_MODEL
from evalkit.threads import settle_wait_policy


METRICS_COLUMNS = ("task", "metric", "value", "ci_lo", "ci_hi", "n", "stderr", "filter")


@functools.lru_cache(maxsize=1)
def _whole_frame():
    """A pandas DataFrame whose printed form shows every column: on a terminal pandas fits a frame to
    its width by hiding the middle columns ("..."), which hid `metric` and `value`; this one wraps them
    onto more lines instead. Its slices are plain DataFrames. (A class made on first use: pandas is
    imported only when a frame is asked for.)"""
    import pandas as pd

    class WholeFrame(pd.DataFrame):
        def __repr__(self) -> str:
            width = shutil.get_terminal_size((100, 24)).columns
            with pd.option_context("display.max_columns", None, "display.expand_frame_repr", True,
                                   "display.width", width):
                return super().__repr__()

    return WholeFrame


@dataclass
class Run:
    """A stored run: its id, status, size and aggregate metrics (one dict per task × metric)."""

    id: str
    status: str
    n_samples: int
    duration_s: float
    db: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    load_s: float = 0.0  # seconds spent loading the model
    eval_s: float = 0.0  # seconds spent evaluating
    lead: list[dict[str, Any]] = field(default_factory=list)  # does the first token predict the answer?
    replayed: int | None = None  # a resumed run: batches replayed from its journal (None: not resumed)
    computed: int | None = None  # a resumed run: batches computed in the resume
    degenerate: list[dict[str, Any]] = field(default_factory=list)  # its flagged tasks (`scoring.degenerate`)

    def metrics_frame(self):
        """The metrics as a pandas DataFrame: task, metric, value, ci_lo, ci_hi, n, stderr, filter, in that
        order, printed whole (`print` wraps it to the terminal instead of hiding middle columns as "...")."""
        columns = [c for c in METRICS_COLUMNS if any(c in m for m in self.metrics)]
        columns += [c for m in self.metrics for c in m if c not in columns]
        return _whole_frame()(self.metrics, columns=list(dict.fromkeys(columns)) or list(METRICS_COLUMNS))

    def samples_frame(self):
        """This run's per-prompt rows (the `samples` table) as a pandas DataFrame."""
        con = connect(self.db)
        try:
            return con.execute("SELECT * FROM samples WHERE run_id = ? ORDER BY task, doc_id", [self.id]).df()
        finally:
            con.close()


def run(tasks: str | Sequence[str] = (), model: str = DEFAULT_MODEL, *, db: str | os.PathLike | None = None,
        on_start: Callable[[str], None] | None = None, **options: Any) -> Run:
    """Evaluate a model and store the run, as `evalkit run` does; return the stored `Run`.

    `tasks` is a name, a comma list or a sequence ("firsttoken", ["firsttoken_en", "needle"]);
    every other option is a `RunConfig` field under its own name (model_args, template, quant,
    kv_cache, attention, limit, seed, batch_size, name, prompts_file, top_k, temperature,
    needle_lengths (numbers, or a preset name: "long"), ...).
    One configuration only: a comma list of policies or variants is `run_all`.
    """
    from evalkit.errors import BadInput

    envvars.check_environment()
    cfg = _config(tasks, model, db, options)
    from evalkit.runner.sweep import all_configs

    if len(all_configs(cfg)) != 1:
        raise BadInput("evalkit.run runs one configuration; a comma list (--kv-cache, --quant) is evalkit.run_all")
    return run_all(tasks, model, db=db, on_start=on_start, **options)[0]


def resume(run: str, *, db: str | os.PathLike | None = None, on_start: Callable[[str], None] | None = None) -> Run:
    """Continue a stopped run from its journal, as `evalkit run --resume RUN` does; return the stored `Run`.

    Only the batches its journal lacks are computed, and the rows equal an uninterrupted
    run's. Refused (BadInput) when the run is done or still running, has no journal, its
    journal does not verify, or what it ran with (model file, tokenizer, quant, template, KV
    policy, seed, versions) has changed. A run whose finished results wait in a spool file is
    brought in.
    """
    from evalkit.runner.resume import resume as resume_run
    from evalkit.store.db import db_path

    envvars.check_environment()
    settle_wait_policy()
    result = resume_run(db, run, on_start=on_start)
    return Run(result.run_id, result.status, result.n_samples, result.duration_s, db_path(db), result.metrics,
               result.load_s, result.eval_s, result.lead, result.replayed, result.computed, result.degenerate)


def run_all(tasks: str | Sequence[str] = (), model: str = DEFAULT_MODEL, *, db: str | os.PathLike | None = None,
            on_start: Callable[[str], None] | None = None, on_done: Callable[[Run], None] | None = None,
            **options: Any) -> list[Run]:
    """`run` for every configuration of a sweep: one stored run per `quant` variant (a comma list,
    e.g. "bf16,int8-weight,int4-weight": one model load each) and `kv_cache` policy (a comma list:
    the policies share the variant's loaded model), all checked before anything is written."""
    from evalkit.runner.sweep import execute_sweep
    from evalkit.store.db import db_path

    envvars.check_environment()
    settle_wait_policy()  # before planning loads torch: on a busy CPU its threads sleep, not spin
    cfg = _config(tasks, model, db, options)
    path = db_path(cfg.db)

    def as_run(result) -> Run:
        return Run(result.run_id, result.status, result.n_samples, result.duration_s, path, result.metrics,
                   result.load_s, result.eval_s, result.lead, degenerate=result.degenerate)

    done = (lambda result: on_done(as_run(result))) if on_done else None
    return [as_run(r) for r in execute_sweep(cfg, on_start=on_start, on_done=done)]


def _config(tasks, model, db, options):
    from evalkit.errors import BadInput
    from evalkit.runner.config import RunConfig

    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t and t.strip()]
    fields = set(RunConfig.__dataclass_fields__) - {"tasks", "model", "db"}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise BadInput(f"unknown run option {unknown[0]!r} (known: {', '.join(sorted(fields))})")
    lengths = options.get("needle_lengths")
    if isinstance(lengths, str):  # a named grid ("long") or a comma list, as `--needle-lengths` takes
        from evalkit.prompts.presets import LENGTH_PRESETS

        try:
            options["needle_lengths"] = list(LENGTH_PRESETS.get(lengths.strip()) or
                                             [int(v) for v in lengths.split(",") if v.strip()])
        except ValueError:
            raise BadInput(f"needle_lengths: expected numbers or one of {', '.join(LENGTH_PRESETS)}, "
                           f"got {lengths!r}") from None
    return RunConfig(tasks=names, model=model, db=str(db) if db is not None else None, **options)


def connect(db: str | os.PathLike | None = None):
    """A read-only DuckDB connection to the evalkit DB (close it when done: while it is open, no
    other process can write the file). Refuses a file that is not an evalkit DB at this schema."""
    from evalkit.store.db import reader_connection

    envvars.check_environment()
    return reader_connection(db)


def promote(run: str, tag: str, *, db: str | os.PathLike | None = None) -> bool:
    """Make a done run the tag's current run (`tag:NAME` then names it, until the next promotion to
    the tag; promoting an older run again moves the tag back), as `evalkit promote` does; return
    whether a tag row was written (False when the run already was the tag's current run)."""
    from evalkit.release.db import promote as promote_run

    envvars.check_environment()
    return promote_run(db, run, tag).added


def gate(candidate: str, baseline: str, rules: str | os.PathLike | None = None, *,
         db: str | os.PathLike | None = None):
    """Gate run `candidate` against `baseline` (ids, prefixes, latest, tag:NAME, run names), as
    `evalkit gate` does; return its `GateResult` (`.outcome` "pass" | "fail" | "inconclusive", `.passed`,
    `.verdict.rows`, `.markdown`, `.junit`). `rules`: "same" (the default), "upgrade", or a rules
    file. See docs/gate.md."""
    from evalkit.release.db import gate_runs

    envvars.check_environment()
    return gate_runs(db, candidate, baseline, rules)
