"""Options shared by several commands, each with its EVALKIT_* environment variable."""

from __future__ import annotations

import click

db_option = click.option(
    "--db",
    envvar="EVALKIT_DB",
    type=click.Path(dir_okay=False),
    default=None,
    help="DuckDB file [env EVALKIT_DB; default reports/evalkit.duckdb].",
)

format_option = click.option(
    "--format",
    "fmt",
    envvar="EVALKIT_FORMAT",
    type=click.Choice(["table", "csv", "json"]),
    default="table",
    show_default=True,
    help="Output format [env EVALKIT_FORMAT].",
)
