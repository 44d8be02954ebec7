"""The release gate: rules, the pure decision, its renderings, and promotion tags.

Owns: the rules file and `decide` (`rules`), and the DB side — reading two runs,
promoting a run (`db`). Does not: print or pick exit codes (the CLI does).
"""
