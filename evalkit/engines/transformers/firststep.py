"""The exact first-step engine: one prefill, and everything evalkit reads off the first step.

Owns, for a batch of already-templated prompts on a Hugging Face causal LM:
- one batched prefill (explicit position ids, KV cache kept) giving the full-vocabulary
  first-step distribution: top-k, entropy, float32 log-softmax. The head every prompt of the
  batch shares (a chat template's system turn) is computed once and its cache repeated; each
  row's remaining tokens are left-padded after it;
- candidate-string probabilities (docs/metrics.md §1.1 `ft_hit_prob`): P(response starts with a
  string) as the product of its tokens' teacher-forced conditional probabilities,
  the string tokenised in its real context (once per template frame); the batch's candidate
  tries are fed level by level after the prompts, rows grouped by how many nodes they need so
  none is padded to another language's trie, each group on its own copy of its prompts' cache;
- the first unit of each likely first token (a split UTF-8 character completed greedily), its
  nodes fed in the trie's own level forwards;
- a greedy continuation from the same cache, with first-step interventions (banned
  first tokens, a sampled first token at a given temperature); the continuations of every batch
  a `Prober` is handed are stepped together (`_Decoder`), new rows joining as earlier ones end;
- the result (`FirstStep`), candidate and unit ids and the trie's tolerance rule are every engine's:
  `evalkit.engines.firststep`.

None of the batching moves a number beyond float reassociation: `tests/test_engine_equivalence.py`
holds every field to the pre-speed-work engine (`tests/reference_engine.py`) within 1e-4 nats.

Does not: import lm-eval, store anything, apply chat templates, normalise or cut text
(stop strings only stop generation; cutting the text before them is the caller's job).
Other tokenisations of a candidate string than its tokenisation in context are not
counted in its probability.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import math
import os
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from evalkit.defaults import BATCH_TOKENS, DEFAULT_BATCH_SIZE, DEFAULT_TOP_K
from evalkit.engines.firststep import (  # noqa: F401  (first_ids, top_mass, topk_dict: read off probe's results)
    SEED_STRIDE,
    UNIT_RANKS,
    UNIT_TOKENS,
    FirstStep,
    _encode,
    candidate_ids,
    context_tail,
    first_ids,
    first_unit_ids,
    tolerance_cut,
    top_mass,
    topk_dict,
)
from evalkit.engines.kvpolicy import FULL, KVPolicy
from evalkit.engines.transformers.kvcache import new_cache


# the share of a batch's time a progress bar gives its phases (a guide for the eye, not a measure)
PREFILL_SHARE, FIRST_STEP_SHARE = 0.3, 0.5


def probe(
    model,
    tokenizer,
    contexts: list[str],
    candidates: list[list[str]] | None = None,
    *,
    top_k: int = DEFAULT_TOP_K,
    max_new_tokens: int = 32,
    stop: Sequence[str] = (),
    batch_size: int = DEFAULT_BATCH_SIZE,
    first_temperature: float | None = None,
    banned_first_ids: set[int] | frozenset = frozenset(),
    seed: int = 0,
    add_special_tokens: bool = False,
    tolerance: float = 0.0,
    exact_candidates: list[list[str]] | None = None,
    attention: list[Any] | None = None,
    answer_tokens: Sequence[int] | None = None,
    kv_policy: KVPolicy | None = None,
    unit_ranks: int = 0,
    batch_tokens: int = BATCH_TOKENS,
    progress: Callable[[str, float], None] | None = None,
) -> list[FirstStep]:
    """Prefill each context once and read its first step; see the module docstring.

    `contexts` are complete prompts (already templated, assistant header and any
    prefill included). `candidates[i]` are the strings whose probability of starting
    the response to `contexts[i]` is wanted (duplicates counted once). The first
    generated token is the argmax after `banned_first_ids` are removed, or a sample
    at `first_temperature` (> 0) drawn with a generator seeded from `seed` and the
    prompt's index in `contexts`; later tokens are greedy. With `max_new_tokens=0`
    nothing is generated but `first_token_id` is still chosen. Results are in the
    order of `contexts` and do not depend on `batch_size`. A batch holds at most
    `batch_size` prompts and at most `batch_tokens` positions once padded to its longest
    prompt (never fewer than one prompt), so long prompts go in smaller batches: the KV
    cache and the prefill's temporaries grow with the padded positions, not the count.

    `tolerance` > 0 lets each prompt leave unscored the least likely token prefixes
    of its candidate trie, as long as their probabilities add up to at most
    `tolerance`; every candidate under such a prefix gets 0.0. Candidates that are
    not prefixes of one another are disjoint events, so any sum of candidate
    probabilities (ft_hit_prob, opener_mass) then falls short of the exact sum by
    at most the prompt's `unscored_mass` <= `tolerance`. 0, the default, is exact.
    `exact_candidates[i]` (also listed in `candidates[i]`) are never left out: their
    prefixes are always teacher-forced, whatever their probability.

    `answer_tokens[i]` > 0 lets the greedy continuation of context i run on, past the stop
    strings and `max_new_tokens`, to that many tokens (or eos): `answer_ids` is the whole
    continuation and `response_ids` its prefix as it would have stopped — one generation,
    from the same prefill and cache.
    `unit_ranks` > 0 fills `units` for the that many likeliest first tokens: the first unit
    (docs/metrics.md §1.0) each one starts, completed greedily where the token alone holds
    no whole character (`_Engine.complete_units`), so a figure can show 递 where the token
    decodes to "�".
    `kv_policy` (`kvpolicy.KVPolicy`, default `full`) is applied to every forward pass —
    the prefill, the candidate trie and decoding — so every number read here is computed
    under it: evicted keys are masked out of every later query's attention (positions keep
    their original indices), rounded caches store and read rounded keys and values. `full`
    runs exactly the code path without a policy.

    `attention[i]` (an `attention.Request`) asks for prompt i's prefill attention, reduced
    per layer (`FirstStep.attention`); the model must run `attention.IMPLEMENTATION`
    (`attention.install`). Only the prefill is read (under the KV-cache policy's masks, as the model ran it);
    nothing else changes.

    `progress(phase, fraction)` is told, as the work goes, what runs now ("prefill", "candidate trie",
    "decode (40 rows)") and the share of all `contexts` done, in [0, 1]: a bar moves within a batch.
    """
    prober = Prober(model, tokenizer, top_k=top_k, max_new_tokens=max_new_tokens, stop=stop, batch_size=batch_size,
                    first_temperature=first_temperature, add_special_tokens=add_special_tokens, tolerance=tolerance,
                    kv_policy=kv_policy, unit_ranks=unit_ranks, batch_tokens=batch_tokens)
    prober.submit(None, contexts, candidates, exact_candidates=exact_candidates, attention=attention,
                  answer_tokens=answer_tokens, seed=seed, banned_first_ids=banned_first_ids, progress=progress)
    ((_, steps),) = prober.finish()
    return steps


class Prober:
    """`probe` over batches handed in one at a time, their continuations decoded together.

    Each `submit`ted list of prompts is prefilled, read and scored at once (`_batches`, `_Engine.run_batch`:
    the same forwards `probe` has always run, so the same numbers); only its continuation waits. The rows
    that go on past their first token join one decoder for every submission (`_Decoder`), which steps
    them together and takes the next batch's rows in while earlier ones are still going: a decode step
    serves between one batch's worth of rows and two, instead of one batch's remainder shrinking to a
    row or two. A row's greedy tokens are its own whatever it is stepped with (float reassociation
    aside, `tests/test_engine_equivalence.py`).

    `ready()` hands back the submissions whose every row has finished, as (key, steps in the order of
    their contexts); `finish()` decodes what is left and hands back the rest. `probe` is one
    `submit` and `finish`. The settings given here hold for every submission.
    """

    def __init__(self, model, tokenizer, *, top_k: int = DEFAULT_TOP_K, max_new_tokens: int = 32,
                 stop: Sequence[str] = (), batch_size: int = DEFAULT_BATCH_SIZE,
                 first_temperature: float | None = None, add_special_tokens: bool = False,
                 tolerance: float = 0.0, kv_policy: KVPolicy | None = None, unit_ranks: int = 0,
                 batch_tokens: int = BATCH_TOKENS, trie_positions: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        trie_positions = TRIE_POSITIONS if trie_positions is None else trie_positions
        if trie_positions < 1:
            raise ValueError(f"trie_positions must be >= 1, got {trie_positions}")
        if not 0 <= tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
        self.batch_size, self.batch_tokens = batch_size, batch_tokens
        self.engine = _Engine(model, tokenizer, top_k, max_new_tokens, stop, first_temperature, frozenset(), 0,
                              add_special_tokens, tolerance, kv_policy, unit_ranks, None)
        self.engine.trie_positions = trie_positions
        # rows are stepped while more than three quarters of a batch go, so a step feeds 24 to 56 rows at
        # batch size 32 (a decode step of 32 to 64 rows costs 2.4-3.1 ms a row here, of 8 rows 8.8; a whole
        # batch kept took the suite's peak to 2.02 GB); batch size 1 keeps its meaning, one prompt in every
        # forward (the arithmetic of a single request)
        self.keep = batch_size * 3 // 4 if self.engine.policy_merges and batch_size > 1 else 0
        self.decoder = _Decoder(self.engine)
        self.open: dict[int, tuple[Any, list[FirstStep], set[int]]] = {}  # submission -> (key, steps, rows going)
        self.order = 0

    def submit(self, key: Any, contexts: list[str], candidates: list[list[str]] | None = None, *,
               exact_candidates: list[list[str]] | None = None, attention: list[Any] | None = None,
               answer_tokens: Sequence[int] | None = None, seed: int = 0,
               banned_first_ids: set[int] | frozenset = frozenset(),
               progress: Callable[[str, float], None] | None = None) -> None:
        """Prefill, read and score `contexts` now (arguments as `probe`'s), and queue their continuations."""
        if candidates is not None and len(candidates) != len(contexts):
            raise ValueError(f"{len(candidates)} candidate lists for {len(contexts)} contexts")
        if exact_candidates is not None and len(exact_candidates) != len(contexts):
            raise ValueError(f"{len(exact_candidates)} exact candidate lists for {len(contexts)} contexts")
        if attention is not None and len(attention) != len(contexts):
            raise ValueError(f"{len(attention)} attention requests for {len(contexts)} contexts")
        if answer_tokens is not None and len(answer_tokens) != len(contexts):
            raise ValueError(f"{len(answer_tokens)} answer lengths for {len(contexts)} contexts")
        engine = self.engine
        context_ids = [_encode(engine.tokenizer, c, engine.add_special_tokens) for c in contexts]
        for i, ids in enumerate(context_ids):
            if not ids:
                raise ValueError(f"context {i} tokenises to no tokens; nothing to predict from")
        engine.seed, engine.attention = seed, attention
        engine.banned = sorted(int(i) for i in banned_first_ids)
        number, self.order = self.order, self.order + 1
        steps: list[FirstStep | None] = [None] * len(contexts)
        going: set[int] = set()
        self.open[number] = (key, steps, going)  # type: ignore[assignment]  # every slot is filled below
        # longest first, so a batch holds prompts of similar length (little padding)
        order = sorted(range(len(contexts)), key=lambda i: (-len(context_ids[i]), i))
        done = 0
        with torch.inference_mode():
            for rows in _batches(order, [len(ids) for ids in context_ids], self.batch_size, self.batch_tokens):
                if progress is not None:
                    engine.progress = functools.partial(_tell, progress, done, len(rows), len(contexts))
                done += len(rows)
                # the rows still decoding count against the batch's positions (`batch_tokens`): long
                # prompts' continuations finish before the next batch of them is prefilled
                self.decoder.fit(self.batch_tokens - len(rows) * max(len(context_ids[i]) for i in rows))
                batch_steps, state = engine.run_batch(
                    rows,
                    [contexts[i] for i in rows],
                    [context_ids[i] for i in rows],
                    [list(candidates[i]) if candidates is not None else [] for i in rows],
                    [set(exact_candidates[i]) if exact_candidates is not None else set() for i in rows],
                    [int(answer_tokens[i]) if answer_tokens is not None else 0 for i in rows],
                )
                for i, step in zip(rows, batch_steps):
                    steps[i] = step
                if state is not None:
                    self.decoder.admit([_Row(step, i, going, *limit)
                                        for i, step, limit in zip(rows, batch_steps, state.limits)], state)
                    state = None  # the decoder holds what it needs of the batch's cache
                    self.decoder.run(self.keep)

    def ready(self) -> list[tuple[Any, list[FirstStep]]]:
        """The submissions whose every row has finished, oldest first, each handed back once."""
        out = [(number, key, steps) for number, (key, steps, going) in self.open.items() if not going]
        for number, _, _ in out:
            del self.open[number]
        return [(key, steps) for _, key, steps in out]

    def finish(self, progress: Callable[[str, float], None] | None = None) -> list[tuple[Any, list[FirstStep]]]:
        """Decode every row still going (told to `progress`, if given, instead of the last submission's),
        and hand back every submission not handed back yet."""
        if progress is not None:
            self.engine.progress = progress
        with torch.inference_mode():
            self.decoder.run(0)
        return self.ready()


def _tell(progress: Callable[[str, float], None], before: int, rows: int, total: int, phase: str,
          share: float) -> None:
    """A batch's progress (its phase, `share` of it done) as the share of all prompts done."""
    progress(phase, (before + share * rows) / total)


def _batches(order: list[int], lengths: list[int], batch_size: int, batch_tokens: int) -> list[list[int]]:
    """Cut `order` (longest prompt first) into batches of at most `batch_size` prompts whose
    padded size, prompts × the first (longest) prompt's length, stays within `batch_tokens`."""
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < batch_size and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


# --- internals -------------------------------------------------------------------

MIN_SHARED_HEAD = 4  # a batch's common leading tokens are prefilled once from this many on
# the padded node positions one level forward of the candidate trie may hold. Where the model's head is
# applied apart (`head_split`), a level's logits exist LSE_ROWS node rows at a time, and what bounds a
# group is the KV cache its levels append to (rows x (prompt + every level's width) positions): on the
# whole firsttoken suite, with the decoder's rows beside it, 2048 peaked at 2.16 GiB RSS and 1024 at
# 1.88 GiB (2.02 GB, over the 2 GB budget). Where the whole forward runs, a level's logits are
# positions x vocabulary floats (512 x 49152 x 4 bytes = 100 MB on the default model; 1024 took a
# default run of 64 prompts to 1.98 GB RSS). 512 either way
TRIE_POSITIONS = 512
FORWARD_POSITIONS = 24  # what a forward costs before its first position, in positions (docs/performance.md)
PAD_SHARE = 0.15  # a trie group may pad this share of its positions
LSE_ROWS = 128  # node rows whose logits exist at once (rows x vocabulary floats: 25 MB)
SPLIT_TOLERANCE = 1e-4  # how near the head applied apart must come to the model's own logits (`head_split`)
_SPLITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (decoder, head, cache kw) | None


def head_split(model) -> tuple[Any, Any, str] | None:
    """(decoder, head, the decoder's cache keyword) when the model's logits are its output head applied to
    its decoder's last hidden state, else None; decided once per model, by running both on a short input.

    The trie reads each node's whole log-softmax, but only the node positions that are real need the head:
    applied apart, to LSE_ROWS of them at a time, it skips the padding and never holds a (positions x
    vocabulary) tensor. A model that changes its logits after the head (a soft cap, a scale) fails the
    check and keeps the whole forward."""
    if model in _SPLITS:
        return _SPLITS[model]
    found = None
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError, TypeError):
        decoder = head = None
    if decoder is not None and head is not None and decoder is not model:
        device = _model_device(model)
        ids = torch.tensor([[1, 2, 3]], dtype=torch.long, device=device)
        try:
            with torch.inference_mode():
                whole = model(input_ids=ids, use_cache=False).logits
                apart = head(decoder(input_ids=ids, use_cache=False).last_hidden_state)
            same = whole.shape == apart.shape and torch.allclose(whole.float(), apart.float(), atol=SPLIT_TOLERANCE,
                                                                 rtol=SPLIT_TOLERANCE)
        except Exception:  # noqa: BLE001  (a decoder or head that cannot be called apart: the whole forward)
            same = False
        if same:
            params = inspect.signature(decoder.forward).parameters
            found = (decoder, head, "cache" if "cache" in params else "past_key_values")
    _SPLITS[model] = found
    return found


