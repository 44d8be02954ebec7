"""Static reports of stored runs: sections read from the DB with SQL, PNG plots, HTML and markdown.

Owns: `build` (which runs, the SQL behind each section, HTML and markdown),
`plots` and `needle_plot` (matplotlib figures). Does not: compute metrics or write the DB.
"""
