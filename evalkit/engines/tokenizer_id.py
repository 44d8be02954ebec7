"""A tokenizer's identity: one stable hash of what decides which token id means which text.

Owns: `identify(tokenizer, origin) -> TokenizerId`, the hash every engine stores with its run
(`runs.tokenizer_hash`, `runs.tokenizer_source`; docs/metrics.md §1.5), for the three kinds of
tokenizer evalkit runs on:
- a transformers fast tokenizer: its `tokenizer.json` (`backend_tokenizer.to_str()`), keeping the
  model (vocabulary token -> id, merges, model type), normalizer, pre-tokenizer, decoder and added
  tokens (special or not), and leaving out what is a setting of this load rather than of the
  vocabulary (truncation, padding, the post-processor that adds BOS);
- a slow (Python) transformers tokenizer: its class, its vocabulary (token -> id), its added and
  special tokens, and the SentencePiece model's bytes where it has one;
- a GGUF vocabulary read by llama.cpp (`GGUFTokenizer`): the tokenizer model and pre-tokenizer
  names, and each token's text, attributes (control, byte, user-defined ...) and score in id order,
  through llama.cpp's own vocabulary API.

Two tokenizers with the same hash map every id to the same text; a vocabulary with its ids
permuted hashes differently. The hash is of what is listed, so a transformers tokenizer and the
GGUF converted from it hash differently (they are read through different APIs); the comparison
then compares what their tokens say (docs/metrics.md §1.5), which holds either way.

Does not: store (the runner writes the run row) or compare runs (`compare`, `release.db`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from evalkit.kinds import TokenizerKind

# tokenizer.json keys that describe this load's settings, not the vocabulary
_LOAD_SETTINGS = ("truncation", "padding", "post_processor", "version")


@dataclass(frozen=True)
class TokenizerId:
    """A tokenizer's identity as a run row keeps it."""

    hash: str  # sha256 hex of the canonical description
    source: str  # the engine's words for where it came from, and what was hashed

    @property
    def short(self) -> str:
        return self.hash[:12]


def identify(tokenizer: Any, origin: str) -> TokenizerId:
    """The identity of `tokenizer` (a transformers tokenizer, fast or slow, or a llama.cpp
    `GGUFTokenizer`); `origin`: the engine's words for where it came from ("hf model X",
    "server tokenizer=PATH"). Raises TypeError for an object that is none of these."""
    eng = getattr(tokenizer, "eng", None)
    if eng is not None and hasattr(eng, "vocab") and hasattr(eng, "lib"):
        return _finish(_gguf_description(eng), "GGUF vocabulary", origin)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        return _finish(_fast_description(backend.to_str()), "tokenizer.json", origin)
    if hasattr(tokenizer, "get_vocab"):
        return _finish(_slow_description(tokenizer), "slow tokenizer", origin)
    raise TypeError(f"cannot identify a tokenizer of type {type(tokenizer).__name__}")


def at_load(tokenizer: Any, origin: str) -> TokenizerId | None:
    """What an engine records at load: `identify`, or None (the run's tokenizer then reads "unknown",
    docs/metrics.md) for a tokenizer none of these kinds (a Mistral tokenizer under vLLM, a test fake)."""
    try:
        return identify(tokenizer, origin)
    except TypeError:
        return None


def of_json(text: str, origin: str = "tokenizer.json") -> TokenizerId:
    """The identity of a fast tokenizer given as its tokenizer.json text.

    >>> a = '{"version": "1.0", "truncation": null, "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}}}'
    >>> b = '{"truncation": {"max_length": 8}, "model": {"vocab": {"a": 0, "b": 1}, "type": "WordLevel"}}'
    >>> c = '{"model": {"type": "WordLevel", "vocab": {"a": 1, "b": 0}}}'
    >>> of_json(a).hash == of_json(b).hash, of_json(a).hash == of_json(c).hash
    (True, False)
    """
    return _finish(_fast_description(text), "tokenizer.json", origin)


def _finish(description: bytes, kind: TokenizerKind, origin: str) -> TokenizerId:
    return TokenizerId(hashlib.sha256(description).hexdigest(), f"{origin}: {kind}")


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _fast_description(text: str) -> bytes:
    data = json.loads(text)
    for key in _LOAD_SETTINGS:
        data.pop(key, None)
    return _canonical(data)


def _slow_description(tok: Any) -> bytes:
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    added = getattr(tok, "added_tokens_decoder", None) or {}
    special = sorted(getattr(tok, "all_special_tokens", None) or [])
    data: dict[str, Any] = {
        "class": type(tok).__name__,
        "vocab": vocab,
        "added": sorted((int(i), str(getattr(t, "content", t)), bool(getattr(t, "special", False)))
                        for i, t in added.items()),
        "special": special,
    }
    sp = getattr(tok, "sp_model", None)
    if sp is not None and hasattr(sp, "serialized_model_proto"):
        data["sentencepiece_sha256"] = hashlib.sha256(sp.serialized_model_proto()).hexdigest()
    return _canonical(data)


def _gguf_description(eng: Any) -> bytes:
    """The GGUF vocabulary through llama.cpp's API, token by token in id order (its merges are not
    readable through that API; the tokenizer model and pre-tokenizer names stand for them)."""
    lib, vocab = eng.lib, eng.vocab
    h = hashlib.sha256()
    head = {key: eng.meta(key) for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre")}
    head["vocab_type"] = int(lib.llama_vocab_type(vocab))
    head["n_tokens"] = int(eng.n_vocab)
    head["add_bos"] = bool(lib.llama_vocab_get_add_bos(vocab))
    head["add_eos"] = bool(lib.llama_vocab_get_add_eos(vocab))
    h.update(_canonical(head))
    for t in range(int(eng.n_vocab)):
        text = lib.llama_vocab_get_text(vocab, t) or b""
        attr = int(lib.llama_vocab_get_attr(vocab, t))
        score = float(lib.llama_vocab_get_score(vocab, t))
        h.update(len(text).to_bytes(4, "little") + text + attr.to_bytes(4, "little", signed=True)
                 + repr(score).encode())
    return h.hexdigest().encode()
