"""Corpus mode of drift (docs/drift.md): a text scored as `llama-perplexity --kl-divergence` scores it.

Owns: `corpus_drift(path, quants, ...)` — read and tokenise the text (BOS first), cut it into
chunks of n_ctx tokens (each chunk's first token replaced by BOS), teacher-force every chunk
through the base variant (the first of `quants`) and keep its distributions over the second half
of each chunk compact, then through each other variant, and summarise KL(base ‖ variant), Δp of
the text's own tokens, same top and the perplexity lines over those positions with llama.cpp's
formulas (`scoring.drift.summary`). One model loaded at a time; nothing is stored.
Does not: print (`cli/drift.py`), or run lm-eval.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from evalkit.errors import BadInput
from evalkit.paths import read_input
from evalkit.prompts.encoding import feed_of, raw_ids
from evalkit.scoring import drift

DEFAULT_N_CTX = 512  # llama-perplexity's default context
MAX_CORPUS_BYTES = 64 << 20  # a corpus text read whole and tokenised: 50x wikitext-2's test split


@dataclass(frozen=True)
class CorpusResult:
    """One variant against the base over the text's scored positions."""

    base: str  # the base variant's name
    variant: str
    summary: drift.Summary
    n_ctx: int
    n_chunks: int
    seconds: float  # the variant's teacher-forced pass


def read_text(path: str | os.PathLike, limit: int = MAX_CORPUS_BYTES) -> str:
    """The file's text; BadInput (one line) when it cannot be read, is not a regular file (a
    device such as /dev/zero, a FIFO: never read or waited on), is over `limit` bytes, is not
    UTF-8 or is empty."""
    p = Path(path)
    raw = read_input(p, "corpus file", limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{p}: not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise BadInput(f"{p}: the file holds no text")
    return text


def _load(model: str, model_args: str | None, quant: str | None, device: str | None, batch_size: int):
    from evalkit.engines import resolve as models

    plan = models.resolve(model, model_args, quant_name=quant, device=device)
    if not plan.in_process_hf:
        raise BadInput("drift-corpus teacher-forces through the in-process hf engine (--model hf)")
    return models.load(plan, batch_size=batch_size)


def corpus_drift(path: str | os.PathLike, quants: list[str | None], *, model: str = "hf",
                 model_args: str | None = None, n_ctx: int = DEFAULT_N_CTX, chunks: int | None = None,
                 batch_size: int = 4, eps: float = drift.DEFAULT_EPS, device: str | None = None,
                 on_variant=None) -> list[CorpusResult]:
    """Score the text at `path` with each variant of `quants` after the first against the first.

    Raises BadInput for an unreadable text, fewer than two variants, an n_ctx under 8 or beyond the
    model's context, a text shorter than 2 × n_ctx tokens (llama-perplexity's own floor), or
    `chunks` < 1."""
    import gc

    from evalkit.engines.transformers import quant as quantization
    from evalkit.engines.transformers.teacher import base_pass, corpus_chunks, drift_pass, scored_items

    if len(quants) < 2:
        raise BadInput("drift-corpus compares variants with the first: give --quant BASE,CAND[,...]")
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx < 8:
        raise BadInput(f"--n-ctx must be a whole number >= 8, got {n_ctx!r}")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise BadInput(f"--chunks must be a whole number >= 1, got {chunks!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise BadInput(f"--batch-size must be a whole number >= 1, got {batch_size!r}")
    for q in quants:
        if q is not None:
            quantization.parse(q)  # an unknown name is one line before any model loads
    text = read_text(path)
    names = [q or "as loaded" for q in quants]
    lm = _load(model, model_args, quants[0], device, batch_size)
    tok = lm.tokenizer
    limit = getattr(lm.model.config, "max_position_embeddings", None)
    if limit and n_ctx > limit:
        raise BadInput(f"--n-ctx {n_ctx} is beyond the model's context ({limit} positions)")
    # each chunk begins with the BOS where the model has one (docs/drift.md), unless add_bos_token=false
    bos = None if feed_of(tok).asked is False else tok.bos_token_id
    tokens = ([bos] if bos is not None else []) + raw_ids(tok, text)
    if len(tokens) < 2 * n_ctx:
        raise BadInput(f"{path}: {len(tokens)} tokens; scoring with --n-ctx {n_ctx} needs at least {2 * n_ctx}")
    cut = corpus_chunks(tokens, n_ctx, bos)
    if chunks is not None:
        cut = cut[:chunks]
    items = scored_items(cut)
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    bases = base_pass(lm.model, items, eps=eps, batch_size=batch_size, pad_id=pad)
    out = []
    for q, name in zip(quants[1:], names[1:]):
        del lm
        gc.collect()
        lm = _load(model, model_args, q, device, batch_size)
        t0 = time.monotonic()
        rows = [r for per in drift_pass(lm.model, items, bases, batch_size=batch_size, pad_id=pad) for r in per]
        seconds = time.monotonic() - t0
        s = drift.summary([r.kld for r in rows], [r.dp for r in rows], [r.same_top for r in rows],
                          nll=[r.nll for r in rows], nll_base=[r.nll_base for r in rows],
                          bound=[r.bound for r in rows])
        result = CorpusResult(names[0], name, s, n_ctx, len(cut), seconds)
        out.append(result)
        if on_variant:
            on_variant(result)
    return out
