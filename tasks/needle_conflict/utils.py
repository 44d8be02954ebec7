"""lm-eval hooks of the needle_conflict tasks; the logic lives in evalkit.prompts.needle_task."""

from evalkit.prompts.needle_task import load_conflict_docs, process_conflict  # noqa: F401


def load_en(**metadata):
    return load_conflict_docs(lang="en", **metadata)


def load_zh(**metadata):
    return load_conflict_docs(lang="zh", **metadata)
