"""The report's "Promotions and gates" section: each tag's history and the recent gate decisions.

Owns: reading the `tags` history and the newest `gates` rows (`read_promotions`, on the report's
read-only connection, through `store.promotions`) and laying them out (`promotions_section`):
one table of promotions per tag, the run each tag names now in bold, and one table of gate
decisions, newest first. Does not: decide, promote, or render (`report.rendering`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from evalkit.report.sections import Section, Table, plural
from evalkit.store.promotions import recent_gates, tag_history

KEY = "promotions"  # the section's anchor: index.html#promotions
TITLE = "Promotions and gates"
MAX_GATES = 20  # gate decisions shown, newest first
MAX_PROMOTIONS = 20  # rows per tag, newest kept


@dataclass
class Promotions:
    tags: list[dict[str, Any]] = field(default_factory=list)  # store.promotions.tag_history rows
    gates: list[dict[str, Any]] = field(default_factory=list)  # store.promotions.recent_gates rows


def read_promotions(con) -> Promotions:
    return Promotions(tag_history(con), recent_gates(con, MAX_GATES))


def _when(value) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else ""


def promotions_section(data: Promotions) -> Section:
    section = Section(KEY, TITLE)
    if not data.tags and not data.gates:
        section.omitted = ("no run was promoted (evalkit promote RUN --tag NAME) and no gate decision was "
                           "recorded (evalkit gate)")
        return section
    section.intro = ("Each promotion, oldest first: tag:NAME is the run promoted to NAME most recently (in "
                     "bold), so promoting an earlier run again rolls the tag back. Below, the gate decisions "
                     "evalkit gate recorded, newest first (table gates, and each check in table gate_checks).")
    by_tag: dict[str, list[dict[str, Any]]] = {}
    for row in data.tags:
        by_tag.setdefault(row["tag"], []).append(row)
    for tag, rows in by_tag.items():
        shown = rows[-MAX_PROMOTIONS:]
        table = Table(["promoted (UTC)", "run", "name", "model", "quant"], [], caption=f"tag:{tag}")
        for i, r in enumerate(shown):
            table.rows.append([_when(r["promoted_at"]), r["run_id"], r["name"] or "", r["model"] or "",
                               r["quant"] or ""])
            if r["current"]:
                table.strong.add((i, 1))
        if len(rows) > len(shown):
            table.caption += f" (the newest {len(shown)} of {len(rows)} promotions)"
        section.tables.append(table)
    if data.gates:
        gates = Table(["decided (UTC)", "verdict", "candidate", "baseline", "rules", "gate", "pass", "fail",
                       "inconclusive", "skipped"], [], caption="gate decisions, newest first", numeric_from=6)
        for i, g in enumerate(data.gates):
            baseline = g["baseline"] + (f" ({g['baseline_ref']})" if g["baseline_ref"] not in (None, g["baseline"])
                                        else "")
            gates.rows.append([_when(g["created_at"]), g["verdict"], g["candidate"], baseline,
                               f"{g['rules_name']} · {g['rules_digest']}", g["id"], str(g["n_pass"]),
                               str(g["n_fail"]), str(g["n_inconclusive"]), str(g["n_skipped"])])
            if g["verdict"] != "pass":
                gates.strong.add((i, 1))
        section.tables.append(gates)
        if len(data.gates) == MAX_GATES:
            section.notes.append(f"The newest {plural(MAX_GATES, 'decision')}; every one is in the gates table.")
    else:
        section.notes.append("No gate decision recorded yet (evalkit gate records each one unless --no-record).")
    return section
