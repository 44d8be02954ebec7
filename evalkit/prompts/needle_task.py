"""The lm-eval side of the needle and needle_conflict tasks: token counting with the run's
tokenizer, doc generation at load time, scoring.

Owns: `load_docs` and `load_conflict_docs` (lm-eval's `custom_dataset` hooks of
tasks/needle/*.yaml and tasks/needle_conflict/*.yaml), the token counter that renders
the prompt exactly as the run will (template and system message included), the
context-length check, `needle_metadata` (what an evalkit run passes to the tasks), and
the `process_results` hooks (needle_recall; the conflict pick's values; the attention
values a backend read off the prefill, passed through). Does not: build documents
(`prompts.needle`, `prompts.conflict`), compute the derived metrics (`scoring.needle`,
`scoring.conflict`) or plot (`report.needle_plot`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evalkit.contract import CONFLICT, NEEDLE, FirstStepResult, response_text
from evalkit.defaults import DEFAULT_SEED, GEN_TOKENS
from evalkit.errors import BadInput
from evalkit.prompts import needle
from evalkit.prompts.templates import with_text
from evalkit.scoring import registry
from evalkit.scoring.conflict import conflict_pick, pick_values
from evalkit.scoring.needle import needle_recall

# in-process tokenizers handed over by an evalkit run (key -> tokenizer), so the
# docs are counted with the very tokenizer the run loaded
_TOKENIZERS: dict[str, Any] = {}


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str, gguf_file: str | None):
    from transformers import AutoTokenizer

    from evalkit.loaderrors import loading
    from evalkit.paths import check_input_path

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    if os.path.lexists(path):  # a local folder (else a hub id)
        check_input_path(path, "tokenizer", "either")
        if gguf_file:
            check_input_path(Path(path) / gguf_file, "GGUF file", "file")
    with loading("tokenizer", path):
        return AutoTokenizer.from_pretrained(path, **kwargs)


def token_counter(tokenizer, *, chat: bool, system: str | None, doc_to_text: str | None = None) -> Callable[[str], int]:
    """count(user_text) = tokens of the whole prompt the model is fed for that message (its template's
    doc_to_text, chat template and the declared special tokens included)."""
    from evalkit.prompts.encoding import encode
    from evalkit.prompts.templates import Template, render_prompt

    template = Template("needle", chat, system, doc_to_text=doc_to_text)
    return lambda text: len(encode(tokenizer, render_prompt(tokenizer, template, text)))


def _tokenizer(metadata: dict):
    """The run's own tokenizer (`tokenizer_key`), or one loaded from `tokenizer` (+ `gguf_file`)."""
    tok = _TOKENIZERS.get(metadata.get("tokenizer_key") or "")
    if tok is None:
        path = metadata.get("tokenizer") or metadata.get("pretrained")
        if not path:
            raise BadInput(
                "needle tasks count lengths in the model's tokens: pass metadata tokenizer=PATH "
                "(evalkit run does this for you)"
            )
        tok = _load_tokenizer(str(path), metadata.get("gguf_file"))
    return tok


def load_docs(*, lang: str, hint: bool, **metadata) -> Any:
    """lm-eval custom_dataset: the needle grid of one language and hint flag.

    Metadata keys: `tokenizer_key` (an in-process tokenizer) or `tokenizer`
    (+ `gguf_file`) to load one; `chat`, `system` (the template); `needle_lengths`,
    `needle_depths`, `seed`; `max_length` (the model's context) when known.
    """
    import datasets

    tok = _tokenizer(metadata)
    lengths = [int(x) for x in metadata.get("needle_lengths") or needle.DEFAULT_LENGTHS]
    depths = [float(x) for x in metadata.get("needle_depths") or needle.DEFAULT_DEPTHS]
    check_lengths(lengths, metadata.get("max_length"))
    docs = grid_docs(tok, chat=bool(metadata.get("chat", True)), system=metadata.get("system"), lengths=lengths,
                     depths=depths, seed=int(metadata.get("seed", DEFAULT_SEED)), lang=lang, hint=hint,
                     doc_to_text=metadata.get("doc_to_text"))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


# (tokenizer, template, grid, seed, lang, hint) -> documents: built once per process, so a run
# can build them before its row is written (any length that cannot be met is bad input) and
# lm-eval then loads the same documents
_GRIDS: dict[tuple, list[dict]] = {}
# needle task -> (lang, hint)
TASK_GRIDS = {"needle_en": ("en", False), "needle_en_hint": ("en", True),
              "needle_zh": ("zh", False), "needle_zh_hint": ("zh", True)}


