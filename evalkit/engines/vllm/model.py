"""lm-eval model type `evalkit-vllm`: lm-eval's VLLM whose generate_until also returns the first step.

Owns: asking vLLM for the top-K logprobs of each greedy request's generated tokens
(`SamplingParams(logprobs=K)`) and turning the first step into the
`FirstStepResult` `evalkit-hf` returns: text, first token, first unit, top-K, and
the metrics those logprobs fix exactly. Does not: score text (the task's `process_results` does),
store, or talk to an OpenAI-compatible server (lm-eval's `local-completions` does,
with text-level metrics only).

What vLLM's first-step logprobs give, and what they do not:
- K = min(top_k, the engine's `max_logprobs`). vLLM's `max_logprobs` defaults to 20
  (the OpenAI API's cap on `top_logprobs`, which vLLM's server keeps), so a run
  stores 20 top-k rows per prompt, not the 50 of `evalkit-hf`, unless the engine
  is started with `--model-args ...,max_logprobs=50`.
- The values are vLLM's default `logprobs_mode="raw_logprobs"`: log-softmax of the
  model's logits before temperature or any logits processor, i.e. the T = 1
  first-token distribution, exact for the K tokens returned. An engine started
  with a `processed_*` logprobs mode breaks that; evalkit does not check.
- `top3_mass` and `unstable`: exact at T = 1 (the sum of the three largest
  probabilities). top3_mass@T for T != 1 renormalises p**(1/T) over the whole
  vocabulary; the K tokens returned bound that normaliser but do not fix it, so
  at T != 1 both are left out (`--temperature 1` gets them).
- `ft_token_hit`: the rank-1 first token against the first token of each accepted
  start tokenised in context, the rule `evalkit-hf` uses.
- Left out: `entropy` (needs the whole vocabulary), `prior_drift` (its support
  rule needs k >= 50, docs/metrics.md §1.3, and the content-free prior's mean distribution),
  `ft_hit_prob` and `opener_mass` (teacher-forced candidate strings: vLLM's
  `prompt_logprobs` could give them exactly, but at one more full-prompt request
  per candidate, about 120 per prompt with the opener lexicon), and with them their whitespace-led
  paths and `ws_mass` (the first-step mass of every whitespace-only token needs the whole vocabulary).

Sampled requests (temperature > 0 after lm-eval's normalisation: the sampled
protocol) go to VLLM's own generate_until unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    maybe_truncate,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.models.vllm_causallms import VLLM
from vllm import SamplingParams

from evalkit.engines import firststep, tokenizer_id, validate
from evalkit.progress import bar as progress_bar
from evalkit.engines.vllm.resolve import logprobs_k
from evalkit.contract import FIRSTTOKEN, FirstStepResult, doc_kind
from evalkit.defaults import DEFAULT_TEMPERATURE, DEFAULT_TOP_K
from evalkit.prompts.encoding import encode, parse_add_bos, set_feed
from evalkit.scoring.firsttoken import candidate_strings, unstable

log = logging.getLogger(__name__)

def step_topk(step: dict[int, Any] | None, k: int) -> list[tuple[int, float]]:
    """One position's vLLM logprobs (token_id -> Logprob) as [(token_id, logprob)], best first, at most k.

    vLLM puts the sampled token first and then ranks 1..n; `rank` orders them
    (older vLLM: a bare float, or no rank, is ordered by value).

    >>> from types import SimpleNamespace as L
    >>> step_topk({7: L(logprob=-2.0, rank=3), 5: L(logprob=-0.1, rank=1), 9: L(logprob=-1.0, rank=2)}, 2)
    [(5, -0.1), (9, -1.0)]
    >>> step_topk(None, 5)
    []
    """
    if not step:
        return []
    entries = []
    for token_id, lp in step.items():
        value = float(getattr(lp, "logprob", lp))
        rank = getattr(lp, "rank", None)
        entries.append((rank if rank is not None else math.inf, -value, int(token_id), value))
    entries.sort()
    return [(token_id, value) for _, _, token_id, value in entries[:k]]


def first_step_result(
    text: str,
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Any]] | None,
    *,
    k: int,
    temperature: float,
    decode: Callable[[list[int], bool], str],
    answer_first_ids: set[int] | None = None,
    eos_ids: set[int] | frozenset = frozenset(),
) -> FirstStepResult:
    """The `FirstStepResult` of one vLLM completion (`RequestOutput.outputs[0]`).

    `text`: the completion cut at its stop strings; `token_ids`, `logprobs`: the
    completion's (one token_id -> Logprob dict per generated token); `decode(ids,
    skip_special_tokens)`; `answer_first_ids`: first tokens of the accepted starts in
    context (None: the doc has none). Metrics hold only what the top-K logprobs fix
    exactly; `entropy` is None (unknown), not 0.
    """
    ids = [int(t) for t in token_ids]
    if ids and ids[-1] in eos_ids:  # vLLM keeps the eos that ended the completion; evalkit-hf does not
        ids = ids[:-1]
    top = step_topk(logprobs[0] if logprobs else None, k)
    unit, _ = firststep.first_unit_ids(lambda xs: decode(xs, True), ids)
    metrics: dict[str, float] = {}
    if len(top) >= 3 and temperature == 1.0:
        top3 = sum(math.exp(lp) for _, lp in top[:3])
        metrics["top3_mass"] = top3
        metrics["unstable"] = unstable(top3)
    if answer_first_ids is not None and top:
        metrics["ft_token_hit"] = 1.0 if top[0][0] in answer_first_ids else 0.0
    first_id = ids[0] if ids else None
    return FirstStepResult(
        text=text,
        first_token_id=first_id,
        first_token=decode([first_id], True) if first_id is not None else "",
        first_unit=unit,
        topk=[(t, decode([t], False), lp) for t, lp in top],
        entropy=None,
        metrics=metrics,
    )


def is_greedy(gen_kwargs: dict[str, Any]) -> bool:
    """Greedy after lm-eval's normalisation (do_sample false, or no temperature > 0).

    >>> is_greedy({"do_sample": False, "temperature": 0.8}), is_greedy({"do_sample": True, "temperature": 0.8})
    (True, False)
    """
    return float(normalize_gen_kwargs(dict(gen_kwargs)).get("temperature") or 0.0) == 0.0


@register_model("evalkit-vllm")
class EvalkitVLLM(VLLM):
    """lm-eval's VLLM plus the first step from vLLM's logprobs. Extra model args: top_k
    (asked for; capped at the engine's max_logprobs, default 20) and temperature (the
    T of top3_mass@T; only T = 1 is exact from logprobs). Every other arg goes to VLLM
    and on to `vllm.LLM` (e.g. max_logprobs=50, gpu_memory_utilization=0.8)."""

    def __init__(self, pretrained, *, top_k: int = DEFAULT_TOP_K, temperature: float = DEFAULT_TEMPERATURE,
                 add_bos_token: Any = None, **kwargs: Any) -> None:
        super().__init__(pretrained, **kwargs)
        self.feed = set_feed(self.tokenizer, parse_add_bos(add_bos_token))  # the ids fed: `prompts.encoding`
        self.add_bos_token = self.feed.bos
        self.tokenizer_id = tokenizer_id.at_load(self.tokenizer, f"vllm {pretrained}")
        self.top_k = int(top_k)
        self.temperature = float(temperature)
        self.logprobs_k = logprobs_k(self.top_k, self._max_logprobs())
        if self.logprobs_k < self.top_k:
            log.warning("evalkit-vllm: vLLM returns at most %d logprobs per token; storing top-%d, not top-%d",
                        self.logprobs_k, self.logprobs_k, self.top_k)
        if self.temperature != 1.0:
            log.warning("evalkit-vllm: top3_mass@T=%g needs the whole first-token distribution; "
                        "vLLM's top-%d logprobs fix it only at T=1, so it is left out", self.temperature, self.logprobs_k)

    def _max_logprobs(self) -> int | None:
        """The engine's max_logprobs (None: not known here, vLLM's default applies)."""
        engine = getattr(getattr(self, "model", None), "llm_engine", None)
        value = getattr(getattr(engine, "model_config", None), "max_logprobs", None)
        if value is None:
            value = self.model_args.get("max_logprobs")
        return None if value is None else int(value)

    def generate_until(self, requests, disable_tqdm: bool = False):
        greedy = [i for i, r in enumerate(requests) if is_greedy(r.args[1])]
        sampled = sorted(set(range(len(requests))) - set(greedy))
        out: list[Any] = [None] * len(requests)
        if sampled:
            texts = super().generate_until([requests[i] for i in sampled], disable_tqdm=disable_tqdm)
            for i, text in zip(sampled, texts):
                out[i] = text
        if greedy:
            for i, result in zip(greedy, self._probe([requests[i] for i in greedy], disable_tqdm)):
                out[i] = result
        return out

    def _probe(self, requests, disable_tqdm: bool) -> list[FirstStepResult]:
        """Greedy requests with logprobs=K, in request order."""
        eos = self.tokenizer.decode(self.eot_token_id) or getattr(self.tokenizer, "eos_token", None) or ""
        contexts = [r.args[0] for r in requests]
        encodings = [encode(self.tokenizer, c) for c in contexts]
        prompts, params, untils = [], [], []
        for toks, req in zip(encodings, requests):
            kwargs, until, max_gen = self.modify_gen_kwargs(req.args[1], eos=eos, default_max_gen_toks=self.max_gen_toks)
            toks, max_gen = maybe_truncate(
                toks, max_gen_toks=max_gen, max_model_len=self.max_length, side=self.truncation_side, verbose=True
            )
            stop = [s for s in until if s == eos] if self.think_end_token else until  # as VLLM.generate_until
            prompts.append(toks)
            params.append(SamplingParams(max_tokens=max_gen, stop=stop, logprobs=self.logprobs_k, **kwargs))
            untils.append(until)
        bs = len(prompts) if self.batch_size == "auto" else int(self.batch_size)
        outputs: list[Any] = []
        bar = progress_bar(total=len(prompts), desc="first-token probe (vLLM)", unit="prompt",
                           disable=disable_tqdm or self.rank != 0)
        for start in range(0, len(prompts), bs):
            chunk = self._model_generate(prompts[start : start + bs], generate=True, sampling_params=params[start : start + bs])
            outputs.extend(chunk)
            bar.update(len(chunk))
        bar.close()

        def decode(ids: list[int], skip_special_tokens: bool) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

        eos_ids = {int(i) for i in (self.eot_token_id, getattr(self.tokenizer, "eos_token_id", None)) if i is not None}
        results = []
        for req, context, until, output in zip(requests, contexts, untils, outputs):
            completion = output.outputs[0]
            doc = req.doc or {}
            result = first_step_result(
                postprocess_generated_text(completion.text, until, self.think_end_token),
                completion.token_ids, completion.logprobs,
                k=self.logprobs_k, temperature=self.temperature, decode=decode,
                answer_first_ids=self._answer_first_ids(context, doc), eos_ids=eos_ids,
            )
            shown = doc.get("prompt") if isinstance(doc.get("prompt"), str) else context
            results.append(validate.check_result(result, source="vLLM", prompt=shown))
        return results

    def _answer_first_ids(self, context: str, doc: dict) -> set[int] | None:
        """First tokens of the doc's accepted starts tokenised after this context (None: no answers)."""
        if doc_kind(doc) != FIRSTTOKEN or not doc.get("answers"):
            return None
        return firststep.first_ids(self.tokenizer, context, candidate_strings(doc["answers"]))
