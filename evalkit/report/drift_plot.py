"""The report's figure of drift by position (docs/drift.md): KL(base ‖ run) and same-top share at each
response position, one line per run (variant), KLD on a log axis, with 95 % intervals over prompts.

Owns: averaging per-prompt rows per (run, position), their intervals (`stats.interval`: bootstrap
percentile for the KLD, Wilson for the same-top share), drawing with matplotlib's Agg backend, and
`drift_figure(con, run_ids, out)`, the report's hook: reads the runs' `drift` rows and writes the
PNG (None when none of the runs has any). Does not: compute drift (`scoring.drift`) or write HTML.

A row is a dict ``{"label", "position", "kld", "same_top"}``: one prompt at one position of one run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from evalkit.report.plots import save_figure

KLD_FLOOR = 1e-6  # a mean KLD of 0 (a run against itself) is drawn here on the log axis
MAX_POSITION = 48  # positions past this (few prompts) are not drawn


def position_series(rows: Iterable[dict]) -> dict[str, list[dict]]:
    """label -> [{"position", "n", "kld", "kld_lo", "kld_hi", "same_top", "top_lo", "top_hi"}] by position.

    Intervals are None where a position has fewer than two prompts.
    """
    from evalkit.scoring.stats import interval

    cells: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        cells[(str(r["label"]), int(r["position"]))].append((float(r["kld"]), 1.0 if r["same_top"] else 0.0))
    if not cells:
        raise ValueError("no drift rows to plot")
    out: dict[str, list[dict]] = defaultdict(list)
    for (label, pos), vals in sorted(cells.items()):
        klds, tops = [v[0] for v in vals], [v[1] for v in vals]
        k_ci, t_ci = interval(klds, binary=False), interval(tops, binary=True)
        out[label].append({"position": pos, "n": len(vals), "kld": sum(klds) / len(klds),
                           "kld_lo": k_ci[0] if k_ci else None, "kld_hi": k_ci[1] if k_ci else None,
                           "same_top": sum(tops) / len(tops), "top_lo": t_ci[0] if t_ci else None,
                           "top_hi": t_ci[1] if t_ci else None})
    return dict(out)


def drift_plot(rows: Iterable[dict], path: str | Path, title: str | None = None,
               max_position: int = MAX_POSITION) -> Path:
    """Write the two-panel PNG (KLD by position, log y; same-top share by position); return its path."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    series = position_series(rows)
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    ax_k, ax_t = fig.subplots(1, 2)
    for label, pts in series.items():
        pts = [p for p in pts if p["position"] <= max_position]
        if not pts:
            continue
        x = [p["position"] for p in pts]
        y = [max(p["kld"], KLD_FLOOR) for p in pts]
        line = ax_k.plot(x, y, marker="o", ms=3, label=label)[0]
        ci = [(p["position"], max(p["kld_lo"], KLD_FLOOR), max(p["kld_hi"], KLD_FLOOR)) for p in pts
              if p["kld_lo"] is not None]
        if ci:
            ax_k.fill_between([c[0] for c in ci], [c[1] for c in ci], [c[2] for c in ci], alpha=0.15,
                              color=line.get_color(), linewidth=0)
        ax_t.plot(x, [p["same_top"] for p in pts], marker="o", ms=3, label=label, color=line.get_color())
        ci = [(p["position"], p["top_lo"], p["top_hi"]) for p in pts if p["top_lo"] is not None]
        if ci:
            ax_t.fill_between([c[0] for c in ci], [c[1] for c in ci], [c[2] for c in ci], alpha=0.15,
                              color=line.get_color(), linewidth=0)
    ax_k.set_yscale("log")
    ax_k.set_xlabel("response position (0 = first token)")
    ax_k.set_ylabel("KL(base || run), nats")
    ax_k.set_title("KL divergence by position")
    ax_k.grid(alpha=0.3, which="both")
    ax_t.set_ylim(-0.02, 1.02)
    ax_t.set_xlabel("response position (0 = first token)")
    ax_t.set_ylabel("same top-1 as the base")
    ax_t.set_title("same top by position")
    ax_t.grid(alpha=0.3)
    ax_t.legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    return save_figure(fig, path)


def drift_rows(con, run_ids: Sequence[str]) -> list[dict]:
    """The `drift` rows of these runs, labelled by the run's quant (name, else id, when quants repeat)."""
    rows = con.execute(
        """
        SELECT d.run_id, coalesce(r.quant, 'as loaded'), r.name, r.template, d.position, d.kld, d.same_top
        FROM drift d JOIN runs r ON r.id = d.run_id
        WHERE d.run_id IN (SELECT unnest(?))
        ORDER BY d.run_id, d.position
        """, [list(run_ids)]).fetchall()
    quants: dict[str, set[str]] = defaultdict(set)
    for run_id, quant, *_ in rows:
        quants[quant].add(run_id)
    out = []
    for run_id, quant, name, template, pos, kld, top in rows:
        label = quant if len(quants[quant]) == 1 else (name or f"{quant} {run_id}")
        out.append({"label": label, "position": pos, "kld": kld, "same_top": top})
    return out


def drift_figure(con, run_ids: Sequence[str], out: str | Path, name: str = "drift_by_position.png") -> Path | None:
    """The report's hook: the figure of these runs' drift by position, written to `out/name`; None when
    none of them teacher-forced a base (no `drift` rows, or a DB from before m019)."""
    has = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'drift' AND "
                      "database_name = current_database()").fetchone()[0]
    if not has:
        return None
    rows = drift_rows(con, run_ids)
    if not rows:
        return None
    return drift_plot(rows, Path(out) / name, title="drift by position against the base run")
