"""Where the model looks during the prefill (`--attention`, docs/metrics.md §1.8).

Owns: the attention implementation `evalkit_eager` — transformers' eager attention, the
explicit softmax(QKᵀ·scale + mask), computed by the model's own eager function in blocks
of query rows, so a layer never holds its whole (batch × heads × T × T) weight tensor and
no layer's weights outlive the layer — and, while one prefill runs under `capture`, the
per-layer reduction of each block's weights to what evalkit keeps:

- the first token's importance score α of every head, over the prompt's first
  T = min(64, n) tokens (Gu et al. 2025): α = (1/T) Σ_{t<T} A[t, 0], every query position
  counted, the first one included (as their reference code does); a head is a sink head
  when α > ε = 0.3;
- the attention mass that the last prompt position puts on named token spans (the
  needle sentence, the question), per head;
- on request, the last position's whole attention row, mean over heads (`evalkit inspect`).

Only a forward run inside `capture` needs the weights: every other forward of a model
switched to `evalkit_eager` (the decode steps, the candidate trie, the content-free prior)
runs the implementation the model ran before (`sdpa`: its fused kernels, no weights made),
so `--attention` costs the prefill's eager attention and nothing else. The capture keeps its
sums on the model's device and moves them to the host once per prefill (`results`): a
`.cpu()` per row, layer and span would stop a GPU at every layer.

`install(model)` switches a loaded model to `evalkit_eager` (and fixes glibc's mmap
threshold, so what the blocks free is given back); `token_span` maps a character span of
the prompt to its token positions. Does not: choose the spans (the backend does, from the
doc), store anything, or touch the engine's masks (the engine builds them; this module
only reads what it is handed).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from evalkit.prompts.encoding import encode, raw_ids
from evalkit.defaults import SINK_EPSILON, SINK_TOKENS

IMPLEMENTATION = "evalkit_eager"  # the name registered with transformers' AttentionInterface
BLOCK_BYTES = 16 << 20  # attention weights one block of query rows may hold (all rows of the batch, all heads)
# glibc: allocations of this many bytes or more get a mapping of their own, given back when freed
MMAP_THRESHOLD = 1 << 20


@dataclass(frozen=True)
class Request:
    """What to read off one prompt's prefill: named spans [start, end) in prompt token positions."""

    spans: dict[str, tuple[int, int]] = field(default_factory=dict)
    keep_last_row: bool = False


@dataclass
class PromptAttention:
    """One prompt's attention, reduced: per layer and head."""

    n_tokens: int  # prompt tokens
    sink_tokens: int  # T used for α: min(SINK_TOKENS, n_tokens)
    sink_alpha: list[list[float]]  # [layer][head] α of the first token
    spans: dict[str, list[list[float]]]  # name -> [layer][head] mass the last position puts on the span
    last_row: list[list[float]] | None = None  # [layer][position] the last position's attention, mean over heads

    @property
    def n_layers(self) -> int:
        return len(self.sink_alpha)

    def sink_rate_by_layer(self, epsilon: float = SINK_EPSILON) -> list[float]:
        """Per layer: the share of heads whose α exceeds ε."""
        return [sum(a > epsilon for a in heads) / len(heads) for heads in self.sink_alpha]

    def sink_score_by_layer(self) -> list[float]:
        """Per layer: α of the first token, mean over heads."""
        return [sum(heads) / len(heads) for heads in self.sink_alpha]

    def sink_rate(self, epsilon: float = SINK_EPSILON) -> float:
        """Sink₁^ε of Gu et al.: the share of all (layer, head) pairs whose α exceeds ε."""
        by_layer = self.sink_rate_by_layer(epsilon)
        return sum(by_layer) / len(by_layer)

    def span_by_layer(self, name: str) -> list[float]:
        """Per layer: the last position's attention mass on span `name`, mean over heads."""
        return [sum(heads) / len(heads) for heads in self.spans[name]]

    def span(self, name: str) -> float:
        """The span's mass, mean over heads and layers."""
        by_layer = self.span_by_layer(name)
        return sum(by_layer) / len(by_layer)


# ---- spans ---------------------------------------------------------------------------


def token_span(tokenizer, text: str, start: int, end: int) -> tuple[int, int] | None:
    """The token positions [first, last + 1) of `text`'s tokens that overlap characters [start, end).

    `text` is tokenised as the engine feeds a prompt (`encoding.encode`: a declared BOS first, which
    shifts every position by one). A token overlaps when any of its characters lies in the span (a
    token " The" that carries the space before a sentence belongs to the sentence). None when no token
    overlaps or the tokenizer gives no offsets.
    """
    if not 0 <= start < end <= len(text):
        return None
    shift = len(encode(tokenizer, text)) - len(raw_ids(tokenizer, text))  # the fed prefix, if any
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        span = _span_by_prefix(tokenizer, text, start, end)
    else:
        hits = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and a < end and b > start]
        span = (hits[0], hits[-1] + 1) if hits else None
    return None if span is None else (span[0] + shift, span[1] + shift)


