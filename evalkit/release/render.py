"""The gate's verdict as a person or a CI reads it: a markdown table and JUnit XML.

Owns: `to_markdown` (the outcome line, one table row per check and the line that states
how the outcome was reached; also what goes to $GITHUB_STEP_SUMMARY) and `to_junit` (one
test case per check, in three states). Does not: decide.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from evalkit.release.decide import Verdict, VerdictRow, fmt
from evalkit.textsafe import md_cell, md_row, md_text, xml_clean


_STATUS_CELL = {"pass": "pass", "fail": "**FAIL**", "inconclusive": "*inconclusive*", "skipped": "skipped"}
_OUTCOME_WORD = {"pass": "PASS", "fail": "FAIL", "inconclusive": "INCONCLUSIVE"}


def _limit_text(row: VerdictRow) -> str:
    if row.kind == "threshold":
        return "" if row.limit is None else f"{row.op} {fmt(row.limit)}"
    word = "drop" if row.higher_is_better else "increase"
    if row.margin is None:
        return ""
    if row.limit is not None and "%" in row.margin:
        return f"{word} < {fmt(row.limit)} ({row.margin})"
    return f"{word} < {row.margin}"


def _estimate_text(row: VerdictRow) -> str:
    est = row.drop if row.kind == "regression" else (row.observed if row.ci else None)
    if est is None:
        return ""
    text = f"{est + 0.0:.4g}"
    if row.ci is not None:
        text += f" [{fmt(row.ci[0])}, {fmt(row.ci[1])}]"
    return text


def counts_line(verdict: Verdict) -> str:
    """'11 checks: 1 pass, 1 fail, 8 inconclusive, 1 skipped.'"""
    parts = [f"{verdict.count(s)} {s}" for s in ("pass", "fail", "inconclusive", "skipped")]
    return f"{len(verdict.rows)} checks: {', '.join(parts)}."


def to_markdown(verdict: Verdict, candidate_id: str, baseline_id: str | None = None,
                head: list[str] | None = None) -> str:
    """The verdict as a header line (PASS / FAIL / INCONCLUSIVE), the `head` lines (which rules, which
    question they answer) and one markdown table row per check."""
    word = _OUTCOME_WORD[verdict.outcome]
    against = f" vs baseline {md_text(baseline_id)}" if baseline_id else ""
    lines = [
        f"## evalkit gate: {word} — candidate {md_text(candidate_id)}{against}",
        "",
        *(f"{line}\n" for line in head or ()),
        counts_line(verdict),
        "",
        "| status | kind | task | metric | candidate | baseline | limit | estimate [95 % CI] | n | reason |",
        "|---|---|---|---|---:|---:|---|---|---:|---|",
    ]
    for r in verdict.rows:
        cells = [
            r.kind,
            r.task or "*",
            r.metric,
            fmt(r.observed),
            fmt(r.baseline),
            _limit_text(r),
            _estimate_text(r),
            "" if r.n is None else str(r.n),
            r.reason,
        ]
        lines.append(md_row([_STATUS_CELL[r.status], *(md_cell(c) for c in cells)]))  # data as inert text
    lines += ["", md_text(verdict.summary)]
    return "\n".join(lines) + "\n"


def to_junit(verdict: Verdict, candidate_id: str, baseline_id: str | None = None, rules: str | None = None) -> str:
    """The verdict as JUnit XML: one testsuite "evalkit-gate", one testcase per row.

    A failed check is a ``<failure>``, an inconclusive one an ``<error type="inconclusive">``
    (neither passed nor shown to fail), a skipped one ``<skipped>``; the gate's outcome is
    the suite's ``outcome`` property.
    """
    suite = ET.Element(
        "testsuite",
        {
            "name": "evalkit-gate",
            "tests": str(len(verdict.rows)),
            "failures": str(verdict.count("fail")),
            "errors": str(verdict.count("inconclusive")),
            "skipped": str(verdict.count("skipped")),
            "time": "0",
        },
    )
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", {"name": "candidate", "value": candidate_id})
    if baseline_id:
        ET.SubElement(props, "property", {"name": "baseline", "value": baseline_id})
    ET.SubElement(props, "property", {"name": "outcome", "value": verdict.outcome})
    if rules:
        ET.SubElement(props, "property", {"name": "rules", "value": rules})
    for r in verdict.rows:
        case = ET.SubElement(
            suite,
            "testcase",
            {"classname": f"evalkit.gate.{r.kind}", "name": r.name, "time": "0"},
        )
        if r.status == "fail":
            failure = ET.SubElement(case, "failure", {"message": r.reason, "type": r.kind})
            failure.text = r.reason
        elif r.status == "inconclusive":
            error = ET.SubElement(case, "error", {"message": r.reason, "type": "inconclusive"})
            error.text = r.reason
        elif r.status == "skipped":
            ET.SubElement(case, "skipped", {"message": r.reason})
        else:
            out = ET.SubElement(case, "system-out")
            out.text = r.reason
    xml_clean(suite)  # names, reasons and ids as text XML 1.0 allows
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"
