"""`evalkit needle-heatmap RUN`: the depth × length recall heatmap and curve of a run."""

from __future__ import annotations

import click

from evalkit.cli.options import db_option


@click.command("needle-heatmap")
@click.argument("run", default="latest")
@click.option("--out", type=click.Path(file_okay=False), default="reports", show_default=True,
              help="Folder for the PNG files.")
@db_option
def needle_heatmap_command(run, out, db):
    """Plot needle recall over depth × length (hint and no hint side by side).

    \b
    Examples:
      evalkit run --tasks needle --needle-lengths 256,512
      evalkit needle-heatmap latest --out reports/
    """
    from evalkit.errors import BadInput
    from evalkit.paths import check_output_dir
    from evalkit.report.needle_plot import heatmap, recall_by_depth_plot
    from evalkit.store.db import db_path
    from evalkit.store.queries import needle_cells

    check_output_dir(out, "--out", protect=[db_path(db)])
    run_id, rows = needle_cells(db, run)
    if not rows:
        raise BadInput(f"run {run_id} has no needle samples (run it with --tasks needle)")
    names = [f"needle_heatmap_{run_id}.png", f"needle_by_depth_{run_id}.png"]
    out = check_output_dir(out, "--out", names, protect=[db_path(db)])
    files = [
        heatmap(rows, out / names[0], title=f"needle recall · run {run_id}"),
        recall_by_depth_plot(rows, out / names[1]),
    ]
    for f in files:
        click.echo(str(f))


COMMANDS = [needle_heatmap_command]
