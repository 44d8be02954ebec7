"""Models whose layers do not all read the whole past: sliding-window attention layers.

Gemma-2/3 (five sliding layers to one full one), Mistral, Phi-3, Qwen2 with `use_sliding_window` and
others declare it in their config (`sliding_window`, `layer_types`). Left to itself transformers gives
such a model a cache with sliding layers (`DynamicSlidingWindowLayer`: a running token count, the last
window - 1 keys) and builds each layer type's mask from that count and the column indices. The
first-step engine edits its caches (the candidate trie's columns appended and cropped off, rows
selected, padded and merged), feeds left-padded rows and trie nodes off their column order, so that
count and those indices stop meaning positions: shape errors ("The size of tensor a (19) must match
the size of tensor b (28)"), or a window counted over padding.

Owns `Windows`, read once off a model (`windows_of`; None for a model every layer of which reads the
whole past, like Llama and SmolLM2, for which nothing here runs): a plain cache (every layer a growing
`DynamicLayer` that keeps every key, `plain_cache`), and the masks every forward hands such a model,
built from real positions (`Windows.masks`): a full layer reads what the engine allows, a sliding
layer only the allowed keys fewer than `window` positions back (transformers' and llama.cpp's rule:
q - k < window). Where full and sliding layers mix, the masks go as transformers' per-layer-type dict
(the modeling code then builds none of its own). Also the refusal of layer kinds evalkit does not
model (`chunked_attention`), said as the model loads.

Does not: say which keys the engine allows (the KV-cache policy, the trie: `prefill`, `trie`), or
run the model.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref

import torch

from evalkit.errors import BadInput

FULL, SLIDING = "full_attention", "sliding_attention"
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> Windows | None


@dataclasses.dataclass(frozen=True)
class Windows:
    """A model with sliding-window layers: a query at position q reads a key at position k of a
    sliding layer only when q - k < `window`; `mixed`: full layers beside them (masks per layer type)."""

    window: int
    mixed: bool

    def masks(self, allow: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype: torch.dtype):
        """The additive masks of one forward: `allow` (B, Q, K) bool, the keys the engine lets each query
        read; `q_pos` (B, Q) and `k_pos` (B, K) the queries' and key columns' positions. One (B, 1, Q, K)
        mask when every layer slides, else {layer type: mask} as the modeling code takes it."""
        near = (q_pos[:, :, None] - k_pos[:, None, :]) < self.window
        sliding = _additive(allow & near.to(allow.device), dtype)
        if not self.mixed:
            return sliding
        return {FULL: _additive(allow, dtype), SLIDING: sliding}


def _additive(allow: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, Q, K) bool -> (B, 1, Q, K) additive float mask: 0 where allowed, the dtype's minimum elsewhere
    (a row with nothing allowed reads uniformly, never NaN)."""
    neg = torch.finfo(dtype).min
    return torch.zeros(allow.shape, dtype=dtype, device=allow.device).masked_fill(~allow, neg).unsqueeze(1)


def allowed(attention_mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """(B, Q, K) bool: what an engine mask lets each query read. A 2-D key mask (B, K), 1 where a column
    holds a real token, reads every real key at or before the query's position (causal by position);
    a 4-D additive mask (B, 1, Q, K) is read as it is (0: allowed)."""
    if attention_mask.dim() == 2:
        return attention_mask.bool()[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    return attention_mask[:, 0] == 0


def key_positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, K) each column's position under a 2-D key mask whose real columns run in order (left padding,
    padding after a shared head): the real tokens counted before it, as the prefill numbers them."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _layer_types(config) -> list[str]:
    """Each layer's attention type, as transformers' own cache reads the config: `layer_types`, else a
    layer with `sliding_window` slides and one with `attention_chunk_size` is chunked."""
    types = getattr(config, "layer_types", None)
    if types:
        return [str(t) for t in types]
    n = int(getattr(config, "num_hidden_layers", 0) or 0)
    if getattr(config, "sliding_window", None) is not None:
        return [SLIDING] * n
    if getattr(config, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * n
    return [FULL] * n


def _takes_mask_dict(model) -> bool:
    """Whether the model's decoder takes a {layer type: mask} dict as its attention mask (transformers'
    hybrid models: `isinstance(causal_mask_mapping := attention_mask, dict)`)."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, TypeError):
        decoder = model
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return False
    return "attention_mask, dict)" in source


def windows_of(model) -> Windows | None:
    """The model's sliding-window layout (None: every layer reads the whole past); decided once per model.

    Raises BadInput for layer kinds evalkit does not model (chunked attention), or a model mixing full
    and sliding layers whose modeling code takes no mask per layer type."""
    if model in _FOUND:
        return _FOUND[model]
    config = getattr(model, "config", None)
    if config is None:  # a module without a transformers config (a wrapper): no layer kinds to read
        return None
    get_text = getattr(config, "get_text_config", None)
    if get_text is not None:
        config = get_text(decoder=True)
    types = set(_layer_types(config))
    other = sorted(types - {FULL, SLIDING})
    if "chunked_attention" in other:
        raise BadInput(f"this model has chunked-attention layers ({type(model).__name__}); evalkit's hf engine "
                       "models full and sliding-window attention only")
    found = None
    if SLIDING in types:
        window = getattr(config, "sliding_window", None)
        if not isinstance(window, int) or window < 1:
            raise BadInput(f"this model has sliding-window layers but no usable sliding_window in its config "
                           f"({window!r})")
        mixed = FULL in types
        if mixed and not _takes_mask_dict(model):
            raise BadInput(f"this model ({type(model).__name__}) mixes full and sliding-window layers but its "
                           "transformers code takes no mask per layer type; evalkit's hf engine cannot mask it")
        found = Windows(window=window, mixed=mixed)
    _FOUND[model] = found
    return found


def plain_cache():
    """An empty cache whose every layer is a plain growing `DynamicLayer` (keeps every key; the masks
    keep sliding layers to their window), which the engine may crop, select, pad and merge."""
    from transformers import DynamicCache

    return DynamicCache()
