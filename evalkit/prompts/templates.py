"""Prompt templates, a run dimension: how a task's prompt is put in front of the model.

Owns: reading the packaged `data/templates.yaml` and a user's extension file, each entry checked
(its keys are `TEMPLATE_KEYS`; an unknown key is refused, never ignored), and a template's own text
around the prompt in lm-eval's words: `doc_to_text`, a Jinja string over the prompt's fields
("Question: {{prompt}}\nAnswer:"), and `target_delimiter`, the whitespace between the prompt and the
answer (lm-eval's " "). `render_prompt` gives the text a model is fed, as lm-eval builds it.
Does not: apply chat templates itself (lm-eval does, through `apply_chat_template` and
`system_instruction`), or add special tokens (`prompts.encoding` does).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from evalkit import envvars
from evalkit.errors import BadInput
from evalkit.paths import MAX_YAML_BYTES, read_input

PACKAGED = Path(__file__).resolve().parents[1] / "data" / "templates.yaml"


# a templates file's keys, each with what it says (an unknown key is refused: it would be silently ignored)
TEMPLATE_KEYS = {
    "chat": "true: the model's own chat template; false: the text as it is",
    "system": "a system message before the prompt (null: none)",
    "description": "one line for `evalkit templates` and the docs",
    "doc_to_text": "lm-eval's doc_to_text: a Jinja string over the prompt's fields, e.g. "
                   "'Question: {{prompt}}\\nAnswer:' (null: the task's own, the prompt as it is)",
    "target_delimiter": "lm-eval's target_delimiter: the whitespace between the prompt and the answer "
                        "(null: the task's own)",
}


@dataclass(frozen=True)
class Template:
    name: str
    chat: bool
    system: str | None
    description: str = ""
    doc_to_text: str | None = None  # Jinja over the prompt's fields; None: the task's own ("{{prompt}}")
    target_delimiter: str | None = None  # whitespace between prompt and answer; None: the task's own

    def to_dict(self) -> dict:
        return asdict(self)

    def text_of(self, doc: dict | str) -> str:
        """The prompt's text under this template's `doc_to_text` (a doc, or its prompt alone), before any
        chat template.

        >>> Template("qa", False, None, doc_to_text="Question: {{prompt}}\\nAnswer:").text_of("Why?")
        'Question: Why?\\nAnswer:'
        >>> Template("plain", False, None).text_of({"prompt": "Why?"})
        'Why?'
        """
        fields = {"prompt": doc} if isinstance(doc, str) else doc
        if self.doc_to_text is None:
            return str(fields["prompt"])
        return _environment().from_string(self.doc_to_text).render(**fields)


def with_text(docs: list[dict], doc_to_text: str | None) -> list[dict]:
    """Each doc with `text`, what the tasks' own `doc_to_text: "{{text}}"` shows the model: the doc under a
    template's `doc_to_text` (an evalkit run passes it as task metadata), else its prompt as it is."""
    shown = Template("task", False, None, doc_to_text=doc_to_text)
    return [{**d, "text": shown.text_of(d)} for d in docs]


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(keep_trailing_newline=True)


def _check_doc_to_text(name: str, path: Path, text) -> str | None:
    """A template's `doc_to_text` checked: text, valid Jinja, naming `{{prompt}}` (a template that drops the
    prompt asks the same of every prompt)."""
    if text is None:
        return None
    if not isinstance(text, str) or not text.strip():
        raise BadInput(f"template {name!r} in {path}: `doc_to_text` must be non-empty text or null")
    import jinja2
    from jinja2 import meta

    try:
        names = meta.find_undeclared_variables(_environment().parse(text))
    except jinja2.TemplateSyntaxError as exc:
        raise BadInput(f"template {name!r} in {path}: `doc_to_text` is not a valid Jinja template ({exc.message})") from None
    if "prompt" not in names:
        raise BadInput(f"template {name!r} in {path}: `doc_to_text` must use {{{{prompt}}}} (it names "
                       f"{', '.join(sorted(names)) or 'no field'})")
    return text


def _check_delimiter(name: str, path: Path, text) -> str | None:
    """`target_delimiter` checked: whitespace only (or empty), so "the response after the delimiter and
    any leading whitespace" is one event for the text and the probability metrics; other text around the
    answer belongs in `doc_to_text`."""
    if text is None:
        return None
    if not isinstance(text, str) or text.strip():
        raise BadInput(f"template {name!r} in {path}: `target_delimiter` must be whitespace (e.g. \" \") or empty; "
                       "put other text into doc_to_text")
    return text


def _read(path: Path) -> dict[str, Template]:
    try:
        raw = yaml.safe_load(read_input(path, "templates file", MAX_YAML_BYTES).decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as exc:
        raise BadInput(f"templates file {path} is not valid YAML") from exc
    if not isinstance(raw, dict):
        raise BadInput(f"templates file {path} must map template names to definitions")
    out = {}
    for name, spec in raw.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("chat"), bool):
            raise BadInput(f"template {name!r} in {path} needs `chat: true|false`")
        unknown = sorted(str(k) for k in spec if k not in TEMPLATE_KEYS)
        if unknown:
            raise BadInput(f"template {name!r} in {path}: unknown key {unknown[0]!r} "
                           f"(known: {', '.join(TEMPLATE_KEYS)})")
        system = spec.get("system")
        if system is not None and not isinstance(system, str):
            raise BadInput(f"template {name!r} in {path}: `system` must be text or null")
        out[str(name)] = Template(str(name), spec["chat"], system, str(spec.get("description", "")),
                                  _check_doc_to_text(str(name), path, spec.get("doc_to_text")),
                                  _check_delimiter(str(name), path, spec.get("target_delimiter")))
    return out


def load_templates(extra: str | os.PathLike | None = None) -> dict[str, Template]:
    """The packaged templates, overridden and extended by `extra` or $EVALKIT_TEMPLATES."""
    templates = _read(PACKAGED)
    extra = extra or envvars.templates()
    if extra:
        templates.update(_read(Path(extra)))
    return templates


def get_template(name: str, extra: str | os.PathLike | None = None) -> Template:
    templates = load_templates(extra)
    if name not in templates:
        raise BadInput(f"unknown template {name!r} (known: {', '.join(sorted(templates))})")
    return templates[name]


def render_prompt(tokenizer, template: Template, prompt: str) -> str:
    """The prompt as lm-eval puts it before the model for a zero-shot generate_until task.

    The prompt first goes through the template's `doc_to_text`. Chat:
    `apply_chat_template([system?, user], tokenize=False, add_generation_prompt=True)`,
    retried without the system message when the chat template rejects one (as HFLM does).
    Not chat: the system message (if any), a blank line, and the prompt.
    """
    prompt = template.text_of(prompt)
    if not template.chat:
        return f"{template.system}\n\n{prompt}" if template.system else prompt
    if not getattr(tokenizer, "chat_template", None):
        raise BadInput(f"template {template.name!r} needs a chat template and this tokenizer has none "
                       "(use --template plain)")
    import jinja2

    messages = ([{"role": "system", "content": template.system}] if template.system else [])
    messages.append({"role": "user", "content": prompt})
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except jinja2.exceptions.TemplateError:
        messages = [m for m in messages if m["role"] != "system"]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
