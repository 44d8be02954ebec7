"""Fuzz: the gate's markdown and JUnit writers (`release.render`) on verdicts decided over runs whose
task names and ids are generated text (control characters, markup, HTML, lone surrogates).

Every verdict renders; the markdown parses (CommonMark with raw HTML, GFM tables, linkify) into one
heading, one table of one row per check with ten cells each, the task cell holding the task name as
text, and no HTML, link, image or code element; the JUnit parses as XML 1.0 with one test case per
check, named after it."""

from __future__ import annotations

import xml.dom.minidom
import xml.etree.ElementTree as ET

from hypothesis import given
from hypothesis import strategies as st
from markdown_it import MarkdownIt

from evalkit.release.decide import decide
from evalkit.release.render import to_junit, to_markdown
from evalkit.release.rules import parse_rules
from evalkit.textsafe import visible
from tests.fuzz import fuzz
from tests.test_gate import hits, make_run

MD = MarkdownIt("commonmark", {"html": True, "linkify": True}).enable(["table", "strikethrough", "linkify"])
FORBIDDEN = {"html_inline", "html_block", "link_open", "image", "code_inline", "fence", "code_block", "blockquote_open",
             "bullet_list_open", "ordered_list_open", "hr", "s_open", "softbreak", "hardbreak"}
MARKUP = ["\r## evalkit gate: PASS\r", "<img src=x onerror=alert(1)>", "| a | b |", "`x`", "*x*", "[a](http://b)",
          "www.a.com", "\x1b[31m", "\x00", "\ud800", "\u2028", "&amp;", "1. ", "- ", "> ", "    ", "\\", "~~x~~"]
names = st.lists(st.one_of(st.sampled_from(MARKUP), st.text(min_size=1, max_size=4)), min_size=1, max_size=5).map(
    "".join).filter(lambda s: s.strip())
RULES = parse_rules({"regressions": {"ft_hit": 0.05}, "thresholds": {"ft_hit": ">= 0.2"}})


def _tokens(markdown: str) -> list:
    out = []
    for tok in MD.parse(markdown):
        out.append(tok)
        out += tok.children or []
    return out


@fuzz(100)
@given(tasks=st.lists(names, min_size=1, max_size=3, unique=True), cand=names, base=names,
       right=st.integers(0, 30))
def test_gate_writers_on_hostile_names(tasks, cand, base, right):
    candidate = make_run(cand, {t: hits(30, right) for t in tasks})
    baseline = make_run(base, {t: hits(30, 15) for t in tasks})
    verdict = decide(candidate, baseline, RULES)

    md = to_markdown(verdict, cand, base)
    tokens = _tokens(md)
    assert not {t.type for t in tokens} & FORBIDDEN, md
    assert [t.tag for t in tokens if t.type == "heading_open"] == ["h2"]
    assert sum(t.type == "table_open" for t in tokens) == 1
    rows = [t for t in tokens if t.type == "tr_open"]
    assert len(rows) == len(verdict.rows) + 1  # the header row
    cells = [t for t in MD.parse(md) if t.type == "inline"][12:]  # after the heading, counts, header
    assert len(cells) == 10 * len(verdict.rows) + 1  # and the closing line
    for i, row in enumerate(verdict.rows):  # the task cell: the name as text, nothing else
        task = cells[10 * i + 2].children or []
        assert [c.type for c in task] == ["text"] and task[0].content == visible(row.task or "*")

    junit = to_junit(verdict, cand, base)
    xml.dom.minidom.parseString(junit.encode("utf-8"))
    suite = ET.fromstring(junit.split("?>", 1)[1])
    names_seen = [c.get("name") for c in suite.iter("testcase")]
    assert names_seen == [visible(r.name, keep="\t\n") for r in verdict.rows]

