"""The DB file opens in DuckDB's own 1.x clients: the `duckdb` CLI of the duckdb-cli package (DuckDB
1.5) runs every `evalkit query` example of the README and docs/storage-and-sql.md on a freshly written
evalkit DB."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from evalkit.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def duckdb_cli() -> str:
    exe = Path(sys.executable).parent / "duckdb"
    if exe.is_file():
        return str(exe)
    found = shutil.which("duckdb")
    if not found:
        pytest.skip("the duckdb CLI is not installed (pip install duckdb-cli, part of the test extra: pip install -e '.[test]')")
    return found


def readme_queries() -> list[str]:
    """The SQL of every `evalkit query "..."` example in the README and docs/storage-and-sql.md (a run
    id placeholder kept as text)."""
    text = "\n".join((ROOT / name).read_text(encoding="utf-8") for name in ("README.md", "docs/storage-and-sql.md"))
    found = re.findall(r'evalkit query (?:--\S+ \S+ )*"((?:SELECT|WITH)[^"]*)"', text, re.S)
    return [" ".join(q.split()) for q in found]


def test_readme_queries_run_in_the_duckdb_cli(tmp_path):
    exe = duckdb_cli()
    version = subprocess.run([exe, "-version"], capture_output=True, text=True, check=True).stdout.strip()
    assert version.startswith("v1."), version
    db = tmp_path / "evalkit.duckdb"
    for _ in range(2):
        res = CliRunner().invoke(cli, ["run", "--model", "evalkit-fake", "--tasks", "firsttoken", "--limit", "2",
                                       "--db", str(db)], catch_exceptions=False)
        assert res.exit_code == 0, res.output
    queries = readme_queries()
    assert len(queries) >= 4, queries
    for sql in queries:
        out = subprocess.run([exe, "-readonly", "-csv", str(db), "-c", sql], capture_output=True, text=True)
        assert out.returncode == 0, f"{sql}\n{out.stderr}"
    out = subprocess.run([exe, "-readonly", "-csv", str(db), "-c",
                          "SELECT count(*) FROM runs; SELECT count(*) > 0 FROM leaderboard"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["count_star()", "2", "(count_star()", ">", "0)", "true"]
