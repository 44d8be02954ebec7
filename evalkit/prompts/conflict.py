"""Conflicting facts at the start and the end of a prompt (docs/metrics.md §1.9): the needle_conflict documents.

Owns: one document per (language, length, pair of values, order): the haystack of the
needle tasks with the same key stated twice, with two different values — "The access
code is A." as the very first sentence and "The access code is B." as the last sentence
before the question — and nothing else changed. Each pair comes in both orders (`ab`:
A first, B last; `ba`: B first, A last) over the same filler text, so a model that
answers by position switches values between the two, and one that prefers a value keeps
it. The prompt has the requested length in the model's own tokens (within 2 %), as the
needle documents have (`needle.fit_fillers`).

Does not: score responses (`scoring.conflict`), load a tokenizer, or render templates
(the caller's `count_tokens` counts the whole prompt, template included).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence

from evalkit.errors import BadInput
from evalkit.prompts.needle import (
    _SENTENCE_JOINER,
    _check_lang,
    fit_fillers,
    load_haystack,
    make_key,
    needle_sentence,
    question,
)
from evalkit.prompts.presets import DEFAULT_LENGTHS

DEFAULT_PAIRS = 8  # pairs of values per language and length (each in both orders)
ORDERS = ("ab", "ba")


def conflict_pair_id(lang: str, length: int, pair: int) -> str:
    """The id both orders of one pair share, e.g. "en-L512-p3"."""
    return f"{lang}-L{length}-p{pair}"


def _values(rng: random.Random) -> tuple[str, str]:
    """Two keys that differ in both halves (no 4-digit group of one is a group of the other)."""
    a = make_key(rng)
    while True:
        b = make_key(rng)
        if not set(a.split("-")) & set(b.split("-")):
            return a, b


def build_conflict_doc(
    count_tokens: Callable[[str], int],
    *,
    lang: str,
    length: int,
    pair: int,
    order: str,
    seed: int,
    haystack: Sequence[str] | None = None,
) -> dict:
    """One conflict document whose whole prompt is ``length`` tokens within +-2 %.

    The values A and B and the filler's starting sentence depend only on (seed, lang,
    length, pair), so the two orders of a pair differ in nothing but which value comes
    first.
    """
    _check_lang(lang)
    if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
        raise BadInput(f"needle length must be a positive integer, got {length!r}")
    if order not in ORDERS:
        raise BadInput(f"conflict order must be one of {', '.join(ORDERS)}, got {order!r}")
    pool = list(haystack) if haystack is not None else load_haystack(lang)
    if not pool:
        raise BadInput(f"needle haystack for {lang!r} is empty")
    rng = random.Random(f"{seed}-{lang}-conflict-{length}-p{pair}")
    key_a, key_b = _values(rng)
    start = rng.randrange(len(pool))
    first_key, last_key = (key_a, key_b) if order == "ab" else (key_b, key_a)
    first, last = needle_sentence(first_key, lang), needle_sentence(last_key, lang)
    tail = "\n\n" + question(lang, False)
    joiner = _SENTENCE_JOINER[lang]

    def fillers(n: int) -> list[str]:
        return [pool[(start + i) % len(pool)] for i in range(n)]

    def compose(sentences: list[str]) -> str:
        return joiner.join([first, *sentences, last]) + tail

    chosen = fit_fillers(count_tokens, compose, fillers, length=length, lang=lang,
                         fixed="the two value sentences and the question")
    prompt = compose(chosen)
    return {
        "doc_id": f"{conflict_pair_id(lang, length, pair)}-{order}",
        "pair_id": conflict_pair_id(lang, length, pair),
        "lang": lang,
        "length": length,
        "n_tokens": count_tokens(prompt),
        "pair": pair,
        "order": order,
        "first_key": first_key,
        "last_key": last_key,
        "first": first,
        "last": last,
        "n_sentences": len(chosen) + 2,
        "prompt": prompt,
        "answers": [first_key, last_key],
    }


def build_conflict_grid(
    count_tokens: Callable[[str], int],
    *,
    langs: Iterable[str],
    lengths: Iterable[int] = DEFAULT_LENGTHS,
    pairs: int = DEFAULT_PAIRS,
    seed: int,
) -> list[dict]:
    """Every (lang, pair, length, order) document, pair-major: the first 2 × k × len(lengths)
    documents of a language hold k complete pairs at every length (so `--limit` keeps pairs whole)."""
    if isinstance(pairs, bool) or not isinstance(pairs, int) or pairs < 1:
        raise BadInput(f"conflict pairs must be a whole number >= 1, got {pairs!r}")
    lengths = list(lengths)
    docs = []
    for lang in langs:
        pool = load_haystack(lang)
        for pair in range(pairs):
            for length in lengths:
                for order in ORDERS:
                    docs.append(build_conflict_doc(count_tokens, lang=lang, length=length, pair=pair, order=order,
                                                   seed=seed, haystack=pool))
    ids = [d["doc_id"] for d in docs]
    if len(set(ids)) != len(ids):
        raise BadInput("conflict grid has repeated cells; give each length once")
    return docs
