"""What the first-step engine's modules share: one probe call's settings and the rules its tokens follow.

Owns `_Settings`, the base of the engine (`firststep._Engine`): every setting a `Prober` is given (top-k,
stop strings, first-step interventions, tolerance, KV-cache policy, unit ranks), what is read once off the
model and tokenizer (device, float dtype, eos and pad ids, the forward's keyword names), and the rules a
response's tokens follow: ids decoded to text, where a continuation stops (eos, a stop string,
`max_new_tokens`), whether rows of different batches may share decode steps. Also the share of a batch's
time a progress bar gives its phases.

The modules beside it build on it: `prefill` (the forwards, masks, shared head and head split), `trie` (the
candidate trie and first units), `decoder` (the shared decode steps) and `firststep` (batching, the
`Prober`, one batch's first step).

Does not: run the model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from evalkit.engines.kvpolicy import FULL


# the share of a batch's time a progress bar gives its phases (a guide for the eye, not a measure)
PREFILL_SHARE, FIRST_STEP_SHARE = 0.3, 0.5


def _model_device(model) -> torch.device:
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


def _eos_ids(model, tokenizer) -> set[int]:
    """Token ids that end a response: tokenizer eos, `<|im_end|>`, generation-config eos."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    unk = getattr(tokenizer, "unk_token_id", None)
    if isinstance(im_end, int) and im_end >= 0 and im_end != unk:
        ids.add(im_end)
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, Iterable):
        ids.update(int(i) for i in gen_eos)
    return ids


class _Settings:
    """One probe call's settings, and the rules its tokens follow (see the module docstring)."""

    def __init__(self, model, tokenizer, top_k, max_new_tokens, stop, first_temperature,
                 banned_first_ids, seed, tolerance=0.0, kv_policy=None, unit_ranks=0,
                 attention=None):
        self.model = model
        self.progress: Callable[[str, float], None] = lambda phase, share: None  # see `probe`
        self.unit_ranks = max(0, int(unit_ranks))
        self.policy = kv_policy or FULL
        self.attention = attention  # per context: attention.Request, or None
        self.tolerance = float(tolerance)
        self.tokenizer = tokenizer
        self.top_k = top_k
        self.max_new_tokens = max_new_tokens
        self.stop = [s for s in stop if s]
        self.first_temperature = first_temperature
        self.banned = sorted(int(i) for i in banned_first_ids)
        self.seed = seed
        self.device = _model_device(model)
        self.float_dtype = next(
            (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32
        )
        self.eos = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.pad_id = int(pad)
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache` (old name deprecated)
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = "logits_to_keep" in params
        self._split: tuple[Any, Any, str] | None | bool = False  # `head_split`, looked up at the first trie level
        # (text after the context's last added token, candidate) -> the candidate's tokens there (`in_context`)
        self.tail_ids: dict[tuple[str, str], list[int]] = {}
        self.frame_cuts = True  # False once this tokenizer is seen not to cut its input at added tokens
        self.lead_space = False  # score each candidate's whitespace-led paths too (`trie.whitespace_paths`)
        # (text after the context's last added token, whitespace node, string) -> its tokens after them
        self.lead_ids: dict[tuple[str, tuple[int, ...], str], list[int]] = {}
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added_tokens = [str(getattr(t, "content", t)) for t in decoder.values() if str(getattr(t, "content", t))]

    @property
    def policy_merges(self) -> bool:
        """Whether rows of different batches may share decode steps (`_Decoder`): not under a rounded
        cache, whose layers keep per-row residuals of their own."""
        return not self.policy.rounds

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def accept(self, response: list[int], token: int, limit: int, stop: bool = True) -> bool:
        """Append `token` to `response` unless it is eos; True while the row goes on."""
        if token in self.eos:
            return False
        response.append(token)
        if len(response) >= limit:
            return False
        return not (stop and self.stopped(response))

    def stopped(self, ids: list[int]) -> bool:
        return bool(self.stop) and any(s in self.tokenizer.decode(ids) for s in self.stop)

    def response_prefix(self, ids: list[int]) -> list[int]:
        """The tokens a generation with the stop strings and `max_new_tokens` would have kept."""
        for k in range(1, min(len(ids), self.max_new_tokens) + 1):
            if self.stopped(ids[:k]):
                return ids[:k]
        return ids[: self.max_new_tokens]
