"""`evalkit query` limits: a statement stops at --timeout or at Ctrl-C and frees the DB's lock at
once; each source counts once; a folder whose Parquet files are not Parquet is one line.

The long statement (LONG) hashes ten billion numbers: minutes on any machine, and DuckDB
cannot fold it away as it folds `count(*) FROM range(...)`. The lock is proven free by a
writer in another process, which DuckDB refuses while any process holds the file.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest

from evalkit.store.export import export_parquet
from tests import children
from tests.test_bad_input import seed_db

ROOT = Path(__file__).resolve().parents[1]
LONG = "SELECT max(md5(x::VARCHAR)) FROM range(10000000000) t(x)"
COUNT_RUNS = "SELECT count(*) AS n FROM runs"


@pytest.fixture
def query(invoke):
    """`query(SQL, *options, env=None)`: `evalkit query` in-process."""
    return lambda *args, env=None: invoke("query", *args, env=env)


def one_error_line(res, fragment: str) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.output
    assert lines[0].startswith("evalkit: error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in res.output
    return lines[0]


def writer_can_open(db: Path) -> bool:
    """Whether another process can open `db` read-write right now (no wait, no retry)."""
    probe = subprocess.run([sys.executable, "-c", "import duckdb, sys; duckdb.connect(sys.argv[1]).close()", str(db)],
                           capture_output=True, text=True, timeout=60)
    return probe.returncode == 0


def sql_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "evalkit-sql"]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """Two DBs of one fake-LM run each, and a Parquet export of the first."""
    folder = tmp_path_factory.mktemp("limits-seed")
    seed_db(folder / "a.duckdb", runs=1)
    seed_db(folder / "b.duckdb", runs=1)
    export_parquet(folder / "a.duckdb", folder / "a-export")
    return folder


@pytest.fixture
def work(seeded, tmp_path):
    """This test's own copies of the seeded DBs and export."""
    for name in ("a.duckdb", "b.duckdb"):
        shutil.copy(seeded / name, tmp_path / name)
    shutil.copytree(seeded / "a-export", tmp_path / "a-export")
    return tmp_path


def test_the_long_statement_runs_past_the_timeout():
    """LONG is still running after 2 s on its own, so a stop at --timeout 1 is the timeout's."""
    con = duckdb.connect(":memory:")
    timer = threading.Timer(2.0, con.interrupt)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(duckdb.InterruptException):
            con.execute(LONG).fetchall()
    finally:
        timer.cancel()
        con.close()
    assert time.monotonic() - started >= 2.0


@pytest.mark.parametrize("sources, env, runs", [
    (["--db", "{a}"], {}, 1),
    (["--db", "{a}", "--db", "{b}"], {}, 2),
    (["--parquet", "{export}", "--db", "{b}"], {}, 2),
    (["--db", "{a}"], {"EVALKIT_QUERY_TIMEOUT": "1"}, 1),
], ids=["one-db", "two-dbs", "export-and-db", "env-var"])
def test_a_long_query_stops_at_the_timeout_and_frees_the_lock(query, work, sources, env, runs):
    a, b = work / "a.duckdb", work / "b.duckdb"
    args = [s.format(a=a, b=b, export=work / "a-export") for s in sources]
    timeout = [] if env else ["--timeout", "1"]
    started = time.monotonic()
    res = query(LONG, *timeout, *args, env=env)
    took = time.monotonic() - started
    assert res.exit_code == 2, res.output
    assert one_error_line(res, "query stopped") == "evalkit: error: query stopped after 1 s (--timeout)"
    assert 1.0 <= took < 6.0, f"stopped after {took:.1f} s"
    assert not sql_threads(), "the statement's thread outlived it"
    assert writer_can_open(a) and writer_can_open(b)
    # a statement that ends in time is untouched by the limit
    fast = query(COUNT_RUNS, *args, "--format", "csv", env=env)
    assert fast.exit_code == 0 and fast.stdout.split() == ["n", str(runs)], fast.output