def _model_device(model) -> torch.device:
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else next(model.parameters()).device


def _eos_ids(model, tokenizer) -> set[int]:
    """Token ids that end a response: tokenizer eos, `<|im_end|>`, generation-config eos."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    unk = getattr(tokenizer, "unk_token_id", None)
    if isinstance(im_end, int) and im_end >= 0 and im_end != unk:
        ids.add(im_end)
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif isinstance(gen_eos, Iterable):
        ids.update(int(i) for i in gen_eos)
    return ids


def _read_attention(requests, indices, offsets, length):
    """The prefill's attention capture for this batch (`attention.capture`), or a no-op when none is asked for."""
    if requests is None:
        return contextlib.nullcontext()
    from evalkit.engines.transformers import attention

    return attention.capture([requests[i] or attention.Request() for i in indices], offsets, length)


def _rows_of(cache, rows: torch.Tensor):
    """A new cache holding these batch rows of `cache`, which is left as it was: each layer is a
    shallow copy whose tensors `batch_select_indices` replaces (it indexes, never writes in place)."""
    sub = copy.copy(cache)
    sub.layers = [copy.copy(layer) for layer in cache.layers]
    sub.batch_select_indices(rows)
    return sub


def _truncate_cache(cache, length: int) -> None:
    """Keep the first `length` positions of every layer (`crop`'s meaning differs across
    transformers versions, so the layers are sliced directly)."""
    for layer in cache.layers:
        if hasattr(layer, "truncate"):  # a rounded layer (kvcache) keeps its residual count right
            layer.truncate(length)
        elif getattr(layer, "keys", None) is not None:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


