"""Scoring: the metric registry and the pure functions behind every metric.

Owns: `registry` (each metric's name, level, direction, aggregation and meaning:
the single source the gate, the report, the samples columns and `evalkit metrics`
read), text matching (`text`), the opener lexicon (`lexicon`), the first-token and
needle metrics, and the statistics (`stats`). Does not: run models or touch the DB.
"""
