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
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from evalkit import envvars
from evalkit.errors import BadInput
from evalkit.paths import MAX_YAML_BYTES, check_input_path, read_input

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


def read_yaml(path: Path) -> Any:
    """A task YAML through the door (`paths.read_input`: a regular file of at most MAX_YAML_BYTES,
    a FIFO never waited on), parsed as lm-eval parses it (`!function` tags as plain strings);
    BadInput for a file of the wrong kind or size, None for one that does not parse (lm-eval
    reports a broken file itself when it loads it)."""
    raw = read_input(path, "task file", MAX_YAML_BYTES)
    try:
        return yaml.load(raw.decode("utf-8"), Loader=_Loader)
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError):
        return None


def _declared(path: Path) -> set[str]:
    cfg = read_yaml(path)
    if not isinstance(cfg, dict):
        return set()
    include = cfg.get("include")
    if isinstance(include, str):  # lm-eval reads it too: through the same door first
        target = Path(include) if Path(include).is_absolute() else path.parent / include
        if os.path.lexists(target):
            check_input_path(target, "task file", "file", MAX_YAML_BYTES)
    names: set[str] = set()
    for key in ("task", "group", "tag"):
        value = cfg.get(key)
        values = value if isinstance(value, list) else [value]
        names.update(v for v in values if isinstance(v, str))
    return names


def yaml_files(folder: Path) -> list[Path]:
    """The `*.yaml` files under `folder`, as lm-eval's TaskManager finds them (`**/*.yaml`)."""
    return sorted(Path(folder).rglob("*.yaml"))


def task_names(folders: Iterable[Path]) -> set[str]:
    """Every `task`, `group` and `tag` name declared in the YAML files under `folders`; BadInput
    for one lm-eval could not read either (a FIFO, a device, a folder, over MAX_YAML_BYTES), and
    for a FIFO, device or socket anywhere in the folders (lm-eval imports and reads files there
    by name)."""
    names: set[str] = set()
    for folder in folders:
        for here, _, _ in os.walk(folder):  # lm-eval also imports `!function` modules and reads data files here
            check_input_path(here, "task folder", "folder")
        for path in yaml_files(folder):
            names |= _declared(path)
    return names


def expand(names: Iterable[str]) -> list[str]:
    """Task names with evalkit's groups replaced by their tasks (other names as they are).

    >>> expand(["firsttoken", "needle_en"])
    ['firsttoken_en', 'firsttoken_zh', 'needle_en']
    """
    groups: dict[str, list[str]] = {}
    for path in yaml_files(tasks_path()):
        cfg = _yaml_config(str(path))
        if isinstance(cfg.get("group"), str) and isinstance(cfg.get("task"), list):
            groups[cfg["group"]] = [t for t in cfg["task"] if isinstance(t, str)]
    out: list[str] = []
    for name in names:
        out += expand(groups[name]) if name in groups else [name]
    return list(dict.fromkeys(out))


@functools.lru_cache(maxsize=64)
def _yaml_config(path: str) -> dict[str, Any]:
    cfg = read_yaml(Path(path))
    return cfg if isinstance(cfg, dict) else {}


def generation_kwargs(task: str) -> dict[str, Any]:
    """A built-in task's `generation_kwargs`, following its `include:` (e.g. `until`, `max_gen_toks`).

    Raises BadInput for a name that is not a built-in task with generation settings.
    """
    root = tasks_path()
    for path in yaml_files(root):
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
    """lm-eval's TaskManager over evalkit's tasks (and `include_path`), without the built-ins; every
    YAML lm-eval will read there is checked first (`task_names`: BadInput, never a wait on a FIFO)."""
    from lm_eval.tasks import TaskManager

    paths = [str(tasks_path())] + ([str(include_path)] if include_path else [])
    task_names(Path(p) for p in paths)
    return TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
