"""The teacher-forced pass of drift by position (docs/drift.md): one prefill of prompt + response.

Owns, for a Hugging Face causal LM (or the llama.cpp engine):
- `teacher_force`: the next-token log-distribution at every position of given target tokens after
  a context — one batched forward of context + target[:-1] per prompt (left padding, explicit
  position ids, no cache), the logits of the target's positions only (`logits_to_keep`);
  `sequence_force` the same through the llama.cpp engine (one prefill per prompt), so "the same
  GGUF through transformers and through llama.cpp" is a pair too (engine drift);
- `base_pass`: a base model's distributions kept compact (`scoring.drift.compact`);
- `drift_pass`: a candidate's distributions compared, position by position, with a base's
  compact ones (`scoring.drift.compare_position`);
- `corpus_chunks` / `corpus_pass`: a text scored as `llama-perplexity --kl-divergence` scores it
  (chunks of n_ctx tokens, BOS first, the second half of each chunk).

Does not: generate (the base's tokens come from its greedy run, `firststep.probe`), apply a KV-cache
policy (the pass runs the full cache: drift compares models, not cache policies), store anything
or compute statistics beyond one position (`scoring.drift`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from evalkit.engines.transformers.firststep import _batches
from evalkit.engines.transformers.shared import _model_device
from evalkit.engines.transformers.windows import allowed, windows_of
from evalkit.defaults import BATCH_TOKENS, DEFAULT_BATCH_SIZE
from evalkit.scoring import drift


@dataclass(frozen=True)
class Forced:
    """One prompt to teacher-force: its context tokens and the target tokens (the base's response)."""

    context_ids: list[int]
    target_ids: list[int]


# target positions whose (V,) float32 log-softmax one teacher-forced batch holds: 512 x 49152 x 4 bytes
# = 100 MB on the default model, twice (logits and log-softmax), whatever the run's batch size
LOGIT_POSITIONS = 512


def teacher_force(model, items: Sequence[Forced], *, batch_size: int = DEFAULT_BATCH_SIZE,
                  batch_tokens: int = BATCH_TOKENS, pad_id: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (index into `items`, (L, V) float32 log-softmax) for every item with a target, in batches.

    Row j of an item's tensor is the distribution of target token j given the context and the
    target tokens before it. One forward per batch of context + target[:-1]; items are batched
    longest first within `batch_size` prompts and `batch_tokens` padded positions, and within
    LOGIT_POSITIONS target positions, whose full-vocabulary distributions a batch holds at once.
    """
    todo = [i for i, it in enumerate(items) if it.target_ids]
    longest = max((len(items[i].target_ids) for i in todo), default=1)
    batch_size = max(1, min(batch_size, LOGIT_POSITIONS // longest))
    for i in todo:
        if not items[i].context_ids:
            raise ValueError(f"item {i} has no context tokens; nothing to predict from")
    lengths = {i: len(items[i].context_ids) + len(items[i].target_ids) - 1 for i in todo}
    order = sorted(todo, key=lambda i: (-lengths[i], i))
    device = _model_device(model)
    keep_kw = "logits_to_keep" in _forward_params(model)
    windows = windows_of(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    with torch.inference_mode():
        for rows in _batches(order, [lengths.get(i, 0) for i in range(len(items))], batch_size, batch_tokens):
            T = max(lengths[i] for i in rows)
            L = max(len(items[i].target_ids) for i in rows)
            ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
            mask = torch.zeros((len(rows), T), dtype=torch.long)
            for r, i in enumerate(rows):
                seq = items[i].context_ids + items[i].target_ids[:-1]
                ids[r, T - len(seq):] = torch.tensor(seq, dtype=torch.long)
                mask[r, T - len(seq):] = 1
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            mask, pos = mask.to(device), pos.to(device)
            attn = mask
            if windows is not None:  # sliding layers: each layer type's mask from the real positions
                attn = windows.masks(allowed(mask, pos, pos), pos, pos, dtype)
            kwargs = {"input_ids": ids.to(device), "attention_mask": attn, "position_ids": pos, "use_cache": False}
            if keep_kw:
                kwargs["logits_to_keep"] = L
            logits = model(**kwargs).logits[:, -L:, :]
            logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
            for r, i in enumerate(rows):
                n = len(items[i].target_ids)
                yield i, logprobs[r, L - n:]


def sequence_force(eng, items: Sequence[Forced]) -> Iterator[tuple[int, torch.Tensor]]:
    """`teacher_force` through the llama.cpp engine (`llamacpp.firststep.LlamaCppEngine`): one prefill of
    context + target[:-1] per item (`sequence_logits`), the distributions of the target's positions.
    The token ids must be the engine's own (the same GGUF vocabulary as the base's)."""
    for i, it in enumerate(items):
        if not it.target_ids:
            continue
        if not it.context_ids:
            raise ValueError(f"item {i} has no context tokens; nothing to predict from")
        ids = list(it.context_ids) + list(it.target_ids[:-1])
        logits = torch.from_numpy(eng.sequence_logits(ids, len(it.context_ids)))  # (L, V) float32
        yield i, torch.log_softmax(logits.double(), dim=-1)


def forced(model, items: Sequence[Forced], *, batch_size: int = DEFAULT_BATCH_SIZE,
           pad_id: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """The teacher-forced distributions through whichever engine `model` is: a llama.cpp engine (it has
    `sequence_logits`), else a Hugging Face causal LM."""
    if hasattr(model, "sequence_logits"):
        return sequence_force(model, items)
    return teacher_force(model, items, batch_size=batch_size, pad_id=pad_id)


def _forward_params(model) -> set[str]:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def compact_rows(logprobs: torch.Tensor, eps: float = drift.DEFAULT_EPS,
                 keep: Sequence[int] | None = None) -> list[drift.Compact]:
    """`drift.compact` of every row of an (L, V) log-softmax, sorted once in torch (same result);
    `keep[j]`: row j's token that must be listed (`drift.compact`'s `keep`).

    Ties in probability are broken by token id, as `drift.compact` breaks them.
    """
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must be in [0, 1), got {eps}")
    lp = logprobs.double()
    values, idx = torch.sort(lp, dim=-1, descending=True, stable=True)
    p = values.exp()
    tails = torch.flip(torch.cumsum(torch.flip(p, [-1]), -1), [-1])  # tails[:, j] = mass of ranks >= j
    tails = torch.cat([tails, torch.zeros((tails.shape[0], 1), dtype=tails.dtype)], dim=-1)
    ks = torch.argmax((tails <= eps).to(torch.int8), dim=-1).clamp(min=1).tolist()
    out = []
    for r, k in enumerate(ks):
        out.append(drift.with_kept(idx[r, :k].numpy().astype(np.int32), values[r, :k].numpy().astype(np.float32),
                                   float(tails[r, k]), lp[r].numpy(), None if keep is None else int(keep[r])))
    return out


def base_pass(model, items: Sequence[Forced], *, eps: float = drift.DEFAULT_EPS, batch_size: int = DEFAULT_BATCH_SIZE,
              pad_id: int = 0) -> list[list[drift.Compact]]:
    """Per item: its compact distribution at each target position (empty for an empty target); the
    target token is always listed (for a greedy response it is the top token anyway)."""
    out: list[list[drift.Compact]] = [[] for _ in items]
    for i, lp in forced(model, items, batch_size=batch_size, pad_id=pad_id):
        out[i] = compact_rows(lp, eps, items[i].target_ids)
    return out


def drift_pass(model, items: Sequence[Forced], bases: Sequence[Sequence[drift.Compact]], *,
               batch_size: int = DEFAULT_BATCH_SIZE, pad_id: int = 0) -> list[list[drift.PositionDrift]]:
    """Per item: the candidate's drift from the base at each target position (`drift.compare_position`
    with the target token, the base's greedy choice, as the Δp token)."""
    if len(bases) != len(items):
        raise ValueError(f"{len(bases)} base distributions for {len(items)} items")
    out: list[list[drift.PositionDrift]] = [[] for _ in items]
    for i, lp in forced(model, items, batch_size=batch_size, pad_id=pad_id):
        if len(bases[i]) != lp.shape[0]:
            raise ValueError(f"item {i}: {len(bases[i])} base positions for {lp.shape[0]} target tokens")
        top_id = max(int(b.ids.max()) for b in bases[i])
        if top_id >= lp.shape[1]:
            raise ValueError(f"the base lists token {top_id}, beyond this model's {lp.shape[1]} tokens: "
                             "drift needs the same vocabulary on both sides")
        q = lp.double().numpy()
        out[i] = [drift.compare_position(b, q[j], items[i].target_ids[j]) for j, b in enumerate(bases[i])]
    return out


