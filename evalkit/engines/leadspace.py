"""The whitespace-led first-token event: the token paths by which a response, after any leading whitespace,
begins with a candidate string (docs/metrics.md "One event for text and probability").

Owns the rule both exact engines (transformers, llama.cpp) apply, so both count the same paths and leave out
the same share:
- `lead_spaces(tokenizer)`: the leading-whitespace strings ω that the vocabulary's mixed tokens carry
  (" Paris" carries " "), once per tokenizer, from `vocab.vocab_table`;
- `whitespace_levels`: the first tokens that add only whitespace ("\\n\\n", " ", "▁▁"; whitespace as the text
  metrics strip it, `str.strip`, a superset of `vocab.whitespace_ids`)
  as extra trie nodes before the candidates, level by level (a whitespace token after a whitespace token), the
  least likely left unscored under the prompt's `tolerance` (`firststep.tolerance_cut`), at most WS_LEVELS deep;
- `lead_paths`: each candidate's token paths: ω + candidate (ω in {""} ∪ `lead_spaces`) tokenised in its real
  context, after the context and after each scored whitespace node (its text appended to the context), each
  distinct token sequence once; a path whose leading whitespace-only tokens are not a scored node is left out
  (its mass is in the unscored mass already).
Does not: run a model (each engine hands `whitespace_levels` a forward that reads the whitespace tokens'
log-probabilities after a level of nodes) or sum paths into metrics (`scoring.firsttoken.event_prob`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from evalkit.engines.firststep import tolerance_cut
from evalkit.engines.vocab import vocab_table

Path = tuple[int, ...]

# how many whitespace-only tokens a path may begin with; whitespace runs longer than this (in tokens) are left
# unscored, their mass added to `unscored_mass` (measured on the firsttoken prompts: under `plain` Gemma-3-270M
# opens with one "\n\n" token; two levels already fall under the default tolerance almost always)
WS_LEVELS = 3
# the whitespace nodes one prompt's level may feed. Each scored node carries the whole candidate trie after it
# (the opener lexicon's ~130 prefixes), and at the default tolerance (1e-4) every whitespace token likelier than
# that survives the cut: on the firsttoken prompts 64 a level made some prompts' tries 50x longer. The likeliest
# are fed, the rest's mass is added to `unscored_mass` (which may then exceed the tolerance: it stays a bound)
WS_NODES = 4
# the share of a prompt's tolerance the whitespace nodes may leave unscored; the rest is the candidate trie's.
# One budget spent level by level leaves the trie nothing wherever the whitespace tokens' mass is about the
# tolerance (under `chat` on the default model it is ~1e-4 against 1e-4), and a trie cut at tolerance 0 is
# fed whole: 3x the positions on 20 prompts. The trie's own cut barely moves between the whole tolerance and
# half of it (2,715 against 2,809 positions on the same prompts)
WS_SHARE = 0.5


@dataclass(frozen=True)
class LeadVocab:
    """What a tokenizer's vocabulary says about leading whitespace."""

    spaces: tuple[str, ...]  # ω: the leading whitespace of mixed tokens, e.g. (" ",); "" is not in it
    ws_ids: tuple[int, ...]  # tokens that add only whitespace, ascending
    ws_text: dict[int, str] = field(default_factory=dict)  # such a token -> the whitespace it adds


_VOCABS: weakref.WeakKeyDictionary[Any, LeadVocab] = weakref.WeakKeyDictionary()


def lead_vocab(tokenizer) -> LeadVocab:
    """`LeadVocab` of a tokenizer (transformers or the llama.cpp engine's), built once per tokenizer object."""
    try:
        return _VOCABS[tokenizer]
    except (KeyError, TypeError):
        pass
    table = vocab_table(tokenizer)
    spaces: set[str] = set()
    ws: dict[int, str] = {}
    for i, piece in enumerate(table.pieces):
        if not piece:
            continue
        text = piece.decode("utf-8", "replace")  # whitespace as the text metrics strip it (str.strip)
        n = len(text) - len(text.lstrip())
        if n == len(text):
            ws[i] = text
        elif n:
            spaces.add(text[:n])
    out = LeadVocab(tuple(sorted(spaces)), tuple(sorted(ws)), ws)
    try:
        _VOCABS[tokenizer] = out
    except TypeError:
        pass
    return out


def lead_spaces(tokenizer) -> tuple[str, ...]:
    """The leading-whitespace strings ω that the vocabulary's mixed tokens carry (" Paris" carries " ")."""
    return lead_vocab(tokenizer).spaces


