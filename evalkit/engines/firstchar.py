"""The first character of the response, from the whole next-token distribution (docs/metrics.md §1.5).

Owns, engine-independent and on plain tensors:
- `CharTable` / `char_table(tokenizer)`: per token id (from `vocab.vocab_table`) what it says first — its
  first non-whitespace character, read from its own bytes; whitespace only (it leads on to what follows);
  a fragment (bytes ending inside a UTF-8 character, kept as that byte prefix); an invalid byte
  (`byte:XX`, a byte no UTF-8 character starts with); or a special token's role (`<eos>`, `<eot>`,
  `<special:ID>`), never "<". Built once per tokenizer and kept as long as it lives;
- `first_chars`: one step's probability vector through one scatter-add (`index_add_`) on that table, then
  the whitespace-only tokens and the fragments expanded over a "teacher-force these prefixes, give me
  their next-step log-probs" callback the engine provides (`Forward`), level by level: a whitespace-only
  prefix reads the next token's table; a fragment reads only the tokens whose bytes continue a valid
  UTF-8 character (Phan et al. 2024, "Exact Byte-Level Probabilities from Tokenized Language Models",
  limited to the first character), at most 3 steps; every other token after a fragment leaves the
  character unfinished (`byte:XX`, its lead byte). The least likely prefixes are left unexpanded under
  the candidate trie's rule (`firststep.tolerance_cut`) within the run's `tolerance`: each character's
  probability is then exact up to `FirstChars.unresolved` <= tolerance (unless a prefix runs past
  `MAX_DEPTH` tokens or past `MAX_POSITIONS` prefixes a prompt, which is counted there too).
Whitespace here is Unicode whitespace and the zero-width marks (U+200B-U+200D, U+2060, U+FEFF).

Does not: run a model (the engine's callback does), store anything, or compare two distributions
(`scoring.textspace`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from evalkit.engines.firststep import tolerance_cut
from evalkit.engines.vocab import VocabTable, vocab_table

# the events a run stores per prompt (first_char_topk): the likeliest, at least MIN_EVENTS, on until they hold
# KEEP_MASS of the resolved mass, at most TOP_EVENTS; the rest is one mass (samples.fc_rest_mass)
MIN_EVENTS, TOP_EVENTS, KEEP_MASS = 20, 512, 0.999
MAX_DEPTH = 4  # the longest token prefix fed: a whitespace token, a lead byte and two continuations
# the most prefixes one prompt teacher-forces, whatever its tolerance: the least likely past it are left
# unresolved (counted in `FirstChars.unresolved`, which may then exceed the tolerance)
MAX_POSITIONS = 512
LEVEL_CHUNK = 256  # prefixes of a level read in float64 at a time (`first_chars`)
LOG_FLOOR = math.log(1e-12)  # a prefix less likely than this is never a node: its mass is unresolved at once
ZERO_WIDTH = frozenset("\u200b\u200c\u200d\u2060\ufeff")

# (row, prefix tokens) -> that prefix's next-step log-probabilities; one call a level, all rows together
Forward = Callable[[Sequence[tuple[int, tuple[int, ...]]]], torch.Tensor]

CHAR, WHITESPACE, FRAGMENT, INVALID = "char", "whitespace", "fragment", "invalid"


def _length(lead: int) -> int:
    """Bytes of the UTF-8 character starting with `lead`; 0 where no character starts with it."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def _continues(prefix: bytes) -> bool:
    """Whether `prefix` (a lead byte and some continuation bytes) can still become a valid character."""
    n = _length(prefix[0])
    if n == 0 or len(prefix) > n or any(not 0x80 <= b <= 0xBF for b in prefix[1:]):
        return False
    if len(prefix) > 1:  # the second byte's narrower ranges (no overlong form, no surrogate, <= U+10FFFF)
        lo, hi = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}.get(prefix[0],
                                                                                                 (0x80, 0xBF))
        if not lo <= prefix[1] <= hi:
            return False
    return True


