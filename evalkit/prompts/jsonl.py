"""The JSONL prompt format of the first-token tasks, shipped and user-supplied.

One JSON object per line:
    {"prompt": "What is recursion?", "answers": ["Recursion"], "lang": "en",
     "id": "my-001", "category": "definition"}
`prompt`, `answers` (non-empty list of accepted answer starts) and `lang` are
required; `id` (default: FILE-LINE), `category` (default: "") and `answers_full`
(strings any of which, found in the whole response, makes the answer right:
docs/metrics.md §1.7) are optional.

Owns: reading and validating such a file. Does not: score anything.
"""

from __future__ import annotations

import json
from pathlib import Path

from evalkit.contract import FIRSTTOKEN
from evalkit.errors import BadInput
from evalkit.paths import read_input

MAX_PROMPTS_BYTES = 256 << 20  # a prompts file is read whole; a device or a larger file is refused unread


def _check_encodes(where: str, key: str, value) -> None:
    """JSON can spell a lone surrogate ("\\ud800"); such text cannot be tokenised or stored."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadInput(f"{where}: {key!r} holds text that does not encode as UTF-8 "
                           f"(a lone surrogate at position {exc.start})") from None


def load_prompts(path: str | Path) -> list[dict]:
    """Read and validate a prompts JSONL file; any problem is a BadInput naming file and line."""
    path = Path(path)
    raw = read_input(path, "prompts file", MAX_PROMPTS_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path} is not UTF-8 text (byte {exc.start})") from exc
    docs, seen = [], set()
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{where}: not valid JSON ({exc.msg})") from exc
        except RecursionError:
            raise BadInput(f"{where}: JSON nested too deep (a prompt is an object of text fields)") from None
        if not isinstance(obj, dict):
            raise BadInput(f"{where}: each line must be a JSON object")
        for key in ("prompt", "answers", "lang"):
            if key not in obj:
                raise BadInput(f"{where}: missing field {key!r}")
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise BadInput(f"{where}: 'prompt' must be non-empty text")
        answers = obj["answers"]
        if (
            not isinstance(answers, list)
            or not answers
            or not all(isinstance(a, str) and a.strip() for a in answers)
        ):
            raise BadInput(f"{where}: 'answers' must be a non-empty list of non-empty strings")
        if not isinstance(obj["lang"], str) or not obj["lang"].strip():
            raise BadInput(f"{where}: 'lang' must be a language code such as 'en' or 'zh'")
        full = obj.get("answers_full")
        if full is not None and (not isinstance(full, list) or not full
                                 or not all(isinstance(a, str) and a.strip() for a in full)):
            raise BadInput(f"{where}: 'answers_full' must be a non-empty list of non-empty strings")
        for key in ("prompt", "lang", "id", "category"):
            _check_encodes(where, key, obj.get(key))
        for answer in [*answers, *(full or [])]:
            _check_encodes(where, "answers", answer)
        doc_id = str(obj.get("id") or f"{path.stem}-{lineno}")
        if doc_id in seen:
            raise BadInput(f"{where}: duplicate id {doc_id!r}")
        seen.add(doc_id)
        docs.append(
            {
                "kind": FIRSTTOKEN,
                "id": doc_id,
                "lang": obj["lang"].strip(),
                "category": str(obj.get("category") or ""),
                "prompt": obj["prompt"],
                "answers": [a.strip() for a in answers],
                # every doc carries the key (datasets takes its columns from the first row)
                "answers_full": [a.strip() for a in full] if full else None,
            }
        )
    if not docs:
        raise BadInput(f"prompts file {path} has no prompts")
    return docs
