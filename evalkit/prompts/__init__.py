"""What the model is asked: the task catalog, the JSONL prompt format, templates, needle documents.

Owns: finding evalkit's lm-eval tasks (`catalog`, shipped in the package as
`evalkit.tasks`), reading prompt files (`jsonl`), the prompt templates
(`templates`), building needle documents (`needle`) and the lm-eval hooks of the
needle tasks (`needle_task`). Does not: run a model or score a response.
"""
