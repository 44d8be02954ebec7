"""The versioned lexicon of generic openers ("Sure", "Of course", "好的", "首先" …).

Owns: reading `data/openers.yaml` (or a user's file of the same shape) and its
version string, which every run stores. Does not: match text (see `scoring.text`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from evalkit import envvars
from evalkit.errors import BadInput
from evalkit.paths import MAX_YAML_BYTES, read_input

PACKAGED = Path(__file__).resolve().parents[1] / "data" / "openers.yaml"


@dataclass(frozen=True)
class Lexicon:
    version: str
    by_lang: dict[str, tuple[str, ...]]

    @property
    def entries(self) -> list[str]:
        """Every entry, all languages, in file order (duplicates removed)."""
        return list(dict.fromkeys(e for entries in self.by_lang.values() for e in entries))


@functools.lru_cache(maxsize=8)
def _load(path: str) -> Lexicon:
    try:
        raw = yaml.safe_load(read_input(path, "opener lexicon", MAX_YAML_BYTES).decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as exc:
        raise BadInput(f"opener lexicon {path} is not valid YAML") from exc
    if not isinstance(raw, dict) or not raw.get("version"):
        raise BadInput(f"opener lexicon {path} needs a `version` and lists of entries per language")
    by_lang = {}
    for key, value in raw.items():
        if key in ("version", "description"):
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise BadInput(f"opener lexicon {path}: `{key}` must be a list of non-empty strings")
        by_lang[str(key)] = tuple(v.strip() for v in value)
    if not by_lang:
        raise BadInput(f"opener lexicon {path} has no entries")
    return Lexicon(str(raw["version"]), by_lang)


def load_lexicon(path: str | os.PathLike | None = None) -> Lexicon:
    """The packaged lexicon, or the file at `path` / $EVALKIT_OPENERS."""
    return _load(str(path or envvars.openers() or PACKAGED))