def ws_mass(logprobs, vocab: LeadVocab) -> float:
    """The first-step probability of the tokens that add only whitespace (`ws_mass`), from a (V,) row of
    log-probabilities (a tensor or an array)."""
    ids = list(vocab.ws_ids)
    row = np.asarray(logprobs.detach().float().cpu().numpy() if hasattr(logprobs, "detach") else logprobs,
                     dtype=np.float64).reshape(-1)
    ids = [i for i in ids if i < row.shape[0]]
    return float(np.exp(row[ids]).sum()) if ids else 0.0


@dataclass
class Levels:
    """One prompt's whitespace nodes: the scored ones and what was left out."""

    nodes: dict[Path, float] = field(default_factory=dict)  # scored whitespace prefix -> log P(prefix)
    unscored: float = 0.0  # mass of the whitespace prefixes left out (tolerance cut, WS_NODES, WS_LEVELS)
    budget: float = 0.0  # what is left of the prompt's tolerance for the candidate trie after them


Forward = Callable[[list[list[Path]]], list[list[np.ndarray]]]


def whitespace_levels(root: Sequence[np.ndarray], ws_ids: Sequence[int], tolerance: float, forward: Forward,
                      levels: int | None = None, cap: int | None = None, share: float | None = None) -> list[Levels]:
    """Per prompt, the whitespace-only prefixes that are scored as trie nodes.

    `root[r]` holds prompt r's first-step log-probabilities of `ws_ids` (in that order). Level d's new
    prefixes are each scored level-(d-1) prefix (the root at d = 1) followed by a whitespace token; before a
    level is fed, its least likely new prefixes are left out while their mass fits in what is left of the
    share of the prompt's `tolerance` they may spend (`tolerance_cut`, the candidate trie's own rule; `share`,
    WS_SHARE by default; what they leave of it, and the rest, is the trie's `budget`), and beyond the `cap`
    likeliest, or beyond `levels` deep, they are left out whatever their mass (added to `unscored`).
    `forward(nodes_per_prompt)` feeds one level's nodes after each prompt and returns, per prompt and node,
    the log-probabilities of `ws_ids` after it; it is called only on nonempty levels.

    >>> lp = np.log(np.array([[0.5, 0.1]]))  # after every prefix: P(" ") = 0.5, P("\\n") = 0.1
    >>> fwd = lambda lv: [[lp[0] for _ in nodes] for nodes in lv]
    >>> (out,) = whitespace_levels([lp[0]], [7, 9], 0.02, fwd, levels=2, share=1.0)
    >>> sorted((k, round(math.exp(v), 3)) for k, v in out.nodes.items())
    [((7,), 0.5), ((7, 7), 0.25), ((7, 9), 0.05), ((9,), 0.1), ((9, 7), 0.05)]
    >>> round(out.unscored, 3), round(out.budget, 3)  # (9, 9) cut (0.01); 0.6 of the other three, beyond two levels
    (0.22, 0.01)
    """
    levels = WS_LEVELS if levels is None else levels
    cap = WS_NODES if cap is None else cap
    share = WS_SHARE if share is None else share
    ws = [int(t) for t in ws_ids]
    out = [Levels(budget=float(tolerance) * share) for _ in root]
    after: list[dict[Path, np.ndarray]] = [{(): np.asarray(r, dtype=np.float64)} for r in root]
    for depth in range(1, levels + 2):
        fed: list[list[Path]] = []
        for r, lv in enumerate(out):
            fresh: dict[Path, float] = {}
            for node, lps in after[r].items():
                base = lv.nodes.get(node, 0.0)
                for t, v in zip(ws, lps):
                    if v > -math.inf:
                        fresh[node + (t,)] = base + float(v)
            if depth > levels:  # longer whitespace runs: left out, whatever their mass
                lv.unscored += sum(math.exp(v) for v in fresh.values())
                fed.append([])
                continue
            level, left = tolerance_cut(list(fresh), fresh, (), lv.budget)
            lv.unscored += lv.budget - left
            lv.budget = left
            level.sort(key=lambda n: (-fresh[n], n))
            for node in level[cap:]:
                lv.unscored += math.exp(fresh[node])
            level = level[:cap]
            for node in level:
                lv.nodes[node] = fresh[node]
            fed.append(level)
        if depth > levels or not any(fed):
            break
        got = forward(fed)
        after = [dict(zip(nodes, rows)) for nodes, rows in zip(fed, got)]
    for lv in out:  # the trie's: what the whitespace nodes left of their share, and the rest
        lv.budget += float(tolerance) * (1.0 - share)
    return out


