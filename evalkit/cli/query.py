"""`evalkit query "SQL"`: read-only SQL on the DB."""

from __future__ import annotations

import click

from evalkit.cli.options import db_option, format_option
from evalkit.cli.output import render


@click.command("query")
@click.argument("sql")
@db_option
@format_option
def query_command(sql, db, fmt):
    """Run read-only SQL (SELECT, DESCRIBE, SHOW ...) on the DB; writes are refused.

    \b
    Examples:
      evalkit query "SELECT template, task, metric, round(value, 3) AS v FROM leaderboard WHERE metric = 'ft_hit'"
      evalkit query "SELECT * FROM needle_heatmap" --format csv
    """
    from evalkit.store import read_query

    cols, rows = read_query(db, sql)
    click.echo(render(cols, rows, fmt))


COMMANDS = [query_command]
