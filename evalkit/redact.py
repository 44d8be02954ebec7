"""Credentials in URLs, hidden wherever a URL is stored, printed or logged.

A URL may carry a secret two ways: a user and password before its host
(`http://user:pass@host/v1`) and a key in its query (`?api_key=...`, `&token=...`). `text`
replaces each such secret in any text with `***`, whatever else the text holds, so a caller
never has to find the URL first; `value` does the same through dicts, lists and tuples. The
one place of the rule: the run row (`runner.execute.run_row`) and a journal's fingerprint pass
through `value`, a model's label through `text` (`engines.resolve.resolve`), the CLI's one-line
errors through `text` (`cli`), and the server engine shows only `text` of its URL (its progress
bar, its errors, its `source`). Does not: decide what is sent (the server engine sends the
credentials to the host they name, and an API key only from the environment: docs/engines.md).
"""

from __future__ import annotations

import re
from typing import Any

SHOWN = "***"
# scheme://userinfo@ : userinfo runs to the last '@' before the path, query or fragment
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.\-]*://)[^/?#\s\"'<>]*@")
# a query parameter whose name says it holds a secret
_QUERY = re.compile(r"(?i)([?&;](?:[a-z0-9_\-]*(?:key|token|secret|password|passwd|pwd|auth|signature|sig|"
                    r"credential)[a-z0-9_\-]*)=)[^&#\s\"'<>]*")


def text(s: str) -> str:
    """`s` with every URL's user, password and secret query values shown as `***`.

    >>> text("the server at http://bob:hunter2@example.com:8000/v1 does not answer")
    'the server at http://***@example.com:8000/v1 does not answer'
    >>> text("https://h/v1?model=m&api_key=sk-123&x=1")
    'https://h/v1?model=m&api_key=***&x=1'
    >>> text("http://127.0.0.1:8000/v1")
    'http://127.0.0.1:8000/v1'
    """
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
