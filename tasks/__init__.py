"""evalkit's lm-eval tasks (YAML, data and their `utils.py` hooks).

Kept at the top of the repository so that `lm_eval --include_path tasks` works from a
checkout; installed inside the package as `evalkit.tasks` (`evalkit tasks-path` prints
where). lm-eval reads the YAML files itself; this file only makes the folder a package.
"""
