"""`evalkit tags [NAME]`: each tag's promotions, oldest first, and the run it names now."""

from __future__ import annotations

import click

from evalkit.cli.options import db_option, format_option
from evalkit.cli.output import render


@click.command("tags")
@click.argument("name", required=False)
@db_option
@format_option
def tags_command(name, db, fmt):
    """Each tag's history: every promotion, oldest first; `current` marks the run `tag:NAME` names
    (the one promoted to it most recently); `dangling` marks a promotion whose run is gone from the DB
    (deleted by another DuckDB client: `tag:NAME` is then refused). Only reads the DB.

    \b
    Examples:
      evalkit tags
      evalkit tags prod --format csv
    """
    from evalkit.store.promotions import read_tag_history

    rows = read_tag_history(db, name)
    cols = ["tag", "promoted_at", "run_id", "name", "model", "quant", "current", "dangling"]
    shown = [[r[c] if c not in ("current", "dangling") else
              ("*" if c == "current" and r[c] else "run gone" if c == "dangling" and r[c] else "") for c in cols]
             if fmt == "table" else [r[c] for c in cols] for r in rows]
    if not rows:
        click.echo("no tags yet (evalkit promote RUN --tag NAME)", err=True)
        return
    click.echo(render(cols, shown, fmt))


COMMANDS = [tags_command]
