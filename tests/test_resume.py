"""Reliability, resume: a run killed at any point continues from its journal, and its rows
equal an uninterrupted run's; a journal that is not this DB's journal of this run, or that
changed, or a configuration that changed, is refused with one line before the model loads.

The timeline test kills a real `evalkit run` process (tests.kill_cli: SIGKILL or SIGINT at
an exact batch, or as it stores the finished run), resumes it, and compares every row of
metrics, samples and first_token_topk with an uninterrupted run of the same configuration.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner

from evalkit import api
from evalkit.cli import cli as main
from evalkit.contract import FirstStepResult
from evalkit.errors import BadInput
from evalkit.store import journal, spool
from tests.test_determinism import TABLES, differences

ROOT = Path(__file__).resolve().parents[1]
LIMIT, BATCH = 3, 2  # firsttoken_en + firsttoken_zh, 3 prompts each: 6 prompts in 3 batches


def run_args(model_dir, db) -> list[str]:
    return ["run", "--model", "hf", "--model-args", f"pretrained={model_dir}", "--device", "cpu",
            "--tasks", "firsttoken_en,firsttoken_zh", "--limit", str(LIMIT), "--batch-size", str(BATCH),
            "--db", str(db)]


def killed_run(model_dir, db, at: str, sig: str = "SIGKILL") -> tuple[str, subprocess.CompletedProcess]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "KILL_AT": at, "KILL_SIG": sig}
    proc = subprocess.run([sys.executable, "-m", "tests.kill_cli", *run_args(model_dir, db)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    started = [ln for ln in proc.stderr.splitlines() if ln.startswith("run ") and ln.endswith(" started")]
    assert started, proc.stderr
    return started[0].split()[1], proc


def status(db, run_id: str) -> str:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute("SELECT status FROM runs WHERE id = ?", [run_id]).fetchone()[0]
    finally:
        con.close()


def row_of(db, run_id: str) -> tuple:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute("SELECT status, pid, error, heartbeat_at FROM runs WHERE id = ?", [run_id]).fetchone()
    finally:
        con.close()


def journal_lines(db, run_id: str) -> int:
    path = spool.spool_dir(Path(db)) / f"{run_id}{journal.SUFFIX}"
    return len(path.read_bytes().split(b"\n")) - 1 if path.exists() else -1


def journaled(db, run_id: str) -> tuple[int, int]:
    """(whole batches, prompts) the run's journal holds."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        ident = spool.identity(con)
    finally:
        con.close()
    opened, _ = journal.Journal.resume(spool.spool_dir(Path(db)) / f"{run_id}{journal.SUFFIX}", ident, run_id)
    opened.close()
    return len(opened.batches), opened.prompts


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """An uninterrupted run's DB and id."""
    db = tmp_path_factory.mktemp("resume") / "evalkit.duckdb"
    result = CliRunner().invoke(main, run_args(tiny_model_dir, db))
    assert result.exit_code == 0, result.output
    ids = duckdb.connect(str(db), read_only=True).execute("SELECT id FROM runs").fetchall()
    return db, ids[0][0]


