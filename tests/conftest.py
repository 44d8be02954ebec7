"""Shared fixtures: a tmp DB for every test, the tiny random Llama, the model zoo on real tokenizers, a fake
lm-eval LM, the CLI in-process."""

from __future__ import annotations

import os
import re

# torch's OpenMP threads wait passively in the tests and their children, whatever the machine's load:
# evalkit would choose so itself on a busy machine and say so on stderr (evalkit/threads.py), and a
# test's stderr must not depend on the load (tests/test_threads.py unsets it to test that rule)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from click.testing import CliRunner

from tests.fake_lm import register_fake_lm

register_fake_lm()


@pytest.fixture(scope="session", autouse=True)
def children_end_with_the_session():
    """No child process outlives the test run: what is still running when the session ends (also
    when it is stopped with Ctrl-C) is ended (tests/children.py; the children die with pytest
    anyway, should it be killed outright)."""
    yield
    from tests.children import end_children

    end_children()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """One converted-model cache for the session, never the user's own (~/.cache/evalkit)."""
    return tmp_path_factory.mktemp("evalkit-cache")


@pytest.fixture(autouse=True)
def env_setup(tmp_path, monkeypatch, model_cache):
    """Every test gets its own DB file, the session's model cache and no hub access."""
    monkeypatch.setenv("EVALKIT_DB", str(tmp_path / "evalkit.duckdb"))
    monkeypatch.setenv("EVALKIT_CACHE", str(model_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("EVALKIT_TEMPLATES", raising=False)
    monkeypatch.delenv("EVALKIT_OPENERS", raising=False)


@pytest.fixture(autouse=True)
def secrets_forgotten():
    """The secrets a test registered (`evalkit.redact` keeps one list for the process, as a run does)
    end with the test, so a key one test sets ("other") never blanks another test's text."""
    yield
    from evalkit import redact

    redact.forget_all()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def default_model_available():
    from evalkit.engines.plan import default_model_dir
    from evalkit.errors import BadInput

    try:
        default_model_dir()
    except BadInput as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def invoke():
    """`invoke("runs", "--db", db, env=None)`: the evalkit CLI in-process (click's CliRunner), every
    argument as text, exceptions not caught so a real bug shows its traceback."""
    from evalkit.cli import cli

    def run_cli(*args, env=None):
        return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False, env=env)

    return run_cli


@pytest.fixture(scope="session")
def fake_run(invoke):
    """`fake_run(db, mode="hit", name=None, limit=2)`: one `evalkit run` of the fake LM ("evalkit-fake",
    tests/fake_lm.py) on the firsttoken tasks, stored in `db`; returns its run id. Session-scoped, so a
    module's stored runs can be made once (before the per-test environment: hence no hub here)."""

    def run(db, mode="hit", name=None, limit=2):
        res = invoke("run", "--model", "evalkit-fake", "--model-args", f"mode={mode}", "--tasks", "firsttoken",
                     "--limit", limit, *(["--name", name] if name else []), "--db", db, env={"HF_HUB_OFFLINE": "1"})
        assert res.exit_code == 0, res.output
        return re.search(r"^run (\S+)\s+done", res.stdout, re.MULTILINE).group(1)

    return run


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    """`zoo(family)`: that family's tiny peaked model and its permuted-id twin (tests/zoo.py), built
    once per session on first use; skips, saying why, when its vocabulary GGUF is not there."""
    from tests import zoo as zoo_module

    root = tmp_path_factory.mktemp("zoo")
    built: dict = {}

    def pair(family: str):
        reason = zoo_module.missing(family)
        if reason:
            pytest.skip(reason)
        if family not in built:
            built[family] = zoo_module.build_pair(family, root)
        return built[family]

    return pair
