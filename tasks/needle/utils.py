"""lm-eval hooks of the needle tasks; the logic lives in evalkit.prompts.needle_task."""

from evalkit.prompts.needle_task import load_docs, process_results  # noqa: F401


def load_en(**metadata):
    return load_docs(lang="en", hint=False, **metadata)


def load_en_hint(**metadata):
    return load_docs(lang="en", hint=True, **metadata)


def load_zh(**metadata):
    return load_docs(lang="zh", hint=False, **metadata)


def load_zh_hint(**metadata):
    return load_docs(lang="zh", hint=True, **metadata)
