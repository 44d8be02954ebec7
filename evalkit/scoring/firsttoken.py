"""The first-token metrics of one response, and the scoring of one response.

Owns: the text-level metrics (ft_hit, opener_rate, top3_share) as small functions
of plain values (what each means: `evalkit.scoring.registry`);
`score`, which turns one lm-eval response (a string, a list of sampled strings,
or a backend's `FirstStepResult`) into per-sample metric values, once, in the task's
`process_results`; and `stored_fields`, what a samples row keeps of the response.
Does not: run models (distribution-level values arrive already computed by a
engine, see `evalkit.engines`), aggregate (lm-eval takes means), or store anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from evalkit.contract import FirstStepResult, response_text
from evalkit.defaults import UNSTABLE_BELOW, WS_MASS_NOTE
from evalkit.scoring.answers import answer_hit
from evalkit.scoring.text import covers, drop_covered, first_word, is_cjk, matched_start


def ft_hit(response: str, starts: Sequence[str]) -> float:
    """1.0 when the response begins with one of the accepted starts (docs/metrics.md §1.1).

    >>> ft_hit("Paris is the capital of France.", ["Paris"]), ft_hit("The capital is Paris", ["Paris"])
    (1.0, 0.0)
    """
    if not starts:
        raise ValueError("ft_hit needs at least one accepted start")
    return 1.0 if matched_start(response, starts) else 0.0


def opener_rate(response: str, openers: Sequence[str]) -> float:
    """1.0 when the response begins with a generic opener from the lexicon (docs/metrics.md §1.2).

    >>> opener_rate("Sure! Recursion is ...", ["Sure", "好的"]), opener_rate("好的，递归是", ["Sure", "好的"])
    (1.0, 1.0)
    >>> opener_rate("Surely not", ["Sure"])
    0.0
    """
    if not openers:
        raise ValueError("opener_rate needs a non-empty lexicon")
    return 1.0 if matched_start(response, openers) else 0.0


def ft_outcome(values: dict[str, float]) -> str:
    """`hit`, `opener` or `other`, from a response's ft_hit and opener_rate; a hit wins over an opener.

    >>> ft_outcome({"ft_hit": 0.0, "opener_rate": 1.0}), ft_outcome({"ft_hit": 1.0, "opener_rate": 1.0})
    ('opener', 'hit')
    """
    if values.get("ft_hit") == 1.0:
        return "hit"
    if values.get("opener_rate") == 1.0:
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
    """Share of the three most frequent first units among N samples (docs/metrics.md §1.4).

    >>> top3_share(["a", "a", "b", "c", "d"])
    0.8
    """
    units = list(first_units)
    if not units:
        raise ValueError("top3_share needs at least one sample")
    return sum(n for _, n in Counter(units).most_common(3)) / len(units)


def unstable(top3: float) -> float:
    """1.0 when a prompt's top-3 first-unit mass (exact `top3_mass`, or the sampled
    `top3_share`) is below UNSTABLE_BELOW (docs/metrics.md §1.4), else 0.0.

    >>> unstable(0.69), unstable(0.70), unstable(0.95)
    (1.0, 0.0, 0.0)
    """
    return 1.0 if top3 < UNSTABLE_BELOW else 0.0


def candidate_strings(starts: Sequence[str]) -> list[str]:
    """The strings whose probability makes `ft_hit_prob`: the whole start when it
    holds CJK, its first word otherwise (docs/metrics.md §1.1), deduplicated.

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


def answer_strings(answers_full: Sequence[str]) -> list[str]:
    """The strings whose probability makes `answer_prob` (docs/metrics.md §1.7): each checkable answer
    whole, as given and with its first letter in upper case (the two ways a response begins with it;
    answer_hit ignores case), deduplicated.

    >>> answer_strings(["six", "6", "George Washington", "华盛顿", " "])
    ['six', 'Six', '6', 'George Washington', '华盛顿']
    """
    out = []
    for s in answers_full:
        s = s.strip()
        if s:
            out += [s, s[0].upper() + s[1:]]
    return list(dict.fromkeys(out))


def answer_prob(probs: dict[str, float], strings: Sequence[str], tokens: dict[str, list[int]] | None = None) -> float:
    """P(response begins with a checkable answer): the teacher-forced probabilities of `strings`
    (`answer_strings`), summed over those no other string covers (`text.drop_covered`), as
    ft_hit_prob sums the accepted starts. A string without a probability is an error, never a 0.

    >>> answer_prob({"six": 0.125, "Six": 0.25, "6": 0.5}, ["six", "Six", "6"])
    0.875
    >>> answer_prob({"Paris": 0.5, "Paris, France": 0.1}, ["Paris", "Paris, France"], {"Paris": [7], "Paris, France": [7, 2, 9]})
    0.5
    """
    if not strings:
        raise ValueError("answer_prob needs at least one answer string")
    kept = drop_covered(strings, tokens)
    missing = [s for s in kept if s not in probs]
    if missing:
        raise KeyError(f"answer_prob: no probability for {missing!r}")
    return sum(probs[s] for s in kept)


