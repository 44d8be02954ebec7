"""`evalkit compare BASELINE CANDIDATE [CANDIDATE ...]`: first-token drift and metric deltas.

Two runs print as A and B; a baseline and several candidates (a quantization sweep)
print one drift table and one delta table with a row per candidate and task.
"""

from __future__ import annotations

import json

import click

from evalkit.cli.options import db_option, format_option
from evalkit.cli.output import render

DRIFT_COLUMNS = ["task", "n", "top5_mass_a", "top5_mass_b", "top5_overlap", "js_div", "flip_rate", "space"]
DELTA_COLUMNS = ["task", "metric", "n", "mean_a", "mean_b", "delta", "ci_lo", "ci_hi"]
SWEEP_DRIFT_COLUMNS = ["task", "run", "quant", "n", "top5_mass_base", "top5_mass", "top5_overlap", "js_div",
                       "flip_rate", "space"]
SWEEP_DELTA_COLUMNS = ["task", "metric", "run", "quant", "n", "mean_base", "mean", "delta", "ci_lo", "ci_hi"]


@click.command("compare")
@click.argument("runs", nargs=-1, required=True)
@db_option
@format_option
def compare_command(runs, db, fmt):
    """Compare each candidate run against the baseline (the first RUN) over the prompts they share.

    Prints the first-token drift per task (top-5 mass of each run, top-5 overlap,
    Jensen-Shannon divergence in bits, share of flipped top-1 tokens) and, for every
    per-sample metric, the paired delta candidate - baseline with a bootstrap 95% CI.
    Runs on one tokenizer compare tokens by id; runs on different tokenizers compare the
    first non-whitespace character each token adds (the `space` column says which;
    docs/metrics.md). Top-k lists of different K are cut to the shorter.
    With several candidates (e.g. a --quant sweep) both tables hold a row per candidate.
    RUN: id, unique prefix, latest, tag:NAME, or a run name.

    \b
    Examples:
      evalkit compare tag:prod latest
      evalkit compare 2506011200-ab12 2506011315-cd34 --format json
      evalkit compare sweep-bf16 sweep-int8-weight sweep-int4-weight
    """
    from evalkit.compare import compare_many
    from evalkit.errors import BadInput

    if len(runs) < 2:
        raise BadInput("compare needs a baseline and at least one candidate: evalkit compare BASELINE RUN [RUN ...]")
    m = compare_many(db, runs[0], list(runs[1:]))
    if len(m.comparisons) == 1:
        _two(m, fmt)
    else:
        _sweep(m, fmt)


def _two(m, fmt) -> None:
    from dataclasses import asdict

    c = m.comparisons[0]
    drift = [[getattr(r, k) for k in DRIFT_COLUMNS] for r in c.drift]
    deltas = [[d.task, d.metric, d.n, d.mean_a, d.mean_b, d.delta, d.lo, d.hi] for d in c.deltas]
    a, b = m.runs.get(c.run_a), m.runs.get(c.run_b)
    if fmt == "json":
        out = asdict(c)
        out["deltas"] = [dict(zip(DELTA_COLUMNS, row)) for row in deltas]
        out["quant_a"], out["quant_b"] = (a.quant if a else None), (b.quant if b else None)
        out["quant_detail_a"], out["quant_detail_b"] = (a.quant_detail if a else None), (b.quant_detail if b else None)
        out["tokenizer_a"] = {"hash": a.tokenizer_hash, "source": a.tokenizer_source} if a else None
        out["tokenizer_b"] = {"hash": b.tokenizer_hash, "source": b.tokenizer_source} if b else None
        out["degenerate_a"] = dict(a.degenerate) if a else {}
        out["degenerate_b"] = dict(b.degenerate) if b else {}
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
        click.echo("runs differ in: " + _differ(c.dimensions))
    click.echo(f"A tokenizer  {_tokenizer(a)}")
    click.echo(f"B tokenizer  {_tokenizer(b)}")
    if c.tokenizers:
        click.echo(f"tokenizers: {c.tokenizers}")
    if (a and a.quant) or (b and b.quant):
        click.echo(f"A quant  {a.quant_summary if a else '-'}")
        click.echo(f"B quant  {b.quant_summary if b else '-'}")
    _degenerate([("A", a), ("B", b)])
    click.echo()
    if c.drift:
        click.echo("first-token drift (A -> B)")
        click.echo(render(DRIFT_COLUMNS, drift, "table"))
    _bounds(c.drift)
    if c.drift_note:
        click.echo(c.drift_note)
    _by_position_table([c])
    click.echo()
    click.echo("metric deltas B - A (paired bootstrap 95% CI)")
    click.echo(render(DELTA_COLUMNS, deltas, "table"))
    _not_computed([c])


