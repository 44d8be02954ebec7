"""KV-cache policies (`--kv-cache`): the grammar every engine reads, and which cached keys a query may read.

Owns: parsing and checking a policy (`parse`, `parse_list`, `as_policy`, `check_available`),
the libraries of the quantized policies (`KV_BACKENDS`) and the visibility rule
(`KVPolicy.visible`, read by the transformers first-step engine's attention masks). Does not:
run the model, build the masks or round a cache (`transformers.firststep` and
`transformers.kvcache`), or say what an engine refuses (each engine's resolver:
`llamacpp.resolve.llamacpp_refusal`).

Policies (docs/metrics.md §1.7):

- `full` — every earlier key is visible; the engine runs exactly as without a policy.
- `window:W` — a query at position t sees the keys at positions t−W+1 … t (itself and
  the W−1 before it): the others are evicted.
- `sinkwindow:S:W` — the same window, plus the first S positions of the prompt (the
  attention sinks of StreamingLLM) kept for ever.
- `fp8` — keys and values stored as float8 e4m3 with a per-tensor scale (amax / 448)
  per prompt and layer, calibrated on the prompt and then frozen, as transformers'
  `Fp8QuantizedLayer` does; no extra package.
- `quantized:BACKEND:BITS` — the prompt's keys and values quantized group-wise by
  transformers' `QuantoQuantizedLayer` (optimum-quanto, 2 or 4 bits) or
  `HQQQuantizedLayer` (hqq, 1, 2, 3, 4 or 8 bits), with their defaults (axis 0, groups
  of 64 values: one head's key or value vector of one token when the head dimension is
  64; a head vector a group when it does not divide by 64); tokens after the prompt stay in full precision in the residual buffer until
  it holds `RESIDUAL` (128) of them, then they are quantized too. `quantized:fp8:8` is `fp8`.

- `ggml:TYPE` — llama.cpp's own K and V cache types (`f16`, llama.cpp's default; `q8_0`;
  `q4_0`), for `--model llamacpp` only; there `full` is an f32 cache. llama.cpp cannot run the
  policies above (`llamacpp.resolve.llamacpp_refusal` says why).

Positions keep their original indices under eviction: a key evicted from the window
leaves a gap, and the query at position t still sees the sinks at distance t. StreamingLLM
instead re-indexes the cache (sinks at 0 … S−1, the window right after them), so the
distances the model sees never exceed S + W; evalkit keeps the distances of the full
prompt, i.e. the positions a model serving a sliding window with absolute positions uses.

Eviction is causal and per query, exactly what a cache that drops a key once no later
query may read it gives, token by token: a key evicted for the question may still have
been read, in lower layers, by tokens that the question does see, so a token's
information can reach a query from up to L·(W−1) positions back through L layers (the
receptive field of sliding-window attention). Only tokens beyond that (and not sinks)
cannot change a query's output; `tests/test_kvcache.py` checks both sides of that bound.

Rounded caches are rounded when written, and every query reads them as stored, its own
key included, in the prefill too: the question reads the rounded keys of the first
sentence. (transformers' `QuantizedCache` returns the prefill's own keys unrounded, so
under `generate` the prompt's first-step distribution would not change at all.)
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import cast

from evalkit.errors import BadInput
from evalkit.install import install_hint
from evalkit.kinds import KVPolicyKind, KVQuantBackend

FULL_SPEC = "full"
GROUP = 64  # transformers' QuantizedCache q_group_size default
RESIDUAL = 128  # transformers' QuantizedCache residual_length default: newest tokens kept in full precision
MAX_WINDOW = 2**31 - 1


@dataclass(frozen=True)
class KVBackend:
    """A library that rounds a `quantized:BACKEND:BITS` cache, through transformers' layer class for it."""

    name: KVQuantBackend
    package: str  # the pip distribution that provides it
    module: str  # its import name
    bits: tuple[int, ...]  # the bit widths it takes
    layer_class: str  # the transformers.cache_utils class that rounds with it


KV_BACKENDS: dict[str, KVBackend] = {b.name: b for b in (
    KVBackend("quanto", "optimum-quanto", "optimum.quanto", (2, 4), "QuantoQuantizedLayer"),
    KVBackend("hqq", "hqq", "hqq", (1, 2, 3, 4, 8), "HQQQuantizedLayer"),
)}
KVQUANT_PIP = install_hint("kvquant")
GGML_TYPES = ("f16", "q8_0", "q4_0")  # llama.cpp's K/V cache types `ggml:TYPE` names (llamacpp.firststep.KV_TYPES)
POLICY_HELP = ", ".join(["full, window:W, sinkwindow:S:W, fp8",
                         *(f"quantized:{b.name}:{'|'.join(map(str, b.bits))}" for b in KV_BACKENDS.values()),
                         f"ggml:{'|'.join(GGML_TYPES)} (llamacpp)"])


