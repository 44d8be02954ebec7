"""Text from data, written where a reader would otherwise take it for markup or for a command.

Run names, task names, prompts, tokens, answers and rule keys come from users and from models;
wherever evalkit writes them into markdown, JUnit XML or a terminal, they go through here.

Owns:
- `visible`: every control character shown as a visible character instead of acting (C0 as
  Unicode's control pictures, ``\\r`` → ``␍``; DEL as ``␡``; C1, line and paragraph separators,
  lone surrogates and the noncharacters U+FFFE / U+FFFF as ``\\xNN`` / ``\\uNNNN``).
- `md_text` (one cell or one run of a line of markdown): `visible`, then HTML's ``& < >`` as
  entities and every other ASCII mark that could act where it stands backslash-escaped
  (CommonMark makes an escaped mark literal; a word's underscore, a decimal point or a
  sentence's full stop stay as they are), leading and trailing white space as numeric entities
  (no indented code block, no trimmed cell). The result is inert: no heading, list, quote, fence, table, emphasis, link,
  autolink (``http\\://``, ``www\\.``), entity or raw HTML can start inside it, in CommonMark or
  GitHub's dialect. `md_strong`, `md_em`, `md_row` and `md_cells` build on it; `md_target` is a
  relative link's target.
- `xml_text`: text XML 1.0 allows (`visible` but for tab and newline), and `xml_clean`, which
  applies it to every attribute and text of an ElementTree before it is written.
- `term_text`: a name or a line for a terminal, escape sequences shown instead of obeyed.
Does not: decide what a document says or where data goes (the writers do).
"""

from __future__ import annotations

import string
from urllib.parse import quote
from collections.abc import Iterable
from xml.etree.ElementTree import Element

_PICTURES = {c: chr(0x2400 + c) for c in range(0x20)} | {0x7F: "\u2421"}

_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}
# marks that act wherever they stand (code, emphasis, links, tables, strikethrough, email autolinks,
# GitHub's math, an ATX heading's closing #s, escapes): always escaped
_ALWAYS = frozenset("\\`*[]|~@$#!")
# marks that act only where a line starts (lists, quotes, headings, setext underlines, breaks)
_LINE_START = frozenset("-+=:")


def _acts(chars: str, i: int, lead: int | None) -> bool:
    """Whether ASCII mark ``chars[i]`` could act as markup where it stands. `lead`: where the text's
    first mark stands when the text may start a line (block markup begins there), else None."""
    ch, prev = chars[i], chars[i - 1] if i else ""
    nxt = chars[i + 1] if i + 1 < len(chars) else ""
    if ch in _ALWAYS:
        return True
    if ch == "_":  # inside a word it neither opens nor closes emphasis (CommonMark's flanking rules)
        return not (prev.isalnum() and nxt.isalnum())
    first = i == lead  # the first mark of a line
    # a list's "1." / "1)": at most 9 digits first on a line, then a space or nothing
    list_item = (lead is not None and 0 < i - lead <= 9 and chars[lead:i].isdigit() and chars[lead:i].isascii()
                 and (not nxt or nxt.isspace()))
    if ch == ":":  # a URL's scheme (http://, ftp://) or a table's alignment at a line's start
        return nxt == "/" or first
    if ch == ".":  # a domain's dot (www.a.b, a.com), not a decimal point
        return (nxt.isalnum() and not (prev.isdigit() and nxt.isdigit())) or list_item
    if ch == ")":
        return list_item
    if ch in _LINE_START:
        return first
    return False


def _escaped(ch: str) -> str | None:
    """The visible form of one character that must not act, None for one that may stay."""
    cp = ord(ch)
    if cp in _PICTURES:
        return _PICTURES[cp]
    if 0x80 <= cp <= 0x9F:
        return f"\\x{cp:02x}"
    if cp in (0x2028, 0x2029, 0xFFFE, 0xFFFF) or 0xD800 <= cp <= 0xDFFF:
        return f"\\u{cp:04x}"
    return None


def visible(text: str, keep: str = "") -> str:
    """`text` with every control character shown instead of acting (`keep`: those left as they are).

    >>> visible("a\\rb\\x1b[2J\\x9b\\u2028c")
    'a␍b␛[2J\\\\x9b\\\\u2028c'
    >>> visible("one\\ttwo\\n", keep="\\t\\n")
    'one\\ttwo\\n'
    """
    out = []
    for ch in str(text):
        shown = None if ch in keep else _escaped(ch)
        out.append(ch if shown is None else shown)
    return "".join(out)