def _bounds(rows, run: str = "") -> None:
    """The bound a first-character comparison states: where js_div of the whole distributions lies."""
    for r in rows:
        if r.js_hi is not None:
            left = (f"; largest unresolved mass on one prompt {r.unresolved:.2g}" if r.unresolved is not None
                    else " (the stored top-k's undecided mass placed anywhere)")
            click.echo(f"{run}{r.task}: js_div {r.js_div:.4g}, of the whole first-character distributions within "
                       f"[{r.js_lo:.4g}, {r.js_hi:.4g}]{left}")


def _sweep(m, fmt) -> None:
    from dataclasses import asdict

    def quant(run_id):
        info = m.runs.get(run_id)
        return info.quant if info else None

    order = {c.run_b: i for i, c in enumerate(m.comparisons)}
    drift = sorted(([r.task, c.run_b, quant(c.run_b), r.n, r.top5_mass_a, r.top5_mass_b, r.top5_overlap, r.js_div,
                     r.flip_rate, r.space] for c in m.comparisons for r in c.drift),
                   key=lambda row: (row[0] == "all", row[0], order[row[1]]))
    deltas = sorted(([d.task, d.metric, c.run_b, quant(c.run_b), d.n, d.mean_a, d.mean_b, d.delta, d.lo, d.hi]
                     for c in m.comparisons for d in c.deltas),
                    key=lambda row: (row[0] == "all", row[0], _metric_rank(row[1]), order[row[2]]))
    if fmt == "json":
        out = {
            "baseline": m.baseline,
            "runs": {k: asdict(v) for k, v in m.runs.items()},
            "drift": [dict(zip(SWEEP_DRIFT_COLUMNS, row)) for row in drift],
            "deltas": [dict(zip(SWEEP_DELTA_COLUMNS, row)) for row in deltas],
            "notes": {c.run_b: c.drift_note for c in m.comparisons if c.drift_note},
            "n_shared": {c.run_b: c.n_shared for c in m.comparisons},
            "dimensions": {c.run_b: c.dimensions for c in m.comparisons},
            "by_position": {c.run_b: c.by_position for c in m.comparisons if c.by_position},
        }
        click.echo(json.dumps(out, ensure_ascii=False, indent=2, default=str))
        return
    if fmt == "csv":
        rows = [[r[0], f"drift:{k}", r[1], r[2], r[3], r[4] if k == "top5_mass" else None,
                 r[5] if k == "top5_mass" else None,
                 (r[5] - r[4]) if k == "top5_mass" else r[SWEEP_DRIFT_COLUMNS.index(k)], None, None]
                for r in drift for k in ("top5_mass", "top5_overlap", "js_div", "flip_rate")]
        click.echo(render(SWEEP_DELTA_COLUMNS, rows + deltas, "csv"))
        return
    base = m.runs.get(m.baseline)
    click.echo(f"baseline {m.baseline}  {base.quant_summary if base else ''}")
    for c in m.comparisons:
        info = m.runs.get(c.run_b)
        click.echo(f"run      {c.run_b}  {info.quant_summary if info else ''}  (shared prompts: {c.n_shared})")
        if c.tokenizers and not c.tokenizers.startswith("same tokenizer"):
            click.echo(f"         tokenizers: {c.tokenizers}")
        others = {k: v for k, v in c.dimensions.items() if k != "quant"}
        if others:
            click.echo(f"         differs from the baseline in: {_differ(others)}")
    _degenerate([(run_id, m.runs.get(run_id)) for run_id in [m.baseline, *(c.run_b for c in m.comparisons)]])
    click.echo()
    click.echo("first-token drift against the baseline, a row per run and task")
    click.echo(render(SWEEP_DRIFT_COLUMNS, drift, "table"))
    for c in m.comparisons:
        _bounds(c.drift, f"{c.run_b}: ")
        if c.drift_note:
            click.echo(f"{c.run_b}: {c.drift_note}")
    _by_position_table(m.comparisons)
    click.echo()
    click.echo("metric deltas run - baseline (paired bootstrap 95% CI)")
    click.echo(render(SWEEP_DELTA_COLUMNS, deltas, "table"))
    _not_computed(m.comparisons)


