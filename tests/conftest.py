"""Shared fixtures: a tmp DB for every test, the tiny random Llama, a fake lm-eval LM."""

from __future__ import annotations

import pytest

from tests.fake_lm import register_fake_lm

register_fake_lm()


@pytest.fixture(autouse=True)
def env_setup(tmp_path, monkeypatch):
    """Every test gets its own DB file and no hub access."""
    monkeypatch.setenv("EVALKIT_DB", str(tmp_path / "evalkit.duckdb"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("EVALKIT_TEMPLATES", raising=False)
    monkeypatch.delenv("EVALKIT_OPENERS", raising=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def default_model_available():
    from evalkit.backends.models import default_model_dir
    from evalkit.errors import BadInput

    try:
        default_model_dir()
    except BadInput as exc:
        pytest.skip(str(exc))