def _blank(ch: str) -> bool:
    return ch.isspace() or ch in ZERO_WIDTH


def scan(data: bytes) -> tuple[str, Any]:
    """What text beginning with `data` says first: (CHAR, the character), (WHITESPACE, None): whitespace
    only so far, (FRAGMENT, the bytes of the unfinished first character) or (INVALID, the offending lead
    byte).

    >>> scan(" Paris".encode()), scan(b"\\n\\n"), scan("\\u200b中".encode()), scan(b" \\xe4\\xb8")
    (('char', 'P'), ('whitespace', None), ('char', '中'), ('fragment', b'\\xe4\\xb8'))
    >>> scan(b"\\x80abc"), scan(b"\\xe4x"), scan(b"")
    (('invalid', 128), ('invalid', 228), ('whitespace', None))
    """
    i = 0
    while i < len(data):
        n = _length(data[i])
        if n == 0:
            return INVALID, data[i]
        part = data[i:i + n]
        if not _continues(part[:min(len(part), 2)]) or any(not 0x80 <= b <= 0xBF for b in part[1:]):
            return INVALID, data[i]
        if len(part) < n:
            return FRAGMENT, part
        ch = part.decode("utf-8")
        if not _blank(ch):
            return CHAR, ch
        i += n
    return WHITESPACE, None


def byte_event(lead: int) -> str:
    """The event of a character that never finished (or never could): its lead byte."""
    return f"byte:{lead:02X}"


@dataclass
class CharTable:
    """A tokenizer's tokens by what they say first (see the module docstring)."""

    vocab: VocabTable
    events: list[str]  # event id -> name
    token_event: torch.Tensor  # (V,) long: event id, or len(events) for a whitespace-only or fragment token
    whitespace_ids: torch.Tensor  # (n,) long: tokens adding whitespace only (or nothing)
    fragment_ids: torch.Tensor  # (m,) long: tokens whose first character is unfinished
    fragments: dict[int, bytes]  # fragment token -> its unfinished character's bytes
    continuation_ids: list[int]  # tokens starting with a continuation byte (the only ones that extend a fragment)
    _after: dict[bytes, tuple[torch.Tensor, list[tuple[int, str, Any]]]] = field(default_factory=dict)

    def after(self, pending: bytes) -> tuple[torch.Tensor, list[tuple[int, str, Any]]]:
        """The tokens that continue the unfinished character `pending`: (their ids, per token (id, kind,
        value) as `scan` reads pending + the token). Kept per `pending` for the table's life."""
        hit = self._after.get(pending)
        if hit is None:
            rows = []
            for t in self.continuation_ids:
                kind, value = scan(pending + (self.vocab.pieces[t] or b""))
                if kind != INVALID:
                    rows.append((t, kind, value))
            hit = (torch.tensor([r[0] for r in rows], dtype=torch.long), rows)
            self._after[pending] = hit
        return hit


def build_char_table(vocab: VocabTable) -> CharTable:
    """A `CharTable` of `vocab`.

    >>> from evalkit.engines.vocab import VocabTable
    >>> t = build_char_table(VocabTable((b" Paris", b"P", b" ", b"\\xe4", None, b"\\xb8\\xad"), {4: "<eos>"}))
    >>> [t.events[i] if i < len(t.events) else "-" for i in t.token_event.tolist()]
    ['P', 'P', '-', '-', '<eos>', 'byte:B8']
    >>> t.whitespace_ids.tolist(), t.fragments, t.continuation_ids
    ([2], {3: b'\\xe4'}, [5])
    """
    ids: dict[str, int] = {}
    token_event: list[int] = []
    ws, frag = [], {}
    cont = []
    for t, piece in enumerate(vocab.pieces):
        if piece is None:
            token_event.append(ids.setdefault(vocab.role(t), len(ids)))
            continue
        if piece and 0x80 <= piece[0] <= 0xBF:
            cont.append(t)
        kind, value = scan(piece)
        if kind == CHAR:
            token_event.append(ids.setdefault(value, len(ids)))
        elif kind == INVALID:
            token_event.append(ids.setdefault(byte_event(value), len(ids)))
        else:
            token_event.append(-1)
            if kind == WHITESPACE:
                ws.append(t)
            else:
                frag[t] = value
    n = len(ids)
    return CharTable(vocab, list(ids), torch.tensor([n if e < 0 else e for e in token_event], dtype=torch.long),
                     torch.tensor(ws, dtype=torch.long), torch.tensor(sorted(frag), dtype=torch.long), frag, cont)


