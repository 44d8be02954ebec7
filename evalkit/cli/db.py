"""`evalkit migrate` (upgrade an older DB's schema) and `evalkit ingest` (bring in kept runs)."""

from __future__ import annotations

import click

from evalkit.cli.options import db_option


@click.command("migrate")
@db_option
def migrate_command(db):
    """Upgrade the DB's schema to this evalkit's (read-only commands never do it themselves).

    \b
    Examples:
      evalkit migrate
      evalkit migrate --db old-runs.duckdb
    """
    from evalkit.errors import BadInput
    from evalkit.store.db import db_path, file_state, open_writer

    path = db_path(db)
    state = file_state(path)
    if state.kind == "missing":
        raise BadInput(f"no evalkit database at {path}")
    pending = state.pending if state.kind in ("evalkit", "empty") else []
    with open_writer(path):  # refuses a foreign file; applies what is pending
        pass
    click.echo(f"{path}: applied {len(pending)} schema upgrade(s): {', '.join(pending)}" if pending
               else f"{path}: schema already up to date")


@click.command("ingest")
@click.argument("paths", nargs=-1, type=click.Path(dir_okay=False))
@db_option
def ingest_command(paths, db):
    """Bring into the DB the finished runs kept in spool files (all pending ones, or PATHS).

    A run whose results the DB could not take when it finished (a reader holding the
    file's lock past the timeout, a full disk) is kept in a file beside the DB,
    `<db>.spool/<run id>.duckdb`; the next write brings it in, or this command.

    \b
    Examples:
      evalkit ingest
      evalkit ingest reports/evalkit.duckdb.spool/2612021005-ab12cd.duckdb
    """
    from evalkit.store.spool import ingest

    ids = ingest(db, paths)
    click.echo(f"ingested {len(ids)} run(s)" + (f": {', '.join(ids)}" if ids else ""))


COMMANDS = [migrate_command, ingest_command]
