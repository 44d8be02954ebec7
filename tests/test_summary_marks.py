"""summary.md and the step summary as a user reads them in a terminal, grep and GitHub's view.

The rules: `report.fonts.isolate` marks a text with U+2068/U+2069 only where it holds right-to-left
characters (every report section goes through it); `cli.gate._record`'s step-summary line says where
the report is instead of a relative link, dead in GitHub's summary view.
"""

from __future__ import annotations

import unicodedata

import pytest

from evalkit.report.fonts import FSI, PDI, isolate


@pytest.mark.parametrize("text", ["' Paris'", "递", "42", "Ж", "' '", "é"])
def test_text_without_rtl_is_left_unmarked(text):
    assert isolate(text) == text


@pytest.mark.parametrize("text", ["ל", "' שלום'", "مرحبا", "a\u05d0"])
def test_rtl_text_is_isolated(text):
    assert any(unicodedata.bidirectional(c) in ("R", "AL") for c in text)  # independent of has_rtl
    assert isolate(text) == f"{FSI}{text}{PDI}"


def test_a_report_of_latin_tokens_holds_no_marks(invoke, fake_run, tmp_path):
    db = tmp_path / "m.duckdb"
    fake_run(db)
    res = invoke("report", "--out", tmp_path / "rep", "--db", db)
    assert res.exit_code == 0, res.stderr
    md = (tmp_path / "rep" / "summary.md").read_text(encoding="utf-8")
    assert FSI not in md and PDI not in md
