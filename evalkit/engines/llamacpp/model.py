"""lm-eval model type `evalkit-llamacpp` (`--model llamacpp`): a GGUF run natively by llama.cpp.

Owns: the bridge between lm-eval requests and `llamacpp.firststep.LlamaCppEngine` — per greedy
request the same `FirstStepResult` `evalkit-hf` returns (text, first token, first unit,
top-k, full-vocabulary entropy, top1_prob, top3_mass@T, unstable, ft_hit_prob, ft_token_hit,
opener_mass, prior_drift against a content-free prior computed by this engine, the answer
continuation, the first units of the top tokens), `loglikelihood` and
`loglikelihood_rolling` (so lm-eval's own tasks run on it), sampled generation for the
sampled protocol, and what the run row records of the GGUF (`quant_detail`: its own
quantization type, bits per weight, the llama.cpp build). `probe` is the engine-level
counterpart of `transformers.firststep.probe`.
Does not: score text (the task's `process_results` does), store, or refuse run options
(`engines.resolve` refuses --quant, --attention and the KV policies llama.cpp cannot run,
before anything loads).

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
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from evalkit.engines import firststep as shared
from evalkit.engines import kvpolicy, validate
from evalkit.engines.llamacpp.firststep import DEFAULT_KV, SEQ_MAX, LlamaCppEngine, log_softmax
from evalkit.engines.llamacpp.resolve import llamacpp_refusal
from evalkit.defaults import (
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_GEN_TOKS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOLERANCE,
    DEFAULT_TOP_K,
)
from evalkit.contract import FIRSTTOKEN, FirstStepResult, doc_kind
from evalkit.errors import BadInput
from evalkit.scoring import stats
from evalkit.scoring.firsttoken import answer_prob, unstable
from evalkit.scoring.lexicon import load_lexicon
from evalkit.scoring.selection import EVERYTHING, Candidates, Selection, candidates
from evalkit.scoring.text import drop_covered

CONTENT_FREE = ("N/A", "", "…", "无")  # as evalkit-hf's content-free prior (Zhao et al. 2021)


def kv_type(policy: kvpolicy.KVPolicy) -> str:
    """llama.cpp's cache type for a policy: `ggml:TYPE` names one, `full` is f32 (nothing rounded)."""
    if policy.kind == "ggml":
        return policy.cache_type
    if policy.is_full:
        return "f32"
    raise BadInput(f"--kv-cache {policy.spec}: {llamacpp_refusal(policy)}")


# --- the first step on llama.cpp ------------------------------------------------------------


def candidate_ids(eng: LlamaCppEngine, context: str, candidate: str, context_ids: list[int]) -> list[int]:
    """The candidate's tokens in its real context: ids(context + candidate) past ids(context);
    tokenised alone when the joint tokenisation merges across the boundary (`firststep.candidate_ids`' rule)."""
    tail = shared.context_tail(eng.tokenize(context + candidate), context_ids)
    return tail if tail is not None else eng.tokenize(candidate, special=False)


def _lse(logits: np.ndarray) -> float:
    x = logits.astype(np.float64)
    m = float(x.max())
    return m + math.log(float(np.exp(x - m).sum()))