def lead_paths(candidates: Iterable[str], spaces: Sequence[str], nodes: Mapping[Path, str],
               ws_ids: Iterable[int] | frozenset, tokens_in: Callable[[Path, str], list[int]]) -> dict[str, list[Path]]:
    """Each candidate's distinct token paths to "the response, after its leading whitespace, begins with it".

    `nodes` are the scored whitespace prefixes with the text each adds; `tokens_in(node, s)` tokenises s in its
    real context after the prompt and the node (`firststep.candidate_ids`' rule: the ids of context + node's
    text + s past the prompt's ids and the node). A path is ω + candidate tokenised after the prompt or after a
    node, ω in {""} ∪ `spaces`; a path whose leading whitespace-only tokens are not the root or a scored node
    is left out (its mass is in the unscored mass), and one token sequence reached twice is one path.

    >>> toks = {((), "Paris"): [5], ((), " Paris"): [6], ((1,), "Paris"): [5], ((1,), " Paris"): [1, 5]}
    >>> lead_paths(["Paris"], [" "], {(1,): " "}, {1}, lambda n, s: toks[(n, s)])
    {'Paris': [(5,), (6,), (1, 5)]}
    """
    ws = frozenset(ws_ids)
    out: dict[str, list[Path]] = {}
    starts = [((), "")] + sorted(nodes.items())
    for cand in dict.fromkeys(candidates):
        paths: dict[Path, None] = {}
        for node, _ in starts:
            for omega in ("", *spaces):
                path = node + tuple(tokens_in(node, omega + cand))
                lead = 0
                while lead < len(path) and path[lead] in ws:
                    lead += 1
                if lead == len(path) or (lead and path[:lead] not in nodes):
                    continue  # whitespace alone, or under whitespace left unscored
                paths[path] = None
        out[cand] = list(paths)
    return out


def led(strings: Iterable[str], spaces: Sequence[str]) -> list[str]:
    """Each string, then ω + it for each ω in `spaces`: the texts whose first token in context may open a path
    of the whitespace-led event (`lead_paths` at the root).

    >>> led(["Sure"], [" ", "\\n"])
    ['Sure', ' Sure', '\\nSure']
    """
    strings = list(dict.fromkeys(strings))
    return strings + [omega + s for s in strings for omega in spaces]


def start_ids(strings: Iterable[str], vocab: LeadVocab | None, first_ids: Callable[[list[str]], set[int]]) -> set[int]:
    """Every first token a path of `strings` can have, `first_ids(texts)` giving the first token of each text in
    its context: each string's own and, with the whitespace-led event (`vocab` given), each ω + string's
    (`led`) and every whitespace-only token (every other path's first token). Their first-step mass bounds
    the strings' event from above (`opener_start_mass` of the opener lexicon), on either engine.

    >>> first = lambda texts: {len(t) for t in texts}  # a "tokenizer" whose first token is the text's length
    >>> sorted(start_ids(["Sure"], None, first)), sorted(start_ids(["Sure"], LeadVocab((" ",), (1, 2)), first))
    ([4], [1, 2, 4, 5])
    """
    strings = list(strings)
    if vocab is None:
        return first_ids(strings)
    return first_ids(led(strings, vocab.spaces)) | set(vocab.ws_ids)


def node_text(node: Path, ws_text: Mapping[int, str]) -> str:
    return "".join(ws_text[t] for t in node)


def start_tokens(strings: Iterable[str], tokens: Mapping[str, list[int]], paths: Mapping[str, list[Path]],
                 ws_ids: Iterable[int] | frozenset) -> set[int]:
    """The first tokens a strict, token-level hit (`ft_token_hit`) may start with: each string's first token in
    context and, with the whitespace-led event, the first token of each of its paths that does not add only
    whitespace (" Paris"; a response opening with "\\n\\n" is not yet a token-level hit).

    >>> sorted(start_tokens(["Paris"], {"Paris": [5]}, {"Paris": [(5,), (6,), (1, 5)]}, {1}))
    [5, 6]
    """
    ws = frozenset(ws_ids)
    out = {tokens[s][0] for s in strings if tokens.get(s)}
    out |= {p[0] for s in strings for p in paths.get(s, ()) if p and p[0] not in ws}
    return out
