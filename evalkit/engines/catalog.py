"""Model type names a run may ask for, found without importing lm-eval's model modules.

Owns: the model type names lm-eval registers (read from its model modules'
`register_model(...)` calls) and whether an engine's extra package is installed.
Importing `lm_eval.models` costs seconds; validating a run's names must not, so
that bad input is refused fast and `evalkit run` starts loading the model within
its budget. Does not: build models (task names: `evalkit.prompts.catalog`).
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

from evalkit.engines import ENGINES, engine_for
from evalkit.errors import BadInput

_REGISTER = re.compile(r"register_model\(([^)]*)\)")


@functools.lru_cache(maxsize=1)
def model_types() -> frozenset[str]:
    """Model type names registered by lm-eval's model modules, plus evalkit's own."""
    names = {e.name for e in ENGINES} | {a for e in ENGINES for a in e.aliases}
    spec = importlib.util.find_spec("lm_eval")
    if spec and spec.submodule_search_locations:
        models = Path(list(spec.submodule_search_locations)[0]) / "models"
        for path in models.glob("*.py"):
            for args in _REGISTER.findall(path.read_text(encoding="utf-8", errors="replace")):
                names.update(re.findall(r"[\"']([^\"']+)[\"']", args))
    return frozenset(names)


def check_installed(name: str) -> None:
    """Raise BadInput when model type `name` needs a package that is not installed here.

    Found with `find_spec`, without importing the package (importing vllm takes seconds)."""
    record = engine_for(name)
    package = record.package if record else None
    if package and importlib.util.find_spec(package) is None:
        how = record.install if record and record.install else f"pip install {package}"
        raise BadInput(f"--model {name} needs the {package!r} package, which is not installed: {how}")


def is_model_type(name: str) -> bool:
    """Known to lm-eval, either from its sources or registered in this process already."""
    if name in model_types():
        return True
    import sys

    if "lm_eval.api.registry" in sys.modules:  # someone registered models in-process (plugins, tests)
        from lm_eval.api.registry import model_registry

        return name in model_registry
    return False
