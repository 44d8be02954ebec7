"""lm-eval hooks of the first-token tasks: load the JSONL data, score responses.

The tasks run under evalkit and under plain `lm_eval --include_path tasks`;
both paths score with the same evalkit functions.
"""

from __future__ import annotations

from pathlib import Path

from evalkit.prompts.catalog import FIRSTTOKEN_DATA, data_path
from evalkit.prompts.jsonl import load_prompts
from evalkit.prompts.templates import with_text
from evalkit.scoring import firsttoken
from evalkit.scoring.lexicon import load_lexicon


def _dataset(path: Path, metadata: dict):
    """The prompts, each with `text`: the prompt under the run's template `doc_to_text` (metadata), else as it is."""
    import datasets

    docs = with_text(load_prompts(path), metadata.get("doc_to_text"))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def load_en(**kwargs):
    return _dataset(data_path(*FIRSTTOKEN_DATA["firsttoken_en"]), kwargs)


def load_zh(**kwargs):
    return _dataset(data_path(*FIRSTTOKEN_DATA["firsttoken_zh"]), kwargs)


def load_user(**kwargs):
    """A user's own JSONL, named by the `prompts_file` metadata key (see docs/cli.md, "Your own prompts")."""
    path = kwargs.get("prompts_file")
    if not path:
        raise ValueError("firsttoken_user needs metadata prompts_file=PATH")
    return _dataset(Path(path), kwargs)


def process_results(doc, results):
    """results: [response] — a string, a list of sampled strings, or a backend's FirstStepResult."""
    return firsttoken.score(doc, results[0], load_lexicon().entries)
