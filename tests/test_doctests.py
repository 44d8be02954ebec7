"""Every example in evalkit's docstrings runs: each module's `>>>` lines are doctests.

A module whose optional backend is not installed here (vllm, llama_cpp) is skipped with
the reason; one that fails to import for any other reason fails.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import evalkit

OPTIONAL = {"vllm", "llama_cpp"}  # backend packages an extra installs; their modules skip without them
MODULES = sorted(m.name for m in pkgutil.walk_packages(evalkit.__path__, "evalkit."))


def test_every_module_is_listed():
    assert "evalkit.scoring.stats" in MODULES and "evalkit.report.reading" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_module_examples(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{name} needs {exc.name}, not installed here")
        raise
    result = doctest.testmod(module, report=True, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed (output above)"
