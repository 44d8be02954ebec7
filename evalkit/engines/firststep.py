"""What every engine's first step shares: its result, candidate and unit token ids, the candidate trie's rule.

Owns: `FirstStep` (what one prompt's first step looked like, whichever engine computed it), a
candidate string's tokens in its real context (`candidate_ids`, `context_tail`, `first_ids`),
the first unit of a token sequence (`first_unit_ids`, `UNIT_RANKS`, `UNIT_TOKENS`), pure helpers
on a step (`top_mass`, `topk_dict`), the seed of a sampled first token (`SEED_STRIDE`), and the
candidate trie's specification: which of a level's new prefixes are left unscored under a
prompt's `tolerance` (`tolerance_cut`), the one rule the transformers and llama.cpp engines both
apply, so both leave out the same share.
Does not: run a model (each engine's `firststep` does), or know lm-eval, tasks or metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from evalkit.prompts.encoding import encode, raw_ids

Node = TypeVar("Node", bound=Hashable)  # a trie node: a proper prefix of a candidate's tokens

# a sampled first token's generator is seeded with seed * SEED_STRIDE + the prompt's index, in every engine
SEED_STRIDE = 1_000_003
UNIT_RANKS = 10  # the likeliest first tokens whose first unit a run stores (first_token_topk.unit)
UNIT_TOKENS = 4  # a first unit is completed over at most this many tokens (a UTF-8 character has <= 4 bytes)


@dataclass
class FirstStep:
    """What one prompt's first step looked like, and what the model went on to say."""

    context_ids: list[int]  # prompt tokens (no padding)
    topk_ids: list[int]  # k most likely first tokens, descending
    topk_logprobs: list[float]  # natural-log probabilities, same order
    entropy: float  # full-vocabulary entropy in nats
    logprobs: torch.Tensor  # (V,) float32 log-softmax of the first step
    candidate_probs: dict[str, float] = field(default_factory=dict)  # candidate -> P(response starts with it)
    candidate_tokens: dict[str, list[int]] = field(default_factory=dict)  # candidate -> its tokens in context
    unscored_mass: float = 0.0  # bound on how much any sum of candidate_probs falls short (<= tolerance)
    # with the whitespace-led event (`leadspace`): candidate -> its distinct token paths, path -> probability
    candidate_paths: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)
    path_probs: dict[tuple[int, ...], float] = field(default_factory=dict)
    candidate_positions: int = 0  # trie nodes teacher-forced for this prompt
    unit_positions: int = 0  # first-unit nodes forwarded that the trie did not already feed
    response_ids: list[int] = field(default_factory=list)  # generated tokens, stop/eos excluded
    answer_ids: list[int] = field(default_factory=list)  # the longer continuation asked for (answer_tokens), eos excluded
    units: dict[int, str] = field(default_factory=dict)  # top token id -> its first unit (unit_ranks)
    first_token_id: int = -1  # the token chosen at step 1 (== response_ids[0] unless it was eos)
    attention: Any = None  # attention.PromptAttention of the prefill, when asked for (`probe(attention=...)`)
    first_chars: Any = None  # firstchar.FirstChars: the first-character distribution (None: not read)


def context_tail(joint: Sequence[int], context_ids: Sequence[int]) -> list[int] | None:
    """The tokens of ids(context + candidate) past ids(context); None when the joint tokenisation
    does not start with the context's own tokens (a merge across the boundary: the caller then
    tokenises the candidate alone).

    >>> context_tail([1, 2, 3, 4], [1, 2]), context_tail([1, 5, 4], [1, 2]), context_tail([1, 2], [1, 2])
    ([3, 4], None, None)
    """
    n = len(context_ids)
    if len(joint) > n and list(joint[:n]) == list(context_ids):
        return list(joint[n:])
    return None


def candidate_ids(
    tokenizer,
    context: str,
    candidate: str,
    context_ids: list[int] | None = None,
) -> list[int]:
    """The candidate's tokens in its real context: ids(context + candidate) past ids(context), both
    as the model is fed them (`encoding.encode`: the declared BOS first).

    When the joint tokenisation does not start with the context's own tokens (a merge
    across the boundary), the candidate is tokenised alone instead.
    """
    if context_ids is None:
        context_ids = encode(tokenizer, context)
    tail = context_tail(encode(tokenizer, context + candidate), context_ids)
    return tail if tail is not None else raw_ids(tokenizer, candidate)


def first_ids(tokenizer, context: str, strings: Iterable[str]) -> set[int]:
    """The first token of each string tokenised in context (`candidate_ids`): the token a
    strict, token-level hit must start with (docs/metrics.md §1.1 `ft_token_hit`)."""
    context_ids = encode(tokenizer, context)
    return {ids[0] for s in strings if (ids := candidate_ids(tokenizer, context, s, context_ids))}


def start_mass(logprobs: torch.Tensor, token_ids: Iterable[int]) -> float:
    """The first-step probability of the tokens `token_ids` (each counted once) under `logprobs` (V,):
    `opener_start_mass` with the first tokens the lexicon's openers begin with in context (`first_ids`).

    >>> round(start_mass(torch.log(torch.tensor([0.5, 0.3, 0.2])), [2, 0, 2]), 4)
    0.7
    """
    ids = sorted({int(t) for t in token_ids})
    return float(torch.exp(logprobs.detach().float().reshape(-1)[ids]).sum()) if ids else 0.0


def opener_variants(entries: Iterable[str]) -> list[str]:
    """Each opener of the lexicon as written and after a space: the strings whose first tokens
    `--ban-openers` masks at the first step, on every engine."""
    return [text for entry in entries for text in (entry, " " + entry)]