@dataclass(frozen=True)
class KVPolicy:
    """One KV-cache policy; `spec` is its canonical text, stored in `runs.kv_cache`."""

    kind: KVPolicyKind
    window: int | None = None  # W: the newest positions a query sees, itself included
    sinks: int = 0  # S: the first positions kept for ever
    backend: KVQuantBackend | None = None  # quantized only
    bits: int | None = None
    cache_type: str | None = None  # ggml only: llama.cpp's K and V cache type (GGML_TYPES)

    @property
    def spec(self) -> str:
        if self.kind == "window":
            return f"window:{self.window}"
        if self.kind == "sinkwindow":
            return f"sinkwindow:{self.sinks}:{self.window}"
        if self.kind == "quantized":
            return f"quantized:{self.backend}:{self.bits}"
        if self.kind == "ggml":
            return f"ggml:{self.cache_type}"
        return self.kind

    @property
    def is_full(self) -> bool:
        return self.kind == "full"

    @property
    def evicts(self) -> bool:
        """Keys become invisible to later queries (the engine builds custom attention masks)."""
        return self.kind in ("window", "sinkwindow")

    @property
    def rounds(self) -> bool:
        """Keys and values are stored rounded (the engine uses `new_cache`)."""
        return self.kind in ("fp8", "quantized")

    def visible(self, q_pos, k_pos):
        """Whether a query at position `q_pos` may read the key at `k_pos` (broadcasting tensors).

        >>> import torch
        >>> q, k = torch.tensor(10), torch.arange(12)
        >>> parse("window:3").visible(q, k).nonzero().flatten().tolist()
        [8, 9, 10]
        >>> parse("sinkwindow:2:3").visible(q, k).nonzero().flatten().tolist()
        [0, 1, 8, 9, 10]
        >>> parse("full").visible(q, k).nonzero().flatten().tolist()
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
        """
        causal = k_pos <= q_pos
        if not self.evicts:
            return causal
        keep = (q_pos - k_pos) < self.window
        if self.sinks:
            keep = keep | (k_pos < self.sinks)
        return causal & keep


FULL = KVPolicy("full")


def _int(text: str, what: str, spec: str, lo: int) -> int:
    if not (text.isascii() and text.isdigit()) or not lo <= int(text) <= MAX_WINDOW:
        raise BadInput(f"--kv-cache {spec!r}: {what} must be a whole number from {lo} to {MAX_WINDOW}, got {text!r}")
    return int(text)


def parse(text: str | None) -> KVPolicy:
    """A policy from its text; None or "" is `full`. Raises BadInput with the forms known.

    >>> parse("window:256").spec, parse(" SinkWindow:4:256 ").spec, parse("quantized:fp8:8").spec
    ('window:256', 'sinkwindow:4:256', 'fp8')
    """
    if text is None or not text.strip():
        return FULL
    spec = text.strip().lower()
    kind, *parts = spec.split(":")
    if kind in ("full", "fp8") and not parts:
        return FULL if kind == "full" else KVPolicy("fp8")
    if kind == "window" and len(parts) == 1:
        return KVPolicy("window", window=_int(parts[0], "W (the window)", spec, 1))
    if kind == "sinkwindow" and len(parts) == 2:
        sinks = _int(parts[0], "S (the sinks)", spec, 1)
        return KVPolicy("sinkwindow", window=_int(parts[1], "W (the window)", spec, 1), sinks=sinks)
    if kind == "ggml" and len(parts) == 1:
        if parts[0] not in GGML_TYPES:
            raise BadInput(f"--kv-cache {spec!r}: llama.cpp's cache types here are {', '.join(GGML_TYPES)}")
        return KVPolicy("ggml", cache_type=parts[0])
    if kind == "quantized" and len(parts) == 2:
        backend, bits_text = parts
        if backend == "fp8":
            if bits_text != "8":
                raise BadInput(f"--kv-cache {spec!r}: the fp8 backend has 8 bits")
            return KVPolicy("fp8")
        if backend not in KV_BACKENDS:
            raise BadInput(f"--kv-cache {spec!r}: unknown backend {backend!r} (known: fp8, {', '.join(KV_BACKENDS)})")
        bits = _int(bits_text, "BITS", spec, 1)
        allowed = KV_BACKENDS[backend].bits
        if bits not in allowed:
            raise BadInput(f"--kv-cache {spec!r}: the {backend} backend takes {', '.join(map(str, allowed))} bits")
        return KVPolicy("quantized", backend=cast(KVQuantBackend, backend), bits=bits)
    raise BadInput(f"unknown --kv-cache {text.strip()!r} (known: {POLICY_HELP})")


def as_policy(value: str | KVPolicy | None, default: str = FULL_SPEC) -> KVPolicy:
    """The policy a backend runs under: the resolved one a `ModelPlan` hands over, or, from plain
    lm-eval (`--model_args kv_cache=TEXT`), its text parsed here; None: `default`.

    >>> as_policy(parse("window:8")).spec, as_policy("fp8").spec, as_policy(None, "ggml:f16").spec
    ('window:8', 'fp8', 'ggml:f16')
    """
    if isinstance(value, KVPolicy):
        return value
    return parse(value or default)


def parse_list(text: str | None) -> list[KVPolicy]:
    """A comma list of policies (one run each), in order; a policy named twice is refused.

    >>> [p.spec for p in parse_list("full,window:256, fp8")]
    ['full', 'window:256', 'fp8']
    """
    if text is None or not text.strip():
        return [FULL]
    policies = [parse(part) for part in text.split(",") if part.strip()]
    if not policies:
        raise BadInput(f"--kv-cache {text!r} names no policy (known: {POLICY_HELP})")
    specs = [p.spec for p in policies]
    twice = next((s for s in specs if specs.count(s) > 1), None)
    if twice:
        raise BadInput(f"--kv-cache names {twice!r} twice")
    return policies

def check_available(policy: KVPolicy) -> None:
    """Refuse a quantized policy whose backend package is not installed (no import, no torch)."""
    if policy.kind != "quantized":
        return
    library = KV_BACKENDS[policy.backend]
    package = library.package
    try:
        found = importlib.util.find_spec(library.module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise BadInput(f"--kv-cache {policy.spec} needs the {package} package: {KVQUANT_PIP}, or pip install {package}")
