"""Talking to an OpenAI-compatible server: requests with retries and deadlines, and its answers checked.

Owns `Client` (GET and POST to an API root, each request retried on a connection error, a timeout, HTTP 429
or 5xx, with a deadline for the whole request and, optionally, for the whole run), the reading of an
answer (`read_json`: UTF-8 JSON of bounded size, no key given twice) and the shape checks of the two
answers evalkit reads: the `/v1/models` list (`served_models`) and a `/v1/completions` choice
(`completion`). What goes wrong is one `ServerError` line saying what the server did.

Does not: know tokenizers, prompts or metrics (`server.model` turns completions into first steps).
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.parse
from typing import Any

from evalkit import redact
from evalkit.errors import BadInput, RunFailed


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
    Answers are JSON of at most `MAX_RESPONSE_BYTES`, with no object key given twice.

    `api_key` is sent as `Authorization: Bearer` (else a user and password in `base_url` as basic
    authentication) on requests to `base_url`'s origin only (`auth_for`); no redirect is followed,
    so a server that redirects elsewhere gets a failed request, never the credentials. Messages
    name the URL as `shown` (`redact.text`: its credentials as `***`)."""

    def __init__(self, base_url: str, *, timeout: float = 120, retries: int = 3,
                 run_timeout: float | None = None, api_key: str | None = None) -> None:
        self.base = base_url.rstrip("/")
        redact.register_url(self.base)  # its password, by value, out of every text evalkit writes
        redact.register(api_key)
        self.shown = redact.text(self.base)
        self.origin = _origin(self.base)
        self._auth = _credentials(self.base, api_key)
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.run_timeout = None if run_timeout is None else float(run_timeout)
        self.run_deadline = None if run_timeout is None else time.monotonic() + float(run_timeout)

    def auth_for(self, url: str) -> dict[str, str]:
        """The credential header for a request to `url`: only when its origin is `base_url`'s."""
        return dict(self._auth) if _origin(url) == self.origin else {}

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
        url, shown = self.base + path, self.shown + path
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                pause = min(2.0 ** (attempt - 1), 30.0)
                if self.run_deadline is not None:
                    pause = min(pause, max(0.0, self.run_deadline - time.monotonic()))
                time.sleep(pause)
            budget = self._left(shown)
            try:
                status, raw = _request(method, url, data, budget, self.auth_for(url))
            except _Timeout:
                last = f"no whole answer within {budget:.3g} s" + (
                    f", what the run had left of run_timeout={self.run_timeout:g} s" if budget < self.timeout else "")
                continue
            except (OSError, http.client.HTTPException, ValueError) as exc:
                last = redact.text(_one_line(f"{type(exc).__name__}: {exc}"))
                continue
            if status == 429 or status >= 500:
                last = f"HTTP {status}: {_said(raw)}"
                continue
            if status >= 400:
                raise ServerError(f"{shown}: HTTP {status}: {_said(raw)}")
            return read_json(raw, shown)
        raise ServerError(f"{shown}: no answer after {self.retries + 1} tries ({last})")


def _origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL, the port filled in for http / https: what "the same server" means."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:
        port = None
    return scheme, (parts.hostname or "").lower(), port


def _credentials(base: str, api_key: str | None) -> dict[str, str]:
    """The Authorization header for `base`'s origin: the API key as a bearer token, else the URL's
    user and password as basic authentication, else none."""
    if api_key:
        return {"Authorization": f"Bearer {api_key}"}
    parts = urllib.parse.urlsplit(base)
    if parts.username is None:
        return {}
    import base64

    pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
    return {"Authorization": "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")}


class _Timeout(Exception):
    """A request's deadline passed (the watchdog shut its socket)."""


def _request(method: str, url: str, data: bytes | None, budget: float,
             auth: dict[str, str] | None = None) -> tuple[int, bytes]:
    """(HTTP status, body) of one request that ends within `budget` seconds, whatever the server does;
    `_Timeout` when it does not, ValueError for a body over MAX_RESPONSE_BYTES."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {redact.text(url)}")
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
        headers.update(auth or {})
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
    evalkit.engines.server.client.ServerError: u: the server's JSON gives the key 'a' twice in one object
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


def _said(raw: bytes, width: int = 300) -> str:
    """What an error answer's body says, on one line, cut to `width` characters after its secrets are
    scrubbed (a body quoting the request's Authorization header: a secret cut in two is still found)."""
    return _one_line(redact.text(raw[: 64 * width].decode("utf-8", "replace")))[:width]


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _clip(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _kind(value: Any) -> str:
    return {dict: "a JSON object", list: "a JSON list", str: "a string", type(None): "null",
            bool: "a boolean", int: "a number", float: "a number"}.get(type(value), type(value).__name__)


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


MAX_TOKEN_CHARS = 4096  # one token's text (real vocabularies' longest are a few hundred characters)
MAX_TEXT_CHARS = 256 * 1024  # one completion's text
_ODD = re.compile("[\ud800-\udfff\x00\ufffd]")
_ODD_NAMES = {"\x00": "a NUL character", "\ufffd": "U+FFFD (bytes the server could not decode: the token is lost)"}


def check_text(value: str, field: str, url: str, limit: int = MAX_TOKEN_CHARS) -> None:
    """Refuse a text field of a server's answer (`text`, a `tokens` item, a `top_logprobs` key) that no
    tokenizer can take or map back to its token: a lone surrogate (valid JSON, "\\ud800", but no text),
    a NUL, U+FFFD (the server replaced bytes it could not decode), or more than `limit` characters.
    ServerError, one line naming the server, the field and the token (clipped).

    >>> check_text("Paris", "logprobs.tokens[0]", "u")
    >>> check_text("\ufffd", "logprobs.tokens[0]", "http://h/v1/completions")
    Traceback (most recent call last):
    ...
    evalkit.engines.server.client.ServerError: http://h/v1/completions: the server's logprobs.tokens[0] '�' holds U+FFFD (bytes the server could not decode: the token is lost); a tokenizer cannot map it to a token
    """
    if len(value) > limit:
        raise ServerError(f"{url}: the server's {field} {_clip(value)} is {len(value)} characters long, "
                          f"more than the {limit} a {'token' if limit == MAX_TOKEN_CHARS else 'completion'} "
                          "may hold")
    odd = _ODD.search(value)
    if odd:
        ch = odd.group(0)
        what = _ODD_NAMES.get(ch, f"a lone surrogate (U+{ord(ch):04X}), which is no text")
        raise ServerError(f"{url}: the server's {field} {_clip(value)} holds {what}; "
                          "a tokenizer cannot map it to a token")


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
    evalkit.engines.server.client.ServerError: http://h/v1/completions: the server answered {"choices": []}, not an OpenAI completion ({"choices": [{"text": ...}]})
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
    check_text(text, "completion text", url, MAX_TEXT_CHARS)
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
            if isinstance(item, str):
                check_text(item, f"logprobs.{name}[{i}]", url)
            if isinstance(item, dict):
                for token, value in item.items():
                    check_text(token, f"logprobs.{name}[{i}] key", url)
                    if isinstance(value, bool) or not isinstance(value, (int, float)):
                        raise ServerError(f"{url}: the server's logprobs.top_logprobs[{i}][{_clip(token)}] is "
                                          f"{_clip(value)}, not a number")
        checked[name] = items
    choice["logprobs"] = checked
    return choice
