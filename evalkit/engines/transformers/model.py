"""lm-eval model type `evalkit-hf`: HFLM whose generate_until also returns the first step.

Owns: the bridge between lm-eval requests and `firststep.Prober` — each batch of requests is
handed to the prober, whose continuations run together across batches, and kept once its last
continuation ends (each prompt is journaled as soon as its own ends); per request it returns a
`FirstStepResult` (text, first token, top-k, entropy and the distribution-level metrics) instead of
a bare string; lm-eval passes it through
`resps` to the task's `process_results` and the logged samples. The content-free
prior is computed once per prompt frame inside the same run. Also applies
`--quant` after loading, and under `--attention` switches the model to eager attention
(`attention.install`) and asks each prefill for the spans its doc names (the needle
sentence, the first-token question), returning sink_rate and the span masses per
sample and per layer. Under a data-parallel launch (torchrun, `accelerate launch`) each process
takes its global rank from the Accelerator, so lm-eval hands it its share of the documents and
gathers them on rank 0. Loads with transformers' hub kernels off (`offline.guard`). Does not: score text (the task's `process_results` does,
through `scoring.firsttoken.score`) or store.

Sampling requests (`do_sample: true`, the sampled protocol) go to HFLM's own
generate_until unchanged.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import transformers
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from evalkit import envvars
from evalkit.contract import FIRSTTOKEN, NEEDLE, FirstStepResult, doc_kind
from evalkit.engines import firststep as shared
from evalkit.engines import caps as caps_of
from evalkit.engines import firstchar, kvpolicy, leadspace, tokenizer_id, validate
from evalkit.engines.modelid import gguf_add_bos
from evalkit.engines.transformers import attention as attn
from evalkit.engines.transformers import firststep, kvcache, offline
from evalkit.engines.transformers import quant as quantization
from evalkit.engines.transformers import quantdetail, quantize, windows
from evalkit.engines.transformers.convert import cached_args
from evalkit.defaults import (
    AUTO_BATCH,
    AUTO_DEVICE_SHARE,
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_BATCH_SIZE,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOLERANCE,
    DEFAULT_TOP_K,
    MEMORY_BUDGET,
)
from evalkit.errors import BadInput
from evalkit.prompts.encoding import parse_add_bos, set_feed
from evalkit.progress import bar as progress_bar
from evalkit.progress import keep_ticking
from evalkit.scoring import stats
from evalkit.scoring.firsttoken import event_prob, unstable
from evalkit.scoring.lexicon import load_lexicon
from evalkit.scoring.selection import EVERYTHING, Candidates, Selection, candidates

# Inputs without content (Zhao et al. 2021), put through the same template as the prompts.
CONTENT_FREE = ("N/A", "", "…", "无")


def content_free_prior(model, tokenizer, frame: str, top_k: int,
                       kv_policy: kvpolicy.KVPolicy | None = None) -> dict[int, float]:
    """The content-free prior (docs/metrics.md §1.3) of a prompt frame (the context with its prompt
    replaced by "\x00"): the mean first-step distribution over CONTENT_FREE inputs put in
    the frame, as its top-k `token_id -> probability`, under the run's KV-cache policy."""
    # under a template with no text around the prompt, "" leaves nothing to condition on
    contexts = [c for c in (frame.replace("\x00", cf) for cf in CONTENT_FREE) if c.strip()]
    steps = firststep.probe(model, tokenizer, contexts, top_k=top_k, max_new_tokens=0, batch_size=len(contexts),
                         kv_policy=kv_policy)
    mean = torch.stack([s.logprobs.exp() for s in steps]).mean(0)
    top = torch.topk(mean, top_k)
    return dict(zip(top.indices.tolist(), top.values.tolist()))


