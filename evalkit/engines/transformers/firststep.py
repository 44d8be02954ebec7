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

The engine is one module per job. This one: `probe`, the `Prober` (prompts cut into batches, each
batch's results handed back, its continuation queued) and `_Engine.run_batch` (one batch's first step
read off, the first token chosen). Beside it: `prefill` (the forwards, the KV-cache policy's masks, the
shared head, the head applied apart), `trie` (the candidate trie and first units), `decoder` (the
continuations stepped together) and `shared` (the settings and token rules all of them read).

None of the batching moves a number beyond float reassociation: `tests/test_engine_equivalence.py`
holds every field to the pre-speed-work engine (`tests/reference_engine.py`) within 1e-4 nats.

Does not: import lm-eval, store anything, apply chat templates, normalise or cut text
(stop strings only stop generation; cutting the text before them is the caller's job).
Other tokenisations of a candidate string than its tokenisation in context are not
counted in its probability.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from evalkit.defaults import BATCH_TOKENS, DEFAULT_BATCH_SIZE, DEFAULT_TOP_K
from evalkit.engines import firstchar
from evalkit.engines.firststep import (  # noqa: F401  (first_ids, top_mass, topk_dict, ...: read off probe's results)
    SEED_STRIDE,
    UNIT_RANKS,
    UNIT_TOKENS,
    FirstStep,
    candidate_ids,
    first_ids,
    first_unit_ids,
    top_mass,
    topk_dict,
)
from evalkit.prompts.encoding import encode
from evalkit.engines.kvpolicy import KVPolicy
from evalkit.engines.transformers.decoder import _Decoder, _Queued, _Row
from evalkit.engines.transformers.prefill import _read_attention
from evalkit.engines.transformers.shared import PREFILL_SHARE
from evalkit.engines.transformers.trie import LSE_ROWS, TRIE_POSITIONS, _rows_of, _Trie, _truncate_cache


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
    tolerance: float = 0.0,
    exact_candidates: list[list[str]] | None = None,
    attention: list[Any] | None = None,
    answer_tokens: Sequence[int] | None = None,
    kv_policy: KVPolicy | None = None,
    unit_ranks: int = 0,
    batch_tokens: int = BATCH_TOKENS,
    progress: Callable[[str, float], None] | None = None,
    first_char: bool | None = None,
    lead_space: bool = False,
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

    `first_char` (default: `_Engine.first_char`, off) fills each step's `first_chars`: the first-character distribution over the
    whole vocabulary (`firstchar.first_chars`), its whitespace and fragment prefixes teacher-forced over
    the prompt's cache within `tolerance`.

    `lead_space` makes each candidate's probability that of the event its text twin tests (docs/metrics.md
    "One event for text and probability"): the response, after any leading whitespace, begins with it —
    summed over its distinct token paths (`engines.leadspace`: ω + candidate for the vocabulary's leading
    whitespace strings ω, and the same after each first whitespace-only token the tolerance keeps),
    `candidate_paths` and `path_probs` holding them. False (the default) scores the string right after the
    prompt only, as the reference engine (`tests/reference_engine.py`) does.

    `progress(phase, fraction)` is told, as the work goes, what runs now ("prefill", "candidate trie",
    "decode (40 rows)") and the share of all `contexts` done, in [0, 1]: a bar moves within a batch.
    """
    prober = Prober(model, tokenizer, top_k=top_k, max_new_tokens=max_new_tokens, stop=stop, batch_size=batch_size,
                    first_temperature=first_temperature, tolerance=tolerance,
                    kv_policy=kv_policy, unit_ranks=unit_ranks, batch_tokens=batch_tokens, first_char=first_char,
                    lead_space=lead_space)
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
                 first_temperature: float | None = None,
                 tolerance: float = 0.0, kv_policy: KVPolicy | None = None, unit_ranks: int = 0,
                 batch_tokens: int = BATCH_TOKENS, trie_positions: int = TRIE_POSITIONS,
                 first_char: bool | None = None, lead_space: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1, got {batch_tokens}")
        if trie_positions < 1:
            raise ValueError(f"trie_positions must be >= 1, got {trie_positions}")
        if not 0 <= tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
        self.batch_size, self.batch_tokens = batch_size, batch_tokens
        self.engine = _Engine(model, tokenizer, top_k, max_new_tokens, stop, first_temperature, frozenset(), 0,
                              tolerance, kv_policy, unit_ranks, None)
        self.engine.trie_positions = trie_positions
        if first_char is not None:
            self.engine.first_char = first_char
        self.engine.lead_space = lead_space
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
        context_ids = [encode(engine.tokenizer, c) for c in contexts]
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


class _Engine(_Trie):
    """One probe call's engine: one batch's prefill, its first step read off, its candidate trie scored, its
    first tokens chosen; the continuation is handed to the decoder (`_Decoder`)."""

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
            levels = None
            if self.lead_space and any(toks_of):  # each candidate's whitespace-led paths (`whitespace_paths`)
                trie_of, paths_of, exact_paths, levels = self.whitespace_paths(
                    contexts, ids_list, [list(t) for t in toks_of], exact_sets, logprobs, cache, mask)
                scored, units = self.score_nodes(trie_of, unit_tops, cache, mask, logprobs, exact_paths,
                                                 budgets=[lv.budget for lv in levels])
            else:
                scored, units = self.score_nodes(toks_of, unit_tops, cache, mask, logprobs, exact_sets)
            for r, step in enumerate(steps):
                probs, unscored, positions, unit_fed = scored[r]
                if levels is not None:
                    step.candidate_paths, step.path_probs = paths_of[r], probs
                    step.candidate_probs = {c: sum(probs[p] for p in paths_of[r][c]) for c in dict.fromkeys(cand_lists[r])}
                    unscored += levels[r].unscored
                    positions += len(levels[r].nodes)
                else:
                    step.candidate_probs = {c: probs[c] for c in dict.fromkeys(cand_lists[r])}
                step.unscored_mass, step.candidate_positions, step.unit_positions = unscored, positions, unit_fed
                step.candidate_tokens = toks_of[r]
                if self.unit_ranks:
                    step.units = units[r]

        if self.first_char:
            self.progress("first characters", PREFILL_SHARE)
            for step, chars in zip(steps, self.first_chars(logprobs, cache, mask)):
                step.first_chars = chars
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

    first_char: bool = False  # read each prompt's first-character distribution (`firstchar`, opt-in); `Prober` sets it

    def first_chars(self, logprobs: torch.Tensor, cache, mask) -> list[firstchar.FirstChars]:
        """Each row's first-character distribution (`firstchar.first_chars`), its whitespace and fragment
        prefixes teacher-forced over the prompt's cache as the trie's nodes are (`forward_nodes`), on a copy
        of the rows that need any (the whole cache, cropped back after, under a rounded cache policy)."""
        B, P = mask.shape
        table = firstchar.char_table(self.tokenizer)
        held: dict[str, Any] = {"rows": None, "slot": {}, "used": 0}

        def forward(nodes):
            if held["rows"] is None:
                rows = sorted({r for r, _ in nodes})
                whole = len(rows) == B or self.policy.rounds
                held["rows"] = list(range(B)) if whole else rows
                held["cache"] = cache if whole else _rows_of(cache, torch.tensor(rows, device=self.device))
                held["mask"] = mask if whole else mask[rows]
                held["whole"] = whole
            rows = held["rows"]
            place = {r: j for j, r in enumerate(rows)}
            depth = len(nodes[0][1])
            per_row: dict[int, list[int]] = {}
            for i, (r, _) in enumerate(nodes):
                per_row.setdefault(r, []).append(i)
            width = max(1, self.trie_positions // len(rows))  # a forward's padded positions stay bounded
            out = torch.empty((len(nodes), logprobs.shape[-1]), dtype=torch.float32)
            for begin in range(0, max(len(v) for v in per_row.values()), width):
                level: list[list[tuple[int, ...]]] = [[] for _ in rows]
                reads = []
                for r, idx in per_row.items():
                    for q, i in enumerate(idx[begin:begin + width]):
                        level[place[r]].append((r, *nodes[i][1]))
                        reads.append((place[r], q, i))
                if not reads:
                    continue
                n_real = held["mask"].sum(-1).tolist()
                got, held["used"] = self.forward_nodes(level, depth, held["slot"], held["used"], held["cache"],
                                                       held["mask"], n_real)
                for c in range(0, len(reads), LSE_ROWS):
                    chunk = reads[c:c + LSE_ROWS]
                    jj, qq = (torch.tensor([x[k] for x in chunk], device=got.device) for k in (0, 1))
                    logits = (self.split[1](got[jj, qq]) if self.split is not None else got[jj, qq]).float()
                    out[torch.tensor([x[2] for x in chunk])] = torch.log_softmax(logits, dim=-1).cpu()
            return out

        state = getattr(cache, "evalkit_state", None)
        if state is not None:  # the prefixes are alternatives, never a sequence: no residual flush
            state["hold"] = True
        try:
            return firstchar.first_chars(table, logprobs, forward, self.tolerance)
        finally:
            if state is not None:
                state["hold"] = False
            if held.get("whole") and held["used"]:
                _truncate_cache(cache, P)

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
