"""Drift by position inside a run or a sweep (docs/drift.md): which run is the base, and the
teacher-forced pass of every other run against it.

Owns: `session(cfg)`, the context a sweep runs in when it asks for drift (`--drift`: the sweep's
first run is the base; `--drift-base RUN`: a stored run that kept its distributions; or only
`--keep-distributions`: store this run as a base), and `observe`, which the runner calls once a
run's lm-eval results are in: the base's greedy tokens are teacher-forced through the base
(compact distributions kept in memory, stored with `--keep-distributions`), and each later run
teacher-forces the same tokens and is compared with them position by position; the per-position
rows and summaries are written, and `drift_kld@0` / `drift_first_ratio` are returned as metric
rows of the run. Does not: generate (the runs did), compute statistics (`scoring.drift`) or
shape SQL (`store.drift`).

The drift rows are written in a transaction of their own, just before the run's results: a run
that then fails to store keeps drift rows under its (failed) id.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from evalkit import engines
from evalkit.defaults import DEFAULT_BATCH_SIZE
from evalkit.errors import BadInput
from evalkit.prompts.encoding import encode
from evalkit.scoring import drift as stats_drift

FIRST = "first"  # RunConfig.drift_base: the sweep's first run is the base
# the --model types whose engine can teacher-force (`teacher.forced`): hf, llamacpp
ENGINES = tuple(r.model_type for r in engines.ENGINES if r.teacher_forces)


@dataclass
class Session:
    """The drift state of one `evalkit run` (a sweep or a single run)."""

    db: str | None
    compare: bool  # later runs are compared with the base
    keep: bool  # the base's distributions are stored
    eps: float = stats_drift.DEFAULT_EPS
    base_run_id: str | None = None
    base: dict = field(default_factory=dict)  # (task, doc_id) -> store.drift.BaseItem
    seconds: dict[str, float] = field(default_factory=dict)  # run id -> seconds of its teacher-forced pass
    base_bytes: int = 0  # bytes of distribution values the base stored
    base_tokenizer: tuple[str, str] | None = None  # the base run's (tokenizer hash, source); None: unknown


_ACTIVE: list[Session] = []
# run id -> seconds of its teacher-forced pass, for every run of this process (bench/drift.py reads it)
SECONDS: dict[str, float] = {}


@contextlib.contextmanager
def session(cfg) -> Iterator[Session | None]:
    """The drift session `cfg` asks for (None when it asks for none); a stored base is read, and
    refused with one line when it kept no distributions, before any run starts."""
    ref, keep = getattr(cfg, "drift_base", None), bool(getattr(cfg, "keep_distributions", False))
    if ref is None and not keep:
        yield None
        return
    if cfg.model not in ENGINES:
        raise BadInput(f"drift by position teacher-forces through the in-process hf or llama.cpp engine; "
                       f"--model {cfg.model} cannot (use --model hf or llamacpp)")
    if cfg.kv_cache and "," in cfg.kv_cache:
        raise BadInput("drift by position compares weight variants and runs the full KV cache: give one --kv-cache "
                       "policy with --drift / --drift-base / --keep-distributions")
    s = Session(cfg.db, compare=ref is not None, keep=keep)
    if ref is not None and ref != FIRST:
        from evalkit.store import drift as store
        from evalkit.store.db import open_reader
        from evalkit.store.queries import resolve_run

        with open_reader(cfg.db) as con:
            s.base_run_id = resolve_run(con, ref)
            s.base = store.load_base(con, s.base_run_id)
            found = con.execute("SELECT tokenizer_hash, tokenizer_source FROM runs WHERE id = ?",
                                [s.base_run_id]).fetchone()
            s.base_tokenizer = (found[0], found[1] or "") if found and found[0] else None
        s.keep = False  # the base is stored already
    elif ref == FIRST:
        from evalkit.engines.transformers import quant

        if len(quant.parse_sweep(cfg.quant)) < 2:
            raise BadInput("--drift compares the variants of a sweep with its first one: give --quant BASE,CAND"
                           "[,...], or --drift-base RUN for a stored base run")
    _ACTIVE.append(s)
    try:
        yield s
    finally:
        _ACTIVE.remove(s)


def check_tokenizer(lm) -> None:
    """Refuse (BadInput) a drift candidate whose tokenizer is not the base's: it would teacher-force
    the base's token ids, which name other texts under another tokenizer. Drift by position
    compares distributions over one vocabulary, position by position, so it does not cross
    tokenizers; `evalkit compare` compares such runs on what their tokens say (docs/drift.md).
    A tokenizer unknown on either side (a base stored before tokenizer identities), or hashed from
    another kind of source (a transformers tokenizer.json against a GGUF vocabulary: the same GGUF
    through both engines is a pair drift compares), is not refused."""
    if not _ACTIVE:
        return
    s = _ACTIVE[-1]
    mine = _identity(lm)
    if not s.compare or s.base_run_id is None or s.base_tokenizer is None or mine is None:
        return
    (base_hash, base_source), (my_hash, my_source) = s.base_tokenizer, mine
    if my_hash != base_hash and _kind(my_source) == _kind(base_source):
        raise BadInput(f"drift by position needs the base's tokenizer: base run {s.base_run_id} has tokenizer "
                       f"{base_hash[:12]}, this model {my_hash[:12]}, so the base's token ids would mean other "
                       "texts; compare runs on different tokenizers with `evalkit compare` (it compares what their "
                       "tokens say)")


def _identity(lm) -> tuple[str, str] | None:
    """(tokenizer hash, source) the loaded engine computed (`engines.tokenizer_id`); None: it gave none."""
    tid = getattr(lm, "tokenizer_id", None)
    return (tid.hash, tid.source) if tid is not None else None


def _kind(source: str) -> str:
    return source.rsplit(": ", 1)[-1]


def logged_items(results: dict) -> dict[tuple[str, str], tuple[str, list[int]]]:
    """(task, doc_id) -> (context, greedy token ids) of every greedy response with tokens in lm-eval's results."""
    from evalkit.contract import FirstStepResult
    from evalkit.runner.collect import _doc_id

    out = {}
    for task, logged in sorted((results.get("samples") or {}).items()):
        for s in logged:
            resp = s["filtered_resps"][0] if s.get("filtered_resps") else s["resps"][0][0]
            if isinstance(resp, FirstStepResult) and resp.token_ids and s.get("arguments"):
                out[(task, _doc_id(s))] = (s["arguments"][0][0], list(resp.token_ids))
    return out