def _degenerate(named) -> None:
    """A note per compared run's task flagged as degenerate output (docs/metrics.md): its deltas are no
    improvement or regression of a model that answers, whatever their intervals say."""
    for who, info in named:
        for task, reason in (info.degenerate if info else ()):
            click.echo(f"note: {who} ({info.run_id}) is degenerate output on {task}: {reason}; "
                       "its deltas there rank nothing")


def _not_computed(comparisons) -> None:
    """One line per metric that has no delta because a run did not compute it (`evalkit run --metrics`)."""
    lines = dict.fromkeys(f"{metric}: not computed: {why}" for c in comparisons
                          for metric, why in c.not_computed.items())
    if lines:
        click.echo()
        click.echo("no delta (a run did not compute the metric):")
        for line in lines:
            click.echo(f"  {line}")


def _by_position_table(comparisons) -> None:
    """Drift by position (docs/drift.md) of each run that teacher-forced the baseline's responses."""
    rows = [[r["task"], c.run_b, r["bucket"], r["n"], r["kld_mean"], r["kld_unc"], r["same_top"], r["dp_rms"]]
            for c in comparisons for r in c.by_position]
    if not rows:
        return
    click.echo()
    click.echo("drift by position against the baseline: KL(baseline || run) in nats, teacher-forcing its responses")
    click.echo(render(["task", "run", "position", "n", "kld", "kld_unc", "same_top", "dp_rms"], rows, "table"))
    seen = set()
    for c in comparisons:
        for r in c.by_position:
            if r["drift_first_ratio"] is not None and (c.run_b, r["task"]) not in seen:
                seen.add((c.run_b, r["task"]))
                click.echo(f"{r['task']}  {c.run_b}  drift_first_ratio {r['drift_first_ratio']:.3f} "
                           f"[{r['ratio_lo']:.3f}, {r['ratio_hi']:.3f}]  (KLD at position 0 / at positions >= 1)")


def _differ(dimensions: dict[str, tuple]) -> str:
    """The run dimensions two runs differ in: "kv_cache full -> window:256; quant bf16 -> int8-weight"
    (a tokenizer hash by its first 12 digits)."""
    def show(k, v):
        return v[:12] if k == "tokenizer_hash" and isinstance(v, str) else v

    return "; ".join(f"{k} {show(k, x)} -> {show(k, y)}" for k, (x, y) in dimensions.items())


def _tokenizer(info) -> str:
    """A run's tokenizer identity as one line: its hash's first 12 digits and where it came from."""
    if info is None or info.tokenizer_hash is None:
        return "unknown (stored before tokenizer identities, or the engine gave none)"
    return f"{info.tokenizer_hash[:12]}  {info.tokenizer_source or ''}".rstrip()


def _metric_rank(metric: str) -> int:
    from evalkit.store.rows import SAMPLE_METRIC_COLUMNS

    cols = list(SAMPLE_METRIC_COLUMNS)
    return cols.index(metric) if metric in cols else len(cols)


COMMANDS = [compare_command]
