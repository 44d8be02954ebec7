"""Degenerate output: a run's task whose responses say nothing a metric may rank.

Owns: the tests of one response (`is_empty`, `repeated_unit`), the verdict on one task's responses
(`degenerate(...) -> Finding`, thresholds `defaults.DEGENERATE_*`, `REPEAT_*`) and the `degenerate`
rows of a run, one per task and group (`task_rows`, what migration m029's table holds). A model fed
input it never expects (Gemma without the BOS its tokenizer declares) answers "????????" or stops at
once; such a run looks confident (low entropy, stable, free of openers), so its numbers are named,
never ranked: the report bolds none of them, and the gate's upgrade rules do not pass it.

Does not: compute `special_mass` (the engines do, at the first step: the mass on the tokens that add
no text, `engines.vocab`), store rows (`store.rows`), or print (the CLI and the report do).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from evalkit.defaults import DEGENERATE_SHARE, DEGENERATE_SPECIAL_MASS, REPEAT_MAX_UNIT, REPEAT_MIN_COPIES

# the `degenerate` table's columns (m029), in order
COLUMNS = ("run_id", "task", "n", "n_empty", "n_at_once", "n_cut", "n_repeated", "special_mass", "degenerate",
           "reason", "example")
EXAMPLE_CHARS = 40  # an example response is cut to this many characters


def is_empty(response: str) -> bool:
    """No visible character: the model ended at once, or gave whitespace only (a stop sequence may
    have cut it there).

    >>> is_empty(""), is_empty(" \\n\\n"), is_empty("?")
    (True, True, False)
    """
    return not response.strip()


def repeated_unit(response: str, min_copies: int = REPEAT_MIN_COPIES, max_unit: int = REPEAT_MAX_UNIT) -> str | None:
    """The unit a response repeats and nothing else, its whitespace removed: at least `min_copies`
    copies of one unit of at most `max_unit` characters, the last copy possibly cut short by the
    token limit; None when it is anything else.

    >>> repeated_unit("????????"), repeated_unit("</h4></h4></h4></h"), repeated_unit("？？？？")
    ('?', '</h4>', '？')
    >>> repeated_unit("ha ha ha"), repeated_unit("Paris"), repeated_unit("??"), repeated_unit("1000")
    ('ha', None, None, None)
    """
    text = "".join(response.split())
    for size in range(1, min(max_unit, len(text) // min_copies) + 1):
        unit = text[:size]
        if (unit * (len(text) // size + 1)).startswith(text):
            return unit
    return None


@dataclass(frozen=True)
class Finding:
    """One task's responses, counted, and whether they are degenerate (with the reason in words)."""

    n: int  # responses with text (a run that generated none, `--metrics gate`, has 0)
    n_empty: int  # no visible character
    n_at_once: int  # of those, ended at the first step (no token generated)
    n_cut: int  # of those, cut by the task's stop sequence right after whitespace the model opened with
    n_repeated: int  # one unit repeated and nothing else
    special_mass: float | None  # mean first-step mass on the special tokens; None: no prompt has it
    degenerate: bool
    reason: str | None  # why it is flagged; None when it is not
    example: str | None  # a degenerate response, cut to EXAMPLE_CHARS

    def row(self, run_id: str, task: str) -> dict[str, Any]:
        return {"run_id": run_id, "task": task, "n": self.n, "n_empty": self.n_empty, "n_at_once": self.n_at_once,
                "n_cut": self.n_cut, "n_repeated": self.n_repeated, "special_mass": self.special_mass, "degenerate": self.degenerate,
                "reason": self.reason, "example": self.example}


