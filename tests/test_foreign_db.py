"""Another program's DuckDB file is known by what evalkit did not write into it, whatever it
holds (issue 36, class 10): every command that opens a DB refuses it in one line, exit 2,
and leaves it byte for byte.

evalkit knows its own file by its marks (`store.db.inspect_con`): `evalkit_meta` with
evalkit's columns and application_id, `schema_version` with evalkit's columns; a DB from
before the marker by its migration list alone. Tables named like evalkit's (runs,
schema_version, evalkit_meta) with other columns, views in their place, tables in another
schema, and files holding only a sequence, a macro, a type or a schema are all foreign:
none of them is "empty", so no writer migrates into them.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import duckdb
import pytest

from evalkit.store.db import FileState, file_state, inspect_con
from evalkit.store.migrations import MIGRATIONS

SV = "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, name VARCHAR NOT NULL, applied_at TIMESTAMP NOT NULL)"
SHAPES: dict[str, list[str]] = {
    "schema-version-other-columns": ["CREATE TABLE schema_version (a INTEGER)"],
    "schema-version-a-view": ["CREATE VIEW schema_version AS SELECT 1 AS version, 'm001_create_runs' AS name, "
                              "now() AS applied_at"],
    "schema-version-in-another-schema": ["CREATE SCHEMA s", SV.replace("schema_version", "s.schema_version")],
    "schema-version-swapped-types": ["CREATE TABLE schema_version (version VARCHAR, name INTEGER, applied_at DATE)",
                                     "INSERT INTO schema_version VALUES ('1', 1, '2020-01-01')"],
    "meta-other-columns": [SV, "CREATE TABLE evalkit_meta (a INTEGER)"],
    "meta-a-view": [SV, "CREATE VIEW evalkit_meta AS SELECT 'application_id' AS key, 'evalkit' AS value"],
    "meta-of-another-app": [SV, "CREATE TABLE evalkit_meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)",
                            "INSERT INTO evalkit_meta VALUES ('application_id', 'other')"],
    "evalkit-names-other-columns": [SV, "INSERT INTO schema_version VALUES (1, 'm001_create_runs', now())",
                                    "CREATE TABLE runs (x INTEGER)", "CREATE TABLE metrics (y VARCHAR)"],
    "evalkit-migrations-past-the-marker-unmarked": [
        SV, *[f"INSERT INTO schema_version VALUES ({i}, '{m.__name__}', now())" for i, m in enumerate(MIGRATIONS, 1)]],
    "runs-table-only": ["CREATE TABLE runs (id VARCHAR, score DOUBLE)", "INSERT INTO runs VALUES ('a', 1)"],
    "sequence-only": ["CREATE SEQUENCE s"],
    "macro-only": ["CREATE MACRO m(x) AS x + 1"],
    "type-only": ["CREATE TYPE mood AS ENUM ('a', 'b')"],
    "schema-only": ["CREATE SCHEMA other"],
}

# (argv after the command's name, or None for the command's own) for each command that opens a DB
COMMANDS = {
    "runs": ["runs"],
    "show": ["show", "latest"],
    "query": ["query", "SELECT 1"],
    "compare": ["compare", "latest", "latest"],
    "report": ["report", "--out", "{tmp}/report"],
    "export": ["export", "--parquet", "{tmp}/export"],
    "gate": ["gate", "--candidate", "latest", "--baseline", "latest"],
    "promote": ["promote", "latest", "--tag", "prod"],
    "needle-heatmap": ["needle-heatmap", "latest", "--out", "{tmp}/plots"],
    "migrate": ["migrate"],
    "ingest": ["ingest"],
    "resume": ["run", "--resume", "latest"],
    "run": ["run", "--model", "evalkit-fake", "--model-args", "mode=hit", "--tasks", "firsttoken", "--limit", "1"],
}


def make(path: Path, statements: list[str]) -> Path:
    con = duckdb.connect(str(path))
    for sql in statements:
        con.execute(sql)
    con.close()
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def foreign(tmp_path_factory):
    folder = tmp_path_factory.mktemp("foreign")
    return {name: make(folder / f"{name}.duckdb", sql) for name, sql in SHAPES.items()}


@pytest.mark.parametrize("shape", SHAPES)
def test_inspect_calls_each_shape_foreign(foreign, shape):
    assert file_state(foreign[shape]) == FileState("foreign")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_command_refuses_a_foreign_file_unchanged(invoke, foreign, tmp_path, shape, command):
    db = tmp_path / "theirs.duckdb"
    db.write_bytes(foreign[shape].read_bytes())
    before = sorted(p.name for p in tmp_path.iterdir()), digest(db)
    res = invoke(*[a.format(tmp=tmp_path) for a in COMMANDS[command]], "--db", db)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("evalkit: error: "), res.stderr
    assert "another program" in lines[0], lines[0]
    assert (sorted(p.name for p in tmp_path.iterdir()), digest(db)) == before


def test_evalkit_db_and_older_evalkit_db_are_still_known(tmp_path, fake_run):
    db = tmp_path / "ours.duckdb"
    fake_run(db)
    state = file_state(db)
    assert state.kind == "evalkit" and not state.pending
    older = make(tmp_path / "older.duckdb", [SV])
    con = duckdb.connect(str(older))
    for version, m in enumerate(MIGRATIONS[:5], start=1):
        m(con)
        con.execute("INSERT INTO schema_version VALUES (?, ?, now())", [version, m.__name__])
    con.close()
    state = file_state(older)
    assert state.kind == "evalkit" and state.applied == tuple(m.__name__ for m in MIGRATIONS[:5])
    assert file_state(make(tmp_path / "empty.duckdb", [])).kind == "empty"


def test_an_attached_foreign_file_is_foreign_too(foreign):
    con = duckdb.connect(":memory:")
    try:
        for name, path in foreign.items():
            con.execute(f"ATTACH '{path}' AS x (READ_ONLY)")
            assert inspect_con(con, "x").kind == "foreign", name
            con.execute("DETACH x")
    finally:
        con.close()