_TABLES: weakref.WeakKeyDictionary[Any, CharTable] = weakref.WeakKeyDictionary()


def char_table(tokenizer) -> CharTable:
    """The `CharTable` of `tokenizer`, built on first use and kept as long as the tokenizer lives."""
    try:
        return _TABLES[tokenizer]
    except (KeyError, TypeError):
        pass
    table = build_char_table(vocab_table(tokenizer))
    try:
        _TABLES[tokenizer] = table
    except TypeError:
        pass
    return table


@dataclass
class FirstChars:
    """One prompt's first-character distribution: every event resolved, with the mass left unresolved."""

    probs: dict[str, float]  # event -> probability, likeliest first (ties by name)
    unresolved: float  # probability of the prefixes left unexpanded (<= tolerance, see `first_chars`)
    positions: int = 0  # prefixes teacher-forced for it

    def top(self, n: int = TOP_EVENTS, least: int = MIN_EVENTS, mass: float = KEEP_MASS
            ) -> tuple[list[tuple[str, float]], float]:
        """(the likeliest events — at least `least`, on until they hold `mass` of the whole, at most `n` —,
        the resolved mass of the others).

        >>> FirstChars({"a": 0.5, "b": 0.3, "c": 0.2}, 0.0).top(2)
        ([('a', 0.5), ('b', 0.3)], 0.2)
        >>> FirstChars({"a": 0.5, "b": 0.3, "c": 0.2}, 0.0).top(least=1, mass=0.75)
        ([('a', 0.5), ('b', 0.3)], 0.2)
        """
        items = list(self.probs.items())
        held, k = 0.0, 0
        while k < min(n, len(items)) and (k < least or held < mass):
            held += items[k][1]
            k += 1
        return items[:k], math.fsum(p for _, p in items[k:])


@dataclass
class _Node:
    row: int
    prefix: tuple[int, ...]
    pending: bytes  # b"": whitespace so far; else the unfinished character's bytes
    logp: float


def attach(result: Any, chars: FirstChars | None) -> None:
    """Give a `contract.FirstStepResult` the stored part of `chars` (its likeliest events, `FirstChars.top`,
    the rest's mass, the unresolved mass); nothing where the engine read none."""
    if chars is None:
        return
    result.first_chars, result.fc_rest_mass = chars.top()
    result.fc_unresolved_mass = chars.unresolved


def _said(table: CharTable, prefix: tuple[int, ...]) -> tuple[bytes, ...]:
    """A prefix by the bytes its tokens add (what a permuted vocabulary keeps)."""
    return tuple(table.vocab.pieces[t] or b"" for t in prefix)


def _index(table: CharTable, V: int) -> torch.Tensor:
    """The table's token -> event index for a distribution over V tokens (past the table: the pending slot)."""
    index = table.token_event[:V]
    if V > len(index):
        index = torch.cat([index, torch.full((V - len(index),), len(table.events), dtype=torch.long)])
    return index


def _children(table: CharTable, row: int, prefix: tuple[int, ...], lp: torch.Tensor, base: float = 0.0,
              dropped: list[float] | None = None) -> list[_Node]:
    """The whitespace-only and fragment tokens a whitespace-so-far prefix goes on with, as nodes; those under
    FLOOR are not made, their probability added to `dropped[row]` (unresolved)."""
    out = []
    for ids, frag in ((table.whitespace_ids, False), (table.fragment_ids, True)):
        ids = ids[ids < lp.shape[0]]
        if not len(ids):
            continue
        vals = lp[ids] + base
        live = vals >= LOG_FLOOR
        if dropped is not None:
            dropped[row] += float(vals[~live].exp().sum())
        keep = torch.nonzero(live).flatten()
        for t, v in zip(ids[keep].tolist(), vals[keep].tolist()):
            out.append(_Node(row, (*prefix, t), table.fragments[t] if frag else b"", v))
    return out


