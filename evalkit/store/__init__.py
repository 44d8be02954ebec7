"""The DuckDB file: opening it, its schema, the rows evalkit writes and the questions it asks.

Owns: connecting and migrating (`db`), the append-only schema (`migrations`),
read-side queries (`queries`) and Parquet export and merged read-only SQL
(`export`). Does not: compute metrics or format output.
"""
