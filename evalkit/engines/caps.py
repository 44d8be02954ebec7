"""How much an in-process engine puts in one forward, derived from a memory budget and the model's shapes.

Owns: `Shapes` (what a model's memory per position and per vocabulary entry depends on: layers, KV
heads, head size, hidden and MLP sizes, vocabulary, the compute dtype's bytes), `shapes_of` (read off a
loaded Hugging Face model's config, by attribute, no transformers import), `Caps` (prompts a batch,
padded positions a batch, padded positions a candidate-trie level) and `derive`, the pure function
from a budget and shapes to caps. Does not: measure memory, or batch anything itself.

The budget (`defaults.MEMORY_BUDGET`, 1 GiB) is the working memory an engine's tensors may take
beyond the weights and the process. It is split in three:

- a third for the batch's padded positions: each one holds its KV cache, 2 x layers x KV heads x
  head size x dtype bytes, and the prefill's per-layer temporaries, about (4 x hidden + 3 x MLP
  size) x dtype bytes (hidden state, residual, queries, attention output; the MLP's gate, up and
  product). Rounded down to a multiple of 512;
- a sixth for a trie level's positions: each one a position as above plus a float32 row of logits
  over the vocabulary (4 x vocabulary bytes). Rounded down to a power of two;
- the rest for what each prompt of a batch keeps (its float32 first-step distribution and its
  decode step's logits, 2 x 4 x vocabulary bytes) and what the shares above leave out (the
  decoder's growing rows, allocator slack).

A batch holds `PROMPT_POSITIONS` (144: a chat-templated first-token prompt with room to spare) a prompt
at most, so its prompt count is padded positions // 144, unless the third share cannot hold that
many distributions. Longer prompts still go fewer at a time: the positions cap bounds prompts x the
longest prompt's length (`transformers.firststep._batches`).

The shares are calibrated on the default model, SmolLM2-135M-Instruct in fp32, where 32 prompts,
4608 positions and 512-position trie levels were measured to keep the whole first-token suite under
2 GB of peak RSS (docs/performance.md); other models get caps in proportion to their bytes per
position and per vocabulary entry. The prefill's attention scores (heads x prompt length squared,
one layer at a time) are not modelled: they grow with the longest prompt, which no cap here bounds.

Worked numbers, at the default budget of 2**30 bytes:

SmolLM2-135M (30 layers, 3 KV heads of 64, hidden 576, MLP 1536, vocabulary 49,152, fp32):
a position is 2·30·3·64·4 = 46,080 bytes of cache + 4·(4·576 + 3·1536) = 27,648 of temporaries =
73,728; 2**30 / 3 / 73,728 = 4,854 → 4,608 positions; 4,608 // 144 = 32 prompts; a trie position
adds 4·49,152 = 196,608 bytes of logits: 2**30 / 6 / 270,336 = 661 → 512.

>>> smol = Shapes(layers=30, kv_heads=3, head_dim=64, hidden=576, intermediate=1536, vocab=49152, dtype_bytes=4)
>>> derive(smol)
Caps(batch_prompts=32, batch_positions=4608, trie_positions=512, budget=1073741824)

Qwen2.5-0.5B's shapes (24 layers, 2 KV heads of 64, hidden 896, MLP 4864, vocabulary 151,936, fp32):
24,576 + 72,704 = 97,280 bytes a position → 3,679 → 3,584 positions, 24 prompts; a trie position
97,280 + 607,744 = 705,024 bytes → 253 → 128.

>>> derive(Shapes(layers=24, kv_heads=2, head_dim=64, hidden=896, intermediate=4864, vocab=151936, dtype_bytes=4))
Caps(batch_prompts=24, batch_positions=3584, trie_positions=128, budget=1073741824)

The same model in bf16 computes at half the bytes a position: 48,640 → 7,358 → 7,168 positions.

>>> derive(Shapes(layers=24, kv_heads=2, head_dim=64, hidden=896, intermediate=4864, vocab=151936, dtype_bytes=2))
Caps(batch_prompts=49, batch_positions=7168, trie_positions=256, budget=1073741824)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from evalkit.defaults import MAX_BATCH_SIZE, MEMORY_BUDGET

POSITION_SHARE = 1 / 3  # of the budget: a batch's padded positions
TRIE_SHARE = 1 / 6  # of the budget: one candidate-trie level's padded positions
ROW_SHARE = 1 / 2  # of the budget: what each prompt keeps (its distributions), and slack
POSITION_STEP = 512  # padded positions are rounded down to a multiple of this
PROMPT_POSITIONS = 144  # positions a batch allows each prompt: batch_prompts = batch_positions // this
LOGIT_BYTES = 4  # the engine reads logits as float32 whatever the model computes in
ROW_COPIES = 2  # vocabulary-sized float32 rows a prompt holds: its first-step distribution, a decode step's logits


@dataclass(frozen=True)
class Shapes:
    """What a model's working memory grows with."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    dtype_bytes: int  # of the dtype the model computes in (the KV cache's and the activations')

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Shapes.{name} must be a whole number >= 1, got {value!r}")

    @property
    def kv_bytes(self) -> int:
        """KV cache bytes a position: keys and values of every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def position_bytes(self) -> int:
        """A batch position: its KV cache and the prefill's per-layer temporaries."""
        return self.kv_bytes + (4 * self.hidden + 3 * self.intermediate) * self.dtype_bytes

    @property
    def trie_bytes(self) -> int:
        """A trie-level position: a batch position and its float32 logits over the vocabulary."""
        return self.position_bytes + LOGIT_BYTES * self.vocab


