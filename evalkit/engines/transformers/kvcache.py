"""The rounded KV caches of the `fp8` and `quantized:BACKEND:BITS` policies, inside transformers.

Owns: `new_cache`, the cache a rounding policy (`kvpolicy.KVPolicy.rounds`) runs with: keys and
values rounded when written, and read as stored by every query, its own key included, in the
prefill too (transformers' `QuantizedCache` returns the prefill's own keys unrounded, so under
`generate` the prompt's first-step distribution would not change at all). Group-wise backends
keep the newest tokens in full precision in the residual buffer until it holds `RESIDUAL` of
them. Does not: parse a policy or say which keys a query sees (`evalkit.engines.kvpolicy`), or
build the masks (`firststep`).
"""

from __future__ import annotations

from evalkit.engines.kvpolicy import GROUP, KV_BACKENDS, KVQUANT_PIP, RESIDUAL, KVPolicy
from evalkit.errors import BadInput

FP8_MAX = 448.0  # largest finite float8_e4m3fn

# --- rounded caches ------------------------------------------------------------------


class _Rounder:
    """Rounds one prompt's (one batch row's) keys or values as the policy stores them."""

    def __init__(self, policy: KVPolicy):
        self.policy = policy
        self.helper = None
        if policy.kind == "quantized":
            import transformers.cache_utils as cu

            library = KV_BACKENDS[policy.backend]
            cls = getattr(cu, library.layer_class, None)
            if cls is None:
                raise BadInput(f"--kv-cache {policy.spec}: this transformers has no {library.layer_class}")
            try:
                self.helper = cls(nbits=policy.bits)
            except ImportError as exc:
                package = library.package
                raise BadInput(f"--kv-cache {policy.spec} needs the {package} package: {KVQUANT_PIP}; "
                               f"{str(exc).splitlines()[0]}") from None

    def fp8_scale(self, t):
        import torch

        return (t.abs().amax().float() / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)

    def fp8(self, t, scale):
        import torch

        return (t.float() / scale).to(torch.float8_e4m3fn).float().mul(scale).to(t.dtype)

    def groupwise(self, t, axis: int):
        """transformers' quantize then dequantize of one row's chunk, as its QuantizedLayer would."""
        h = self.helper
        h.keys = t  # HQQ reads the device and compute dtype off the layer's keys
        # groups of 64 as transformers' default, which span whole head vectors when the head
        # dimension is a multiple of 64; otherwise (tiny test models) one head vector a group
        h.q_group_size = GROUP if t.shape[-1] % GROUP == 0 else t.shape[-1]
        return h._dequantize(h._quantize(t.contiguous(), axis=axis)).to(t.dtype)


class RoundedLayer:
    """Factory of the cache layer class: a transformers `DynamicLayer` whose stored keys and
    values are rounded when written (built lazily so importing this module needs no torch)."""

    _cls = None

    @classmethod
    def make(cls, rounder: _Rounder, state: dict):
        if cls._cls is None:
            cls._cls = _define_layer()
        return cls._cls(rounder, state)


def _define_layer():
    import torch
    from transformers.cache_utils import DynamicLayer

    class _RoundedLayer(DynamicLayer):
        """Keys and values stored as dequantize(quantize(x)): numerically what a quantized cache
        returns, kept in the compute dtype so slicing, batch selection and masks work as for a
        plain dynamic layer. Rounded per batch row (over its real prompt tokens only), so a
        prompt's result does not depend on the others in its batch."""

        def __init__(self, rounder, state):
            super().__init__()
            self.rounder, self.state = rounder, state
            self.scales = None  # fp8: (B, 2) per-row key / value scales, frozen after the prompt
            self.tail = 0  # group-wise: unrounded columns at the end (the residual buffer)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                key_states, value_states = self._round_prompt(key_states, value_states)
            elif self.rounder.policy.kind == "fp8":
                key_states = self._round_rows(key_states, 0)
                value_states = self._round_rows(value_states, 1)
            else:
                self.tail += key_states.shape[-2]
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            if self.tail >= RESIDUAL and not self.state.get("hold"):
                self._flush()
            return self.keys, self.values

        def _round_prompt(self, keys, values):
            pads = self.state["pads"]
            keys, values = keys.clone(), values.clone()
            fp8 = self.rounder.policy.kind == "fp8"
            if fp8:
                self.scales = torch.ones((keys.shape[0], 2), dtype=torch.float32, device=keys.device)
            for r, pad in enumerate(pads):
                for j, t in enumerate((keys, values)):
                    chunk = t[r : r + 1, :, pad:, :]
                    if chunk.shape[-2] == 0:
                        continue
                    if fp8:
                        self.scales[r, j] = self.rounder.fp8_scale(chunk)
                        t[r : r + 1, :, pad:, :] = self.rounder.fp8(chunk, self.scales[r, j])
                    else:
                        axis = self.rounder.helper.axis_key if j == 0 else self.rounder.helper.axis_value
                        t[r : r + 1, :, pad:, :] = self.rounder.groupwise(chunk, axis)
            return keys, values

        def _round_rows(self, t, j):
            out = t.clone()
            for r in range(t.shape[0]):
                out[r] = self.rounder.fp8(t[r], self.scales[r, j])
            return out

        def _flush(self):
            """Quantize the residual buffer (group-wise backends), as transformers does once it is full."""
            n = self.tail
            for t, axis in ((self.keys, self.rounder.helper.axis_key), (self.values, self.rounder.helper.axis_value)):
                for r in range(t.shape[0]):
                    t[r : r + 1, :, -n:, :] = self.rounder.groupwise(t[r : r + 1, :, -n:, :], axis)
            self.tail = 0

        def truncate(self, length: int) -> None:
            removed = self.keys.shape[-2] - length
            self.keys = self.keys[..., :length, :]
            self.values = self.values[..., :length, :]
            self.tail = max(0, self.tail - removed)

        def batch_select_indices(self, indices) -> None:
            super().batch_select_indices(indices)
            if self.scales is not None:
                self.scales = self.scales[indices.to(self.scales.device)]

    return _RoundedLayer


def new_cache(policy: KVPolicy, model, pads: list[int]):
    """An empty cache for one batch that stores keys and values as `policy` rounds them.

    `pads[r]` is the number of left-padding columns of batch row r (rounded caches
    calibrate on each row's real prompt tokens only). The cache's `evalkit_state` dict is
    shared by its layers: its "hold" is set while tokens that are alternatives rather than
    a sequence (the candidate trie) sit in the residual buffer, so they are never flushed.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=model.config)
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    # a sliding layer's rounded layer keeps every key too: the engine's masks hold it to its window (`windows`)
    if cache.layers and any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers):
        raise BadInput(f"--kv-cache {policy.spec} needs a model with full attention in every layer "
                       "(transformers' QuantizedCache has the same limit)")
    rounder = _Rounder(policy)
    state = {"pads": list(pads), "hold": False}
    cache.layers = [RoundedLayer.make(rounder, state) for _ in range(n_layers)]
    cache.layer_class_to_replicate = None
    cache.evalkit_state = state  # type: ignore[attr-defined]  # read back by the engine
    return cache
