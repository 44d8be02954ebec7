"""Is the whole answer right? `answer_hit`: a checkable answer found anywhere in the response.

Owns: matching a prompt's `answers_full` strings ("Paris", "42", "forty-two", "七十二")
against a response (docs/metrics.md §1.7): both sides NFKC-normalised and case-folded,
digits and their separators as the needle key is; a string with Chinese, Japanese or
Korean characters is found as a substring, any other on word boundaries ("Paris" hits
"Paris." but not "Parisian"; "42" hits "is 42." but not "420", "4.2" or "1,042"); a
string of Chinese numerals must not touch another Chinese numeral ("九" does not hit
"九十一"). Does not: decide which prompts are checkable (the data does).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

from evalkit.scoring.text import is_cjk

_FOLD = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": "-"})
_CN_NUMERALS = set("零〇一二三四五六七八九十百千万亿两")


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text).translate(_FOLD).casefold())


def _word(ch: str) -> bool:
    """A character that continues a word (letters and digits, not CJK, not the apostrophe)."""
    return ch.isalnum() and not is_cjk(ch)


def _bounded(text: str, start: int, end: int) -> bool:
    before, after = text[start - 1 : start], text[end : end + 1]
    if (before and _word(before)) or (after and _word(after)):
        return False
    # a number goes on through "4.2" and "42,000": "42" is not found in "42.5" or "1,042"
    if after in (".", ",") and text[end - 1].isdigit() and text[end + 1 : end + 2].isdigit():
        return False
    return not (before in (".", ",") and text[start].isdigit() and text[start - 2 : start - 1].isdigit())


def _found(text: str, answer: str) -> bool:
    if not answer:
        return False
    cjk = any(is_cjk(ch) for ch in answer)
    numeral = all(ch in _CN_NUMERALS for ch in answer)
    start = text.find(answer)
    while start >= 0:
        end = start + len(answer)
        if numeral:
            ok = text[start - 1 : start] not in _CN_NUMERALS or start == 0
            ok = ok and (end == len(text) or text[end] not in _CN_NUMERALS)
        elif cjk:
            ok = True
        else:
            ok = _bounded(text, start, end)
        if ok:
            return True
        start = text.find(answer, start + 1)
    return False


def answer_hit(response: str, answers_full: Sequence[str]) -> float:
    """1.0 when one of the checkable answers occurs in the response (see the module docstring).

    >>> answer_hit("The capital is Paris.", ["Paris"]), answer_hit("Parisian food", ["Paris"])
    (1.0, 0.0)
    >>> answer_hit("答案是七十二。", ["72", "七十二"]), answer_hit("是九十一", ["九"]), answer_hit("等于７２", ["72"])
    (1.0, 0.0, 1.0)
    >>> answer_hit("It is 420.", ["42"]), answer_hit("4.2", ["42"]), answer_hit("Forty-Two!", ["forty-two"])
    (0.0, 0.0, 1.0)
    """
    if not answers_full:
        raise ValueError("answer_hit needs at least one checkable answer")
    text = _norm(response)
    for answer in answers_full:
        wanted = _norm(answer).strip()
        while wanted and unicodedata.category(wanted[-1])[0] == "P" and not is_cjk(wanted[-1]):
            wanted = wanted[:-1]
        if _found(text, wanted):
            return 1.0
    return 0.0
