"""evalkit: first-token, opener and needle metrics on lm-eval, stored in DuckDB."""

__version__ = "0.1.0"
