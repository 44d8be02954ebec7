"""The fonts the report is drawn and shown with, shipped with evalkit so Chinese, Hebrew or Greek
tokens read the same on every machine, with or without system fonts.

Owns: which font files the report uses (`REPORT_FONTS`: DejaVu Sans, from matplotlib's own data, and
WenQuanYi Micro Hei, a CJK font from the PyPI package ``paperang-p2-fonts-cjk``, Apache-2.0), their
registration with matplotlib (`register_with_matplotlib`), the HTML's ``@font-face`` rules with each
font cut down to the characters the page holds and embedded as base64 WOFF (`font_face_css`), and
bidirectional text in plot labels (`visual_order`). Does not: draw, or decide what a label says
(`report.plots`), or write the page (`report.rendering`).
"""

from __future__ import annotations

import base64
import functools
import io
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from evalkit.errors import BadInput


@dataclass(frozen=True)
class FontFile:
    family: str  # the family name matplotlib and fontconfig give the face
    css_family: str  # the name the HTML's @font-face rule gives it
    face: int  # the face's index in a collection (.ttc); 0 for a single font


DEJAVU = FontFile("DejaVu Sans", "evalkit DejaVu Sans", 0)
CJK = FontFile("WenQuanYi Micro Hei", "evalkit WenQuanYi Micro Hei", 0)
REPORT_FONTS = (DEJAVU, CJK)  # fallback order: a character takes the first font that has it
CJK_PACKAGE, CJK_FILE = "paperang_p2_fonts_cjk", "fonts/wqy-microhei.ttc"
CJK_DISTRIBUTION = "paperang-p2-fonts-cjk"  # pyproject.toml's dependency


def font_path(font: FontFile) -> Path:
    """The file of one of `REPORT_FONTS`; BadInput naming the package to reinstall when it is missing."""
    if font == DEJAVU:
        import matplotlib

        return Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    from importlib import resources

    try:
        path = Path(str(resources.files(CJK_PACKAGE) / CJK_FILE))
    except ModuleNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise BadInput(f"the report's CJK font is missing: pip install {CJK_DISTRIBUTION} "
                       "(a dependency of evalkit-firsttoken)")
    return path


@functools.lru_cache(maxsize=1)
def register_with_matplotlib() -> tuple[tuple[str, ...], frozenset[int]]:
    """Add `REPORT_FONTS` to matplotlib's font list; return (their families in fallback order, the
    code points they draw together)."""
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    drawable: set[int] = set()
    for font in REPORT_FONTS:
        path = str(font_path(font))
        if font.family not in {f.name for f in font_manager.fontManager.ttflist}:
            font_manager.fontManager.addfont(path)
        drawable |= set(FT2Font(path).get_charmap())
    return tuple(f.family for f in REPORT_FONTS), frozenset(drawable)


@functools.lru_cache(maxsize=len(REPORT_FONTS))
def _cmap(font: FontFile) -> frozenset[int]:
    from fontTools.ttLib import TTFont

    return frozenset(TTFont(str(font_path(font)), fontNumber=font.face, lazy=True).getBestCmap())


def _subset_woff(font: FontFile, chars: str) -> bytes:
    """The font cut down to `chars` (with their OpenType features), as WOFF (zlib; no extra library)."""
    from fontTools import subset
    from fontTools.ttLib import TTFont

    options = subset.Options()
    options.flavor = "woff"
    options.layout_features = ["*"]
    options.notdef_outline = True
    options.name_IDs = ["*"]  # the licence and the names stay with the glyphs
    options.drop_tables += ["FFTM"]
    # lazy: only the glyphs kept are read (0.2 s of CPU for a CJK subset, against 1.5 s reading all 49k)
    font_file = TTFont(str(font_path(font)), fontNumber=font.face, lazy=True, recalcTimestamp=False)
    subsetter = subset.Subsetter(options)
    subsetter.populate(text=chars)
    subsetter.subset(font_file)
    out = io.BytesIO()
    font_file.flavor = "woff"
    font_file.save(out)
    return out.getvalue()


def font_face_css(text: str) -> tuple[str, tuple[str, ...]]:
    """(@font-face rules embedding each of `REPORT_FONTS` cut down to the characters of `text` that it
    has and no earlier font has; the CSS family names, in fallback order, of the fonts embedded).

    A page shows every such character with a shipped font, whatever the machine has installed.
    """
    wanted = {ord(ch) for ch in text if ch.isprintable() and not ch.isspace()} | {ord(" ")}
    rules, families = [], []
    for font in REPORT_FONTS:
        mine = wanted & _cmap(font)
        if not mine or mine == {ord(" ")}:
            continue
        wanted -= mine - {ord(" ")}
        data = base64.b64encode(_subset_woff(font, "".join(map(chr, sorted(mine))))).decode("ascii")
        rules.append(f'@font-face{{font-family:"{font.css_family}";src:url(data:font/woff;base64,{data}) '
                     'format("woff");font-display:swap}')
        families.append(font.css_family)
    return "\n".join(rules), tuple(families)


_RTL = {"R", "AL", "RLE", "RLO", "RLI"}


def has_rtl(text: str) -> bool:
    """Whether `text` holds a right-to-left character (Hebrew, Arabic, ...).

    >>> has_rtl("Paris"), has_rtl("'\\u05dc'")
    (False, True)
    """
    return any(unicodedata.bidirectional(ch) in _RTL for ch in text)


def visual_order(text: str) -> str:
    """`text` in the order its characters are seen, by the Unicode bidirectional algorithm (python-bidi),
    the paragraph's direction taken from its first strong character, as the HTML's ``dir="auto"`` does.
    matplotlib draws a string's characters left to right as stored; so a label is put through this
    alone, one paragraph of its own, isolated from the text around it. Unchanged without RTL text.

    >>> visual_order("'\\u05e9\\u05dc\\u05d5\\u05dd'") == "'\\u05dd\\u05d5\\u05dc\\u05e9'"
    True
    """
    if not has_rtl(text):
        return text
    from bidi import get_display

    return "\n".join(get_display(line) for line in text.split("\n"))


FSI, PDI = "\u2068", "\u2069"  # First Strong Isolate ... Pop Directional Isolate: Unicode's own <bdi>


def isolate(text: str) -> str:
    """`text` marked as a unit whose direction is its own (Unicode's FSI ... PDI) when it holds
    right-to-left text (`has_rtl`): a Hebrew token beside a number stays where it is instead of
    swapping places with it. The HTML renders the marks as ``<bdi>``; markdown viewers honour them as
    they are. Text without RTL characters is left unmarked: the marks show in terminals and grep.

    >>> isolate("ל") == "\\u2068ל\\u2069", isolate("' Paris'")
    (True, "' Paris'")
    """
    return f"{FSI}{text}{PDI}" if has_rtl(text) else text
