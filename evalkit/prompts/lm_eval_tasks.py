"""lm-eval's own tasks (gsm8k, mmlu_anatomy, arithmetic_1dc ...), run and stored beside evalkit's.

Owns: `index()`, lm-eval's TaskManager over its ~14,700 built-in YAML files, built once per
process and only when a run names a task that evalkit's folders do not declare (it takes
4-15 s; evalkit's own index takes a millisecond); `not_evalkits` (which of a run's names
are lm-eval's); `check_names` (an unknown name, with a did-you-mean over both sets); `check_data` (each such task builds and its dataset loads, else one line
naming the task); and `text_responses`, which hands lm-eval's filters and metrics plain
text while keeping evalkit's first step (`contract.FirstStepText`). Does not: list or build
evalkit's own tasks (`catalog`), score or store anything (`runner.collect`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from evalkit.contract import FirstStepResult, FirstStepText
from evalkit.errors import BadInput
from evalkit.prompts import catalog

_LOADED: set[str] = set()  # names whose data loaded in this process (a sweep checks each once)
MAX_REASON = 200  # characters of the loader's message kept in the one-line error


@functools.lru_cache(maxsize=1)
def index():
    """lm-eval's TaskManager over its built-in tasks (no metadata, no include path); built once."""
    from lm_eval.tasks import TaskManager

    return TaskManager()


def evalkit_names(include_path: str | None = None) -> set[str]:
    """The names evalkit's task folder (and `include_path`) declare: these never need `index()`."""
    folders = [catalog.tasks_path()] + ([Path(include_path)] if include_path else [])
    return catalog.task_names(folders)


def not_evalkits(names: Iterable[str], include_path: str | None = None) -> list[str]:
    """The names, in order, that neither evalkit's tasks nor `include_path` declare (lm-eval's own)."""
    own = evalkit_names(include_path)
    return [n for n in names if n not in own]


def check_names(names: Iterable[str], evalkits: list[str]) -> None:
    """Refuse a name lm-eval does not know either, with a did-you-mean over both sets (evalkit's
    first: "firsttoken_enn" means firsttoken_en, not some lm-eval task). Builds `index()`."""
    from evalkit.scoring.registry import suggest

    known = index().all_tasks  # tasks, groups and tags
    for name in names:
        if name not in known:
            hint = suggest(name, evalkits) or suggest(name, known)
            raise BadInput(f"unknown task {name!r}{hint} (evalkit's: {', '.join(evalkits)}; or one of lm-eval's "
                           f"{len(known)} tasks and groups, listed by `lm-eval ls tasks`)")


def _reason(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    text = text if len(text) <= MAX_REASON else text[: MAX_REASON - 1] + "…"
    return f"{type(exc).__name__}: {text}"


def _offline() -> bool:
    """Whether the hub libraries run offline, as they themselves read HF_HUB_OFFLINE / HF_DATASETS_OFFLINE."""
    import datasets.config
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE or getattr(datasets.config, "HF_HUB_OFFLINE", False)
                or getattr(datasets.config, "HF_DATASETS_OFFLINE", False))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """lm-eval's and datasets' loggers down to errors while a task builds (the failure is ours to say)."""
    names = ("lm_eval", "lm-eval", "datasets", "huggingface_hub")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)


def check_data(names: Iterable[str]) -> None:
    """Build each lm-eval task or group (which loads its dataset); raises BadInput naming the first
    whose data cannot be had. Run before the model loads and before the run row is written."""
    for name in names:
        if name in _LOADED:
            continue
        try:
            with _quiet():
                index().load([name])
        except Exception as exc:  # noqa: BLE001  (datasets, hub and lm-eval raise many kinds)
            where = ("; offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), datasets come only from the local "
                     "cache (HF_DATASETS_CACHE)") if _offline() else ""
            raise BadInput(f"lm-eval task {name!r}: its data could not be loaded ({_reason(exc)}){where}") from None
        _LOADED.add(name)


def as_text(resp: Any) -> Any:
    """A FirstStepResult as `FirstStepText` (a str carrying it); any other response as it is."""
    return FirstStepText.of(resp) if isinstance(resp, FirstStepResult) else resp


@contextlib.contextmanager
def text_responses(lm: Any) -> Iterator[None]:
    """While lm-eval runs its own tasks, `lm.generate_until` answers text: their regex filters and
    metrics take strings, and `FirstStepText.step` keeps the first step for `collect`."""
    inner = lm.generate_until

    def generate_until(requests, *args, **kwargs):
        return [as_text(r) for r in inner(requests, *args, **kwargs)]

    shadowed = "generate_until" in vars(lm)
    lm.generate_until = generate_until
    try:
        yield
    finally:
        if shadowed:
            lm.generate_until = inner
        else:
            del lm.generate_until
