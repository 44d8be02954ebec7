"""Past one machine: Parquet export round trip, one query over several DBs and exports, rank 0 alone writes."""

from __future__ import annotations

import duckdb
import pytest
from click.testing import CliRunner

from evalkit.cli import cli
from evalkit.errors import BadInput
from evalkit.runner.execute import RunConfig, execute
from evalkit.store.export import export_parquet
from evalkit.store.sandbox import TABLES, merged_query, read_query


def all_rows(query, table):
    """Every row of a table, in one canonical order (sources may return rows in any order)."""
    cols, rows = query(f"SELECT * FROM {table}")
    return cols, sorted(rows, key=repr)


@pytest.fixture(scope="module")
def two_dbs(fake_run, tmp_path_factory):
    """Two DB files as if from two machines: A with 2 runs (one tagged), B with 1."""
    from evalkit.store.db import transaction

    folder = tmp_path_factory.mktemp("machines")
    a, b = folder / "a.duckdb", folder / "b.duckdb"
    ids_a = [fake_run(a, "hit", name="a1"), fake_run(a, "opener", name="a2")]
    ids_b = [fake_run(b, "other", limit=3, name="b1")]
    with transaction(a) as con:
        con.execute("INSERT INTO tags VALUES ('prod', ?, now())", [ids_a[0]])
        # the fake LM has no logprobs: a few top-k rows so every table travels
        con.executemany("INSERT INTO first_token_topk (run_id, task, doc_id, rank, token_id, token, logprob) "
                        "VALUES (?, 'firsttoken_zh', 'zh-001', ?, ?, ?, ?)",
                        [[ids_a[1], 0, 17, "递", -0.25], [ids_a[1], 1, 4, " Sure", -1.5]])
        # and a few attention rows, as an --attention run would store them
        con.executemany("INSERT INTO attention_layers VALUES (?, 'firsttoken_en', 'en-001', ?, ?, ?, NULL, ?)",
                        [[ids_a[0], 0, 0.25, 0.2, 0.4], [ids_a[0], 1, 0.75, 0.6, 0.3]])
    from evalkit.release.db import gate_runs, record_decision

    record_decision(a, gate_runs(a, ids_a[1], ids_a[0]), "tag:prod")  # a gate's decision travels too
    return a, b, ids_a, ids_b


