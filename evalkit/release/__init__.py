"""The release gate: rules, the pure decision, its renderings, and promotion tags.

Owns: the rules file (`rules`), the decision (`decide`), its statistics (`paired`: one
test per check, Holm over them), the markdown and JUnit forms
(`render`), and the DB side — reading two runs, promoting a run (`db`). Does not: print
or pick exit codes (the CLI does). (`evalkit.gate(...)` is the Python API's entry point
to it, see `evalkit.api`.)
"""