# --- corpus mode -------------------------------------------------------------------------


def corpus_chunks(tokens: Sequence[int], n_ctx: int, bos_id: int | None) -> list[list[int]]:
    """The text's tokens cut as llama-perplexity cuts them: consecutive chunks of n_ctx tokens (a last
    partial chunk dropped), the first token of each replaced by BOS when the model has one.

    >>> corpus_chunks(list(range(10)), 4, bos_id=99)
    [[99, 1, 2, 3], [99, 5, 6, 7]]
    """
    if n_ctx < 4:
        raise ValueError(f"n_ctx must be at least 4, got {n_ctx}")
    chunks = []
    for start in range(0, len(tokens) - n_ctx + 1, n_ctx):
        chunk = list(tokens[start:start + n_ctx])
        if bos_id is not None:
            chunk[0] = int(bos_id)
        chunks.append(chunk)
    return chunks


def scored_items(chunks: Sequence[Sequence[int]]) -> list[Forced]:
    """Each chunk as a teacher-forced item: the first half (n_ctx // 2 + 1 tokens) is the context,
    the rest the n_ctx - 1 - n_ctx // 2 scored tokens, as llama-perplexity scores them."""
    out = []
    for chunk in chunks:
        first = len(chunk) // 2
        out.append(Forced(list(chunk[:first + 1]), list(chunk[first + 1:])))
    return out