def observe(plan, lm, run_id: str, results: dict | None) -> list[dict[str, Any]]:
    """The drift pass of one finished run (see the module docstring); its metric rows ([] for the base,
    or when no session is active)."""
    if not _ACTIVE or results is None:
        return []
    s = _ACTIVE[-1]
    if s.base_run_id is None:  # this run is the base
        _as_base(s, lm, run_id, results, _batch(lm, plan.cfg.batch_size))
        return []
    if not s.compare or s.base_run_id == run_id:
        return []
    return _as_candidate(s, lm, run_id, _batch(lm, plan.cfg.batch_size))


def _batch(lm, asked) -> int:
    """The prompts a teacher-forced batch holds: the loaded engine's caps (`--batch-size auto` resolved
    at load), else the number asked."""
    caps = getattr(lm, "caps", None)
    if caps is not None:
        return int(caps.batch_prompts)
    return asked if isinstance(asked, int) else DEFAULT_BATCH_SIZE


def _model_of(lm):
    """(what `teacher.forced` runs: the hf model or the llama.cpp engine, the tokenizer, the pad id)."""
    tok = getattr(lm, "tokenizer", None)
    model = getattr(lm, "eng", None)  # the llama.cpp engine (engines.llamacpp)
    if model is None or not hasattr(model, "sequence_logits"):
        model = getattr(lm, "model", None)
    if model is None or tok is None or not (hasattr(model, "forward") or hasattr(model, "sequence_logits")):
        raise BadInput("drift by position teacher-forces through the in-process hf or llama.cpp engine")
    pad = getattr(tok, "pad_token_id", None)
    pad = pad if pad is not None else (getattr(tok, "eos_token_id", None) or 0)
    return model, tok, int(pad)


def _as_base(s: Session, lm, run_id: str, results: dict, batch_size: int) -> None:
    from evalkit.engines.transformers.teacher import Forced, base_pass
    from evalkit.store import drift as store
    from evalkit.store.runs import transaction

    model, tok, pad = _model_of(lm)
    items = logged_items(results)
    keys = sorted(items)
    forced = [Forced(encode(tok, items[k][0]), items[k][1]) for k in keys]
    t0 = time.monotonic()
    dists = base_pass(model, forced, eps=s.eps, batch_size=batch_size, pad_id=pad)
    s.seconds[run_id] = SECONDS[run_id] = time.monotonic() - t0
    s.base_run_id = run_id
    s.base_tokenizer = _identity(lm)
    s.base = {k: store.BaseItem(items[k][0], items[k][1], d) for k, d in zip(keys, dists)}
    with transaction(s.db) as con:
        s.base_bytes = store.write_base(con, run_id, s.base, keep=s.keep, eps=s.eps)


def _as_candidate(s: Session, lm, run_id: str, batch_size: int) -> list[dict[str, Any]]:
    from evalkit.engines.transformers.teacher import Forced, drift_pass
    from evalkit.store import drift as store
    from evalkit.store.runs import transaction

    model, tok, pad = _model_of(lm)
    keys = sorted(k for k, it in s.base.items() if it.token_ids)
    forced = [Forced(encode(tok, s.base[k].context), s.base[k].token_ids) for k in keys]
    t0 = time.monotonic()
    rows = drift_pass(model, forced, [s.base[k].dists for k in keys], batch_size=batch_size, pad_id=pad)
    s.seconds[run_id] = SECONDS[run_id] = time.monotonic() - t0
    per_key = dict(zip(keys, rows))
    with transaction(s.db) as con:
        store.write_drift(con, run_id, s.base_run_id, per_key)
    return metric_rows(run_id, per_key)


def metric_rows(run_id: str, per_key: dict) -> list[dict[str, Any]]:
    """`drift_kld@0` (mean, stderr, bootstrap interval) and `drift_first_ratio` (with its bootstrap CI
    over prompts) per task, as `metrics` rows."""
    from evalkit.scoring.stats import interval, mean_stderr

    by_task: dict[str, list[list[float]]] = {}
    for (task, _), rows in sorted(per_key.items()):
        if rows:
            by_task.setdefault(task, []).append([r.kld for r in rows])
    out = []
    for task, prompts in by_task.items():
        first = [p[0] for p in prompts]
        mean, se = mean_stderr(first)
        ci = interval(first, binary=False)
        out.append({"run_id": run_id, "task": task, "metric": "drift_kld@0", "filter": "none", "value": mean,
                    "stderr": se, "n": len(first), "ci_lo": ci[0] if ci else None, "ci_hi": ci[1] if ci else None})
        try:
            r = stats_drift.first_ratio(prompts)
        except ValueError:
            continue
        if all(math.isfinite(v) for v in (r.value, r.lo, r.hi)):
            out.append({"run_id": run_id, "task": task, "metric": "drift_first_ratio", "filter": "none",
                        "value": r.value, "stderr": None, "n": r.n, "ci_lo": r.lo, "ci_hi": r.hi})
    return out
