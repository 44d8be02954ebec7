"""lm-eval model type `evalkit-llamacpp` (`--model llamacpp`): a GGUF run natively by llama.cpp.

Owns: the bridge between lm-eval requests and `llamacpp.firststep.LlamaCppEngine` — per greedy
request the same `FirstStepResult` `evalkit-hf` returns (text, first token, first unit,
top-k, full-vocabulary entropy, top1_prob, top3_mass@T, unstable, ft_hit_prob, ft_token_hit,
opener_mass, prior_drift against a content-free prior computed by this engine, the answer
continuation, the first units of the top tokens), `loglikelihood` and
`loglikelihood_rolling` (so lm-eval's own tasks run on it), sampled generation for the
sampled protocol, and what the run row records of the GGUF (`quant_detail`: its own
quantization type, bits per weight, the llama.cpp build). The first step itself is read by
`llamacpp.probe`; the GGUF's tokenizer and chat template are `llamacpp.tokenizer`'s.
Does not: score text (the task's `process_results` does), store, or refuse run options
(`engines.resolve` refuses --quant, --attention and the KV policies llama.cpp cannot run,
before anything loads).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from evalkit.progress import bar as progress_bar

from evalkit.engines import firststep as shared
from evalkit.engines import firstchar, kvpolicy, leadspace, tokenizer_id, validate
from evalkit.engines.llamacpp.firststep import DEFAULT_KV, LlamaCppEngine, log_softmax
from evalkit.engines.llamacpp.probe import _lse, candidate_ids, content_free_prior, engine_vocab, first_token, probe
from evalkit.engines.llamacpp.tokenizer import tokenizer_of
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
from evalkit.prompts.encoding import encode, parse_add_bos, raw_ids, set_feed
from evalkit.scoring import stats
from evalkit.scoring.firsttoken import event_prob, unstable
from evalkit.scoring.lexicon import load_lexicon
from evalkit.scoring.selection import EVERYTHING, Candidates, Selection, candidates


def kv_type(policy: kvpolicy.KVPolicy) -> str:
    """llama.cpp's cache type for a policy: `ggml:TYPE` names one, `full` is f32 (nothing rounded)."""
    if policy.kind == "ggml":
        return policy.cache_type
    if policy.is_full:
        return "f32"
    raise BadInput(f"--kv-cache {policy.spec}: {llamacpp_refusal(policy)}")


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
                 ban_openers: bool = False, lead_space: bool = False, first_char: bool = False,
                 probe_seed: int = 0, answer_max_tokens: int = DEFAULT_ANSWER_TOKENS,
                 tolerance: float = DEFAULT_TOLERANCE, kv_cache: str | kvpolicy.KVPolicy | None = None,
                 batch_size: int | str | None = DEFAULT_BATCH_SIZE, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 device: str | None = None,
                 prompt_batch: int = 1, add_bos_token: Any = None) -> None:
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
        self.tokenizer = tokenizer_of(self.eng)
        self.feed = set_feed(self.tokenizer, parse_add_bos(add_bos_token))  # the ids fed: `prompts.encoding`
        self.tokenizer_id = tokenizer_id.at_load(self.tokenizer, f"llama.cpp {self.eng.path.rsplit('/', 1)[-1]}")
        self.kv_policy = policy
        self.top_k = int(top_k)
        self.temperature = float(temperature)
        self.first_temperature = None if first_temperature in (None, "", "none") else float(first_temperature)
        self.ban_openers = bool(ban_openers)
        # the whitespace-led event (docs/metrics.md "One event for text and probability"); false: before m028's
        self.lead_space = lead_space if isinstance(lead_space, bool) else str(lead_space).lower() != "false"
        # the first-character distribution (`engines.firstchar`, first_char_topk); first_char=false: not read
        self.first_char = first_char if isinstance(first_char, bool) else str(first_char).lower() != "false"
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
        """lm-eval's encoder: the run's feed (`prompts.encoding`) unless told to add nothing."""
        return raw_ids(self.tokenizer, string) if add_special_tokens is False else encode(self.tokenizer, string)

    def tok_decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """log P(continuation | context) and whether every continuation token is the argmax. Requests
        sharing a context are one prefill plus one trie of their continuations over it."""
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, ctx, cont) in enumerate(requests):
            groups.setdefault(tuple(ctx), []).append(i)
        bar = progress_bar(total=len(requests), desc="loglikelihood (llama.cpp)", unit="request", disable=disable_tqdm)
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
        ids = encode(self.tokenizer, context)
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
            bound = (len(encode(self.tokenizer, context)) + max(max_new, self.answer_max_tokens)
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
        bar = progress_bar(total=len(requests), desc="first-token probe (llama.cpp)", unit="prompt",
                           disable=disable_tqdm)
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
                        tolerance=self.tolerance, exact_candidates=[c.exact for c in cands], lead_space=self.lead_space,
                        batch_size=self.prompt_batch, first_char=self.first_char,
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
        ids = encode(self.tokenizer, context)
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
        ids = encode(self.tokenizer, context)
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
            "special_mass": shared.special_mass(step.logprobs, self.tokenizer),  # degenerate output's signal
        }
        if kind == FIRSTTOKEN and doc.get("answers"):  # a set whose trie was skipped gives no value, never a 0
            answers, openers = list(cands.starts), list(cands.openers)
            # each the probability of its text twin's event, over distinct token paths (`firsttoken.event_prob`)
            tokens, paths, pp = step.candidate_tokens, step.candidate_paths, step.path_probs
            lead = engine_vocab(self.eng)
            metrics["ws_mass"] = leadspace.ws_mass(step.logprobs, lead)
            if cands.answers:
                metrics["answer_prob"] = event_prob(list(cands.answers), step.candidate_probs, tokens, paths, pp)
            if answers:
                metrics["ft_hit_prob"] = event_prob(answers, step.candidate_probs, tokens, paths, pp)
                starts = leadspace.start_tokens(answers, tokens, paths, lead.ws_ids)
                metrics["ft_token_hit"] = 1.0 if step.topk_ids[0] in starts else 0.0
            if openers:
                metrics["opener_mass"] = event_prob(openers, step.candidate_probs, tokens, paths, pp)
            ids = encode(self.tokenizer, context)
            metrics["opener_start_mass"] = shared.start_mass(step.logprobs, leadspace.start_ids(
                self.lexicon.entries, lead if self.lead_space else None,
                lambda texts: {toks[0] for e in texts if (toks := candidate_ids(self.eng, context, e, ids))}))
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
            token_ids=list(step.answer_ids or step.response_ids),  # what a drift base teacher-forces, as hf's
            units=step.units,
            skipped=self.skipped,
        )
        firstchar.attach(result, step.first_chars)
        shown = doc.get("prompt") if isinstance(doc.get("prompt"), str) else context
        return validate.check_result(result, source=f"llama.cpp ({Path(self.eng.path).name})", prompt=shown)
