"""evalkit's version: in the run row (`runs.config`), `evalkit --version`, `evalkit.__version__`.

A module of its own so the layers below the package root (the runner) can read it without
importing the root, which imports the Python API above them."""

__version__ = "0.1.0"
