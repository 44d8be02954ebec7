"""What each token of a vocabulary adds to the text, as bytes: the table the whitespace-led first-token
event and the first-character distribution read.

Owns `VocabTable` (per token id: the bytes it adds to the response, or None for a special token, with
the special tokens' role names) and `vocab_table(tokenizer)`, built once per tokenizer object:
- a byte-level BPE vocabulary (GPT-2, Llama 3, Qwen2, SmolLM2): the token string through GPT-2's
  byte <-> printable character map;
- a SentencePiece-style vocabulary (Llama 2, Gemma): "▁" is a space, `<0xNN>` is the byte NN;
- the llama.cpp engine's GGUF tokenizer: llama.cpp's own piece of each token (`llama_token_to_piece`),
  special (control) tokens by their llama.cpp attribute;
- anything else: the token decoded alone.
A token's bytes may end inside a UTF-8 character (a byte-fallback token, a byte-level fragment of a
Chinese character): they are kept as bytes, never decoded to U+FFFD.

Does not: run a model, or decide which events a metric counts (`whitespace_ids` only says which
tokens add whitespace and nothing else).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from typing import Any

# llama.cpp's token attributes (llama.h, enum llama_token_attr)
_ATTR_UNKNOWN, _ATTR_UNUSED, _ATTR_CONTROL = 1 << 0, 1 << 1, 1 << 3
_WHITESPACE_BYTES = frozenset(b" \t\n\r\x0b\x0c")

EOS, EOT, BOS = "<eos>", "<eot>", "<bos>"


@dataclass(frozen=True)
class VocabTable:
    """Per token id, the bytes it adds to the text (None: a special token, which adds none)."""

    pieces: tuple[bytes | None, ...]
    roles: dict[int, str] = field(default_factory=dict)  # special token id -> its role name (`role`)

    def __len__(self) -> int:
        return len(self.pieces)

    def role(self, token_id: int) -> str:
        """A special token's event name: `<eos>`, `<eot>` (another end of generation), `<bos>`, or
        `<special:ID>`."""
        return self.roles.get(int(token_id), f"<special:{int(token_id)}>")

    def whitespace_ids(self) -> frozenset[int]:
        """The tokens that add whitespace and nothing else (" ", "\\n\\n", "▁▁"): after one of them the
        response has still not said its first visible character."""
        return frozenset(i for i, b in enumerate(self.pieces)
                         if b and all(c in _WHITESPACE_BYTES for c in b))


_TABLES: weakref.WeakKeyDictionary[Any, VocabTable] = weakref.WeakKeyDictionary()


def vocab_table(tokenizer) -> VocabTable:
    """The table of `tokenizer` (a transformers tokenizer or the llama.cpp engine's `GGUFTokenizer`),
    built on first use and kept as long as the tokenizer lives."""
    try:
        return _TABLES[tokenizer]
    except (KeyError, TypeError):
        pass
    table = _llamacpp_table(tokenizer) if hasattr(tokenizer, "eng") else _hf_table(tokenizer)
    try:
        _TABLES[tokenizer] = table
    except TypeError:  # an object that takes no weak reference: built each time
        pass
    return table


def whitespace_ids(tokenizer) -> frozenset[int]:
    return vocab_table(tokenizer).whitespace_ids()


def _roles(n: int, bos: int | None, eos: int | None, eog: set[int]) -> dict[int, str]:
    roles = {i: EOT for i in eog if 0 <= i < n}
    if bos is not None and 0 <= bos < n:
        roles[bos] = BOS
    if eos is not None and 0 <= eos < n:
        roles[eos] = EOS
    return roles


def _llamacpp_table(tokenizer) -> VocabTable:
    eng = tokenizer.eng
    lib, vocab, n = eng.lib, eng.vocab, eng.n_vocab
    pieces: list[bytes | None] = []
    eog: set[int] = set()
    for i in range(n):
        attr = int(lib.llama_vocab_get_attr(vocab, i))
        if bool(lib.llama_vocab_is_eog(vocab, i)):
            eog.add(i)
        special = attr & (_ATTR_CONTROL | _ATTR_UNKNOWN | _ATTR_UNUSED) or i in eog
        pieces.append(None if special else eng.piece(i, special=False))
    bos, eos = int(lib.llama_vocab_bos(vocab)), int(lib.llama_vocab_eos(vocab))
    return VocabTable(tuple(pieces), _roles(n, bos if bos >= 0 else None, eos if eos >= 0 else None, eog))


def _decoder_kind(tokenizer) -> str:
    """'bytelevel', 'sentencepiece' or 'other', from the fast tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "other"
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return "other"
    parts = decoder.get("decoders") or [decoder]
    types = {str(p.get("type")) for p in parts if isinstance(p, dict)}
    if "ByteLevel" in types:
        return "bytelevel"
    if "Metaspace" in types or "ByteFallback" in types or any(
            p.get("type") == "Replace" and "▁" in json.dumps(p.get("pattern")) for p in parts if isinstance(p, dict)):
        return "sentencepiece"
    return "other"


def _hf_table(tokenizer) -> VocabTable:
    n = len(tokenizer)
    specials = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            specials.add(int(i))
    kind = _decoder_kind(tokenizer)
    strings = tokenizer.convert_ids_to_tokens(list(range(n)))
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    pieces: list[bytes | None] = []
    for i, s in enumerate(strings):
        if i in specials or s is None:
            pieces.append(None)
            continue
        pieces.append(_piece_bytes(tokenizer, i, s, kind, byte_of))
    eos = getattr(tokenizer, "eos_token_id", None)
    bos = getattr(tokenizer, "bos_token_id", None)
    eog = {i for i in specials if _is_end_of_turn(strings[i] if i < len(strings) else None)}
    return VocabTable(tuple(pieces), _roles(n, bos, eos, eog))


def _is_end_of_turn(text: str | None) -> bool:
    return text is not None and any(k in text.lower() for k in ("end_of_turn", "im_end", "eot", "end|>"))


def _piece_bytes(tokenizer, i: int, s: str, kind: str, byte_of: dict[str, int]) -> bytes:
    if kind == "bytelevel":
        try:
            return bytes(byte_of[c] for c in s)
        except KeyError:  # an added, non-special token held as plain text
            return s.encode("utf-8")
    if kind == "sentencepiece":
        if len(s) == 6 and s.startswith("<0x") and s.endswith(">"):
            try:
                return bytes([int(s[3:5], 16)])
            except ValueError:
                pass
        return s.replace("▁", " ").encode("utf-8")
    return tokenizer.decode([i]).encode("utf-8")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