def test_ctrl_c_stops_a_running_query_and_frees_the_lock(work):
    db = work / "a.duckdb"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EVALKIT_DB": str(db)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "evalkit", "query", LONG, "--timeout", "120"], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        # its own SIGINT handling, and it dies with the test run (tests/children.py)
        preexec_fn=children.preexec(),
    )
    try:
        deadline = time.monotonic() + 60
        while writer_can_open(db):  # until the query holds the file
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the query never opened the DB"
        time.sleep(0.5)  # into the statement
        assert proc.poll() is None, "the query ended before Ctrl-C"
        proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.strip().splitlines() == ["evalkit: error: interrupted"], err
    assert took < 2.0, f"stopped {took:.1f} s after Ctrl-C"
    assert writer_can_open(db)


@pytest.mark.parametrize("option, spelling", [
    (option, spelling) for option in ("--db", "--parquet") for spelling in ("same", "dot", "symlink", "hardlink")
    if (option, spelling) != ("--parquet", "hardlink")  # a folder has no hard links
])
def test_each_source_counts_once(query, work, option, spelling):
    source = work / ("a.duckdb" if option == "--db" else "a-export")
    again = {
        "same": str(source),
        "dot": f"{source.parent}/./{source.name}",
        "symlink": str(work / f"link-{source.name}"),
        "hardlink": str(work / f"hard-{source.name}"),
    }[spelling]
    if spelling == "symlink":
        os.symlink(source, again)
    if spelling == "hardlink":
        os.link(source, again)
    once = query(COUNT_RUNS, option, source, "--format", "csv")
    assert once.exit_code == 0 and once.stdout.split() == ["n", "1"], once.output
    twice = query(COUNT_RUNS, option, source, option, again, "--format", "csv")
    assert twice.exit_code == 2, twice.output
    line = one_error_line(twice, "is the same source as")
    assert again in line and str(source) in line
    # two sources that are not the same still union
    both = query(COUNT_RUNS, option, source, "--db", work / "b.duckdb", "--format", "csv")
    assert both.exit_code == 0 and both.stdout.split() == ["n", "2"], both.output


@pytest.mark.parametrize("content, fragment", [
    ("text", "runs.parquet is not a Parquet file"),
    ("duckdb", "runs.parquet is a DuckDB file, not Parquet"),
    ("damaged", "runs.parquet is not a readable Parquet file"),
    ("empty", "runs.parquet is not a Parquet file"),
])
def test_a_bad_parquet_file_is_one_line(query, work, content, fragment):
    folder = work / "a-export"
    file = folder / "runs.parquet"
    good = file.read_bytes()
    if content == "text":
        file.write_text("id,name\nr1,x\n", encoding="utf-8")
    elif content == "duckdb":
        shutil.copy(work / "a.duckdb", file)
    elif content == "damaged":  # the magic bytes at both ends, nothing sound between them
        file.write_bytes(good[:4] + b"\0" * 64 + good[-8:])
    else:
        file.write_bytes(b"")
    res = query(COUNT_RUNS, "--parquet", folder)
    assert res.exit_code == 2, res.output
    assert str(file) in one_error_line(res, fragment)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "abc", ""])
def test_the_timeout_is_a_finite_number_above_zero(query, work, value):
    res = query(COUNT_RUNS, "--timeout", value, "--db", work / "a.duckdb")
    assert res.exit_code == 2, res.output
    line = one_error_line(res, "--timeout")
    if value not in ("abc", ""):
        assert line == f"evalkit: error: --timeout must be a finite number of seconds > 0, got {value}"
    if value:  # an empty variable is an unset one
        env = query(COUNT_RUNS, "--db", work / "a.duckdb", env={"EVALKIT_QUERY_TIMEOUT": value})
        assert env.exit_code == 2, env.output
        one_error_line(env, f"EVALKIT_QUERY_TIMEOUT={value!r}")
