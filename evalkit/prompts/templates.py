"""Prompt templates, a run dimension: how a task's prompt is put in front of the model.

Owns: reading the packaged `data/templates.yaml` and a user's extension file.
Does not: apply chat templates itself (lm-eval does, through
`apply_chat_template` and `system_instruction`).
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


@dataclass(frozen=True)
class Template:
    name: str
    chat: bool
    system: str | None
    description: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


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
        system = spec.get("system")
        if system is not None and not isinstance(system, str):
            raise BadInput(f"template {name!r} in {path}: `system` must be text or null")
        out[str(name)] = Template(str(name), spec["chat"], system, str(spec.get("description", "")))
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

    Chat: `apply_chat_template([system?, user], tokenize=False, add_generation_prompt=True)`,
    retried without the system message when the chat template rejects one (as HFLM does).
    Not chat: the system message (if any), a blank line, and the prompt.
    """
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