def probe(eng: LlamaCppEngine, contexts: list[str], candidates: list[list[str]] | None = None, *,
          top_k: int = DEFAULT_TOP_K, max_new_tokens: int = 32, stop: Sequence[str] = (),
          first_temperature: float | None = None, banned_first_ids=frozenset(), seed: int = 0,
          answer_tokens: Sequence[int] | None = None, unit_ranks: int = 0, tolerance: float = 0.0,
          exact_candidates: list[list[str]] | None = None,
          batch_size: int = DEFAULT_BATCH_SIZE) -> list[shared.FirstStep]:
    """`transformers.firststep.probe`'s results for each context, computed by llama.cpp (see the module docstring).

    Same meaning of every argument as `transformers.firststep.probe` (`tolerance`, `exact_candidates`: the
    prefixes left out of the candidate trie, `_candidate_probs`). Up to `batch_size` prompts share
    the KV cache, each in its own sequence (at most half the context's cells in all): one prefill
    for all of them, then each prompt's trie over its own cached prompt, then their greedy
    continuations stepped together, one llama_decode a token for the whole batch.
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
    if candidates is not None and len(candidates) != len(contexts):
        raise ValueError(f"{len(candidates)} candidate lists for {len(contexts)} contexts")
    if answer_tokens is not None and len(answer_tokens) != len(contexts):
        raise ValueError(f"{len(answer_tokens)} answer lengths for {len(contexts)} contexts")
    stops = [s for s in stop if s]
    ids_all = [eng.tokenize(c) for c in contexts]
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
                step.candidate_probs, step.unscored_mass, step.candidate_positions = _candidate_probs(
                    eng, len(ids), lp, step.candidate_tokens, tolerance,
                    set(exact_candidates[i]) if exact_candidates is not None else frozenset(), seq=b, n_base=len(rows))
            if unit_ranks:
                step.units = complete_units(eng, len(ids), step.topk_ids[: min(unit_ranks, k)], seq=b,
                                            n_base=len(rows))
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


def _as_tensor(lp: np.ndarray):
    import torch

    return torch.from_numpy(lp.astype(np.float32))


def _candidate_probs(eng: LlamaCppEngine, n_prompt: int, lp: np.ndarray, tokens: dict[str, list[int]],
                     tolerance: float = 0.0, exact: set[str] | frozenset = frozenset(), seq: int = 0,
                     n_base: int = 1) -> tuple[dict[str, float], float, int]:
    """({candidate: P(response starts with it)}, unscored mass, trie positions fed).

    tolerance 0: the trie's proper prefixes in one batch over the cached prompt (exact). tolerance > 0:
    one batch per trie level, and before each level the least likely new prefixes are left out while
    their probabilities add up to at most what is left of `tolerance` — `transformers.firststep.probe`'s rule, so the
    two engines leave out the same share; the prefixes of `exact` candidates never are. Every leaf of
    the whole trie has its sequence from the start (`LlamaCppEngine.levels`), so each level feeds only
    its own prefixes; a trie with more leaves than sequences re-feeds each level's ancestors instead.
    """
    nodes = {tuple(tk[:d]) for tk in tokens.values() for d in range(1, len(tk))}
    logits: dict[tuple[int, ...], np.ndarray] = {}
    fed = 0
    budget = float(tolerance)
    if tolerance <= 0:
        logits = eng.tree(n_prompt, sorted(nodes), seq, n_base)
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
                    return eng.tree(n_prompt, sorted(batch), seq, n_base), len(batch)
            for depth in range(1, depth_max + 1):
                fresh = []
                for node in (n for n in nodes if len(n) == depth):
                    parent = node[:-1]
                    if depth > 1 and parent not in logits:
                        continue
                    row = lp if depth == 1 else logits[parent].astype(np.float64) - _lse(logits[parent])
                    log_p[node] = (log_p[parent] if depth > 1 else 0.0) + float(row[node[-1]])
                    fresh.append(node)
                level, budget = shared.tolerance_cut(fresh, log_p, kept, budget)
                level = list(dict.fromkeys(level))
                if not level:
                    break
                got, n_fed = feed(level)
                logits.update({n: got[n] for n in level})
                fed += n_fed
    lse = {node: _lse(row) for node, row in logits.items()}
    probs = {}
    for cand, tk in tokens.items():
        if not tk:
            probs[cand] = 1.0
            continue
        if len(tk) > 1 and tuple(tk[:-1]) not in logits:  # under a prefix left out: in the unscored mass
            probs[cand] = 0.0
            continue
        total = float(lp[tk[0]])
        for d in range(1, len(tk)):
            node = tuple(tk[:d])
            total += float(logits[node][tk[d]]) - lse[node]
        probs[cand] = math.exp(total)
    return probs, float(tolerance) - budget, fed


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
        logits = eng.tree(n_prompt, sorted(nodes), seq, n_base)
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
    mean = np.mean([np.exp(log_softmax(eng.prefill(eng.tokenize(c)))) for c in contexts], axis=0)
    top = np.argsort(-mean, kind="stable")[:top_k]
    return {int(t): float(mean[t]) for t in top}


# --- the chat template ------------------------------------------------------------------------


class GGUFTokenizer:
    """The GGUF's own tokenizer and chat template, with the small part of a transformers
    tokenizer's interface evalkit and lm-eval call (`__call__`, `decode`, `apply_chat_template`,
    `chat_template`, `len`): token counts and templated prompts come from the file llama.cpp runs.
    The template is rendered as transformers renders one (jinja2 sandbox, trim_blocks,
    lstrip_blocks, `raise_exception`)."""

    def __init__(self, eng: LlamaCppEngine) -> None:
        self.eng = eng
        self.chat_template = eng.meta("tokenizer.chat_template")
        lib = eng.lib
        self.bos_token_id = int(lib.llama_vocab_bos(eng.vocab))
        self.eos_token_id = int(lib.llama_vocab_eos(eng.vocab))
        self.bos_token = eng.decode([self.bos_token_id]) if self.bos_token_id >= 0 else ""
        self.eos_token = eng.decode([self.eos_token_id]) if self.eos_token_id >= 0 else ""
        self.pad_token_id = self.eos_token_id
        self.name_or_path = eng.path

    def __len__(self) -> int:
        return self.eng.n_vocab

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self.eng.tokenize(text, add_bos=bool(add_special_tokens))}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.eng.tokenize(text, add_bos=bool(add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = False, **_: Any) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.eng.decode(ids, special=not skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            **kwargs: Any):
        if not self.chat_template:
            raise ValueError(f"{self.eng.path} has no chat template (tokenizer.chat_template)")
        text = _render(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        if continue_final_message and messages:
            final = messages[-1]["content"].strip()
            cut = text.rfind(final)
            if cut >= 0:
                text = text[: cut + len(final)]
        return self.eng.tokenize(text) if tokenize else text


def _render(template: str, messages, **variables) -> str:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, **variables)


# --- lm-eval model type --------------------------------------------------------------------------


@register_model("evalkit-llamacpp")
class EvalkitLlamaCpp(TemplateLM):
    """A GGUF on llama.cpp. Model args: model (the .gguf path; none: the embedded SmolLM2), n_ctx
    (default: the model's training context, at most 8192), n_threads (default: the usable cores),
    flash_attn (default off, as llama-cpp-python and Ollama run; `LlamaCppEngine.set_kv_type`),
    and evalkit's own: top_k, temperature (of top3_mass@T), first_temperature, ban_openers,
    probe_seed, answer_max_tokens, tolerance (as evalkit-hf's: 0 is exact), kv_cache (`full` = f32,
    `ggml:f16` = llama.cpp's default, `ggml:q8_0`, `ggml:q4_0`), prompt_batch (prompts sharing one
    prefill and one decoding loop; default 1, so that every number is the one a single request to a
    llama.cpp server gets: llama.cpp's kernels round differently for other batch shapes)."""

    journal = None  # store.journal.Journal | None, set by the runner: greedy batches replay from it (--resume)
    selection: Selection = EVERYTHING  # what to compute (`select`, `evalkit run --metrics`)
    skipped: tuple[str, ...] = ()  # the registry metrics the selection leaves uncomputed

    def select(self, chosen: Selection) -> None:
        """Compute only what `chosen` reads from the next request on (as evalkit-hf's `select`)."""
        self.selection, self.skipped = chosen, tuple(sorted(chosen.skipped()))

    def __init__(self, model: str, *, n_ctx: int | None = None, n_threads: int | None = None,
                 flash_attn: bool = False, top_k: int = DEFAULT_TOP_K,
                 temperature: float = DEFAULT_TEMPERATURE, first_temperature: float | None = None,
                 ban_openers: bool = False,
                 probe_seed: int = 0, answer_max_tokens: int = DEFAULT_ANSWER_TOKENS,
                 tolerance: float = DEFAULT_TOLERANCE, kv_cache: str | kvpolicy.KVPolicy | None = None,
                 batch_size: int | str | None = DEFAULT_BATCH_SIZE, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 device: str | None = None,
                 prompt_batch: int = 1) -> None:
        super().__init__()
        policy = kvpolicy.as_policy(kv_cache, f"ggml:{DEFAULT_KV}")  # the plan's, or plain lm-eval's text
        cache = kv_type(policy)  # refused before the model loads
        if device not in (None, "cpu") and not str(device).startswith("cpu"):
            raise BadInput(f"--model llamacpp runs on the CPU in this build (got --device {device})")
        try:
            self.eng = LlamaCppEngine(str(model), n_ctx=n_ctx, n_threads=n_threads, kv_type=cache,
                                      flash_attn=bool(flash_attn))
        except ValueError as exc:  # a file llama.cpp cannot read: one line naming it
            raise BadInput(str(exc)) from None
        self.tokenizer = GGUFTokenizer(self.eng)
        self.kv_policy = policy
        self.top_k = int(top_k)
        self.temperature = float(temperature)
        self.first_temperature = None if first_temperature in (None, "", "none") else float(first_temperature)
        self.ban_openers = bool(ban_openers)
        self.probe_seed = int(probe_seed)
        self.answer_max_tokens = int(answer_max_tokens)
        self.tolerance = float(tolerance)
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.prompt_batch = int(prompt_batch)
        self.max_gen_toks = int(max_gen_toks)
        self.lexicon = load_lexicon()
        self._priors: dict[str, dict[int, float]] = {}
        self.quant_detail = self._describe()

    # -- what the run row records -------------------------------------------------------

    def _describe(self) -> dict[str, Any]:
        from importlib.metadata import version

        facts = self.eng.facts()
        info = self.eng.lib.llama_print_system_info().decode("utf-8", "replace").strip()
        return {
            "engine": "llama.cpp",
            "library": "llama-cpp-python",
            "version": version("llama-cpp-python"),
            "scheme": f"GGUF {facts.file_type} computed by llama.cpp's own kernels (not dequantized)",
            "gguf_file_type": facts.file_type,
            "bits": round(facts.bits_per_weight, 3),
            "bits_per_weight": round(facts.bits_per_weight, 3),
            "n_params": facts.n_params,
            "model_desc": facts.desc,
            "kv_cache_type": self.eng.kv_type,
            "flash_attn": self.eng.flash_attn,
            "n_ctx": self.eng.n_ctx,
            "n_threads": self.eng.n_threads,
            "prompt_batch": self.prompt_batch,
            "system_info": info,
            "source": f"GGUF file {self.eng.path.rsplit('/', 1)[-1]}",
        }

    def set_kv_policy(self, policy: kvpolicy.KVPolicy) -> None:
        """Run every later request under `policy` (a `--kv-cache` sweep reuses the loaded model)."""
        self.eng.set_kv_type(kv_type(policy))
        self.kv_policy = policy
        self.quant_detail = {**self.quant_detail, "kv_cache_type": self.eng.kv_type, "flash_attn": self.eng.flash_attn}
        self._priors = {}

    # -- lm-eval's TemplateLM interface ---------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.eng.n_ctx

    @property
    def tokenizer_name(self) -> str:
        return self.eng.path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template is not False and chat_template is not None else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """As HFLM: the GGUF's template, retried without the system message when the template rejects one."""
        import jinja2

        try:
            return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)
        except jinja2.exceptions.TemplateError:
            chat_history = [m for m in chat_history if m["role"] != "system"]
            return self.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.eng.tokenize(string, add_bos=bool(add_special_tokens))

    def tok_decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """log P(continuation | context) and whether every continuation token is the argmax. Requests
        sharing a context are one prefill plus one trie of their continuations over it."""
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, ctx, cont) in enumerate(requests):
            groups.setdefault(tuple(ctx), []).append(i)
        bar = tqdm(total=len(requests), desc="loglikelihood (llama.cpp)", disable=disable_tqdm)
        for ctx, idxs in groups.items():
            conts = [list(requests[i][2]) for i in idxs]
            longest = max(len(c) for c in conts)
            room = self.max_length - 1 - longest
            if room < 1:
                raise ValueError(f"a continuation of {longest} tokens leaves no room for context in {self.max_length}")
            ctx_ids = list(ctx)[-room:]  # left-truncated, as HFLM does
            lp0 = log_softmax(self.eng.prefill(ctx_ids))
            nodes = {tuple(c[:d]) for c in conts for d in range(1, len(c))}
            logits = self.eng.tree(len(ctx_ids), sorted(nodes))
            for i, cont in zip(idxs, conts):
                total, greedy = 0.0, True
                for d, tok in enumerate(cont):
                    if d == 0:
                        row_lp = lp0
                    else:
                        row = logits[tuple(cont[:d])]
                        row_lp = row.astype(np.float64) - _lse(row)
                    total += float(row_lp[tok])
                    greedy = greedy and int(np.argmax(row_lp)) == tok
                out[i] = (total, greedy)
                self.cache_hook.add_partial("loglikelihood", requests[i][0], (total, greedy))
            bar.update(len(idxs))
        bar.close()
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood in windows of the context (lm-eval's rolling windows)."""
        from lm_eval import utils

        out = []
        for req in tqdm(requests, desc="loglikelihood_rolling (llama.cpp)", disable=disable_tqdm):
            (text,) = req.args
            windows = list(map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length - 1, context_len=1)))
            total = 0.0
            for ctx, cont in windows:
                ids = list(ctx) + list(cont)
                rows = self.eng.sequence_logits(ids, len(ctx))
                for row, tok in zip(rows, cont):
                    total += float(row[tok]) - _lse(row)
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    def cells_needed(self, context: str, doc: dict, max_new: int) -> int:
        """KV cells one greedy prompt can hold at once, at most: its tokens, the trie of its candidate
        strings (every distinct token prefix, each a cell while the trie is fed) and its continuation."""
        ids = self.eng.tokenize(context)
        cands = self._candidates(doc).strings
        nodes = {tuple(toks[:d]) for c in cands for toks in [candidate_ids(self.eng, context, c, ids)]
                 for d in range(1, len(toks) + 1)}
        answer = max(max_new, self.answer_max_tokens) if doc.get("answers_full") else max_new
        return len(ids) + len(nodes) + answer

    def _check_fit(self, requests) -> None:
        """Refuse (BadInput, before any prompt is computed) greedy prompts whose cells (`cells_needed`)
        exceed the context: llama.cpp would stop on them mid-run with its context full."""
        too_big = []
        lexicon = sum(len(self.eng.tokenize(e, special=False)) + 1 for e in self.lexicon.entries)
        for req in requests:
            gen = req.args[1]
            if gen.get("do_sample"):
                continue
            context, doc, max_new = req.args[0], req.doc or {}, int(gen.get("max_gen_toks", self.max_gen_toks))
            # a bound first (every candidate's tokens alone, one more for a merge at the prompt's end),
            # the exact trie only where the bound does not fit
            cands = self._candidates(doc)
            bound = (len(self.eng.tokenize(context)) + max(max_new, self.answer_max_tokens)
                     + sum(len(self.eng.tokenize(c, special=False)) + 1 for c in cands.exact)
                     + (lexicon if cands.openers else 0))
            if bound <= self.eng.n_ctx:
                continue
            need = self.cells_needed(context, doc, max_new)
            if need > self.eng.n_ctx:
                too_big.append(f"{(req.doc or {}).get('id', req.idx)} ({need} cells)")
        if too_big:
            more = f" and {len(too_big) - 5} more" if len(too_big) > 5 else ""
            raise BadInput(f"{len(too_big)} prompts do not fit llama.cpp's context of n_ctx={self.eng.n_ctx} cells "
                           f"with the trie of their candidate strings and their answer: {', '.join(too_big[:5])}"
                           f"{more}; raise --model-args n_ctx")

    def generate_until(self, requests, disable_tqdm: bool = False):
        self._check_fit(requests)
        out: list[Any] = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="first-token probe (llama.cpp)", disable=disable_tqdm)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for idxs in groups.values():
            gen = requests[idxs[0]].args[1]
            until = gen.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen.get("max_gen_toks", self.max_gen_toks))
            if not gen.get("do_sample") and not any(self.selection.runs("response", doc_kind(requests[i].doc or {}))
                                                    for i in idxs):
                max_new = 0  # nothing selected reads these responses (`--metrics`): the first token only
            if gen.get("do_sample"):
                for i in idxs:
                    out[i] = self._sample(requests[i].args[0], gen, until, max_new, i)
                    bar.update(1)
                continue
            for start in range(0, len(idxs), self.batch_size):
                chunk = idxs[start : start + self.batch_size]
                contexts = [requests[i].args[0] for i in chunk]
                docs = [requests[i].doc or {} for i in chunk]
                cands = [self._candidates(d) for d in docs]

                def compute(start=start, contexts=contexts, docs=docs, cands=cands):
                    steps = probe(
                        self.eng, contexts, [c.strings for c in cands], top_k=self.top_k, max_new_tokens=max_new,
                        stop=until, first_temperature=self.first_temperature,
                        banned_first_ids=self._banned_first_ids(contexts[0]),
                        seed=self.probe_seed + 7919 * start,
                        answer_tokens=[self.answer_max_tokens if d.get("answers_full")
                                       and self.selection.runs("answer", doc_kind(d)) else 0 for d in docs],
                        unit_ranks=shared.UNIT_RANKS if self.selection.runs("units", FIRSTTOKEN) else 0,
                        tolerance=self.tolerance, exact_candidates=[c.exact for c in cands],
                        batch_size=self.prompt_batch,
                    )
                    return [self._result(ctx, doc, cand, step, until)
                            for ctx, doc, cand, step in zip(contexts, docs, cands, steps)]

                # a batch is its place in the request list and its prompts, as in evalkit-hf: a resumed
                # run forms the same batches and replays those its journal holds
                key = [repr(sorted(gen.items())), start, contexts, [c.strings for c in cands]]
                results = self.journal.batch(key, compute) if self.journal is not None else compute()
                for i, result in zip(chunk, results):
                    out[i] = result
                bar.update(len(chunk))
        bar.close()
        return out

    # -- helpers ------------------------------------------------------------------------

    def _sample(self, context: str, gen: dict, until: list[str], max_new: int, index: int) -> str:
        """One sampled completion (the sampled protocol): softmax(logits / T) at every step, seeded."""
        temperature = float(gen.get("temperature") or 1.0)
        rng = np.random.default_rng([self.probe_seed, index])
        ids = self.eng.tokenize(context)
        logits = self.eng.prefill(ids)
        toks: list[int] = []
        try:
            while len(toks) < max_new:
                p = np.exp(log_softmax(logits / temperature))
                tok = int(rng.choice(p.shape[0], p=p / p.sum()))
                if tok in self.eng.eog:
                    break
                toks.append(tok)
                text = self.tok_decode(toks)
                if any(s in text for s in until if s):
                    break
                if len(ids) + len(toks) >= self.max_length:
                    break
                self.eng._decode([tok], [len(ids) + len(toks) - 1], [(0,)], [True])
                logits = self.eng.logits(-1)
        finally:
            self.eng.lib.llama_memory_seq_rm(self.eng.mem, 0, len(ids), -1)
        text = self.tok_decode(toks)
        for s in until:
            if s and s in text:
                text = text.split(s, 1)[0]
        return text

    def _candidates(self, doc: dict) -> Candidates:
        """Answer starts and checkable answers (scored exactly), then the lexicon's openers; each set empty
        where the run's selection skips its trie."""
        return candidates(self.selection, doc, self.lexicon.entries)

    def _banned_first_ids(self, context: str) -> frozenset[int]:
        if not self.ban_openers:
            return frozenset()
        ids = self.eng.tokenize(context)
        return frozenset(toks[0] for text in shared.opener_variants(self.lexicon.entries)
                         if (toks := candidate_ids(self.eng, context, text, ids)))

    def _prior(self, context: str, doc: dict) -> dict[int, float] | None:
        frame = shared.prompt_frame(context, doc)
        if frame is None:
            return None
        if frame not in self._priors:
            self._priors[frame] = content_free_prior(self.eng, frame, self.top_k)
        return self._priors[frame]

    def _result(self, context, doc, cands: Candidates, step: shared.FirstStep, until) -> FirstStepResult:
        kind = doc_kind(doc)
        decoded = self.selection.runs("response", kind)  # else no response was generated (`--metrics`)
        text: str | None = None
        unit: str | None = None
        if decoded:
            text = self.tok_decode(step.response_ids)
            for s in until:
                if s and s in text:
                    text = text.split(s, 1)[0]
            unit, _ = shared.first_unit_ids(self.tok_decode, step.response_ids)
        topk = [(int(t), self.tok_decode([int(t)], skip_special_tokens=False), float(lp))
                for t, lp in zip(step.topk_ids, step.topk_logprobs)]
        top3 = shared.top_mass(step.logprobs, 3, self.temperature)
        metrics: dict[str, float] = {
            "top1_prob": math.exp(step.topk_logprobs[0]),
            "top3_mass": top3,
            "unstable": unstable(top3),
            "entropy": step.entropy,
        }
        if kind == FIRSTTOKEN and doc.get("answers"):  # a set whose trie was skipped gives no value, never a 0
            answers, openers = list(cands.starts), list(cands.openers)
            tokens = step.candidate_tokens
            if cands.answers:
                metrics["answer_prob"] = answer_prob(step.candidate_probs, list(cands.answers), tokens)
            if answers:
                metrics["ft_hit_prob"] = sum(step.candidate_probs[a] for a in drop_covered(answers, tokens))
                metrics["ft_token_hit"] = (1.0 if step.topk_ids[0] in {tokens[a][0] for a in answers if tokens.get(a)}
                                           else 0.0)
            if openers:
                metrics["opener_mass"] = sum(step.candidate_probs[o] for o in drop_covered(openers, tokens))
            ids = self.eng.tokenize(context)
            metrics["opener_start_mass"] = shared.start_mass(step.logprobs, {
                toks[0] for e in self.lexicon.entries if (toks := candidate_ids(self.eng, context, e, ids))})
            prior = self._prior(context, doc)
            if prior is not None:
                p = {t: math.exp(lp) for t, lp in zip(step.topk_ids, step.topk_logprobs)}
                metrics["prior_drift"] = stats.prior_drift(p, prior)
        # without a response, the token chosen at step 1 (what a response would have begun with)
        first_id = step.response_ids[0] if step.response_ids else None if decoded else step.first_token_id
        result = FirstStepResult(
            text=text,
            first_token_id=first_id,
            first_token=self.tok_decode([first_id]) if first_id is not None else "",
            first_unit=unit,
            topk=topk,
            entropy=step.entropy,
            metrics=metrics,
            answer_text=self.tok_decode(step.answer_ids) if step.answer_ids else None,
            units=step.units,
            skipped=self.skipped,
        )
        shown = doc.get("prompt") if isinstance(doc.get("prompt"), str) else context
        return validate.check_result(result, source=f"llama.cpp ({Path(self.eng.path).name})", prompt=shown)
