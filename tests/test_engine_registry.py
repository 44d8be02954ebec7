"""The registry of engines (`evalkit.engines.ENGINES`) is the one place that names them.

Each record's module, resolver and model type are real; the docs' refusal table is the
registry's, row for row; each refusal is the line the engine prints; resolution reaches every
engine through the registry only; and importing the registry, the resolver and the catalog
imports no engine.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from evalkit.engines import ENGINES, OTHER_RESOLVER, engine_for, load_resolver, refusal_table
from evalkit.errors import BadInput

ROOT = Path(__file__).resolve().parent.parent
ENGINES_DIR = ROOT / "evalkit" / "engines"


def test_every_record_names_a_real_module_resolver_and_engine_folder():
    for record in ENGINES:
        assert callable(record.resolve_with()), record.name
        module, _, _ = record.resolver.partition(":")
        folder = record.module.rsplit(".", 1)[0]
        assert module.startswith(folder + "."), f"{record.name}: its resolver lives outside its folder"
        assert (ROOT / (record.module.replace(".", "/") + ".py")).is_file(), record.module
        assert engine_for(record.name) is record
        for alias in record.aliases:
            assert engine_for(alias) is record
    assert callable(load_resolver(OTHER_RESOLVER))
    assert len({r.engine for r in ENGINES}) == len(ENGINES)


def test_the_docs_refusal_table_is_the_registry():
    text = (ROOT / "docs" / "engines.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- refusals:[^>]*-->\n(.*?)<!-- /refusals -->", text, re.S)
    assert block, "docs/engines.md has no refusal table"
    rows = [line for line in block.group(1).splitlines() if line.startswith("| `")]
    assert rows == [f"| `{e}` | `{o}` | {w} |" for e, o, w in refusal_table()]


@pytest.mark.parametrize("engine, option, why", refusal_table())
def test_each_refusal_is_the_line_the_engine_prints(engine, option, why):
    from evalkit.engines.resolve import resolve

    record = next(r for r in ENGINES if r.engine == engine)
    model_type = record.aliases[0]
    asked = {"--quant": {"quant_name": "bf16"}, "--attention": {"attention": True},
             "--device": {"device": "cuda"}, "--kv-cache": {"kv_cache": "window:8"},
             "--first-temperature": {"first_temperature": 1.0}, "--ban-openers": {"ban_openers": True}}[option]
    if record.package and importlib.util.find_spec(record.package) is None:
        pytest.skip(f"{record.package} is not installed")
    with pytest.raises(BadInput) as err:
        resolve(model_type, None, **asked)
    assert str(err.value) == f"{option} cannot run with --model {model_type}: {why}"


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at module level or inside a function, as written."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_the_shared_modules_import_no_engine_folder():
    """resolve, plan, firststep, kvpolicy, catalog, validate and the registry reach the engine folders
    through the registry's names only (a dotted path, imported when a model of that engine is resolved)."""
    folders = {p.name for p in ENGINES_DIR.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == {"transformers", "llamacpp", "server", "vllm"}
    for path in ENGINES_DIR.glob("*.py"):
        reached = {m for m in _imports(path) for f in folders if m.startswith(f"evalkit.engines.{f}")}
        assert not reached, f"{path.name} imports {sorted(reached)}"


def test_importing_the_registry_and_resolver_imports_no_engine():
    code = ("import sys, evalkit.engines, evalkit.engines.resolve, evalkit.engines.catalog\n"
            "print(sorted(m for m in sys.modules if m.startswith('evalkit.engines.') and m.count('.') > 2"
            " or m in ('torch', 'lm_eval', 'numpy', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
