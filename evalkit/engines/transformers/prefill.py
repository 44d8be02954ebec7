"""The first-step engine's forwards: the prefill with its shared head, the KV-cache policy's masks, the head split.

Owns `_Forwards` (on `shared._Settings`): the model's forward with a cache kept — whole, or the decoder's
last hidden states where the output head is applied apart (`head_split`, decided once per model) — and a
batch's prefill: rows left-padded, the head every row shares (a chat template's system turn) computed once
and its cache repeated, the first-step log-softmax read off the last position. The KV-cache policy's
eviction masks (`policy_mask`, `additive`) and rounded caches (`kvcache.new_cache`) are applied here, to
every forward the engine runs: the prefill, the candidate trie's levels (`trie`) and the decode steps
(`decoder`). Also the prefill's attention capture (`attention.capture`).

Does not: choose tokens, score candidates, or decide which prompts share a batch (`firststep`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import weakref
from typing import Any

import torch

from evalkit.engines.transformers.kvcache import new_cache
from evalkit.engines.transformers.shared import _model_device, _Settings
from evalkit.engines.transformers.windows import Windows, allowed, key_positions, plain_cache, windows_of


MIN_SHARED_HEAD = 4  # a batch's common leading tokens are prefilled once from this many on
SPLIT_TOLERANCE = 1e-4  # how near the head applied apart must come to the model's own logits (`head_split`)
_SPLITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (decoder, head, cache kw) | None


def head_split(model) -> tuple[Any, Any, str] | None:
    """(decoder, head, the decoder's cache keyword) when the model's logits are its output head applied to
    its decoder's last hidden state, else None; decided once per model, by running both on a short input.

    The trie reads each node's whole log-softmax, but only the node positions that are real need the head:
    applied apart, to LSE_ROWS of them at a time, it skips the padding and never holds a (positions x
    vocabulary) tensor. A model that changes its logits after the head (a soft cap, a scale) fails the
    check and keeps the whole forward."""
    if model in _SPLITS:
        return _SPLITS[model]
    found = None
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError, TypeError):
        decoder = head = None
    if decoder is not None and head is not None and decoder is not model:
        device = _model_device(model)
        ids = torch.tensor([[1, 2, 3]], dtype=torch.long, device=device)
        try:
            with torch.inference_mode():
                whole = model(input_ids=ids, use_cache=False).logits
                apart = head(decoder(input_ids=ids, use_cache=False).last_hidden_state)
            same = whole.shape == apart.shape and torch.allclose(whole.float(), apart.float(), atol=SPLIT_TOLERANCE,
                                                                 rtol=SPLIT_TOLERANCE)
        except Exception:  # noqa: BLE001  (a decoder or head that cannot be called apart: the whole forward)
            same = False
        if same:
            params = inspect.signature(decoder.forward).parameters
            found = (decoder, head, "cache" if "cache" in params else "past_key_values")
    _SPLITS[model] = found
    return found


def _read_attention(requests, indices, offsets, length):
    """The prefill's attention capture for this batch (`attention.capture`), or a no-op when none is asked for."""
    if requests is None:
        return contextlib.nullcontext()
    from evalkit.engines.transformers import attention

    return attention.capture([requests[i] or attention.Request() for i in indices], offsets, length)


class _Forwards(_Settings):
    """The model's forwards for one batch of prompts: the prefill, and the masks every later forward reads."""

    @property
    def windows(self) -> Windows | None:
        """The model's sliding-window layout (`windows.windows_of`), None for a model whose every layer
        reads the whole past (then the forwards run exactly as without this)."""
        return windows_of(self.model)

    @property
    def split(self) -> tuple[Any, Any, str] | None:
        if self._split is False:
            self._split = head_split(self.model)
        return self._split  # type: ignore[return-value]

    def forward(self, input_ids, attention_mask, position_ids, cache=None, last_only=False, hidden_only=False,
                key_pos=None):
        """Model forward with a cache kept: (logits, cache); with `hidden_only`, (the decoder's last hidden
        states, cache), the head left to the caller (`head_split`, which must have found one).

        `attention_mask` is the engine's: (B, K) 1 on real key columns, or a 4-D additive mask. On a model
        with sliding-window layers (`windows`) it becomes the masks of each layer type, built from the
        queries' positions and `key_pos` (B, K), each key column's position (read off a 2-D mask when not
        given), and the cache is a plain one (`windows.plain_cache`)."""
        windows = self.windows
        if windows is not None:
            if key_pos is None:
                if attention_mask.dim() != 2:
                    raise ValueError("a 4-D mask on a sliding-window model needs its key positions")
                key_pos = key_positions(attention_mask)
            allow = allowed(attention_mask, position_ids, key_pos)
            attention_mask = windows.masks(allow, position_ids, key_pos, self.float_dtype)
            if cache is None:
                cache = plain_cache()
        if hidden_only:
            decoder, _, cache_kw = self.split  # type: ignore[misc]
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True, **{cache_kw: cache})
            hidden = out.last_hidden_state
        else:
            kwargs = {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": position_ids,
                "use_cache": True,
                self.cache_kw: cache,
            }
            if last_only and self.keep_kw:
                kwargs["logits_to_keep"] = 1
            out = self.model(**kwargs)
        new_cache = getattr(out, "cache", None)  # transformers 5's name; `past_key_values` before it
        if new_cache is None:
            new_cache = getattr(out, "past_key_values", None)
        return (hidden if hidden_only else out.logits), new_cache

    @staticmethod
    def pads(ids_list) -> list[int]:
        P = max(len(ids) for ids in ids_list)
        return [P - len(ids) for ids in ids_list]

    def shared_head(self, ids_list) -> int:
        """How many leading tokens every prompt of the batch shares and the prefill computes once (0: none).

        Only where nothing else reads the prefill column by column: the `full` policy (no eviction
        masks, no rounded cache) and no attention capture. At least one token of every prompt stays
        after the head, so each row's own last position is computed in the batch."""
        if len(ids_list) < 2 or not self.policy.is_full or self.attention is not None:
            return 0
        head = min(len(os.path.commonprefix(ids_list)), min(len(ids) for ids in ids_list) - 1)
        return head if head >= MIN_SHARED_HEAD else 0

    def prefill(self, ids_list):
        """Prefill the batch: (first-step log-probs (B, V) float32, cache, key mask (B, P), positions (B, P)).

        Rows are left-padded. A head every row shares (`shared_head`) is computed once, as one row,
        and its cache repeated for every row; each row's remaining tokens are then left-padded after
        the head (the padding sits between head and tail, masked out; positions stay the real ones)."""
        B = len(ids_list)
        head = self.shared_head(ids_list)
        cache = None
        if head:
            ids = torch.tensor([ids_list[0][:head]], dtype=torch.long, device=self.device)
            ones = torch.ones_like(ids)
            _, cache = self.forward(ids, ones, torch.arange(head, device=self.device).unsqueeze(0), last_only=True)
            cache.batch_repeat_interleave(B)
        tails = [ids[head:] for ids in ids_list]
        S = max(len(t) for t in tails)
        input_ids = torch.full((B, S), self.pad_id, dtype=torch.long)
        tail_mask = torch.zeros((B, S), dtype=torch.long)
        for r, t in enumerate(tails):
            input_ids[r, S - len(t):] = torch.tensor(t, dtype=torch.long)
            tail_mask[r, S - len(t):] = 1
        mask = torch.cat([torch.ones((B, head), dtype=torch.long), tail_mask], dim=-1).to(self.device)
        input_ids = input_ids.to(self.device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        if cache is None and self.policy.rounds:
            cache = new_cache(self.policy, self.model, self.pads(ids_list))
        attn = mask
        if self.policy.evicts:  # a query at position t reads only the keys the policy keeps at t
            eye = torch.eye(S, dtype=torch.bool, device=self.device).unsqueeze(0)  # padding rows read themselves
            attn = self.policy_mask(position_ids, position_ids, mask, also=eye)
        logits, cache = self.forward(input_ids, attn, position_ids[:, head:], cache=cache, last_only=True,
                                     key_pos=position_ids)
        return torch.log_softmax(logits[:, -1, :].float(), dim=-1), cache, mask, position_ids

    def policy_mask(self, q_pos, k_pos, k_valid, also=None):
        """The 4-D additive attention mask of the KV-cache policy: query i of row r may read
        key column j when the column holds a real token (`k_valid`) the policy keeps visible
        at the query's position (`KVPolicy.visible` on the original position indices), or
        where `also` says so. (B, 1, Q, K) in the model's float dtype, 0 or its minimum."""
        allow = k_valid.bool()[:, None, :] & self.policy.visible(q_pos[:, :, None], k_pos[:, None, :])
        if also is not None:
            allow = allow | also
        return self.additive(allow)

    def additive(self, allow: torch.Tensor) -> torch.Tensor:
        """(B, Q, K) bool -> (B, 1, Q, K) additive float mask."""
        neg = torch.finfo(self.float_dtype).min
        return torch.zeros(allow.shape, dtype=self.float_dtype, device=allow.device).masked_fill(~allow, neg).unsqueeze(1)
