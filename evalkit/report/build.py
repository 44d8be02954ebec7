"""Static reports of stored runs: ``index.html``, ``summary.md`` and PNG plots next to them.

Owns: the entry point `build_report` — read (`report.reading`), build each section
(`report.sections`, `report.needle_sections`), draw the figures the sections asked for,
render (`report.rendering`) and write — the order of the sections, and the files a
report may write into ``--out``. A section without data is left out with a one-line
reason. Does not: compute metrics or statistics, draw (``evalkit.report.plots``,
``evalkit.report.needle_plot``), print, or write to the DB (it opens it read-only and
closes it before plotting).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from evalkit.errors import BadInput
from evalkit.paths import check_output_dir, write_file
from evalkit.report.needle_sections import (
    MAX_ATTENTION_PLOTS,
    MAX_HEATMAPS,
    attention_section,
    conflict_section,
    needle_section,
)
from evalkit.report.promotion_section import promotions_section, read_promotions
from evalkit.report.reading import read_report
from evalkit.report.rendering import to_html, to_markdown
from evalkit.report.sections import (
    Image,
    MAX_ROC_RUNS,
    Section,
    first_token_section,
    lead_section,
    leaderboard_section,
    runs_section,
    trend_section,
)
from evalkit.store.db import db_path, open_reader

MAX_PROMPTS = 50  # --prompts: first-token prompts charted
# every file a report may write into --out
DRIFT_PNG = "drift_by_position.png"
REPORT_FILES = ("index.html", "summary.md", "leaderboard.png", "first_token.png", "trend.png", "reliability.png",
                "sink.png", *(f"roc_{k + 1}.png" for k in range(MAX_ROC_RUNS)),
                *(f"needle_{k + 1}.png" for k in range(MAX_HEATMAPS)), "needle_kv_cache.png",
                "needle_kv_cache_depth.png", *(f"needle_attn_{k + 1}.png" for k in range(MAX_ATTENTION_PLOTS)),
                DRIFT_PNG)


@dataclass
class Report:
    out_dir: Path
    files: list[Path]  # everything written, index.html first
    sections: list[Section]
    run_ids: list[str]


def parse_run_refs(values: Iterable[str] | None) -> list[str]:
    """Run references from repeated and/or comma-separated --runs values.

    >>> parse_run_refs(["a,b", " c ", ""])
    ['a', 'b', 'c']
    """
    refs: list[str] = []
    for value in values or ():
        refs.extend(part.strip() for part in value.split(",") if part.strip())
    return refs


def _drift_rows(con, run_ids: list[str]) -> list[dict]:
    """The drift-by-position rows of these runs ([] for a DB from before m019, or runs without drift)."""
    from evalkit.report.drift_plot import drift_rows

    has = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'drift' AND "
                      "database_name = current_database()").fetchone()[0]
    return drift_rows(con, run_ids) if has and run_ids else []


def drift_section(rows: list[dict], out_dir: Path) -> Section:
    """KL divergence and same top by response position, one line per variant (docs/drift.md)."""
    section = Section("drift", "Drift by response position")
    if not rows:
        section.omitted = "no run here teacher-forced a base run's responses (evalkit run --drift makes them)"
        return section
    from evalkit.report.drift_plot import drift_plot

    section.intro = ("Each variant teacher-forced its base run's greedy responses; KL(base ‖ variant) in nats "
                     "and the share of positions with the same top token, by position in the response "
                     "(0 = the first token). See docs/drift.md.")
    section.images.append(Image(DRIFT_PNG, "drift by position", lambda: drift_plot(
        rows, out_dir / DRIFT_PNG, title="drift by position against the base run")))
    return section


def build_report(db=None, runs: Iterable[str] | None = None, out: str | Path = "reports",
                 prompts: int = 4) -> Report:
    """Write the report of ``runs`` (default: the newest done runs, at most `reading.MAX_DEFAULT_RUNS`) into ``out``.

    Raises BadInput for an unknown run, a DB without finished runs (when no runs
    are named), a negative ``prompts``, or an ``out`` that is a file.
    """
    if isinstance(prompts, bool) or not 0 <= prompts <= MAX_PROMPTS:
        raise BadInput(f"--prompts must be a whole number from 0 to {MAX_PROMPTS}, got {prompts}")
    out_dir = check_output_dir(out, "--out", REPORT_FILES, protect=[db_path(db)])
    refs = parse_run_refs(runs)
    with open_reader(db) as con:
        data = read_report(con, refs, prompts)
        drift = _drift_rows(con, [r["id"] for r in data.runs])
        promotions = read_promotions(con)
    data.db = str(db_path(db))
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"cannot create the report folder {out_dir}: {exc.strerror or exc}") from None

    sections = [
        runs_section(data),
        promotions_section(promotions),
        leaderboard_section(data, out_dir),
        first_token_section(data, out_dir, prompts),
        lead_section(data, out_dir),
        needle_section(data, out_dir),
        attention_section(data, out_dir),
        conflict_section(data),
        trend_section(data, out_dir),
        drift_section(drift, out_dir),
    ]
    from evalkit.report.plots import render

    render([image.draw for s in sections for image in s.images])  # the figures, several at a time
    images = [out_dir / image.name for s in sections for image in s.images]
    index = write_file(out_dir / "index.html", to_html(data, sections), "report file")
    summary = write_file(out_dir / "summary.md", to_markdown(data, sections), "report file")
    return Report(out_dir=out_dir, files=[index, summary, *images], sections=sections,
                  run_ids=[r["id"] for r in data.runs])
