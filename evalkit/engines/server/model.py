"""lm-eval model type `evalkit-server` (`--model server`): an OpenAI-compatible server's logprobs as a first step.

Owns: talking to `/v1/completions` of a server (vLLM serve, SGLang, TGI, llama.cpp's server,
llama-cpp-python's) with a bounded number of parallel requests, retries and a timeout
(`Client`), and turning its answers into the `FirstStepResult` `evalkit-hf` returns:
- first step: the completion's first `top_logprobs`, K = min(--top-k, what the server allows),
  mapped to token ids with the run's tokenizer (a token text that several ids share is left
  out of the stored top-k, and counted in `unmapped_topk`);
- text, first token, first unit and the answer continuation: from the completion;
- `ft_hit_prob`: from prompt logprobs (`echo` with `logprobs`): one request per accepted start,
  the prompt followed by the start; the start's tokens are those the server put at or after the
  prompt's end. Before it trusts them, the backend checks once that the server's echoed
  logprob of its own greedy first token equals that token's first-step logprob (llama-cpp-python
  0.3.x pairs each echoed token with the distribution one position late when the model adds no
  BOS, which this check catches);
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

import http.client
import json
import math
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

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
from evalkit.engines import validate
from evalkit.errors import BadInput, RunFailed
from evalkit.scoring import stats
from evalkit.scoring.firsttoken import answer_strings, candidate_strings, unstable
from evalkit.scoring.selection import EVERYTHING, Selection
from evalkit.scoring.text import drop_covered

ECHO_TOLERANCE = 1e-3  # nats: the echo check's allowance for the server's own float rounding
ECHO_PROBE = "The capital of France is"  # the echo check's prompt
CONTENT_FREE = ("N/A", "", "…", "无")


MAX_RESPONSE_BYTES = 64 << 20  # one completion's JSON; a server sending more is refused, not read on


class ServerError(RunFailed):
    """The server did not answer a request in time after every retry, or answered something that is not
    an OpenAI-compatible answer; the message is one line saying what the server did."""


class Client:
    """POSTs to an OpenAI-compatible API root, each request retried `retries` times (1 s, 2 s, 4 s ...
    apart) on a connection error, a timeout, HTTP 429 or 5xx; another HTTP error is final.

    `timeout` is a deadline for the whole request (connect, headers and body), not per socket read: a
    watchdog shuts the socket when it passes, so a server trickling one byte every 0.5 s cannot hold a
    request past it. `run_timeout` (None: none) is a deadline for every request of the run together,
    counted from the client's creation; no request or retry starts after it, and none runs past it.
    Answers are JSON of at most `MAX_RESPONSE_BYTES`, with no object key given twice."""

    def __init__(self, base_url: str, *, timeout: float = 120, retries: int = 3,
                 run_timeout: float | None = None) -> None:
        self.base = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.run_timeout = None if run_timeout is None else float(run_timeout)
        self.run_deadline = None if run_timeout is None else time.monotonic() + float(run_timeout)

    def get(self, path: str) -> Any:
        return self._call("GET", path, None)

    def post(self, path: str, body: dict) -> Any:
        return self._call("POST", path, json.dumps(body).encode())

    def _left(self, url: str) -> float:
        """Seconds this request may take: the per-request timeout, cut to what the run has left."""
        if self.run_deadline is None:
            return self.timeout
        left = self.run_deadline - time.monotonic()
        if left <= 0:
            raise ServerError(f"{url}: the run's deadline passed (--model-args run_timeout={self.run_timeout:g} s)")
        return min(self.timeout, left)

    def _call(self, method: str, path: str, data: bytes | None) -> Any:
        url = self.base + path
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                pause = min(2.0 ** (attempt - 1), 30.0)
                if self.run_deadline is not None:
                    pause = min(pause, max(0.0, self.run_deadline - time.monotonic()))
                time.sleep(pause)
            budget = self._left(url)
            try:
                status, raw = _request(method, url, data, budget)
            except _Timeout:
                last = f"no whole answer within {budget:.3g} s" + (
                    f", what the run had left of run_timeout={self.run_timeout:g} s" if budget < self.timeout else "")
                continue
            except (OSError, http.client.HTTPException, ValueError) as exc:
                last = _one_line(f"{type(exc).__name__}: {exc}")
                continue
            if status == 429 or status >= 500:
                last = f"HTTP {status}: {_one_line(raw[:300].decode('utf-8', 'replace'))}"
                continue
            if status >= 400:
                raise ServerError(f"{url}: HTTP {status}: {_one_line(raw[:300].decode('utf-8', 'replace'))}")
            return read_json(raw, url)
        raise ServerError(f"{url}: no answer after {self.retries + 1} tries ({last})")


class _Timeout(Exception):
    """A request's deadline passed (the watchdog shut its socket)."""


