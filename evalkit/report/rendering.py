"""A report's sections as one offline HTML page and as markdown.

Owns: the HTML (no external CSS or JS; the fonts it needs embedded, cut down to the page's
characters, `report.fonts`; images are relative PNG files), its contents list (the sections
with data, then those left out, apart), text of either direction isolated (``<bdi>`` for the
marks of `fonts.isolate`, ``dir="auto"`` on free text), and the markdown of `summary.md`.
Does not: decide what a section holds (`report.sections`) or write files (`report.build`).
"""

from __future__ import annotations

import html
import re

from evalkit.report.fonts import FSI, PDI, font_face_css
from evalkit.report.reading import ReportData
from evalkit.report.sections import Section, Table, plural
from evalkit.textsafe import md_cell, md_cells, md_em, md_row, md_strong, md_target, md_text

# the system's own fonts first; then the fonts embedded in the page (`_FONTS`), which have every character
_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"Noto Sans","Noto Sans CJK SC",_FONTS,sans-serif;
 margin:0 auto;max-width:1240px;padding:1.2rem 1.5rem 3rem;color:#1f2328;line-height:1.45}
h1{font-size:1.6rem;margin:.2rem 0}h2{font-size:1.25rem;border-bottom:1px solid #d0d7de;padding-bottom:.3rem;
 margin-top:2.2rem}