def event_prob(strings: Sequence[str], probs: dict[str, float], tokens: dict[str, list[int]] | None = None,
               paths: dict[str, list[tuple[int, ...]]] | None = None,
               path_probs: dict[tuple[int, ...], float] | None = None) -> float:
    """P(the response, after its leading whitespace, begins with one of `strings`): ft_hit_prob, opener_mass
    and answer_prob (docs/metrics.md "One event for text and probability").

    Without `paths` (an engine that scores each string after the prompt only): the strings' probabilities
    summed over those no other string covers (`text.drop_covered`). With `paths` (string -> its distinct
    token paths, whitespace-led ones included, `engines.leadspace`) and `path_probs` (path -> probability):
    the sum over distinct paths, a path dropped where a string that covers its own as text (`text.covers`)
    has a path that is a prefix of it — `drop_covered`'s rule, path by path — so no token path is counted
    twice. A string without a probability is an error, never a 0.

    >>> event_prob(["Paris", "Paris, France"], {}, None, {"Paris": [(5,), (1, 5)], "Paris, France": [(5, 2), (9,)]},
    ...            {(5,): 0.5, (1, 5): 0.25, (5, 2): 0.125, (9,): 0.0625})
    0.8125
    """
    if not paths:
        kept = drop_covered(strings, tokens)
        missing = [s for s in kept if s not in probs]
        if missing:
            raise KeyError(f"no probability for {missing!r}")
        return sum(probs[s] for s in kept)
    uniq = list(dict.fromkeys(s for s in strings if s))
    missing = [s for s in uniq if s not in paths]
    if missing:
        raise KeyError(f"no paths for {missing!r}")
    owners: dict[tuple[int, ...], list[str]] = {}
    for s in uniq:
        for p in paths[s]:
            owners.setdefault(p, []).append(s)
    total = 0.0
    for p, who in owners.items():
        covered = all(any(o != s and covers(o, s) for k in range(1, len(p) + 1) for o in owners.get(p[:k], ()))
                      for s in who)
        if not covered:
            total += (path_probs or {})[p]
    return total


def whitespace_note(task: str, mean_ws_mass: float | None) -> str | None:
    """The line a run's summary carries when its mean `ws_mass` is above WS_MASS_NOTE, else None.

    >>> whitespace_note("firsttoken_en", 0.91)[:60]
    'firsttoken_en: mean ws_mass 0.910 > 0.5: the template leaves'
    >>> whitespace_note("firsttoken_en", 0.02) is None
    True
    """
    if mean_ws_mass is None or mean_ws_mass <= WS_MASS_NOTE:
        return None
    return (f"{task}: mean ws_mass {mean_ws_mass:.3f} > {WS_MASS_NOTE}: the template leaves the model to open with "
            "whitespace (the probability metrics count the answers after it; a template that ends where the answer "
            "starts, such as `qa` for a base model, measures the answer itself)")


def score(doc: dict[str, Any], resp: Any, openers: Sequence[str]) -> dict[str, float]:
    """The per-sample metric values of one first-token response (the task's `process_results`).

    `resp` is a string (any lm-eval backend), a list of N sampled strings (the sampled
    protocol), or a `FirstStepResult` (evalkit's backends), whose distribution-level
    values are taken as the backend computed them.
    """
    starts = list(doc.get("answers") or [])
    text = response_text(resp)
    skipped = set(resp.skipped) if isinstance(resp, FirstStepResult) else set()
    if text is None and not {"ft_hit", "opener_rate"} <= skipped:  # only a selection may leave out the response
        raise TypeError("a response without text must name the metrics it leaves uncomputed (skipped)")
    values: dict[str, float] = {}
    if text is not None:
        values.update(ft_hit=ft_hit(text, starts), opener_rate=opener_rate(text, openers))
    if isinstance(resp, (list, tuple)):
        share = top3_share(first_unit_text(s) for s in resp)
        values["top3_share"] = share
        values["unstable"] = unstable(share)
    if isinstance(resp, FirstStepResult):
        values.update({k: float(v) for k, v in resp.metrics.items() if v is not None})
    if doc.get("answers_full") and "answer_hit" not in skipped:  # docs/metrics.md §1.7: is the whole answer right?
        answer = resp.answer_text if isinstance(resp, FirstStepResult) and resp.answer_text is not None else text
        if answer is not None:
            values["answer_hit"] = answer_hit(answer, doc["answers_full"])
            if "ft_token_hit" in values:
                values["ft_answer_mismatch"] = float(values["ft_token_hit"] != values["answer_hit"])
    return {k: v for k, v in values.items() if k not in skipped}  # a skipped metric is NULL, never a value


def stored_fields(resp: Any) -> dict[str, Any]:
    """What a `samples` row keeps of one response besides its metric values (read, not scored).

    >>> stored_fields("Sure, Paris.")
    {'response': 'Sure, Paris.', 'first_unit': 'sure'}
    """
    text = response_text(resp)
    if isinstance(resp, FirstStepResult):  # text and first_unit None where no response was generated
        return {"response": text, "first_unit": resp.first_unit, "first_token": resp.first_token,
                "first_token_id": resp.first_token_id, "topk": resp.topk, "units": resp.units, "answer": resp.answer_text}
    return {"response": text, "first_unit": first_unit_text(text) if text is not None else None}
