"""The DuckDB store (see docs/storage-and-sql.md): the exact schema after migrating, migrations bookkeeping,
the bulk insert that ends a run, run-id resolution and read-only SQL."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import shutil

import duckdb
import pytest

from evalkit.errors import BadInput
from evalkit.store import rows as store_rows
from evalkit.store import runs as store
from evalkit.store.db import applied, migrate, open_reader, open_writer, pending, transaction
from evalkit.store.migrations import MIGRATIONS
from evalkit.store.queries import resolve_run
from evalkit.store.sandbox import read_query

EXPECTED_TABLES = {
    "schema_version": {"version": "INTEGER", "name": "VARCHAR", "applied_at": "TIMESTAMP"},
    "runs": {
        "id": "VARCHAR",
        "created_at": "TIMESTAMP",
        "finished_at": "TIMESTAMP",
        "status": "VARCHAR",
        "name": "VARCHAR",
        "model": "VARCHAR",
        "model_args": "VARCHAR",
        "model_fingerprint": "VARCHAR",
        "dtype": "VARCHAR",
        "quant": "VARCHAR",
        "template": "VARCHAR",
        "template_text": "VARCHAR",
        "system_prompt": "VARCHAR",
        "tasks": "VARCHAR[]",
        "seed": "INTEGER",
        "batch_size": "INTEGER",
        "sample_limit": "INTEGER",
        "top_k": "INTEGER",
        "first_temperature": "DOUBLE",
        "ban_openers": "BOOLEAN",
        "opener_lexicon_version": "VARCHAR",
        "evalkit_version": "VARCHAR",
        "lm_eval_version": "VARCHAR",
        "transformers_version": "VARCHAR",
        "torch_version": "VARCHAR",
        "git_commit": "VARCHAR",
        "host": "VARCHAR",
        "duration_s": "DOUBLE",
        "config": "VARCHAR",
        "error": "VARCHAR",
        "pid": "INTEGER",
        "pid_start": "VARCHAR",
        "heartbeat_at": "TIMESTAMP",
        "model_name": "VARCHAR",
        "kv_cache": "VARCHAR",
        "quant_detail": "VARCHAR",
        "attention": "BOOLEAN",
        "attn_implementation": "VARCHAR",
        "engine": "VARCHAR",
        "unavailable": "VARCHAR",
        "tokenizer_hash": "VARCHAR",  # m021
        "tokenizer_source": "VARCHAR",
        "batch_positions": "INTEGER",  # m025
        "trie_positions": "INTEGER",
        "memory_budget": "BIGINT",
        "metric_selection": "VARCHAR",  # m026
        "fed": "VARCHAR",  # m027
        "fed_note": "VARCHAR",
        "model_arch": "VARCHAR",  # m029
        "model_file_type": "VARCHAR",
    },
    "metrics": {
        "run_id": "VARCHAR",
        "task": "VARCHAR",
        "metric": "VARCHAR",
        "filter": "VARCHAR",
        "value": "DOUBLE",
        "stderr": "DOUBLE",
        "n": "INTEGER",
        "ci_lo": "DOUBLE",
        "ci_hi": "DOUBLE",
    },
    "samples": {
        "run_id": "VARCHAR",
        "task": "VARCHAR",
        "doc_id": "VARCHAR",
        "prompt_hash": "VARCHAR",
        "prompt": "VARCHAR",
        "target": "VARCHAR",
        "response": "VARCHAR",
        "first_token": "VARCHAR",
        "first_token_id": "INTEGER",
        "first_unit": "VARCHAR",
        "ft_outcome": "VARCHAR",
        "lang": "VARCHAR",
        "category": "VARCHAR",
        "ft_hit": "DOUBLE",
        "ft_token_hit": "DOUBLE",
        "ft_hit_prob": "DOUBLE",
        "opener_rate": "DOUBLE",
        "opener_mass": "DOUBLE",
        "prior_drift": "DOUBLE",
        "top3_mass": "DOUBLE",
        "top3_share": "DOUBLE",
        "unstable": "DOUBLE",
        "entropy": "DOUBLE",
        "needle_depth": "DOUBLE",
        "needle_length": "INTEGER",
        "needle_tokens": "INTEGER",
        "needle_hint": "BOOLEAN",
        "needle_recall": "DOUBLE",
        "metrics": "VARCHAR",
        "top1_prob": "DOUBLE",
        "answer_hit": "DOUBLE",
        "ft_answer_mismatch": "DOUBLE",
        "answer": "VARCHAR",
        "sink_rate": "DOUBLE",
        "needle_attn": "DOUBLE",
        "question_attn": "DOUBLE",
        "first_wins": "DOUBLE",
        "last_wins": "DOUBLE",
        "conflict_both": "DOUBLE",
        "conflict_pick": "VARCHAR",
        "conflict_pair": "VARCHAR",
        "conflict_order": "VARCHAR",
        "answer_prob": "DOUBLE",  # m020
        "opener_start_mass": "DOUBLE",  # m026
        "ws_mass": "DOUBLE",  # m028
        "special_mass": "DOUBLE",  # m029
        "fc_rest_mass": "DOUBLE",  # m030
        "fc_unresolved_mass": "DOUBLE",
    },
    "first_token_topk": {
        "run_id": "VARCHAR",
        "task": "VARCHAR",
        "doc_id": "VARCHAR",
        "rank": "INTEGER",
        "token_id": "INTEGER",
        "token": "VARCHAR",
        "logprob": "DOUBLE",
        "unit": "VARCHAR",
    },
    "tags": {"tag": "VARCHAR", "run_id": "VARCHAR", "created_at": "TIMESTAMP"},
    "gates": {  # m024
        "id": "VARCHAR", "created_at": "TIMESTAMP", "candidate": "VARCHAR", "baseline": "VARCHAR",
        "baseline_ref": "VARCHAR", "rules_name": "VARCHAR", "rules_digest": "VARCHAR", "verdict": "VARCHAR",
        "n_pass": "INTEGER", "n_fail": "INTEGER", "n_inconclusive": "INTEGER", "n_skipped": "INTEGER",
        "holm_family": "INTEGER", "evalkit_version": "VARCHAR",
    },
    "gate_checks": {  # m024
        "gate_id": "VARCHAR", "position": "INTEGER", "kind": "VARCHAR", "task": "VARCHAR", "metric": "VARCHAR",
        "status": "VARCHAR", "observed": "DOUBLE", "baseline_value": "DOUBLE", "bound": "DOUBLE", "margin": "VARCHAR",
        "drop": "DOUBLE", "ci_lo": "DOUBLE", "ci_hi": "DOUBLE", "n": "INTEGER", "method": "VARCHAR",
        "p_fail": "DOUBLE", "decide_n": "INTEGER", "reason": "VARCHAR",
    },
    "evalkit_meta": {"key": "VARCHAR", "value": "VARCHAR"},
    "degenerate": {  # m029
        "run_id": "VARCHAR", "task": "VARCHAR", "n": "INTEGER", "n_empty": "INTEGER", "n_at_once": "INTEGER",
        "n_cut": "INTEGER", "n_repeated": "INTEGER", "special_mass": "DOUBLE", "degenerate": "BOOLEAN",
        "reason": "VARCHAR", "example": "VARCHAR",
    },
    "first_char_topk": {  # m030
        "run_id": "VARCHAR", "task": "VARCHAR", "doc_id": "VARCHAR", "rank": "INTEGER", "event": "VARCHAR",
        "prob": "DOUBLE",
    },
    "lead_indicators": {
        "run_id": "VARCHAR", "task": "VARCHAR", "category": "VARCHAR", "signal": "VARCHAR", "auroc": "DOUBLE",
        "ci_lo": "DOUBLE", "ci_hi": "DOUBLE", "n": "INTEGER", "n_right": "INTEGER", "base_rate": "DOUBLE",
        "reason": "VARCHAR",
    },
    "attention_layers": {
        "run_id": "VARCHAR",
        "task": "VARCHAR",
        "doc_id": "VARCHAR",
        "layer": "INTEGER",
        "sink_rate": "DOUBLE",
        "sink_score": "DOUBLE",
        "needle_attn": "DOUBLE",
        "question_attn": "DOUBLE",
    },
    # m019: drift by position (docs/drift.md)
    "response_tokens": {"run_id": "VARCHAR", "task": "VARCHAR", "doc_id": "VARCHAR", "token_ids": "INTEGER[]"},
    "drift_base": {
        "run_id": "VARCHAR", "task": "VARCHAR", "doc_id": "VARCHAR", "position": "INTEGER",
        "token_ids": "INTEGER[]", "logprobs": "FLOAT[]", "tail": "DOUBLE", "eps": "DOUBLE",
    },
    "drift": {
        "run_id": "VARCHAR", "base_run_id": "VARCHAR", "task": "VARCHAR", "doc_id": "VARCHAR", "position": "INTEGER",
        "kld": "DOUBLE", "same_top": "BOOLEAN", "dp": "DOUBLE", "kld_bound": "DOUBLE",
    },
    "drift_summary": {
        "run_id": "VARCHAR", "base_run_id": "VARCHAR", "task": "VARCHAR", "bucket": "VARCHAR", "n": "INTEGER",
        "kld_mean": "DOUBLE", "kld_unc": "DOUBLE", "dp_mean": "DOUBLE", "dp_unc": "DOUBLE", "dp_rms": "DOUBLE",
        "dp_rms_unc": "DOUBLE", "same_top": "DOUBLE", "same_top_unc": "DOUBLE", "kld_bound_max": "DOUBLE",
        **{f"kld_{c}": "DOUBLE" for c in ['max', 'p999', 'p99', 'p95', 'p90', 'median', 'p10', 'p5', 'p1', 'p01', 'min']},
        **{f"dp_{c}": "DOUBLE" for c in ['max', 'p999', 'p99', 'p95', 'p90', 'p75', 'median', 'p25', 'p10', 'p5', 'p1', 'p01', 'min']},
    },
}
SCHEMA_VERSION_DDL = (  # as store.migrate creates it
    "CREATE TABLE schema_version (version INTEGER PRIMARY KEY, name VARCHAR NOT NULL, applied_at TIMESTAMP NOT NULL)"
)
EXPECTED_VIEWS = {"leaderboard", "needle_heatmap", "first_token_drift", "needle_gaps", "needle_attention",
                  "attention_sink", "conflict_table", "drift_by_position", "drift_by_bucket",
                  "drift_runs"}  # others may be appended


def columns(con, table: str) -> dict[str, str]:
    rows = con.execute(
        "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = ? ORDER BY ordinal_position",
        [table],
    ).fetchall()
    return dict(rows)


def relations(con, kind: str) -> set[str]:
    rows = con.execute("SELECT table_name FROM information_schema.tables WHERE table_type = ?", [kind]).fetchall()
    return {r[0] for r in rows}


def file_digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- schema and migrations ---------------------------------------------------------------


def test_fresh_db_has_the_exact_schema(tmp_path):
    with open_writer(tmp_path / "fresh.duckdb") as con:
        assert relations(con, "BASE TABLE") == set(EXPECTED_TABLES)
        for table, expected in EXPECTED_TABLES.items():
            assert columns(con, table) == expected, table
        assert EXPECTED_VIEWS <= relations(con, "VIEW")
        # the documented columns keep their order in `runs` (the ordinal order is part of the schema)
        assert list(columns(con, "runs")) == list(EXPECTED_TABLES["runs"])
        assert list(columns(con, "samples")) == list(EXPECTED_TABLES["samples"])


def test_column_lists_in_store_match_the_schema():
    assert list(store_rows.RUN_COLUMNS) == list(EXPECTED_TABLES["runs"])
    assert list(store_rows.SAMPLE_COLUMNS) == list(EXPECTED_TABLES["samples"])
    assert list(store_rows.METRIC_COLUMNS) == list(EXPECTED_TABLES["metrics"])
    assert list(store_rows.TOPK_COLUMNS) == list(EXPECTED_TABLES["first_token_topk"])
    assert list(store_rows.FIRST_CHAR_COLUMNS) == list(EXPECTED_TABLES["first_char_topk"])
    assert list(store_rows.ATTENTION_COLUMNS) == list(EXPECTED_TABLES["attention_layers"])


def test_applied_and_pending(tmp_path):
    names = [m.__name__ for m in MIGRATIONS]
    assert names[:6] == [
        "m001_create_runs",
        "m002_create_metrics",
        "m003_create_samples",
        "m004_create_first_token_topk",
        "m005_create_tags",
        "m006_create_views",
    ]
    assert len(set(names)) == len(names)
    con = duckdb.connect(str(tmp_path / "raw.duckdb"))
    try:
        assert applied(con) == []
        assert pending(con) == names
        assert relations(con, "BASE TABLE") == set()  # pending() and applied() only read
        assert migrate(con) == names
        assert applied(con) == names
        assert pending(con) == []
        versions = con.execute("SELECT version, name FROM schema_version ORDER BY version").fetchall()
        assert versions == list(enumerate(names, start=1))
    finally:
        con.close()


def test_migrating_twice_is_a_no_op(tmp_path):
    path = tmp_path / "twice.duckdb"
    with open_writer(path) as con:
        first = con.execute("SELECT * FROM schema_version ORDER BY version").fetchall()
        schema = {t: columns(con, t) for t in EXPECTED_TABLES}
        assert migrate(con) == []
    with open_writer(path) as con:
        assert con.execute("SELECT * FROM schema_version ORDER BY version").fetchall() == first
        assert {t: columns(con, t) for t in EXPECTED_TABLES} == schema
        assert pending(con) == []


def older_db(path, migrations: int):
    """Open `path` as an evalkit that knew only the first `migrations` migrations left it."""
    con = duckdb.connect(str(path))
    con.execute(SCHEMA_VERSION_DDL)
    for version, m in enumerate(MIGRATIONS[:migrations], start=1):
        m(con)
        con.execute("INSERT INTO schema_version VALUES (?, ?, now())", [version, m.__name__])
    return con


def test_partly_migrated_db_gets_only_the_rest(tmp_path):
    path = tmp_path / "old.duckdb"
    con = older_db(path, 2)
    con.execute("INSERT INTO runs (id, created_at, status, model) VALUES ('r1', now(), 'done', 'hf')")
    con.close()
    with open_writer(path) as con:
        assert applied(con) == [m.__name__ for m in MIGRATIONS]
        assert con.execute("SELECT id FROM runs").fetchall() == [("r1",)]
        assert relations(con, "BASE TABLE") == set(EXPECTED_TABLES)


def test_kv_cache_migration_marks_earlier_hf_runs_full(tmp_path):
    """Runs of the hf backend from before --kv-cache ran with the full cache; others (vLLM, API,
    fake) are NULL: evalkit did not control their cache. The leaderboard view gains the column."""
    path = tmp_path / "old.duckdb"
    con = older_db(path, MIGRATIONS.index(next(m for m in MIGRATIONS if m.__name__ == "m013_kv_cache")))
    for run_id, model in (("r-hf", "hf"), ("r-vllm", "vllm"), ("r-none", None)):
        config = json.dumps({"model": model, "tasks": ["firsttoken"]}) if model else None
        con.execute("INSERT INTO runs (id, created_at, status, model, config) VALUES (?, now(), 'done', ?, ?)",
                    [run_id, model or "x", config])
    con.execute("INSERT INTO metrics (run_id, task, metric, filter, value, stderr, n) "
                "VALUES ('r-hf', 'firsttoken', 'ft_hit', 'none', 0.5, 0.1, 3)")
    con.close()
    with open_writer(path) as con:
        assert dict(con.execute("SELECT id, kv_cache FROM runs").fetchall()) == {
            "r-hf": "full", "r-vllm": None, "r-none": None}
        assert con.execute("SELECT kv_cache FROM leaderboard").fetchall() == [("full",)]


def test_engine_migration_names_the_engine_of_earlier_runs(tmp_path):
    """m018: runs from before it were computed by the model type their config names (hf -> transformers,
    vllm -> vllm); other lm-eval types stay NULL. The leaderboard keeps its columns and gains engine."""
    path = tmp_path / "old.duckdb"
    con = older_db(path, MIGRATIONS.index(next(m for m in MIGRATIONS if m.__name__ == "m018_engine")))
    for run_id, model in (("r-hf", "hf"), ("r-vllm", "vllm"), ("r-api", "local-completions"), ("r-none", None)):
        config = json.dumps({"model": model, "tasks": ["firsttoken"]}) if model else None
        con.execute("INSERT INTO runs (id, created_at, status, model, config) VALUES (?, now(), 'done', ?, ?)",
                    [run_id, model or "x", config])
    con.execute("INSERT INTO metrics (run_id, task, metric, filter, value, stderr, n) "
                "VALUES ('r-hf', 'firsttoken', 'ft_hit', 'none', 0.5, 0.1, 3)")
    con.close()
    with open_writer(path) as con:
        assert dict(con.execute("SELECT id, engine FROM runs").fetchall()) == {
            "r-hf": "transformers", "r-vllm": "vllm", "r-api": None, "r-none": None}
        assert con.execute("SELECT engine, quant_detail, kv_cache FROM leaderboard").fetchall() == [
            ("transformers", None, None)]


def test_the_last_migration_keeps_every_leaderboard_column(tmp_path):
    """m015 (attention and conflicts) comes after m014 and adds views of its own; the leaderboard
    keeps every column the earlier migrations gave it."""
    names = [m.__name__ for m in MIGRATIONS]
    assert names.index("m015_attention_and_conflict") > names.index("m014_quant_detail")
    with open_writer(tmp_path / "lb.duckdb") as con:
        cols = {r[0] for r in con.execute(
            "SELECT column_name FROM duckdb_columns() WHERE table_name = 'leaderboard'").fetchall()}
    assert {"run_id", "model_name", "quant", "quant_detail", "kv_cache", "template", "metric", "value", "ci_lo",
            "ci_hi"} <= cols


def test_quant_detail_migration_keeps_every_leaderboard_column(tmp_path):
    """m014 re-creates the leaderboard as m013 left it (intervals, model_name, kv_cache) and adds
    quant_detail; a run stored before it has no detail. It comes after m016 in the list: a file
    that already records m016 as version 14 takes m014 as version 15."""
    names = [m.__name__ for m in MIGRATIONS]
    assert names[9:17] == ["m010_metric_intervals", "m011_run_model_name", "m012_answers_and_lead_indicators",
                          "m013_kv_cache", "m016_topk_units", "m014_quant_detail", "m015_attention_and_conflict",
                          "m017_db_identity"]
    path = tmp_path / "old.duckdb"
    con = older_db(path, names.index("m014_quant_detail"))
    before = [r[0] for r in con.execute("DESCRIBE leaderboard").fetchall()]
    con.execute("INSERT INTO runs (id, created_at, status, model, quant) VALUES ('r1', now(), 'done', 'hf', 'bf16')")
    con.execute("INSERT INTO metrics (run_id, task, metric, filter, value, stderr, n) "
                "VALUES ('r1', 'firsttoken', 'ft_hit', 'none', 0.5, 0.1, 3)")
    con.close()
    with open_writer(path) as con:
        after = [r[0] for r in con.execute("DESCRIBE leaderboard").fetchall()]
        # m018 (engine), then m029 (the degenerate-output flag and its reason) end it since
        assert after == before + ["quant_detail", "engine", "degenerate", "degenerate_reason"]
        assert {"ci_lo", "ci_hi", "model_name", "kv_cache"} <= set(after)
        assert con.execute("SELECT quant, quant_detail FROM leaderboard").fetchall() == [("bf16", None)]
        assert con.execute("SELECT version, name FROM schema_version WHERE version <= 17 "
                           "ORDER BY version DESC LIMIT 4").fetchall() == [
            (17, "m017_db_identity"), (16, "m015_attention_and_conflict"), (15, "m014_quant_detail"),
            (14, "m016_topk_units")]


def test_every_db_gets_its_own_identity(tmp_path):
    """m017: a uuid and a signing key per DB, kept across reopenings; two DBs never share them."""
    from evalkit.store.spool import identity

    with open_writer(tmp_path / "a.duckdb") as con:
        a = identity(con)
    with open_writer(tmp_path / "a.duckdb") as con:
        assert identity(con) == a
    with open_writer(tmp_path / "b.duckdb") as con:
        b = identity(con)
    assert len(a.db_uuid) == 32 and len(a.key) == 64
    assert a.db_uuid != b.db_uuid and a.key != b.key


def test_read_only_open_needs_an_existing_db(tmp_path):
    path = tmp_path / "ro.duckdb"
    with pytest.raises(BadInput), open_reader(path):
        pass
    assert not path.exists()


def test_read_only_open_of_an_older_db_refuses_and_changes_nothing(tmp_path):
    """A file written by an older evalkit (fewer migrations) is not migrated by a reader: it is
    refused with the command that upgrades it, and stays byte-identical; a writer upgrades it."""
    path = tmp_path / "older.duckdb"
    older_db(path, 5).close()
    before = file_digest(path)
    with pytest.raises(BadInput, match="evalkit migrate"), open_reader(path):
        pass
    assert file_digest(path) == before
    with open_writer(path) as con:
        assert pending(con) == []
        assert EXPECTED_VIEWS <= relations(con, "VIEW")
    before = file_digest(path)
    with open_reader(path) as con:
        assert applied(con) == [m.__name__ for m in MIGRATIONS]
    assert file_digest(path) == before  # an up-to-date file is only read


# ---- resolve_run ----------------------------------------------------------------------------

T0 = dt.datetime(2026, 1, 1, 12, 0, 0)


def add_run(path, run_id: str, minutes: int, status: str = "done") -> None:
    store.insert_run(path, {
        "id": run_id, "created_at": T0 + dt.timedelta(minutes=minutes), "status": status, "model": "hf",
        "tasks": ["firsttoken"],
    })


@pytest.fixture(scope="module")
def runs_db_master(tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "runs.duckdb"
    add_run(path, "2601011200-aaaaaa", 0)
    add_run(path, "2601011201-abcdef", 1)
    add_run(path, "2601011202-abc123", 2)
    add_run(path, "2601011203-ffffff", 3, status="failed")
    with transaction(path) as con:
        con.execute("INSERT INTO tags VALUES ('prod', '2601011200-aaaaaa', ?)", [T0])
        con.execute("INSERT INTO tags VALUES ('prod', '2601011201-abcdef', ?)", [T0 + dt.timedelta(hours=1)])
        con.execute("INSERT INTO tags VALUES ('old', '2601011200-aaaaaa', ?)", [T0 + dt.timedelta(hours=2)])
    return path


@pytest.fixture
def db_with_runs(runs_db_master, tmp_path):
    """A fresh copy per test: four runs (one failed), the tag prod on two of them, old on one."""
    path = tmp_path / "runs.duckdb"
    shutil.copyfile(runs_db_master, path)
    return path


def test_resolve_run(db_with_runs):
    with open_reader(db_with_runs) as con:
        assert resolve_run(con, "2601011201-abcdef") == "2601011201-abcdef"  # a full id
        assert resolve_run(con, " 2601011201-abcdef ") == "2601011201-abcdef"
        assert resolve_run(con, "2601011201") == "2601011201-abcdef"  # a unique prefix
        assert resolve_run(con, "2601011202-abc") == "2601011202-abc123"
        assert resolve_run(con, "latest") == "2601011203-ffffff"  # newest, whatever its status
        assert resolve_run(con, "tag:old") == "2601011200-aaaaaa"
        assert resolve_run(con, "tag:prod") == "2601011201-abcdef"  # the run promoted to it most recently
        with pytest.raises(BadInput, match="ambiguous"):
            resolve_run(con, "26010112")
        with pytest.raises(BadInput, match="unknown run"):
            resolve_run(con, "nope")
        with pytest.raises(BadInput, match="unknown run"):
            resolve_run(con, "2601011201-abcdef0")  # longer than an id
        with pytest.raises(BadInput):
            resolve_run(con, "tag:missing")


def test_a_tag_names_the_run_promoted_to_it_most_recently_not_the_newest_run(db_with_runs):
    from evalkit.store.promotions import add_tag, tag_history

    with transaction(db_with_runs) as con:
        assert add_tag(con, "prod", "2601011200-aaaaaa") == "2601011201-abcdef"  # back to the older run
        assert add_tag(con, "prod", "2601011200-aaaaaa") == "2601011200-aaaaaa"  # already current: no row
    with open_reader(db_with_runs) as con:
        assert resolve_run(con, "tag:prod") == "2601011200-aaaaaa"
        history = tag_history(con, "prod")
    assert [(h["run_id"], h["current"]) for h in history] == [
        ("2601011200-aaaaaa", False), ("2601011201-abcdef", False), ("2601011200-aaaaaa", True)]


def test_a_promotion_is_later_than_the_last_even_when_the_clock_is_not(db_with_runs, monkeypatch):
    from evalkit.store import promotions

    future = T0 + dt.timedelta(days=3650)  # the tag's newest row is ahead of this machine's clock
    with transaction(db_with_runs) as con:
        con.execute("INSERT INTO tags VALUES ('prod', '2601011202-abc123', ?)", [future])
        promotions.add_tag(con, "prod", "2601011201-abcdef")
        (at,) = con.execute("SELECT max(created_at) FROM tags WHERE tag = 'prod'").fetchone()
    assert at == future + promotions.TICK
    with open_reader(db_with_runs) as con:
        assert resolve_run(con, "tag:prod") == "2601011201-abcdef"


def test_the_tag_history_migration_keeps_what_each_tag_named(tmp_path):
    """Before m021 `tag:NAME` was the newest run (by start) holding the tag. A tag whose newest row
    names an older run (promoted after a newer one) gets one row for the run it named, at the
    upgrade; a tag the two rules agree on is left alone."""
    path = tmp_path / "older.duckdb"
    names = [m.__name__ for m in MIGRATIONS]
    con = older_db(path, names.index("m023_tag_history"))
    for i, run_id in enumerate(["r-old", "r-new"]):
        con.execute("INSERT INTO runs (id, created_at, status, model, tasks) VALUES (?, ?, 'done', 'hf', ['x'])",
                    [run_id, T0 + dt.timedelta(minutes=i)])
    con.execute("INSERT INTO tags VALUES ('prod', 'r-new', ?), ('prod', 'r-old', ?), ('dev', 'r-old', ?), "
                "('dev', 'r-new', ?)", [T0 + dt.timedelta(hours=h) for h in (1, 2, 1, 2)])
    con.close()
    with open_writer(path) as con:
        rows = con.execute("SELECT tag, run_id FROM tags ORDER BY tag, created_at").fetchall()
        assert rows == [("dev", "r-old"), ("dev", "r-new"),
                        ("prod", "r-new"), ("prod", "r-old"), ("prod", "r-new")]
        assert resolve_run(con, "tag:prod") == resolve_run(con, "tag:dev") == "r-new"


def test_resolve_run_by_name(db_with_runs):
    for run_id, minutes, name in [("2601011204-111111", 4, "chat-q4"), ("2601011205-222222", 5, "chat-q4"),
                                  ("2601011206-333333", 6, "chat-q4-ban")]:
        store.insert_run(db_with_runs, {"id": run_id, "created_at": T0 + dt.timedelta(minutes=minutes),
                                        "status": "done", "model": "hf", "tasks": ["firsttoken"], "name": name})
    with open_reader(db_with_runs) as con:
        assert resolve_run(con, "chat-q4") == "2601011205-222222"  # the newest of that name, not a prefix
        assert resolve_run(con, "chat-q4-ban") == "2601011206-333333"
        assert resolve_run(con, "2601011204") == "2601011204-111111"  # ids still come first
        with pytest.raises(BadInput, match="run name"):
            resolve_run(con, "chat")


def test_resolve_run_by_name_prefers_done_runs_and_refuses_a_name_that_is_an_id_prefix(db_with_runs):
    for run_id, minutes, name, status in [("2601011204-111111", 4, "nightly", "done"),
                                          ("2601011205-222222", 5, "nightly", "interrupted"),
                                          ("2601011206-333333", 6, "only-failed", "failed"),
                                          ("2601011207-444444", 7, "260101120", "done")]:
        store.insert_run(db_with_runs, {"id": run_id, "created_at": T0 + dt.timedelta(minutes=minutes),
                                        "status": status, "model": "hf", "tasks": ["firsttoken"], "name": name})
    with open_reader(db_with_runs) as con:
        assert resolve_run(con, "nightly") == "2601011204-111111"  # the newer one was interrupted
        assert resolve_run(con, "only-failed") == "2601011206-333333"
        with pytest.raises(BadInput, match="both a run name and an id prefix"):
            resolve_run(con, "260101120")
        with pytest.raises(BadInput):
            resolve_run(con, "")
        with pytest.raises(BadInput):
            resolve_run(con, "tag:")


def test_resolve_run_prefix_is_literal(db_with_runs):
    """A prefix is text, not a pattern: LIKE wildcards match nothing."""
    with open_reader(db_with_runs) as con:
        for ref in ("%", "2601011201-abc%", "_601011201", "2601011201-abc_ef"):
            with pytest.raises(BadInput):
                resolve_run(con, ref)


def test_resolve_latest_on_an_empty_db(tmp_path):
    with open_writer(tmp_path / "empty.duckdb") as con, pytest.raises(BadInput, match="no runs"):
        resolve_run(con, "latest")


# ---- read_query -----------------------------------------------------------------------------


def test_read_query_reads(db_with_runs):
    cols, rows = read_query(db_with_runs, "SELECT id, status FROM runs ORDER BY id")
    assert cols == ["id", "status"]
    assert rows[0] == ("2601011200-aaaaaa", "done") and len(rows) == 4
    cols, rows = read_query(db_with_runs, "DESCRIBE tags")
    assert [r[0] for r in rows] == ["tag", "run_id", "created_at"]
    _, rows = read_query(db_with_runs, "SHOW TABLES")
    assert {"runs", "samples"} <= {r[0] for r in rows}
    cols, rows = read_query(db_with_runs, "WITH t AS (SELECT count(*) AS n FROM runs) SELECT n FROM t")
    assert rows == [(4,)]


@pytest.mark.parametrize(
    "sql",
    [
        "INSERT INTO tags VALUES ('x', 'y', now())",
        "UPDATE runs SET status = 'done'",
        "DELETE FROM runs",
        "DROP TABLE runs",
        "CREATE TABLE t (x INTEGER)",
        "CREATE VIEW v AS SELECT 1",
        "ALTER TABLE runs ADD COLUMN x INTEGER",
        "SELECT 1; DELETE FROM runs",
        "WITH t AS (SELECT 1) DELETE FROM runs",
        "COPY runs TO '{out}'",
        "ATTACH '{out}.db' AS other",
        "CHECKPOINT",
        "SET threads = 1",
        "INSTALL httpfs",
    ],
)
def test_read_query_refuses_writes(db_with_runs, tmp_path, sql):
    before = file_digest(db_with_runs)
    out = tmp_path / "out.csv"
    with pytest.raises(BadInput):
        read_query(db_with_runs, sql.format(out=out))
    assert file_digest(db_with_runs) == before
    assert not out.exists() and not (tmp_path / "out.csv.db").exists()
    _, rows = read_query(db_with_runs, "SELECT count(*) FROM runs")
    assert rows == [(4,)]


def test_read_query_bad_sql_and_missing_db(db_with_runs, tmp_path):
    with pytest.raises(BadInput, match="SQL error"):
        read_query(db_with_runs, "SELECT FROM WHERE")
    with pytest.raises(BadInput, match="SQL error"):
        read_query(db_with_runs, "SELECT * FROM no_such_table")
    with pytest.raises(BadInput):
        read_query(db_with_runs, "   ")
    with pytest.raises(BadInput):
        read_query(tmp_path / "missing.duckdb", "SELECT 1")
    assert not (tmp_path / "missing.duckdb").exists()


def test_read_query_allows_pivot(tmp_path):
    """DuckDB parses PIVOT as a MULTI statement; it only reads, so query lets it through."""
    db = tmp_path / "p.duckdb"
    with transaction(db) as con:
        con.execute("INSERT INTO tags VALUES ('prod', 'r1', now()), ('dev', 'r2', now())")
    cols, rows = read_query(db, "PIVOT (SELECT tag, run_id FROM tags) ON tag USING first(run_id)")
    assert sorted(cols) == ["dev", "prod"] and len(rows) == 1


# ---- finish_run: the bulk insert -----------------------------------------------------------


def sample_row(run_id: str, i: int) -> dict:
    return {
        "run_id": run_id, "task": "firsttoken_zh" if i % 2 else "firsttoken_en", "doc_id": f"d{i}",
        "prompt": f"递归 {i} $", "first_token_id": i, "ft_hit": float(i % 2), "needle_hint": i % 3 == 0,
        "needle_length": None, "metrics": f'{{"ft_hit": {i % 2}}}',
    }


def test_finish_run_stores_every_row_as_given(tmp_path, monkeypatch):
    """Rows span several Arrow batches and keep their order; a key a row lacks is NULL, a key
    outside the table is ignored; the run row is updated in the same transaction."""
    monkeypatch.setattr(store_rows, "_BATCH_ROWS", 4)
    db = tmp_path / "f.duckdb"
    add_run(db, "r1", 0, status="running")
    rows = [sample_row("r1", i) for i in range(11)]
    rows[5] = {"run_id": "r1", "task": "firsttoken_en", "doc_id": "d5"}
    rows[6]["not_a_column"] = "ignored"
    topk = [{"run_id": "r1", "task": "firsttoken_en", "doc_id": f"d{i // 3}", "rank": i % 3,
             "token_id": 100 + i, "token": " tok", "logprob": -0.5 * i, "unit": "tok" if i % 3 == 0 else None}
            for i in range(9)]
    metrics = [{"run_id": "r1", "task": "firsttoken_en", "metric": "ft_hit", "filter": "none",
                "value": 0.5, "stderr": 0.1, "n": 11}]
    store.finish_run(db, "r1", metrics=metrics, samples=rows, topk=topk, status="done", duration_s=2.5)
    with open_reader(db) as con:
        stored = con.execute(f"SELECT {', '.join(store_rows.SAMPLE_COLUMNS)} FROM samples").fetchall()
        assert stored == [tuple(r.get(c) for c in store_rows.SAMPLE_COLUMNS) for r in rows]
        assert con.execute(f"SELECT {', '.join(store_rows.TOPK_COLUMNS)} FROM first_token_topk").fetchall() == [
            tuple(r[c] for c in store_rows.TOPK_COLUMNS) for r in topk]
        assert con.execute("SELECT metric, value, n FROM metrics").fetchall() == [("ft_hit", 0.5, 11)]
        assert con.execute("SELECT status, duration_s FROM runs WHERE id = 'r1'").fetchone() == ("done", 2.5)


def test_finish_run_with_a_bad_value_writes_nothing(tmp_path, monkeypatch):
    """A value that does not fit its column (in a later batch) fails the run's one transaction."""
    monkeypatch.setattr(store_rows, "_BATCH_ROWS", 4)
    db = tmp_path / "bad.duckdb"
    add_run(db, "r1", 0, status="running")
    rows = [sample_row("r1", i) for i in range(11)]
    rows[9]["ft_hit"] = "not a number"
    with pytest.raises(duckdb.Error, match="not a number"):
        store.finish_run(db, "r1", metrics=[], samples=rows, topk=[], status="done")
    with open_reader(db) as con:
        assert con.execute("SELECT count(*) FROM samples").fetchone() == (0,)
        assert con.execute("SELECT status FROM runs WHERE id = 'r1'").fetchone() == ("running",)