def _request(method: str, url: str, data: bytes | None, budget: float) -> tuple[int, bytes]:
    """(HTTP status, body) of one request that ends within `budget` seconds, whatever the server does;
    `_Timeout` when it does not, ValueError for a body over MAX_RESPONSE_BYTES."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url}")
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    deadline = time.monotonic() + budget
    conn = kind(parts.hostname, parts.port, timeout=budget)
    expired = threading.Event()
    held: list[socket.socket] = []  # the connection's socket (http.client drops conn.sock on Connection: close)

    def shut() -> None:
        expired.set()
        for sock in held:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(budget, shut)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.connect()
        held.append(conn.sock)
        if expired.is_set():
            raise _Timeout()
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = {"Content-Type": "application/json", "Accept": "application/json"} if data is not None else {}
        conn.request(method, target, body=data, headers=headers)
        resp = conn.getresponse()
        chunks, size = [], 0
        while True:
            held[0].settimeout(max(0.01, deadline - time.monotonic()))
            chunk = resp.read1(1 << 16)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_RESPONSE_BYTES:
                raise ValueError(f"an answer of more than {MAX_RESPONSE_BYTES >> 20} MiB")
            chunks.append(chunk)
            if expired.is_set():
                raise _Timeout()
        if expired.is_set():
            raise _Timeout()
        return resp.status, b"".join(chunks)
    except (OSError, http.client.HTTPException):
        if expired.is_set() or time.monotonic() >= deadline:
            raise _Timeout() from None
        raise
    finally:
        watchdog.cancel()
        conn.close()


def read_json(raw: bytes, url: str) -> Any:
    """The JSON value of a server's answer; ServerError (one line, what the server sent) when it is not
    UTF-8 JSON or an object in it gives a key twice (a top_logprobs with a token twice).

    >>> read_json(b'{"a": [1, 2.5, null]}', "u")
    {'a': [1, 2.5, None]}
    >>> read_json(b'{"top": {"a": -1, "a": -2}}', "u")
    Traceback (most recent call last):
    ...
    evalkit.engines.server.model.ServerError: u: the server's JSON gives the key 'a' twice in one object
    """
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ServerError(f"{url}: the server's JSON gives the key {_clip(key)} twice in one object")
            out[key] = value
        return out

    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=pairs)
    except UnicodeDecodeError:
        raise ServerError(f"{url}: the server's answer is not UTF-8 text ({_clip(raw[:40])})") from None
    except json.JSONDecodeError as exc:
        raise ServerError(f"{url}: the server's answer is not JSON ({exc.msg} at character {exc.pos}: "
                          f"{_clip(raw[:80].decode('utf-8', 'replace'))})") from None
    except RecursionError:
        raise ServerError(f"{url}: the server's JSON is nested too deep to read") from None


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _clip(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _kind(value: Any) -> str:
    return {dict: "a JSON object", list: "a JSON list", str: "a string", type(None): "null",
            bool: "a boolean", int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def load_tokenizer(path: str):
    """The run's tokenizer: a .gguf file read vocabulary-only by llama.cpp (`GGUFTokenizer`), or a
    transformers tokenizer folder."""
    if path.endswith(".gguf"):
        from evalkit.engines.llamacpp.model import GGUFTokenizer
        from evalkit.engines.llamacpp.firststep import LlamaCppEngine

        return GGUFTokenizer(LlamaCppEngine(path, vocab_only=True))
    from transformers import AutoTokenizer

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
            alone = tokenizer(text, add_special_tokens=False)["input_ids"]
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
                 repeat_penalty: float | None = None, run_timeout: float | None = None) -> None:
        super().__init__()
        if not tokenizer:
            raise BadInput("--model server needs --model-args tokenizer=PATH (a .gguf file or tokenizer folder): "
                           "the chat template, and the ids of the token texts a server returns")
        self.client = Client(base_url, timeout=timeout, retries=retries, run_timeout=run_timeout)
        try:
            listed = self.client.get("/models")
        except ServerError as exc:
            raise BadInput(f"the server at {base_url} does not answer: {exc}") from None
        self.base_url = base_url
        self.served_model = model or served_models(listed, base_url)[0]
        self.tokenizer = load_tokenizer(str(tokenizer))
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
        bar = tqdm(total=len(requests), desc=f"first step ({self.base_url})", disable=disable_tqdm)

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
        return completion(self.client.post("/completions", payload), self.client.base + "/completions")

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
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
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


def served_models(listed: Any, base_url: str) -> list[str | None]:
    """The model ids a `/v1/models` answer lists (`{"data": [{"id": ...}, ...]}`), [None] when it lists none;
    BadInput naming what the server sent when the answer has another shape.

    >>> served_models({"data": [{"id": "m1"}, {"id": "m2"}]}, "u"), served_models({"data": []}, "u")
    (['m1', 'm2'], [None])
    >>> served_models([{"id": "m1"}], "http://h/v1")
    Traceback (most recent call last):
    ...
    evalkit.errors.BadInput: the server at http://h/v1 answered /models with a JSON list, not {"data": [{"id": ...}]}; name the model with --model-args model=NAME
    """
    data = listed.get("data") if isinstance(listed, dict) else None
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        what = _kind(listed) if not isinstance(listed, dict) else f"{{\"data\": {_kind(data)} ...}}"
        raise BadInput(f"the server at {base_url} answered /models with {what}, not {{\"data\": [{{\"id\": ...}}]}}; "
                       "name the model with --model-args model=NAME")
    return [m["id"] for m in data] or [None]


_LOGPROB_FIELDS = {  # field of a completion's `logprobs` -> (what each item may be, in words)
    "tokens": ((str,), "a token text"),
    "token_logprobs": ((int, float, type(None)), "a number or null"),
    "top_logprobs": ((dict, type(None)), "an object of token text -> logprob, or null"),
    "text_offset": ((int,), "a character offset"),
}


def completion(answer: Any, url: str) -> dict[str, Any]:
    """The first choice of an OpenAI `/completions` answer, its shape checked: `text` a string and
    `logprobs` null or an object whose lists hold what `_LOGPROB_FIELDS` says (missing lists are empty).
    ServerError (one line, what the server sent) for any other shape.

    >>> c = completion({"choices": [{"text": "Paris", "logprobs": {"tokens": ["Paris"],
    ...                 "token_logprobs": [-0.1], "top_logprobs": [{"Paris": -0.1}]}}]}, "u")
    >>> c["text"], c["logprobs"]["text_offset"]
    ('Paris', [])
    >>> completion({"choices": []}, "http://h/v1/completions")
    Traceback (most recent call last):
    ...
    evalkit.engines.server.model.ServerError: http://h/v1/completions: the server answered {"choices": []}, not an OpenAI completion ({"choices": [{"text": ...}]})
    """
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        what = _kind(answer) if not isinstance(answer, dict) else (
            "an object without choices" if choices is None else
            f'{{"choices": {"[]" if choices == [] else _kind(choices) if not isinstance(choices, list) else "[" + _kind(choices[0]) + ", ...]"}}}')
        raise ServerError(f"{url}: the server answered {what}, not an OpenAI completion "
                          '({"choices": [{"text": ...}]})')
    choice = dict(choices[0])
    text = choice.get("text")
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise ServerError(f"{url}: the server's completion text is {_kind(text)}, not a string")
    choice["text"] = text
    lp = choice.get("logprobs")
    if lp is None:
        lp = {}
    if not isinstance(lp, dict):
        raise ServerError(f"{url}: the server's completion logprobs are {_kind(lp)}, not an object")
    checked: dict[str, list[Any]] = {}
    for name, (types, words) in _LOGPROB_FIELDS.items():
        items = lp.get(name)
        if items is None:
            items = []
        if not isinstance(items, list):
            raise ServerError(f"{url}: the server's logprobs.{name} is {_kind(items)}, not a list")
        for i, item in enumerate(items):
            if isinstance(item, bool) or not isinstance(item, types):
                raise ServerError(f"{url}: the server's logprobs.{name}[{i}] is {_clip(item)}, not {words}")
            if isinstance(item, dict):
                for token, value in item.items():
                    if isinstance(value, bool) or not isinstance(value, (int, float)):
                        raise ServerError(f"{url}: the server's logprobs.top_logprobs[{i}][{_clip(token)}] is "
                                          f"{_clip(value)}, not a number")
        checked[name] = items
    choice["logprobs"] = checked
    return choice


def _cut(text: str, until: list[str]) -> str:
    for s in until:
        if s and s in text:
            text = text.split(s, 1)[0]
    return text


def _first_tokens(tokenizer, text: str, n: int) -> str:
    """The text of the first n tokens of `text` as the tokenizer splits it."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[:n], skip_special_tokens=True) if len(ids) > n else text
