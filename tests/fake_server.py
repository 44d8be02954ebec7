"""A scripted OpenAI-compatible server on 127.0.0.1, for the server engine's fault tests and the fuzz suite.

Owns: `FakeServer(answer)`, a threaded HTTP server whose every reply is what `answer(method, path, body)`
returns: a `Reply` (status, headers, body bytes, how the body is cut into writes and how long each
write waits, headers trickled or not), and `healthy(prompt_tokens)`, the answers of a well-behaved
server. Does not: run a model; its numbers are whatever the script says.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    body: bytes | Any = b""  # bytes as they are, anything else as JSON
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    chunk: int = 0  # bytes per write (0: all at once)
    delay: float = 0.0  # seconds before each write
    trickle_headers: float = 0.0  # seconds between header bytes (0: headers at once)
    length: bool = True  # send Content-Length

    def raw(self) -> bytes:
        return self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()


Answer = Callable[[str, str, Any], Reply]


class FakeServer:
    """`with FakeServer(answer) as url:` an API root (http://127.0.0.1:PORT/v1) answered by `answer`."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: list[tuple[str, str, Any]] = []
        self.headers: list[dict[str, str]] = []  # each request's headers, in the order of `requests`
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _serve(self, method: str) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(size) if size else b""
                try:
                    body = json.loads(data) if data else None
                except ValueError:
                    body = data
                path = self.path.removeprefix("/v1")
                outer.requests.append((method, path, body))
                outer.headers.append(dict(self.headers.items()))
                reply = outer.answer(method, path, body)
                raw = reply.raw()
                head = f"HTTP/1.1 {reply.status} X\r\n"
                headers = {"Content-Type": "application/json", "Connection": "close", **reply.headers}
                if reply.length:
                    headers.setdefault("Content-Length", str(len(raw)))
                head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
                try:
                    if reply.trickle_headers:
                        for b in head.encode():
                            self.wfile.write(bytes([b]))
                            self.wfile.flush()
                            time.sleep(reply.trickle_headers)
                    else:
                        self.wfile.write(head.encode())
                    step = reply.chunk or max(1, len(raw))
                    for at in range(0, len(raw), step):
                        if reply.delay:
                            time.sleep(reply.delay)
                        self.wfile.write(raw[at : at + step])
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True

            def do_GET(self) -> None:  # noqa: N802
                self._serve("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> str:
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self.url

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def completion(text: str, top: dict[str, float] | None, *, offset: int = 0) -> dict:
    """One OpenAI completion answer whose first token is `text` with the top logprobs `top`."""
    lp = None
    if top is not None:
        lp = {"tokens": [text], "token_logprobs": [top.get(text, -1.0)], "top_logprobs": [top],
              "text_offset": [offset]}
    return {"choices": [{"text": text, "logprobs": lp, "index": 0, "finish_reason": "length"}]}


def healthy(top: dict[str, float], text: str | None = None) -> Answer:
    """A well-behaved server: one model, and every completion starting with `text` (default: the
    likeliest of `top`) with the first-step logprobs `top`."""
    first = text if text is not None else max(top, key=lambda t: top[t])

    def answer(method: str, path: str, body: Any) -> Reply:
        if path == "/models":
            return Reply({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        if path == "/completions":
            return Reply(completion(first, top, offset=len(body.get("prompt", "")) if isinstance(body, dict) else 0))
        return Reply({"error": "not found"}, status=404)

    return answer
