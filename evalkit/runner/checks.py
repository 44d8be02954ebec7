"""The checks of a run that need the loaded model, made before the run row is written.

Owns: `check_against_model` — `--top-k` within the vocabulary, needle lengths within
the context, and every first-token prompt the run will send fitting the context with
room to answer (refused with the ids of those that do not: nothing is truncated
silently). Models that expose no tokenizer or context length (API models, the test
fakes) are checked for what they expose. Does not: load the model (`engines.resolve.load`).
"""

from __future__ import annotations

from typing import Any

from evalkit.errors import BadInput
from evalkit.prompts import catalog
from evalkit.prompts.encoding import encode
from evalkit.runner.config import RunPlan

SHOWN_IDS = 5  # prompt ids named in the message


def vocab_size(lm: Any) -> int | None:
    tokenizer = getattr(lm, "tokenizer", None)
    sizes = []
    if tokenizer is not None:
        try:
            sizes.append(len(tokenizer))
        except TypeError:
            pass
    config = getattr(getattr(lm, "model", None), "config", None)
    if isinstance(getattr(config, "vocab_size", None), int):
        sizes.append(config.vocab_size)
    return min(sizes) if sizes else None


def context_length(lm: Any) -> int | None:
    try:
        value = getattr(lm, "max_length", None)
    except Exception:  # noqa: BLE001  (a backend whose property needs what it does not have)
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _firsttoken_docs(plan: RunPlan) -> list[dict]:
    from evalkit.prompts.jsonl import load_prompts

    docs: list[dict] = []
    for task in catalog.expand(plan.tasks):
        if task in catalog.FIRSTTOKEN_DATA:
            found = load_prompts(catalog.data_path(*catalog.FIRSTTOKEN_DATA[task]))
        elif task == catalog.PROMPTS_TASK and plan.prompts is not None:
            found = plan.prompts
        else:
            continue
        docs += found[: plan.cfg.limit] if plan.cfg.limit else found
    return docs


def check_prompts_fit(plan: RunPlan, tokenizer, max_length: int) -> None:
    """Refuse first-token prompts whose templated tokens plus the answer exceed the context."""
    from evalkit.prompts.templates import render_prompt

    response = int(catalog.generation_kwargs("firsttoken_en").get("max_gen_toks", 0))
    longer = int(plan.model.args.get("answer_max_tokens") or 0)  # prompts with checkable answers go on
    too_long = []
    for doc in _firsttoken_docs(plan):
        context = render_prompt(tokenizer, plan.template, doc["prompt"])
        n = len(encode(tokenizer, context))
        answer = max(response, longer) if doc.get("answers_full") else response
        if n + answer > max_length:
            too_long.append(f"{doc['id']} ({n} tokens)")
    if too_long:
        more = f" and {len(too_long) - SHOWN_IDS} more" if len(too_long) > SHOWN_IDS else ""
        raise BadInput(f"{len(too_long)} prompts do not fit the model's context of {max_length} tokens with "
                       f"room to answer: {', '.join(too_long[:SHOWN_IDS])}{more} (nothing is truncated)")


def check_needle_grid(plan: RunPlan, tokenizer, max_length: int | None) -> None:
    """Refuse needle lengths the context cannot hold, and build the run's needle and conflict
    documents now, so that a length no document can meet (too short for the needle and the
    question) is bad input too; lm-eval then loads these same documents (`needle_task.grid_docs`
    and `needle_task.conflict_docs` keep them)."""
    from evalkit.prompts import conflict, needle
    from evalkit.prompts.needle_task import TASK_CONFLICTS, TASK_GRIDS, check_lengths, conflict_docs, grid_docs

    cfg = plan.cfg
    lengths = cfg.needle_lengths or list(needle.DEFAULT_LENGTHS)
    check_lengths(lengths, max_length)
    if tokenizer is None:
        raise BadInput(f"needle tasks need the model's tokenizer; model type {cfg.model!r} exposes none")
    for task in catalog.expand(plan.tasks):
        if task in TASK_GRIDS:
            lang, hint = TASK_GRIDS[task]
            grid_docs(tokenizer, chat=plan.template.chat, system=plan.template.system, lengths=lengths,
                      depths=cfg.needle_depths or list(needle.DEFAULT_DEPTHS), seed=cfg.seed, lang=lang, hint=hint,
                      doc_to_text=plan.template.doc_to_text)
        elif task in TASK_CONFLICTS:
            conflict_docs(tokenizer, chat=plan.template.chat, system=plan.template.system, lengths=lengths,
                          pairs=conflict.DEFAULT_PAIRS, seed=cfg.seed, lang=TASK_CONFLICTS[task],
                          doc_to_text=plan.template.doc_to_text)


def check_against_model(plan: RunPlan, lm: Any) -> None:
    """Refuse what the loaded model cannot do as asked; raises BadInput, writes nothing."""
    vocab = vocab_size(lm)
    if vocab is not None and plan.model.top_k is not None and plan.cfg.top_k > vocab:
        raise BadInput(f"--top-k {plan.cfg.top_k} is more than the model's vocabulary of {vocab} tokens")
    max_length = context_length(lm)
    tokenizer = getattr(lm, "tokenizer", None)
    if plan.template.chat and tokenizer is not None:  # every engine: a chat template the tokenizer has not
        from evalkit.prompts.templates import render_prompt  # is render_prompt's one line, before the run

        render_prompt(tokenizer, plan.template, "?")
    if plan.has_needle:
        check_needle_grid(plan, tokenizer, max_length)
    if max_length is not None and tokenizer is not None and callable(tokenizer):
        check_prompts_fit(plan, tokenizer, max_length)
    from evalkit.runner.drift import check_tokenizer

    check_tokenizer(lm)  # drift by position: the base's token ids must mean the same texts here