def degenerate(responses: Sequence[str | None], at_once: Sequence[bool] = (),
               special_masses: Iterable[float | None] = (), cut: Sequence[bool] = (), *,
               share: float = DEGENERATE_SHARE, special_mass: float = DEGENERATE_SPECIAL_MASS) -> Finding:
    """The verdict on one task's responses: degenerate when more than `share` of the responses with
    text are empty or one unit repeated, or when the mean first-step mass on special tokens (per
    prompt, where the engine had the distribution) is above `special_mass`. `at_once[i]`: response i
    ended at the first step; `cut[i]`: the task's stop sequence cut it right after whitespace the model
    opened with (an empty response all the same: its text metrics read a miss; the reason says so).
    A response of None (not generated) counts for neither share.

    >>> f = degenerate(["????????", "？？？？", "</h4></h4></h4>", "Paris"], special_masses=[0.01, 0.0, 0.02, 0.01])
    >>> f.degenerate, f.n_repeated, f.reason
    (True, 3, '3 of 4 responses repeat one token or character (e.g. "????????")')
    >>> f = degenerate(["", "", " ", "Paris"], at_once=[True, True, False, False])
    >>> f.n_empty, f.n_at_once, f.reason
    (3, 2, '3 of 4 responses are empty (2 ended at once)')
    >>> degenerate(["", "", "Paris"], cut=[True, True, False]).reason
    '2 of 3 responses are empty (2 cut by the stop sequence after the whitespace they open with)'
    >>> degenerate(["Paris", "", "Rome", "????"]).degenerate  # half is not more than half
    False
    >>> f = degenerate([None, None], special_masses=[0.9, 0.7])
    >>> f.degenerate, f.reason
    (True, 'the first-step mass on special tokens (EOS and others) is 0.80 on average, above 0.5')
    >>> degenerate([]).degenerate
    False
    """
    texts = [(i, r) for i, r in enumerate(responses) if r is not None]
    ended = list(at_once) + [False] * (len(responses) - len(at_once))
    stopped = list(cut) + [False] * (len(responses) - len(cut))
    empty = [i for i, r in texts if is_empty(r)]
    units = {i: u for i, r in texts if not is_empty(r) and (u := repeated_unit(r)) is not None}
    masses = [float(m) for m in special_masses if m is not None]
    mean_mass = sum(masses) / len(masses) if masses else None
    n = len(texts)
    reasons = []
    example = None
    if n and (len(empty) + len(units)) / n > share:
        if units:
            first = min(units)
            example = str(responses[first])[:EXAMPLE_CHARS]
            reasons.append(f"{len(units)} of {n} responses repeat one token or character (e.g. {_quoted(example)})")
        if empty:
            gone, cut_short = sum(1 for i in empty if ended[i]), sum(1 for i in empty if stopped[i])
            how = [f"{gone} ended at once"] if gone else []
            how += [f"{cut_short} cut by the stop sequence after the whitespace they open with"] if cut_short else []
            reasons.append(f"{len(empty)} of {n} responses are empty" + (f" ({', '.join(how)})" if how else ""))
            example = example if example is not None else str(responses[empty[0]])
    if mean_mass is not None and mean_mass > special_mass:
        reasons.append(f"the first-step mass on special tokens (EOS and others) is {mean_mass:.2f} on average, "
                       f"above {special_mass:g}")
    return Finding(n=n, n_empty=len(empty), n_at_once=sum(1 for i in empty if ended[i]),
                   n_cut=sum(1 for i in empty if stopped[i]), n_repeated=len(units),
                   special_mass=mean_mass, degenerate=bool(reasons), reason="; ".join(reasons) or None,
                   example=example)


def _quoted(text: str) -> str:
    return '"' + text.replace("\n", "\\n") + '"'


def task_rows(run_id: str, samples: Sequence[Mapping[str, Any]],
              groups: Mapping[str, Sequence[str]] | None = None) -> list[dict[str, Any]]:
    """The `degenerate` rows of a run: one per task its samples hold, and one per group over its
    members' samples (`groups`: lm-eval's group_subtasks, nested groups included), from the stored
    per-sample values (response, first_token_id, special_mass). Samples of an lm-eval task that
    answers by loglikelihood (no first token) count for no response.
    """
    by_task: dict[str, list[Mapping[str, Any]]] = {}
    for s in samples:
        by_task.setdefault(str(s["task"]), []).append(s)

    def members(task: str, seen: frozenset[str] = frozenset()) -> list[str]:
        if groups is None or task not in groups or task in seen:
            return [task]
        return [leaf for sub in groups[task] for leaf in members(sub, seen | {task})]

    out = []
    names = list(by_task) + [g for g in (groups or {}) if g not in by_task]
    for task in sorted(names):
        rows = [s for leaf in dict.fromkeys(members(task)) for s in by_task.get(leaf, [])]
        if not rows:
            continue
        generated = [s.get("response") if _generated(s) else None for s in rows]
        at_once = [g is not None and is_empty(g) and s.get("first_token_id") is None for g, s in zip(generated, rows)]
        cut = [g == "" and bool(s.get("first_token")) and is_empty(str(s.get("first_token")))
               for g, s in zip(generated, rows)]
        finding = degenerate(generated, at_once, [s.get("special_mass") for s in rows], cut)
        out.append(finding.row(run_id, task))
    return out


def _generated(sample: Mapping[str, Any]) -> bool:
    """A sample whose response is generated text (evalkit's tasks, lm-eval's generating ones), not a
    loglikelihood answer (those store no first token or first unit)."""
    return sample.get("response") is not None and (
        sample.get("first_token") is not None or sample.get("first_unit") is not None
        or sample.get("first_token_id") is not None)
