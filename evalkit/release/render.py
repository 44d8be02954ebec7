"""The gate's verdict as a person or a CI reads it: a markdown table and JUnit XML.

Owns: `to_markdown` (the header line and one table row per check; also what goes to
$GITHUB_STEP_SUMMARY) and `to_junit` (one test case per check). Does not: decide.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from evalkit.release.decide import Verdict, VerdictRow, fmt


def _limit_text(row: VerdictRow) -> str:
    if row.limit is None:
        return ""
    if row.kind == "threshold":
        return f"{row.op} {fmt(row.limit)}"
    return f"{'drop' if row.higher_is_better else 'increase'} ≤ {fmt(row.limit)}"


def _delta_text(row: VerdictRow) -> str:
    if row.delta is None:
        return ""
    text = f"{row.delta + 0.0:+.4g}"
    if row.ci is not None:
        text += f" [{fmt(row.ci[0])}, {fmt(row.ci[1])}]"
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(verdict: Verdict, candidate_id: str, baseline_id: str | None = None) -> str:
    """The verdict as a header line (PASS / FAIL) and one markdown table row per check."""
    word = "PASS" if verdict.passed else "FAIL"
    against = f" vs baseline `{baseline_id}`" if baseline_id else ""
    lines = [
        f"## evalkit gate: {word} — candidate `{candidate_id}`{against}",
        "",
        f"{len(verdict.rows)} checks: {verdict.count('pass')} pass, "
        f"{verdict.count('fail')} fail, {verdict.count('skipped')} skipped.",
        "",
        "| status | kind | task | metric | candidate | baseline | limit | Δ [CI] | n | reason |",
        "|---|---|---|---|---:|---:|---|---|---:|---|",
    ]
    for r in verdict.rows:
        status = {"pass": "pass", "fail": "**FAIL**", "skipped": "skipped"}[r.status]
        cells = [
            status,
            r.kind,
            r.task or "*",
            r.metric,
            fmt(r.observed),
            fmt(r.baseline),
            _limit_text(r),
            _delta_text(r),
            "" if r.n is None else str(r.n),
            r.reason,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def to_junit(verdict: Verdict, candidate_id: str, baseline_id: str | None = None) -> str:
    """The verdict as JUnit XML: one testsuite "evalkit-gate", one testcase per row."""
    suite = ET.Element(
        "testsuite",
        {
            "name": "evalkit-gate",
            "tests": str(len(verdict.rows)),
            "failures": str(verdict.count("fail")),
            "errors": "0",
            "skipped": str(verdict.count("skipped")),
            "time": "0",
        },
    )
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", {"name": "candidate", "value": candidate_id})
    if baseline_id:
        ET.SubElement(props, "property", {"name": "baseline", "value": baseline_id})
    for r in verdict.rows:
        case = ET.SubElement(
            suite,
            "testcase",
            {"classname": f"evalkit.gate.{r.kind}", "name": r.name, "time": "0"},
        )
        if r.status == "fail":
            failure = ET.SubElement(case, "failure", {"message": r.reason, "type": r.kind})
            failure.text = r.reason
        elif r.status == "skipped":
            ET.SubElement(case, "skipped", {"message": r.reason})
        else:
            out = ET.SubElement(case, "system-out")
            out.text = r.reason
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"
