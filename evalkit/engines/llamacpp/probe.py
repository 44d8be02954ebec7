"""The first step on llama.cpp: `probe`, the engine-level counterpart of `transformers.firststep.probe`.

Owns, over one `LlamaCppEngine`: batches of prompts prefilled together, each in its own sequence; the
first-step distribution, the candidate trie (`_candidate_probs`), the first units of the likeliest first
tokens (`complete_units`), the first token (argmax or a seeded sample, bans applied), the greedy
continuations stepped together; and a prompt frame's content-free prior (`content_free_prior`).
Does not: know lm-eval or tasks (`llamacpp.model` turns these numbers into a `FirstStepResult`).

How the numbers are computed: the prompt is prefilled once into the KV cache; its last
logits give the first-step distribution (log-softmax in float64 over the whole vocabulary);
the candidate strings (accepted answer starts and the opener lexicon), tokenised in their
real context, form a token trie whose proper prefixes are evaluated over the cached prompt
(`LlamaCppEngine.tree`: a batch whose tokens carry several sequences), so `ft_hit_prob` and
`opener_mass` are sums of products of teacher-forced conditional probabilities. With
`tolerance` 0 the whole trie is one batch and exact; the default (evalkit-hf's, 1e-4) leaves out
the least likely opener prefixes level by level, as `transformers.firststep.probe` does: the accepted answers are
always exact, opener_mass falls short by at most the tolerance.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from evalkit.defaults import DEFAULT_BATCH_SIZE, DEFAULT_TOP_K
from evalkit.engines import firststep as shared
from evalkit.engines import leadspace
from evalkit.engines.llamacpp.firststep import SEQ_MAX, LlamaCppEngine, log_softmax
from evalkit.engines.llamacpp.tokenizer import tokenizer_of
from evalkit.prompts.encoding import encode

K = TypeVar("K", bound=Hashable)  # a candidate trie's key: a string, or a token path (`_lead_space`)
CONTENT_FREE = ("N/A", "", "…", "无")  # as evalkit-hf's content-free prior (Zhao et al. 2021)


def candidate_ids(eng: LlamaCppEngine, context: str, candidate: str, context_ids: list[int]) -> list[int]:
    """The candidate's tokens in its real context: ids(context + candidate) past ids(context);
    tokenised alone when the joint tokenisation merges across the boundary (`firststep.candidate_ids`' rule)."""
    return shared.candidate_ids(tokenizer_of(eng), context, candidate, context_ids)


def _lse(logits: np.ndarray) -> float:
    x = logits.astype(np.float64)
    m = float(x.max())
    return m + math.log(float(np.exp(x - m).sum()))


def probe(eng: LlamaCppEngine, contexts: list[str], candidates: list[list[str]] | None = None, *,
          top_k: int = DEFAULT_TOP_K, max_new_tokens: int = 32, stop: Sequence[str] = (),
          first_temperature: float | None = None, banned_first_ids=frozenset(), seed: int = 0,
          answer_tokens: Sequence[int] | None = None, unit_ranks: int = 0, tolerance: float = 0.0,
          exact_candidates: list[list[str]] | None = None,
          batch_size: int = DEFAULT_BATCH_SIZE, lead_space: bool = False,
          first_char: bool = False) -> list[shared.FirstStep]:
    """`transformers.firststep.probe`'s results for each context, computed by llama.cpp (see the module docstring).

    Same meaning of every argument as `transformers.firststep.probe` (`tolerance`, `exact_candidates`: the
    prefixes left out of the candidate trie, `_candidate_probs`). Up to `batch_size` prompts share
    the KV cache, each in its own sequence (at most half the context's cells in all): one prefill
    for all of them, then each prompt's trie over its own cached prompt, then their greedy
    continuations stepped together, one llama_decode a token for the whole batch. `lead_space`: each
    candidate's whitespace-led paths too (`_lead_space`), as `transformers.firststep.probe`'s.
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    if candidates is not None and len(candidates) != len(contexts):
        raise ValueError(f"{len(candidates)} candidate lists for {len(contexts)} contexts")
    if answer_tokens is not None and len(answer_tokens) != len(contexts):
        raise ValueError(f"{len(answer_tokens)} answer lengths for {len(contexts)} contexts")
    stops = [s for s in stop if s]
    ids_all = [encode(tokenizer_of(eng), c) for c in contexts]
    for i, ids in enumerate(ids_all):
        if not ids:
            raise ValueError(f"context {i} tokenises to no tokens; nothing to predict from")
    out: list[shared.FirstStep] = []
    for rows in _batches([len(ids) for ids in ids_all], batch_size, eng.n_ctx // 2):
        lps = [log_softmax(x) for x in eng.prefill_batch([ids_all[i] for i in rows])]
        steps = []
        for b, (i, lp) in enumerate(zip(rows, lps)):
            ids, context = ids_all[i], contexts[i]
            k = max(0, min(top_k, lp.shape[0]))
            top = np.argsort(-lp, kind="stable")[:k]
            p = np.exp(lp)
            step = shared.FirstStep(
                context_ids=list(ids), topk_ids=[int(t) for t in top], topk_logprobs=[float(lp[t]) for t in top],
                entropy=float(-(p * lp).sum()), logprobs=_as_tensor(lp),
            )
            cands = list(dict.fromkeys(candidates[i])) if candidates is not None else []
            if cands:
                step.candidate_tokens = {c: candidate_ids(eng, context, c, ids) for c in cands}
                exact = set(exact_candidates[i]) if exact_candidates is not None else set()
                if lead_space:
                    _lead_space(eng, step, context, ids, lp, cands, exact, tolerance, seq=b, n_base=len(rows))
                else:
                    step.candidate_probs, step.unscored_mass, step.candidate_positions = _candidate_probs(
                        eng, len(ids), lp, step.candidate_tokens, tolerance, exact, seq=b, n_base=len(rows))
            if unit_ranks:
                step.units = complete_units(eng, len(ids), step.topk_ids[: min(unit_ranks, k)], seq=b,
                                            n_base=len(rows))
            if first_char:
                step.first_chars = first_chars(eng, len(ids), lp, tolerance, seq=b, n_base=len(rows))
            step.first_token_id = first_token(lp, banned_first_ids, first_temperature, seed, i)
            steps.append(step)
        n_answer = [int(answer_tokens[i]) if answer_tokens is not None else 0 for i in rows]
        if max_new_tokens > 0 or any(n_answer):
            def stopper(n):
                return None if n or not stops else (lambda xs: any(s in eng.decode(xs) for s in stops))

            responses = eng.generate_batch([len(ids_all[i]) for i in rows], [s.first_token_id for s in steps],
                                           [max(max_new_tokens, n) for n in n_answer], [stopper(n) for n in n_answer])
            for step, response, n in zip(steps, responses, n_answer):
                if n:
                    step.answer_ids = response
                    step.response_ids = _response_prefix(eng, response, max_new_tokens, stops)
                else:
                    step.response_ids = response
        out.extend(steps)
    return out


def _batches(lengths: list[int], batch_size: int, max_tokens: int) -> list[list[int]]:
    """Prompt indices in order, cut into batches of at most `batch_size` prompts and `max_tokens` tokens
    (a longer prompt goes alone).

    >>> _batches([10, 10, 10, 50], 2, 40)
    [[0, 1], [2], [3]]
    """
    out: list[list[int]] = []
    total = 0
    for i, n in enumerate(lengths):
        if out and len(out[-1]) < batch_size and total + n <= max_tokens:
            out[-1].append(i)
            total += n
        else:
            out.append([i])
            total = n
    return out


def first_chars(eng: LlamaCppEngine, n_prompt: int, lp: np.ndarray, tolerance: float, seq: int = 0,
                n_base: int = 1):
    """The prompt's first-character distribution (`firstchar.first_chars`): its whitespace and fragment
    prefixes teacher-forced over the cached prompt in sequence `seq`, one token tree a level
    (`LlamaCppEngine.tree`, which feeds a level's ancestors again beside it)."""
    import torch

    from evalkit.engines import firstchar
    from evalkit.engines.vocab import vocab_table

    def forward(nodes):
        tree = {p[:d] for _, p in nodes for d in range(1, len(p) + 1)}
        logits = eng.tree(n_prompt, sorted(tree), seq=seq, n_base=n_base, want={p for _, p in nodes})
        return torch.stack([torch.from_numpy(log_softmax(logits[p])) for _, p in nodes])

    table = getattr(eng, "first_char_table", None)  # built once per loaded model
    if table is None:
        table = firstchar.build_char_table(vocab_table(tokenizer_of(eng)))
        setattr(eng, "first_char_table", table)
    return firstchar.first_chars(table, torch.from_numpy(lp.astype(np.float64))[None], forward, tolerance)[0]


def _as_tensor(lp: np.ndarray):
    import torch

    return torch.from_numpy(lp.astype(np.float32))


def _candidate_probs(eng: LlamaCppEngine, n_prompt: int, lp: np.ndarray, tokens: Mapping[K, list[int]],
                     tolerance: float = 0.0, exact: Collection[K] = frozenset(), seq: int = 0,
                     n_base: int = 1) -> tuple[dict[K, float], float, int]:
    """({candidate: P(response starts with it)}, unscored mass, trie positions fed).

    tolerance 0: the trie's proper prefixes in one batch over the cached prompt (exact). tolerance > 0:
    one batch per trie level, and before each level the least likely new prefixes are left out while
    their probabilities add up to at most what is left of `tolerance` — `transformers.firststep.probe`'s rule, so the
    two engines leave out the same share; the prefixes of `exact` candidates never are. Every leaf of
    the whole trie has its sequence from the start (`LlamaCppEngine.levels`), so each level feeds only
    its own prefixes; a trie with more leaves than sequences re-feeds each level's ancestors instead.
    """
    nodes = {tuple(tk[:d]) for tk in tokens.values() for d in range(1, len(tk))}
    # node -> {child token: log P(child | node)} for the children some candidate goes on with: a whole row
    # of logits is n_vocab floats (1 MB on a 262k vocabulary), kept only while its level is read
    children: dict[tuple[int, ...], set[int]] = {}
    for tk in tokens.values():
        for d in range(1, len(tk)):
            children.setdefault(tuple(tk[:d]), set()).add(int(tk[d]))
    rows: dict[tuple[int, ...], dict[int, float]] = {}

    def keep(got: Mapping[tuple[int, ...], np.ndarray], level: Sequence[tuple[int, ...]]) -> None:
        for n in level:
            row = got[n]
            lse = _lse(row)
            rows[n] = {t: float(row[t]) - lse for t in children.get(n, ())}

    fed = 0
    budget = float(tolerance)
    if tolerance <= 0:
        keep(eng.tree(n_prompt, sorted(nodes), seq, n_base), sorted(nodes))
        fed = len(nodes)
    else:
        kept = {tuple(tokens[c][:d]) for c in exact if c in tokens for d in range(1, len(tokens[c]))}
        log_p: dict[tuple[int, ...], float] = {}
        depth_max = max((len(n) for n in nodes), default=0)
        with contextlib.ExitStack() as stack:
            parents = {n[:-1] for n in nodes}
            if len([n for n in nodes if n not in parents]) <= SEQ_MAX - n_base:
                tree = stack.enter_context(eng.levels(n_prompt, sorted(nodes), seq, n_base))

                def feed(level):
                    return tree.feed(level), len(level)
            else:  # more leaves than sequences: each level re-fed with its ancestors, in groups
                def feed(level):
                    batch = {n[:d] for n in level for d in range(1, len(n) + 1)}
                    return eng.tree(n_prompt, sorted(batch), seq, n_base, want=set(level)), len(batch)
            for depth in range(1, depth_max + 1):
                fresh = []
                for node in (n for n in nodes if len(n) == depth):
                    parent = node[:-1]
                    if depth > 1 and parent not in rows:
                        continue
                    step_lp = float(lp[node[-1]]) if depth == 1 else rows[parent][node[-1]]
                    log_p[node] = (log_p[parent] if depth > 1 else 0.0) + step_lp
                    fresh.append(node)
                level, budget = shared.tolerance_cut(fresh, log_p, kept, budget)
                level = list(dict.fromkeys(level))
                if not level:
                    break
                got, n_fed = feed(level)
                keep(got, level)
                fed += n_fed
    probs = {}
    for cand, tk in tokens.items():
        if not tk:
            probs[cand] = 1.0
            continue
        if len(tk) > 1 and tuple(tk[:-1]) not in rows:  # under a prefix left out: in the unscored mass
            probs[cand] = 0.0
            continue
        total = float(lp[tk[0]])
        for d in range(1, len(tk)):
            total += rows[tuple(tk[:d])][tk[d]]
        probs[cand] = math.exp(total)
    return probs, float(tolerance) - budget, fed


_VOCABS: weakref.WeakKeyDictionary[LlamaCppEngine, leadspace.LeadVocab] = weakref.WeakKeyDictionary()


def engine_vocab(eng: LlamaCppEngine) -> leadspace.LeadVocab:
    """The engine's vocabulary as the whitespace-led event reads it (`leadspace.lead_vocab`), built once."""
    if eng not in _VOCABS:
        _VOCABS[eng] = leadspace.lead_vocab(tokenizer_of(eng))
    return _VOCABS[eng]


def _lead_space(eng: LlamaCppEngine, step: shared.FirstStep, context: str, ids: list[int], lp: np.ndarray,
                cands: list[str], exact: set[str], tolerance: float, seq: int, n_base: int) -> None:
    """The whitespace-led event of each candidate (`engines.leadspace`, as the transformers engine's
    `whitespace_paths`): the whitespace levels fed as trees over the cached prompt, then every candidate's
    distinct paths in one trie (`_candidate_probs`) with what is left of the tolerance; fills the step's
    candidate probabilities, paths, path probabilities, unscored mass and positions fed."""
    lv = engine_vocab(eng)
    ws = np.asarray(lv.ws_ids, dtype=np.int64)

    def forward(levels):
        (nodes,) = levels
        got = eng.tree(len(ids), sorted({n[:d] for n in nodes for d in range(1, len(n) + 1)}), seq, n_base,
                       want=set(nodes))
        return [[got[n][ws].astype(np.float64) - _lse(got[n]) for n in nodes]]

    (levels,) = leadspace.whitespace_levels([lp[ws]], lv.ws_ids, tolerance, forward)

    def tokens_in(node, s):
        if not node:
            return candidate_ids(eng, context, s, ids)
        return candidate_ids(eng, context + leadspace.node_text(node, lv.ws_text), s, list(ids) + list(node))

    nodes = {n: leadspace.node_text(n, lv.ws_text) for n in levels.nodes}
    paths = leadspace.lead_paths(cands, lv.spaces, nodes, lv.ws_ids, tokens_in)
    trie = {p: list(p) for ps in paths.values() for p in ps}
    exact_paths = {p for c in exact for p in paths.get(c, ())}
    probs, unscored, fed = _candidate_probs(eng, len(ids), lp, trie, levels.budget, exact_paths, seq, n_base)
    step.candidate_paths, step.path_probs = paths, probs
    step.candidate_probs = {c: sum(probs[p] for p in paths[c]) for c in cands}
    step.unscored_mass = unscored + levels.unscored
    step.candidate_positions = fed + len(levels.nodes)


def complete_units(eng: LlamaCppEngine, n_prompt: int, top_ids: list[int], seq: int = 0,
                   n_base: int = 1) -> dict[int, str]:
    """{token: its first unit} for the likeliest first tokens: the token's own text where it holds a
    whole character, else the first unit of its greedy continuation (at most `firststep.UNIT_TOKENS`
    tokens, read off trees over the cached prompt); "" when none is whole by then."""
    out: dict[int, str] = {}
    open_: list[tuple[int, ...]] = []
    for t in top_ids:
        unit, _ = shared.first_unit_ids(eng.decode, [t])
        if unit:
            out[t] = unit
        else:
            open_.append((t,))
    for _ in range(1, shared.UNIT_TOKENS):
        if not open_:
            break
        nodes = {path[:d] for path in open_ for d in range(1, len(path) + 1)}
        logits = eng.tree(n_prompt, sorted(nodes), seq, n_base, want=set(open_))
        nxt = []
        for path in open_:
            child = (*path, int(np.argmax(logits[path])))
            unit, _ = shared.first_unit_ids(eng.decode, list(child))
            if unit or child[-1] in eng.eog:
                out[path[0]] = unit
            else:
                nxt.append(child)
        open_ = nxt
    for path in open_:
        out[path[0]] = ""
    return out


def first_token(lp: np.ndarray, banned, temperature: float | None, seed: int, index: int) -> int:
    """Step-1 token: argmax, or a seeded sample at `temperature`, banned tokens removed (as evalkit-hf)."""
    if banned:
        lp = lp.copy()
        ids = [int(i) for i in banned if 0 <= int(i) < lp.shape[0]]
        if len(ids) >= lp.shape[0]:
            raise ValueError("banned_first_ids covers the whole vocabulary")
        lp[ids] = -np.inf
    if temperature is None or temperature <= 0:
        return int(np.argmax(lp))
    import torch

    generator = torch.Generator().manual_seed(seed * shared.SEED_STRIDE + index)
    probs = torch.softmax(torch.from_numpy(lp).double() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _response_prefix(eng: LlamaCppEngine, ids: list[int], max_new: int, stops: list[str]) -> list[int]:
    """The tokens a generation with the stop strings and `max_new` tokens would have kept."""
    for k in range(1, min(len(ids), max_new) + 1):
        if stops and any(s in eng.decode(ids[:k]) for s in stops):
            return ids[:k]
    return ids[:max_new]


def content_free_prior(eng: LlamaCppEngine, frame: str, top_k: int) -> dict[int, float]:
    """The content-free prior (docs/metrics.md §1.3) of a prompt frame, on this engine: the mean
    first-step distribution over CONTENT_FREE inputs put in the frame, as its top-k."""
    contexts = [c for c in (frame.replace("\x00", cf) for cf in CONTENT_FREE) if c.strip()]
    mean = np.mean([np.exp(log_softmax(eng.prefill(encode(tokenizer_of(eng), c)))) for c in contexts], axis=0)
    top = np.argsort(-mean, kind="stable")[:top_k]
    return {int(t): float(mean[t]) for t in top}
