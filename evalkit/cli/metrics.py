"""`evalkit metrics`: what each number means (the metric registry)."""

from __future__ import annotations

import json

import click

from evalkit.cli.options import format_option
from evalkit.cli.output import render


@click.command("metrics")
@format_option
def metrics_command(fmt):
    """List every metric evalkit reports: name, level, direction, unit and meaning.

    ↑ higher is better, ↓ lower is better, – descriptive (no better direction;
    the gate and the report use the same directions). A name ending in {D} or {L} stands for a family, e.g.
    needle_recall@depth0.5.

    \b
    Examples:
      evalkit metrics
      evalkit metrics --format json
    """
    from evalkit.scoring import registry

    metrics = registry.all_metrics()
    if fmt == "json":
        click.echo(json.dumps([m.to_dict() for m in metrics], ensure_ascii=False, indent=2))
        return
    cols = ["metric", "level", "better", "unit", "per sample", "meaning"]
    rows = [[m.name, m.level, f"{m.arrow} {m.direction}", m.unit,
             "yes" if m.per_sample else "", m.meaning] for m in metrics]
    click.echo(render(cols, rows, fmt, max_width=200))


COMMANDS = [metrics_command]