def grid_docs(tokenizer, *, chat: bool, system: str | None, lengths: list[int], depths: list[float], seed: int,
              lang: str, hint: bool, doc_to_text: str | None = None) -> list[dict]:
    """The needle documents of one language and hint flag, counted in `tokenizer` (cached), each with the
    `text` the template's doc_to_text makes of it."""
    key = (id(tokenizer), chat, system, tuple(lengths), tuple(depths), seed, lang, hint, doc_to_text)
    if key not in _GRIDS:
        count = token_counter(tokenizer, chat=chat, system=system, doc_to_text=doc_to_text)
        docs = needle.build_grid(count, langs=[lang], lengths=lengths, depths=depths, hint=hint, seed=seed)
        for d in docs:
            d["kind"] = NEEDLE
        _GRIDS[key] = with_text(docs, doc_to_text)
    return _GRIDS[key]


# conflict task -> lang
TASK_CONFLICTS = {"needle_conflict_en": "en", "needle_conflict_zh": "zh"}


def conflict_docs(tokenizer, *, chat: bool, system: str | None, lengths: list[int], pairs: int, seed: int,
                  lang: str, doc_to_text: str | None = None) -> list[dict]:
    """The conflict documents of one language, counted in `tokenizer` (cached as `grid_docs`)."""
    from evalkit.prompts import conflict

    key = ("conflict", id(tokenizer), chat, system, tuple(lengths), pairs, seed, lang, doc_to_text)
    if key not in _GRIDS:
        count = token_counter(tokenizer, chat=chat, system=system, doc_to_text=doc_to_text)
        docs = conflict.build_conflict_grid(count, langs=[lang], lengths=lengths, pairs=pairs, seed=seed)
        for d in docs:
            d["kind"] = CONFLICT
        _GRIDS[key] = with_text(docs, doc_to_text)
    return _GRIDS[key]


def load_conflict_docs(*, lang: str, **metadata) -> Any:
    """lm-eval custom_dataset: the conflict documents of one language (docs/metrics.md §1.9).

    Metadata as for `load_docs` (`needle_depths` is not used), plus `conflict_pairs`
    (default `conflict.DEFAULT_PAIRS`).
    """
    import datasets

    from evalkit.prompts import conflict

    tok = _tokenizer(metadata)
    lengths = [int(x) for x in metadata.get("needle_lengths") or needle.DEFAULT_LENGTHS]
    check_lengths(lengths, metadata.get("max_length"))
    docs = conflict_docs(tok, chat=bool(metadata.get("chat", True)), system=metadata.get("system"), lengths=lengths,
                         pairs=int(metadata.get("conflict_pairs") or conflict.DEFAULT_PAIRS),
                         seed=int(metadata.get("seed", DEFAULT_SEED)), lang=lang,
                         doc_to_text=metadata.get("doc_to_text"))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def check_lengths(lengths, max_length: int | None) -> None:
    """Refuse lengths the model cannot hold with room to answer (nothing is truncated)."""
    for length in lengths:
        if length <= 0:
            raise BadInput(f"needle length must be a positive token count, got {length}")
        if max_length and length * (1 + needle.LENGTH_TOLERANCE) + GEN_TOKENS > max_length:
            raise BadInput(
                f"needle length {length} does not fit the model's context of {max_length} tokens "
                f"(with {GEN_TOKENS} tokens to answer); use --needle-lengths below "
                f"{int((max_length - GEN_TOKENS) / (1 + needle.LENGTH_TOLERANCE))}"
            )


def attention_values(resp: Any) -> dict[str, float]:
    """The attention-level values a backend read off the prompt's prefill (`--attention`), if any."""
    if not isinstance(resp, FirstStepResult):
        return {}
    return {k: float(v) for k, v in resp.metrics.items()
            if v is not None and (m := registry.get(k)) is not None and m.level == "attention"}


def process_results(doc, results) -> dict[str, float]:
    text = response_text(results[0])  # None: no response was generated (`--metrics`): needle_recall is NULL
    recall = {} if text is None else {"needle_recall": needle_recall(text, doc["key"])}
    return {**recall, **attention_values(results[0])}


def process_conflict(doc, results) -> dict[str, float]:
    text = response_text(results[0])
    return {**(pick_values(conflict_pick(text, doc["first_key"], doc["last_key"])) if text is not None else {}),
            **attention_values(results[0])}


def needle_metadata(cfg, template, lm) -> dict[str, Any]:
    """Task metadata of an evalkit run: grid, seed, template and the run's own tokenizer
    (the lengths were checked against the model's context before the run started)."""
    tok = getattr(lm, "tokenizer", None)
    if tok is None:
        raise BadInput(f"needle tasks need the model's tokenizer; model type {cfg.model!r} exposes none")
    key = f"run-{id(tok)}"
    _TOKENIZERS[key] = tok
    max_length = getattr(lm, "max_length", None)
    return {
        "tokenizer_key": key,
        "chat": template.chat,
        "system": template.system,
        "doc_to_text": template.doc_to_text,
        "needle_lengths": cfg.needle_lengths or list(needle.DEFAULT_LENGTHS),
        "needle_depths": cfg.needle_depths or list(needle.DEFAULT_DEPTHS),
        "seed": cfg.seed,
        "max_length": max_length if isinstance(max_length, int) else None,
    }