class _Engine:
    """One probe call's settings, and the forward passes for one batch of prompts."""

    def __init__(self, model, tokenizer, top_k, max_new_tokens, stop, first_temperature,
                 banned_first_ids, seed, add_special_tokens, tolerance=0.0, kv_policy=None, unit_ranks=0,
                 attention=None):
        self.model = model
        self.trie_positions = TRIE_POSITIONS  # padded node positions a trie level holds (`node_groups`)
        self.progress: Callable[[str, float], None] = lambda phase, share: None  # see `probe`
        self.unit_ranks = max(0, int(unit_ranks))
        self.policy = kv_policy or FULL
        self.attention = attention  # per context: attention.Request, or None
        self.tolerance = float(tolerance)
        self.tokenizer = tokenizer
        self.top_k = top_k
        self.max_new_tokens = max_new_tokens
        self.stop = [s for s in stop if s]
        self.first_temperature = first_temperature
        self.banned = sorted(int(i) for i in banned_first_ids)
        self.seed = seed
        self.add_special_tokens = add_special_tokens
        self.device = _model_device(model)
        self.float_dtype = next(
            (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32
        )
        self.eos = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.pad_id = int(pad)
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache` (old name deprecated)
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = "logits_to_keep" in params
        self._split: tuple[Any, Any, str] | None | bool = False  # `head_split`, looked up at the first trie level
        # (text after the context's last added token, candidate) -> the candidate's tokens there (`in_context`)
        self.tail_ids: dict[tuple[str, str], list[int]] = {}
        self.frame_cuts = True  # False once this tokenizer is seen not to cut its input at added tokens
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added_tokens = [str(getattr(t, "content", t)) for t in decoder.values() if str(getattr(t, "content", t))]

    @property
    def split(self) -> tuple[Any, Any, str] | None:
        if self._split is False:
            self._split = head_split(self.model)
        return self._split  # type: ignore[return-value]

    def forward(self, input_ids, attention_mask, position_ids, cache=None, last_only=False, hidden_only=False):
        """Model forward with a cache kept: (logits, cache); with `hidden_only`, (the decoder's last hidden
        states, cache), the head left to the caller (`head_split`, which must have found one)."""
        if hidden_only:
            decoder, _, cache_kw = self.split  # type: ignore[misc]
            out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=True, **{cache_kw: cache})
            hidden = out.last_hidden_state
        else:
            kwargs = {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "position_ids": position_ids,
                "use_cache": True,
                self.cache_kw: cache,
            }
            if last_only and self.keep_kw:
                kwargs["logits_to_keep"] = 1
            out = self.model(**kwargs)
        new_cache = getattr(out, "cache", None)  # transformers 5's name; `past_key_values` before it
        if new_cache is None:
            new_cache = getattr(out, "past_key_values", None)
        return (hidden if hidden_only else out.logits), new_cache

    def run_batch(self, indices, contexts, ids_list, cand_lists, exact_sets=None,
                  answer_lens=None) -> tuple[list[FirstStep], _Queued | None]:
        """Prefill one batch together and read its first step; `indices` are the prompts' places in
        `contexts` (seeds). Returns the steps, and their continuation for `_Decoder.admit` (None when
        nothing is generated)."""
        B = len(ids_list)
        with _read_attention(self.attention, indices, self.pads(ids_list), max(len(ids) for ids in ids_list)) as seen:
            logprobs, cache, mask, position_ids = self.prefill(ids_list)
        self.progress("prefill done", PREFILL_SHARE)

        steps = []
        k = max(0, min(self.top_k, logprobs.shape[-1]))
        top = torch.topk(logprobs, k, dim=-1)
        # read off the device once a batch, not once a row (each read is a wait on a GPU)
        top_ids, top_lps = top.indices.tolist(), top.values.tolist()
        entropy = torch.special.entr(logprobs.exp()).sum(-1).tolist()
        host = logprobs.detach().cpu()
        for r in range(B):
            steps.append(FirstStep(
                context_ids=list(ids_list[r]),
                topk_ids=top_ids[r],
                topk_logprobs=top_lps[r],
                entropy=float(entropy[r]),
                logprobs=host[r].clone(),
            ))
        if seen is not None:
            for step, read in zip(steps, seen.results()):
                step.attention = read
        toks_of = [{c: self.in_context(contexts[r], ids_list[r], c) for c in dict.fromkeys(cand_lists[r])}
                   for r in range(B)]
        unit_tops = [s.topk_ids[: min(self.unit_ranks, k)] for s in steps] if self.unit_ranks else [[] for _ in steps]
        if any(toks_of) or any(unit_tops):
            self.progress("candidate trie", PREFILL_SHARE)
            scored, units = self.score_nodes(toks_of, unit_tops, cache, mask, logprobs, exact_sets)
            for r, step in enumerate(steps):
                probs, unscored, positions, unit_fed = scored[r]
                step.candidate_probs = {c: probs[c] for c in dict.fromkeys(cand_lists[r])}
                step.unscored_mass, step.candidate_positions, step.unit_positions = unscored, positions, unit_fed
                step.candidate_tokens = toks_of[r]
                if self.unit_ranks:
                    step.units = units[r]

        first = [self.first_token(logprobs[r], indices[r]) for r in range(B)]
        for r in range(B):
            steps[r].first_token_id = first[r]
        self.progress("batch done", 1.0)
        answer_lens = list(answer_lens or [0] * B)
        if self.max_new_tokens <= 0 and not any(answer_lens):
            return steps, None
        # each row's (token limit, stops at the stop strings, continued to answer the question)
        limits = [(max(self.max_new_tokens, n), n == 0, n > 0) for n in answer_lens]
        return steps, _Queued(first, cache, mask, position_ids, limits)

    @staticmethod
    def pads(ids_list) -> list[int]:
        P = max(len(ids) for ids in ids_list)
        return [P - len(ids) for ids in ids_list]

    def shared_head(self, ids_list) -> int:
        """How many leading tokens every prompt of the batch shares and the prefill computes once (0: none).

        Only where nothing else reads the prefill column by column: the `full` policy (no eviction
        masks, no rounded cache) and no attention capture. At least one token of every prompt stays
        after the head, so each row's own last position is computed in the batch."""
        if len(ids_list) < 2 or not self.policy.is_full or self.attention is not None:
            return 0
        head = min(len(os.path.commonprefix(ids_list)), min(len(ids) for ids in ids_list) - 1)
        return head if head >= MIN_SHARED_HEAD else 0

    def prefill(self, ids_list):
        """Prefill the batch: (first-step log-probs (B, V) float32, cache, key mask (B, P), positions (B, P)).

        Rows are left-padded. A head every row shares (`shared_head`) is computed once, as one row,
        and its cache repeated for every row; each row's remaining tokens are then left-padded after
        the head (the padding sits between head and tail, masked out; positions stay the real ones)."""
        B = len(ids_list)
        head = self.shared_head(ids_list)
        cache = None
        if head:
            ids = torch.tensor([ids_list[0][:head]], dtype=torch.long, device=self.device)
            ones = torch.ones_like(ids)
            _, cache = self.forward(ids, ones, torch.arange(head, device=self.device).unsqueeze(0), last_only=True)
            cache.batch_repeat_interleave(B)
        tails = [ids[head:] for ids in ids_list]
        S = max(len(t) for t in tails)
        input_ids = torch.full((B, S), self.pad_id, dtype=torch.long)
        tail_mask = torch.zeros((B, S), dtype=torch.long)
        for r, t in enumerate(tails):
            input_ids[r, S - len(t):] = torch.tensor(t, dtype=torch.long)
            tail_mask[r, S - len(t):] = 1
        mask = torch.cat([torch.ones((B, head), dtype=torch.long), tail_mask], dim=-1).to(self.device)
        input_ids = input_ids.to(self.device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        if cache is None and self.policy.rounds:
            cache = new_cache(self.policy, self.model, self.pads(ids_list))
        attn = mask
        if self.policy.evicts:  # a query at position t reads only the keys the policy keeps at t
            eye = torch.eye(S, dtype=torch.bool, device=self.device).unsqueeze(0)  # padding rows read themselves
            attn = self.policy_mask(position_ids, position_ids, mask, also=eye)
        logits, cache = self.forward(input_ids, attn, position_ids[:, head:], cache=cache, last_only=True)
        return torch.log_softmax(logits[:, -1, :].float(), dim=-1), cache, mask, position_ids

    def policy_mask(self, q_pos, k_pos, k_valid, also=None):
        """The 4-D additive attention mask of the KV-cache policy: query i of row r may read
        key column j when the column holds a real token (`k_valid`) the policy keeps visible
        at the query's position (`KVPolicy.visible` on the original position indices), or
        where `also` says so. (B, 1, Q, K) in the model's float dtype, 0 or its minimum."""
        allow = k_valid.bool()[:, None, :] & self.policy.visible(q_pos[:, :, None], k_pos[:, None, :])
        if also is not None:
            allow = allow | also
        return self.additive(allow)

    def additive(self, allow: torch.Tensor) -> torch.Tensor:
        """(B, Q, K) bool -> (B, 1, Q, K) additive float mask."""
        neg = torch.finfo(self.float_dtype).min
        return torch.zeros(allow.shape, dtype=self.float_dtype, device=allow.device).masked_fill(~allow, neg).unsqueeze(1)

    @property
    def policy_merges(self) -> bool:
        """Whether rows of different batches may share decode steps (`_Decoder`): not under a rounded
        cache, whose layers keep per-row residuals of their own."""
        return not self.policy.rounds

    def in_context(self, context: str, context_ids: list[int], candidate: str) -> list[int]:
        """`candidate_ids(context, candidate)`, computed once per template frame where the tokenizer allows.

        A fast tokenizer cuts its input at added tokens (`<|im_start|>` …) before anything else, so a
        candidate's tokens after a context depend only on the text after the context's last added token:
        the tail ("assistant\\n" under a chat template) is the key, the same for every prompt of a frame.
        The first context seen with each tail is also tokenised whole, and the shortcut is dropped for
        good if any candidate's tokens differ (a tokenizer that does not cut there)."""
        cut = self.frame_cut(context)
        if cut is None:
            return candidate_ids(self.tokenizer, context, candidate, context_ids, self.add_special_tokens)
        tail = context[cut:]
        key = (tail, candidate)
        ids = self.tail_ids.get(key)
        if ids is None:
            whole = candidate_ids(self.tokenizer, context, candidate, context_ids, self.add_special_tokens)
            # a merge across the boundary: the candidate is tokenised alone, whatever the context
            ids = context_tail(_encode(self.tokenizer, tail + candidate, False), _encode(self.tokenizer, tail, False))
            ids = whole if ids is None else ids
            if ids != whole:  # checked once per key, on the first context with this tail
                self.frame_cuts = False  # this tokenizer does not cut at its added tokens: never again
                return whole
            self.tail_ids[key] = ids
        return ids

    def frame_cut(self, context: str) -> int | None:
        """Where the text after the context's last added token starts (the start of that token), or None."""
        if not self.frame_cuts or not self.added_tokens:
            return None
        best = -1
        for tok in self.added_tokens:
            best = max(best, context.rfind(tok))
        return best if best >= 0 else None

    def score_nodes(self, toks_of, unit_tops, cache, mask, logprobs, exact_sets=None):
        """The candidate trie and the first units of the batch, in shared forwards.

        Returns (per row: ({candidate: P(response starts with it)}, unscored mass, trie positions
        forwarded, first-unit positions forwarded beside them), per row: {top token id: its first unit}).

        Candidates: teacher forcing over the token trie of each prompt's candidates (`toks_of[r]`:
        candidate -> its tokens in context), one trie level per forward. A node is a proper prefix
        `(row, t0, ..., t{d-1})`; fed its last token at position n_real + d - 1 after the prompt, it
        attends to its prompt and its ancestors only (a custom 4-D mask), so shared prefixes are fed
        once and the prompt's cache is never recomputed. Before each level, a prompt's least likely
        new prefixes are left out while their total probability fits in what is left of its
        `tolerance` (see `probe`); prefixes of the prompt's exact candidates never are.

        First units: each token of `unit_tops[r]` that holds no whole character alone is completed
        greedily (`first_unit_ids`), at most UNIT_TOKENS tokens deep; its nodes ride in the same
        level forwards, and a node the trie already feeds is not fed twice. "" when no unit is
        whole by then. Tokens that are whole alone map to their own stripped text.

        Rows are grouped by how many nodes their first level holds, and each group runs its levels
        on its own copy of its rows' prompt cache, so a row is padded only to its group's widest
        level, not the batch's: an English prompt's few dozen nodes do not wait on a Chinese one's
        two hundred. The prompt cache is left as it was.
        """
        B, P = mask.shape
        kept: set[tuple[int, ...]] = set()  # prefixes of exact candidates: always forced
        for r in range(B):
            for c in (exact_sets[r] if exact_sets else ()):
                tk = toks_of[r].get(c, [])
                kept.update((r, *tk[:d]) for d in range(1, len(tk)))
        # node -> {next token: log P(next | node)}; the root's is read from the prefill's full row
        child_lp: dict[tuple[int, ...], dict[int, float]] = {}
        trie_done: set[tuple[int, ...]] = {(r,) for r in range(B)}  # the root and every trie node forwarded
        node_sum: dict[tuple[int, ...], float] = {(r,): 0.0 for r in range(B)}  # log P(prefix)
        wanted: dict[tuple[int, ...], set[int]] = {}  # node -> the next tokens the trie reads off it
        for r in range(B):
            for tk in toks_of[r].values():
                for d in range(len(tk)):
                    wanted.setdefault((r, *tk[:d]), set()).add(tk[d])
        for r in range(B):
            child_lp[(r,)] = {t: float(logprobs[r, t]) for t in wanted.get((r,), ())}
        units: list[dict[int, str]] = [{} for _ in range(B)]
        unit_open: list[list[tuple[int, ...]]] = [[] for _ in range(B)]  # nodes whose greedy next token is wanted
        for r, ids in enumerate(unit_tops):
            for t in ids:
                unit, _ = first_unit_ids(self.decode, [t])
                if unit:
                    units[r][t] = unit
                else:
                    unit_open[r].append((r, t))
        budget = [self.tolerance] * B  # probability each prompt may still leave unscored
        positions = [0] * B
        unit_fed = [0] * B  # first-unit nodes forwarded that the trie did not feed
        depth_max = max(max((len(tk) for d in toks_of for tk in d.values()), default=0) - 1,
                        UNIT_TOKENS - 1 if any(unit_open) else 0)

        def trie_level(r: int, depth: int) -> list[tuple[int, ...]]:
            """Row r's trie nodes of this depth that are forwarded, after the tolerance cut."""
            fresh = []
            for tk in toks_of[r].values():
                if len(tk) <= depth:
                    continue
                node, parent = (r, *tk[:depth]), (r, *tk[: depth - 1])
                if parent not in trie_done or node in node_sum:
                    continue  # parent left out, or node already queued
                node_sum[node] = node_sum[parent] + child_lp[parent][node[-1]]
                fresh.append(node)
            level, budget[r] = tolerance_cut(fresh, node_sum, kept, budget[r])
            positions[r] += len(level)
            trie_done.update(level)
            return level

        state = getattr(cache, "evalkit_state", None)
        if state is not None:  # trie nodes are alternatives, never a sequence: no residual flush
            state["hold"] = True
        try:
            if depth_max >= 1:
                first_level = [trie_level(r, 1) for r in range(B)]
                groups = self.node_groups(first_level, unit_open)
                for g, rows in enumerate(groups):
                    self.progress(f"candidate trie {g + 1}/{len(groups)}",
                                  PREFILL_SHARE + (FIRST_STEP_SHARE - PREFILL_SHARE) * g / len(groups))
                    self.score_group(rows, first_level, unit_open, trie_level, depth_max, cache, mask, child_lp,
                                     wanted, units, unit_fed)
        finally:
            if state is not None:
                state["hold"] = False
        for nodes in unit_open:  # a token whose unit no level completed: ""
            for node in nodes:
                units[node[0]].setdefault(node[1], "")
        out = []
        for r in range(B):
            probs = {}
            for cand, tk in toks_of[r].items():
                if not tk:
                    probs[cand] = 1.0
                    continue
                last = (r, *tk[:-1])
                if last not in trie_done:  # under a prefix left out: counted in the unscored mass
                    probs[cand] = 0.0
                    continue
                probs[cand] = math.exp(node_sum[last] + child_lp[last][tk[-1]])
            out.append((probs, self.tolerance - budget[r], positions[r], unit_fed[r]))
        return out, units

    def node_groups(self, first_level, unit_open) -> list[list[int]]:
        """Rows cut into groups that share level forwards: rows with like first levels together (their
        deeper levels are alike too). A forward costs about FORWARD_POSITIONS positions before it computes
        any (the weights are read from memory once a forward), so a row joins the group before it while
        the padding that adds stays under that, or under PAD_SHARE of the group's positions; a group
        holds at most `trie_positions` padded positions a level (TRIE_POSITIONS unless the caps say otherwise)."""
        B = len(first_level)
        if self.policy.rounds:  # a rounded cache is never copied: one group
            return [list(range(B))]
        width = [len(first_level[r]) + len(unit_open[r]) for r in range(B)]
        order = sorted((r for r in range(B) if width[r]), key=lambda r: (width[r], r))
        groups: list[list[int]] = []
        for r in order:
            g = groups[-1] if groups else None
            if g is not None:
                padded = (len(g) + 1) * width[r]
                padding = padded - sum(width[i] for i in g) - width[r]
                if padded <= self.trie_positions and padding <= max(FORWARD_POSITIONS, PAD_SHARE * padded):
                    g.append(r)
                    continue
            groups.append([r])
        return groups

    def score_group(self, rows, first_level, unit_open, trie_level, depth_max, cache, mask, child_lp, wanted,
                    units, unit_fed) -> None:
        """Run every level of these rows' trie and unit nodes on a copy of their prompt cache (the
        batch's own cache, cropped back after, when the group is the whole batch)."""
        B, P = mask.shape
        whole = len(rows) == B
        if whole:  # the batch's own cache: its rows in its order
            rows = list(range(B))
        sub = cache if whole else _rows_of(cache, torch.tensor(rows, device=self.device))
        sub_mask = mask if whole else mask[rows]
        slot: dict[tuple[int, ...], int] = {}  # node -> its column after the prompt
        used = 0
        n_real = sub_mask.sum(-1).tolist()
        try:
            level = {r: first_level[r] for r in rows}
            opened = {r: unit_open[r] for r in rows}  # per row: unit nodes whose greedy next token is wanted
            for depth in range(1, depth_max + 1):
                if depth > 1:
                    level = {r: trie_level(r, depth) for r in rows}
                feed: list[list[tuple[int, ...]]] = []
                for r in rows:
                    nodes = list(level[r])
                    seen = set(nodes)
                    extra = [n for n in opened[r] if n not in seen]
                    unit_fed[r] += len(extra)
                    feed.append(nodes + extra)
                if not any(feed):
                    break
                out, used = self.forward_nodes(feed, depth, slot, used, sub, sub_mask, n_real)
                open_now = {n for r in rows for n in opened[r]}
                reads = [(j, q, node) for j, nodes in enumerate(feed) for q, node in enumerate(nodes)]
                units_read, greedy = self.read_nodes(out, reads, wanted, open_now, child_lp)
                nxt: dict[int, list[tuple[int, ...]]] = {r: [] for r in rows}
                for (_, _, node), token in zip(units_read, greedy):
                    child = (*node, int(token))
                    unit, _ = first_unit_ids(self.decode, list(child[1:]))
                    if unit or child[-1] in self.eos:
                        units[node[0]][node[1]] = unit
                    elif depth + 1 < UNIT_TOKENS:
                        nxt[node[0]].append(child)
                    else:
                        units[node[0]][node[1]] = ""
                opened = nxt
        finally:
            if whole and used:
                _truncate_cache(cache, P)

    def read_nodes(self, out, reads, wanted, units_open, child_lp) -> tuple[list[tuple[int, int, Any]], list[int]]:
        """Read one trie level's forward, LSE_ROWS node positions at a time: each read node's log-probability
        of every next token the trie wants off it (into `child_lp`), and the greedy next token of each node
        in `units_open`. `out` is the level's logits, or its last hidden states where the head is applied
        here (`head_split`): only `reads`' positions, never the padding, pay for the head.
        Returns (the reads in `units_open`, their greedy tokens)."""
        split = self.split
        units_read: list[tuple[int, int, Any]] = []
        greedy: list[int] = []
        for begin in range(0, len(reads), LSE_ROWS):
            chunk = reads[begin:begin + LSE_ROWS]
            jj, qq = (torch.tensor([r[i] for r in chunk], device=out.device) for i in (0, 1))
            logits = (split[1](out[jj, qq]) if split is not None else out[jj, qq]).float()  # (n, V)
            lse = torch.logsumexp(logits, dim=-1)
            pairs = [(i, t) for i, (_, _, node) in enumerate(chunk) for t in wanted.get(node, ())]
            if pairs:
                ii, tt = (torch.tensor([p[k] for p in pairs], device=out.device) for k in (0, 1))
                for (i, t), v in zip(pairs, (logits[ii, tt] - lse[ii]).tolist()):
                    child_lp.setdefault(chunk[i][2], {})[t] = v
            opened = [i for i, (_, _, node) in enumerate(chunk) if node in units_open]
            if opened:
                units_read += [chunk[i] for i in opened]
                greedy += torch.argmax(logits[torch.tensor(opened, device=out.device)], dim=-1).tolist()
        return units_read, greedy

    def forward_nodes(self, level, depth: int, slot: dict, used: int, cache, mask, n_real):
        """Forward one level of token trees packed after the prompts: (logits (B, Q, V), or the last hidden
        states (B, Q, H) where the head is applied apart (`head_split`); columns used).

        `level[r]` holds row r's nodes `(row, t0, ..., t{depth-1})`, each fed its last token at
        position n_real + depth - 1 and attending to its prompt and its ancestors (whose
        columns after the prompt `slot` records; the level's own columns are added to it),
        under the KV-cache policy. The nodes are alternatives: the caller crops the cache back
        to the prompt (or drops its copy) when its trees are done."""
        B, P = mask.shape
        Q = max(len(nodes) for nodes in level)
        real = torch.tensor(n_real, dtype=torch.long)
        inp = torch.full((B, Q), self.pad_id, dtype=torch.long)
        pos = (real + depth - 1).unsqueeze(1).expand(B, Q).clone()
        allow = torch.zeros((B, Q, P + used + Q), dtype=torch.bool)
        allow[:, :, :P] = mask.bool().cpu().unsqueeze(1)
        rr, jj, tok, ar, aj, ac, anc_pos = [], [], [], [], [], [], []
        for r, nodes in enumerate(level):
            for j, node in enumerate(nodes):
                rr.append(r)
                jj.append(j)
                tok.append(node[-1])
                for k in range(2, len(node)):  # ancestors (row, t0), (row, t0, t1), ... at position n_real + k - 2
                    ar.append(r)
                    aj.append(j)
                    ac.append(P + slot[node[:k]])
                    anc_pos.append(n_real[r] + k - 2)
                slot[node] = used + j
        if rr:
            r_t, j_t = torch.tensor(rr), torch.tensor(jj)
            inp[r_t, j_t] = torch.tensor(tok, dtype=torch.long)
            allow[r_t, j_t, P + used + j_t] = True
        if ar:
            a_r, a_j, a_c = torch.tensor(ar), torch.tensor(aj), torch.tensor(ac)
            ok = torch.ones(len(ar), dtype=torch.bool)
            if self.policy.evicts:
                ok = self.policy.visible(real[a_r] + depth - 1, torch.tensor(anc_pos))
            allow[a_r[ok], a_j[ok], a_c[ok]] = True
        if self.policy.evicts:  # each node reads the prompt keys the policy keeps at its position
            prompt_pos = ((mask.cumsum(-1) - 1).clamp(min=0)).cpu()
            allow[:, :, :P] &= self.policy.visible(pos[:, :, None], prompt_pos[:, None, :])
        attn = self.additive(allow.to(self.device))  # the float mask is made where the model runs
        out, _ = self.forward(inp.to(self.device), attn, pos.to(self.device), cache=cache,
                              hidden_only=self.split is not None)
        return out, used + Q

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def first_token(self, row_logprobs: torch.Tensor, index: int) -> int:
        """Step-1 token: argmax, or a seeded sample at `first_temperature`, bans applied."""
        lp = row_logprobs
        if self.banned:
            V = lp.shape[-1]
            banned = [i for i in self.banned if 0 <= i < V]
            if len(banned) >= V:
                raise ValueError("banned_first_ids covers the whole vocabulary")
            lp = lp.clone()
            lp[torch.tensor(banned, dtype=torch.long, device=lp.device)] = float("-inf")
        T = self.first_temperature
        if T is None or T <= 0:
            return int(torch.argmax(lp))
        generator = torch.Generator().manual_seed(self.seed * SEED_STRIDE + index)
        probs = torch.softmax(lp.float().cpu() / T, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    def accept(self, response: list[int], token: int, limit: int, stop: bool = True) -> bool:
        """Append `token` to `response` unless it is eos; True while the row goes on."""
        if token in self.eos:
            return False
        response.append(token)
        if len(response) >= limit:
            return False
        return not (stop and self.stopped(response))

    def stopped(self, ids: list[int]) -> bool:
        return bool(self.stop) and any(s in self.tokenizer.decode(ids) for s in self.stop)

    def response_prefix(self, ids: list[int]) -> list[int]:
        """The tokens a generation with the stop strings and `max_new_tokens` would have kept."""
        for k in range(1, min(len(ids), self.max_new_tokens) + 1):
            if self.stopped(ids[:k]):
                return ids[:k]
        return ids[: self.max_new_tokens]


@dataclasses.dataclass
class _Queued:
    """A batch's rows after their first step, waiting to be continued (`_Decoder.admit`)."""

    first: list[int]  # each row's first token
    cache: Any  # the prompts' KV cache, (rows, ..., P, ...)
    mask: torch.Tensor  # (rows, P) 1 where a column holds a real token
    position_ids: torch.Tensor  # (rows, P) each column's position
    limits: list[tuple[int, bool, bool]]  # per row: (token limit, stop at the stop strings, answer continuation)


class _Row:
    """One prompt's continuation: the tokens so far, where it stops, and the result it fills."""

    __slots__ = ("step", "index", "going", "limit", "stop", "answer", "tokens")

    def __init__(self, step: FirstStep, index: int, going: set[int], limit: int, stop: bool, answer: bool) -> None:
        self.step, self.index, self.going = step, index, going
        self.limit, self.stop, self.answer = limit, stop, answer
        self.tokens: list[int] = []


def _plain(cache) -> bool:
    """Whether every layer of `cache` is a plain growing layer, whose rows may be padded and merged."""
    from transformers.cache_utils import DynamicLayer

    return getattr(cache, "evalkit_state", None) is None and all(type(layer) is DynamicLayer for layer in cache.layers)


def _pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """`t` with `n` zero columns put before dimension `dim`'s first."""
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class _Decoder:
    """Greedy continuations of rows from any number of batches, one forward a step for all of them.

    A batch's rows join with their prompt cache after their first step. Where both caches are plain
    (`_plain`, and the policy allows: `_Engine.policy_merges`) the rows join those already going: the
    shorter side is left-padded with masked columns, and since every row has its own positions, key
    mask and cache rows, a row reads only its own keys whatever it is batched with. Columns that are
    padding for every row are cut off as rows leave. Where caches cannot merge, the rows going are
    finished first. A row finished fills its `FirstStep` (`response_ids`, and `answer_ids` for an
    answer continuation) and leaves its submission's set of rows going."""

    def __init__(self, engine: _Engine) -> None:
        self.engine = engine
        self.rows: list[_Row] = []
        self.cache: Any = None
        self.mask = self.last_pos = self.tokens = torch.empty(0)
        self.key_pos: torch.Tensor | None = None

    def admit(self, rows: list[_Row], queued: _Queued) -> None:
        """Take in a batch's rows (`rows[j]` is row j of `queued`); those that end at their first token
        finish at once."""
        eng = self.engine
        keep = [j for j, (row, token) in enumerate(zip(rows, queued.first)) if self.accept(row, token)]
        cache, mask, positions = queued.cache, queued.mask, queued.position_ids
        queued.cache = None  # merged below or taken whole: no second reference
        if not keep:
            return
        if len(keep) < len(rows):
            index = torch.tensor(keep, dtype=torch.long, device=eng.device)
            cache.batch_select_indices(index)
            mask, positions = mask[index], positions[index]
        tokens = torch.tensor([queued.first[j] for j in keep], dtype=torch.long, device=eng.device)
        last_pos = positions[:, -1]
        key_pos = positions if eng.policy.evicts else None  # each key column's position, read by the policy
        for j in keep:
            rows[j].going.add(rows[j].index)
        if self.rows and not (eng.policy_merges and _plain(self.cache) and _plain(cache)):
            self.run(0)
        if not self.rows:
            self.cache, self.mask, self.last_pos, self.key_pos, self.tokens = cache, mask, last_pos, key_pos, tokens
            self.rows = [rows[j] for j in keep]
            return
        width = max(self.mask.shape[1], mask.shape[1])
        old, new = width - self.mask.shape[1], width - mask.shape[1]
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, old, -2), _pad_left(theirs.keys, new, -2)])
            mine.values = torch.cat([_pad_left(mine.values, old, -2), _pad_left(theirs.values, new, -2)])
        self.mask = torch.cat([_pad_left(self.mask, old, 1), _pad_left(mask, new, 1)])
        if key_pos is not None and self.key_pos is not None:
            self.key_pos = torch.cat([_pad_left(self.key_pos, old, 1), _pad_left(key_pos, new, 1)])
        self.last_pos = torch.cat([self.last_pos, last_pos])
        self.tokens = torch.cat([self.tokens, tokens])
        self.rows += [rows[j] for j in keep]

    def run(self, keep: int) -> None:
        """Step while more than `keep` rows are going."""
        while len(self.rows) > keep:
            self.step()

    def fit(self, positions: int) -> None:
        """Step while the rows going hold more than `positions` cache columns in all (rows x width)."""
        while self.rows and len(self.rows) * self.mask.shape[1] > positions:
            self.step()

    def step(self) -> None:
        """Feed every row its last token and append its greedy next one; rows that end leave."""
        eng = self.engine
        eng.progress(f"decode ({len(self.rows)} rows)", 1.0)
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=-1)
        self.last_pos = self.last_pos + 1
        attn = self.mask
        if self.key_pos is not None:  # each row reads the keys the policy keeps at its position
            self.key_pos = torch.cat([self.key_pos, self.last_pos.unsqueeze(-1)], dim=-1)
            attn = eng.policy_mask(self.last_pos.unsqueeze(-1), self.key_pos, self.mask)
        logits, self.cache = eng.forward(self.tokens.unsqueeze(-1), attn, self.last_pos.unsqueeze(-1), self.cache,
                                         last_only=True)
        tokens = torch.argmax(logits[:, -1, :], dim=-1)
        going = [self.accept(row, token) for row, token in zip(self.rows, tokens.tolist())]
        if all(going):
            self.tokens = tokens
            return
        keep = [j for j, g in enumerate(going) if g]
        self.rows = [self.rows[j] for j in keep]
        if not keep:
            self.cache = None
            return
        index = torch.tensor(keep, dtype=torch.long, device=eng.device)
        self.cache.batch_select_indices(index)
        self.mask, self.last_pos, self.tokens = self.mask[index], self.last_pos[index], tokens[index]
        if self.key_pos is not None:
            self.key_pos = self.key_pos[index]
        if _plain(self.cache):  # columns no row reads any more
            cut = int(self.mask.any(0).int().argmax())
            if cut:
                for layer in self.cache.layers:
                    layer.keys, layer.values = layer.keys[..., cut:, :], layer.values[..., cut:, :]
                self.mask = self.mask[:, cut:]
                if self.key_pos is not None:
                    self.key_pos = self.key_pos[:, cut:]

    def accept(self, row: _Row, token: int) -> bool:
        """Append `token` to the row; True while it goes on, else fill its result and let it go."""
        eng = self.engine
        if eng.accept(row.tokens, token, row.limit, row.stop):
            return True
        if row.answer:
            row.step.answer_ids = row.tokens
            row.step.response_ids = eng.response_prefix(row.tokens)
        else:
            row.step.response_ids = row.tokens
        row.going.discard(row.index)
        return False
