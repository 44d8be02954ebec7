"""The first-token metrics of one response, and the scoring of one response.

Owns: the text-level metrics (ft_hit, opener_rate, top3_share) as small functions
of plain values (what each means: `evalkit.scoring.registry`);
`score_response`, which turns one lm-eval response (a string, a list of sampled
strings, or the probe's dict) into per-sample metric values and stored fields.
Does not: run models (distribution-level values arrive already computed by
the probe, see `probe.py`/`firststep.py`), aggregate (lm-eval takes means), or
store anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from evalkit.scoring.text import first_word, is_cjk, matched_start

UNSTABLE_BELOW = 0.70


def ft_hit(response: str, starts: Sequence[str]) -> float:
    """1.0 when the response begins with one of the accepted starts (SPEC 1.1).

    >>> ft_hit("Paris is the capital of France.", ["Paris"]), ft_hit("The capital is Paris", ["Paris"])
    (1.0, 0.0)
    """
    if not starts:
        raise ValueError("ft_hit needs at least one accepted start")
    return 1.0 if matched_start(response, starts) else 0.0


def opener_rate(response: str, openers: Sequence[str]) -> float:
    """1.0 when the response begins with a generic opener from the lexicon (SPEC 1.2).

    >>> opener_rate("Sure! Recursion is ...", ["Sure", "好的"]), opener_rate("好的，递归是", ["Sure", "好的"])
    (1.0, 1.0)
    >>> opener_rate("Surely not", ["Sure"])
    0.0
    """
    if not openers:
        raise ValueError("opener_rate needs a non-empty lexicon")
    return 1.0 if matched_start(response, openers) else 0.0


def ft_outcome(response: str, starts: Sequence[str], openers: Sequence[str]) -> str:
    """`hit`, `opener` or `other` (SPEC 1.1); a hit wins over an opener.

    >>> ft_outcome("Sure, Paris.", ["Paris"], ["Sure"]), ft_outcome("Paris.", ["Paris"], ["Sure"])
    ('opener', 'hit')
    """
    if starts and matched_start(response, starts):
        return "hit"
    if matched_start(response, openers):
        return "opener"
    return "other"


def first_unit_text(response: str) -> str:
    """Text-level first unit, for backends without tokens: the first word, or the
    first character of text that starts with CJK.

    >>> first_unit_text("  Sure, I can"), first_unit_text("递归是")
    ('sure', '递')
    """
    return first_word(response)


def top3_share(first_units: Iterable[str]) -> float:
    """Share of the three most frequent first units among N samples (SPEC 1.4).

    >>> top3_share(["a", "a", "b", "c", "d"])
    0.8
    """
    units = list(first_units)
    if not units:
        raise ValueError("top3_share needs at least one sample")
    return sum(n for _, n in Counter(units).most_common(3)) / len(units)


def candidate_strings(starts: Sequence[str]) -> list[str]:
    """The strings whose probability makes `ft_hit_prob`: the whole start when it
    holds CJK, its first word otherwise (SPEC 1.1), deduplicated.

    >>> candidate_strings(["Recursion", "Le chat", "递归"])
    ['Recursion', 'Le', '递归']
    """
    out = []
    for s in starts:
        s = s.strip()
        if not s:
            continue
        out.append(s if any(is_cjk(c) for c in s) else s.split()[0])
    return list(dict.fromkeys(out))


def score_response(doc: dict[str, Any], resp: Any, openers: Sequence[str]) -> tuple[dict[str, float], dict[str, Any]]:
    """Score one response of a first-token task.

    `resp` is what the model returned for the doc: a string (any lm-eval
    backend), a list of strings (the sampled protocol: N repeats), or the
    probe's dict (`{"text", "first_token", "first_unit", "metrics", ...}`).
    Returns (per-sample metric values, other fields to store).
    """
    starts = list(doc.get("answers") or [])
    probe = resp if isinstance(resp, dict) else None
    samples = list(resp) if isinstance(resp, (list, tuple)) else None
    if probe is not None:
        text = probe["text"]
    elif samples is not None:
        if not samples:
            raise ValueError("no sampled responses")
        text = samples[0]
    else:
        text = resp
    if not isinstance(text, str):
        raise TypeError(f"response must be text, got {type(text).__name__}")

    values: dict[str, float] = {"ft_hit": ft_hit(text, starts), "opener_rate": opener_rate(text, openers)}
    fields: dict[str, Any] = {
        "response": text,
        "ft_outcome": ft_outcome(text, starts, openers),
        "first_unit": first_unit_text(text),
    }
    if samples is not None:
        share = top3_share(first_unit_text(s) for s in samples)
        values["top3_share"] = share
        values["unstable"] = 1.0 if share < UNSTABLE_BELOW else 0.0
        fields["samples"] = samples
    if probe is not None:
        values.update({k: float(v) for k, v in probe.get("metrics", {}).items() if v is not None})
        for key in ("first_token", "first_token_id", "first_unit", "topk", "entropy"):
            if key in probe:
                fields[key] = probe[key]
    return values, fields

