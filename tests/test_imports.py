"""The package's imports form layers without circles (tests/import_graph.py reads them from the source)."""

from __future__ import annotations

from pathlib import Path

from tests import import_graph as ig
import pytest


def test_no_import_circles():
    assert ig.circles(ig.graph()) == [], ig.report(ig.graph())


def test_no_arrow_up():
    assert ig.arrows_up(ig.graph()) == [], ig.report(ig.graph())


def test_every_module_has_a_layer():
    for name in ig.modules():
        ig.layer_of(name)  # raises for a module no layer holds


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "evalkit" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return tmp_path / "evalkit"


def test_the_reader_finds_a_lazy_circle_and_an_arrow_up(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "paths.py": "def f():\n    from evalkit.store.db import x\n",  # floor -> store, inside a function
        "store/__init__.py": "",
        "store/db.py": "from evalkit import paths\nfrom . import runs\nx = 1\n",
        "store/runs.py": "from .db import x\n",  # relative, back to db: a circle db <-> runs
        "report/__init__.py": "",
        "report/reading.py": "import evalkit.engines.resolve\n",
        "engines/__init__.py": "",
        "engines/resolve.py": "import os\n",
    })
    g = ig.graph(pkg)
    assert ig.circles(g) == [["evalkit.paths", "evalkit.store.db", "evalkit.store.runs"]]
    up = ig.arrows_up(g)
    assert any(a.startswith("evalkit.paths (floor) -> evalkit.store.db (store)  at evalkit/paths.py:2") for a in up), up
    assert any(a.startswith("evalkit.report.reading (readers) -> evalkit.engines.resolve (engines)") for a in up), up
    assert len(up) == 2


def test_a_clean_package_passes(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "from evalkit.version import __version__\n",
        "version.py": "__version__ = '0'\n",
        "store/__init__.py": "",
        "store/db.py": "from evalkit.paths import is_duckdb_file\n",
        "paths.py": "def is_duckdb_file(p):\n    return False\n",
    })
    g = ig.graph(pkg)
    assert ig.circles(g) == [] and ig.arrows_up(g) == []


def test_an_unplaced_module_is_named():
    with pytest.raises(ValueError, match="evalkit_extra.x is in no layer"):
        ig.layer_of("evalkit_extra.x")
