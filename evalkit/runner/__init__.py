"""One evaluation run: its configuration, its order of work, and turning lm-eval's results into rows.

Owns: `config` (RunConfig and every check that needs no model), `checks` (those that
need the loaded model), `execute` (the order of a run and its endings), `liveness`
(heartbeat and signals) and `collect` (lm-eval's results dict to metric, sample and
top-k rows). Does not: parse the command line or compute metric values.
"""
