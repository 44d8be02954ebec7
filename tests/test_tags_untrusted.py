"""Tags under untrusted inputs: a tag whose run another DuckDB client deleted, and tag names a
command line or a reader would take for something else.

The rules, one place each: `store.queries.resolve_run` (every command reading `tag:NAME` goes
through it) refuses a tag whose current run is gone with `store.queries.dangling`'s one line;
`store.promotions.tag_history` marks such rows `dangling` for `evalkit tags`; tag names are checked
by `labels.check_tag_name` (called by `release.db.promote`), which reuses the run names'
label rule `labels.check_label` (length, control characters, compatibility forms such as
fullwidth letters).
"""

from __future__ import annotations

import duckdb
import pytest

from tests.fuzz import error_lines


def _one_line(res, expect: str) -> str:
    lines = error_lines(res.stderr)
    assert res.exit_code == 2 and len(lines) == 1, (res.exit_code, res.stderr)
    assert lines[0].startswith("evalkit: error: ") and expect in lines[0], lines[0]
    assert "internal error" not in res.stderr and "Traceback" not in res.stderr
    return lines[0]


def test_a_tag_whose_run_was_deleted_elsewhere(invoke, fake_run, tmp_path):
    db = tmp_path / "t.duckdb"
    gone, kept = fake_run(db, name="gone"), fake_run(db, name="kept")
    assert invoke("promote", gone, "--tag", "prod", "--db", db).exit_code == 0
    con = duckdb.connect(str(db))  # another client deletes the run the tag names
    for table in [r[0] for r in con.execute("SELECT table_name FROM information_schema.columns "
                                            "WHERE column_name = 'run_id' AND table_schema = 'main' "
                                            "AND table_name NOT IN ('tags') "
                                            "AND table_name IN (SELECT table_name FROM information_schema.tables "
                                            "WHERE table_type = 'BASE TABLE')").fetchall()]:
        con.execute(f'DELETE FROM "{table}" WHERE run_id = ?', [gone])
    con.execute("DELETE FROM runs WHERE id = ?", [gone])
    con.close()
    expect = f"tag:prod points to run {gone}, which is gone from the DB"
    for args in (["show", "tag:prod"], ["gate", "--candidate", kept, "--baseline", "tag:prod"],
                 ["gate", "--candidate", "tag:prod", "--baseline", kept], ["compare", "tag:prod", kept],
                 ["report", "--runs", "tag:prod", "--out", tmp_path / "r"], ["promote", "tag:prod", "--tag", "x"]):
        _one_line(invoke(*args, "--db", db), expect)
    res = invoke("tags", "--db", db, "--format", "csv")
    assert res.exit_code == 0, res.stderr
    header, row = res.stdout.strip().splitlines()[:2]
    assert header.endswith(",current,dangling") and row.startswith("prod,") and gone in row
    assert row.endswith(",True,True"), row
    table = invoke("tags", "--db", db)
    assert "run gone" in table.stdout
    # promoting a run again mends the tag
    assert invoke("promote", kept, "--tag", "prod", "--db", db).exit_code == 0
    assert invoke("show", "tag:prod", "--db", db).exit_code == 0


@pytest.mark.parametrize("tag, expect", [
    ("-x", "starts with '-'"),
    ("--db", "starts with '-'"),
    ("a" * 100_000, "longer than 200 characters"),
    ("ｐｒｏｄ", "compatibility form of 'p'"),
    ("prod\uff11", "compatibility form of '1'"),
    ("ﬁx", "compatibility form of 'fi'"),
    ("pr od", "bad tag name"),
])
def test_a_tag_name_that_would_read_as_something_else(invoke, fake_run, tmp_path, tag, expect):
    db = tmp_path / "n.duckdb"
    run = fake_run(db)
    before = db.read_bytes()
    line = _one_line(invoke("promote", run, f"--tag={tag}", "--db", db), expect)
    assert len(line) < 400
    assert db.read_bytes() == before


def test_the_run_names_share_the_rule(invoke, fake_run, tmp_path):
    from evalkit.errors import BadInput
    from evalkit.labels import check_tag_name
    from evalkit.runner.config import check_run_name

    for check in (check_run_name, check_tag_name):
        with pytest.raises(BadInput, match="compatibility form"):
            check("ｂａｓｅ")
    assert check_run_name("模型-1") == "模型-1" and check_tag_name("prod-2.1_x") == "prod-2.1_x"
