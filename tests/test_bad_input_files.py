"""Bad input, third round (issue 36): files, folders and the store — classes 1, 7 and 10.

The same contract as tests/test_bad_input.py (exit 2, one line, the DB folder and the inputs
byte for byte), for output paths that are no regular file (class 1), input files and numbers
of every size and kind (class 7) and DuckDB files of other programs (class 10). `FILE_CASES`
also feeds bench/bad_input_table.py; each id starts with its class (`c1-outputs/...`), so the
table counts each class. Classes 4, 5 and 6 are not one-command cases (a planted tmp folder,
a copied DB, a second process): tests/test_spool_folders.py and tests/test_input_files.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.test_bad_input import FAKE, Case, _case, fingerprint, make_inputs, registered

GATE = ["gate", "--candidate", "latest", "--baseline", "latest", "--db", "{db}"]
FOREIGN = {  # another program's DuckDB file, each shape that once gave an internal error or was written into
    "schema_version_other_columns": ["CREATE TABLE schema_version (a INTEGER)"],
    "evalkit_meta_other_columns": ["CREATE TABLE schema_version (version INTEGER, name VARCHAR)",
                                   "CREATE TABLE evalkit_meta (a INTEGER)"],
    "schema_version_in_another_schema": ["CREATE SCHEMA s", "CREATE TABLE s.schema_version (version INTEGER)"],
    "evalkit_meta_a_view": ["CREATE TABLE schema_version (version INTEGER, name VARCHAR)",
                            "CREATE VIEW evalkit_meta AS SELECT 'application_id' AS key, 'evalkit' AS value"],
    "sequence_only": ["CREATE SEQUENCE s"],
    "macro_only": ["CREATE MACRO m(x) AS x + 1"],
}

FILE_CASES: list[Case] = [
    # ---- class 1: outputs that are not regular files -------------------------------------------
    _case("c1-outputs/junit-a-fifo", [*GATE, "--junit", "{fifo}"], "is a FIFO"),
    _case("c1-outputs/step-summary-a-fifo", GATE, "is a FIFO", env=[("GITHUB_STEP_SUMMARY", "{fifo}")]),
    _case("c1-outputs/junit-a-socket", [*GATE, "--junit", "{socket}"], "is a socket"),
    _case("c1-outputs/report-out-a-fifo", ["report", "--out", "{fifo}", "--db", "{db}"], "not a folder"),
    _case("c1-outputs/report-file-a-fifo", ["report", "--out", "{fifo_folder}", "--db", "{db}"], "is a FIFO"),
    _case("c1-outputs/export-a-fifo", ["export", "--parquet", "{fifo}", "--db", "{db}"], "not a folder"),
    _case("c1-outputs/export-table-a-fifo", ["export", "--parquet", "{fifo_export}", "--db", "{db}"], "is a FIFO"),
    _case("c1-outputs/needle-heatmap-out-a-fifo", ["needle-heatmap", "latest", "--out", "{fifo}", "--db", "{db}"],
          "not a folder"),
    # ---- class 7: sizes and kinds of input files, integer ranges ------------------------------------
    _case("c7-sizes/drift-corpus-dev-zero", ["drift-corpus", "/dev/zero", "--quant", "fp32,bf16"],
          "a character device, not a regular file"),
    _case("c7-sizes/drift-corpus-a-fifo", ["drift-corpus", "{fifo}", "--quant", "fp32,bf16"], "a FIFO"),
    _case("c7-sizes/prompts-a-fifo", ["run", *FAKE, "--prompts", "{fifo}", "--db", "{db}"], "a FIFO"),
    _case("c7-sizes/templates-file-a-fifo", ["run", *FAKE, "--tasks", "firsttoken", "--templates-file", "{fifo}",
                                             "--db", "{db}"], "a FIFO"),
    _case("c7-sizes/rules-a-fifo", [*GATE, "--rules", "{fifo}"], "a FIFO"),
    _case("c7-sizes/runs-limit-2-63", ["runs", "--limit", "9223372036854775808", "--db", "{db}"], "--limit"),
    _case("c7-sizes/run-seed-2-31", ["run", *FAKE, "--tasks", "firsttoken", "--seed", "2147483648", "--db", "{db}"],
          "--seed"),
    _case("c7-sizes/run-limit-minus-2-63", ["run", *FAKE, "--tasks", "firsttoken", "--limit", "-9223372036854775809",
                                            "--db", "{db}"], "--limit"),
    _case("c7-sizes/report-prompts-2-63", ["report", "--prompts", "9223372036854775808", "--out", "{tmp}/r",
                                           "--db", "{db}"], "--prompts"),
    _case("c7-sizes/inspect-top-k-400-digits", ["inspect", "Hi", "--top-k", "9" * 400], "--top-k"),
    _case("c7-sizes/drift-corpus-n-ctx-2-63", ["drift-corpus", "{fifo}", "--quant", "fp32,bf16", "--n-ctx",
                                               "9223372036854775808"], "--n-ctx"),
    _case("c7-sizes/needle-lengths-item-2-31", ["run", *FAKE, "--tasks", "needle", "--needle-lengths", "256,2147483648",
                                                "--db", "{db}"], "--needle-lengths"),
    *[_case(f"c7-sizes/db-a-fifo-{argv[0]}", [*argv, "--db", "{fifo}"], "a FIFO, not a DuckDB file")
      for argv in (["runs"], ["migrate"], ["show", "latest"], ["run", *FAKE, "--tasks", "firsttoken", "--limit", "1"],
                   ["compare", "latest", "latest"])],
    _case("c7-sizes/db-a-fifo-merged-query", ["query", "SELECT 1", "--db", "{db}", "--db", "{fifo}"],
          "a FIFO, not a DuckDB file"),
    # ---- class 10: DuckDB files of other programs -----------------------------------------------------
    *[_case(f"c10-foreign/{command}-{shape}", [*argv, "--db", f"{{foreign_{shape}}}"], "another program",
            watch=f"foreign_{shape}")
      for shape in FOREIGN
      for command, argv in (("runs", ["runs"]), ("migrate", ["migrate"]),
                            ("run", ["run", *FAKE, "--tasks", "firsttoken", "--limit", "1"]),
                            ("query", ["query", "SELECT 1"]), ("promote", ["promote", "latest", "--tag", "x"]))],
]


def make_file_inputs(folder: Path) -> dict[str, str]:
    """The special files FILE_CASES point at (FIFOs, a socket, foreign DuckDB files); their placeholders."""
    import socket

    import duckdb

    folder = Path(folder)
    os.mkfifo(folder / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(folder / "socket"))
    sock.close()
    report = folder / "fifo_folder"
    report.mkdir()
    os.mkfifo(report / "index.html")
    export = folder / "fifo_export"
    export.mkdir()
    os.mkfifo(export / "runs.parquet")
    paths = {"fifo": str(folder / "fifo"), "socket": str(folder / "socket"), "fifo_folder": str(report),
             "fifo_export": str(export)}
    for shape, statements in FOREIGN.items():
        path = folder / f"foreign_{shape}.duckdb"
        con = duckdb.connect(str(path))
        for sql in statements:
            con.execute(sql)
        con.close()
        paths[f"foreign_{shape}"] = str(path)
    return paths


@pytest.fixture(scope="module")
def seeded_files(tmp_path_factory):
    from tests.test_bad_input import common_prefix, seed_db

    folder = tmp_path_factory.mktemp("seed")
    ids = seed_db(folder / "seed.duckdb")
    seed_db(folder / "seed2.duckdb", runs=1)
    return folder / "seed.duckdb", folder / "seed2.duckdb", common_prefix(ids)


@pytest.mark.parametrize("case", FILE_CASES, ids=[c.id for c in FILE_CASES])
def test_bad_input_files(case: Case, seeded_files, tmp_path):
    if not registered(case.command):
        pytest.skip(f"`evalkit {case.command}` is not registered yet")
    from click.testing import CliRunner

    from evalkit.cli import cli

    seed, seed2, prefix = seeded_files
    dbdir = tmp_path / "dbs"
    dbdir.mkdir()
    db, db2 = dbdir / "evalkit.duckdb", dbdir / "other.duckdb"
    db.write_bytes(seed.read_bytes())
    db2.write_bytes(seed2.read_bytes())
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    paths = {**make_inputs(inputs, db, db2, prefix), **make_file_inputs(inputs)}
    before_db, before_inputs = fingerprint(dbdir), fingerprint(inputs)

    result = CliRunner().invoke(cli, case.args(paths), catch_exceptions=False, env=case.environ(paths))

    lines = result.stderr.strip().splitlines()
    shown = f"\n--- stderr ---\n{result.stderr}--- stdout ---\n{result.stdout}"
    assert result.exit_code == 2, f"exit {result.exit_code}, expected 2{shown}"
    assert len(lines) == 1 and lines[0].startswith("evalkit: error: "), shown
    assert case.expect.lower() in lines[0].lower(), f"message does not name {case.expect!r}{shown}"
    assert fingerprint(dbdir) == before_db, f"the DB folder changed{shown}"
    assert fingerprint(inputs) == before_inputs, f"an input file changed{shown}"
    assert all(not os.path.exists(p) or not os.path.isfile(p) for k, p in paths.items()
               if k in ("fifo", "socket")), "a special file was replaced by a regular one"
