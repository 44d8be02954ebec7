"""`evalkit query "SQL"`: read-only SQL on the DB, or on several DBs and Parquet exports at once."""

from __future__ import annotations

import click

from evalkit.cli.options import format_option
from evalkit.cli.output import render


@click.command("query")
@click.argument("sql")
@click.option("--db", "dbs", multiple=True, envvar="EVALKIT_DB", type=click.Path(dir_okay=False),
              help="DuckDB file; repeat to query several at once [env EVALKIT_DB; default reports/evalkit.duckdb].")
@click.option("--parquet", "parquet_dirs", multiple=True, type=click.Path(),
              help="A folder written by `evalkit export --parquet`; repeatable. With it, only --db given here count.")
@click.option("--timeout", type=float, default=None, envvar="EVALKIT_QUERY_TIMEOUT",
              help="Stop the SQL after this many seconds, exit 2 [env EVALKIT_QUERY_TIMEOUT; default 300].")
@format_option
@click.pass_context
def query_command(ctx, sql, dbs, parquet_dirs, timeout, fmt):
    """Run read-only SQL (SELECT, DESCRIBE, SHOW ...) on the DB; writes are refused.

    Several sources (--db more than once, or --parquet) are unioned table by
    table: `runs` holds the runs of every machine. Each source counts once: one
    named twice (also as ./x or through a symlink) is refused.

    The SQL stops after --timeout seconds (exit 2) or at Ctrl-C (exit 130), and
    the DB's lock is released at once.

    \b
    Examples:
      evalkit query "SELECT template, task, metric, round(value, 3) AS v FROM leaderboard WHERE metric = 'ft_hit'"
      evalkit query "SELECT * FROM needle_heatmap" --format csv
      evalkit query --timeout 30 "SELECT task, count(*) FROM samples GROUP BY task"
      evalkit query --db a.duckdb --db b.duckdb --parquet exports/gpu-box "SELECT host, count(*) FROM runs GROUP BY host"
    """
    from evalkit.store.sandbox import DEFAULT_TIMEOUT, merged_query

    if parquet_dirs and ctx.get_parameter_source("dbs") is not click.core.ParameterSource.COMMANDLINE:
        dbs = ()  # $EVALKIT_DB does not join exports unasked
    cols, rows = merged_query(dbs, parquet_dirs, sql, DEFAULT_TIMEOUT if timeout is None else timeout)
    click.echo(render(cols, rows, fmt))


COMMANDS = [query_command]