@dataclass(frozen=True)
class Caps:
    """What one forward of an in-process engine may hold (see the module docstring)."""

    batch_prompts: int  # prompts a batch
    batch_positions: int  # padded positions a batch (prompts x its longest prompt)
    trie_positions: int  # padded node positions a candidate-trie level
    budget: int  # the working-memory budget they were derived from, bytes


def derive(shapes: Shapes, budget: int = MEMORY_BUDGET, batch_prompts: int | None = None) -> Caps:
    """The caps of a model of these shapes under `budget` bytes of working memory; `batch_prompts`,
    when given (an explicit `--batch-size`), is kept as asked and only the positions are derived.

    >>> derive(Shapes(30, 3, 64, 576, 1536, 49152, 4), batch_prompts=8).batch_prompts
    8
    >>> derive(Shapes(30, 3, 64, 576, 1536, 49152, 4), budget=2**24)  # 16 MiB: below one step of 512
    Caps(batch_prompts=1, batch_positions=75, trie_positions=8, budget=16777216)
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a whole number of bytes >= 1, got {budget!r}")
    positions = _floor_step(int(budget * POSITION_SHARE) // shapes.position_bytes, POSITION_STEP)
    trie = _floor_pow2(int(budget * TRIE_SHARE) // shapes.trie_bytes)
    if batch_prompts is None:
        rows = int(budget * ROW_SHARE) // (ROW_COPIES * LOGIT_BYTES * shapes.vocab)
        batch_prompts = max(1, min(positions // PROMPT_POSITIONS, rows, MAX_BATCH_SIZE))
    elif isinstance(batch_prompts, bool) or not isinstance(batch_prompts, int) or batch_prompts < 1:
        raise ValueError(f"batch_prompts must be a whole number >= 1, got {batch_prompts!r}")
    return Caps(batch_prompts=batch_prompts, batch_positions=positions, trie_positions=trie, budget=budget)


def _floor_step(n: int, step: int) -> int:
    """`n` rounded down to a multiple of `step`; below one step, `n` itself (at least 1).

    >>> _floor_step(4854, 512), _floor_step(511, 512), _floor_step(0, 512)
    (4608, 511, 1)
    """
    return max(1, n // step * step if n >= step else n)


def _floor_pow2(n: int) -> int:
    """The largest power of two <= `n` (1 for `n` < 1).

    >>> _floor_pow2(661), _floor_pow2(512), _floor_pow2(0)
    (512, 512, 1)
    """
    return 1 << (max(n, 1).bit_length() - 1)


def shapes_of(model: Any) -> Shapes:
    """The shapes of a loaded Hugging Face causal LM, read off its (text) config and its first floating
    parameter's dtype. A config without `num_key_value_heads` has as many KV heads as heads; without
    `head_dim`, hidden // heads; without `intermediate_size`, 4 x hidden."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    dtype_bytes = int(dtype.itemsize) if dtype is not None else LOGIT_BYTES
    return Shapes(layers=int(text.num_hidden_layers), kv_heads=kv_heads, head_dim=head_dim, hidden=hidden,
                  intermediate=intermediate, vocab=int(text.vocab_size), dtype_bytes=dtype_bytes)
