"""Shared fixtures: a tmp DB for every test, the tiny random Llama, a fake lm-eval LM."""

from __future__ import annotations

import pytest

from tests.fake_lm import register_fake_lm

register_fake_lm()


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
