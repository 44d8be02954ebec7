"""The reference first-step engine: evalkit's engine as it was before the speed work, kept to test against.

`tests/test_engine_equivalence.py` and `bench/phases.py` run it beside `evalkit.engines.transformers.firststep` on the same
prompts: every prompt prefilled with left padding, the candidate trie padded per level to the batch's
widest row, the first units in forwards of their own, candidates tokenised after the whole context.
Nothing in evalkit imports it. What follows is its docstring as it was:

The exact first-step engine: one prefill, and everything evalkit reads off the first step.

Owns, for a batch of already-templated prompts on a Hugging Face causal LM:
- one batched prefill (left padding, explicit position ids, KV cache kept) giving the
  full-vocabulary first-step distribution: top-k, entropy, float32 log-softmax;
- candidate-string probabilities (docs/metrics.md §1.1 `ft_hit_prob`): P(response starts with a
  string) as the product of its tokens' teacher-forced conditional probabilities,
  the string tokenised in its real context; one extra batched forward per prompt over
  all its candidates, reusing a copy of the prompt's KV cache;
- a greedy continuation from the same cache, with first-step interventions (banned
  first tokens, a sampled first token at a given temperature);
- pure helpers on the results: `top_mass`, `topk_dict`, `first_unit_ids`.

Does not: import lm-eval, store anything, apply chat templates, normalise or cut text
(stop strings only stop generation; cutting the text before them is the caller's job).
Other tokenisations of a candidate string than its tokenisation in context are not
counted in its probability.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from evalkit.engines.kvpolicy import FULL, KVPolicy
from evalkit.engines.transformers.kvcache import new_cache
from evalkit.defaults import BATCH_TOKENS
from evalkit.defaults import DEFAULT_BATCH_SIZE, DEFAULT_TOP_K

_SEED_STRIDE = 1_000_003


@dataclass
class FirstStep:
    """What one prompt's first step looked like, and what the model went on to say."""

    context_ids: list[int]  # prompt tokens (no padding)
    topk_ids: list[int]  # k most likely first tokens, descending
    topk_logprobs: list[float]  # natural-log probabilities, same order
    entropy: float  # full-vocabulary entropy in nats
    logprobs: torch.Tensor  # (V,) float32 log-softmax of the first step
    candidate_probs: dict[str, float] = field(default_factory=dict)  # candidate -> P(response starts with it)
    candidate_tokens: dict[str, list[int]] = field(default_factory=dict)  # candidate -> its tokens in context
    unscored_mass: float = 0.0  # bound on how much any sum of candidate_probs falls short (<= tolerance)
    candidate_positions: int = 0  # trie nodes teacher-forced for this prompt
    response_ids: list[int] = field(default_factory=list)  # generated tokens, stop/eos excluded
    answer_ids: list[int] = field(default_factory=list)  # the longer continuation asked for (answer_tokens), eos excluded
    units: dict[int, str] = field(default_factory=dict)  # top token id -> its first unit (unit_ranks)
    first_token_id: int = -1  # the token chosen at step 1 (== response_ids[0] unless it was eos)
    attention: Any = None  # attention.PromptAttention of the prefill, when asked for (`probe(attention=...)`)


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
    "decode 12/48") and the share of all `contexts` done, in [0, 1]: a bar moves within a batch.
    """
    if candidates is not None and len(candidates) != len(contexts):
        raise ValueError(f"{len(candidates)} candidate lists for {len(contexts)} contexts")
    if exact_candidates is not None and len(exact_candidates) != len(contexts):
        raise ValueError(f"{len(exact_candidates)} exact candidate lists for {len(contexts)} contexts")
    if attention is not None and len(attention) != len(contexts):
        raise ValueError(f"{len(attention)} attention requests for {len(contexts)} contexts")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if batch_tokens < 1:
        raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    if answer_tokens is not None and len(answer_tokens) != len(contexts):
        raise ValueError(f"{len(answer_tokens)} answer lengths for {len(contexts)} contexts")
    if not contexts:
        return []
    context_ids = [_encode(tokenizer, c, add_special_tokens) for c in contexts]
    for i, ids in enumerate(context_ids):
        if not ids:
            raise ValueError(f"context {i} tokenises to no tokens; nothing to predict from")
    engine = _Engine(model, tokenizer, top_k, max_new_tokens, stop, first_temperature,
                     banned_first_ids, seed, add_special_tokens, tolerance, kv_policy, unit_ranks, attention)
    # longest first, so a batch holds prompts of similar length (little padding)
    order = sorted(range(len(contexts)), key=lambda i: (-len(context_ids[i]), i))
    results: list[FirstStep | None] = [None] * len(contexts)
    done = 0
    with torch.inference_mode():
        for rows in _batches(order, [len(ids) for ids in context_ids], batch_size, batch_tokens):
            if progress is not None:
                engine.progress = functools.partial(_tell, progress, done, len(rows), len(contexts))
            done += len(rows)
            steps = engine.run_batch(
                rows,
                [contexts[i] for i in rows],
                [context_ids[i] for i in rows],
                [list(candidates[i]) if candidates is not None else [] for i in rows],
                [set(exact_candidates[i]) if exact_candidates is not None else set() for i in rows],
                [int(answer_tokens[i]) if answer_tokens is not None else 0 for i in rows],
            )
            for i, step in zip(rows, steps):
                results[i] = step
    return results  # type: ignore[return-value]  # every row was filled


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


def candidate_ids(
    tokenizer,
    context: str,
    candidate: str,
    context_ids: list[int] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """The candidate's tokens in its real context: ids(context + candidate) past ids(context).

    When the joint tokenisation does not start with the context's own tokens (a merge
    across the boundary), the candidate is tokenised alone instead.
    """
    if context_ids is None:
        context_ids = _encode(tokenizer, context, add_special_tokens)
    joint = _encode(tokenizer, context + candidate, add_special_tokens)
    n = len(context_ids)
    if len(joint) > n and joint[:n] == context_ids:
        return joint[n:]
    return _encode(tokenizer, candidate, False)


def first_ids(tokenizer, context: str, strings: Iterable[str]) -> set[int]:
    """The first token of each string tokenised in context (`candidate_ids`): the token a
    strict, token-level hit must start with (docs/metrics.md §1.1 `ft_token_hit`)."""
    return {ids[0] for s in strings if (ids := candidate_ids(tokenizer, context, s))}


def top_mass(logprobs: torch.Tensor, k: int = 3, temperature: float = 1.0) -> float:
    """Probability mass of the k most likely tokens of softmax(logits / temperature).

    `logprobs` may be logits or log-probabilities: log_softmax(logits) / T renormalised
    equals logits / T renormalised. Temperature 0 means argmax (mass 1).

    >>> lp = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.1]))
    >>> round(top_mass(lp, k=3), 4)
    0.9
    >>> round(top_mass(lp, k=1, temperature=0.5), 4)  # 0.25 / (0.25 + 0.09 + 0.01 + 0.01)
    0.6944
    >>> top_mass(torch.tensor([]))
    0.0
    """
    if logprobs.numel() == 0 or k <= 0:
        return 0.0
    if temperature <= 0:
        return 1.0
    probs = torch.softmax(logprobs.detach().float().reshape(-1) / temperature, dim=-1)
    return float(torch.topk(probs, min(k, probs.numel())).values.sum())


def topk_dict(step: FirstStep, k: int) -> dict[int, float]:
    """The step's k most likely first tokens as `token_id -> logprob`, most likely first.

    >>> s = FirstStep([5], [17, 4, 9], [-0.1, -2.3, -4.0], 0.5, torch.zeros(0))
    >>> topk_dict(s, 2)
    {17: -0.1, 4: -2.3}
    >>> topk_dict(s, 0)
    {}
    """
    if k <= 0:
        return {}
    return dict(zip(step.topk_ids[:k], step.topk_logprobs[:k]))


def first_unit_ids(decode: Callable[[list[int]], str], ids: Sequence[int]) -> tuple[str, int]:
    """The first unit (docs/metrics.md §1.0): shortest prefix of `ids` whose text is whole.

    Whole: at least one non-whitespace character and no U+FFFD (a split UTF-8 character
    or byte-fallback token decodes to one until its last byte arrives). Returns the
    prefix's text, stripped, and its length in tokens; ("", len(ids)) if none qualifies.

    >>> pieces = {1: b" ", 2: b"\\xe9", 3: b"\\x80\\x92", 4: b"x"}  # "递" = e9 80 92
    >>> decode = lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", "replace")
    >>> first_unit_ids(decode, [1, 2, 3, 4])
    ('递', 3)
    >>> first_unit_ids(decode, [1, 2])
    ('', 2)
    >>> first_unit_ids(decode, [])
    ('', 0)
    """
    ids = list(ids)
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        if "\ufffd" not in text and text.strip():
            return text.strip(), n
    return "", len(ids)


# --- internals -------------------------------------------------------------------

UNIT_RANKS = 10  # the likeliest first tokens whose first unit a run stores (first_token_topk.unit)
UNIT_TOKENS = 4  # a first unit is completed over at most this many tokens (a UTF-8 character has <= 4 bytes)


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


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

    def forward(self, input_ids, attention_mask, position_ids, cache=None, last_only=False):
        """Model forward with a cache kept: (logits, cache)."""
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
        new_cache = getattr(out, "cache", None)
        if new_cache is None:
            new_cache = getattr(out, "past_key_values", None)
        return out.logits, new_cache

    def run_batch(self, indices, contexts, ids_list, cand_lists, exact_sets=None, answer_lens=None) -> list[FirstStep]:
        """Prefill one batch together; `indices` are the prompts' places in `contexts` (seeds)."""
        B, P = len(ids_list), max(len(ids) for ids in ids_list)
        input_ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        mask = torch.zeros((B, P), dtype=torch.long)
        for r, ids in enumerate(ids_list):
            input_ids[r, P - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[r, P - len(ids) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = new_cache(self.policy, self.model, [P - len(ids) for ids in ids_list]) if self.policy.rounds else None
        attn = mask
        if self.policy.evicts:  # a query at position t reads only the keys the policy keeps at t
            eye = torch.eye(P, dtype=torch.bool, device=self.device).unsqueeze(0)  # padding rows read themselves
            attn = self.policy_mask(position_ids, position_ids, mask, also=eye)
        with _read_attention(self.attention, indices, [P - len(ids) for ids in ids_list], P) as seen:
            logits, cache = self.forward(input_ids, attn, position_ids, cache=cache, last_only=True)
        logprobs = torch.log_softmax(logits[:, -1, :].float(), dim=-1)  # (B, V)
        self.progress("prefill done", PREFILL_SHARE)

        steps = []
        k = max(0, min(self.top_k, logprobs.shape[-1]))
        top = torch.topk(logprobs, k, dim=-1)
        entropy = torch.special.entr(logprobs.exp()).sum(-1)
        for r in range(B):
            steps.append(FirstStep(
                context_ids=list(ids_list[r]),
                topk_ids=top.indices[r].tolist(),
                topk_logprobs=top.values[r].tolist(),
                entropy=float(entropy[r]),
                logprobs=logprobs[r].detach().cpu().clone(),
            ))
        if seen is not None:
            for step, read in zip(steps, seen.results()):
                step.attention = read
        if any(cand_lists):
            self.progress("candidate trie", PREFILL_SHARE)
            scored = self.candidate_probs(contexts, ids_list, cand_lists, cache, mask, logprobs, exact_sets)
            for step, (probs, unscored, positions, tokens) in zip(steps, scored):
                step.candidate_probs, step.unscored_mass, step.candidate_positions = probs, unscored, positions
                step.candidate_tokens = tokens
        if self.unit_ranks:
            ranks = min(self.unit_ranks, k)
            for step, units in zip(steps, self.complete_units(cache, mask, [s.topk_ids[:ranks] for s in steps])):
                step.units = units

        first = torch.tensor([self.first_token(logprobs[r], indices[r]) for r in range(B)])
        for r in range(B):
            steps[r].first_token_id = int(first[r])
        self.progress("decode", FIRST_STEP_SHARE)
        answer_lens = list(answer_lens or [0] * B)
        if self.max_new_tokens > 0 or any(answer_lens):
            limits = [max(self.max_new_tokens, n) for n in answer_lens]
            responses = self.generate(first.to(self.device), cache, mask, position_ids[:, -1], limits,
                                      [n == 0 for n in answer_lens], position_ids)
            for r in range(B):
                if answer_lens[r]:
                    steps[r].answer_ids = responses[r]
                    steps[r].response_ids = self.response_prefix(responses[r])
                else:
                    steps[r].response_ids = responses[r]
        self.progress("batch done", 1.0)
        return steps

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

    def candidate_probs(self, contexts, ids_list, cand_lists, cache, mask, logprobs, exact_sets=None):
        """Per prompt of the prefilled batch: ({candidate: P(response starts with it)},
        unscored mass, trie positions forwarded, {candidate: its tokens in context}).

        Teacher forcing over the token trie of each prompt's candidates, one trie level
        per forward for the whole batch. The level's nodes (proper prefixes of some
        candidate) are packed side by side after the prompt in the batch's own KV cache,
        each attending to its prompt and its ancestors only (a custom 4-D mask), so
        shared prefixes are fed once and the cache is never copied. The cache is cropped
        back to the prompt afterwards. Before each level, a prompt's least likely new
        prefixes are left out while their total probability fits in what is left of
        its `tolerance` (see `probe`); prefixes of the prompt's exact candidates never are.
        """
        B, P = mask.shape
        state = getattr(cache, "evalkit_state", None)
        if state is not None:  # trie nodes are alternatives, never a sequence: no residual flush
            state["hold"] = True
        toks_of: list[dict[str, list[int]]] = []
        for r in range(B):
            toks_of.append({
                c: candidate_ids(self.tokenizer, contexts[r], c, ids_list[r], self.add_special_tokens)
                for c in dict.fromkeys(cand_lists[r])
            })
        kept: set[tuple[int, ...]] = set()  # prefixes of exact candidates: always forced
        for r in range(B):
            for c in (exact_sets[r] if exact_sets else ()):
                tk = toks_of[r].get(c, [])
                kept.update((r, *tk[:d]) for d in range(1, len(tk)))
        node_lp: dict[tuple[int, ...], torch.Tensor] = {(r,): logprobs[r] for r in range(B)}  # (row, *prefix) -> (V,)
        node_sum: dict[tuple[int, ...], float] = {(r,): 0.0 for r in range(B)}  # log P(prefix)
        slot: dict[tuple[int, ...], int] = {}  # node -> its column after the prompt
        budget = [self.tolerance] * B  # probability each prompt may still leave unscored
        positions = [0] * B
        used = 0  # extension columns so far (the same for every row; short rows are padded)
        depth_max = max((len(tk) for d in toks_of for tk in d.values()), default=0) - 1
        try:
            for depth in range(1, depth_max + 1):
                level: list[list[tuple[int, ...]]] = [[] for _ in range(B)]
                for r in range(B):
                    fresh = []
                    for tk in toks_of[r].values():
                        if len(tk) <= depth:
                            continue
                        node, parent = (r, *tk[:depth]), (r, *tk[: depth - 1])
                        if parent not in node_lp or node in node_sum:
                            continue  # parent left out, or node already queued
                        node_sum[node] = node_sum[parent] + float(node_lp[parent][node[-1]])
                        fresh.append(node)
                    fresh.sort(key=lambda n: (node_sum[n], n))
                    for j, node in enumerate(fresh):
                        if node in kept:
                            level[r].append(node)
                            continue
                        p = math.exp(node_sum[node])
                        if p > budget[r]:  # this one and every likelier one is scored
                            level[r] += fresh[j:]
                            break
                        budget[r] -= p
                if not any(level):
                    break
                for r, nodes in enumerate(level):
                    positions[r] += len(nodes)
                lp, used = self.forward_nodes(level, depth, slot, used, cache, mask)
                for r, nodes in enumerate(level):
                    for j, node in enumerate(nodes):
                        node_lp[node] = lp[r, j]
        finally:
            if used:
                _truncate_cache(cache, P)
            if state is not None:
                state["hold"] = False
        out = []
        for r in range(B):
            probs = {}
            for cand, tk in toks_of[r].items():
                if not tk:
                    probs[cand] = 1.0
                    continue
                last = (r, *tk[:-1])
                if last not in node_lp:  # under a prefix left out: counted in the unscored mass
                    probs[cand] = 0.0
                    continue
                probs[cand] = math.exp(node_sum[last] + float(node_lp[last][tk[-1]]))
            out.append(({c: probs[c] for c in dict.fromkeys(cand_lists[r])}, self.tolerance - budget[r], positions[r],
                        toks_of[r]))
        return out

    def forward_nodes(self, level, depth: int, slot: dict, used: int, cache, mask):
        """Forward one level of token trees packed after the prompts: (log-probs (B, Q, V), columns used).

        `level[r]` holds row r's nodes `(r, t0, ..., t{depth-1})`, each fed its last token at
        position n_real + depth - 1 and attending to its prompt and its ancestors (whose
        columns after the prompt `slot` records; the level's own columns are added to it),
        under the KV-cache policy. The nodes are alternatives: the caller crops the cache back
        to the prompt when its trees are done."""
        B, P = mask.shape
        n_real = mask.sum(-1).tolist()
        evicts = self.policy.evicts
        Q = max(len(nodes) for nodes in level)
        inp = torch.full((B, Q), self.pad_id, dtype=torch.long)
        pos = torch.zeros((B, Q), dtype=torch.long)
        allow = torch.zeros((B, Q, P + used + Q), dtype=torch.bool)
        allow[:, :, :P] = mask.bool().cpu().unsqueeze(1)
        for r, nodes in enumerate(level):
            for j, node in enumerate(nodes):
                inp[r, j] = node[-1]
                pos[r, j] = n_real[r] + depth - 1
                for k in range(2, len(node)):  # ancestors (row, t0), (row, t0, t1), ...
                    # the ancestor node[:k] sits at position n_real + k - 2
                    if not evicts or self.policy.visible(n_real[r] + depth - 1, n_real[r] + k - 2):
                        allow[r, j, P + slot[node[:k]]] = True
                allow[r, j, P + used + j] = True
                slot[node] = used + j
        if evicts:  # each node reads the prompt keys the policy keeps at its position
            prompt_pos = ((mask.cumsum(-1) - 1).clamp(min=0)).cpu()
            allow[:, :, :P] &= self.policy.visible(pos[:, :, None], prompt_pos[:, None, :])
        neg = torch.finfo(self.float_dtype).min
        attn = torch.zeros(allow.shape, dtype=self.float_dtype).masked_fill(~allow, neg).unsqueeze(1)
        logits, _ = self.forward(inp.to(self.device), attn.to(self.device), pos.to(self.device), cache=cache)
        return torch.log_softmax(logits.float(), dim=-1), used + Q  # (B, Q, V)

    def complete_units(self, cache, mask, top_ids: list[list[int]]) -> list[dict[int, str]]:
        """Per prompt: {token id: its first unit} for the tokens of `top_ids[r]` that hold no
        whole character alone (a byte of a split character, a bare space or newline).

        The unit is docs/metrics.md's first unit of the greedy continuation after that token
        (`first_unit_ids`), read from the prefilled cache one level of all rows' unfinished
        tokens per forward, at most UNIT_TOKENS tokens deep; "" when none is whole by then.
        Tokens that are whole alone map to their own stripped text. The cache is cropped back."""
        B, P = mask.shape
        decode = self.decode
        out: list[dict[int, str]] = [{} for _ in range(B)]
        open_: list[list[tuple[int, ...]]] = [[] for _ in range(B)]
        for r, ids in enumerate(top_ids):
            for t in ids:
                unit, n = first_unit_ids(decode, [t])
                if unit:
                    out[r][t] = unit
                else:
                    open_[r].append((r, t))
        state = getattr(cache, "evalkit_state", None)
        if state is not None:
            state["hold"] = True
        slot: dict[tuple[int, ...], int] = {}
        used = 0
        try:
            for depth in range(1, UNIT_TOKENS):
                if not any(open_):
                    break
                lp, used = self.forward_nodes(open_, depth, slot, used, cache, mask)
                nxt: list[list[tuple[int, ...]]] = [[] for _ in range(B)]
                for r, nodes in enumerate(open_):
                    for j, node in enumerate(nodes):
                        child = (*node, int(torch.argmax(lp[r, j])))
                        unit, _ = first_unit_ids(decode, list(child[1:]))
                        if unit or child[-1] in self.eos:
                            out[r][node[1]] = unit
                        else:
                            nxt[r].append(child)
                open_ = nxt
        finally:
            if used:
                _truncate_cache(cache, P)
            if state is not None:
                state["hold"] = False
        for nodes in open_:
            for node in nodes:
                out[node[0]][node[1]] = ""
        return out

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
        generator = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + index)
        probs = torch.softmax(lp.float().cpu() / T, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    def generate(self, first: torch.Tensor, cache, mask, last_pos, limits: list[int],
                 stops: list[bool], key_pos=None) -> list[list[int]]:
        """Greedy continuation of each row after its step-1 token, row r up to `limits[r]` tokens
        (and its stop strings, where `stops[r]`); rows finish independently.

        Mutates `cache` (finished rows are dropped from it with `batch_select_indices`).
        `key_pos` (B, P): the position of each prompt column, read when the policy evicts.
        """
        evicts = self.policy.evicts
        B = first.shape[0]
        responses: list[list[int]] = [[] for _ in range(B)]
        rows = list(range(B))  # batch row of each cache row
        tokens = first  # (len(rows),) last token of each cache row

        def accept(r: int, token: int) -> bool:
            return self.accept(responses[r], token, limits[r], stops[r])

        going = [accept(r, int(t)) for r, t in zip(rows, tokens.tolist())]
        longest, steps = max(limits), 1
        while any(going):
            steps += 1
            self.progress(f"decode {steps}/{longest}",
                          FIRST_STEP_SHARE + (1 - FIRST_STEP_SHARE) * min(1.0, steps / max(longest, 1)))
            if not all(going):
                keep = torch.tensor([j for j, g in enumerate(going) if g], dtype=torch.long, device=self.device)
                cache.batch_select_indices(keep)
                rows = [rows[j] for j in keep.tolist()]
                mask, last_pos, tokens = mask[keep], last_pos[keep], tokens[keep]
                if evicts:
                    key_pos = key_pos[keep]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
            last_pos = last_pos + 1
            attn = mask
            if evicts:
                key_pos = torch.cat([key_pos, last_pos.unsqueeze(-1)], dim=-1)
                attn = self.policy_mask(last_pos.unsqueeze(-1), key_pos, mask)
            logits, cache = self.forward(tokens.unsqueeze(-1), attn, last_pos.unsqueeze(-1), cache, last_only=True)
            tokens = torch.argmax(logits[:, -1, :], dim=-1)
            going = [accept(r, int(t)) for r, t in zip(rows, tokens.tolist())]
        return responses

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
