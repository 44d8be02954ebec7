"""`evalkit query` is a sandbox made of DuckDB's own settings: every statement type DuckDB's
parser knows, plain and wrapped, on one DB and on several, writes no file, changes no DB,
reads no file that was not named, and ends with exit 2 and one line.

The statements below are chosen to do harm if they ran: write a file, attach or change a
database, read a file nobody named, install or load an extension, turn a setting back.
A test first checks that each plain statement really parses as the type it stands for,
so every type DuckDB lists (but the three no SQL text produces) is covered.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from evalkit.cli import cli
from tests.test_bad_input import seed_db

# statement type -> SQL that would do harm; {out} a file that must not appear, {secret} a file
# that must not be read, {other} an evalkit DB that must not change
HARMFUL = {
    "SELECT": "SELECT * FROM read_csv('{secret}')",
    "INSERT": "INSERT INTO tags VALUES ('x', 'y', now())",
    "UPDATE": "UPDATE runs SET status = 'failed'",
    "CREATE": "CREATE TABLE evil AS SELECT * FROM read_csv('{secret}')",
    "DELETE": "DELETE FROM runs",
    "PREPARE": "PREPARE evil AS DELETE FROM runs",
    "EXECUTE": "EXECUTE evil",
    "ALTER": "ALTER TABLE runs RENAME TO gone",
    "TRANSACTION": "BEGIN TRANSACTION",
    "COPY": "COPY runs TO '{out}'",
    "ANALYZE": "ANALYZE runs",
    "VARIABLE_SET": "SET VARIABLE evil = (SELECT content FROM read_text('{secret}'))",
    "CREATE_FUNC": "CREATE MACRO evil() AS TABLE SELECT * FROM read_csv('{secret}')",
    "EXPLAIN": "EXPLAIN ANALYZE COPY runs TO '{out}'",
    "DROP": "DROP TABLE samples",
    "EXPORT": "EXPORT DATABASE '{out}'",
    "PRAGMA": "PRAGMA import_database('{outdir}')",
    "VACUUM": "VACUUM",
    "CALL": "CALL pragma_database_size()",
    "SET": "SET enable_external_access = true",
    "LOAD": "LOAD '{out}'",
    "EXTENSION": "INSTALL httpfs",
    "ATTACH": "ATTACH '{other}' AS other",
    "DETACH": "DETACH evalkit",
    "MULTI": "PIVOT read_csv('{secret}') ON column0",
    "COPY_DATABASE": "COPY FROM DATABASE evalkit TO other",
    "MERGE_INTO": "MERGE INTO tags USING (SELECT 'a' AS tag) s ON false WHEN NOT MATCHED THEN INSERT "
                  "VALUES ('a', 'b', now())",
}
# types no SQL text parses to: built from the API (relations, logical plans) or an error marker
NOT_FROM_SQL = {"INVALID", "RELATION", "LOGICAL_PLAN"}
# types this DuckDB's parser reports as another: INSTALL as LOAD, ANALYZE as VACUUM, SET VARIABLE as SET,
# CREATE MACRO as CREATE, and COPY FROM DATABASE as a PRAGMA (which is why PRAGMA is not trusted by type)
FOLDED = {"EXTENSION": "LOAD", "ANALYZE": "VACUUM", "VARIABLE_SET": "SET", "CREATE_FUNC": "CREATE",
          "COPY_DATABASE": "PRAGMA"}
# and a statement whose type the Python package does not list at all (extract_statements raises)
UNLISTED = {"UPDATE_EXTENSIONS": "UPDATE EXTENSIONS"}
# the ways a statement is wrapped inside another
WRAPS = {
    "plain": "{sql}",
    "explain-analyze": "EXPLAIN ANALYZE {sql}",
    "after-a-select": "SELECT 42; {sql}",
    "in-a-cte": "WITH x AS (SELECT 1) {sql}",
    "subquery": "SELECT * FROM ({sql})",
}


def test_every_parseable_statement_type_is_covered():
    types = set(duckdb.StatementType.__members__) - NOT_FROM_SQL
    assert set(HARMFUL) == types
    con = duckdb.connect(":memory:")
    for kind, sql in HARMFUL.items():
        text = sql.format(secret="/x", out="/x", outdir="/x", other="/x")
        assert con.extract_statements(text)[0].type.name == FOLDED.get(kind, kind), (kind, text)
    for sql in UNLISTED.values():
        with pytest.raises(ValueError):
            [st.type for st in con.extract_statements(sql)]


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sandbox-seed")
    seed_db(folder / "a.duckdb", runs=1)
    seed_db(folder / "b.duckdb", runs=1)
    return folder


STATEMENTS = {**HARMFUL, **UNLISTED}
CASES = [(kind, wrap) for kind in STATEMENTS for wrap in WRAPS]


def _workspace(seeded, tmp_path, merged: bool):
    """Copies of the seeded DBs and a secret file to tempt a statement; (folder, secret, an
    outside DB, the --db options of one DB or two merged)."""
    work = tmp_path / "work"
    work.mkdir()
    for name in ("a.duckdb", "b.duckdb"):
        (work / name).write_bytes((seeded / name).read_bytes())
    secret = work / "secret.csv"
    secret.write_text("password\nhunter2\n", encoding="utf-8")
    other = tmp_path / "other.duckdb"
    other.write_bytes((seeded / "b.duckdb").read_bytes())
    dbs = ["--db", str(work / "a.duckdb")] + (["--db", str(work / "b.duckdb")] if merged else [])
    return work, secret, other, dbs


@pytest.mark.parametrize("merged", [False, True], ids=["one-db", "two-dbs"])
def test_no_statement_writes_reads_or_changes_anything(seeded, tmp_path, merged):
    work, secret, other, dbs = _workspace(seeded, tmp_path, merged)
    before, before_other = digest(work), other.read_bytes()
    tried, refused = 0, 0
    for kind, wrap in CASES:
        sql = WRAPS[wrap].format(sql=STATEMENTS[kind].format(secret=secret, out=work / "leak.out", outdir=work,
                                                           other=other))
        res = CliRunner().invoke(cli, ["query", sql, *dbs], catch_exceptions=False)
        tried += 1
        lines = res.stderr.strip().splitlines()
        where = f"{kind}/{wrap}: {sql}\n{res.output}"
        assert res.exit_code == 2, where
        assert len(lines) == 1 and lines[0].startswith("evalkit: error: "), where
        assert "hunter2" not in res.output, where
        assert digest(work) == before, f"a file changed or appeared: {where}"
        assert other.read_bytes() == before_other, where
        refused += 1
    assert tried == refused == len(STATEMENTS) * len(WRAPS)
    print(f"\n{'two DBs' if merged else 'one DB'}: {tried} statements ({len(STATEMENTS)} statement types x "
          f"{len(WRAPS)} wrappings) refused, exit 2, one line, nothing changed")


def test_reads_still_work(seeded, tmp_path):
    db = tmp_path / "a.duckdb"
    db.write_bytes((seeded / "a.duckdb").read_bytes())
    for sql in ("SELECT count(*) FROM runs", "DESCRIBE runs", "SHOW TABLES", "SUMMARIZE metrics",
                "PIVOT (SELECT task, metric FROM metrics) ON task USING count(*)", "EXPLAIN SELECT * FROM samples",
                "PRAGMA table_info('runs')"):
        res = CliRunner().invoke(cli, ["query", sql, "--db", str(db)], catch_exceptions=False)
        assert res.exit_code == 0, (sql, res.output)


@pytest.mark.parametrize("merged", [False, True], ids=["one-db", "two-dbs"])
def test_the_sandbox_holds_without_the_statement_check(seeded, tmp_path, monkeypatch, merged):
    """With the second layer (the statement-type check) switched off, DuckDB's own settings alone
    keep every statement from writing a file, changing a DB or reading a file nobody named. Some
    statements then run (exit 0) — a CREATE TABLE in the in-memory merge, a BEGIN — harmlessly."""
    from evalkit.store import sandbox

    monkeypatch.setattr(sandbox, "check_read_only", lambda sql: None)
    work, secret, other, dbs = _workspace(seeded, tmp_path, merged)
    before, before_other = digest(work), other.read_bytes()
    outcomes = {0: 0, 2: 0}
    for kind, wrap in CASES:
        sql = WRAPS[wrap].format(sql=STATEMENTS[kind].format(secret=secret, out=work / "leak.out", outdir=work,
                                                           other=other))
        res = CliRunner().invoke(cli, ["query", sql, *dbs], catch_exceptions=False)
        where = f"{kind}/{wrap}: {sql}\n{res.output}"
        assert res.exit_code in outcomes and "Traceback" not in res.output, where
        outcomes[res.exit_code] += 1
        assert "hunter2" not in res.output, where
        assert digest(work) == before, f"a file changed or appeared: {where}"
        assert other.read_bytes() == before_other, where
    print(f"\nsandbox alone, {'two DBs' if merged else 'one DB'}: {outcomes[2]} refused by DuckDB, "
          f"{outcomes[0]} ran harmlessly; no file changed")