def test_parquet_round_trip(two_dbs, tmp_path):
    a, _, _, _ = two_dbs
    before = a.read_bytes()
    out = tmp_path / "export"
    result = CliRunner().invoke(cli, ["export", "--parquet", str(out), "--db", str(a)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{t}.parquet" for t in TABLES)
    assert a.read_bytes() == before  # a read-only connection: the DB is untouched
    for table in TABLES:
        from_db = all_rows(lambda sql: read_query(a, sql), table)
        from_parquet = all_rows(lambda sql: merged_query([], [out], sql), table)
        assert from_parquet == from_db, table
        # the fake LM's runs read no first characters (an opt-in of the exact engines); the table's rows
        # are stored and read back in tests/test_firstchar.py
        assert from_db[1] or table == "first_char_topk", f"{table} is empty: the round trip proves little"
    # the DB's views are rebuilt over the export
    lb = merged_query([], [out], "SELECT count(*) FROM leaderboard")[1][0][0]
    assert lb == read_query(a, "SELECT count(*) FROM leaderboard")[1][0][0] > 0


def test_an_export_from_before_attention_layers_still_reads(two_dbs, tmp_path):
    """attention_layers came later: an export without its Parquet file reads as having no such rows."""
    a, _, _, _ = two_dbs
    out = tmp_path / "old"
    export_parquet(a, out)
    (out / "attention_layers.parquet").unlink()
    assert merged_query([], [out], "SELECT count(*) FROM attention_layers")[1][0][0] == 0
    assert merged_query([], [out], "SELECT count(*) FROM attention_sink")[1][0][0] == 0
    assert merged_query([a], [out], "SELECT count(*) FROM attention_layers")[1][0][0] == 2
    (out / "tags.parquet").unlink()
    with pytest.raises(BadInput, match="tags.parquet is missing"):
        merged_query([], [out], "SELECT 1")


def test_export_counts_rows(two_dbs, tmp_path):
    a, _, ids_a, _ = two_dbs
    written = {table: n for table, n, _ in export_parquet(a, tmp_path / "out")}
    assert written["runs"] == len(ids_a)
    assert written["tags"] == 1
    assert written["samples"] == read_query(a, "SELECT count(*) FROM samples")[1][0][0]


def test_merged_query_over_two_db_files(two_dbs):
    a, b, ids_a, ids_b = two_dbs
    before = a.read_bytes(), b.read_bytes()
    runner = CliRunner()
    result = runner.invoke(
        cli, ["query", "SELECT count(*) AS n FROM runs", "--db", str(a), "--db", str(b), "--format", "csv"],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["n", "3"]
    cols, rows = merged_query([a, b], [], "SELECT id, name FROM runs ORDER BY name")
    assert rows == [(ids_a[0], "a1"), (ids_a[1], "a2"), (ids_b[0], "b1")]
    # every table is the union of both sources
    for table in TABLES:
        n_a = read_query(a, f"SELECT count(*) FROM {table}")[1][0][0]
        n_b = read_query(b, f"SELECT count(*) FROM {table}")[1][0][0]
        assert merged_query([a, b], [], f"SELECT count(*) FROM {table}")[1][0][0] == n_a + n_b, table
    # views work across machines: tags from A resolve against runs from both
    _, lb = merged_query([a, b], [], "SELECT DISTINCT run_id FROM leaderboard ORDER BY run_id")
    assert [r[0] for r in lb] == sorted(ids_a + ids_b)
    assert (a.read_bytes(), b.read_bytes()) == before


def test_merged_query_over_a_db_and_an_export(two_dbs, tmp_path):
    a, b, ids_a, ids_b = two_dbs
    export_parquet(b, tmp_path / "b")
    cols, rows = merged_query([a], [tmp_path / "b"], "SELECT name, count(*) FROM samples JOIN runs ON id = run_id "
                                                    "GROUP BY name ORDER BY name")
    assert rows == [("a1", 4), ("a2", 4), ("b1", 6)]
    # with --parquet, $EVALKIT_DB (a third, empty source here) is not joined unasked
    result = CliRunner().invoke(cli, ["query", "SELECT count(*) AS n FROM runs", "--parquet", str(tmp_path / "b"),
                                      "--format", "csv"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["n", "1"]


def test_merged_query_refuses_writes_and_bad_sources(two_dbs, tmp_path):
    a, b, _, _ = two_dbs
    for sql in ("INSERT INTO tags VALUES ('x', 'y', now())", "COPY runs TO 'x.csv'", "ATTACH 'x.duckdb' AS x",
                "DETACH evalkit_src0", "SELECT 1; DROP VIEW runs"):
        with pytest.raises(BadInput, match="read-only"):
            merged_query([a, b], [], sql)
    text = tmp_path / "notes.txt"
    text.write_text("not a database\n")
    with pytest.raises(BadInput, match="not a DuckDB file"):
        merged_query([a, text], [], "SELECT 1")
    with pytest.raises(BadInput, match="no evalkit database"):
        merged_query([a, tmp_path / "missing.duckdb"], [], "SELECT 1")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "runs.parquet").write_bytes(b"")
    with pytest.raises(BadInput, match="metrics.parquet is missing"):
        merged_query([], [tmp_path / "half"], "SELECT 1")
    plain = tmp_path / "plain.duckdb"
    duckdb.connect(str(plain)).execute("CREATE TABLE t (a INTEGER)").close()
    with pytest.raises(BadInput, match="not an evalkit database"):
        merged_query([a, plain], [], "SELECT 1")
    assert not (tmp_path / "x.csv").exists()


@pytest.mark.parametrize("env", [
    {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"},
    {"LOCAL_RANK": "1", "WORLD_SIZE": "2"},
    {"RANK": "3", "LOCAL_RANK": "0", "WORLD_SIZE": "4"},  # first process of a second node
], ids=["rank1", "local-rank1", "node2-rank3"])
def test_only_rank_zero_writes(env, monkeypatch, tmp_path):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    db = tmp_path / "evalkit.duckdb"
    result = execute(RunConfig(tasks=["firsttoken"], model="evalkit-fake", model_args="mode=hit", limit=2, db=str(db)))
    rank = env.get("RANK", env.get("LOCAL_RANK"))
    assert result.status == f"not stored: this is rank {rank} of {env['WORLD_SIZE']}; rank 0 stores the run"
    assert result.n_samples == 0 and result.metrics == []
    if db.exists():  # it should not even be created; if it is, it must hold nothing
        assert read_query(db, "SELECT count(*) FROM runs")[1][0][0] == 0
    assert not db.exists(), "a non-zero rank created the DB file"


def test_rank_zero_of_two_writes(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    db = tmp_path / "evalkit.duckdb"
    run_id = execute(RunConfig(tasks=["firsttoken"], model="evalkit-fake", model_args="mode=hit", limit=2,
                               db=str(db))).run_id
    assert read_query(db, "SELECT id, status FROM runs")[1] == [(run_id, "done")]


def test_merging_a_db_with_its_own_export_counts_each_run_once(two_dbs, tmp_path):
    # every run of a DB merged with its own export was counted twice
    a, b, ids_a, ids_b = two_dbs
    export_parquet(a, tmp_path / "a")
    export_parquet(a, tmp_path / "a2")
    for table in TABLES:
        alone = all_rows(lambda sql: read_query(a, sql), table)
        for dbs, exports in (([a], [tmp_path / "a"]), ([], [tmp_path / "a", tmp_path / "a2"])):
            assert all_rows(lambda sql: merged_query(dbs, exports, sql), table) == alone, (table, dbs, exports)
    # with a second machine's DB beside it, its runs are added once
    n = merged_query([a, b], [tmp_path / "a"], "SELECT count(*), count(DISTINCT id) FROM runs")[1][0]
    assert n == (3, 3)
    n_samples = merged_query([a, b], [tmp_path / "a"], "SELECT count(*) FROM samples")[1][0][0]
    assert n_samples == sum(read_query(x, "SELECT count(*) FROM samples")[1][0][0] for x in (a, b))
    _, lb = merged_query([a], [tmp_path / "a"], "SELECT count(*) FROM leaderboard")
    assert lb == read_query(a, "SELECT count(*) FROM leaderboard")[1]
