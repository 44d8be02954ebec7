"""Every module of the package stays small enough to hold in one's head: at most MAX_LINES lines.

A module that passes about 600 lines, or holds two classes that change for different reasons, is
split along those reasons (one module per job: batching, prefill, the candidate trie, the decoder),
not grown (docs/code-layout.md). The migrations too: an append-only list, ten to a module by number.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "evalkit"
MAX_LINES = 600
EXEMPT: frozenset[str] = frozenset()  # no module is exempt: the migrations are split ten to a module


def too_long(package: Path = PACKAGE, limit: int = MAX_LINES, exempt: frozenset[str] = EXEMPT) -> list[str]:
    """One line for each module of `package` over `limit` lines, longest first, naming the file."""
    found = []
    for path in sorted(package.rglob("*.py")):
        name = path.relative_to(package.parent).as_posix()
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit and name not in exempt:
            found.append((lines, name))
    return [f"{name} has {lines} lines, over {limit}: one module per job, small enough to hold in your head; "
            f"split it along its reasons to change rather than grow it (docs/code-layout.md)"
            for lines, name in sorted(found, reverse=True)]


def test_no_module_passes_the_limit():
    long = too_long()
    assert not long, "\n".join(long)


def test_a_long_module_is_named_and_an_exemption_holds(tmp_path):
    pkg = tmp_path / "evalkit"
    (pkg / "store").mkdir(parents=True)
    (pkg / "short.py").write_text("x = 1\n" * 600, encoding="utf-8")
    (pkg / "long.py").write_text("x = 1\n" * 601, encoding="utf-8")
    (pkg / "store" / "kept.py").write_text("x = 1\n" * 900, encoding="utf-8")
    (found,) = too_long(pkg, exempt=frozenset({"evalkit/store/kept.py"}))
    assert found.startswith("evalkit/long.py has 601 lines, over 600: one module per job")
    assert len(too_long(pkg)) == 2  # nothing is exempt by default