def candidate_metrics(tokenizer, context: str, step: firststep.FirstStep, answers: list[str], openers: list[str],
                      prior: dict[int, float] | None, full: list[str] | None = None) -> dict[str, float]:
    """ft_hit_prob and ft_token_hit (with accepted starts `answers`), opener_mass (with `openers`), answer_prob
    (with checkable answers `full`) and prior_drift (with a prior) of one probed prompt; a set left empty
    (its trie skipped: `evalkit run --metrics`) gives no value, never a 0.

    Each is the probability of the event its text twin tests (`firsttoken.event_prob`): with the
    whitespace-led paths the engine scored (`leadspace`), summed over distinct token paths; sums skip a
    string that another string of the same set covers, as text and in tokens (`text.drop_covered`, path
    by path), so no probability is counted twice. ws_mass: the first-step mass on whitespace-only tokens."""
    tokens, paths, pp = step.candidate_tokens, step.candidate_paths, step.path_probs
    metrics: dict[str, float] = {"ws_mass": leadspace.ws_mass(step.logprobs, leadspace.lead_vocab(tokenizer))}
    if answers:
        metrics["ft_hit_prob"] = event_prob(answers, step.candidate_probs, tokens, paths, pp)
        starts = leadspace.start_tokens(answers, tokens, paths, leadspace.lead_vocab(tokenizer).ws_ids)
        metrics["ft_token_hit"] = 1.0 if step.topk_ids[0] in starts else 0.0
    if openers:
        metrics["opener_mass"] = event_prob(openers, step.candidate_probs, tokens, paths, pp)
    if full:
        metrics["answer_prob"] = event_prob(full, step.candidate_probs, tokens, paths, pp)
    if prior is not None:
        p = {t: math.exp(lp) for t, lp in zip(step.topk_ids, step.topk_logprobs)}
        metrics["prior_drift"] = stats.prior_drift(p, prior)
    return metrics


