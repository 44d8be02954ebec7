"""Fuzz: every numeric option of the CLI, as the user types it (any text: huge, negative, NaN, inf,
hex, full-width digits, padded), through the real command in-process (click's CliRunner).

Each case ends in exit 0 or in exit 2 with one `evalkit: error:` line and the DB folder keeping its
bytes; a numeric option is never an internal error. A valid value runs the command for real (the fake
LM for `run`); commands that would load a model (`drift-corpus`) are given a corpus that does not
exist, so that a valid number ends in that one line instead."""

from __future__ import annotations

import re
import shutil

import pytest
from click.testing import CliRunner
from hypothesis import given, reject
from hypothesis import strategies as st

from evalkit.cli import cli
from tests.fuzz import fingerprint, fuzz

EDGES = ["0", "-1", "1", "2", "7", "50", "2147483648", "9223372036854775807", "9223372036854775808",
         "18446744073709551616", "-9223372036854775809", "1e3", "1.5", "nan", "inf", "-inf", "0x10", " 5", "５", "",
         "1_000", "+3", "-0", "1e309", "0.0", "1e-300"]
numbers = st.one_of(st.sampled_from(EDGES), st.integers(-2**70, 2**70).map(str),
                    st.floats(allow_nan=True, allow_infinity=True).map(repr), st.text(max_size=6))


@pytest.fixture(scope="module")
def seeded(tmp_path_factory, fake_run):
    """A DB holding two fake runs, copied fresh for each case."""
    db = tmp_path_factory.mktemp("seed") / "seed.duckdb"
    fake_run(db, limit=1)
    fake_run(db, limit=1, mode="opener")
    return db


def _invoke(seeded, tmp_path_factory, args_of):
    folder = tmp_path_factory.mktemp("case")
    db = folder / "dbs" / "evalkit.duckdb"
    db.parent.mkdir()
    shutil.copyfile(seeded, db)
    args = args_of(db, folder)
    read_only = args[0] != "run"
    before = fingerprint(db.parent)
    res = CliRunner().invoke(cli, args, catch_exceptions=False, env={"EVALKIT_DB": str(db), "HF_HUB_OFFLINE": "1"})
    errors = [line for line in res.stderr.splitlines() if line.startswith("evalkit: error: ")]
    assert res.exit_code in (0, 2), f"{args}: exit {res.exit_code}: {res.stderr[-500:]}"
    if res.exit_code == 2:
        assert len(errors) == 1 and "Traceback" not in res.stderr, f"{args}: {res.stderr[-800:]}"
        assert fingerprint(db.parent) == before, f"{args}: the DB folder changed on a refusal"
    elif read_only:
        assert fingerprint(db.parent) == before, f"{args}: a read-only command changed the DB folder"
    return res


def _beyond_int64(value: str) -> bool:
    try:
        return int(value) >= 2**63
    except ValueError:
        return False


def test_finding_runs_limit_beyond_int64(seeded, tmp_path_factory):
    _invoke(seeded, tmp_path_factory, lambda db, _: ["runs", "--limit", "9223372036854775808", "--db", str(db)])


@fuzz(40)
@given(value=numbers)
def test_runs_limit(seeded, tmp_path_factory, value):
    if _beyond_int64(value):
        reject()  # the known finding above
    res = _invoke(seeded, tmp_path_factory, lambda db, _: ["runs", "--limit", value, "--db", str(db)])
    if res.exit_code == 0:
        assert int(value) >= 1


@fuzz(40)
@given(value=numbers)
def test_query_timeout(seeded, tmp_path_factory, value):
    _invoke(seeded, tmp_path_factory, lambda db, _: ["query", "SELECT count(*) FROM runs", "--timeout", value,
                                                     "--db", str(db)])


@fuzz(15, deadline_s=30)
@given(value=numbers)
def test_report_prompts(seeded, tmp_path_factory, value):
    _invoke(seeded, tmp_path_factory, lambda db, folder: ["report", "--prompts", value, "--out",
                                                          str(folder / "out"), "--db", str(db)])


@fuzz(30)
@given(option=st.sampled_from(["--n-ctx", "--chunks", "--batch-size"]), value=numbers)
def test_drift_corpus_numbers(seeded, tmp_path_factory, option, value):
    res = _invoke(seeded, tmp_path_factory, lambda db, folder: [
        "drift-corpus", str(folder / "no-such-corpus.txt"), "--quant", "none,int8-weight", option, value])
    assert res.exit_code == 2


@fuzz(20, deadline_s=60)
@given(option=st.sampled_from(["--limit", "--seed", "--batch-size", "--top-k", "--temperature",
                               "--first-temperature"]), value=numbers)
def test_run_numbers(seeded, tmp_path_factory, option, value):
    """A run of the fake LM with one numeric option set; a refused value leaves the DB as it was."""
    if option == "--limit" and re.fullmatch(r"\s*\+?\d+\s*", value) and int(value) > 4:
        value = "4"  # a valid limit runs for real: keep it short
    _invoke(seeded, tmp_path_factory, lambda db, _: ["run", "--model", "evalkit-fake", "--model-args", "mode=hit",
                                                     "--tasks", "firsttoken_en", "--limit", "2", option, value,
                                                     "--db", str(db)])