def first_chars(table: CharTable, logprobs: torch.Tensor, forward: Forward | None, tolerance: float,
                max_depth: int = MAX_DEPTH, max_positions: int = MAX_POSITIONS) -> list[FirstChars]:
    """The first-character distribution of each row of `logprobs` ((B, V) first-step log-probabilities).

    `forward(nodes)` teacher-forces each (row, prefix) after its row's prompt and returns their next-step
    log-probabilities, (len(nodes), V); all nodes of one call have the same prefix length and every
    shorter prefix of theirs was in an earlier call. None: nothing is expanded (all of it unresolved).
    A level's least likely prefixes are left out under `tolerance_cut` with half of what is left of the
    row's `tolerance` (all of it at the last level), so `unresolved` <= tolerance unless a prefix would
    run past `max_depth` tokens, or a row needs more than `max_positions` prefixes (the likeliest are fed).

    A byte-level vocabulary spelling 中 (e4 b8 ad) as two tokens, and a whitespace token before it:

    >>> from evalkit.engines.vocab import VocabTable
    >>> t = build_char_table(VocabTable((b"\\xe4\\xb8", b"\\xad", b"\\xad\\xe4", b" ", b"A", None), {5: "<eos>"}))
    >>> lp = lambda *p: torch.log(torch.tensor([p], dtype=torch.float64))
    >>> def forward(nodes):  # after e4 b8: ad 0.9, eos 0.1; after " ": e4 b8 0.5, A 0.5
    ...     return torch.cat([lp(0, .9, 0, 0, 0, .1) if n[-1] == 0 else lp(.5, 0, 0, 0, .5, 0) for _, n in nodes])
    >>> fc, = first_chars(t, lp(.6, 0, 0, .4, 0, 0), forward, 0.0)
    >>> {k: round(v, 6) for k, v in fc.probs.items()}, fc.unresolved, fc.positions
    ({'中': 0.72, 'A': 0.2, 'byte:E4': 0.08}, 0.0, 3)
    """
    # in float64, renormalised: a float32 log-softmax sums to 1 only within about 1e-6, which would leave
    # two runs of one model (a permuted twin) a rest bucket of that size on one side and none on the other
    lp = torch.log_softmax(logprobs.detach().reshape(logprobs.shape[0], -1).double().cpu(), dim=-1)
    B, V = lp.shape
    E = len(table.events)
    index = _index(table, V)
    acc = torch.zeros((B, E + 1), dtype=torch.float64)
    acc.index_add_(1, index, lp.exp())
    extra: list[dict[str, float]] = [{} for _ in range(B)]
    budget = [float(tolerance)] * B
    # tokens past the tokenizer's table (a model's padded vocabulary) say nothing known: unresolved
    unresolved = lp[:, len(table.token_event):].exp().sum(-1).tolist() if V > len(table.token_event) else [0.0] * B
    positions = [0] * B
    frontier = [node for r in range(B) for node in _children(table, r, (), lp[r], 0.0, unresolved)]
    depth = 1
    while frontier:
        if depth > max_depth or forward is None:  # beyond the bound: unresolved, whatever the tolerance
            for node in frontier:
                unresolved[node.row] += math.exp(node.logp)
            break
        fed: list[_Node] = []
        by_row: dict[int, dict[tuple[int, ...], _Node]] = {}
        for n in frontier:
            by_row.setdefault(n.row, {})[n.prefix] = n
        for r, by_ids in sorted(by_row.items()):
            # ties go by what the prefixes say (their bytes), then by id: a vocabulary whose ids are
            # permuted cuts the same prefixes
            nodes = {(_said(table, k), k): n for k, n in by_ids.items()}
            share = budget[r] if depth == max_depth else budget[r] / 2
            level, left = tolerance_cut(list(nodes), {k: n.logp for k, n in nodes.items()}, set(), share)
            budget[r] -= share - left
            unresolved[r] += share - left
            room = max_positions - positions[r]
            if len(level) > room:  # past the row's positions: the least likely left unresolved
                level.sort(key=lambda k: (-nodes[k].logp, k))
                unresolved[r] += math.fsum(math.exp(nodes[k].logp) for k in level[room:])
                level = level[:room]
            fed += [nodes[k] for k in level]
            positions[r] += len(level)
        if not fed:
            break
        raw = forward([(n.row, n.prefix) for n in fed]).detach().reshape(len(fed), -1)
        frontier = []
        # a level's rows in float64 a chunk at a time: the whole level (thousands of prefixes on Chinese
        # prompts, each a vocabulary-sized row) held twice more in float64 took gigabytes
        for start in range(0, len(fed), LEVEL_CHUNK):
            part = fed[start:start + LEVEL_CHUNK]
            out = torch.log_softmax(raw[start:start + LEVEL_CHUNK].double().cpu(), dim=-1)
            _read_level(table, part, out, acc, extra, frontier, unresolved)
        del raw
        depth += 1
    results = []
    for r in range(B):
        mass = {table.events[e]: float(acc[r, e]) for e in torch.nonzero(acc[r, :E]).flatten().tolist()}
        for name, p in extra[r].items():
            mass[name] = mass.get(name, 0.0) + p
        ranked = dict(sorted(((k, v) for k, v in mass.items() if v > 0), key=lambda kv: (-kv[1], kv[0])))
        results.append(FirstChars(ranked, unresolved[r], positions[r]))
    return results


