"""Static reports of stored runs: sections read from the DB with SQL, PNG plots, HTML and markdown.

Owns, one module per step: `build` (the entry point `build_report`, the order of the
sections, the files written), `reading` (which runs, the SQL behind every section, the
run labels and trend key), `sections` (the shape of a section, and the runs, leaderboard,
first-token, lead and trend sections), `needle_sections` (needle recall, attention,
conflicts), `rendering` (HTML and markdown), and `plots` / `needle_plot` (matplotlib
figures). Does not: compute metrics or write the DB.
"""
