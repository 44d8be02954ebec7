"""The Python API, for notebooks and scripts: `run`, `connect`, `gate` (the CLI is built on it).

    >>> import evalkit
    >>> r = evalkit.run(tasks="firsttoken", limit=20)          # doctest: +SKIP
    >>> r.metrics_frame()                                       # doctest: +SKIP
    >>> con = evalkit.connect()                                 # doctest: +SKIP
    >>> con.sql("SELECT * FROM leaderboard").df()               # doctest: +SKIP
    >>> evalkit.gate(r.id, "tag:prod").passed                   # doctest: +SKIP

Owns: the three entry points and the `Run` they return. Errors are evalkit's own
(`evalkit.errors.BadInput` for bad input, `RunFailed` when a run fails), raised, never
printed. Does not: do anything the library modules do not (`runner`, `store`, `gate`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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

    def metrics_frame(self):
        """The metrics as a pandas DataFrame (task, metric, value, ci_lo, ci_hi, n, ...)."""
        import pandas as pd

        return pd.DataFrame(self.metrics)

    def samples_frame(self):
        """This run's per-prompt rows (the `samples` table) as a pandas DataFrame."""
        con = connect(self.db)
        try:
            return con.execute("SELECT * FROM samples WHERE run_id = ? ORDER BY task, doc_id", [self.id]).df()
        finally:
            con.close()


def run(tasks: str | Sequence[str] = (), model: str = "hf", *, db: str | os.PathLike | None = None,
        on_start: Callable[[str], None] | None = None, **options: Any) -> Run:
    """Evaluate a model and store the run, as `evalkit run` does; return the stored `Run`.

    `tasks` is a name, a comma list or a sequence ("firsttoken", ["firsttoken_en", "needle"]);
    every other option is a `RunConfig` field under its own name (model_args, template, quant,
    limit, seed, batch_size, name, prompts_file, top_k, temperature, needle_lengths, ...).
    """
    from evalkit.errors import BadInput
    from evalkit.runner.config import RunConfig
    from evalkit.runner.execute import execute
    from evalkit.store.db import db_path

    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t and t.strip()]
    fields = set(RunConfig.__dataclass_fields__) - {"tasks", "model", "db"}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise BadInput(f"unknown run option {unknown[0]!r} (known: {', '.join(sorted(fields))})")
    cfg = RunConfig(tasks=names, model=model, db=str(db) if db is not None else None, **options)
    result = execute(cfg, on_start=on_start)
    return Run(result.run_id, result.status, result.n_samples, result.duration_s, db_path(cfg.db), result.metrics,
               result.load_s, result.eval_s, result.lead)


def connect(db: str | os.PathLike | None = None):
    """A read-only DuckDB connection to the evalkit DB (close it when done: while it is open, no
    other process can write the file). Refuses a file that is not an evalkit DB at this schema."""
    from evalkit.store.db import reader_connection

    return reader_connection(db)


def gate(candidate: str, baseline: str, rules: str | os.PathLike | None = None, *,
         db: str | os.PathLike | None = None):
    """Gate run `candidate` against `baseline` (ids, prefixes, latest, tag:NAME, run names), as
    `evalkit gate` does; return its `GateResult` (`.passed`, `.verdict.rows`, `.markdown`, `.junit`)."""
    from evalkit.release.db import gate_runs

    return gate_runs(db, candidate, baseline, rules)
