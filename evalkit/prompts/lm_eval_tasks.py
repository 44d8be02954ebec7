"""lm-eval's own tasks (gsm8k, mmlu_anatomy, arithmetic_1dc ...), run and stored beside evalkit's.

Owns: `index()`, lm-eval's TaskManager over its ~14,700 built-in YAML files, built once per
process and only when a run names a task that evalkit's folders do not declare (it takes
4-15 s; evalkit's own index takes a millisecond); `not_evalkits` (which of a run's names
are lm-eval's); `check_names` (an unknown name, with a did-you-mean over both sets); `check_data` (each such task builds and its dataset loads, else one line
naming the task; where the hub cannot be reached it loads from the local datasets cache alone,
so a task never fetched is refused in seconds, not after minutes of retries); and `text_responses`, which hands lm-eval's filters and metrics plain
text while keeping evalkit's first step (`contract.FirstStepText`). Does not: list or build
evalkit's own tasks (`catalog`), score or store anything (`runner.collect`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import socket
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from evalkit.contract import FirstStepResult, FirstStepText
from evalkit.errors import BadInput
from evalkit.prompts import catalog

_LOADED: set[str] = set()  # names whose data loaded in this process (a sweep checks each once)
MAX_REASON = 200  # characters of the loader's message kept in the one-line error
HUB_PROBE_TIMEOUT_S = 3.0  # a connection to the hub that takes longer than this counts as no network


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


def task_file(name: str) -> Path | None:
    """The built-in YAML file that declares ``task: <name>``, found by reading lm-eval's task folder as
    text (~1 s on 2 idle cores, against `index()`'s 10-15 s, or minutes on a busy machine); None for
    a group, a tag or a name lm-eval does not declare."""
    import lm_eval

    line = re.compile(rf"""^task:\s*["']?{re.escape(name)}["']?\s*(#.*)?$""", re.M)
    for path in sorted((Path(lm_eval.__file__).parent / "tasks").rglob("*.yaml")):
        try:
            text = path.read_text("utf-8", errors="replace")
        except OSError:
            continue
        if name in text and line.search(text):
            return path
    return None


@functools.lru_cache(maxsize=1)
def _hub_answers() -> bool:
    return hub_reachable()  # once per process


def why_offline() -> str | None:
    """Why the datasets can come only from the local cache in this process (None: the hub answers)."""
    if _offline():
        return "HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set"
    return None if _hub_answers() else "the hub cannot be reached (no network)"


def _load_offline(name: str, path: Path) -> None:
    """Build the task from its own folder alone, datasets from the local cache alone: seconds, no index."""
    from lm_eval.tasks import TaskManager

    with _quiet(), _hub_offline():
        TaskManager(include_path=str(path.parent), include_defaults=False).load([name])


def check_names(names: Iterable[str], evalkits: list[str]) -> None:
    """Refuse a name lm-eval does not know either, with a did-you-mean over both sets (evalkit's
    first: "firsttoken_enn" means firsttoken_en, not some lm-eval task). Builds `index()`.

    Offline (`why_offline`), a plain task found by `task_file` is first built from its own folder,
    its data from the local cache: a task whose data was never fetched is refused in seconds,
    before the index and the model, with how to fetch it."""
    from evalkit.scoring.registry import suggest

    names = list(names)
    if why_offline():
        for name in list(names):
            path = task_file(name)
            if path is None:
                continue  # a group, a tag, or unknown: the index decides
            try:
                _load_offline(name, path)
            except Exception as exc:  # noqa: BLE001  (datasets, hub and lm-eval raise many kinds)
                raise BadInput(_offline_message(name, exc)) from None
            _LOADED.add(name)
            names.remove(name)
        if not names:
            return
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


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub (``HF_ENDPOINT``, default huggingface.co) opens within
    `timeout` seconds. Through a proxy (``https_proxy`` and the like) the answer is yes: the
    connection is the proxy's to make."""
    import urllib.request
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    url = urlsplit(constants.ENDPOINT)
    if url.hostname is None:
        return False
    if urllib.request.getproxies().get(url.scheme) and not urllib.request.proxy_bypass(url.hostname):
        return True
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """datasets and huggingface_hub in offline mode for the block, as HF_HUB_OFFLINE=1 sets them at import:
    data comes from the local cache or not at all, without a connection tried."""
    import datasets.config
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def fetch_hint(name: str) -> str:
    """How to get a task's data into the local datasets cache once, on a machine that reaches the hub."""
    return (f"fetch it once where the hub can be reached (evalkit run --tasks {name} --limit 1), and it runs "
            "offline from the datasets cache after that (HF_DATASETS_CACHE; docs/cli.md#lm-evals-own-tasks)")


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
    unloaded = [n for n in names if n not in _LOADED]
    if not unloaded:
        return
    # without a hub to reach, the loaders would retry it for minutes before giving up: cache only
    offline = why_offline()
    for name in unloaded:
        try:
            with _quiet(), (_hub_offline() if offline else contextlib.nullcontext()):
                index().load([name])
        except Exception as exc:  # noqa: BLE001  (datasets, hub and lm-eval raise many kinds)
            if offline:
                raise BadInput(_offline_message(name, exc)) from None
            raise BadInput(f"lm-eval task {name!r}: its data could not be loaded ({_reason(exc)})") from None
        _LOADED.add(name)


def _offline_message(name: str, exc: BaseException) -> str:
    reason = _reason(exc).split(": offline mode is enabled")[0]  # the offline mode is ours, not the user's
    return (f"lm-eval task {name!r}: its data is not in the local datasets cache and {why_offline()} "
            f"({reason}); {fetch_hint(name)}")


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