@pytest.mark.parametrize("at, sig, code, was, replayed", [
    ("0", "SIGKILL", -9, "abandoned", 0),  # started, nothing journaled yet
    ("1", "SIGKILL", -9, "abandoned", 1),
    ("2", "SIGINT", 130, "interrupted", 2),  # Ctrl-C: the run is recorded interrupted
    ("store", "SIGKILL", -9, "abandoned", 3),  # every batch journaled, killed as it stores
])
def test_a_killed_run_resumes_to_the_rows_of_an_uninterrupted_run(tiny_model_dir, reference, at, sig, code,
                                                                   was, replayed):
    ref_db, ref_id = reference
    db = ref_db.parent / f"killed-{at}-{sig}.duckdb"
    import shutil

    shutil.copy(ref_db, db)  # the reference run sits beside the resumed one: compared in one DB
    run_id, proc = killed_run(tiny_model_dir, db, at, sig)
    assert proc.returncode == code, proc.stderr
    assert journaled(db, run_id)[0] == replayed  # whole batches: what a resume replays
    if sig == "SIGINT":
        assert f"`evalkit run --resume {run_id}` continues it" in proc.stderr.splitlines()[-1]
    result = CliRunner().invoke(main, ["run", "--resume", run_id, "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert f"resumed run {run_id}: {replayed} batches replayed from its journal, {3 - replayed} computed now" \
        in result.output
    assert status(db, run_id) == "done"
    assert journal_lines(db, run_id) == -1  # removed once the run is stored
    for table in TABLES:
        n_ref, n_resumed, diff = differences(db, table, ref_id, run_id)
        assert n_ref == n_resumed > 0, (table, n_ref, n_resumed)
        assert diff == [], f"{table} differ after a resume killed at {at}: {diff}"
    assert was in ("abandoned", "interrupted")


def test_a_run_killed_mid_batch_keeps_its_finished_prompts_and_resumes_to_the_same_rows(tiny_model_dir, reference):
    """The journal takes each prompt as its continuation ends, not only whole batches: killed as soon
    as it holds one prompt, it holds that prompt (the batch-only journal held nothing then). The
    batch it belongs to runs again whole on resume, and the rows are an uninterrupted run's."""
    ref_db, ref_id = reference
    db = ref_db.parent / "killed-prompts-1.duckdb"
    import shutil

    shutil.copy(ref_db, db)
    run_id, proc = killed_run(tiny_model_dir, db, "prompts:1")
    assert proc.returncode == -9, proc.stderr
    batches, prompts = journaled(db, run_id)
    assert prompts >= 1 and prompts >= 2 * batches  # journaled before its batch was stored
    result = CliRunner().invoke(main, ["run", "--resume", run_id, "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert f"resumed run {run_id}: {batches} batches replayed from its journal, {3 - batches} computed now" \
        in result.output
    for table in TABLES:
        n_ref, n_resumed, diff = differences(db, table, ref_id, run_id)
        assert n_ref == n_resumed > 0 and diff == [], (table, diff)


def test_resume_refuses_what_cannot_resume(tiny_model_dir, reference, tmp_path):
    ref_db, ref_id = reference
    db = tmp_path / "evalkit.duckdb"
    import shutil

    shutil.copy(ref_db, db)
    refused = CliRunner().invoke(main, ["run", "--resume", ref_id, "--db", str(db)])
    assert refused.exit_code == 2 and f"run {ref_id} is done: there is nothing to resume" in refused.output
    refused = CliRunner().invoke(main, ["run", "--resume", ref_id, "--seed", "3", "--db", str(db)])
    assert refused.exit_code == 2 and "drop --seed" in refused.output
    refused = CliRunner().invoke(main, ["run", "--resume", "nope", "--db", str(db)])
    assert refused.exit_code == 2 and "unknown run 'nope'" in refused.output

    run_id, _ = killed_run(tiny_model_dir, db, "1")
    path = spool.spool_dir(db) / f"{run_id}{journal.SUFFIX}"
    good = path.read_bytes()

    before = row_of(db, run_id)

    def refusal(data: bytes) -> str:
        path.write_bytes(data)
        out = CliRunner().invoke(main, ["run", "--resume", run_id, "--db", str(db)])
        assert out.exit_code == 2, out.output
        assert row_of(db, run_id) == before  # refused before the run row changed
        return out.output.strip().splitlines()[-1]

    header, entry = good.split(b"\n")[:2]
    changed = entry.replace(b'"text":"', b'"text":"x', 1)
    assert "line 2's signature does not verify" in refusal(header + b"\n" + changed + b"\n")
    assert "is empty or has no complete header" in refusal(b"")
    other = json.loads(header)
    other["header"]["db_uuid"] = "0" * 32
    assert "belongs to another DB" in refusal(json.dumps(other).encode() + b"\n" + entry + b"\n")
    moved = json.loads(header)
    moved["header"]["run_id"] = "someone-else"
    assert f"is not the journal of run {run_id}" in refusal(json.dumps(moved).encode() + b"\n")
    path.write_bytes(good)
    # the configuration changed under the journal: a different --batch-size forms other batches
    con = duckdb.connect(str(db))
    cfg = json.loads(con.execute("SELECT config FROM runs WHERE id = ?", [run_id]).fetchone()[0])
    con.execute("UPDATE runs SET config = ? WHERE id = ?", [json.dumps({**cfg, "batch_size": 3}), run_id])
    con.close()
    line = refusal(good)
    assert "what it ran with has changed (config.batch_size: 2 -> 3)" in line
    path.unlink()
    out = CliRunner().invoke(main, ["run", "--resume", run_id, "--db", str(db)])
    assert out.exit_code == 2 and f"run {run_id} has no journal" in out.output
    assert row_of(db, run_id) == before


def test_a_journal_line_cut_short_by_a_crash_is_dropped_and_run_again(tiny_model_dir, reference, tmp_path):
    ref_db, ref_id = reference
    db = tmp_path / "evalkit.duckdb"
    import shutil

    shutil.copy(ref_db, db)
    run_id, _ = killed_run(tiny_model_dir, db, "2")
    path = spool.spool_dir(db) / f"{run_id}{journal.SUFFIX}"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])  # the second batch's line lost its end (and its newline)
    resumed = api.resume(run_id, db=db)
    assert (resumed.replayed, resumed.computed) == (1, 2)
    for table in TABLES:
        assert differences(db, table, ref_id, run_id)[2] == []


def test_responses_round_trip_exactly():
    result = FirstStepResult(
        text="Paris.", first_token_id=7, first_token="Par", first_unit="P",
        topk=[(7, "Par", -0.1000000000000001), (9, " the", -2.5e-300)], entropy=float("nan"),
        metrics={"ft_hit": 1.0, "prior_drift": float("inf")}, answer_text=None, units={7: "P", 9: "t"},
        layers={"sink_rate": [0.5, 1 / 3]}, token_ids=[7, 12, 5],
    )
    back = journal.decode(json.loads(json.dumps(journal.encode(result))))
    assert back.topk == result.topk and back.units == result.units and back.layers == result.layers
    assert back.token_ids == result.token_ids
    assert repr(back) == repr(result)  # nan != nan, so compare the text


def test_a_run_kept_in_a_spool_file_resumes_by_coming_in(tiny_model_dir, tmp_path, monkeypatch):
    from evalkit.errors import ResultsKept
    from evalkit.store import runs

    db = tmp_path / "evalkit.duckdb"
    real = runs.finish_run
    monkeypatch.setattr(runs, "finish_run", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(ResultsKept) as kept:
        api.run("firsttoken_en,firsttoken_zh", "hf", db=db, model_args=f"pretrained={tiny_model_dir}",
                device="cpu", limit=LIMIT, batch_size=BATCH)
    run_id = str(kept.value).split()[1]
    monkeypatch.setattr(runs, "finish_run", real)
    assert spool.pending_ids(db) == {run_id}
    assert not list(spool.spool_dir(db).glob("*.journal"))  # the kept file holds the whole run
    result = CliRunner().invoke(main, ["run", "--resume", run_id, "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert f"run {run_id}: its kept results were brought in" in result.output
    assert status(db, run_id) == "done" and not spool.pending_ids(db)


def test_the_journal_goes_to_the_dbs_own_fallback_folder_when_the_spool_folder_cannot_be_made(
        tiny_model_dir, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    ref_db, ref_id = reference
    db = tmp_path / "evalkit.duckdb"
    import shutil

    shutil.copy(ref_db, db)
    spool.spool_dir(db).write_text("a file in the way")
    (tmp_path / "tmp").mkdir()
    run_id, proc = killed_run(tiny_model_dir, db, "1")
    con = duckdb.connect(str(db), read_only=True)
    ident = spool.identity(con)
    con.close()
    found = journal.find(db, ident, run_id)
    assert found is not None and found.parent == spool.fallback_dir(ident), found
    resumed = api.resume(run_id, db=db)
    assert (resumed.replayed, resumed.computed) == (1, 2)
    assert differences(db, "samples", ref_id, run_id)[2] == []


def test_resume_refuses_a_tokenizer_that_changed(tiny_model_dir, tmp_path):
    """The weights' hash does not cover a model folder's tokenizer files: the tokenizer the model loads
    with now must be the one the run started with, or rows tokenized two ways would make one run."""
    db = tmp_path / "evalkit.duckdb"
    run_id, _ = killed_run(tiny_model_dir, db, "1")
    con = duckdb.connect(str(db))
    started = con.execute("SELECT tokenizer_hash FROM runs WHERE id = ?", [run_id]).fetchone()[0]
    assert started  # the tiny model's tokenizer.json has an identity
    con.execute("UPDATE runs SET tokenizer_hash = 'sha256:0' WHERE id = ?", [run_id])
    con.close()
    before = row_of(db, run_id)
    out = CliRunner().invoke(main, ["run", "--resume", run_id, "--db", str(db)])
    assert out.exit_code == 2, out.output
    assert (f"run {run_id} cannot resume: its tokenizer has changed (tokenizer_hash sha256:0 at the start, "
            f"{started} now)") in out.output
    assert row_of(db, run_id) == before and journaled(db, run_id)[0] == 1
    con = duckdb.connect(str(db))
    con.execute("UPDATE runs SET tokenizer_hash = ? WHERE id = ?", [started, run_id])
    con.close()
    out = CliRunner().invoke(main, ["run", "--resume", run_id, "--db", str(db)])
    assert out.exit_code == 0 and status(db, run_id) == "done", out.output
