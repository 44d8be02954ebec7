"""Secrets hidden wherever evalkit stores, prints or logs text: by value, and in URL shapes.

Two rules, one module:
- **by value** (`register`, `register_url`): the client knows the secrets it holds, the API key
  (`envvars.api_key` registers it as it reads it) and a URL's user password (`register_url`,
  with urllib's own parser, the one that sends it). Every registered value is replaced by `***`
  wherever it appears, whole or in the forms a server or a writer may quote it in:
  percent-encoded (`quote` and `quote_plus`, upper- or lower-case hex), JSON- and
  Python-escaped, HTML-escaped, and the base64 of `user:password` sent as Basic auth.
  Values shorter than `MIN_SECRET` characters are not matched by value (they would blank
  ordinary text); the URL rule still hides them in URLs.
- **URL shapes**: a user and password before a host (`http://user:pass@host/v1`) and a secret
  query value (`?api_key=...`), hidden even when nobody registered them (rows stored before).

`text` applies both to any text, `value` through dicts, lists and tuples. The choke points that call
them: the CLI's one-line errors (`cli.CliError.show`, `cli.main`), every write of a run row or
result rows (`store.rows`: `_update`, `insert_rows`, `scrub_row` for inserts; `store.spool._write`),
the journal's lines (`store.journal._dumps`), log records (`install_log_scrub`, a record factory
installed by the CLI and by the first `register`), progress bars' descriptions (`progress.bar`),
the report's reading of runs (`report.reading`), and the server client's messages
(`engines.server.client`).
Does not: decide what is sent (the server engine sends the credentials to the host they name,
and an API key only from the environment: docs/engines.md).
"""

from __future__ import annotations

import base64
import html
import json
import logging
import re
import threading
import urllib.parse
from typing import Any

SHOWN = "***"
MIN_SECRET = 4  # a registered value shorter than this is not matched by value
# scheme://userinfo@ : userinfo runs to the last '@' before the path, query or fragment
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/?#\s\"'<>]*@")
# a query parameter whose name says it holds a secret
_QUERY = re.compile(r"(?i)([?&;](?:[a-z0-9_\-]*(?:key|token|secret|password|passwd|pwd|auth|signature|sig|"
                    r"credential)[a-z0-9_\-]*)=)[^&#\s\"'<>]*")
_PERCENT = re.compile(r"%[0-9A-Fa-f]{2}")

_lock = threading.Lock()
_secrets: set[str] = set()
_pattern: re.Pattern[str] | None = None


def forms(secret: str) -> set[str]:
    """The texts `secret` may appear as: itself, percent-encoded (quote, quote_plus), JSON-, Python- and
    HTML-escaped.

    >>> sorted(forms("a b"))
    ['a b', 'a%20b', 'a+b']
    """
    out = {secret}
    for enc in (urllib.parse.quote(secret, safe=""), urllib.parse.quote(secret),
                urllib.parse.quote_plus(secret, safe=""), urllib.parse.quote_plus(secret)):
        out.add(enc)
    out.add(json.dumps(secret)[1:-1])
    out.add(json.dumps(secret, ensure_ascii=False)[1:-1])
    out.add(repr(secret)[1:-1])
    out.add(html.escape(secret))
    out.add(html.escape(secret, quote=False))
    return {f for f in out if f}


def _regex(form: str) -> str:
    """`form` as a regex whose percent-escapes match upper- or lower-case hex."""
    out, at = [], 0
    for m in _PERCENT.finditer(form):
        out.append(re.escape(form[at:m.start()]))
        out.append("%" + "".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in m.group(0)[1:]))
        at = m.end()
    out.append(re.escape(form[at:]))
    return "".join(out)


def register(*secrets: str | None) -> None:
    """Hide these values (and their `forms`) from every text `text` scrubs, for the rest of the process."""
    global _pattern
    new = {s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET}
    with _lock:
        if new <= _secrets:
            return
        _secrets.update(new)
        every = {f for s in _secrets for f in forms(s)}
        every = {f for f in every if len(f) >= MIN_SECRET}
        # longest first: a form that holds another is replaced whole
        _pattern = re.compile("|".join(_regex(f) for f in sorted(every, key=lambda f: (-len(f), f))))
    install_log_scrub()  # from the first secret on, log records are scrubbed too (the Python API's included)


def register_basic(user: str, password: str) -> None:
    """Register a password and the base64 of `user:password` that Basic authentication sends."""
    register(password, base64.b64encode(f"{user}:{password}".encode("utf-8")).decode("ascii"))


def register_url(url: str) -> urllib.parse.SplitResult:
    """Parse `url` with urllib (the parser the server client sends with) and register what it calls the
    password (as written and percent-decoded, and its Basic-auth form); return the parts. ValueError
    when urllib cannot read the URL's host and port."""
    parts = urllib.parse.urlsplit(url)
    parts.port  # noqa: B018  raises ValueError for a port that is not a number in range
    if parts.password is not None:
        user, password = urllib.parse.unquote(parts.username or ""), urllib.parse.unquote(parts.password)
        register(parts.password)
        register_basic(user, password)
    return parts


def forget_all() -> None:
    """Forget every registered value (tests)."""
    global _pattern
    with _lock:
        _secrets.clear()
        _pattern = None


def text(s: str) -> str:
    """`s` with every registered secret, every URL's user and password and secret query values as `***`.

    >>> text("the server at http://bob:hunter2@example.com:8000/v1 does not answer")
    'the server at http://***@example.com:8000/v1 does not answer'
    >>> text("https://h/v1?model=m&api_key=sk-123&x=1")
    'https://h/v1?model=m&api_key=***&x=1'
    >>> text("http://127.0.0.1:8000/v1")
    'http://127.0.0.1:8000/v1'
    """
    pattern = _pattern
    if pattern is not None:
        s = pattern.sub(SHOWN, s)
    if "://" not in s and "=" not in s:
        return s
    return _QUERY.sub(lambda m: m.group(1) + SHOWN, _USERINFO.sub(lambda m: m.group(1) + SHOWN + "@", s))


def value(obj: Any) -> Any:
    """`obj` with `text` applied to every string in it (dict values and keys, list and tuple items).

    >>> value({"model_args": '{"base_url": "http://u:p@h/v1"}', "seed": 1})
    {'model_args': '{"base_url": "http://***@h/v1"}', 'seed': 1}
    """
    if isinstance(obj, str):
        return text(obj)
    if isinstance(obj, dict):
        return {value(k): value(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(value(v) for v in obj)
    return obj


def active() -> bool:
    """Whether any secret is registered (bulk writers scrub their rows only then)."""
    return _pattern is not None


def holds_secret(s: str) -> bool:
    """Whether `s` holds a registered secret in any of its forms (a cheap check before a copy)."""
    pattern = _pattern
    return pattern is not None and pattern.search(s) is not None


_installed = False


def install_log_scrub() -> None:
    """Scrub every log record's message, evalkit's and libraries', as it is made (a record factory:
    one place, whatever handler later prints the record)."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: left to the handler to report
            return record
        scrubbed = text(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, ()
        return record

    logging.setLogRecordFactory(factory)
