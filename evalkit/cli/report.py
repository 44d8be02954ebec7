"""`evalkit report`: a static HTML + markdown report with PNG plots of stored runs."""

from __future__ import annotations

import click

from evalkit.cli.options import db_option, whole


@click.command("report")
@click.option("--runs", "runs", multiple=True, metavar="RUN[,RUN...]",
              help="Runs to report on (repeatable or comma list; id, prefix, latest, tag:NAME, run name). "
                   "Default: the newest done runs, at most 12.")
@click.option("--out", default="reports", show_default=True, type=click.Path(file_okay=False),
              help="Folder for index.html, summary.md and the PNG plots.")
@click.option("--prompts", type=whole(0), default=4, show_default=True,
              help="First-token prompts to chart (those where the runs disagree most).")
@db_option
def report_command(runs, out, prompts, db):
    """Write a static report (index.html, summary.md, PNG plots) that opens offline.

    Sections: the runs, a leaderboard with 95 % CIs, first-token distributions
    side by side, needle heatmaps and a metric trend for the model with the most
    runs. A section without data is left out with a one-line reason.

    \b
    Examples:
      evalkit report
      evalkit report --runs tag:prod,latest --out reports/compare
      evalkit report --runs 2612021005 --runs 2612021107 --prompts 6
    """
    from evalkit.report.build import build_report

    report = build_report(db, runs, out, prompts)
    for path in report.files:
        click.echo(str(path))


COMMANDS = [report_command]
