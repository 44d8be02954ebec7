"""Every environment variable is checked before any work (`evalkit.envvars`).

- Each record's bad values (abc, nan, inf, -1 where the kind refuses them; blanks for a
  path) make `evalkit run` exit 2 with one stderr line naming the variable, its value and
  what is accepted; an existing DB keeps every byte and a missing one is not created.
- A RANK or LOCAL_RANK above 0 outside a distributed launch is refused the same way; inside
  one, a non-zero rank says that rank 0 stores the run and never prints `done`.
- EVALKIT_DEBUG=0 is off; the Python API checks the environment before anything too.
- The registry names every variable the package reads, and docs/environment.md is its table.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from evalkit import envvars
from evalkit.errors import BadInput

ROOT = Path(__file__).resolve().parents[1]
FAKE_RUN = ["run", "--model", "evalkit-fake", "--model-args", "mode=hit", "--tasks", "firsttoken", "--limit", "2"]
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", *envvars.LAUNCH_MARKERS)

# kind -> values that kind refuses (a relative path such as "abc" names no file or folder here)
BAD_VALUES = {
    "seconds": ("abc", "nan", "inf", "-1"),
    "int": ("abc", "nan", "inf", "-1", "1.5"),
    "flag": ("abc", "nan", "inf", "-1"),
    "choice": ("abc", "nan", "inf", "-1"),
    "file": ("abc", "nan", "inf", "-1"),
    "folder": ("abc", "nan", "inf", "-1"),
    "path": ("  ",),
    "text": (),
    "secret": ("sk bad", "sk-é", "sk\x01"),  # spaces, non-ASCII, control characters: no header token
}
CASES = [(var.name, bad) for var in envvars.VARIABLES for bad in BAD_VALUES[var.kind]]


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """No launcher variable leaks in from the shell that runs the tests."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_rows(db: Path) -> list[tuple]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute("SELECT id, status FROM runs ORDER BY created_at").fetchall()
    finally:
        con.close()


def one_error_line(res, text: str) -> None:
    assert res.exit_code == 2, (res.exit_code, res.output)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("evalkit: error: ") and text in lines[0], lines[0]
    assert res.stdout == ""


@pytest.fixture(scope="module")
def stored_db(invoke, tmp_path_factory):
    """A DB holding one done fake-LM run."""
    db = tmp_path_factory.mktemp("envvars") / "stored.duckdb"
    res = invoke(*FAKE_RUN, "--db", db)
    assert res.exit_code == 0, res.output
    return db


def test_every_kind_has_bad_values_and_every_record_is_whole():
    assert set(BAD_VALUES) == set(envvars.KINDS)
    for var in envvars.VARIABLES:
        assert var.meaning.strip() and var.meaning.endswith("."), var.name
        assert (var.kind == "choice") == bool(var.choices), var.name
        assert var.kind in ("seconds", "int") or (var.low is None and var.high is None), var.name
        if var.default is not None:
            var.parse(var.default)  # every default is a value its own kind accepts
    assert len(envvars.VARS) == len(envvars.VARIABLES)


@pytest.mark.parametrize("name,value", CASES, ids=[f"{n}={v.strip() or 'blank'}" for n, v in CASES])
def test_a_bad_value_is_one_line_before_any_work(invoke, name, value, stored_db, tmp_path):
    db, fresh = tmp_path / "copy.duckdb", tmp_path / "fresh.duckdb"
    shutil.copy(stored_db, db)
    before = digest(db)
    for target in (db, fresh):
        res = invoke(*FAKE_RUN, "--db", target, env={name: value})
        if envvars.VARS[name].kind == "secret":  # named, never shown
            one_error_line(res, f"{name} is set to a value evalkit cannot send: expected {envvars.VARS[name].accepted}")
            assert value not in res.output
        else:
            one_error_line(res, f"{name}={value!r}: expected {envvars.VARS[name].accepted}")
    assert digest(db) == before
    assert not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.duckdb"]


@pytest.mark.parametrize("name,value", [("EVALKIT_LOCK_TIMEOUT", "nan"), ("EVALKIT_HEARTBEAT_S", "abc"),
                                        ("RANK", "abc"), ("EVALKIT_DEBUG", "maybe")])
def test_read_only_commands_check_the_environment_too(invoke, name, value, stored_db):
    before = digest(stored_db)
    for args in (["runs"], ["query", "SELECT 1"], ["gate", "--candidate", "latest", "--baseline", "latest"]):
        one_error_line(invoke(*args, "--db", stored_db, env={name: value}), f"{name}={value!r}: expected ")
    assert digest(stored_db) == before


