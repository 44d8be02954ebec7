"""Names a run may ask for, found without importing lm-eval's heavy modules.

Owns: the task/group/tag names of evalkit's task folders (read from the YAML
files) and the model type names lm-eval registers (read from its model modules'
`register_model(...)` calls). Importing `lm_eval.tasks` or `lm_eval.models`
costs seconds; validating a run's names must not, so that bad input is refused
fast and `evalkit run` starts loading the model within its budget (SPEC 4).
Does not: build tasks or models.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

import yaml

from evalkit.errors import BadInput


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads lm-eval's `!function module.name` tags as plain strings."""


_Loader.add_multi_constructor("!", lambda loader, suffix, node: None)


def task_names(folders: list[Path]) -> set[str]:
    """Every `task`, `group` and `tag` name declared in the YAML files under `folders`."""
    names: set[str] = set()
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.yaml")):
            try:
                cfg = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)
            except (yaml.YAMLError, UnicodeDecodeError, OSError):
                continue  # lm-eval reports broken files itself when it loads them
            if not isinstance(cfg, dict):
                continue
            for key in ("task", "group", "tag"):
                value = cfg.get(key)
                values = value if isinstance(value, list) else [value]
                names.update(v for v in values if isinstance(v, str))
    return names


_REGISTER = re.compile(r"register_model\(([^)]*)\)")


@functools.lru_cache(maxsize=1)
def model_types() -> frozenset[str]:
    """Model type names registered by lm-eval's model modules, plus evalkit's own."""
    names = {"evalkit-hf", "evalkit-vllm"}
    spec = importlib.util.find_spec("lm_eval")
    if spec and spec.submodule_search_locations:
        models = Path(list(spec.submodule_search_locations)[0]) / "models"
        for path in models.glob("*.py"):
            for args in _REGISTER.findall(path.read_text(encoding="utf-8", errors="replace")):
                names.update(re.findall(r"[\"']([^\"']+)[\"']", args))
    return frozenset(names)


# model type -> the package it needs beyond lm-eval's own requirements
BACKEND_PACKAGES = {"vllm": "vllm", "evalkit-vllm": "vllm"}


def check_installed(name: str) -> None:
    """Raise BadInput when model type `name` needs a package that is not installed here.

    Found with `find_spec`, without importing the package (importing vllm takes seconds)."""
    package = BACKEND_PACKAGES.get(name)
    if package and importlib.util.find_spec(package) is None:
        raise BadInput(f"--model {name} needs the {package!r} package, which is not installed: pip install {package}")


def is_model_type(name: str) -> bool:
    """Known to lm-eval, either from its sources or registered in this process already."""
    if name in model_types():
        return True
    import sys

    if "lm_eval.api.registry" in sys.modules:  # someone registered models in-process (plugins, tests)
        from lm_eval.api.registry import model_registry

        return name in model_registry
    return False
