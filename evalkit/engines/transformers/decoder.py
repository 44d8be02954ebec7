"""The decoder: greedy continuations of every batch's rows, stepped together.

Owns `_Decoder`: the rows that go on past their first token (`_Row`, handed over as `_Queued`) join one
decode loop; where caches are plain they are left-padded and merged with the rows already going, so a
step serves rows of several batches; padding columns no row reads are cut as rows leave. A row finished
fills its `FirstStep` (`response_ids`, `answer_ids`).

Does not: prefill or choose the first token (`firststep`); the forward and its masks are the engine's
(`prefill._Forwards`), where a continuation stops too (`shared._Settings.accept`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from evalkit.engines.firststep import FirstStep
from evalkit.engines.transformers.prefill import _Forwards


@dataclasses.dataclass
class _Queued:
    """A batch's rows after their first step, waiting to be continued (`_Decoder.admit`)."""

    first: list[int]  # each row's first token
    cache: Any  # the prompts' KV cache, (rows, ..., P, ...)
    mask: torch.Tensor  # (rows, P) 1 where a column holds a real token
    position_ids: torch.Tensor  # (rows, P) each column's position
    limits: list[tuple[int, bool, bool]]  # per row: (token limit, stop at the stop strings, answer continuation)


class _Row:
    """One prompt's continuation: the tokens so far, where it stops, and the result it fills."""

    __slots__ = ("step", "index", "going", "limit", "stop", "answer", "tokens")

    def __init__(self, step: FirstStep, index: int, going: set[int], limit: int, stop: bool, answer: bool) -> None:
        self.step, self.index, self.going = step, index, going
        self.limit, self.stop, self.answer = limit, stop, answer
        self.tokens: list[int] = []