def _read_level(table: CharTable, fed: list[_Node], out: torch.Tensor, acc: torch.Tensor,
                extra: list[dict[str, float]], frontier: list[_Node], unresolved: list[float]) -> None:
    """Fold the next-step log-probabilities `out` of the prefixes `fed` into the rows' event masses (`acc`,
    `extra`), their unfinished prefixes onto `frontier`, and what falls under FLOOR into `unresolved`."""
    B = acc.shape[0]
    blank = [i for i, n in enumerate(fed) if not n.pending]
    if blank:  # whitespace so far: the whole next step through the table, weighted by the prefix
        weights = torch.tensor([math.exp(fed[i].logp) for i in blank], dtype=torch.float64)
        rows = torch.tensor([fed[i].row for i in blank], dtype=torch.long)
        probs = out[blank].exp() * weights[:, None]
        per_row = torch.zeros((B, out.shape[1]), dtype=torch.float64).index_add_(0, rows, probs)
        acc.index_add_(1, _index(table, out.shape[1]), per_row)
        for i in blank:
            frontier += _children(table, fed[i].row, fed[i].prefix, out[i], fed[i].logp, unresolved)
        # the continued mass of whitespace/fragment tokens went into the table's pending slot: it is
        # resolved through the children, so the slot is cleared at the end
    for i, node in enumerate(fed):
        if not node.pending:
            continue
        ids, rows_after = table.after(node.pending)
        weight = math.exp(node.logp)
        bucket = extra[node.row]
        dead = byte_event(node.pending[0])
        ps = out[i, ids].exp().tolist() if len(rows_after) else []
        for (t, kind, value), p in zip(rows_after, ps):
            if p <= 0:
                continue
            if kind == CHAR:
                bucket[value] = bucket.get(value, 0.0) + weight * p
            elif node.logp + math.log(p) < LOG_FLOOR:
                unresolved[node.row] += weight * p
            else:
                frontier.append(_Node(node.row, (*node.prefix, t), value or b"", node.logp + math.log(p)))
        # every other token leaves the character unfinished: its lead byte's event
        rest = max(0.0, 1.0 - math.fsum(ps)) if ps else 1.0
        bucket[dead] = bucket.get(dead, 0.0) + weight * rest
