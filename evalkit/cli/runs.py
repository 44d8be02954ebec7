"""`evalkit runs` and `evalkit show RUN`: what is stored."""

from __future__ import annotations

import click

from evalkit.cli.options import db_option, format_option, whole
from evalkit.cli.output import lead_table, metric_table, next_steps, render


@click.command("runs")
@click.option("--limit", type=whole(1), default=50, show_default=True, help="Newest N runs.")
@db_option
@format_option
def runs_command(limit, db, fmt):
    """List runs, newest first.

    \b
    Examples:
      evalkit runs
      evalkit runs --format csv --limit 5
    """
    from evalkit.store.db import db_path
    from evalkit.store.queries import list_runs
    from evalkit.store.spool import pending_files

    cols, rows = list_runs(db, limit)
    click.echo(render(cols, rows, fmt))
    waiting = pending_files(db_path(db))
    if waiting:
        click.echo(f"{len(waiting)} finished run(s) wait in {waiting[0].parent}: the next write brings them in, "
                   "or `evalkit ingest` now", err=True)


@click.command("show")
@click.argument("run")
@db_option
@format_option
def show_command(run, db, fmt):
    """One run's settings and metrics. RUN: id, unique prefix, latest, tag:NAME, or a run name.

    \b
    Examples:
      evalkit show latest
      evalkit show tag:prod --format json
    """
    from evalkit.store.queries import lead_rows, run_summary
    from evalkit.textsafe import term_line

    info, cols, rows = run_summary(db, run)
    if fmt != "table":
        click.echo(render(cols, rows, fmt))
        return
    for k, v in info.items():
        click.echo(f"{k:>22}: {'' if v is None else term_line(v)}")  # a name or a model arg stays text
    click.echo()
    if rows:
        click.echo(metric_table([dict(zip(cols, r)) for r in rows]))
    _, lead = lead_rows(db, info["id"])
    if lead:
        click.echo()
        click.echo(lead_table(lead))
    if rows:
        click.echo(next_steps(info["id"]))


COMMANDS = [runs_command, show_command]
