"""SPEC 5, bad input: every command × every bad input → exit 2, one line on stderr, the DB untouched.

One table (`CASES`) drives the test here and `bench/bad_input_table.py`,
which runs the same cases through the real `evalkit` process and writes the
case → message table to bench/bad_input_table.md. Rows for commands not
registered yet are skipped, not dropped.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

FAKE = ["--model", "evalkit-fake", "--model-args", "mode=hit"]


@dataclass(frozen=True)
class Case:
    """One bad input: argv with {placeholders} (see `make_inputs`), a fragment the message must hold,
    and the file that must stay byte-identical ("db": the seeded evalkit DB)."""

    id: str
    argv: tuple[str, ...]
    expect: str
    watch: str = "db"

    @property
    def command(self) -> str:
        return self.argv[0]

    def args(self, paths: dict[str, str]) -> list[str]:
        return [a.format(**paths) for a in self.argv]


def _case(id, argv, expect, watch="db"):
    return Case(id, tuple(argv), expect, watch)


WRITE_SQL = {
    "insert": ("INSERT INTO tags VALUES ('x', 'y', now())", "INSERT"),
    "delete": ("DELETE FROM runs", "DELETE"),
    "drop": ("DROP TABLE samples", "DROP"),
    "create": ("CREATE TABLE t AS SELECT 1 AS a", "CREATE"),
    "copy-to": ("COPY runs TO '{tmp}/runs.csv'", "COPY"),
    "attach": ("ATTACH '{tmp}/other.duckdb' AS other", "ATTACH"),
    "update": ("UPDATE runs SET name = 'x'", "UPDATE"),
    "select-then-drop": ("SELECT 1; DROP TABLE runs", "DROP"),
}

CASES: list[Case] = [
    # run: validated before anything is written
    _case("run/unknown-task", ["run", *FAKE, "--tasks", "nope_task", "--db", "{db}"], "nope_task"),
    _case("run/unknown-model-type", ["run", "--model", "nope-model", "--tasks", "firsttoken", "--db", "{db}"],
          "nope-model"),
    _case("run/model-path-missing", ["run", "--model", "hf", "--model-args", "pretrained={tmp}/no-such-model",
                                     "--tasks", "firsttoken", "--db", "{db}"], "no-such-model"),
    _case("run/model-args-no-equals", ["run", "--model", "evalkit-fake", "--model-args", "mode",
                                       "--tasks", "firsttoken", "--db", "{db}"], "--model-args"),
    _case("run/model-args-twice", ["run", "--model", "evalkit-fake", "--model-args", "mode=hit,mode=key",
                                   "--tasks", "firsttoken", "--db", "{db}"], "mode"),
    _case("run/tolerance-out-of-range", ["run", "--model", "hf", "--model-args", "tolerance=2",
                                         "--tasks", "firsttoken", "--db", "{db}"], "tolerance"),
    _case("run/prune-below-gone", ["run", "--model", "hf", "--model-args", "prune_below=1e-7",
                                   "--tasks", "firsttoken", "--db", "{db}"], "tolerance"),
    _case("run/dtype-on-embedded-model", ["run", "--model", "hf", "--model-args", "dtype=bfloat16",
                                          "--tasks", "firsttoken", "--db", "{db}"], "--quant"),
    _case("run/gguf-without-pretrained", ["run", "--model", "hf", "--model-args", "gguf_file=/tmp/x.gguf",
                                          "--tasks", "firsttoken", "--db", "{db}"], "pretrained"),
    _case("run/prompts-missing", ["run", *FAKE, "--prompts", "{tmp}/missing.jsonl", "--db", "{db}"], "missing.jsonl"),
    _case("run/prompts-bad-json", ["run", *FAKE, "--prompts", "{bad_json}", "--db", "{db}"], ":2: not valid JSON"),
    _case("run/prompts-empty", ["run", *FAKE, "--prompts", "{empty_jsonl}", "--db", "{db}"], "no prompts"),
    _case("run/prompts-missing-field", ["run", *FAKE, "--prompts", "{no_answers}", "--db", "{db}"], "'answers'"),
    _case("run/prompts-not-utf8", ["run", *FAKE, "--prompts", "{latin1}", "--db", "{db}"], "UTF-8"),
    _case("run/prompts-not-object", ["run", *FAKE, "--prompts", "{not_object}", "--db", "{db}"], "JSON object"),
    _case("run/limit-0", ["run", *FAKE, "--tasks", "firsttoken", "--limit", "0", "--db", "{db}"], "--limit"),
    _case("run/needle-length-0", ["run", *FAKE, "--tasks", "needle", "--needle-lengths", "256,0", "--db", "{db}"],
          "--needle-lengths must be a whole number"),
    _case("run/needle-depth-out-of-range", ["run", *FAKE, "--tasks", "needle", "--needle-depths", "0,1.5", "--db", "{db}"],
          "--needle-depths must lie in [0, 1]"),
    _case("run/limit-negative", ["run", *FAKE, "--tasks", "firsttoken", "--limit", "-3", "--db", "{db}"], "-3"),
    _case("run/limit-not-a-number", ["run", *FAKE, "--tasks", "firsttoken", "--limit", "abc", "--db", "{db}"],
          "--limit"),
    _case("run/no-tasks", ["run", *FAKE, "--db", "{db}"], "--tasks"),
    _case("run/unknown-template", ["run", *FAKE, "--tasks", "firsttoken", "--template", "nope", "--db", "{db}"],
          "'nope'"),
    _case("run/templates-file-not-yaml", ["run", *FAKE, "--tasks", "firsttoken", "--templates-file", "{not_yaml}",
                                          "--db", "{db}"], "YAML"),
    _case("run/unknown-quant", ["run", "--tasks", "firsttoken", "--quant", "q9", "--db", "{db}"], "q9"),
    _case("run/db-text-file", ["run", *FAKE, "--tasks", "firsttoken", "--limit", "1", "--db", "{text_db}"],
          "not a DuckDB file", watch="text_db"),
    _case("run/db-empty-file", ["run", *FAKE, "--tasks", "firsttoken", "--limit", "1", "--db", "{empty_db}"],
          "not a DuckDB file", watch="empty_db"),
    # runs / show
    _case("runs/db-text-file", ["runs", "--db", "{text_db}"], "DuckDB", watch="text_db"),
    _case("runs/db-empty-file", ["runs", "--db", "{empty_db}"], "DuckDB", watch="empty_db"),
    _case("runs/db-missing", ["runs", "--db", "{tmp}/missing.duckdb"], "missing.duckdb"),
    _case("show/unknown-run", ["show", "zz-no-such-run", "--db", "{db}"], "zz-no-such-run"),
    _case("show/ambiguous-run", ["show", "{prefix}", "--db", "{db}"], "ambiguous"),
    _case("show/empty-run", ["show", "", "--db", "{db}"], "empty run id"),
    _case("show/unknown-tag", ["show", "tag:nope", "--db", "{db}"], "nope"),
    _case("show/db-text-file", ["show", "latest", "--db", "{text_db}"], "DuckDB", watch="text_db"),
    _case("show/db-empty-file", ["show", "latest", "--db", "{empty_db}"], "DuckDB", watch="empty_db"),
    # query: writes refused, on one DB and on several
    *[_case(f"query/{name}", ["query", sql, "--db", "{db}"], kind) for name, (sql, kind) in WRITE_SQL.items()],
    _case("query/merged-insert", ["query", WRITE_SQL["insert"][0], "--db", "{db}", "--db", "{db2}"], "INSERT"),
    _case("query/merged-copy-to", ["query", WRITE_SQL["copy-to"][0], "--db", "{db}", "--db", "{db2}"], "COPY"),
    _case("query/syntax-error", ["query", "SELEC * FROM runs", "--db", "{db}"], "SQL error"),
    _case("query/unknown-table", ["query", "SELECT * FROM nope", "--db", "{db}"], "nope"),
    _case("query/db-text-file", ["query", "SELECT 1", "--db", "{text_db}"], "DuckDB", watch="text_db"),
    _case("query/db-empty-file", ["query", "SELECT 1", "--db", "{empty_db}"], "DuckDB", watch="empty_db"),
    _case("query/merged-db-text-file", ["query", "SELECT 1", "--db", "{db}", "--db", "{text_db}"], "DuckDB",
          watch="text_db"),
    _case("query/parquet-missing", ["query", "SELECT 1", "--parquet", "{tmp}/no-export", "--db", "{db}"], "no-export"),
    # export
    _case("export/db-text-file", ["export", "--parquet", "{tmp}/out", "--db", "{text_db}"], "DuckDB", watch="text_db"),
    _case("export/db-empty-file", ["export", "--parquet", "{tmp}/out", "--db", "{empty_db}"], "DuckDB",
          watch="empty_db"),
    _case("export/db-missing", ["export", "--parquet", "{tmp}/out", "--db", "{tmp}/missing.duckdb"], "missing.duckdb"),
    _case("export/out-is-a-file", ["export", "--parquet", "{text_db}", "--db", "{db}"], "not a folder"),
    # compare / gate / promote / inspect / report / needle-heatmap (skipped until registered)
    _case("compare/unknown-run", ["compare", "zz-no-such-run", "latest", "--db", "{db}"], "zz-no-such-run"),
    _case("compare/db-text-file", ["compare", "latest", "latest", "--db", "{text_db}"], "DuckDB", watch="text_db"),
    _case("gate/rules-not-yaml", ["gate", "--candidate", "latest", "--baseline", "latest", "--rules", "{not_yaml}",
                                  "--db", "{db}"], "YAML"),
    _case("gate/rules-bad-threshold", ["gate", "--candidate", "latest", "--baseline", "latest", "--rules",
                                       "{bad_rules}", "--db", "{db}"], "ft_hit"),
    _case("gate/rules-missing", ["gate", "--candidate", "latest", "--baseline", "latest", "--rules",
                                 "{tmp}/missing-rules.yaml", "--db", "{db}"], "missing-rules.yaml"),
    _case("gate/unknown-baseline-tag", ["gate", "--candidate", "latest", "--baseline", "tag:nope", "--db", "{db}"],
          "nope"),
    _case("promote/unknown-run", ["promote", "zz-no-such-run", "--tag", "prod", "--db", "{db}"], "zz-no-such-run"),
    _case("report/unknown-run", ["report", "--runs", "zz-no-such-run", "--out", "{tmp}/report", "--db", "{db}"],
          "zz-no-such-run"),
    _case("report/db-text-file", ["report", "--out", "{tmp}/report", "--db", "{text_db}"], "DuckDB", watch="text_db"),
    _case("needle-heatmap/unknown-run", ["needle-heatmap", "zz-no-such-run", "--out", "{tmp}/report", "--db", "{db}"],
          "zz-no-such-run"),
    _case("inspect/unknown-template", ["inspect", "What is recursion?", "--template", "nope"], "'nope'"),
    _case("inspect/unknown-quant", ["inspect", "What is recursion?", "--quant", "q9"], "q9"),
]


def make_inputs(folder: Path, db: Path, db2: Path, prefix: str) -> dict[str, str]:
    """Write the bad files the cases point at; return the placeholders of `Case.argv`."""
    folder = Path(folder)
    files = {
        "bad_json": (b'{"prompt": "hi", "answers": ["x"], "lang": "en"}\n{bad json\n'),
        "empty_jsonl": b"",
        "no_answers": b'{"prompt": "hi", "lang": "en"}\n',
        "latin1": '{"prompt": "café", "answers": ["x"], "lang": "en"}\n'.encode("latin-1"),
        "not_object": b'["hi", ["x"], "en"]\n',
        "not_yaml": b"thresholds: [ft_hit, {\n  - : :\n",
        "bad_rules": b'thresholds:\n  ft_hit: "about half"\n',
        "text_db": b"this is a text file, not a DuckDB database\n",
        "empty_db": b"",
    }
    suffix = {"text_db": ".duckdb", "empty_db": ".duckdb", "not_yaml": ".yaml", "bad_rules": ".yaml"}
    paths = {"tmp": str(folder), "db": str(db), "db2": str(db2), "prefix": prefix}
    for name, data in files.items():
        path = folder / f"{name}{suffix.get(name, '.jsonl')}"
        path.write_bytes(data)
        paths[name] = str(path)
    return paths


def seed_db(path: Path, runs: int = 2) -> list[str]:
    """A DB holding `runs` finished fake-LM runs (firsttoken, 2 prompts per task); return their ids."""
    from evalkit.runner.execute import RunConfig, execute
    from tests.fake_lm import register_fake_lm

    register_fake_lm()
    cfg = RunConfig(tasks=["firsttoken"], model="evalkit-fake", model_args="mode=hit", limit=2, db=str(path))
    return [execute(cfg).run_id for _ in range(runs)]


def common_prefix(ids: list[str]) -> str:
    prefix = os.path.commonprefix(ids)
    assert prefix, f"run ids share no prefix: {ids}"
    return prefix


def fingerprint(folder: Path) -> dict[str, str]:
    """name -> sha256 of every file in the folder (a new .wal or a changed byte both show)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def registered(command: str) -> bool:
    from evalkit.cli import cli

    return command in cli.commands


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """(seeded DB, a second seeded DB, an id prefix shared by two runs)."""
    folder = tmp_path_factory.mktemp("seed")
    ids = seed_db(folder / "seed.duckdb")
    seed_db(folder / "seed2.duckdb", runs=1)
    return folder / "seed.duckdb", folder / "seed2.duckdb", common_prefix(ids)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, seeded, tmp_path):
    if not registered(case.command):
        pytest.skip(f"`evalkit {case.command}` is not registered yet")
    from click.testing import CliRunner

    from evalkit.cli import cli

    seed, seed2, prefix = seeded
    dbdir = tmp_path / "dbs"
    dbdir.mkdir()
    db, db2 = dbdir / "evalkit.duckdb", dbdir / "other.duckdb"
    db.write_bytes(seed.read_bytes())
    db2.write_bytes(seed2.read_bytes())
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    paths = make_inputs(inputs, db, db2, prefix)
    before_db, before_inputs = fingerprint(dbdir), fingerprint(inputs)

    result = CliRunner().invoke(cli, case.args(paths), catch_exceptions=False)

    message = result.stderr
    print(f"{case.id}: exit {result.exit_code}: {message.strip()}")
    lines = message.strip().splitlines()
    shown = f"\n--- stderr ---\n{message}--- stdout ---\n{result.stdout}"
    assert result.exit_code == 2, f"exit {result.exit_code}, expected 2{shown}"
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}{shown}"
    assert "Traceback" not in message, shown
    assert lines[0].startswith("evalkit: error: "), shown
    assert case.expect.lower() in lines[0].lower(), f"message does not name {case.expect!r}{shown}"
    assert fingerprint(dbdir) == before_db, f"the DB folder changed{shown}"
    assert fingerprint(inputs) == before_inputs, f"an input file changed (watching {case.watch}){shown}"
