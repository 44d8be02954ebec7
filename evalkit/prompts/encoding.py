"""One door from text to tokens: the ids a model is fed for a templated prompt, on every engine.

Owns `Feed` (the special tokens fed before the text: what the tokenizer declares, or what the run's
`add_bos_token` model arg says instead), `declared_prefix` (what a tokenizer declares, read from the
tokenizer itself: a transformers tokenizer's `add_bos_token` or post-processor, a GGUF's
`tokenizer.ggml.add_bos_token` through llama.cpp), `set_feed` / `feed_of` (one feed per loaded
tokenizer), and `encode(tokenizer, text)`, which every engine and task kind calls: the text's tokens
with special tokens spelled in it parsed, after the feed's prefix, once — a chat template that
already spells the BOS (Llama 3's `<|begin_of_text|>`, Gemma's `<bos>`) does not get it twice.
lm-eval's HFLM does the same (`tok_encode` with `add_bos_token`, skipping a BOS the text begins with);
llama.cpp asks the vocabulary once (`llama_vocab_get_add_bos`).

`raw_ids(tokenizer, text)` is the text's tokens with nothing added: for a piece of text that is not a
whole prompt (a candidate string tokenised alone).

Does not: render templates (`prompts.templates`), or run a model.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

from evalkit.errors import BadInput

# the text a declaration is read from: any text the tokenizer turns into at least one token
_PROBE_TEXT = "a"


@dataclass(frozen=True)
class Feed:
    """The special tokens fed before every prompt's text."""

    prefix: tuple[int, ...]  # fed before the text, once (empty: nothing)
    declared: tuple[int, ...]  # what the tokenizer itself declares
    source: str  # "declared by the tokenizer" or "add_bos_token=true|false"
    labels: tuple[str, ...] = ()  # the prefix's tokens as text ("<bos>")
    asked: bool | None = None  # add_bos_token as the model args gave it (None: not given, the declaration rules)

    @property
    def bos(self) -> bool:
        return bool(self.prefix)

    def describe(self) -> str:
        """What the run row stores as fed: e.g. "<bos> (id 2), declared by the tokenizer", "nothing, declared
        by the tokenizer", "nothing, add_bos_token=false (the tokenizer declares <bos>)"."""
        fed = " ".join(f"{label} (id {i})" for label, i in zip(self.labels, self.prefix)) if self.prefix else "nothing"
        text = f"{fed}, {self.source}"
        if self.prefix != self.declared:
            text += f" (the tokenizer declares {' '.join(map(str, self.declared)) or 'nothing'})"
        return text

    def note(self) -> str | None:
        """One line when the first fed token is not what the tokenizer declares (the user chose so):
        the model is then fed input it was not trained on."""
        if self.prefix == self.declared:
            return None
        if self.declared and not self.prefix:
            return (f"the tokenizer declares a BOS (id {self.declared[0]}) and {self.source} leaves it out: "
                    "the model is fed input it does not expect")
        return f"the fed prefix {list(self.prefix)} is not the declared {list(self.declared)} ({self.source})"


def _ids(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]


def raw_ids(tokenizer, text: str) -> list[int]:
    """The tokens of `text` alone, with no special token added (special tokens spelled in it parsed)."""
    return _ids(tokenizer, text, False)


def declared_prefix(tokenizer) -> tuple[int, ...]:
    """The special tokens the tokenizer puts before a text's own tokens when asked to add its special
    tokens: what it declares (transformers: `add_bos_token` or the post-processor's template; llama.cpp:
    the GGUF's `tokenizer.ggml.add_bos_token`). SmolLM2's GPT-2-style tokenizer declares none; Gemma's
    declares its `<bos>`.

    >>> class Tok:  # adds id 2 in front when asked
    ...     def __call__(self, text, add_special_tokens=False):
    ...         return {"input_ids": ([2] if add_special_tokens else []) + [7]}
    >>> declared_prefix(Tok())
    (2,)
    """
    bare = _ids(tokenizer, _PROBE_TEXT, False)
    full = _ids(tokenizer, _PROBE_TEXT, True)
    if not bare:
        return ()
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return tuple(full[:start])
    return ()


_FEEDS: weakref.WeakKeyDictionary[Any, Feed] = weakref.WeakKeyDictionary()
_PLAIN: dict[int, Feed] = {}  # tokenizers that take no weak reference, by id (kept while the process lives)


def parse_add_bos(value: Any) -> bool | None:
    """lm-eval's `add_bos_token` model arg as given (text from --model-args, or a bool): None when absent."""
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise BadInput(f"--model-args add_bos_token={value!s}: expected true or false")


def set_feed(tokenizer, add_bos_token: bool | None = None, *, gguf_add_bos: bool | None = None) -> Feed:
    """Fix what `encode` feeds before every text for this tokenizer: what it declares, or, with
    `add_bos_token` (lm-eval's model arg), its BOS or nothing. `gguf_add_bos`: the GGUF's own
    `tokenizer.ggml.add_bos_token` where the tokenizer was built from one (transformers' conversion
    does not always keep it), which then is the declaration."""
    declared = declared_prefix(tokenizer)
    who = "declared by the tokenizer"
    bos = getattr(tokenizer, "bos_token_id", None)
    if gguf_add_bos is not None and bos is not None and int(bos) >= 0:
        declared, who = ((int(bos),) if gguf_add_bos else ()), "declared by the GGUF"
    if add_bos_token is None:
        prefix, source = declared, who
    elif add_bos_token:
        if bos is None or int(bos) < 0:
            raise BadInput("--model-args add_bos_token=true: this tokenizer has no BOS token")
        prefix, source = (declared if declared and declared[0] == int(bos) else (int(bos),)), "add_bos_token=true"
    else:
        prefix, source = (), "add_bos_token=false"
    labels = tuple(_label(tokenizer, i) for i in prefix)
    feed = Feed(tuple(prefix), declared, source, labels, add_bos_token)
    try:
        _FEEDS[tokenizer] = feed
    except TypeError:
        _PLAIN[id(tokenizer)] = feed
    return feed


def _label(tokenizer, token_id: int) -> str:
    try:
        return str(tokenizer.decode([token_id], skip_special_tokens=False))
    except Exception:  # a label is for reading only
        return f"<{token_id}>"


def feed_of(tokenizer) -> Feed:
    """The tokenizer's feed: as `set_feed` fixed it, else what it declares (fixed now)."""
    try:
        found = _FEEDS.get(tokenizer)
    except TypeError:
        found = _PLAIN.get(id(tokenizer))
    return found if found is not None else set_feed(tokenizer)


def encode(tokenizer, text: str) -> list[int]:
    """The ids a model is fed for `text` (a whole templated prompt): the feed's prefix, once, then the
    text's tokens (special tokens spelled in it parsed). A text whose tokens already begin with the
    prefix (a chat template that spells the BOS) gets nothing added.

    >>> class Tok:  # declares BOS 2; "<bos>" in the text is the token 2
    ...     bos_token_id = 2
    ...     def __call__(self, text, add_special_tokens=False):
    ...         ids = [2 if w == "<bos>" else 7 for w in text.split()]
    ...         return {"input_ids": ([2] if add_special_tokens else []) + ids}
    ...     def decode(self, ids, skip_special_tokens=False): return "<bos>"
    >>> tok = Tok()
    >>> encode(tok, "hi there"), encode(tok, "<bos> hi")
    ([2, 7, 7], [2, 7])
    """
    ids = raw_ids(tokenizer, text)
    prefix = feed_of(tokenizer).prefix
    if prefix and tuple(ids[: len(prefix)]) != prefix:
        ids = [*prefix, *ids]
    return ids
