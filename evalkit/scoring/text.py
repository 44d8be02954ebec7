"""Text-level answer starts: normalisation, the first word, and matching a start.

Owns: the docs/metrics.md §1.1 normalisation (NFKC, casefold, whitespace and leading
punctuation stripped) and the rule deciding whether a response *begins with*
an accepted start. Does not: look at tokens or probabilities (see
`engines.firststep`), or know which starts are accepted (the task data does).
"""

from __future__ import annotations

import re
import unicodedata

# Curly quotes and dashes folded to ASCII so "I’d" matches "I'd".
_FOLD = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": "-"})


def is_punct(ch: str) -> bool:
    """Unicode punctuation or symbol (CJK full stops and brackets included)."""
    return unicodedata.category(ch)[0] in "PS"


def is_cjk(ch: str) -> bool:
    """A Han, kana or hangul character: scripts written without spaces between words."""
    cp = ord(ch)
    return (
        0x3040 <= cp <= 0x30FF  # kana
        or 0x3400 <= cp <= 0x4DBF
        or 0x4E00 <= cp <= 0x9FFF
        or 0xF900 <= cp <= 0xFAFF
        or 0xAC00 <= cp <= 0xD7AF  # hangul
        or 0x20000 <= cp <= 0x2FA1F
    )


def normalize(text: str) -> str:
    """NFKC, casefold, whitespace collapsed and stripped, leading punctuation dropped.

    >>> normalize("  **Sure!** Here")
    'sure!** here'
    >>> normalize("「巴黎」")
    '巴黎」'
    """
    text = unicodedata.normalize("NFKC", text).translate(_FOLD).casefold()
    text = re.sub(r"\s+", " ", text).strip()
    i = 0
    while i < len(text) and (is_punct(text[i]) or text[i].isspace()):
        i += 1
    return text[i:]


def _is_word_char(ch: str) -> bool:
    return (ch.isalnum() or ch in "'_") and not is_cjk(ch)


def starts_with(response: str, start: str) -> bool:
    """Does the response begin with `start` (docs/metrics.md §1.1 matching)?

    Both sides are normalised. A start that contains CJK characters is compared
    on the response's first k characters (k = its length). Otherwise the
    response must begin with the start's words and the start must end at a word
    boundary, which is the first-word rule generalised to multi-word starts.

    >>> starts_with("Paris is the capital.", "Paris"), starts_with("Parisian food", "Paris")
    (True, False)
    >>> starts_with("递归是一种方法", "递归"), starts_with("Of course! Here", "of course")
    (True, True)
    >>> starts_with("42等于", "42"), starts_with("420", "42"), starts_with("42,000", "42")
    (True, False, False)
    >>> starts_with("Well-known fact", "Well"), starts_with("Well, it depends", "Well")
    (False, True)
    """
    r, s = normalize(response), normalize(start)
    while s and is_punct(s[-1]):
        s = s[:-1]
    if not s or not r.startswith(s):
        return False
    if any(is_cjk(ch) for ch in s):
        return True
    if not _is_word_char(s[-1]):
        return True
    nxt, after = r[len(s) : len(s) + 1], r[len(s) + 1 : len(s) + 2]
    if not nxt:
        return True
    if _is_word_char(nxt):
        return False
    if nxt == "-" and after and _is_word_char(after):  # "well-known" is one word
        return False
    if nxt in ".," and s[-1].isdigit() and after.isdigit():  # "4.2", "42,000" are one number
        return False
    return True


def first_word(text: str) -> str:
    """The response's first word after normalisation: whitespace-delimited and
    stripped of punctuation, or its first character when it starts with CJK.

    >>> first_word("  Sure, here is"), first_word("好的，我来解释"), first_word("")
    ('sure', '好', '')
    """
    t = normalize(text)
    if not t:
        return ""
    if is_cjk(t[0]):
        return t[0]
    word = t.split(" ", 1)[0]
    out = []
    for ch in word:
        if is_cjk(ch):
            break
        out.append(ch)
    word = "".join(out)
    while word and is_punct(word[-1]):
        word = word[:-1]
    return word


def matched_start(response: str, starts) -> str | None:
    """The first of `starts` the response begins with, or None."""
    for s in starts:
        if starts_with(response, s):
            return s
    return None


def covers(shorter: str, longer: str) -> bool:
    """Does the text `longer` begin with `shorter` as a whole unit: whole words for
    space-delimited scripts, characters for CJK (and any string ending in CJK)?

    >>> covers("Sure", "Sure thing"), covers("So", "Sorry"), covers("So", "Some"), covers("好", "好的")
    (True, False, False, True)
    >>> covers("Sure", "Sure,"), covers("Sure", "Sure"), covers("Well", "Well-known")
    (True, True, False)
    """
    if not shorter or not longer.startswith(shorter):
        return False
    if len(longer) == len(shorter) or is_cjk(shorter[-1]) or not _is_word_char(shorter[-1]):
        return True
    nxt, after = longer[len(shorter)], longer[len(shorter) + 1 : len(shorter) + 2]
    if _is_word_char(nxt) or is_cjk(nxt):
        return False
    return not (nxt == "-" and after and _is_word_char(after))  # "Well-known" is one word


def drop_covered(strings, tokens: dict[str, list[int]] | None = None) -> list[str]:
    """The strings whose probabilities are summed (docs/metrics.md §1.2): a string is dropped when another
    string of the set covers it as text (`covers`: "Sure" covers "Sure thing"; "So" covers
    neither "Sorry" nor "Some") and, where `tokens` gives each string's tokens in context, the
    covering string's tokens are a prefix of the covered one's — only then does the shorter
    string's probability already hold the longer one's. A tokenizer with one token for 好的
    keeps 好的 beside 好. Order of first appearance is kept; duplicates go too.

    >>> drop_covered(["Sure", "Sure thing", "Of course", "Su", "So", "Sorry"])
    ['Sure', 'Of course', 'Su', 'So', 'Sorry']
    >>> drop_covered(["好", "好的"], {"好": [1], "好的": [1, 2]}), drop_covered(["好", "好的"], {"好": [1], "好的": [7]})
    (['好'], ['好', '好的'])
    """
    uniq = list(dict.fromkeys(s for s in strings if s))

    def covered(s: str) -> bool:
        for o in uniq:
            if o == s or not covers(o, s):
                continue
            if tokens is None or tokens.get(s, [])[: len(tokens.get(o, []))] == tokens.get(o, []):
                return True
        return False

    return [s for s in uniq if not covered(s)]
