"""Reliability, bad input: every command × every bad input → exit 2, one line on stderr, the DB untouched.

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

from tests.fuzz import error_lines

FAKE = ["--model", "evalkit-fake", "--model-args", "mode=hit"]


@dataclass(frozen=True)
class Case:
    """One bad input: argv with {placeholders} (see `make_inputs`), a fragment the message must hold,
    and the file that must stay byte-identical ("db": the seeded evalkit DB)."""

    id: str
    argv: tuple[str, ...]
    expect: str
    watch: str = "db"
    env: tuple[tuple[str, str], ...] = ()  # environment variables, {placeholders} allowed

    @property
    def command(self) -> str:
        return self.argv[0]

    def args(self, paths: dict[str, str]) -> list[str]:
        return [a.format(**paths) for a in self.argv]

    def environ(self, paths: dict[str, str]) -> dict[str, str]:
        return {k: v.format(**paths) for k, v in self.env}


def _case(id, argv, expect, watch="db", env=()):
    return Case(id, tuple(argv), expect, watch, tuple(env))


TINY = ["--model", "hf", "--model-args", "pretrained={tiny}"]
RULES = ["gate", "--candidate", "latest", "--baseline", "latest", "--db", "{db}", "--rules"]
# statements of every type DuckDB's parser knows that could write, read a file or change a
# setting, each as `evalkit query` would get it (see also tests/test_sandbox.py)
SANDBOX_SQL = {
    "explain-analyze-copy": ("EXPLAIN ANALYZE COPY runs TO '{tmp}/leak.csv'", "COPY"),
    "explain-copy-database": ("EXPLAIN ANALYZE COPY FROM DATABASE memory TO other", "PRAGMA"),
    "copy-database": ("COPY FROM DATABASE evalkit TO other", "PRAGMA"),
    "update-extensions": ("UPDATE EXTENSIONS", "unlisted type"),
    "read-csv-passwd": ("SELECT * FROM read_csv('/etc/passwd')", "may only read"),
    "read-text-passwd": ("SELECT * FROM read_text('/etc/passwd')", "may only read"),
    "replacement-scan": ("SELECT * FROM '/etc/passwd'", "does not exist"),  # file scans are off
    "glob": ("SELECT * FROM glob('/etc/*')", "may only read"),
    "read-other-db-bytes": ("SELECT * FROM read_blob('{db2}')", "may only read"),
    "summarize-read-csv": ("SUMMARIZE SELECT * FROM read_csv('/etc/passwd')", "may only read"),
    "pivot-read-csv": ("PIVOT read_csv('/etc/passwd') ON column0", "may only read"),
    "pragma-import": ("PRAGMA import_database('{tmp}')", "PRAGMA"),
    "copy-from": ("COPY tags FROM '/etc/passwd'", "COPY"),
    "export-database": ("EXPORT DATABASE '{tmp}/dump'", "EXPORT"),
    "install": ("INSTALL httpfs", "LOAD"),
    "load": ("LOAD httpfs", "LOAD"),
    "set-external-access": ("SET enable_external_access = true", "SET"),
    "reset-lock": ("RESET lock_configuration", "SET"),
    "call-checkpoint": ("CALL checkpoint()", "CALL"),
    "checkpoint": ("CHECKPOINT", "CALL"),
    "vacuum": ("VACUUM", "VACUUM"),
    "detach": ("DETACH evalkit", "DETACH"),
    "begin": ("BEGIN TRANSACTION", "TRANSACTION"),
    "prepare": ("PREPARE p AS DELETE FROM runs", "PREPARE"),
    "execute": ("EXECUTE p", "EXECUTE"),
    "create-macro": ("CREATE MACRO m(x) AS x + 1", "CREATE"),
    "set-variable": ("SET VARIABLE v = 1", "SET"),
    "alter": ("ALTER TABLE runs RENAME TO r", "ALTER"),
    "analyze": ("ANALYZE", "VACUUM"),
    "merge-into": ("MERGE INTO tags USING tags AS t ON false WHEN NOT MATCHED THEN INSERT VALUES ('a', 'b', now())",
                   "MERGE_INTO"),
}


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
    # ---- the store and the gate must be trusted: sandboxed SQL -----------------------------
    *[_case(f"query/{name}", ["query", sql, "--db", "{db}"], expect) for name, (sql, expect) in SANDBOX_SQL.items()],
    _case("query/merged-read-csv-passwd", ["query", "SELECT * FROM read_csv('/etc/passwd')", "--db", "{db}",
                                          "--db", "{db2}"], "may only read"),
    _case("query/merged-explain-copy", ["query", "EXPLAIN ANALYZE COPY runs TO '{tmp}/leak.csv'", "--db", "{db}",
                                        "--db", "{db2}"], "COPY"),
    _case("query/merged-attach-other", ["query", "ATTACH '{older_db}' AS o", "--db", "{db}", "--db", "{db2}"],
          "ATTACH"),
    # ---- read-only commands never write: an empty DuckDB file, an older evalkit, a foreign file
    _case("runs/duckdb-without-tables", ["runs", "--db", "{duckdb_empty}"], "empty DuckDB file", watch="duckdb_empty"),
    _case("runs/older-evalkit-db", ["runs", "--db", "{older_db}"], "evalkit migrate", watch="older_db"),
    _case("runs/foreign-duckdb", ["runs", "--db", "{foreign_db}"], "another program", watch="foreign_db"),
    _case("show/older-evalkit-db", ["show", "latest", "--db", "{older_db}"], "evalkit migrate", watch="older_db"),
    _case("query/older-evalkit-db", ["query", "SELECT 1", "--db", "{older_db}"], "evalkit migrate", watch="older_db"),
    _case("query/foreign-duckdb", ["query", "SELECT * FROM schema_version", "--db", "{foreign_db}"],
          "another program", watch="foreign_db"),
    _case("query/duckdb-without-tables", ["query", "SELECT 1", "--db", "{duckdb_empty}"], "empty DuckDB file",
          watch="duckdb_empty"),
    _case("compare/foreign-duckdb", ["compare", "latest", "latest", "--db", "{foreign_db}"], "another program",
          watch="foreign_db"),
    _case("gate/older-evalkit-db", ["gate", "--candidate", "latest", "--baseline", "latest", "--db", "{older_db}"],
          "evalkit migrate", watch="older_db"),
    _case("report/foreign-duckdb", ["report", "--out", "{tmp}/report", "--db", "{foreign_db}"], "another program",
          watch="foreign_db"),
    _case("export/older-evalkit-db", ["export", "--parquet", "{tmp}/out", "--db", "{older_db}"], "evalkit migrate",
          watch="older_db"),
    _case("needle-heatmap/duckdb-without-tables", ["needle-heatmap", "latest", "--out", "{tmp}/r", "--db",
                                                   "{duckdb_empty}"], "empty DuckDB file", watch="duckdb_empty"),
    _case("run/foreign-duckdb", ["run", *FAKE, "--tasks", "firsttoken", "--limit", "1", "--db", "{foreign_db}"],
          "another program", watch="foreign_db"),
    _case("promote/foreign-duckdb", ["promote", "latest", "--tag", "prod", "--db", "{foreign_db}"],
          "another program", watch="foreign_db"),
    _case("migrate/foreign-duckdb", ["migrate", "--db", "{foreign_db}"], "another program", watch="foreign_db"),
    _case("migrate/db-missing", ["migrate", "--db", "{tmp}/missing.duckdb"], "missing.duckdb"),
    _case("ingest/spool-file-missing", ["ingest", "{tmp}/nope.duckdb", "--db", "{db}"], "no spool file"),
    _case("ingest/not-a-spool-file", ["ingest", "{older_db}", "--db", "{db}"], "not an evalkit spool file",
          watch="older_db"),
    # ---- output paths: never the DB, never an input, a folder or an unwritable path -------
    _case("gate/junit-is-the-db", [*RULES, "{good_rules}", "--junit", "{db}"], "which this command reads"),
    _case("gate/junit-is-the-rules", [*RULES, "{good_rules}", "--junit", "{good_rules}"], "which this command reads",
          watch="good_rules"),
    _case("gate/junit-is-a-folder", [*RULES, "{good_rules}", "--junit", "{tmp}"], "directory"),
    _case("gate/junit-folder-missing", [*RULES, "{good_rules}", "--junit", "{tmp}/no/such/gate.xml"],
          "folder does not exist"),
    _case("gate/junit-is-another-duckdb", [*RULES, "{good_rules}", "--junit", "{older_db}"], "DuckDB database",
          watch="older_db"),
    _case("gate/step-summary-is-a-folder", [*RULES, "{good_rules}"], "$GITHUB_STEP_SUMMARY",
          env=(("GITHUB_STEP_SUMMARY", "{tmp}"),)),
    _case("gate/step-summary-is-the-db", [*RULES, "{good_rules}"], "which this command reads",
          env=(("GITHUB_STEP_SUMMARY", "{db}"),)),
    _case("report/out-is-the-db", ["report", "--out", "{db}", "--db", "{db}"], "is a file"),
    _case("report/prompts-negative", ["report", "--prompts", "-1", "--out", "{tmp}/r", "--db", "{db}"], "--prompts"),
    _case("export/out-is-the-db", ["export", "--parquet", "{db}", "--db", "{db}"], "is a file"),
    _case("needle-heatmap/out-is-a-file", ["needle-heatmap", "latest", "--out", "{text_db}", "--db", "{db}"],
          "is a file"),
    # ---- names that match nothing are errors ---------------------------------------------
    _case("gate/rule-metric-typo", [*RULES, "{rules_metric_typo}"], "did you mean ft_hit"),
    _case("gate/rule-task-typo", [*RULES, "{rules_task_typo}"], "no task 'firsttoken_enn'"),
    _case("gate/rules-check-nothing", [*RULES, "{rules_nothing}"], "would check nothing"),
    _case("gate/rule-unknown-metric", [*RULES, "{rules_no_direction}"], "unknown metric 'my_score'"),
    _case("run/unknown-task-typo", ["run", *FAKE, "--tasks", "firsttoken_enn", "--db", "{db}"],
          "did you mean firsttoken_en"),
    _case("run/include-path-shadows-a-task", ["run", *FAKE, "--tasks", "firsttoken", "--include-path",
                                              "{shadow_tasks}", "--db", "{db}"], "firsttoken_en"),
    _case("run/firsttoken-user-without-prompts", ["run", *FAKE, "--tasks", "firsttoken_user", "--db", "{db}"],
          "--prompts"),
    _case("needle-heatmap/run-without-needles", ["needle-heatmap", "latest", "--out", "{tmp}/r", "--db", "{db}"],
          "no needle samples"),
    # ---- every run option checked before the row ------------------------------------------
    _case("run/temperature-inf", ["run", *FAKE, "--tasks", "firsttoken", "--temperature", "inf", "--db", "{db}"],
          "--temperature must be a finite number"),
    _case("run/temperature-nan", ["run", *FAKE, "--tasks", "firsttoken", "--temperature", "nan", "--db", "{db}"],
          "--temperature"),
    _case("run/temperature-0", ["run", *FAKE, "--tasks", "firsttoken", "--temperature", "0", "--db", "{db}"],
          "--temperature"),
    _case("run/first-temperature-nan", ["run", *TINY, "--tasks", "firsttoken", "--first-temperature", "nan",
                                        "--db", "{db}"], "--first-temperature"),
    _case("run/first-temperature-negative", ["run", *TINY, "--tasks", "firsttoken", "--first-temperature", "-1",
                                             "--db", "{db}"], "--first-temperature"),
    _case("run/first-temperature-on-a-text-backend", ["run", *FAKE, "--tasks", "firsttoken", "--first-temperature",
                                                      "0.5", "--db", "{db}"], "hf backend only"),
    _case("run/top-k-below-50", ["run", *FAKE, "--tasks", "firsttoken", "--top-k", "10", "--db", "{db}"], "--top-k"),
    _case("run/top-k-above-the-vocabulary", ["run", *TINY, "--tasks", "firsttoken", "--top-k", "100000",
                                             "--db", "{db}"], "vocabulary"),
    _case("run/top-k-11-digits", ["run", *FAKE, "--tasks", "firsttoken", "--top-k", "99999999999", "--db", "{db}"],
          "--top-k"),
    _case("run/seed-negative", ["run", *FAKE, "--tasks", "firsttoken", "--seed", "-1", "--db", "{db}"], "--seed"),
    _case("run/seed-11-digits", ["run", *FAKE, "--tasks", "firsttoken", "--seed", "99999999999", "--db", "{db}"],
          "--seed"),
    _case("run/batch-size-0", ["run", *FAKE, "--tasks", "firsttoken", "--batch-size", "0", "--db", "{db}"],
          "--batch-size"),
    _case("run/batch-size-huge", ["run", *FAKE, "--tasks", "firsttoken", "--batch-size", "10000000", "--db", "{db}"],
          "--batch-size"),
    _case("run/limit-11-digits", ["run", *FAKE, "--tasks", "firsttoken", "--limit", "99999999999", "--db", "{db}"],
          "--limit"),
    _case("run/needle-length-above-the-context", ["run", *TINY, "--tasks", "needle_en", "--needle-lengths", "100000",
                                                  "--db", "{db}"], "does not fit the model's context"),
    _case("run/needle-length-below-the-needle", ["run", *TINY, "--tasks", "needle_en", "--needle-lengths", "64",
                                                 "--db", "{db}"], "too small"),
    _case("run/needle-lengths-twice", ["run", *FAKE, "--tasks", "needle", "--needle-lengths", "256,256",
                                       "--db", "{db}"], "twice"),
    _case("run/needle-depths-nan", ["run", *FAKE, "--tasks", "needle", "--needle-depths", "0,nan", "--db", "{db}"],
          "--needle-depths"),
    _case("run/prompts-longer-than-the-context", ["run", "--model", "hf", "--model-args",
                                                  "pretrained={tiny},max_length=64", "--prompts", "{long_prompts}",
                                                  "--db", "{db}"], "long-1"),
    _case("run/prompts-lone-surrogate", ["run", *FAKE, "--prompts", "{surrogate_prompts}", "--db", "{db}"],
          "does not encode"),
    _case("run/device-unknown", ["run", *FAKE, "--tasks", "firsttoken", "--device", "nope", "--db", "{db}"],
          "--device"),
    _case("run/device-cuda-without-cuda", ["run", *FAKE, "--tasks", "firsttoken", "--device", "cuda:7",
                                           "--db", "{db}"], "cuda"),
    _case("run/name-with-a-newline", ["run", *FAKE, "--tasks", "firsttoken", "--name", "nightly\nrun", "--db", "{db}"],
          "control character"),
    _case("run/name-empty", ["run", *FAKE, "--tasks", "firsttoken", "--name", "  ", "--db", "{db}"], "--name is empty"),
    _case("run/name-latest", ["run", *FAKE, "--tasks", "firsttoken", "--name", "latest", "--db", "{db}"],
          "could never name this run: `latest` always means the newest run"),
    _case("run/name-a-tag", ["run", *FAKE, "--tasks", "firsttoken", "--name", "tag:prod", "--db", "{db}"],
          "could never name this run: `tag:...` always names a tag"),
    _case("run/include-path-yaml-too-large", ["run", *FAKE, "--tasks", "firsttoken", "--include-path",
                                              "{big_yaml_tasks}", "--db", "{db}"], "at most 4,194,304 are read"),
    _case("gate/rule-bound-out-of-range", [*RULES, "{rules_out_of_range}"],
          "thresholds.ft_hit: >= 1.01 is outside what ft_hit can reach"),
    _case("run/quant-on-a-text-backend", ["run", *FAKE, "--tasks", "firsttoken", "--quant", "bf16", "--db", "{db}"],
          "hf backend only"),
    # ---- --quant variants and sweeps: refused before anything is loaded or written --------
    _case("run/quant-gpu-only-on-cpu", ["run", "--tasks", "firsttoken", "--quant", "int4-tinygemm", "--device", "cpu",
                                        "--db", "{db}"], "int4-tinygemm"),
    _case("run/quant-group-on-a-variant-without-groups", ["run", "--tasks", "firsttoken", "--quant", "bf16:32",
                                                          "--db", "{db}"], "takes no group size"),
    _case("run/quant-group-not-a-number", ["run", "--tasks", "firsttoken", "--quant", "int4-weight:x", "--db", "{db}"],
          "group size"),
    _case("run/quant-group-zero", ["run", "--tasks", "firsttoken", "--quant", "hqq4:0", "--db", "{db}"], "group size"),
    _case("run/quant-group-not-dividing-the-layers", ["run", *TINY, "--tasks", "firsttoken", "--quant",
                                                      "int4-weight:48", "--db", "{db}"], "int4-weight"),
    _case("run/quant-sweep-group-not-dividing", ["run", *TINY, "--tasks", "firsttoken", "--quant",
                                                 "fp32,int4-weight:48", "--db", "{db}"], "int4-weight"),
    _case("run/quant-sweep-twice", ["run", "--tasks", "firsttoken", "--quant", "bf16,int8-weight,bf16",
                                    "--db", "{db}"], "twice"),
    _case("run/quant-sweep-unknown", ["run", "--tasks", "firsttoken", "--quant", "bf16,int3", "--db", "{db}"],
          "int3"),
    _case("run/quant-sweep-empty-entry", ["run", "--tasks", "firsttoken", "--quant", "bf16,,fp32", "--db", "{db}"],
          "empty entry"),
    _case("run/quant-sweep-on-a-text-backend", ["run", *FAKE, "--tasks", "firsttoken", "--quant", "bf16,fp32",
                                                "--db", "{db}"], "hf backend only"),
    _case("run/quant-gptq-on-the-embedded-model", ["run", "--tasks", "firsttoken", "--quant", "gptq", "--db", "{db}"],
          "gptq"),
    _case("run/quant-awq-on-a-plain-checkpoint", ["run", *TINY, "--tasks", "firsttoken", "--quant", "awq",
                                                  "--db", "{db}"], "awq"),
    _case("inspect/quant-sweep", ["inspect", "Hi", "--quant", "bf16,fp32"], "sweep"),
    _case("compare/one-run", ["compare", "latest", "--db", "{db}"], "baseline"),
    _case("compare/a-run-twice-among-candidates", ["compare", "latest", "latest", "latest", "--db", "{db}"],
          "twice"),
    # ---- --kv-cache (one line, exit 2, nothing written: a bad policy anywhere in a list too) ----
    _case("run/kv-cache-unknown", ["run", "--tasks", "firsttoken", "--kv-cache", "lru:8", "--db", "{db}"],
          "unknown --kv-cache 'lru:8'"),
    _case("run/kv-cache-window-0", ["run", "--tasks", "firsttoken", "--kv-cache", "window:0", "--db", "{db}"],
          "W (the window) must be a whole number"),
    _case("run/kv-cache-window-not-a-number", ["run", "--tasks", "firsttoken", "--kv-cache", "window:1.5",
                                               "--db", "{db}"], "'1.5'"),
    _case("run/kv-cache-sinkwindow-without-window", ["run", "--tasks", "firsttoken", "--kv-cache", "sinkwindow:4",
                                                     "--db", "{db}"], "unknown --kv-cache 'sinkwindow:4'"),
    _case("run/kv-cache-sinks-0", ["run", "--tasks", "firsttoken", "--kv-cache", "sinkwindow:0:256", "--db", "{db}"],
          "S (the sinks)"),
    _case("run/kv-cache-bits", ["run", "--tasks", "firsttoken", "--kv-cache", "quantized:quanto:3", "--db", "{db}"],
          "takes 2, 4 bits"),
    _case("run/kv-cache-unknown-backend", ["run", "--tasks", "firsttoken", "--kv-cache", "quantized:int8:8",
                                           "--db", "{db}"], "unknown backend 'int8'"),
    _case("run/kv-cache-named-twice", ["run", "--tasks", "firsttoken", "--kv-cache", "full,window:8,WINDOW:8",
                                       "--db", "{db}"], "twice"),
    _case("run/kv-cache-bad-last-in-list", ["run", *TINY, "--tasks", "firsttoken", "--kv-cache", "full,fp8,window:x",
                                            "--db", "{db}"], "'x'"),
    _case("run/kv-cache-empty-list", ["run", "--tasks", "firsttoken", "--kv-cache", ",", "--db", "{db}"],
          "names no policy"),
    _case("run/kv-cache-on-a-text-backend", ["run", *FAKE, "--tasks", "firsttoken", "--kv-cache", "window:8",
                                             "--db", "{db}"], "hf backend only"),
    _case("run/kv-cache-in-model-args", ["run", "--model", "hf", "--model-args", "kv_cache=fp8", "--tasks",
                                         "firsttoken", "--db", "{db}"], "--kv-cache"),
    _case("run/kv-cache-sweep-name-too-long", ["run", *TINY, "--tasks", "firsttoken", "--kv-cache", "full,fp8",
                                               "--name", "n" * 195, "--db", "{db}"], "longer than 200"),
    _case("inspect/kv-cache-unknown", ["inspect", "Hi", "--kv-cache", "window"], "unknown --kv-cache 'window'"),
    _case("inspect/kv-cache-list", ["inspect", "Hi", "--kv-cache", "full,fp8"], "one policy"),
    # ---- --quant and --kv-cache lists together: every run checked before the first model loads ----
    _case("run/quant-sweep-with-a-bad-kv-cache-policy", ["run", *TINY, "--tasks", "firsttoken", "--quant", "fp32,bf16",
                                                        "--kv-cache", "full,window:x", "--db", "{db}"], "'x'"),
    _case("run/quant-and-kv-cache-sweep-name-too-long", ["run", *TINY, "--tasks", "firsttoken", "--quant",
                                                         "fp32,bf16", "--kv-cache", "full,fp8", "--name", "n" * 190,
                                                         "--db", "{db}"], "longer than 200"),
    _case("run/model-args-batch-size", ["run", "--model", "hf", "--model-args", "batch_size=4", "--tasks",
                                        "firsttoken", "--db", "{db}"], "--batch-size"),
    _case("run/db-is-a-folder", ["run", *FAKE, "--tasks", "firsttoken", "--db", "{tmp}"], "directory"),
    _case("promote/tag-with-a-newline", ["promote", "latest", "--tag", "prod\n", "--db", "{db}"], "bad tag name"),
    _case("promote/tag-empty", ["promote", "latest", "--tag", "", "--db", "{db}"], "bad tag name"),
    _case("promote/tag-with-a-slash", ["promote", "latest", "--tag", "a/b", "--db", "{db}"], "bad tag name"),
    _case("runs/limit-negative", ["runs", "--limit", "-1", "--db", "{db}"], "--limit"),
    _case("runs/limit-zero", ["runs", "--limit", "0", "--db", "{db}"], "--limit"),
    _case("inspect/temperature-nan", ["inspect", "Hi", "--temperature", "nan"], "--temperature"),
    _case("inspect/top-k-0", ["inspect", "Hi", "--top-k", "0"], "--top-k"),
    _case("inspect/unknown-task", ["inspect", "Hi", "--task", "nope"], "unknown task"),
    # ---- attention, conflicting facts, the long grid ---------------------------------------
    _case("run/attention-on-a-text-backend", ["run", *FAKE, "--tasks", "needle_en", "--attention", "--db", "{db}"],
          "--attention applies to the hf backend only"),
    _case("run/attention-with-attn-implementation", ["run", "--model", "hf", "--model-args",
                                                     "pretrained={tiny},attn_implementation=sdpa", "--tasks",
                                                     "needle_en", "--attention", "--db", "{db}"],
          "leave attn_implementation out"),
    _case("run/attention-in-model-args", ["run", "--model", "hf", "--model-args", "attention=true", "--tasks",
                                          "needle_en", "--db", "{db}"], "set with --attention"),
    _case("run/needle-lengths-unknown-preset", ["run", *FAKE, "--tasks", "needle", "--needle-lengths", "longer",
                                                "--db", "{db}"], "or one of default, long"),
    _case("run/needle-lengths-long-above-the-context", ["run", *TINY, "--tasks", "needle_conflict",
                                                        "--needle-lengths", "long", "--db", "{db}"],
          "does not fit the model's context of 4096"),
    _case("run/conflict-unknown-task-typo", ["run", *FAKE, "--tasks", "needle_confict_en", "--db", "{db}"],
          "did you mean needle_conflict_en"),
    _case("inspect/attention-layers-0", ["inspect", "Hi", "--attention", "--attention-layers", "0"],
          "--attention-layers must be a whole number"),
    _case("inspect/attention-layers-above-the-model", ["inspect", "Hi", "--model-args", "pretrained={tiny}",
                                                       "--attention", "--attention-layers", "3"],
          "the model has 2 layers"),
    _case("gate/regression-on-a-descriptive-metric", [*RULES, "{rules_descriptive}"],
          "sink_rate describes without ranking"),
    # ---- environment values: checked before any work (evalkit/envvars.py) ------------------------
    _case("env/lock-timeout-nan", ["runs", "--db", "{db}"], "EVALKIT_LOCK_TIMEOUT='nan'",
          env=[("EVALKIT_LOCK_TIMEOUT", "nan")]),
    _case("env/lock-timeout-abc", ["runs", "--db", "{db}"], "EVALKIT_LOCK_TIMEOUT='abc'",
          env=[("EVALKIT_LOCK_TIMEOUT", "abc")]),
    _case("env/heartbeat-abc", ["run", *FAKE, "--tasks", "firsttoken", "--limit", "1", "--db", "{db}"],
          "EVALKIT_HEARTBEAT_S='abc'", env=[("EVALKIT_HEARTBEAT_S", "abc")]),
    _case("env/rank-left-over", ["run", *FAKE, "--tasks", "firsttoken", "--limit", "1", "--db", "{db}"],
          "not a distributed launch", env=[("RANK", "1")]),
    _case("env/rank-abc", ["run", *FAKE, "--tasks", "firsttoken", "--limit", "1", "--db", "{db}"], "RANK='abc'",
          env=[("RANK", "abc")]),
    _case("env/debug-maybe", ["runs", "--db", "{db}"], "EVALKIT_DEBUG='maybe'", env=[("EVALKIT_DEBUG", "maybe")]),
    _case("env/query-timeout-nan", ["query", "SELECT 1", "--db", "{db}"], "EVALKIT_QUERY_TIMEOUT",
          env=[("EVALKIT_QUERY_TIMEOUT", "nan")]),
    # ---- model files and model args: refused before the load and the run row ------------------------
    _case("run/text-file-named-gguf", ["run", "--model", "hf", "--model-args", "pretrained={tmp},gguf_file={text_gguf}",
                                       "--tasks", "firsttoken", "--db", "{db}"], "not a readable GGUF file"),
    _case("run/config-json-not-json", ["run", "--model", "hf", "--model-args", "pretrained={bad_config_model}",
                                       "--tasks", "firsttoken", "--db", "{db}"], "is not JSON"),
    _case("run/empty-model-folder", ["run", "--model", "hf", "--model-args", "pretrained={empty_model}",
                                     "--tasks", "firsttoken", "--db", "{db}"], "holds no config.json"),
    _case("run/unknown-model-arg", ["run", "--model", "hf", "--model-args", "pretrained={tiny},attn_implmentation=eager",
                                    "--tasks", "firsttoken", "--db", "{db}"], "did you mean attn_implementation"),
    # ---- query: limits and sources ------------------------------------------------------------------
    _case("query/timeout-zero", ["query", "SELECT 1", "--db", "{db}", "--timeout", "0"], "--timeout"),
    _case("query/same-db-twice", ["query", "SELECT 1", "--db", "{db}", "--db", "{db}"], "same source"),
    _case("query/parquet-text-file", ["query", "SELECT 1", "--parquet", "{text_parquet}"], "not a Parquet file"),
    # ---- ingest: never a file it did not write -----------------------------------------------------
    _case("ingest/the-db-itself", ["ingest", "{db}", "--db", "{db}"], "is the DB itself"),
    # ---- input files: read only when regular and of a sane size and depth ------------------------
    _case("run/prompts-nested-deep", ["run", *FAKE, "--prompts", "{deep_jsonl}", "--db", "{db}"], "nested too deep"),
    _case("run/prompts-a-device", ["run", *FAKE, "--prompts", "/dev/zero", "--db", "{db}"], "not a regular file"),
    _case("gate/rules-a-device", [*RULES, "/dev/zero"], "not a regular file"),
    _case("gate/rules-400-digit-margin", [*RULES, "{rules_big_number}"], "400 characters) (not a finite number)"),
    _case("gate/rules-nested-deep", [*RULES, "{rules_deep}"], "nested too deep"),
    _case("gate/rules-alias-bomb", [*RULES, "{rules_alias_bomb}"], "expected a number"),
    # ---- resume: only a stopped run, with its own configuration -------------------------------------
    _case("run/resume-unknown-run", ["run", "--resume", "nope", "--db", "{db}"], "unknown run 'nope'"),
    _case("run/resume-a-done-run", ["run", "--resume", "latest", "--db", "{db}"], "nothing to resume"),
    _case("run/resume-with-options", ["run", "--resume", "latest", "--seed", "3", "--db", "{db}"], "drop --seed"),
]


def _special_dbs(folder: Path) -> dict[str, str]:
    """DuckDB files a reader must refuse without changing them: no tables, an older evalkit's,
    and another program's that happens to have a schema_version table."""
    import duckdb

    from evalkit.store.migrations import MIGRATIONS

    paths = {name: folder / f"{name}.duckdb" for name in ("duckdb_empty", "older_db", "foreign_db")}
    duckdb.connect(str(paths["duckdb_empty"])).close()
    con = duckdb.connect(str(paths["older_db"]))
    con.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, name VARCHAR NOT NULL, "
                "applied_at TIMESTAMP NOT NULL)")
    for version, m in enumerate(MIGRATIONS[:5], start=1):
        m(con)
        con.execute("INSERT INTO schema_version VALUES (?, ?, now())", [version, m.__name__])
    con.execute("INSERT INTO runs (id, created_at, status, model) VALUES ('r-old', now(), 'done', 'hf')")
    con.close()
    con = duckdb.connect(str(paths["foreign_db"]))
    con.execute("CREATE TABLE schema_version (version INTEGER, name VARCHAR)")
    con.execute("INSERT INTO schema_version VALUES (1, 'create_users')")
    con.execute("CREATE TABLE users (id INTEGER, name VARCHAR)")
    con.execute("INSERT INTO users VALUES (1, 'ada')")
    con.close()
    return {k: str(v) for k, v in paths.items()}


