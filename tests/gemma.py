"""The second real model of the tests: Google's Gemma-3-270M (base, Q4_K_M GGUF, 262k vocabulary,
declares a BOS, no chat template).

Owns: where the file is (EVALKIT_TEST_GEMMA, default ~/.cache/evalkit-test/gemma/gemma-3-270m-q4_k_m.gguf,
which `scripts/test-deps.sh` assembles from its four PyPI part packages and checks against its
sha256), and `missing()`, the reason a test skips with when it cannot be had.
Does not: download anything (tests skip without it, saying why).
"""

from __future__ import annotations

import os
from pathlib import Path

GEMMA_ENV = "EVALKIT_TEST_GEMMA"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
SIZE = 253_113_024


def gemma_path() -> Path:
    return Path(os.environ.get(GEMMA_ENV) or Path.home() / ".cache" / "evalkit-test" / "gemma" / GGUF_NAME)


def missing() -> str | None:
    """Why Gemma-3-270M cannot be had here (None when it can)."""
    path = gemma_path()
    if not path.is_file():
        return f"Gemma-3-270M is not at {path} ({GEMMA_ENV}); `bash scripts/test-deps.sh` fetches it"
    if path.stat().st_size != SIZE:
        return f"{path} is {path.stat().st_size} bytes, not Gemma-3-270M's {SIZE}"
    return None
