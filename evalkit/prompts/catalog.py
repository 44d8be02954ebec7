"""evalkit's lm-eval tasks: where they are installed, and the names they declare.

Owns: `tasks_path()` (the installed `evalkit.tasks` folder, the repository's `tasks/`
in a checkout), `task_names` (every task, group and tag declared by the YAML files of
some folders, read without importing lm-eval's task modules, which costs seconds), and
`task_manager` (lm-eval's TaskManager over evalkit's folders only, never the 14k
built-in YAML files). Does not: build tasks or documents.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from evalkit import envvars
from evalkit.errors import BadInput
from evalkit.paths import MAX_YAML_BYTES, read_input

PROMPTS_TASK = "firsttoken_user"  # the task of `--prompts FILE`
# the built-in first-token tasks' prompt files, under the tasks folder
FIRSTTOKEN_DATA = {
    "firsttoken_en": ("firsttoken", "data", "firsttoken_en.jsonl"),
    "firsttoken_zh": ("firsttoken", "data", "firsttoken_zh.jsonl"),
}
GROUP_TAG = "evalkit"  # the tag every built-in task carries (not a task a user names)


def tasks_path() -> Path:
    """The folder of evalkit's task YAMLs: $EVALKIT_TASKS, else the installed `evalkit.tasks`."""
    path = envvars.tasks()
    if path is None:
        spec = importlib.util.find_spec("evalkit.tasks")
        if spec is None or not spec.submodule_search_locations:
            raise BadInput("evalkit's task folder is not installed (reinstall evalkit, or set EVALKIT_TASKS)")
        path = Path(list(spec.submodule_search_locations)[0])
    if not path.is_dir():
        raise BadInput(f"evalkit task folder not found at {path} (set EVALKIT_TASKS)")
    return path


def data_path(*parts: str) -> Path:
    """A file under the tasks folder, e.g. data_path("needle", "data", "haystack_en.txt")."""
    return tasks_path().joinpath(*parts)


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads lm-eval's `!function module.name` tags as plain strings."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: None)


def _load_yaml(path: str | Path) -> Any:
    """A task YAML of evalkit's folder, `--include-path` or `EVALKIT_TASKS`, parsed. Read through
    `paths.read_input` with the limit of every YAML a person writes (`MAX_YAML_BYTES`): a larger
    file, a FIFO or a device is refused with one line (BadInput) before it is parsed, here and
    before lm-eval, which would read every YAML of the folder too, ever sees it."""
    return yaml.load(read_input(path, "task file", MAX_YAML_BYTES).decode("utf-8"), Loader=_Loader)  # noqa: S506


def _declared(path: Path) -> set[str]:
    try:
        cfg = _load_yaml(path)
    except (yaml.YAMLError, UnicodeDecodeError):
        return set()  # lm-eval reports broken files itself when it loads them
    if not isinstance(cfg, dict):
        return set()
    names: set[str] = set()
    for key in ("task", "group", "tag"):
        value = cfg.get(key)
        values = value if isinstance(value, list) else [value]
        names.update(v for v in values if isinstance(v, str))
    return names


def task_names(folders: Iterable[Path]) -> set[str]:
    """Every `task`, `group` and `tag` name declared in the YAML files under `folders`."""
    names: set[str] = set()
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.yaml")):
            names |= _declared(path)
    return names


def expand(names: Iterable[str]) -> list[str]:
    """Task names with evalkit's groups replaced by their tasks (other names as they are).

    >>> expand(["firsttoken", "needle_en"])
    ['firsttoken_en', 'firsttoken_zh', 'needle_en']
    """
    groups: dict[str, list[str]] = {}
    for path in sorted(tasks_path().rglob("*.yaml")):
        cfg = _yaml_config(str(path))
        if isinstance(cfg.get("group"), str) and isinstance(cfg.get("task"), list):
            groups[cfg["group"]] = [t for t in cfg["task"] if isinstance(t, str)]
    out: list[str] = []
    for name in names:
        out += expand(groups[name]) if name in groups else [name]
    return list(dict.fromkeys(out))


@functools.lru_cache(maxsize=64)
def _yaml_config(path: str) -> dict[str, Any]:
    cfg = _load_yaml(path)
    return cfg if isinstance(cfg, dict) else {}


def generation_kwargs(task: str) -> dict[str, Any]:
    """A built-in task's `generation_kwargs`, following its `include:` (e.g. `until`, `max_gen_toks`).

    Raises BadInput for a name that is not a built-in task with generation settings.
    """
    root = tasks_path()
    for path in sorted(root.rglob("*.yaml")):
        cfg = _yaml_config(str(path))
        if cfg.get("task") != task:
            continue
        merged: dict[str, Any] = {}
        for source in (cfg.get("include"), None):
            layer = _yaml_config(str(path.parent / source)) if source else cfg
            merged.update(layer.get("generation_kwargs") or {})
        if merged:
            return merged
    known = sorted(n for n in task_names([root]) if n.startswith(("firsttoken_", "needle_")))
    raise BadInput(f"unknown task {task!r} (known: {', '.join(known)})")


def task_manager(include_path: str | None = None, metadata: dict[str, Any] | None = None):
    """lm-eval's TaskManager over evalkit's tasks (and `include_path`), without the built-ins."""
    from lm_eval.tasks import TaskManager

    paths = [str(tasks_path())] + ([str(include_path)] if include_path else [])
    return TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
