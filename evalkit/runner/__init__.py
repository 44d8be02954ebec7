"""One evaluation run: its configuration, its order of work, and turning lm-eval's results into rows.

Owns: `execute` (validate, record, evaluate through lm-eval, store) and `collect`
(lm-eval's results dict to metric, sample and top-k rows). Does not: parse the
command line or compute metric values.
"""
