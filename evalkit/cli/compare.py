"""`evalkit compare RUN_A RUN_B`: first-token drift and metric deltas between two runs."""

from __future__ import annotations

import json

import click

from evalkit.cli.options import db_option, format_option
from evalkit.cli.output import render

DRIFT_COLUMNS = ["task", "n", "top5_mass_a", "top5_mass_b", "top5_overlap", "js_div", "flip_rate"]
DELTA_COLUMNS = ["task", "metric", "n", "mean_a", "mean_b", "delta", "ci_lo", "ci_hi"]


@click.command("compare")
@click.argument("run_a")
@click.argument("run_b")
@db_option
@format_option
def compare_command(run_a, run_b, db, fmt):
    """Compare RUN_B against RUN_A over the prompts both share (same task and doc id).

    Prints the first-token drift per task (top-5 mass of each run, top-5 overlap,
    Jensen-Shannon divergence in bits, share of flipped top-1 tokens) and, for every
    per-sample metric, the paired delta B - A with a bootstrap 95% CI.
    RUN: id, unique prefix, latest, tag:NAME, or a run name.

    \b
    Examples:
      evalkit compare tag:prod latest
      evalkit compare 2506011200-ab12 2506011315-cd34 --format json
    """
    from dataclasses import asdict

    from evalkit.compare import compare_runs

    c = compare_runs(db, run_a, run_b)
    drift = [[getattr(r, k) for k in DRIFT_COLUMNS] for r in c.drift]
    deltas = [[d.task, d.metric, d.n, d.mean_a, d.mean_b, d.delta, d.lo, d.hi] for d in c.deltas]
    if fmt == "json":
        out = asdict(c)
        out["deltas"] = [dict(zip(DELTA_COLUMNS, row)) for row in deltas]
        click.echo(json.dumps(out, ensure_ascii=False, indent=2))
        return
    if fmt == "csv":
        # one table: the drift as metrics named "drift:...", then the deltas
        rows = []
        for r in c.drift:
            rows.append([r.task, "drift:top5_mass", r.n, r.top5_mass_a, r.top5_mass_b,
                         r.top5_mass_b - r.top5_mass_a, None, None])
            rows += [[r.task, f"drift:{k}", r.n, None, None, getattr(r, k), None, None]
                     for k in ("top5_overlap", "js_div", "flip_rate")]
        click.echo(render(DELTA_COLUMNS, rows + deltas, "csv"))
        return
    click.echo(f"A = {c.run_a}   B = {c.run_b}   shared prompts: {c.n_shared}")
    if c.dimensions:
        click.echo("runs differ in: " + "; ".join(f"{k} {a} -> {b}" for k, (a, b) in c.dimensions.items()))
    click.echo()
    if c.drift:
        click.echo("first-token drift (A -> B)")
        click.echo(render(DRIFT_COLUMNS, drift, "table"))
    if c.drift_note:
        click.echo(c.drift_note)
    click.echo()
    click.echo("metric deltas B - A (paired bootstrap 95% CI)")
    click.echo(render(DELTA_COLUMNS, deltas, "table"))


COMMANDS = [compare_command]
