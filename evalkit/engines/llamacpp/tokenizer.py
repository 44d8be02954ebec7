"""The GGUF's own tokenizer and chat template, as the part of a transformers tokenizer evalkit and lm-eval call.

Owns `GGUFTokenizer` (token ids, text, the chat template rendered as transformers renders one) over a
`LlamaCppEngine`, for `--model llamacpp` and for `--model server` given a .gguf tokenizer.
Does not: run the model.
"""

from __future__ import annotations

from typing import Any

from evalkit.engines.llamacpp.firststep import LlamaCppEngine


class GGUFTokenizer:
    """The GGUF's own tokenizer and chat template, with the small part of a transformers
    tokenizer's interface evalkit and lm-eval call (`__call__`, `decode`, `apply_chat_template`,
    `chat_template`, `len`): token counts and templated prompts come from the file llama.cpp runs.
    The template is rendered as transformers renders one (jinja2 sandbox, trim_blocks,
    lstrip_blocks, `raise_exception`)."""

    def __init__(self, eng: LlamaCppEngine) -> None:
        self.eng = eng
        self.chat_template = eng.meta("tokenizer.chat_template")
        lib = eng.lib
        self.bos_token_id = int(lib.llama_vocab_bos(eng.vocab))
        self.eos_token_id = int(lib.llama_vocab_eos(eng.vocab))
        self.bos_token = eng.decode([self.bos_token_id]) if self.bos_token_id >= 0 else ""
        self.eos_token = eng.decode([self.eos_token_id]) if self.eos_token_id >= 0 else ""
        self.pad_token_id = self.eos_token_id
        self.name_or_path = eng.path

    def __len__(self) -> int:
        return self.eng.n_vocab

    def __call__(self, text: str, add_special_tokens: bool = False, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self.eng.tokenize(text, add_bos=bool(add_special_tokens))}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.eng.tokenize(text, add_bos=bool(add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = False, **_: Any) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.eng.decode(ids, special=not skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            **kwargs: Any):
        if not self.chat_template:
            raise ValueError(f"{self.eng.path} has no chat template (tokenizer.chat_template)")
        text = _render(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        if continue_final_message and messages:
            final = messages[-1]["content"].strip()
            cut = text.rfind(final)
            if cut >= 0:
                text = text[: cut + len(final)]
        return self.eng.tokenize(text) if tokenize else text


def tokenizer_of(eng: LlamaCppEngine) -> GGUFTokenizer:
    """The engine's one `GGUFTokenizer` (made on first use): the object its feed (`prompts.encoding`) is
    fixed on, so the model, the probe and the prior all feed the same prefix."""
    tok = getattr(eng, "gguf_tokenizer", None)
    if tok is None:
        tok = eng.gguf_tokenizer = GGUFTokenizer(eng)
    return tok


def _render(template: str, messages, **variables) -> str:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, **variables)
