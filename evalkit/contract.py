"""The contract between the lm-eval side (tasks, backends) and the rest of evalkit.

Owns: the kinds of document evalkit's tasks produce (each doc says its `kind`), and
`FirstStepResult`, what evalkit's backends return for one greedy request instead of a
bare string. lm-eval passes a response through `resps` to the task's `process_results`
and into the logged samples unchanged, so the same object reaches scoring and storage.
Any other lm-eval backend answers with a string, or a list of strings under the sampled
protocol; `response_text` reads the text of all three. Does not: compute anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# doc["kind"] of evalkit's tasks
FIRSTTOKEN = "firsttoken"  # a prompt with accepted answer starts (tasks/firsttoken, --prompts)
NEEDLE = "needle"  # a needle document (tasks/needle)
CONFLICT = "conflict"  # one key with two values, first and last sentence (tasks/needle_conflict)
DOC_KINDS = (FIRSTTOKEN, NEEDLE, CONFLICT)


@dataclass
class FirstStepResult:
    """One greedy response and its first step, as a backend read it off the model."""

    text: str | None  # the response, cut before its stop strings; None: not generated (`--metrics`)
    first_token_id: int | None  # None: the response is empty (the model said eos first)
    first_token: str  # its text ("" when empty)
    first_unit: str | None  # shortest prefix of tokens holding a whole non-space character; None: not generated
    topk: list[tuple[int, str, float]] = field(default_factory=list)  # (token id, text, logprob), likeliest first
    entropy: float | None = None  # full-vocabulary entropy in nats; None when the backend cannot know it
    metrics: dict[str, float] = field(default_factory=dict)  # distribution-level values, registry names
    answer_text: str | None = None  # the longer greedy continuation of a prompt with checkable answers
    units: dict[int, str] = field(default_factory=dict)  # top token id -> the first unit it starts (§1.0)
    # per-layer values of the prefill's attention (`--attention`): registry name -> one value per layer
    layers: dict[str, list[float]] = field(default_factory=dict)
    # the greedy tokens after the prompt, eos excluded: the answer continuation where there is one,
    # else the response (what drift by position teacher-forces; docs/drift.md)
    token_ids: list[int] = field(default_factory=list)
    # registry metrics the engine was told not to compute for this response (`evalkit run --metrics`,
    # `scoring.selection`): never scored, NULL in the run, the run row saying why
    skipped: tuple[str, ...] = ()
    # the first-character distribution over the whole vocabulary (docs/metrics.md §1.5, `engines.firstchar`):
    # its likeliest events (a character, or a special token's role) with their probabilities, likeliest
    # first; the resolved mass of the events left out; the mass the tolerance left unresolved. Empty and
    # None where the engine cannot read it (a server, vLLM)
    first_chars: list[tuple[str, float]] = field(default_factory=list)
    fc_rest_mass: float | None = None
    fc_unresolved_mass: float | None = None


class FirstStepText(str):
    """A FirstStepResult's text as a plain string, for lm-eval's own generating tasks (their regex
    filters and metrics take text); `step` keeps the result, so `collect` stores the first step."""

    step: FirstStepResult

    @classmethod
    def of(cls, result: FirstStepResult) -> FirstStepText:
        if result.text is None:
            raise ValueError("a generating task's response was not generated")
        text = cls(result.text)
        text.step = result
        return text


def doc_kind(doc: dict[str, Any]) -> str | None:
    """The doc's kind (FIRSTTOKEN, NEEDLE, CONFLICT), None for a doc of some other task."""
    kind = doc.get("kind")
    return kind if kind in DOC_KINDS else None


def response_text(resp: Any) -> str | None:
    """The text of one response: a string, the first of N sampled strings, or a FirstStepResult's text
    (None where the engine generated none: `evalkit run --metrics` skipped it).

    >>> response_text("Paris."), response_text(["a", "b"]), response_text(FirstStepResult("x", None, "", ""))
    ('Paris.', 'a', 'x')
    """
    if isinstance(resp, FirstStepResult):
        if resp.text is None:
            return None
        text = resp.text
    elif isinstance(resp, (list, tuple)):
        if not resp:
            raise ValueError("no sampled responses")
        text = resp[0]
    else:
        text = resp
    if not isinstance(text, str):
        raise TypeError(f"response must be text, got {type(text).__name__}")
    return text
