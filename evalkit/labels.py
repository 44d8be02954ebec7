"""What readers call a run's model: one definition for the run row (`runs.model_name`, written when a
model is resolved) and the report (runs stored without a model_name). It sits on the floor so the
report, which reads stored runs only, does not import the layer that loads models. And the rule of
the labels a user gives (`check_label`: run names, tags; `check_tag_name`), on the floor so that
`evalkit promote` (release) and `evalkit run` (runner) share it."""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from evalkit.errors import BadInput

MAX_LABEL = 200  # characters of a run name or a tag


def model_label(model_type: str, args: dict[str, Any]) -> str:
    """What a reader calls the model: the pretrained folder or hub id's last part (+ its GGUF file);
    the model type when no model is named (`runs.model_name`, the report's model column).

    >>> model_label("hf", {"pretrained": "/models/Qwen2.5-0.5B/", "gguf_file": "q4.gguf"}), model_label("hf", {})
    ('Qwen2.5-0.5B (q4.gguf)', 'hf')
    """
    pretrained = args.get("pretrained")
    if not isinstance(pretrained, str) or not pretrained:
        return model_type
    name = pretrained.rstrip("/").rsplit("/", 1)[-1]
    return f"{name} ({args['gguf_file']})" if args.get("gguf_file") else name


def check_label(option: str, value: str, *, max_len: int = MAX_LABEL) -> str:
    """A label the user gives (a run's `--name`, a tag): stripped; refused when empty, longer than
    `max_len`, holding control characters (a newline would make a second, different name) or a
    compatibility form of another character (NFKC changes it: a fullwidth 'ｐｒｏｄ' would look like
    'prod' and be another label).

    >>> check_label("--tag", " prod ")
    'prod'
    """
    text = value.strip()
    if not text:
        raise BadInput(f"{option} is empty")
    if len(text) > max_len:
        raise BadInput(f"{option} is longer than {max_len} characters")
    bad = next((c for c in text if unicodedata.category(c)[0] == "C"), None)
    if bad is not None:
        raise BadInput(f"{option} {value!r} holds the control character U+{ord(bad):04X}")
    odd = next((c for c in text if unicodedata.normalize("NFKC", c) != c), None)
    if odd is not None:  # a fullwidth 'ｐｒｏｄ' reads as 'prod' and is another label
        raise BadInput(f"{option} {text!r} holds {odd!r} (U+{ord(odd):04X}), a compatibility form of "
                       f"{unicodedata.normalize('NFKC', odd)!r}: it would look like another label; write that instead")
    return text


def check_tag_name(tag: str) -> str:
    """A tag's name (`promote --tag`): letters, digits, '.', '_' or '-', not starting with '-' (a
    command line would read it as an option), and a label as `check_label` checks it (length, no
    compatibility forms such as fullwidth letters)."""
    if not isinstance(tag, str) or not re.fullmatch(r"[\w.\-]+", tag):
        raise BadInput(f"bad tag name {tag!r}: use letters, digits, '.', '_' or '-'")
    if tag.startswith("-"):
        raise BadInput(f"bad tag name {tag[:40]!r}: it starts with '-', which a command line reads as an option")
    return check_label("--tag", tag)