def _span_by_prefix(tokenizer, text, start, end):
    """Slow tokenizers (no offsets): the span from the token counts of the text's prefixes."""
    def count(s: str) -> int:
        return len(raw_ids(tokenizer, s))
    first, last = count(text[:start]), count(text[:end])
    return (max(0, first - 1), last) if last > first else None


# ---- the attention implementation ------------------------------------------------------

_ACTIVE: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar("evalkit_attention_capture", default=None)
# id(config) -> the attention implementation the model ran before `install` (its forwards outside a capture run it)
_PLAIN: dict[int, str] = {}
# the implementations a forward outside a capture may be handed to: they read transformers' boolean 4-D mask
DELEGATES = ("sdpa",)


def _eager_of(module):
    """The eager attention function of the module's own modeling file (softcapping, sinks and
    other model-specific terms included), else Llama's."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


def eager_blocked(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention in blocks of query rows; returns (output, None).

    Each block is the model's own eager function on those query rows and every key, so
    every row's weights and output are eager's. Under `capture` each block's weights are
    reduced before the next block is computed. A boolean mask (True: attend) becomes
    eager's additive mask block by block.
    """
    cap = _ACTIVE.get()
    plain = _PLAIN.get(id(getattr(module, "config", None)))
    if cap is None and plain in DELEGATES:  # no weights wanted: the model's own fused attention
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[plain](module, query, key, value, attention_mask, scaling=scaling,
                                              dropout=dropout, **kwargs)
    eager = _eager_of(module)
    B, H, Q = query.shape[0], query.shape[1], query.shape[2]
    K = key.shape[-2]
    rows = max(1, BLOCK_BYTES // max(1, B * H * K * 4))
    outputs = []
    for q0 in range(0, Q, rows):
        q1 = min(Q, q0 + rows)
        mask, k, v = attention_mask, key, value
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            if mask.shape[-2] == Q:
                mask = mask[:, :, q0:q1]
            if mask.dtype == torch.bool:
                # keys no row of the block may see (the causal future) carry weight exactly 0: leave them out
                seen = mask.reshape(-1, mask.shape[-1]).any(0).nonzero()
                keep = int(seen[-1]) + 1 if seen.numel() else mask.shape[-1]
                if keep < mask.shape[-1] == K:
                    mask, k, v = mask[..., :keep], key[:, :, :keep], value[:, :, :keep]
                mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                    ~mask, torch.finfo(query.dtype).min)
        out, weights = eager(module, query[:, :, q0:q1], k, v, mask, scaling=scaling, dropout=dropout, **kwargs)
        if cap is not None:
            cap.observe(module, q0, Q, weights)
        del weights
        outputs.append(out)
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def _bool_mask(*args, **kwargs):
    """transformers' boolean (sdpa) mask, never skipped: a 4-D mask even without padding (a
    quarter of eager's float mask; eager_blocked turns each block into eager's values)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register `evalkit_eager` (and its mask) with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, eager_blocked)
    AttentionMaskInterface.register(IMPLEMENTATION, _bool_mask)


def install(model) -> str:
    """Switch a loaded transformers model to `evalkit_eager`; return the implementation now set.

    Also fixes glibc's mmap threshold for the process (`fix_mmap_threshold`), so the blocks'
    temporaries do not stay resident. Raises ValueError when the model cannot switch (it does
    not use transformers' AttentionInterface).
    """
    register()
    before = implementation(model)
    if before and before != IMPLEMENTATION:
        _PLAIN[id(model.config)] = before
    model.set_attn_implementation(IMPLEMENTATION)
    now = getattr(model.config, "_attn_implementation", None)
    if now != IMPLEMENTATION:
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation "
                         f"(it runs {now!r}); --attention needs a model that uses transformers' AttentionInterface")
    fix_mmap_threshold()
    return IMPLEMENTATION


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Serve every allocation of `threshold` bytes or more from a mapping of its own (glibc's
    M_MMAP_THRESHOLD, fixed); True when set, False where there is no glibc `mallopt`.

    `evalkit_eager` allocates and frees the same few large tensors once per block of query
    rows (the keys repeated per head, a block's weights); glibc's default threshold rises to
    32 MiB after the first such free, so they come from the heap, where the cache tensors
    allocated in between pin them and the process keeps what it freed. At 2048 tokens and a
    batch of 8 on SmolLM2-135M that made the prefill's peak RSS about 1 GB larger than sdpa's;
    with the threshold fixed it is sdpa's (bench/attention_cost.py).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(-3, int(threshold)))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def implementation(model) -> str | None:
    """The attention implementation a loaded model runs (sdpa, eager, evalkit_eager ...)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


# ---- capture ---------------------------------------------------------------------------


class _Capture:
    """Per-layer reductions of one batched prefill (left padding: row r's prompt starts at offsets[r])."""

    def __init__(self, requests: Sequence[Request], offsets: Sequence[int], length: int):
        self.requests = list(requests)
        self.offsets = [int(o) for o in offsets]
        self.length = int(length)  # P, the padded prompt length
        self.sink_t = [min(SINK_TOKENS, self.length - o) for o in self.offsets]
        self.layer_of: dict[int, int] = {}  # id(module) -> layer, for modules without layer_idx
        self.sink: dict[int, torch.Tensor] = {}  # layer -> (B, H) summed A[t, first] over t < T
        self.spans: dict[int, list[dict[str, torch.Tensor]]] = {}  # layer -> per row: name -> (H,)
        self.rows: dict[int, list[torch.Tensor | None]] = {}  # layer -> per row: (n,) last row, mean over heads

    def _layer(self, module) -> int:
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int):
            return idx
        return self.layer_of.setdefault(id(module), len(self.layer_of))

    def observe(self, module, q0: int, q_total: int, weights: torch.Tensor) -> None:
        """Add one block of query rows' weights (B, H, q, P) to the sums, on the weights' device
        (no host transfer here: a GPU would wait at every layer)."""
        if q_total != self.length:  # not this prefill's shape (cannot happen inside `capture`)
            return
        layer = self._layer(module)
        B, H, q = weights.shape[0], weights.shape[1], weights.shape[2]
        sink = self.sink.setdefault(layer, torch.zeros((B, H), dtype=torch.float64, device=weights.device))
        for r, o in enumerate(self.offsets):
            t0, t1 = max(o, q0), min(o + self.sink_t[r], q0 + q)
            if t0 < t1:
                sink[r] += weights[r, :, t0 - q0 : t1 - q0, o].double().sum(-1)
        if q0 + q != q_total:
            return
        last = weights[:, :, q - 1, :].double()  # (B, H, P): the last position of every row
        spans, rows = [], []
        for r, (req, o) in enumerate(zip(self.requests, self.offsets)):
            spans.append({name: last[r, :, o + s : o + e].sum(-1) for name, (s, e) in req.spans.items()})
            rows.append(last[r, :, o:].mean(0).float() if req.keep_last_row else None)
        self.spans[layer] = spans
        self.rows[layer] = rows

    def results(self) -> list[PromptAttention]:
        layers = sorted(self.sink)
        if not layers or sorted(self.spans) != layers:
            raise RuntimeError("the attention capture saw no complete layer: the model does not run "
                               f"{IMPLEMENTATION} (see attention.install)")
        # every sum to the host in one transfer: (L, B, H) sinks, then each span's (L, B, H)
        sink = torch.stack([self.sink[layer] for layer in layers]).cpu()
        names = sorted({name for req in self.requests for name in req.spans})
        zero = torch.zeros_like(self.sink[layers[0]][0])
        span = {name: torch.stack([torch.stack([self.spans[layer][r].get(name, zero) for r in range(len(self.requests))])
                                   for layer in layers]).cpu() for name in names}
        out = []
        for r, (req, o) in enumerate(zip(self.requests, self.offsets)):
            T = self.sink_t[r]
            out.append(PromptAttention(
                n_tokens=self.length - o,
                sink_tokens=T,
                sink_alpha=(sink[:, r] / T).tolist(),
                spans={name: span[name][:, r].tolist() for name in req.spans},
                last_row=[self.rows[layer][r].cpu().tolist() for layer in layers] if req.keep_last_row else None,
            ))
        return out


@contextlib.contextmanager
def capture(requests: Sequence[Request], offsets: Sequence[int], length: int) -> Iterator[_Capture]:
    """Reduce the attention of the forward passes run inside the block (one batched prefill of
    `length` positions, row r's prompt from `offsets[r]` on) to each request's numbers; read
    them with `.results()` after the forward."""
    cap = _Capture(requests, offsets, length)
    token = _ACTIVE.set(cap)
    try:
        yield cap
    finally:
        _ACTIVE.reset(token)