def _skeleton(config):
    """The model of `config` on the meta device (no memory, no weights): its layer shapes."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def no_cudnn_attention() -> None:
    """Keep torch's SDPA off its cuDNN kernels in this process (flash, memory-efficient and math
    remain). cuDNN builds an execution graph for each new shape of (batch, heads, queries, keys)
    and caches it by shape; evalkit's attention shapes change at almost every call (the KV cache
    is one column longer at each decode step, rows leave the batch as they finish, each level of
    the candidate trie has its own width), so cuDNN would build a graph nearly every call. It
    serves only fp16 / bf16, which is why only bf16 runs would pay it: the suspected cause of
    bf16 running 2.3x slower than fp32 on an H200 (bench/device_speed.py times each kernel set)."""
    torch.backends.cuda.enable_cudnn_sdp(False)


# prompts done, counted within a batch as its phases go (prefill, candidate trie, decode k/N)
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total_fmt} prompts [{elapsed}<{remaining}{postfix}]"


@register_model("evalkit-hf")
class EvalkitHFLM(HFLM):
    """HFLM plus the exact first-step probe. Extra model args: quant, top_k,
    temperature (for top3_mass@T), first_temperature, ban_openers, probe_seed, and
    tolerance: per prompt, the least likely token prefixes of the lexicon openers'
    trie whose probabilities add up to at most this are not teacher-forced, so
    opener_mass falls short of exact by at most `tolerance` (a bound, not an
    estimate; 0 is exact; see `firststep.probe`). The accepted answers are always
    scored exactly: ft_hit_prob is exact. kv_cache: the KV-cache policy
    (the plan's `KVPolicy`, or its text from plain lm-eval; default full) every probe runs
    under, the content-free prior's included.
    attention: read the prefill's attention (docs/metrics.md §1.8) under eager attention.
    journal: the run's `store.journal.Journal` (set by the runner): each greedy batch is
    replayed from it when it holds all its prompts, or computed, each prompt appended as soon as
    its continuation ends, so a stopped run resumes (`--resume`) losing only the prompts in flight."""

    journal = None  # store.journal.Journal | None
    selection: Selection = EVERYTHING  # what to compute (`select`, `evalkit run --metrics`)
    skipped: tuple[str, ...] = ()  # the registry metrics the selection leaves uncomputed

    def select(self, chosen: Selection) -> None:
        """Compute only what `chosen` reads from the next request on: a trie, the decode or the first
        units nothing selected reads are skipped, and each response says which metrics it lacks."""
        self.selection, self.skipped = chosen, tuple(sorted(chosen.skipped()))

    def __init__(
        self,
        pretrained,
        *,
        quant: str | None = None,
        top_k: int = DEFAULT_TOP_K,
        temperature: float = DEFAULT_TEMPERATURE,
        first_temperature: float | str | None = None,  # lm-eval hands model args over as text
        ban_openers: bool = False,
        lead_space: bool = False,
        first_char: bool = False,
        probe_seed: int = 0,
        tolerance: float = DEFAULT_TOLERANCE,
        answer_max_tokens: int = DEFAULT_ANSWER_TOKENS,
        kv_cache: str | kvpolicy.KVPolicy | None = None,  # the plan's policy, or plain lm-eval's text
        device: str | None = None,
        attention: bool = False,
        add_bos_token: Any = None,
        **kwargs: Any,
    ) -> None:
        kwargs = offline.guard(kwargs)  # no hub kernel fetched at load or forward time unless asked
        policy = kvpolicy.as_policy(kv_cache)  # refused before the weights load
        kvpolicy.check_available(policy)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if envvars.world_size() > 1 and envvars.launched() and str(device).startswith("cpu"):
            # accelerate makes a CPU launch (gloo) only when told to (`accelerate launch --cpu` says so);
            # under torchrun it would leave every process a world of one, each running every prompt
            os.environ.setdefault("ACCELERATE_USE_CPU", "1")
        quantization.check(quant, in_process_hf=True, model_type="hf", device=str(device))
        if str(device).startswith("cuda"):
            no_cudnn_attention()
        self.quant = quantization.parse(quant).text if quant else None
        transformers.utils.logging.disable_progress_bar()  # a bar over weight names, not over the slow part
        gguf_file = self._gguf_path(pretrained, kwargs)  # the file as asked, for quant_detail's source
        # a GGUF is converted once, then read as safetensors (the run row keeps the GGUF's own args)
        converted = cached_args({"pretrained": pretrained, **kwargs})
        pretrained = converted.pop("pretrained")
        quantize.quiet_libraries()
        with quantize.quiet_imports():
            super().__init__(pretrained, device=device, **converted)  # calls _create_model (load-time variants)
            self._model = quantize.apply(self._model, self.quant)  # type: ignore[has-type]
        self.quant_detail = quantdetail.describe(self._model, self.quant, gguf_file=gguf_file)
        windows.windows_of(self._model)  # attention layers the engine cannot mask are refused before any prompt
        # the ids fed (`prompts.encoding`): what the tokenizer declares, or add_bos_token; HFLM's own
        # encoder (sampled requests, loglikelihood) reads the same
        self.feed = set_feed(self.tokenizer, parse_add_bos(add_bos_token),
                             gguf_add_bos=gguf_add_bos(gguf_file) if gguf_file else None)
        self.add_bos_token = self.feed.bos
        self.tokenizer_id = tokenizer_id.at_load(self.tokenizer, f"transformers {gguf_file or pretrained}")
        self._share_requests()
        self.prompts_computed = 0  # prompts this process probed or sampled (not replayed from a journal)
        self.attention = bool(attention)
        if self.attention:
            try:
                attn.install(self._model)
            except ValueError as exc:
                raise BadInput(f"--attention: {exc}") from exc
        self.top_k = int(top_k)
        self.temperature = float(temperature)
        self.first_temperature = None if first_temperature in (None, "", "none") else float(first_temperature)
        self.ban_openers = bool(ban_openers)
        # the whitespace-led event (docs/metrics.md "One event for text and probability"); false: each string
        # scored right after the prompt only, the definition before m028 (bench/leadspace_cost.py compares them)
        self.lead_space = lead_space if isinstance(lead_space, bool) else str(lead_space).lower() != "false"
        # the first-character distribution (`engines.firstchar`, first_char_topk); first_char=false: not read
        self.first_char = first_char if isinstance(first_char, bool) else str(first_char).lower() != "false"
        self.probe_seed = int(probe_seed)
        self.tolerance = float(tolerance)
        self.answer_max_tokens = int(answer_max_tokens)
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"evalkit-hf: tolerance must be in [0, 1), got {tolerance}")
        self.lexicon = load_lexicon()
        self._priors: dict[str, dict[int, float]] = {}
        self._starts: dict[str, set[int]] = {}  # template suffix -> the openers' first tokens after it
        self.set_kv_policy(policy)
        self.caps = self._derive_caps(device)
        if str(self.batch_size).lower().startswith(AUTO_BATCH):
            # lm-eval's own paths (loglikelihood, sampled generation) read the same number, so HFLM
            # never searches for a batch size of its own
            self.batch_size_per_gpu = self.caps.batch_prompts

    def _derive_caps(self, device) -> caps_of.Caps:
        """The batch, position and trie caps of this model (`engines.caps`): under `--batch-size auto` on
        a GPU the budget is a share of the device memory free after the load, else `MEMORY_BUDGET`; an
        explicit batch size is kept."""
        asked = str(self.batch_size).lower()
        auto = asked.startswith(AUTO_BATCH)
        budget = MEMORY_BUDGET
        if auto and str(device).startswith("cuda") and torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info(torch.device(device))
            budget = max(MEMORY_BUDGET, int(free * AUTO_DEVICE_SHARE))
        batch = None if auto else int(asked) if asked.isdigit() else DEFAULT_BATCH_SIZE
        return caps_of.derive(caps_of.shapes_of(self._model), budget, batch)

    def _share_requests(self) -> None:
        """Under a data-parallel launch (torchrun, `accelerate launch`: HFLM made an Accelerator of
        several processes), take this process's global rank and the world size from it, so lm-eval
        gives each rank its share of the documents and gathers the logged samples on rank 0. HFLM
        itself sets them only with more than one CUDA device, and then the rank on the node: on
        CPUs (gloo) every process ran every prompt, and on several nodes the shares overlapped."""
        accelerator = getattr(self, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1:
            self._rank, self._world_size = accelerator.process_index, accelerator.num_processes

    def set_kv_policy(self, policy: kvpolicy.KVPolicy) -> None:
        """Run every later probe under `policy` (a sweep reuses one loaded model for several)."""
        if policy.rounds:
            kvcache.new_cache(policy, self._model, [])  # a backend that cannot load fails here, with one line
        self.kv_policy = policy
        self._priors = {}  # the content-free prior is the policy's too

    # -- loading ----------------------------------------------------------------

    def _create_model(self, pretrained, *, gguf_file=None, quantization_config=None, **kwargs) -> None:
        """HFLM's load, with a load-time `--quant` variant's quantization config given to
        `from_pretrained`; a GGUF model read as a GGUF (the converted-model cache off: else it
        arrives here as its converted folder), which transformers will not quantize on load, is
        loaded first and rebuilt from its own weights with that config. A GPTQ / AWQ
        checkpoint's own config is checked against the variant asked for."""
        asked = quantize.load_config(self.quant)
        if self.quant and quantization.parse(self.quant).quant.how == "checkpoint":
            found = getattr(quantization_config, "quant_method", None) if quantization_config is not None else None
            found = getattr(found, "value", found)
            if str(found or "").lower() != quantization.parse(self.quant).name:
                raise BadInput(f"--quant {self.quant}: {pretrained} is not a {self.quant.upper()} checkpoint "
                               f"(its quantization_config says {found or 'nothing'})")
        if asked is None:
            return super()._create_model(pretrained, gguf_file=gguf_file, quantization_config=quantization_config,
                                         **kwargs)
        if quantization_config is not None:
            raise BadInput(f"--quant {self.quant}: {pretrained} is already quantized "
                           f"({getattr(quantization_config, 'quant_method', '?')}); load it without --quant")
        kwargs.update(quantize.load_kwargs(self.quant, kwargs.get("dtype")))
        if gguf_file:
            super()._create_model(pretrained, gguf_file=gguf_file, **kwargs)
            self._model = quantize.requantize(self._model, self.quant)
            return None
        quantization.check_groups(_skeleton(self.config), self.quant)
        return super()._create_model(pretrained, quantization_config=asked, **kwargs)

    @staticmethod
    def _gguf_path(pretrained, kwargs) -> str | None:
        gguf = kwargs.get("gguf_file")
        if not gguf or not isinstance(pretrained, str):
            return None
        import os

        return gguf if os.path.isabs(gguf) else os.path.join(pretrained, gguf)

    # -- helpers ---------------------------------------------------------------

    def _banned_first_ids(self, context: str) -> frozenset[int]:
        """First tokens of every opener, tokenised after this context, with and without a space."""
        if not self.ban_openers:
            return frozenset()
        return frozenset(shared.first_ids(self.tokenizer, context, shared.opener_variants(self.lexicon.entries)))

    def _opener_starts(self, context: str, doc: dict) -> set[int]:
        """The first tokens the lexicon's openers begin with after this context (`opener_start_mass`), kept
        per template suffix where the suffix begins with an added token (a boundary no merge crosses, so the
        tokens after it do not depend on the prompt). With the whitespace-led event, every first token its
        paths can have (`leadspace.start_ids`), so the mass stays a bound on opener_mass."""
        frame = shared.prompt_frame(context, doc)
        suffix = frame.split("\x00", 1)[1] if frame else ""
        added = [str(getattr(t, "content", t)) for t in (getattr(self.tokenizer, "added_tokens_decoder", None)
                                                          or {}).values()]
        key = suffix if suffix and any(a and suffix.startswith(a) for a in added) else None
        if key is not None and key in self._starts:
            return self._starts[key]
        found = leadspace.start_ids(self.lexicon.entries,
                                    leadspace.lead_vocab(self.tokenizer) if self.lead_space else None,
                                    lambda texts: shared.first_ids(self.tokenizer, context, texts))
        if key is not None:
            self._starts[key] = found
        return found

    def _prior(self, context: str, doc: dict) -> dict[int, float] | None:
        """Content-free prior (top-k dict) for the frame this context was built in."""
        frame = shared.prompt_frame(context, doc)
        if frame is None:
            return None
        if frame not in self._priors:
            self._priors[frame] = content_free_prior(self.model, self.tokenizer, frame, self.top_k, self.kv_policy)
        return self._priors[frame]

    # -- lm-eval API -------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False):
        sampled = [r for r in requests if r.args[1].get("do_sample")]
        if sampled:
            if len(sampled) != len(requests):
                raise ValueError("evalkit-hf: cannot mix sampled and greedy requests in one call")
            if not self.kv_policy.is_full:
                raise BadInput(f"--kv-cache {self.kv_policy.spec}: sampled requests (do_sample) run through "
                               "HFLM's generate, which evalkit's cache policies do not reach; use --kv-cache full")
            self.prompts_computed += len(requests)
            return super().generate_until(requests, disable_tqdm=disable_tqdm)

        if self.world_size > 1 and len({id(r) for r in requests}) < len(requests):
            # lm-eval pads a short rank's share with copies of its last request (even batches for
            # DDP); a greedy answer is the same each time, so each request object is computed once
            unique = list({id(r): r for r in requests}.values())
            done = dict(zip((id(r) for r in unique), self.generate_until(unique, disable_tqdm)))
            return [done[id(r)] for r in requests]
        out: list[Any] = [None] * len(requests)
        # group by generation settings; each group is probed in batches
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        # a terminal gets a bar; a log a line at most every 15 s (progress.LineBar)
        bar = progress_bar(total=len(requests), desc="first-token probe", unit="prompt", bar_format=BAR_FORMAT,
                           disable=disable_tqdm or self.rank != 0)
        keep_ticking(bar)  # its clock moves while a phase says nothing (ends when the bar closes)
        first_done, n_batches, batch_no = 0, sum(-(-len(g) // self._bs()) for g in groups.values()), 0
        bs = self._bs()

        made: dict[tuple[int, int], Any] = {}  # (id of a submission, its row) -> the row's result, made once

        def result_of(tag: tuple, i: int, step) -> Any:
            if (id(tag), i) not in made:
                _, key, contexts, docs, cands = tag
                made[(id(tag), i)] = self._result(contexts[i], docs[i], cands[i], step,
                                                  until_of[key[0]])
            return made[(id(tag), i)]

        def finished(pending: list) -> None:
            """Store the batches whose every continuation has ended (the journal gets what it lacks of them)."""
            for tag, steps in pending:
                chunk, key = tag[0], tag[1]
                results = [result_of(tag, i, step) for i, step in enumerate(steps)]
                for i in range(len(steps)):
                    made.pop((id(tag), i), None)
                if self.journal is not None:
                    self.journal.record(key, results)
                for i, result in zip(chunk, results):
                    out[i] = result

        def journal_rows(prober: firststep.Prober) -> None:
            """Journal each prompt whose continuation has ended, as soon as it has: a kill then loses only
            the prompts in flight. Those that ended in one decode step share one write (`record_rows`).
            Reads the prober's open submissions: `open` maps each to (tag, steps, rows still going)."""
            if self.journal is None:
                return
            ended = [(tag[1], i, len(steps), result_of(tag, i, step))
                     for tag, steps, going in list(prober.open.values())
                     for i, step in enumerate(steps)
                     if step is not None and i not in going and (id(tag), i) not in made]
            if ended:
                self.journal.record_rows(ended)

        until_of: dict[str, list[str]] = {}
        for group, idxs in groups.items():
            # prompts continued to answer_max_tokens share batches, and similar lengths share a batch
            # (little padding)
            idxs.sort(key=lambda i: (not (requests[i].doc or {}).get("answers_full"), -len(requests[i].args[0])))
            gen = requests[idxs[0]].args[1]
            until = gen.get("until") or []
            until = until_of[group] = [until] if isinstance(until, str) else list(until)
            max_new = int(gen.get("max_gen_toks", self.max_gen_toks))
            if not any(self.selection.runs("response", doc_kind(requests[i].doc or {})) for i in idxs):
                max_new = 0  # nothing selected reads these responses (`--metrics`): the first token only
            # every batch of the group is prefilled and scored on its own; their continuations are
            # decoded together, each batch's results kept once its last row has ended
            units = firststep.UNIT_RANKS if self.selection.runs("units", FIRSTTOKEN) else 0
            prober = firststep.Prober(self.model, self.tokenizer, top_k=self.top_k, max_new_tokens=max_new,
                                      stop=until, batch_size=bs, first_temperature=self.first_temperature,
                                      tolerance=self.tolerance, kv_policy=self.kv_policy,
                                      unit_ranks=units, batch_tokens=self.caps.batch_positions,
                                      trie_positions=self.caps.trie_positions, lead_space=self.lead_space,
                                      first_char=self.first_char)
            for start in range(0, len(idxs), bs):
                chunk = idxs[start : start + bs]
                contexts = [requests[i].args[0] for i in chunk]
                docs = [requests[i].doc or {} for i in chunk]
                cands = [self._candidates(d) for d in docs]
                batch_no += 1
                # a batch is defined by its place in the request list and its prompts: a resumed run
                # forms the same batches, and replays those its journal holds
                key = [group, start, contexts, [c.strings for c in cands]]
                held = self.journal.held(key) if self.journal is not None else None
                if held is not None:
                    for i, result in zip(chunk, held):
                        out[i] = result
                else:
                    def moved(phase: str, share: float, base=first_done, n=len(chunk),
                              label=f"batch {batch_no}/{n_batches}", prober=prober):
                        bar.n = base + share * n  # the bar moves within a batch, so its ETA does
                        bar.set_postfix_str(f"{label} {phase}")
                        journal_rows(prober)  # the rows the last decode step ended

                    self.prompts_computed += len(contexts)
                    reads = [self._attention_request(c, d) for c, d in zip(contexts, docs)] if self.attention else None
                    prober.submit(
                        (chunk, key, contexts, docs, cands), contexts, [c.strings for c in cands],
                        exact_candidates=[c.exact for c in cands], attention=reads,
                        answer_tokens=[self.answer_max_tokens if d.get("answers_full")
                                       and self.selection.runs("answer", doc_kind(d)) else 0 for d in docs],
                        seed=self.probe_seed + 7919 * start,  # distinct per chunk, stable per configuration
                        banned_first_ids=self._banned_first_ids(contexts[0]), progress=moved,
                    )
                    journal_rows(prober)
                    finished(prober.ready())
                first_done += len(chunk)
                bar.n = first_done
                bar.refresh()
            def finishing(phase: str, share: float, prober=prober) -> None:
                bar.set_postfix_str(f"finishing: {phase}")
                journal_rows(prober)

            finished(prober.finish(finishing))
            bar.n = first_done
            bar.refresh()
        bar.close()
        return out

    def _bs(self) -> int:
        return self.caps.batch_prompts

    def _candidates(self, doc: dict) -> Candidates:
        """Answer-start strings, checkable answers (answer_prob) and lexicon openers, each set empty where
        the run's selection skips its trie."""
        return candidates(self.selection, doc, self.lexicon.entries)

    def _attention_request(self, context: str, doc: dict) -> attn.Request:
        """The spans whose attention mass a prompt's prefill should give: the needle sentence of a
        needle doc, the question of a first-token doc where a template surrounds it."""
        kind, spans = doc_kind(doc), {}
        named = {NEEDLE: ("needle_attn", doc.get("needle")), FIRSTTOKEN: ("question_attn", doc.get("prompt"))}
        name, text = named.get(kind, (None, None))
        if isinstance(text, str) and text.strip() and context.count(text) == 1 and context.strip() != text.strip():
            start = context.index(text)
            span = attn.token_span(self.tokenizer, context, start, start + len(text))
            if span is not None:
                spans[name] = span
        return attn.Request(spans)

    @staticmethod
    def _attention_values(read: attn.PromptAttention) -> tuple[dict[str, float], dict[str, list[float]]]:
        """(per-sample values, per-layer values) of one prompt's prefill attention."""
        metrics = {"sink_rate": read.sink_rate()}
        layers = {"sink_rate": read.sink_rate_by_layer(), "sink_score": read.sink_score_by_layer()}
        for name in read.spans:
            metrics[name] = read.span(name)
            layers[name] = read.span_by_layer(name)
        return metrics, layers

    def _result(self, context, doc, cands: Candidates, step: firststep.FirstStep, until) -> FirstStepResult:
        kind = doc_kind(doc)
        decoded = self.selection.runs("response", kind)  # else no response was generated (`--metrics`)
        text: str | None = None
        unit: str | None = None
        if decoded:
            text = self.tok_decode(step.response_ids, skip_special_tokens=True)
            for stop in until:
                if stop and stop in text:
                    text = text.split(stop, 1)[0]
            unit, _ = firststep.first_unit_ids(
                lambda ids: self.tok_decode(ids, skip_special_tokens=True), step.response_ids
            )
        topk = [
            (int(t), self.tok_decode([int(t)], skip_special_tokens=False), float(lp))
            for t, lp in zip(step.topk_ids, step.topk_logprobs)
        ]
        top3 = firststep.top_mass(step.logprobs, 3, self.temperature)
        metrics: dict[str, float] = {
            "top1_prob": math.exp(step.topk_logprobs[0]),
            "top3_mass": top3,
            "unstable": unstable(top3),
            "entropy": step.entropy,
            "special_mass": shared.special_mass(step.logprobs, self.tokenizer),  # degenerate output's signal
        }
        if kind == FIRSTTOKEN and doc.get("answers"):
            metrics.update(candidate_metrics(self.tokenizer, context, step, list(cands.starts), list(cands.openers),
                                             self._prior(context, doc), list(cands.answers)))
            metrics["opener_start_mass"] = shared.start_mass(step.logprobs, self._opener_starts(context, doc))
        layers: dict[str, list[float]] = {}
        if step.attention is not None:
            values, layers = self._attention_values(step.attention)
            metrics.update(values)
        # without a response, the token chosen at step 1 (what a response would have begun with)
        first_id = step.response_ids[0] if step.response_ids else None if decoded else step.first_token_id
        answer = self.tok_decode(step.answer_ids, skip_special_tokens=True) if step.answer_ids else None
        result = FirstStepResult(
            text=text,
            first_token_id=first_id,
            first_token=self.tok_decode([first_id]) if first_id is not None else "",
            first_unit=unit,
            topk=topk,
            entropy=step.entropy,
            metrics=metrics,
            answer_text=answer,
            units=step.units,
            layers=layers,
            token_ids=list(step.answer_ids or step.response_ids),
            skipped=self.skipped,
        )
        firstchar.attach(result, step.first_chars)
        shown = doc.get("prompt") if isinstance(doc.get("prompt"), str) else context
        # the same checks at the boundary as every other engine's (finite, logprob <= 0, mass <= 1, ranges)
        return validate.check_result(result, source="transformers", prompt=shown)