def test_values_in_range_and_empty_values_are_taken(monkeypatch, tmp_path):
    assert envvars.lock_timeout() == 120 and envvars.heartbeat_s() == 60 and envvars.debug() is False
    assert envvars.rank() == 0 and envvars.world_size() == 1
    monkeypatch.setenv("EVALKIT_LOCK_TIMEOUT", " 0.5 ")
    monkeypatch.setenv("EVALKIT_HEARTBEAT_S", "0")
    monkeypatch.setenv("EVALKIT_DEBUG", "")  # empty: unset
    assert envvars.lock_timeout() == 0.5 and envvars.heartbeat_s() == 0 and envvars.debug() is False
    monkeypatch.setenv("EVALKIT_HEARTBEAT_S", "300.5")
    with pytest.raises(BadInput, match=r"^EVALKIT_HEARTBEAT_S='300.5': expected a finite number of seconds >= 0 "
                                       r"and <= 300$"):
        envvars.check_environment()
    monkeypatch.setenv("EVALKIT_HEARTBEAT_S", "")
    monkeypatch.setenv("EVALKIT_QUERY_TIMEOUT", "0")  # a timeout of 0 would stop every query
    with pytest.raises(BadInput, match=r"^EVALKIT_QUERY_TIMEOUT='0': expected a finite number of seconds > 0$"):
        envvars.check_environment()
    monkeypatch.setenv("EVALKIT_QUERY_TIMEOUT", "0.01")
    envvars.check_environment()
    monkeypatch.setenv("EVALKIT_DB", str(tmp_path / "x.duckdb"))
    assert envvars.db() == tmp_path / "x.duckdb"
    monkeypatch.setenv("EVALKIT_DB", "")
    assert envvars.db() == envvars.DEFAULT_DB


def test_the_cache_getter_keeps_its_spellings(monkeypatch, tmp_path):
    monkeypatch.delenv("EVALKIT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert envvars.cache() == tmp_path / "evalkit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert envvars.cache() == Path.home() / ".cache" / "evalkit"
    for off in ("none", "OFF", "0"):
        monkeypatch.setenv("EVALKIT_CACHE", off)
        assert envvars.cache() is None
    monkeypatch.setenv("EVALKIT_CACHE", "~/models")
    assert envvars.cache() == Path.home() / "models"


def test_defaults_kept_elsewhere_agree_with_the_registry():
    from evalkit.store.sandbox import DEFAULT_TIMEOUT

    assert float(envvars.VARS["EVALKIT_QUERY_TIMEOUT"].default) == DEFAULT_TIMEOUT


def test_the_heartbeat_bound_keeps_a_live_run_from_looking_abandoned():
    from evalkit.store.rows import STALE_AFTER

    # one skipped beat (a busy DB) and the next one still lands before readers call the run abandoned
    assert 2 * envvars.HEARTBEAT_MAX_S <= STALE_AFTER.total_seconds()
    assert envvars.VARS["EVALKIT_HEARTBEAT_S"].high == envvars.HEARTBEAT_MAX_S


# ------------------------------------------------------------------------ ranks


def test_a_rank_left_over_in_the_shell_is_refused(invoke, stored_db, tmp_path):
    db, fresh = tmp_path / "copy.duckdb", tmp_path / "fresh.duckdb"
    shutil.copy(stored_db, db)
    before = run_rows(db)
    res = invoke(*FAKE_RUN, "--db", db, env={"RANK": "1"})
    one_error_line(res, "RANK=1 is set but this is not a distributed launch (WORLD_SIZE unset): unset RANK")
    for env, why in (({"LOCAL_RANK": "1"}, "LOCAL_RANK=1 is set but this is not a distributed launch"),
                     ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "(WORLD_SIZE=2 is not above it)"),
                     ({"RANK": "1", "WORLD_SIZE": "2"}, "(none of MASTER_ADDR, TORCHELASTIC_RUN_ID is set)")):
        for target in (db, fresh):
            one_error_line(invoke(*FAKE_RUN, "--db", target, env=env), why)
    assert run_rows(db) == before
    assert not fresh.exists()


def test_a_non_zero_rank_of_a_launch_says_rank_zero_stores_the_run(invoke, tmp_path):
    db = tmp_path / "launch.duckdb"
    launch = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RUN_ID": "t1"}
    res = invoke(*FAKE_RUN, "--db", db, env={**launch, "RANK": "1", "LOCAL_RANK": "1"})
    assert res.exit_code == 0, res.output
    assert "not stored: this is rank 1 of 2; rank 0 stores the run" in res.stdout
    assert "done" not in res.stdout and "started" not in res.stderr
    assert not re.search(r"^run ", res.stdout, re.M)  # no run id that names nothing stored
    assert not db.exists()
    res = invoke(*FAKE_RUN, "--db", db, env={**launch, "RANK": "0", "LOCAL_RANK": "0"})
    assert res.exit_code == 0, res.output
    run_id = re.search(r"^run (\S+)\s+done", res.stdout, re.M).group(1)
    assert run_rows(db) == [(run_id, "done")]


