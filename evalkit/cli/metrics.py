"""`evalkit metrics`: what each number means (the metric registry)."""

from __future__ import annotations

import json

import click

from evalkit.cli.options import format_option
from evalkit.cli.output import render


@click.command("metrics")
@click.option("--margins", is_flag=True, help="List only the metrics with a default gate margin, and why each.")
@format_option
def metrics_command(margins, fmt):
    """List every metric evalkit reports: name, level, direction, unit, gate margin and meaning.

    ↑ higher is better, ↓ lower is better, – descriptive (no better direction;
    the gate and the report use the same directions). A name ending in {D} or {L} stands for a family, e.g.
    needle_recall@depth0.5. The margin is how much worse a candidate may be than its baseline
    under the gate's default rules (and a rules file's `default`); * marks the headline
    metrics the default rules check.

    \b
    Examples:
      evalkit metrics
      evalkit metrics --margins
      evalkit metrics --format json
    """
    from evalkit.scoring import registry

    metrics = registry.all_metrics()
    if margins:
        metrics = tuple(m for m in metrics if m.margin)
    if fmt == "json":
        click.echo(json.dumps([m.to_dict() for m in metrics], ensure_ascii=False, indent=2))
        return

    def margin(m) -> str:
        if not m.margin:
            return ""
        return f"{m.margin}{' *' if m.name in registry.HEADLINE_METRICS else ''}"

    if margins:
        cols = ["metric", "better", "margin", "why"]
        rows = [[m.name, f"{m.arrow} {m.direction}", margin(m), m.margin.why] for m in metrics]
    else:
        cols = ["metric", "level", "better", "unit", "per sample", "margin", "meaning"]
        rows = [[m.name, m.level, f"{m.arrow} {m.direction}", m.unit,
                 "yes" if m.per_sample else "", margin(m), m.meaning] for m in metrics]
    click.echo(render(cols, rows, fmt, max_width=200))


COMMANDS = [metrics_command]