def _alias_bomb(levels: int = 9) -> bytes:
    """YAML whose aliases expand to 9**9 strings under one regression (a "billion laughs")."""
    lines = ['regressions:', '  ft_hit: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"  ft_hit_prob: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" if i == levels - 1
                     else f"  m{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return ("\n".join(lines) + "\n").encode()


def make_inputs(folder: Path, db: Path, db2: Path, prefix: str, tiny: Path | None = None) -> dict[str, str]:
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
        "good_rules": b"regressions:\n  ft_hit: 0.02\n",
        "rules_metric_typo": b"regressions:\n  ft_hitt: 0.02\n",
        "rules_task_typo": b'thresholds:\n  firsttoken_enn/ft_hit: ">= 0.1"\n',
        "rules_nothing": b"regressions:\n  needle_recall: 0.05\n",
        "rules_no_direction": b"regressions:\n  my_score: 0.05\nthresholds:\n  my_score: \">= 0\"\n",
        "rules_descriptive": b"regressions:\n  ft_hit: 0.02\n  sink_rate: 0.05\n",
        "rules_out_of_range": b'thresholds:\n  ft_hit: ">= 1.01"\n',
        "long_prompts": ('{"id": "long-1", "prompt": "' + "word " * 200 + '", "answers": ["x"], "lang": "en"}\n'
                         '{"id": "short-1", "prompt": "Hi", "answers": ["x"], "lang": "en"}\n').encode(),
        "deep_jsonl": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
        "rules_big_number": b"regressions:\n  ft_hit: " + b"9" * 400 + b"\n",
        "rules_deep": b"regressions: " + b"[" * 100_000 + b"]" * 100_000 + b"\n",
        "rules_alias_bomb": _alias_bomb(),
        "surrogate_prompts": b'{"id": "s-1", "prompt": "bad \\ud800 text", "answers": ["x"], "lang": "en"}\n',
    }
    suffix = {"text_db": ".duckdb", "empty_db": ".duckdb", "not_yaml": ".yaml", "bad_rules": ".yaml",
              "good_rules": ".yaml", "rules_metric_typo": ".yaml", "rules_task_typo": ".yaml",
              "rules_nothing": ".yaml", "rules_no_direction": ".yaml", "rules_descriptive": ".yaml",
              "rules_out_of_range": ".yaml"}
    paths = {"tmp": str(folder), "db": str(db), "db2": str(db2), "prefix": prefix, "tiny": str(tiny or "")}
    paths.update(_special_dbs(folder))
    shadow = folder / "shadow_tasks"
    shadow.mkdir()
    (shadow / "mine.yaml").write_text("task: firsttoken_en\ndataset_path: nowhere\n", encoding="utf-8")
    paths["shadow_tasks"] = str(shadow)
    big = folder / "big_yaml_tasks"
    big.mkdir()
    from evalkit.paths import MAX_YAML_BYTES

    (big / "big.yaml").write_bytes(b"task: big_task\n# " + b"x" * MAX_YAML_BYTES + b"\n")
    paths["big_yaml_tasks"] = str(big)
    (folder / "text.gguf").write_text("this is a text file, not a GGUF model\n", encoding="utf-8")
    paths["text_gguf"] = str(folder / "text.gguf")
    bad_config = folder / "bad_config_model"
    bad_config.mkdir()
    (bad_config / "config.json").write_text("{not json", encoding="utf-8")
    paths["bad_config_model"] = str(bad_config)
    (folder / "empty_model").mkdir()
    paths["empty_model"] = str(folder / "empty_model")
    parquet = folder / "text_parquet"
    parquet.mkdir()
    from evalkit.store.sandbox import TABLES

    for table in TABLES:  # a complete set of names, each a text file
        (parquet / f"{table}.parquet").write_text("not parquet\n", encoding="utf-8")
    paths["text_parquet"] = str(parquet)
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
    """path -> sha256 of every file under the folder (a new .wal, a new file anywhere below it,
    or a changed byte all show)."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


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


@pytest.fixture(scope="module")
def tiny_for_cases(tiny_model_dir):
    return tiny_model_dir


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, seeded, tiny_for_cases, tmp_path):
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
    paths = make_inputs(inputs, db, db2, prefix, tiny_for_cases)
    before_db, before_inputs = fingerprint(dbdir), fingerprint(inputs)

    result = CliRunner().invoke(cli, case.args(paths), catch_exceptions=False, env=case.environ(paths))

    message = result.stderr
    print(f"{case.id}: exit {result.exit_code}: {message.strip()}")
    # a log's progress lines (a model load announces itself, `progress.LineBar`) may come before the error
    lines = error_lines(message)
    shown = f"\n--- stderr ---\n{message}--- stdout ---\n{result.stdout}"
    assert result.exit_code == 2, f"exit {result.exit_code}, expected 2{shown}"
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}{shown}"
    assert "Traceback" not in message, shown
    assert lines[0].startswith("evalkit: error: "), shown
    assert case.expect.lower() in lines[0].lower(), f"message does not name {case.expect!r}{shown}"
    assert fingerprint(dbdir) == before_db, f"the DB folder changed{shown}"
    assert fingerprint(inputs) == before_inputs, f"an input file changed (watching {case.watch}){shown}"