def test_rank_is_rank_then_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert envvars.rank() == 2
    monkeypatch.setenv("RANK", "5")
    assert envvars.rank() == 5
    monkeypatch.setenv("RANK", "")  # empty: unset
    assert envvars.rank() == 2


# ------------------------------------------------------------------------ debug


@pytest.mark.parametrize("value,on", [("0", False), ("false", False), ("No", False), ("off", False), ("", False),
                                      ("1", True), ("TRUE", True), ("yes", True), (" on ", True)])
def test_debug_spellings(value, on, monkeypatch):
    from evalkit.cli import _debug_env

    monkeypatch.setenv("EVALKIT_DEBUG", value)
    assert envvars.debug() is on
    assert _debug_env() is on


def test_debug_zero_is_off(invoke, tmp_path):
    missing = tmp_path / "missing.duckdb"
    one_error_line(invoke("runs", "--db", missing, env={"EVALKIT_DEBUG": "0"}), "no evalkit database")
    with pytest.raises(BadInput, match="no evalkit database"):  # on: the traceback, not one line
        invoke("runs", "--db", missing, env={"EVALKIT_DEBUG": "1"})


def test_a_bad_debug_value_is_one_line_from_the_console_entry_point(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "EVALKIT_DB": str(tmp_path / "x.duckdb"), "EVALKIT_DEBUG": "maybe"}
    out = subprocess.run([sys.executable, "-m", "evalkit", "runs"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == ["evalkit: error: EVALKIT_DEBUG='maybe': expected one of "
                                       "1/0, true/false, yes/no, on/off"]
    assert not (tmp_path / "x.duckdb").exists()


# ------------------------------------------------------------------------ the Python API


def test_the_api_checks_the_environment_first(monkeypatch, stored_db, tmp_path):
    import evalkit

    db = tmp_path / "api.duckdb"
    monkeypatch.setenv("EVALKIT_LOCK_TIMEOUT", "nan")
    calls = (lambda: evalkit.run("firsttoken", "evalkit-fake", limit=2, db=db),
             lambda: evalkit.run_all("firsttoken", "evalkit-fake", limit=2, db=db),
             lambda: evalkit.connect(stored_db),
             lambda: evalkit.gate("latest", "latest", db=stored_db))
    for call in calls:
        with pytest.raises(BadInput, match=r"^EVALKIT_LOCK_TIMEOUT='nan': expected a finite number of seconds >= 0$"):
            call()
    monkeypatch.delenv("EVALKIT_LOCK_TIMEOUT")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(BadInput, match="RANK=1 is set but this is not a distributed launch"):
        evalkit.run("firsttoken", "evalkit-fake", limit=2, db=db)
    assert not db.exists()


# ------------------------------------------------------------------------ the registry is whole

# a read of one named variable: os.environ.get("X"), os.environ["X"], os.getenv("X"), click's envvar="X"
NAMED_READ = re.compile(r"""os\.environ\.get\(\s*["'](\w+)["']|os\.environ\[\s*["'](\w+)["']\s*\]"""
                        r"""|os\.getenv\(\s*["'](\w+)["']|envvar\s*=\s*["'](\w+)["']""")
# anything that reads the environment (os.environ.setdefault only writes)
ANY_READ = re.compile(r"\benviron\b(?!\.setdefault)|\bgetenv\(|\benvvar\s*=")


def environment_reads() -> dict[str, list[str]]:
    """variable -> the places in the package that read it by name."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "evalkit").rglob("*.py")):
        if path.name == "envvars.py":
            continue
        text = path.read_text(encoding="utf-8")
        for hit in ANY_READ.finditer(text):
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, hit.start()) + 1}"
            named = NAMED_READ.match(text, hit.start() - (3 if text[hit.start() - 3:hit.start()] == "os." else 0))
            assert named, f"{where} reads the environment by other means than a name; read it through evalkit.envvars"
            found.setdefault(next(g for g in named.groups() if g), []).append(where)
    return found


def test_the_registry_names_every_variable_the_package_reads():
    reads = environment_reads()
    assert {"EVALKIT_DB", "EVALKIT_FORMAT"} <= set(reads)  # the grep sees them
    missing = {name: where for name, where in reads.items() if name not in envvars.VARS}
    assert not missing, f"environment variables read without a record in evalkit/envvars.py: {missing}"


def test_docs_list_every_record():
    text = (ROOT / "docs" / "environment.md").read_text(encoding="utf-8")
    assert envvars.doc_table() in text, "docs/environment.md is out of date: paste `python -m evalkit.envvars`"
    for var in envvars.VARIABLES:
        assert f"| `{var.name}` |" in text
