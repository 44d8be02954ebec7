"""evalkit: first-token, opener and needle metrics on lm-eval, stored in DuckDB.

The Python API — `evalkit.run`, `evalkit.connect`, `evalkit.promote`, `evalkit.gate` — lives in `evalkit.api`
and is imported on first use, so `import evalkit` (and `evalkit --help`) stays light.
"""

from evalkit.version import __version__

__all__ = ["__version__", "connect", "gate", "promote", "resume", "run", "run_all"]


def __getattr__(name: str):
    if name in ("run", "run_all", "resume", "connect", "gate", "promote", "Run"):
        from evalkit import api

        return getattr(api, name)
    raise AttributeError(f"module 'evalkit' has no attribute {name!r}")