def _plain(cache) -> bool:
    """Whether every layer of `cache` is a plain growing layer, whose rows may be padded and merged."""
    from transformers.cache_utils import DynamicLayer

    return getattr(cache, "evalkit_state", None) is None and all(type(layer) is DynamicLayer for layer in cache.layers)


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """`t` with `n` zero columns put before dimension `dim`'s first."""
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class _Decoder:
    """Greedy continuations of rows from any number of batches, one forward a step for all of them.

    A batch's rows join with their prompt cache after their first step. Where both caches are plain
    (`_plain`, and the policy allows: `_Settings.policy_merges`) the rows join those already going: the
    shorter side is left-padded with masked columns, and since every row has its own positions, key
    mask and cache rows, a row reads only its own keys whatever it is batched with. Columns that are
    padding for every row are cut off as rows leave. Where caches cannot merge, the rows going are
    finished first. A row finished fills its `FirstStep` (`response_ids`, and `answer_ids` for an
    answer continuation) and leaves its submission's set of rows going."""

    def __init__(self, engine: _Forwards) -> None:
        self.engine = engine
        self.rows: list[_Row] = []
        self.cache: Any = None
        self.mask = self.last_pos = self.tokens = torch.empty(0)
        self.key_pos: torch.Tensor | None = None

    def admit(self, rows: list[_Row], queued: _Queued) -> None:
        """Take in a batch's rows (`rows[j]` is row j of `queued`); those that end at their first token
        finish at once."""
        eng = self.engine
        keep = [j for j, (row, token) in enumerate(zip(rows, queued.first)) if self.accept(row, token)]
        cache, mask, positions = queued.cache, queued.mask, queued.position_ids
        queued.cache = None  # merged below or taken whole: no second reference
        if not keep:
            return
        if len(keep) < len(rows):
            index = torch.tensor(keep, dtype=torch.long, device=eng.device)
            cache.batch_select_indices(index)
            mask, positions = mask[index], positions[index]
        tokens = torch.tensor([queued.first[j] for j in keep], dtype=torch.long, device=eng.device)
        last_pos = positions[:, -1]
        key_pos = positions if eng.policy.evicts else None  # each key column's position, read by the policy
        for j in keep:
            rows[j].going.add(rows[j].index)
        if self.rows and not (eng.policy_merges and _plain(self.cache) and _plain(cache)):
            self.run(0)
        if not self.rows:
            self.cache, self.mask, self.last_pos, self.key_pos, self.tokens = cache, mask, last_pos, key_pos, tokens
            self.rows = [rows[j] for j in keep]
            return
        width = max(self.mask.shape[1], mask.shape[1])
        old, new = width - self.mask.shape[1], width - mask.shape[1]
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, old, -2), _pad_left(theirs.keys, new, -2)])
            mine.values = torch.cat([_pad_left(mine.values, old, -2), _pad_left(theirs.values, new, -2)])
        self.mask = torch.cat([_pad_left(self.mask, old, 1), _pad_left(mask, new, 1)])
        if key_pos is not None and self.key_pos is not None:
            self.key_pos = torch.cat([_pad_left(self.key_pos, old, 1), _pad_left(key_pos, new, 1)])
        self.last_pos = torch.cat([self.last_pos, last_pos])
        self.tokens = torch.cat([self.tokens, tokens])
        self.rows += [rows[j] for j in keep]

    def run(self, keep: int) -> None:
        """Step while more than `keep` rows are going."""
        while len(self.rows) > keep:
            self.step()

    def fit(self, positions: int) -> None:
        """Step while the rows going hold more than `positions` cache columns in all (rows x width)."""
        while self.rows and len(self.rows) * self.mask.shape[1] > positions:
            self.step()

    def step(self) -> None:
        """Feed every row its last token and append its greedy next one; rows that end leave."""
        eng = self.engine
        eng.progress(f"decode ({len(self.rows)} rows)", 1.0)
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=-1)
        self.last_pos = self.last_pos + 1
        attn = self.mask
        if self.key_pos is not None:  # each row reads the keys the policy keeps at its position
            self.key_pos = torch.cat([self.key_pos, self.last_pos.unsqueeze(-1)], dim=-1)
            attn = eng.policy_mask(self.last_pos.unsqueeze(-1), self.key_pos, self.mask)
        logits, self.cache = eng.forward(self.tokens.unsqueeze(-1), attn, self.last_pos.unsqueeze(-1), self.cache,
                                         last_only=True, key_pos=self.key_pos)
        tokens = torch.argmax(logits[:, -1, :], dim=-1)
        going = [self.accept(row, token) for row, token in zip(self.rows, tokens.tolist())]
        if all(going):
            self.tokens = tokens
            return
        keep = [j for j, g in enumerate(going) if g]
        self.rows = [self.rows[j] for j in keep]
        if not keep:
            self.cache = None
            return
        index = torch.tensor(keep, dtype=torch.long, device=eng.device)
        self.cache.batch_select_indices(index)
        self.mask, self.last_pos, self.tokens = self.mask[index], self.last_pos[index], tokens[index]
        if self.key_pos is not None:
            self.key_pos = self.key_pos[index]
        if _plain(self.cache):  # columns no row reads any more
            cut = int(self.mask.any(0).int().argmax())
            if cut:
                for layer in self.cache.layers:
                    layer.keys, layer.values = layer.keys[..., cut:, :], layer.values[..., cut:, :]
                self.mask = self.mask[:, cut:]
                if self.key_pos is not None:
                    self.key_pos = self.key_pos[:, cut:]

    def accept(self, row: _Row, token: int) -> bool:
        """Append `token` to the row; True while it goes on, else fill its result and let it go."""
        eng = self.engine
        if eng.accept(row.tokens, token, row.limit, row.stop):
            return True
        if row.answer:
            row.step.answer_ids = row.tokens
            row.step.response_ids = eng.response_prefix(row.tokens)
        else:
            row.step.response_ids = row.tokens
        row.going.discard(row.index)
        return False