def term_text(text: object) -> str:
    """A name or a message for a terminal: escape sequences and control characters shown, newlines
    kept (a message may have several lines).

    >>> term_text("run \\x1b]0;pwned\\x07 done")
    'run ␛]0;pwned␇ done'
    """
    return visible(str(text), keep="\n")


def term_line(text: object) -> str:
    """One line for a terminal: as `term_text`, and a newline shown too."""
    return visible(str(text))


def term_json(text: str) -> str:
    """JSON text (``json.dumps(..., ensure_ascii=False)``) for a terminal: DEL, the C1 controls and line
    separators JSON lets through raw written as ``\\u`` escapes, so the JSON reads back the same.

    >>> term_json('["a\\x9b31m"]') == '["a\\\\u009b31m"]'
    True
    """
    return "".join(f"\\u{ord(c):04x}" if 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029" else c for c in text)


def md_text(text: object, *, line_start: bool = True) -> str:
    """Data as inert markdown text: shown exactly as it is, never read as markup. `line_start`
    False: the text cannot start a line (a table cell, inside emphasis), where ``-``, ``+``, ``=``
    and a list's ``1.`` cannot act and stay as they are.

    >>> md_text("## PASS <img src=x onerror=alert(1)> *x* http://a.b")
    '\\\\#\\\\# PASS &lt;img src=x onerror=alert(1)&gt; \\\\*x\\\\* http\\\\://a\\\\.b'
    >>> md_text("0.25 | 1. item\\r"), md_text("1. item"), md_text("  code"), md_text("ft_hit")
    ('0.25 \\\\| 1. item␍', '1\\\\. item', '&#32;&#32;code', 'ft_hit')
    """
    chars = visible(str(text))
    lead = len(chars) - len(chars.lstrip()) if line_start else None
    out = []
    for i, ch in enumerate(chars):
        if ch in _ENTITIES:
            out.append(_ENTITIES[ch])
        elif ch in string.punctuation and _acts(chars, i, lead):
            out.append("\\" + ch)
        else:
            out.append(ch)
    # white space at either end: entities, which no parser trims or counts as indentation
    lead = len(chars) - len(chars.lstrip())
    trail = len(chars) - len(chars.rstrip()) if chars.strip() else 0
    if lead or trail:
        body = out[lead:len(out) - trail]
        out = [f"&#{ord(c)};" for c in chars[:lead]] + body + [f"&#{ord(c)};" for c in chars[len(chars) - trail:]]
    return "".join(out)


def md_strong(text: object) -> str:
    """Data as strong (bold) inert markdown text; empty stays empty."""
    return f"**{md_text(text, line_start=False)}**" if str(text) else ""


def md_em(text: object, mark: str = "*") -> str:
    """Data as emphasised (italic) inert markdown text between `mark`s (``*`` or ``_``); empty stays empty."""
    if mark not in ("*", "_"):
        raise ValueError(f"md_em: mark must be * or _, got {mark!r}")
    return f"{mark}{md_text(text, line_start=False)}{mark}" if str(text) else ""


def md_cell(text: object) -> str:
    """Data as one table cell (GFM reads a cell's inside as inline text only: no block starts there)."""
    return md_text(text, line_start=False)


def md_row(cells: Iterable[str]) -> str:
    """One table row of cells already written by `md_cell` / `md_strong` / `md_em`."""
    return "| " + " | ".join(cells) + " |"


def md_cells(values: Iterable[object]) -> str:
    """One table row of data cells."""
    return md_row(md_cell(v) for v in values)


def md_target(path: str) -> str:
    """A relative link's target (an image next to the file): every character but letters, digits,
    ``_.-~`` and ``/`` percent-encoded, so it can neither end the link nor leave it.

    >>> md_target("a b).png")
    'a%20b%29.png'
    """
    return quote(visible(path), safe="/")


def xml_text(text: object) -> str:
    """Text XML 1.0 allows: every control character shown but tab and newline (which an
    attribute's value keeps as character references), lone surrogates and U+FFFE / U+FFFF shown.

    >>> xml_text("a\\x00b\\x1bc\\td\\n")
    'a␀b␛c\\td\\n'
    """
    return visible(str(text), keep="\t\n")


def xml_clean(root: Element) -> Element:
    """Every attribute value, text and tail under `root` made text XML 1.0 allows (`xml_text`), in
    place; returns `root`. Call it on a tree just before it is written."""
    for el in root.iter():
        for key, value in el.attrib.items():
            el.attrib[key] = xml_text(value)
        if el.text is not None:
            el.text = xml_text(el.text)
        if el.tail is not None:
            el.tail = xml_text(el.tail)
    return root
