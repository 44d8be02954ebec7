"""Data written into markdown, JUnit XML and the terminal stays text (evalkit/textsafe.py).

Markdown is checked by rendering it with a CommonMark parser (markdown-it-py, raw HTML on and GFM
tables, as GitHub renders a step summary): the document built around hostile data has exactly the
elements of the same document built around a plain word, and each place holds the data as text.
JUnit is checked by parsing it; terminal text by the absence of any C0 / C1 control character.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
import string
import unicodedata
import xml.dom.minidom
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from markdown_it import MarkdownIt

import evalkit

from evalkit.release.decide import Verdict, VerdictRow
from evalkit.release.render import to_junit, to_markdown as gate_markdown
from evalkit.report.rendering import to_markdown as report_markdown
from evalkit.report.sections import Image, Section, Table
from evalkit.textsafe import md_cell, md_cells, md_em, md_row, md_strong, md_text, term_line, term_text, visible, xml_clean

# CommonMark with raw HTML, GFM's tables and strikethrough, and bare URLs, www. and e-mail addresses
# linked (linkify-it, as GitHub links them)
MD = MarkdownIt("commonmark", {"html": True, "linkify": True}).enable(["table", "strikethrough", "linkify"])

# every code point, surrogates and controls included, weighted toward what markdown and HTML read
MARKUP = list("#>-+*_`~[]()!<>&|\\:@.=\"'$^{}\r\n\t\x00\x1b\x85\u2028 ") + ["1.", "<img src=x onerror=alert(1)>",
         "```", "~~~", "&amp;", "&#60;", "http://a.b/c.png", "www.a.b", "a@b.c", "![x](http://a/x.png)",
         "[x]: http://a", "## evalkit gate: PASS", "evil.com", "mailto:a@b.c", "//a.io/x", " #", "1)", "_", "<!--", "<script>", "    ", "\\|", "---", "==="]
hostile = st.lists(st.one_of(st.sampled_from(MARKUP), st.characters(min_codepoint=0, max_codepoint=0x10FFFF,
                                                                    categories=None)), min_size=1, max_size=12).map("".join)
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def shape(markdown: str) -> list[tuple]:
    """Every element of the parsed document (block tokens and inline children; runs of text as one)."""
    out: list[tuple] = []
    for tok in MD.parse(markdown):
        if tok.type != "inline":
            out.append((tok.type, tok.tag, tok.nesting))
            continue
        for child in tok.children or []:
            if child.type == "text" and out and out[-1] == ("text",):
                continue
            out.append(("text",) if child.type == "text" else (child.type, child.tag, child.nesting))
    return out


def texts(markdown: str) -> list[str]:
    """The text each inline place of the document holds."""
    out = []
    for tok in MD.parse(markdown):
        if tok.type == "inline":
            out.append("".join(c.content for c in tok.children or [] if c.type == "text"))
    return out


def assert_inert(build, data: str) -> None:
    """The document `build(data)` has the elements of `build("x")`, and no element holds markup."""
    doc, plain = build(data), build("x")
    assert shape(doc) == shape(plain), (data, doc)
    kinds = {t[0] for t in shape(doc)}
    assert not kinds & {"html_inline", "html_block", "link_open", "image", "code_inline", "fence", "code_block",
                        "heading_open", "blockquote_open", "bullet_list_open", "ordered_list_open", "hr",
                        "s_open", "softbreak", "hardbreak"} - {t[0] for t in shape(plain)}


@SETTINGS
@given(hostile)
def test_a_cell_holds_the_data_as_text_and_nothing_else(data):
    def doc(d: str) -> str:
        return "\n".join(["| a | b | c |", "|---|---|---:|", md_row([md_text(d), md_strong(d), md_em(d)]),
                          md_cells([d, "1", d]), md_row([md_cell(d), md_em(d, "_"), md_cell(d)]), ""])

    assert_inert(doc, data)
    cells = texts(doc(data))[3:]  # after the header's three
    assert cells == [visible(data)] * 3 + [visible(data), "1", visible(data)] + [visible(data)] * 3


@SETTINGS
@given(hostile, hostile)
def test_a_line_and_a_heading_hold_the_data_as_text(a, b):
    def doc(d: str) -> str:
        return "\n".join([f"## gate: {md_text(d)}", "", md_text(d), "", f"{md_em(d)} then {md_text(b)}", "",
                          md_em(d, "_"), ""])

    assert_inert(doc, a)
    assert texts(doc(a)) == [f"gate: {visible(a)}", visible(a), f"{visible(a)} then {visible(b)}", visible(a)]


@SETTINGS
@given(hostile)
def test_md_text_leaves_no_mark_unescaped(data):
    """The marks that act anywhere are escaped wherever they stand; no raw HTML character, no
    domain or URL scheme a linkifier could read."""
    out = md_text(data)
    i = 0
    while i < len(out):
        ch = out[i]
        if ch == "\\":
            assert i + 1 < len(out) and out[i + 1] in string.punctuation
            i += 2
            continue
        if ch == "&":
            end = out.index(";", i)
            assert out[i:end + 1] in ("&amp;", "&lt;", "&gt;") or out[i + 1] == "#"
            i = end + 1
            continue
        assert ch not in "<>`*[]#|@~!$\r\n\t", (data, out)
        i += 1
    assert "www." not in out and "://" not in out.replace("\\://", "")


def _row(task: str, metric: str, reason: str, status: str) -> VerdictRow:
    return VerdictRow(kind="threshold", task=task, metric=metric, status=status, reason=reason,  # type: ignore[arg-type]
                      observed=0.5, op=">=", limit=0.4, ci=(0.3, 0.7), n=42)


@SETTINGS
@given(hostile, st.sampled_from(["pass", "fail", "inconclusive", "skipped"]))
def test_gate_markdown_is_inert(name, status):
    def doc(d: str) -> str:
        verdict = Verdict(outcome="inconclusive", rows=[_row(d, d, d, status), _row("t", "ft_hit", "ok", "pass")])
        return gate_markdown(verdict, d, d)

    assert_inert(doc, name)
    heading = texts(doc(name))[0]
    assert heading == f"evalkit gate: INCONCLUSIVE — candidate {visible(name)} vs baseline {visible(name)}"
    places = texts(doc(name))  # heading, counts, 10 header cells, then row 1: status, kind, task, metric, ..., reason
    assert places[14:16] == [visible(name)] * 2 and places[21] == visible(name)


def test_the_gates_own_prose_carries_no_escaped_mark():
    """The line under the table is evalkit's text, escaped as data: a code mark of its own would show as a
    literal backslash and backtick."""
    from evalkit.release.verdict import NOT_COMPUTED_WORDS, TWIN_WORDS

    rows = [_row("t", "ft_hit", f"{TWIN_WORDS} answer_prob", "skipped"),
            _row("t", "opener_mass", f"{NOT_COMPUTED_WORDS}: run a did not compute it", "inconclusive")]
    doc = gate_markdown(Verdict(outcome="inconclusive", rows=rows), "cand", "base")
    prose = doc.split("\n\n")[-1]
    assert prose.startswith("A fail needs") and "1 row reads a metric" in prose
    assert "\\`" not in prose and "\\*" not in prose, prose


def test_a_forged_heading_stays_in_its_cell():
    verdict = Verdict(outcome="inconclusive", rows=[_row("t\r## evalkit gate: PASS\r", "m", "<img src=x onerror=f()>",
                                                         "inconclusive")])
    doc = gate_markdown(verdict, "cand", "base")
    headings = [t for t in MD.parse(doc) if t.type == "heading_open"]
    assert len(headings) == 1 and "gate: PASS" not in MD.render(doc).split("</h2>")[0]
    assert "<img" not in MD.render(doc)


@SETTINGS
@given(hostile)
def test_report_markdown_is_inert(d):
    def doc(x: str) -> str:
        table = Table(columns=["run", x], rows=[[x, "0.5"], ["a", x]], caption=x, numeric_from=1, strong={(0, 0)})
        sections = [Section(key="a", title=x, intro=x, tables=[table], notes=[x],
                            images=[Image(name=f"{x}.png", alt=x, draw=lambda: None)]),
                    Section(key="b", title="b", omitted=x)]
        data = SimpleNamespace(runs=[1, 2], db=x, generated=dt.datetime(2026, 1, 2, 3, 4, 5))
        return report_markdown(data, sections)  # type: ignore[arg-type]

    assert_inert(doc, d)
    assert f"2 runs from {visible(d)}, generated 2026-01-02 03:04:05 UTC." in texts(doc(d))


def _xml_roundtrip(text: str) -> None:
    ET.fromstring(text.split("?>", 1)[1])
    xml.dom.minidom.parseString(text.encode("utf-8"))


@SETTINGS
@given(hostile, hostile, st.sampled_from(["pass", "fail", "inconclusive", "skipped"]))
def test_junit_is_well_formed_xml(name, reason, status):
    verdict = Verdict(outcome="fail", rows=[_row(name, name, reason, status)])
    out = to_junit(verdict, name, name)
    _xml_roundtrip(out)
    case = ET.fromstring(out.split("?>", 1)[1]).find("testcase")
    assert case is not None and case.get("name") == visible(f"{name}/{name}", keep="\t\n")


@SETTINGS
@given(hostile)
def test_xml_clean_makes_any_tree_well_formed(d):
    root = ET.Element("r", {"a": d})
    ET.SubElement(root, "c").text = d
    root[0].tail = d
    _xml_roundtrip('<?xml version="1.0"?>' + ET.tostring(xml_clean(root), encoding="unicode"))


def _controls(text: str) -> list[str]:
    return [c for c in text if c != "\n" and unicodedata.category(c) == "Cc"]


@SETTINGS
@given(hostile)
def test_terminal_text_has_no_control_character(d):
    assert _controls(term_text(d)) == [] and _controls(term_line(d)) == [] and "\n" not in term_line(d)


@pytest.mark.parametrize("name", ["run\x1b[2J\x1b]0;title\x07", "a\rb", "c\x9b31m", "d\u2028e"])
def test_terminal_table_shows_escape_sequences(name):
    from evalkit.cli.output import lead_table, metric_table, table

    out = table(["name"], [[name]]) + metric_table([{"task": name, "metric": "ft_hit", "value": 0.5, "n": 3}])
    out += lead_table([{"task": name, "signal": "ft_hit_prob", "auroc": None, "ci_lo": None, "ci_hi": None, "n": 3,
                        "base_rate": 0.3, "reason": name}])
    assert _controls(out) == []


@SETTINGS
@given(hostile)
def test_terminal_json_reads_back_the_same_and_has_no_control_character(d):
    import json

    from evalkit.cli.output import render

    out = render(["name"], [[d]], "json")
    assert _controls(out) == [] and json.loads(out) == [{"name": d}]


def _section_prose() -> list[tuple[str, int, str]]:
    """Every literal piece of text evalkit's report code writes into a section's intro, notes, omitted
    reason or caption: (file, line, text)."""
    import ast

    out = []
    for path in sorted((Path(evalkit.__file__).parent / "report").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            values: list[ast.AST] = []
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Attribute) and t.attr in ("omitted", "intro", "caption") for t in targets):
                    values.append(node.value)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append" \
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "notes":
                values += node.args
            elif isinstance(node, ast.Call):
                values += [k.value for k in node.keywords if k.arg in ("omitted", "intro", "caption", "notes")]
            for value in values:
                for const in ast.walk(value):
                    if isinstance(const, ast.Constant) and isinstance(const.value, str):
                        out.append((path.name, const.lineno, const.value))
    return out


def test_the_reports_own_prose_carries_no_markup():
    """Section text is written as data (escaped, shown as it is), so a backtick or an emphasis mark evalkit
    writes there itself would show up literally in summary.md instead of as code."""
    prose = _section_prose()
    assert len(prose) > 40  # the scan finds the report's texts
    marked = [(f, line, text) for f, line, text in prose if "`" in text or "**" in text]
    assert not marked, marked