def prompt_frame(context: str, doc: Mapping) -> str | None:
    """The template frame a context was built in: the context with its prompt replaced by NUL, the
    key of its content-free prior; None where the doc's prompt is not in the context exactly once."""
    prompt = doc.get("prompt")
    if not isinstance(prompt, str) or not prompt or context.count(prompt) != 1:
        return None
    return context.replace(prompt, "\x00")


def top_mass(logprobs: torch.Tensor, k: int = 3, temperature: float = 1.0) -> float:
    """Probability mass of the k most likely tokens of softmax(logits / temperature).

    `logprobs` may be logits or log-probabilities: log_softmax(logits) / T renormalised
    equals logits / T renormalised. Temperature 0 means argmax (mass 1).

    >>> lp = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.1]))
    >>> round(top_mass(lp, k=3), 4)
    0.9
    >>> round(top_mass(lp, k=1, temperature=0.5), 4)  # 0.25 / (0.25 + 0.09 + 0.01 + 0.01)
    0.6944
    >>> top_mass(torch.tensor([]))
    0.0
    """
    if logprobs.numel() == 0 or k <= 0:
        return 0.0
    if temperature <= 0:
        return 1.0
    probs = torch.softmax(logprobs.detach().float().reshape(-1) / temperature, dim=-1)
    return float(torch.topk(probs, min(k, probs.numel())).values.sum())


def topk_dict(step: FirstStep, k: int) -> dict[int, float]:
    """The step's k most likely first tokens as `token_id -> logprob`, most likely first.

    >>> s = FirstStep([5], [17, 4, 9], [-0.1, -2.3, -4.0], 0.5, torch.zeros(0))
    >>> topk_dict(s, 2)
    {17: -0.1, 4: -2.3}
    >>> topk_dict(s, 0)
    {}
    """
    if k <= 0:
        return {}
    return dict(zip(step.topk_ids[:k], step.topk_logprobs[:k]))


def first_unit_ids(decode: Callable[[list[int]], str], ids: Sequence[int]) -> tuple[str, int]:
    """The first unit (docs/metrics.md §1.0): shortest prefix of `ids` whose text is whole.

    Whole: at least one non-whitespace character and no U+FFFD (a split UTF-8 character
    or byte-fallback token decodes to one until its last byte arrives). Returns the
    prefix's text, stripped, and its length in tokens; ("", len(ids)) if none qualifies.

    >>> pieces = {1: b" ", 2: b"\\xe9", 3: b"\\x80\\x92", 4: b"x"}  # "递" = e9 80 92
    >>> decode = lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", "replace")
    >>> first_unit_ids(decode, [1, 2, 3, 4])
    ('递', 3)
    >>> first_unit_ids(decode, [1, 2])
    ('', 2)
    >>> first_unit_ids(decode, [])
    ('', 0)
    """
    ids = list(ids)
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        if "\ufffd" not in text and text.strip():
            return text.strip(), n
    return "", len(ids)


def tolerance_cut(fresh: Iterable[Node], log_p: Mapping[Node, float], kept: Collection[Node],
                  budget: float) -> tuple[list[Node], float]:
    """One level of a candidate trie: (the new prefixes that are fed, the budget left).

    The least likely new prefixes are left out, least likely first, while their probabilities
    (`exp(log_p[node])`) add up to at most `budget`, what is left of the prompt's `tolerance`;
    the first that does not fit is fed, with every likelier one. Prefixes in `kept` (those of the
    prompt's exact candidates) are always fed and cost nothing. Ties go by the node itself, so the
    cut does not depend on the order the prefixes came in.

    >>> lp = {"a": math.log(0.01), "b": math.log(0.02), "c": math.log(0.5)}
    >>> level, left = tolerance_cut(["c", "b", "a"], lp, set(), 0.025)
    >>> level, round(left, 4)
    (['b', 'c'], 0.015)
    >>> level, left = tolerance_cut(["c", "b", "a"], lp, {"a"}, 0.025)  # "a" is kept and costs nothing
    >>> level, round(left, 4)
    (['a', 'c'], 0.005)
    """
    order = sorted(fresh, key=lambda n: (log_p[n], n))
    level: list[Node] = []
    for j, node in enumerate(order):
        if node in kept:
            level.append(node)
            continue
        p = math.exp(log_p[node])
        if p > budget:  # this one and every likelier one is scored
            level += order[j:]
            break
        budget -= p
    return level, budget


_SPECIALS: Any = None  # weakref.WeakKeyDictionary: tokenizer -> the ids of its special tokens (`special_ids`)


def special_ids(tokenizer) -> list[int]:
    """The ids of the tokens that add no text to a response (`engines.vocab`: a piece of None — EOS, end
    of turn, BOS, control and unused tokens), once per tokenizer object."""
    global _SPECIALS
    import weakref

    from evalkit.engines.vocab import vocab_table

    if _SPECIALS is None:
        _SPECIALS = weakref.WeakKeyDictionary()
    try:
        return _SPECIALS[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = [i for i, piece in enumerate(vocab_table(tokenizer).pieces) if piece is None]
    try:
        _SPECIALS[tokenizer] = ids
    except TypeError:  # an object that takes no weak reference: computed each time
        pass
    return ids


def special_mass(logprobs: torch.Tensor, tokenizer) -> float:
    """`special_mass`: the first-step probability of the tokens that add no text (`special_ids`) under
    `logprobs` (V,); the mass on a response that ends, or says nothing, at once (docs/metrics.md
    "Degenerate output"). Ids past the distribution's end (a tokenizer longer than the model's
    output) are left out."""
    n = int(logprobs.reshape(-1).shape[0])
    return start_mass(logprobs, [i for i in special_ids(tokenizer) if i < n])
