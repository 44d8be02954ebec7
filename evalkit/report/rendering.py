"""A report's sections as one offline HTML page and as markdown.

Owns: the HTML (no external CSS, JS or fonts; images are relative PNG files) and the
markdown of `summary.md`. Does not: decide what a section holds (`report.sections`) or
write files (`report.build`).
"""

from __future__ import annotations

import html

from evalkit.report.reading import ReportData
from evalkit.report.sections import Section, Table, plural

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"Noto Sans","Noto Sans CJK SC",sans-serif;
 margin:0 auto;max-width:1240px;padding:1.2rem 1.5rem 3rem;color:#1f2328;line-height:1.45}
h1{font-size:1.6rem;margin:.2rem 0}h2{font-size:1.25rem;border-bottom:1px solid #d0d7de;padding-bottom:.3rem;
 margin-top:2.2rem}
.meta{color:#59636e;font-size:.9rem}nav a{margin-right:1rem}
.tbl{overflow-x:auto;margin:.8rem 0 1.2rem}.row{display:flex;flex-wrap:wrap;gap:0 2rem}
.row .tbl{max-width:calc(50% - 1rem);min-width:320px}
table{border-collapse:collapse;font-size:.85rem}
.caption{font-weight:600;margin:0 0 .3rem;color:#424a53;font-size:.9rem}
th,td{border:1px solid #d0d7de;padding:.25rem .55rem;white-space:pre-line;text-align:left}
th.run,td.run{min-width:15rem}th{background:#f6f8fa}tr:nth-child(even) td{background:#fbfcfd}td.num{text-align:right;
 font-variant-numeric:tabular-nums}strong{color:#0a3069}
img{max-width:100%;height:auto;border:1px solid #eaeef2;margin:.5rem 0}
.omitted{color:#8c959f;font-style:italic}.note{color:#59636e;font-size:.88rem}
code{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:.85em}
"""


def _html_table(t: Table) -> str:
    e = html.escape
    out = ['<div class="tbl">']
    if t.caption:
        out.append(f'<p class="caption">{e(t.caption)}</p>')
    out.append("<table>")
    # a header may break after an underscore (ft_hit_prob), never inside a word
    # a run's label (name · model · quant · template · engine) gets room to wrap onto two lines, not five
    is_run = [c == "run" or c.startswith("run:") for c in t.columns]
    run_cls = ' class="run"'
    out.append("<thead><tr>" + "".join(f"<th{run_cls if r else ''}>{e(c).replace('_', '_&#8203;')}</th>"
                                       for c, r in zip(t.columns, is_run)) + "</tr></thead><tbody>")
    for i, row in enumerate(t.rows):
        cells = []
        for j, cell in enumerate(row):
            cls = (' class="num"' if t.numeric_from is not None and j >= t.numeric_from
                   else run_cls if is_run[j] else "")
            text = f"<strong>{e(cell)}</strong>" if (i, j) in t.strong else e(cell)
            cells.append(f"<td{cls}>{text}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table></div>")
    return "\n".join(out)


def to_html(data: ReportData, sections: list[Section]) -> str:
    """The report as one self-contained HTML page (images are relative PNG paths)."""
    e = html.escape
    parts = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>evalkit report</title>", f"<style>{_CSS}</style></head><body>",
        "<header><h1>evalkit report</h1>",
        (f'<p class="meta">{plural(len(data.runs), "run")} from <code>{e(data.db)}</code>, '
         f"generated {data.generated:%Y-%m-%d %H:%M:%S} UTC.</p>"),
        "<nav>" + "".join(f'<a href="#{s.key}">{e(s.title)}</a>' for s in sections) + "</nav></header>",
    ]
    for s in sections:
        parts.append(f'<section id="{s.key}"><h2>{e(s.title)}</h2>')
        if s.omitted:
            parts.append(f'<p class="omitted">Omitted: {e(s.omitted)}.</p></section>')
            continue
        if s.intro:
            parts.append(f"<p>{e(s.intro)}</p>")
        for image in s.images:
            parts.append(f'<img src="{e(image.name)}" alt="{e(image.alt)}">')
        if s.side_by_side:
            parts.append('<div class="row">')
        parts.extend(_html_table(t) for t in s.tables)
        if s.side_by_side:
            parts.append("</div>")
        parts.extend(f'<p class="note">{e(n)}</p>' for n in s.notes)
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _md_cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _md_table(t: Table) -> str:
    out = []
    if t.caption:
        out += [f"*{_md_cell(t.caption)}*", ""]
    out.append("| " + " | ".join(_md_cell(c) for c in t.columns) + " |")
    out.append("|" + "|".join("---:" if t.numeric_from is not None and j >= t.numeric_from else "---"
                              for j in range(len(t.columns))) + "|")
    for i, row in enumerate(t.rows):
        cells = [f"**{_md_cell(c)}**" if (i, j) in t.strong and c else _md_cell(c) for j, c in enumerate(row)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def to_markdown(data: ReportData, sections: list[Section]) -> str:
    """The report as markdown (summary.md), images as relative links."""
    lines = ["# evalkit report", "",
             f"{plural(len(data.runs), 'run')} from `{data.db}`, generated {data.generated:%Y-%m-%d %H:%M:%S} UTC.", ""]
    for s in sections:
        lines += [f"## {s.title}", ""]
        if s.omitted:
            lines += [f"_Omitted: {s.omitted}._", ""]
            continue
        if s.intro:
            lines += [s.intro, ""]
        for image in s.images:
            lines += [f"![{image.alt}]({image.name})", ""]
        for t in s.tables:
            lines += [_md_table(t), ""]
        for n in s.notes:
            lines += [f"_{n}_", ""]
    return "\n".join(lines)