.meta{color:#59636e;font-size:.9rem}nav a{margin-right:1rem}nav .left-out{color:#59636e;font-size:.88rem;margin:.3rem 0}
nav .left-out a{color:#8c959f;margin-right:.7rem}
.tbl{overflow-x:auto;margin:.8rem 0 1.2rem}.row{display:flex;flex-wrap:wrap;gap:0 2rem}
.row .tbl{max-width:calc(50% - 1rem);min-width:320px}
table{border-collapse:collapse;font-size:.85rem}
.caption{font-weight:600;margin:0 0 .3rem;color:#424a53;font-size:.9rem}
th,td{border:1px solid #d0d7de;padding:.25rem .55rem;white-space:pre-line;text-align:left}
th.run,td.run{min-width:15rem}th{background:#f6f8fa}tr:nth-child(even) td{background:#fbfcfd}td.num{text-align:right;
 font-variant-numeric:tabular-nums}strong{color:#0a3069}
img{max-width:100%;height:auto;border:1px solid #eaeef2;margin:.5rem 0}
.omitted{color:#8c959f;font-style:italic}.note{color:#59636e;font-size:.88rem}
code{font-family:ui-monospace,SFMono-Regular,Menlo,monospace,_FONTS;font-size:.85em}
"""


def _text(text: str) -> str:
    """HTML of a piece of text: escaped, its isolated parts (`fonts.isolate`) as <bdi>."""
    escaped = html.escape(text)
    return re.sub(f"{FSI}(.*?){PDI}", r"<bdi>\1</bdi>", escaped, flags=re.S).replace(FSI, "").replace(PDI, "")


def _html_table(t: Table) -> str:
    out = ['<div class="tbl">']
    if t.caption:
        out.append(f'<p class="caption">{_text(t.caption)}</p>')
    out.append("<table>")
    # a header may break after an underscore (ft_hit_prob), never inside a word
    # a run's label (name · model · quant · template · engine) gets room to wrap onto two lines, not five
    is_run = [c == "run" or c.startswith("run:") for c in t.columns]
    run_cls = ' class="run"'
    out.append("<thead><tr>" + "".join(f"<th{run_cls if r else ''}>{_text(c).replace('_', '_&#8203;')}</th>"
                                       for c, r in zip(t.columns, is_run)) + "</tr></thead><tbody>")
    for i, row in enumerate(t.rows):
        cells = []
        for j, cell in enumerate(row):
            cls = (' class="num"' if t.numeric_from is not None and j >= t.numeric_from
                   else run_cls if is_run[j] else "")
            text = f"<bdi>{_text(cell)}</bdi>" if is_run[j] else _text(cell)  # a run's name, either direction
            text = f"<strong>{text}</strong>" if (i, j) in t.strong else text
            cells.append(f"<td{cls}>{text}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table></div>")
    return "\n".join(out)


def _contents(sections: list[Section]) -> str:
    """The contents: a link per section with data; the sections left out listed apart, after them."""
    e = html.escape
    shown = "".join(f'<a href="#{s.key}">{e(s.title)}</a>' for s in sections if not s.omitted)
    left = [s for s in sections if s.omitted]
    out = f"<nav><div>{shown}</div>"
    if left:
        out += ('<p class="left-out">Left out, no data: ' + "".join(f'<a href="#{s.key}">{e(s.title)}</a>'
                                                                    for s in left) + "</p>")
    return out + "</nav>"


def to_html(data: ReportData, sections: list[Section]) -> str:
    """The report as one self-contained HTML page (images are relative PNG paths, fonts embedded)."""
    e = html.escape
    parts = [
        "<header><h1>evalkit report</h1>",
        (f'<p class="meta">{plural(len(data.runs), "run")} from <code dir="auto">{e(data.db)}</code>, '
         f"generated {data.generated:%Y-%m-%d %H:%M:%S} UTC.</p>"),
        _contents(sections) + "</header>",
    ]
    for s in sections:
        parts.append(f'<section id="{s.key}"><h2>{e(s.title)}</h2>')
        if s.omitted:
            parts.append(f'<p class="omitted">Omitted: {e(s.omitted)}.</p></section>')
            continue
        if s.intro:
            parts.append(f"<p>{_text(s.intro)}</p>")
        for image in s.images:
            parts.append(f'<img src="{e(image.name)}" alt="{e(image.alt)}">')
        if s.side_by_side:
            parts.append('<div class="row">')
        parts.extend(_html_table(t) for t in s.tables)
        if s.side_by_side:
            parts.append("</div>")
        parts.extend(f'<p class="note">{_text(n)}</p>' for n in s.notes)
        parts.append("</section>")
    body = "\n".join(parts)
    faces, families = font_face_css(html.unescape(re.sub(r"<[^>]*>", " ", body)) + _CSS)
    css = _CSS.replace("_FONTS", ",".join(f'"{f}"' for f in families) or "sans-serif")
    head = ["<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            "<title>evalkit report</title>", f"<style>{faces}\n{css}</style></head><body>"]
    return "\n".join(head) + "\n" + body + "\n</body></html>\n"


def _md_table(t: Table) -> str:
    """A table in markdown: each cell's lines (a value, its interval below) on one line, each
    cell inert text (`textsafe`)."""
    def one_line(cell: str) -> str:
        return " ".join(cell.split("\n"))

    out = []
    if t.caption:
        out += [md_em(t.caption), ""]
    out.append(md_cells(one_line(c) for c in t.columns))
    out.append("|" + "|".join("---:" if t.numeric_from is not None and j >= t.numeric_from else "---"
                              for j in range(len(t.columns))) + "|")
    for i, row in enumerate(t.rows):
        out.append(md_row([md_strong(one_line(c)) if (i, j) in t.strong else md_cell(one_line(c))
                           for j, c in enumerate(row)]))
    return "\n".join(out)


def md_anchor(title: str) -> str:
    """The anchor GitHub and most markdown viewers give a heading: lower case, punctuation
    dropped, spaces as hyphens.

    >>> md_anchor("Promotions and gates"), md_anchor("Does the first token predict the answer?")
    ('promotions-and-gates', 'does-the-first-token-predict-the-answer')
    """
    kept = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return kept.replace(" ", "-")


def to_markdown(data: ReportData, sections: list[Section]) -> str:
    """The report as markdown (summary.md), images as relative links. Every piece of text is
    written by `textsafe` (inert: data cannot make a heading, a link or HTML)."""
    lines = ["# evalkit report", "",
             md_text(f"{plural(len(data.runs), 'run')} from {data.db}, generated {data.generated:%Y-%m-%d %H:%M:%S} UTC."), "",
             "Sections: " + " · ".join(f"[{md_text(s.title, line_start=False)}](#{md_anchor(s.title)})" for s in sections if not s.omitted)
             + " (the same in [index.html](index.html)).", ""]
    for s in sections:
        lines += [f"## {md_text(s.title)}", ""]
        if s.omitted:
            lines += [md_em(f"Omitted: {s.omitted}.", "_"), ""]
            continue
        if s.intro:
            lines += [md_text(s.intro), ""]
        for image in s.images:
            lines += [f"![{md_text(image.alt)}]({md_target(image.name)})", ""]
        for t in s.tables:
            lines += [_md_table(t), ""]
        for n in s.notes:
            lines += [md_em(n, "_"), ""]
    return "\n".join(lines)
