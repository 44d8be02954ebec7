"""Needle-in-a-haystack documents and the needle metrics (docs/metrics.md §1.6).

Owns: the filler haystacks in ``tasks/needle/data/``, building one needle
document (key, needle sentence, placement at depth d, filler sized to a target
length in the model's own tokens), the depth x length grid of such documents,
Scoring a response is ``evalkit.scoring.needle``.

Does not: import lm-eval, load a model or tokenizer, or render a chat
template. Token counting is the caller's ``count_tokens(user_text) -> int``,
which must count the whole prompt the model sees for that user message
(template included). The lm-eval task wiring and the plots live elsewhere
(``evalkit.report.needle_plot`` for the heatmap and the recall-by-depth curve).
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterable, Sequence

from evalkit.defaults import MIDDLE_BAND
from evalkit.errors import BadInput
from evalkit.paths import read_input
from evalkit.prompts.catalog import data_path
from evalkit.prompts.presets import DEFAULT_LENGTHS

MAX_HAYSTACK_BYTES = 64 << 20  # a haystack's filler text: a few hundred kB

LANGS = ("en", "zh")
DEFAULT_DEPTHS = tuple(round(i / 10, 1) for i in range(11))  # 0.0, 0.1, ..., 1.0
LENGTH_TOLERANCE = 0.02  # |n_tokens - length| <= 2 % of length


_QUESTION = {
    "en": "What is the access code mentioned in the text above? Answer with the code only.",
    "zh": "上文提到的编号是多少？只回答编号。",
}
# region -> hint sentence; see hint_text for which depth maps to which region
_HINTS = {
    "en": {
        "first": "Look at the first sentence.",
        "start": "Look near the start of the text.",
        "middle": "Look near the middle of the text.",
        "end": "Look near the end of the text.",
    },
    "zh": {
        "first": "请看第一句话。",
        "start": "请看文章的开头部分。",
        "middle": "请看文章的中间部分。",
        "end": "请看文章的结尾部分。",
    },
}
_SENTENCE_JOINER = {"en": " ", "zh": ""}
_SENTENCE_END = {"en": ".", "zh": "。"}
_SPLIT = {"en": re.compile(r"(?<=[.!?])\s+"), "zh": re.compile(r"(?<=[。！？])")}

def _check_lang(lang: str) -> None:
    if lang not in LANGS:
        raise BadInput(f"unknown needle language {lang!r}; expected one of {', '.join(LANGS)}")


def split_sentences(text: str, lang: str) -> list[str]:
    """Split text into sentences, keeping terminators.

    English splits after ``.``, ``!`` or ``?`` followed by whitespace; Chinese
    splits after ``。``, ``！`` or ``？``. Each sentence is stripped and empty
    ones are dropped: ``"A b. C d!\\nE?" -> ["A b.", "C d!", "E?"]``.
    """
    _check_lang(lang)
    return [s.strip() for s in _SPLIT[lang].split(text) if s.strip()]


def load_haystack(lang: str) -> list[str]:
    """The filler sentences of ``tasks/needle/data/haystack_{lang}.txt``."""
    _check_lang(lang)
    path = data_path("needle", "data", f"haystack_{lang}.txt")
    try:
        text = read_input(path, "needle haystack", MAX_HAYSTACK_BYTES).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"needle haystack {path} is not UTF-8 text ({exc.reason})") from exc
    sentences = split_sentences(text, lang)
    if not sentences:
        raise BadInput(f"needle haystack {path} is empty")
    return sentences


def make_key(rng: random.Random) -> str:
    """A key "DDDD-DDDD" with a non-zero first digit, e.g. "7391-2046"."""
    digits = str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(7))
    return f"{digits[:4]}-{digits[4:]}"


def needle_sentence(key: str, lang: str) -> str:
    """The sentence carrying the key: "The access code is {key}." / "编号是{key}。"."""
    _check_lang(lang)
    return f"The access code is {key}." if lang == "en" else f"编号是{key}。"


def hint_text(lang: str, depth: float) -> str:
    """The pointer the hint variant puts before the question.

    It names where the needle is: d == 0.0 -> "Look at the first sentence." /
    "请看第一句话。"; 0 < d < 0.3 -> the start; 0.3 <= d <= 0.7 -> the middle
    (``defaults.MIDDLE_BAND``, the band ``middle_gap`` calls middle); d > 0.7 -> the end.
    """
    _check_lang(lang)
    if depth == 0.0:
        region = "first"
    elif depth < MIDDLE_BAND[0]:
        region = "start"
    elif depth <= MIDDLE_BAND[1]:
        region = "middle"
    else:
        region = "end"
    return _HINTS[lang][region]


def question(lang: str, hint: bool, depth: float = 0.0) -> str:
    """The question that ends the prompt, with the depth-aware hint first when ``hint``."""
    _check_lang(lang)
    if not hint:
        return _QUESTION[lang]
    return _SENTENCE_JOINER[lang].join([hint_text(lang, depth), _QUESTION[lang]])


def needle_index(depth: float, n_filler: int) -> int:
    """Sentence index of the needle among ``n_filler`` filler sentences: round half up of d * n."""
    return int(math.floor(depth * n_filler + 0.5))


def _depth_label(depth: float) -> str:
    # 0.5 -> "0.5"; depths off the 0.1 grid keep their digits (0.25 -> "0.25")
    return f"{depth:.1f}" if round(depth, 1) == depth else f"{depth:g}"


def doc_id(lang: str, length: int, depth: float, hint: bool) -> str:
    """Stable id of one grid cell, e.g. "en-L512-d0.3-hint"."""
    return f"{lang}-L{length}-d{_depth_label(depth)}-{'hint' if hint else 'plain'}"


def _trimmed_prefixes(sentence: str, lang: str) -> list[list[str]]:
    """Shorter versions of a filler sentence, by granularity (words, then characters).

    Each list is ordered shortest first and each version ends with a terminator;
    zh has only the character list.
    """
    end = _SENTENCE_END[lang]
    body = sentence.rstrip(".!?。！？")
    by_char = [body[:c].rstrip(" ,;:，、；：") + end for c in range(1, len(body))]
    levels = [by_char]
    if lang == "en":
        words = body.split()
        levels.insert(0, [" ".join(words[:w]).rstrip(",;:") + end for w in range(1, len(words))])
    return [[p for p in level if p != end] for level in levels]


def _fit_prefix(
    tokens_with: Callable[[str], int], prefixes: list[str], length: int, tol: float
) -> str | None:
    """The prefix whose prompt is closest to ``length`` within ``tol``, or None.

    Bisection for the longest prefix at or under ``length + tol``, then its
    neighbours; ``prefixes`` is ordered shortest first.
    """
    counts: dict[int, int] = {}  # prefix index -> tokens

    def tokens(i: int) -> int:
        if i not in counts:
            counts[i] = tokens_with(prefixes[i])
        return counts[i]

    lo, hi = -1, len(prefixes)  # assumed: tokens(lo) <= length + tol < tokens(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens(mid) <= length + tol:
            lo = mid
        else:
            hi = mid
    fits = [i for i in range(max(0, lo - 2), min(len(prefixes), lo + 3))
            if abs(tokens(i) - length) <= tol]
    if not fits:
        return None
    return prefixes[min(fits, key=lambda i: (abs(tokens(i) - length), -i))]


def fit_fillers(
    count_tokens: Callable[[str], int],
    compose: Callable[[list[str]], str],
    fillers: Callable[[int], list[str]],
    *,
    length: int,
    lang: str,
    fixed: str,
) -> list[str]:
    """The filler sentences whose composed prompt is ``length`` tokens within +-2 %.

    ``fillers(n)`` gives the first n filler sentences, ``compose(sentences)`` the prompt
    they make with the document's fixed parts (named ``fixed`` in messages). The number
    of fillers is found by doubling and bisection on ``count_tokens``, then the closest
    of its neighbours within tolerance; when no whole number of sentences fits, the last
    filler sentence is cut by words (en) or characters (zh, and en as a fallback).
    """
    tol = LENGTH_TOLERANCE * length
    upper = length + tol
    counts: dict[int, int] = {}  # n fillers -> tokens

    def tokens_for(n: int) -> int:
        if n not in counts:
            counts[n] = count_tokens(compose(fillers(n)))
        return counts[n]

    bare = tokens_for(0)
    if bare > upper:
        raise BadInput(
            f"needle length {length} is too small for {lang}: {fixed} alone "
            f"take {bare} tokens"
        )

    # largest n with tokens <= upper: doubling, then bisection
    max_fillers = 4 * length + 64
    lo, hi = 0, 1
    while tokens_for(hi) <= upper:
        if hi >= max_fillers:
            raise BadInput(
                f"needle length {length} not reachable for {lang}: count_tokens stays at "
                f"{tokens_for(hi)} with {hi} filler sentences"
            )
        lo, hi = hi, min(2 * hi, max_fillers)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens_for(mid) <= upper:
            lo = mid
        else:
            hi = mid

    # local adjustment: closest whole-sentence count within tolerance
    near = [n for n in range(max(0, lo - 2), lo + 3) if abs(tokens_for(n) - length) <= tol]
    if near:
        return fillers(min(near, key=lambda n: (abs(tokens_for(n) - length), n)))
    # whole sentences jump over the window: cut the last of lo + 1 fillers
    base = fillers(lo + 1)
    for prefixes in _trimmed_prefixes(base[-1], lang):
        cut = _fit_prefix(lambda text: count_tokens(compose(base[:-1] + [text])), prefixes, length, tol)
        if cut is not None:
            return base[:-1] + [cut]
    raise BadInput(
        f"needle length {length} cannot be met within 2 % for {lang}: "
        f"{lo} filler sentences give {tokens_for(lo)} tokens, {lo + 1} give {tokens_for(lo + 1)}"
    )


def build_doc(
    count_tokens: Callable[[str], int],
    *,
    lang: str,
    length: int,
    depth: float,
    hint: bool,
    seed: int,
    haystack: Sequence[str] | None = None,
) -> dict:
    """One needle document whose whole prompt is ``length`` tokens within +-2 %.

    The user text is filler sentences (the haystack, cycled from a seed-dependent
    start) with the needle inserted as sentence ``needle_index(depth, n)`` among
    ``n`` fillers (d = 0.0: the very first sentence; d = 1.0: the last one before
    the question), then a blank line and the question. ``n`` is fitted by
    ``fit_fillers``; the needle and question are never cut. The key depends only on (seed, lang, length, depth),
    so the hint and plain variants of a cell share it.
    """
    _check_lang(lang)
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise BadInput(f"needle length must be a positive integer, got {length!r}")
    depth = float(depth)
    if not 0.0 <= depth <= 1.0:
        raise BadInput(f"needle depth must be within [0, 1], got {depth}")
    filler_pool = list(haystack) if haystack is not None else load_haystack(lang)
    if not filler_pool:
        raise BadInput(f"needle haystack for {lang!r} is empty")

    rng = random.Random(f"{seed}-{lang}-{length}-{_depth_label(depth)}")
    key = make_key(rng)
    start = rng.randrange(len(filler_pool))
    needle = needle_sentence(key, lang)
    tail = "\n\n" + question(lang, hint, depth)
    joiner = _SENTENCE_JOINER[lang]

    def fillers(n: int) -> list[str]:
        return [filler_pool[(start + i) % len(filler_pool)] for i in range(n)]

    def compose(sentences: list[str]) -> tuple[str, int]:
        k = needle_index(depth, len(sentences))
        return joiner.join(sentences[:k] + [needle] + sentences[k:]) + tail, k

    chosen = fit_fillers(count_tokens, lambda sentences: compose(sentences)[0], fillers, length=length, lang=lang,
                         fixed="needle and question")
    prompt, k = compose(chosen)
    return {
        "doc_id": doc_id(lang, length, depth, hint),
        "lang": lang,
        "depth": depth,
        "length": length,
        "n_tokens": count_tokens(prompt),
        "hint": bool(hint),
        "key": key,
        "needle": needle,
        "needle_index": k,
        "n_sentences": len(chosen) + 1,
        "prompt": prompt,
        "answers": [key],
    }


def build_grid(
    count_tokens: Callable[[str], int],
    *,
    langs: Iterable[str],
    lengths: Iterable[int] = DEFAULT_LENGTHS,
    depths: Iterable[float] = DEFAULT_DEPTHS,
    hint: bool | Iterable[bool],
    seed: int,
) -> list[dict]:
    """Every (lang, length, depth, hint) document, in that nesting order.

    ``hint`` is one flag or several, e.g. ``(False, True)`` for paired variants.
    """
    hints = [bool(hint)] if isinstance(hint, bool) else [bool(h) for h in hint]
    docs = []
    for lang in langs:
        pool = load_haystack(lang)
        for length in lengths:
            for depth in depths:
                for h in hints:
                    docs.append(build_doc(count_tokens, lang=lang, length=length, depth=depth,
                                          hint=h, seed=seed, haystack=pool))
    ids = [d["doc_id"] for d in docs]
    if len(set(ids)) != len(ids):
        raise BadInput("needle grid has repeated cells; give each lang, length and depth once")
    return docs
