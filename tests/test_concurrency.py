"""Reliability, concurrency: four `evalkit run` processes on one DB file at once all land; reads wait for writes.

DuckDB lets one process write a file at a time; evalkit keeps each write short
(run row at the start, results in one transaction at the end) and retries the
file lock with backoff (store.db.open_waiting), so concurrent runs queue rather than fail.
"""

from __future__ import annotations

import subprocess
import threading
import time

import duckdb

from tests.test_interrupts import evalkit_process

LIMIT = 3  # prompts per task: firsttoken = firsttoken_en + firsttoken_zh
HOLD_S = 3.0  # how long the test holds the write lock against `evalkit query`


def test_four_runs_on_one_db_all_land(tmp_path):
    from evalkit.errors import BadInput
    from evalkit.store.sandbox import read_query

    db = tmp_path / "evalkit.duckdb"
    reads: list[int] = []  # runs seen by each read made while the four write
    errors: list[Exception] = []
    stop = threading.Event()

    def read_while_writing():
        while not stop.is_set():
            try:
                reads.append(read_query(db, "SELECT count(*) FROM runs")[1][0][0])
            except BadInput as exc:  # before the first run creates the file
                if "no evalkit database" not in str(exc) and "needs migrating" not in str(exc):
                    errors.append(exc)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
            time.sleep(0.2)

    reader = threading.Thread(target=read_while_writing, daemon=True)
    reader.start()
    procs = [
        evalkit_process(
            ["run", "--model", "evalkit-fake", "--model-args", "mode=hit", "--tasks", "firsttoken",
             "--limit", str(LIMIT), "--name", f"p{i}"],
            db, delay=0.05, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        for i in range(4)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    stop.set()
    reader.join(30)
    assert not errors, errors
    assert reads, "no read succeeded while the runs were writing"
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"exit {p.returncode}\n{out}\n{err[-2000:]}"

    con = duckdb.connect(str(db), read_only=True)
    try:
        runs = con.execute("SELECT id, name, status FROM runs ORDER BY name").fetchall()
        assert [(name, status) for _, name, status in runs] == [(f"p{i}", "done") for i in range(4)]
        for run_id, name, _ in runs:
            samples = con.execute("SELECT count(*), count(DISTINCT task || doc_id) FROM samples WHERE run_id = ?",
                                  [run_id]).fetchone()
            assert samples == (2 * LIMIT, 2 * LIMIT), (name, samples)
            metrics = dict(con.execute("SELECT task || '/' || metric, value FROM metrics WHERE run_id = ?",
                                       [run_id]).fetchall())
            assert metrics["firsttoken_en/ft_hit"] == 1.0 and metrics["firsttoken_zh/ft_hit"] == 1.0, (name, metrics)
        # every row belongs to one of the four runs; nothing half-written
        assert con.execute("SELECT count(*) FROM samples WHERE run_id NOT IN (SELECT id FROM runs)").fetchone()[0] == 0
        assert con.execute("SELECT count(*) FROM metrics WHERE run_id NOT IN (SELECT id FROM runs)").fetchone()[0] == 0
        assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == 4 * 2 * LIMIT
    finally:
        con.close()


def test_query_waits_for_a_writer(tmp_path):
    """`evalkit query` started while another process holds the write lock succeeds once it is released."""
    from evalkit.store.db import open_writer

    db = tmp_path / "evalkit.duckdb"
    with open_writer(db):
        pass  # create and migrate
    writer = duckdb.connect(str(db))  # this process now holds the file lock
    writer.execute("BEGIN TRANSACTION")
    writer.execute("INSERT INTO tags VALUES ('held', 'x', now())")
    released = threading.Event()

    def release_later():
        time.sleep(HOLD_S)  # long enough for the child to start and meet the lock, even on a busy machine
        writer.execute("COMMIT")
        writer.close()
        released.set()

    threading.Thread(target=release_later, daemon=True).start()
    t0 = time.monotonic()
    proc = evalkit_process(["query", "SELECT count(*) AS n FROM tags", "--format", "csv"], db,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    waited = time.monotonic() - t0
    assert released.wait(10)
    assert proc.returncode == 0, f"exit {proc.returncode}: {err}"
    assert out.strip().splitlines() == ["n", "1"], out  # it read after the writer committed
    assert waited >= HOLD_S - 0.5, f"the query did not wait for the writer ({waited:.2f} s)"
