"""lm-eval model type `evalkit-server` (`--model server`): an OpenAI-compatible server's logprobs as a first step.

Owns: talking to `/v1/completions` of a server (vLLM serve, SGLang, TGI, llama.cpp's server,
llama-cpp-python's) with a bounded number of parallel requests, retries and a timeout
(`server.client`), and turning its answers into the `FirstStepResult` `evalkit-hf` returns:
- first step: the completion's first `top_logprobs`, K = min(--top-k, what the server allows),
  mapped to token ids with the run's tokenizer (a token text that several ids share is left
  out of the stored top-k, and counted in `unmapped_topk`);
- text, first token, first unit and the answer continuation: from the completion;
- `ft_hit_prob`: from prompt logprobs (`echo` with `logprobs`): one request per accepted start,
  the prompt followed by the start; the start's tokens are those the server put at or after the
  prompt's end. Before it trusts them, the backend checks once that the server's echoed
  logprob of its own greedy first token equals that token's first-step logprob (llama-cpp-python
  0.3.x pairs each echoed token with the distribution one position late when the model adds no
  BOS, which this check catches). Only the start right after the prompt is echoed: the whitespace-led
  paths of the exact engines (" Paris", "\n\n" then "Paris"; docs/metrics.md "One event for text and
  probability") would need one echo per whitespace prefix and string, so here ft_hit_prob is a lower
  bound of the event, and `ws_mass` is NULL;
- `ft_token_hit`, `top1_prob`, and `top3_mass` / `unstable` at T = 1 (the K logprobs fix the
  T = 1 top-3 mass; at T ≠ 1 its normaliser needs the whole vocabulary);
- `prior_drift` when K ≥ 50 (the support rule of docs/metrics.md §1.3), the prior from the same server.
A metric it cannot compute stays NULL, and its reason is in `unavailable` (the run row's
`unavailable` column): entropy (the whole vocabulary), opener_mass (one echo request per
lexicon entry per prompt), and whatever the checks above rule out.
This is how evalkit reaches a model served on many GPUs: the distributed engine is the server.
Does not: start servers, apply a chat template the server would (the prompt is rendered here,
with the tokenizer's template, and sent as text), score text, or store.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from evalkit.progress import bar as progress_bar

from evalkit import envvars
from evalkit.engines import firststep
from evalkit.defaults import (
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_MAX_GEN_TOKS,
    DEFAULT_SERVER_CONCURRENCY,
    DEFAULT_SERVER_LOGPROBS,
    DEFAULT_SERVER_RETRIES,
    DEFAULT_SERVER_TIMEOUT_S,
    DEFAULT_TEMPERATURE,
    MIN_TOP_K,
)
from evalkit.contract import FIRSTTOKEN, FirstStepResult, doc_kind
from evalkit.engines import tokenizer_id, validate
from evalkit.engines.server.client import Client, ServerError, completion, served_models
from evalkit.errors import BadInput
from evalkit.prompts.encoding import raw_ids
from evalkit.scoring import stats
from evalkit.scoring.firsttoken import answer_strings, candidate_strings, unstable
from evalkit.scoring.selection import EVERYTHING, Selection
from evalkit.scoring.text import drop_covered

ECHO_TOLERANCE = 1e-3  # nats: the echo check's allowance for the server's own float rounding
ECHO_PROBE = "The capital of France is"  # the echo check's prompt
CONTENT_FREE = ("N/A", "", "…", "无")


def load_tokenizer(path: str):
    """The run's tokenizer: a .gguf file read vocabulary-only by llama.cpp (`GGUFTokenizer`), or a
    transformers tokenizer folder; each through the door first (`paths.check_input_path`), and any
    error of the library one BadInput line naming the path (`loaderrors.loading`)."""
    from evalkit.loaderrors import loading
    from evalkit.paths import check_input_path

    if path.endswith(".gguf"):
        from evalkit.engines.llamacpp.tokenizer import GGUFTokenizer
        from evalkit.engines.llamacpp.firststep import LlamaCppEngine

        check_input_path(path, "tokenizer", "file")
        with loading("tokenizer", path):
            return GGUFTokenizer(LlamaCppEngine(path, vocab_only=True))
    from transformers import AutoTokenizer

    check_input_path(path, "tokenizer", "folder")
    with loading("tokenizer", path):
        return AutoTokenizer.from_pretrained(path)


def piece_ids(tokenizer) -> dict[str, int]:
    """{token text: id} for the texts exactly one token decodes to alone, or whose one canonical token
    (the text tokenises to it alone) settles a tie; a server names top tokens by text."""
    by_text: dict[str, list[int]] = {}
    for i in range(len(tokenizer)):
        by_text.setdefault(tokenizer.decode([i]), []).append(i)
    out = {}
    for text, ids in by_text.items():
        if len(ids) == 1:
            out[text] = ids[0]
        elif text:
            alone = raw_ids(tokenizer, text)
            if len(alone) == 1 and alone[0] in ids:
                out[text] = alone[0]
    return out


def ranked(top: dict[str, float] | None, k: int) -> list[tuple[str, float]]:
    """One position's top_logprobs (text -> logprob) as [(text, logprob)], best first, at most k.

    >>> ranked({"a": -2.0, "b": -0.5, "c": -1.0}, 2)
    [('b', -0.5), ('c', -1.0)]
    """
    return sorted((top or {}).items(), key=lambda kv: (-kv[1], kv[0]))[:k]


@register_model("evalkit-server")
class EvalkitServer(LM):
    """An OpenAI-compatible server. Model args: base_url, model, tokenizer (a .gguf file or tokenizer
    folder: the chat template, and token texts to ids), top_logprobs (the server's cap,
    `DEFAULT_SERVER_LOGPROBS` by default),
    concurrency, retries, timeout (seconds a request may take, all of it), run_timeout (seconds every
    request of the run may take together; none by default), answer_max_tokens, repeat_penalty (sent as
    llama.cpp servers' `repeat_penalty`: llama-cpp-python's server penalises repeats by 1.1 unless told 1,
    even at temperature 0, so its "greedy" text is not the model's); evalkit's own: top_k, temperature,
    seed. Every answer's shape and every number in it is checked (`completion`, `validate`).
    Under `evalkit run --metrics` (`select`) a completion not read past its first step asks for one token,
    and the echo requests of a skipped probability are not sent."""

    selection: Selection = EVERYTHING  # what to compute (`select`)
    skipped: tuple[str, ...] = ()  # the registry metrics the selection leaves uncomputed

    def select(self, chosen: Selection) -> None:
        self.selection, self.skipped = chosen, tuple(sorted(chosen.skipped()))

    def __init__(self, base_url: str, *, model: str | None = None, tokenizer: str | None = None,
                 top_logprobs: int = DEFAULT_SERVER_LOGPROBS, concurrency: int = DEFAULT_SERVER_CONCURRENCY,
                 retries: int = DEFAULT_SERVER_RETRIES, timeout: int = DEFAULT_SERVER_TIMEOUT_S,
                 answer_max_tokens: int = DEFAULT_ANSWER_TOKENS, top_k: int = DEFAULT_SERVER_LOGPROBS,
                 temperature: float = DEFAULT_TEMPERATURE, seed: int = 0, batch_size: Any = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 repeat_penalty: float | None = None, run_timeout: float | None = None,
                 api_key_env: str | None = None) -> None:
        super().__init__()
        if not tokenizer:
            raise BadInput("--model server needs --model-args tokenizer=PATH (a .gguf file or tokenizer folder): "
                           "the chat template, and the ids of the token texts a server returns")
        self.client = Client(base_url, timeout=timeout, retries=retries, run_timeout=run_timeout,
                             api_key=envvars.api_key(api_key_env))
        self.base_url = self.client.shown  # what a bar or a message shows: credentials as ***
        try:
            listed = self.client.get("/models")
        except ServerError as exc:
            raise BadInput(f"the server at {self.base_url} does not answer: {exc}") from None
        self.served_model = model or served_models(listed, self.base_url)[0]
        self.tokenizer = load_tokenizer(str(tokenizer))
        self.tokenizer_id = tokenizer_id.at_load(self.tokenizer, f"server tokenizer={tokenizer}")
        self.ids = piece_ids(self.tokenizer)
        self.k = min(int(top_k), int(top_logprobs))
        self.temperature = float(temperature)
        self.seed = int(seed)
        self.concurrency = int(concurrency)
        self.answer_max_tokens = int(answer_max_tokens)
        self.max_gen_toks = int(max_gen_toks)
        self.repeat_penalty = None if repeat_penalty is None else float(repeat_penalty)
        self.unmapped = 0  # top-k entries whose text names no single token id
        self._priors: dict[str, dict[int, float] | None] = {}
        self.unavailable: dict[str, str] = {
            "entropy": "a server returns K logprobs, not the whole vocabulary",
            "opener_mass": "needs one echo request per opener lexicon entry for every prompt",
            "opener_start_mass": "needs the first-step probability of every opener's first token; a server "
                                 "returns K logprobs, not the whole vocabulary",
            "special_mass": "needs the first-step probability of every special token; a server returns K "
                            "logprobs, not the whole vocabulary (the degenerate-output check reads the responses)",
            "ws_mass": "needs the first-step probability of every whitespace-only token; a server returns K "
                       "logprobs, not the whole vocabulary",
        }
        if self.temperature != 1.0:
            self.unavailable["top3_mass"] = (f"top3_mass@T={self.temperature:g} needs the whole vocabulary; "
                                             "K logprobs fix it at T = 1 only (--temperature 1)")
            self.unavailable["unstable"] = self.unavailable["top3_mass"]
        self._echo_ok = self._check_echo()
        if "ft_hit_prob" in self.unavailable:  # answer_prob is read from the same echo
            self.unavailable["answer_prob"] = self.unavailable["ft_hit_prob"]
        if self.k < MIN_TOP_K:
            self.unavailable["prior_drift"] = (f"the server gives K = {self.k} logprobs; prior_drift's support rule "
                                               f"needs K >= {MIN_TOP_K} (top_logprobs=50 where the server allows it)")

    # -- lm-eval interface --------------------------------------------------------------

    @property
    def max_length(self) -> int | None:
        return None

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "server")).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        import jinja2

        try:
            return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)
        except jinja2.exceptions.TemplateError:
            chat_history = [m for m in chat_history if m["role"] != "system"]
            return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)

    def generate_until(self, requests, disable_tqdm: bool = False):
        bar = progress_bar(total=len(requests), desc=f"first step ({self.base_url})", unit="prompt",
                           disable=disable_tqdm)

        def one(req):
            try:
                return self._one(req.args[0], req.args[1], req.doc or {})
            finally:
                bar.update(1)

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            out = list(pool.map(one, requests))
        bar.close()
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """log P(continuation | context) from the server's prompt logprobs (echo), and whether each
        continuation token was the server's top-1."""
        def one(req):
            context, continuation = req.args
            lp, greedy = self._echo(context, continuation, top=1)
            if lp is None:
                raise ServerError(f"the server merged the context's end into the continuation {continuation!r}")
            return lp, greedy

        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(one, requests))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError("evalkit-server: loglikelihood_rolling is not implemented (use --model llamacpp "
                                  "or hf for perplexity tasks)")

    # -- one request ----------------------------------------------------------------------

    def _complete(self, prompt: str, **body: Any) -> dict:
        payload = {"prompt": prompt, "seed": self.seed, **body}
        if self.repeat_penalty is not None:  # llama.cpp servers' own field (llama-cpp-python's defaults to 1.1)
            payload["repeat_penalty"] = self.repeat_penalty
        if self.served_model:
            payload["model"] = self.served_model
        return completion(self.client.post("/completions", payload), self.client.shown + "/completions")

    @property
    def source(self) -> str:
        return f"the server at {getattr(self, 'base_url', '?')}"

    def _echo(self, context: str, continuation: str, top: int = 0) -> tuple[float | None, bool]:
        """(log P(continuation | context) from echoed prompt logprobs or None where the server's
        tokens straddle the boundary, every continuation token the top-1)."""
        choice = self._complete(context + continuation, max_tokens=1, temperature=0.0, echo=True, logprobs=max(top, 1))
        lp = choice["logprobs"]
        offsets, values, tops = lp["text_offset"], lp["token_logprobs"], lp["top_logprobs"]
        if len(values) != len(offsets):
            raise ServerError(f"{self.source} echoed {len(offsets)} token offsets and {len(values)} logprobs")
        validate.check_logprobs(values, source=self.source, prompt=context + continuation)
        start, end = len(context), len(context) + len(continuation)
        picked = [j for j, off in enumerate(offsets) if start <= off < end]
        if not picked or offsets[picked[0]] != start or any(values[j] is None for j in picked):
            return None, False
        greedy = all(j < len(tops) and tops[j] and max(tops[j].values()) <= values[j] + 1e-9 for j in picked)
        return float(sum(values[j] for j in picked)), greedy

    def _one(self, context: str, gen: dict, doc: dict) -> FirstStepResult | str:
        until = gen.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(gen.get("max_gen_toks", self.max_gen_toks))
        if gen.get("do_sample"):
            choice = self._complete(context, max_tokens=max_new, temperature=float(gen.get("temperature") or 1.0),
                                    stop=until or None)
            return _cut(choice["text"], until)
        kind = doc_kind(doc)
        decoded = self.selection.runs("response", kind)  # else one token: the first step alone (`--metrics`)
        answers_full = bool(doc.get("answers_full")) and self.selection.runs("answer", kind)
        limit = max(max_new if decoded else 1, self.answer_max_tokens) if answers_full else max_new if decoded else 1
        body: dict[str, Any] = {"max_tokens": limit, "temperature": 0.0, "logprobs": self.k}
        if until and not answers_full:
            body["stop"] = until
        choice = self._complete(context, **body)
        full = choice["text"]
        lp = choice["logprobs"]
        tops = lp["top_logprobs"]
        shown = doc.get("prompt") if isinstance(doc.get("prompt"), str) else context
        first = ranked(tops[0] if tops else None, self.k)
        validate.check_values(first, source=self.source, prompt=shown)
        top = []
        for piece, value in first:
            if piece in self.ids:
                top.append((self.ids[piece], piece, float(value)))
            else:
                self.unmapped += 1
        text: str | None = None
        unit: str | None = None
        if decoded:
            text = _cut(full, until)
            if answers_full:  # the response as it would have stopped: at a stop string or max_gen_toks
                text = _cut(_first_tokens(self.tokenizer, full, max_new), until)
            ids = raw_ids(self.tokenizer, text)
            unit, _ = firststep.first_unit_ids(lambda xs: self.tokenizer.decode(xs, skip_special_tokens=True), ids)
        metrics: dict[str, float] = {}
        if top:
            metrics["top1_prob"] = math.exp(top[0][2])
        if len(top) >= 3 and self.temperature == 1.0:
            metrics["top3_mass"] = sum(math.exp(v) for _, _, v in top[:3])
            metrics["unstable"] = unstable(metrics["top3_mass"])
        if kind == FIRSTTOKEN and doc.get("answers"):  # an echo the selection skips is not sent (`--metrics`)
            starts = candidate_strings(doc["answers"])
            if top and self.selection.runs("start_trie", kind):
                metrics["ft_token_hit"] = 1.0 if top[0][0] in firststep.first_ids(self.tokenizer, context, starts) else 0.0
            hit = self._ft_hit_prob(context, starts, top) if self.selection.runs("start_trie", kind) else None
            if hit is not None:
                metrics["ft_hit_prob"] = hit
            # the same echo, on the checkable answers (text-level covering)
            if doc.get("answers_full") and self.selection.runs("answer_trie", kind):
                prob = self._ft_hit_prob(context, drop_covered(answer_strings(doc["answers_full"])), top)
                if prob is not None:
                    metrics["answer_prob"] = prob
            prior = self._prior(context, doc)
            if prior is not None and top:
                metrics["prior_drift"] = stats.prior_drift({t: math.exp(v) for t, _, v in top}, prior)
        first_tokens = lp["tokens"]
        first_text = first_tokens[0] if first_tokens else ""
        result = FirstStepResult(
            text=text,
            first_token_id=self.ids.get(first_text) if first_text else None,
            first_token=first_text,
            first_unit=unit,
            topk=[(t, s, v) for t, s, v in top],
            entropy=None,
            metrics=metrics,
            answer_text=full if answers_full else None,
            skipped=self.skipped,
        )
        return validate.check_result(result, source=self.source, prompt=shown)

    def _check_echo(self) -> bool:
        """Whether the server's prompt logprobs (echo) can be trusted, checked once before the run: the
        echoed logprob of its own greedy next token after ECHO_PROBE must equal that token's completion
        logprob. When it does not (or the server has no echo), ft_hit_prob is NULL with the reason."""
        try:
            choice = self._complete(ECHO_PROBE, max_tokens=1, temperature=0.0, logprobs=1)
            lp = choice["logprobs"]
            if not lp["tokens"] or lp["token_logprobs"][:1] in ([], [None]):
                raise ServerError(f"{self.source} gave no logprob for its first token")
            text, value = lp["tokens"][0], float(lp["token_logprobs"][0])
            validate.check_logprobs([value], source=self.source, prompt=ECHO_PROBE, what="logprob")
            echoed, _ = self._echo(ECHO_PROBE, text)
        except (ServerError, IndexError) as exc:
            self.unavailable["ft_hit_prob"] = f"the server gives no prompt logprobs (echo with logprobs): {exc}"
            return False
        if echoed is None or abs(echoed - value) > ECHO_TOLERANCE:
            self.unavailable["ft_hit_prob"] = (
                f"the server's prompt logprobs (echo) are misaligned: after {ECHO_PROBE!r} its greedy token "
                f"{text!r} has logprob {value:.4f} in the completion and {echoed} echoed")
            return False
        return True

    def _ft_hit_prob(self, context: str, starts: list[str], top) -> float | None:
        """Σ P(start | context) from echoed prompt logprobs; None when the server's echo is not trusted
        (`_check_echo`) or a start's tokens straddle the prompt's end."""
        if not self._echo_ok:
            return None
        total = 0.0
        for start in starts:
            lp, _ = self._echo(context, start)
            if lp is None:
                    return None  # the server's tokens of a start straddle the prompt's end: NULL for this prompt
            total += math.exp(lp)
        return total

    def _prior(self, context: str, doc: dict) -> dict[int, float] | None:
        """The content-free prior from the same server (K >= 50 only), per prompt frame."""
        if self.k < MIN_TOP_K:
            return None
        frame = firststep.prompt_frame(context, doc)
        if frame is None:
            return None
        if frame not in self._priors:
            sums: dict[int, float] = {}
            contexts = [c for c in (frame.replace("\x00", cf) for cf in CONTENT_FREE) if c.strip()]
            for c in contexts:
                choice = self._complete(c, max_tokens=1, temperature=0.0, logprobs=self.k)
                tops = choice["logprobs"]["top_logprobs"] or [None]
                first = ranked(tops[0], self.k)
                validate.check_values(first, source=self.source, prompt=repr(c))
                for text, value in first:
                    if text in self.ids:
                        sums[self.ids[text]] = sums.get(self.ids[text], 0.0) + math.exp(value) / len(contexts)
            self._priors[frame] = dict(sorted(sums.items(), key=lambda kv: -kv[1])[: self.k])
        return self._priors[frame]


def _cut(text: str, until: list[str]) -> str:
    for s in until:
        if s and s in text:
            text = text.split(s, 1)[0]
    return text


def _first_tokens(tokenizer, text: str, n: int) -> str:
    """The text of the first n tokens of `text` as the tokenizer splits it."""
    ids = raw_ids(tokenizer, text)
    return tokenizer.decode(ids[:n], skip_special_tokens=True) if len(ids) > n else text
