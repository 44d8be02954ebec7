"""`evalkit export --parquet DIR`: every table of the DB as Parquet files, to carry between machines."""

from __future__ import annotations

import click

from evalkit.cli.options import db_option


@click.command("export")
@click.option("--parquet", "out_dir", required=True, type=click.Path(),
              help="Folder to write <table>.parquet into (created if missing; an earlier export is replaced whole).")
@db_option
def export_command(out_dir, db):
    """Write runs, metrics, samples, first_token_topk and tags as DIR/<table>.parquet (read-only on the DB).

    All or nothing: the files are written into a new folder beside DIR that then takes
    DIR's place, so an interrupted export leaves the previous one as it was. DIR may
    hold nothing but an earlier export.

    \b
    Examples:
      evalkit export --parquet exports/gpu-box
      evalkit query --parquet exports/gpu-box --db reports/evalkit.duckdb "SELECT host, count(*) FROM runs GROUP BY host"
    """
    from evalkit.store.export import export_parquet

    for table, n, path in export_parquet(db, out_dir):
        click.echo(f"{table:<17} {n:>9} rows  {path}")


COMMANDS = [export_command]
