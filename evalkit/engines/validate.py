"""The numbers an engine returns, checked at the engine boundary before anything is scored or stored.

Owns: what a first step may hold (`check_values`), one check for each shape an engine hands back:
`check_result` (a `FirstStepResult`: the server, vLLM and llama.cpp engines call it on every result),
`check_first_step` (anything shaped like `firststep.FirstStep`: `topk_ids`, `topk_logprobs`, `entropy`,
`candidate_probs`; the transformers engine's one-line hook) and `check_logprobs` (raw per-token
logprobs, such as a server's echoed prompt logprobs). A value that fails is `EngineOutput` (a
`RunFailed`: the run fails, exit 1) with one line naming the engine, the prompt and the value; it is
never stored. The rules:
- every number finite;
- a logprob <= 0, up to `LOGPROB_TOLERANCE` (float rounding of a log-softmax);
- no token twice among the top-k (by id; a server's JSON object with a key twice is refused where it
  is read, `server.read_json`);
- the top-k's total probability <= 1, up to `MASS_TOLERANCE`;
- every metric within its registered range (`registry.Metric.lo` / `hi`), up to `MASS_TOLERANCE`.
Does not: repair or clip a value, compute metrics, or talk to an engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from evalkit.contract import FirstStepResult
from evalkit.errors import RunFailed
from evalkit.scoring import registry

LOGPROB_TOLERANCE = 1e-4  # nats: a log-softmax rounded in float32 / fp16 lands a little above 0, never more
MASS_TOLERANCE = 1e-3  # probability: the top-k sum of such rounded logprobs, and a metric's registered range
_PROMPT_SHOWN = 60  # characters of the prompt a message shows (callers pass the doc's prompt, not the template)


class EngineOutput(RunFailed):
    """An engine returned a number no distribution can hold (a logprob above 0, NaN, a mass above 1 ...)."""


def check_values(topk: Sequence[tuple[Any, float]], *, entropy: float | None = None,
                 metrics: Mapping[str, float] | None = None, source: str, prompt: str) -> None:
    """Check one first step: `topk` as [(token id or text, logprob)], likeliest first; `entropy` in
    nats (None: unknown); `metrics`: registry name -> value. Raises `EngineOutput`.

    >>> check_values([(5, -0.1), (7, -2.5)], entropy=0.4, metrics={"top1_prob": 0.9}, source="s", prompt="p")
    >>> check_values([(5, 3.0)], source="the server at http://h/v1", prompt="Capital of France?")
    Traceback (most recent call last):
    ...
    evalkit.engines.validate.EngineOutput: the server at http://h/v1 returned logprob 3 for token 5 of prompt 'Capital of France?': a logprob is at most 0
    """
    seen: set[Any] = set()
    mass = 0.0
    for token, logprob in topk:
        if not _is_number(logprob) or not math.isfinite(logprob):
            raise EngineOutput(f"{source} returned logprob {logprob!r} for token {token!r} of prompt "
                               f"{_shown(prompt)}: not a finite number")
        if logprob > LOGPROB_TOLERANCE:
            raise EngineOutput(f"{source} returned logprob {logprob:g} for token {token!r} of prompt "
                               f"{_shown(prompt)}: a logprob is at most 0")
        if token in seen:
            raise EngineOutput(f"{source} returned token {token!r} twice in the top-k of prompt {_shown(prompt)}")
        seen.add(token)
        mass += math.exp(min(logprob, 0.0))
    if mass > 1 + MASS_TOLERANCE:
        raise EngineOutput(f"{source} returned a top-{len(seen)} whose probabilities sum to {mass:.6g} for prompt "
                           f"{_shown(prompt)}: a distribution sums to at most 1")
    if entropy is not None:
        if not _is_number(entropy) or not math.isfinite(entropy) or entropy < -LOGPROB_TOLERANCE:
            raise EngineOutput(f"{source} returned entropy {entropy!r} for prompt {_shown(prompt)}: "
                               "an entropy is a finite number >= 0")
    for name, value in (metrics or {}).items():
        _check_metric(name, value, source, prompt)


def check_logprobs(values: Iterable[float | None], *, source: str, prompt: str, what: str = "prompt logprob") -> None:
    """Check raw per-token logprobs (None is a position the engine gives none for, e.g. the first token).

    >>> check_logprobs([None, -1.0, -0.5], source="s", prompt="p")
    >>> check_logprobs([-1.0, float("nan")], source="s", prompt="p")
    Traceback (most recent call last):
    ...
    evalkit.engines.validate.EngineOutput: s returned prompt logprob nan at position 1 of prompt 'p': a logprob is a finite number <= 0
    """
    for i, value in enumerate(values):
        if value is None:
            continue
        if not _is_number(value) or not math.isfinite(value) or value > LOGPROB_TOLERANCE:
            raise EngineOutput(f"{source} returned {what} {value!r} at position {i} of prompt {_shown(prompt)}: "
                               "a logprob is a finite number <= 0")


def check_result(result: FirstStepResult, *, source: str, prompt: str) -> FirstStepResult:
    """Check a `FirstStepResult` (its top-k by token id, entropy, metrics); returns it unchanged. Two ids
    may decode to one text (byte tokens); an engine that names tokens by text (a server's JSON
    `top_logprobs`) is checked for a text given twice where it is read (`server.Client`)."""
    check_values([(t, lp) for t, _, lp in result.topk], entropy=result.entropy, metrics=result.metrics,
                 source=source, prompt=prompt)
    return result


def check_first_step(step: Any, *, source: str, prompt: str) -> Any:
    """Check anything shaped like `firststep.FirstStep` (`topk_ids`, `topk_logprobs`, `entropy`,
    `candidate_probs`); returns it unchanged. The transformers engine's hook, one line where each
    step is built: `validate.check_first_step(step, source="transformers", prompt=context)`."""
    ids = list(getattr(step, "topk_ids", []))
    logprobs = list(getattr(step, "topk_logprobs", []))
    if len(ids) != len(logprobs):
        raise EngineOutput(f"{source} returned {len(ids)} top-k ids and {len(logprobs)} logprobs for prompt "
                           f"{_shown(prompt)}")
    probs = getattr(step, "candidate_probs", None) or {}
    for candidate, p in probs.items():
        if not _is_number(p) or not math.isfinite(p) or not -MASS_TOLERANCE <= p <= 1 + MASS_TOLERANCE:
            raise EngineOutput(f"{source} returned probability {p!r} for the start {candidate!r} of prompt "
                               f"{_shown(prompt)}: a probability is in [0, 1]")
    check_values(list(zip(ids, logprobs)), entropy=getattr(step, "entropy", None), source=source, prompt=prompt)
    return step


def _check_metric(name: str, value: Any, source: str, prompt: str) -> None:
    if not _is_number(value) or not math.isfinite(value):
        raise EngineOutput(f"{source} gave {name} = {value!r} for prompt {_shown(prompt)}: not a finite number")
    metric = registry.get(name)
    if metric is None:
        return
    lo, hi = metric.lo, metric.hi
    if value < lo - MASS_TOLERANCE or (hi is not None and value > hi + MASS_TOLERANCE):
        span = f"[{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}"
        raise EngineOutput(f"{source} gave {name} = {value:.6g} for prompt {_shown(prompt)}: its range is {span}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(prompt: str) -> str:
    """The prompt as a message shows it: its first `_PROMPT_SHOWN` characters, on one line.

    >>> _shown("a\\nb"), _shown("x" * 100)[-4:]
    ("'a\\\\nb'", "xx…'")
    """
    text = prompt if len(prompt) <= _PROMPT_SHOWN else prompt[:_PROMPT_SHOWN] + "…"
    return repr(text)
