"""A deterministic fake lm-eval LM: answers from the doc by a fixed mode, records calls."""

from __future__ import annotations

import os
import time

from lm_eval.api.model import LM

CALLS: list[tuple[str, dict]] = []

MODES = {
    # mode -> response for a doc
    "hit": lambda doc: f"{doc['answers'][0]} is the answer." if doc.get("answers") else "yes",
    "opener": lambda doc: "Sure! Let me explain.",
    "other": lambda doc: "Hmm, that depends on many things.",
    "key": lambda doc: f"The code is {doc['key']}." if doc.get("key") else "none",
    "nokey": lambda doc: "I do not know.",
    "repeat": lambda doc: "????????????????",  # degenerate output (docs/metrics.md): one token repeated
}


class FakeLM(LM):
    def __init__(self, mode: str = "hit", batch_size=1, device=None, **kwargs) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"unknown fake mode {mode!r}")
        self.mode = mode

    def generate_until(self, requests, disable_tqdm: bool = False):
        out = []
        delay = float(os.environ.get("EVALKIT_FAKE_DELAY") or 0)  # seconds per request, to interrupt a run
        for req in requests:
            if delay:
                time.sleep(delay)
            CALLS.append((req.args[0], dict(req.args[1])))
            out.append(MODES[self.mode](req.doc))
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("the fake LM only generates")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("the fake LM only generates")

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in chat_history) + "<assistant>"

    @property
    def tokenizer_name(self) -> str:
        return "fake"


def register_fake_lm() -> None:
    from lm_eval.api.registry import model_registry, register_model

    if "evalkit-fake" not in model_registry:
        register_model("evalkit-fake")(FakeLM)
