"""What the gate reads of a run and what it says back: `RunData` (one run as plain values),
`VerdictRow` and `Verdict`, and how their numbers print.

Owns: the data the decision is made on and returned in, and the words that mark rows decided
without a test of their own. Does not: decide anything (`release.decide`), read the DB
(`release.db`), or render a table (`release.render`).
"""

import math
from dataclasses import dataclass, field
from typing import Any

from evalkit.kinds import GateOutcome, RowStatus, RuleKind
from evalkit.release import paired

TWIN_WORDS = "left to its exact twin"  # how a row left to its twin begins (`_twins_speak`)
NOT_COMPUTED_WORDS = "not computed"  # how a row on a metric a run did not compute begins (`_not_computed`)
DEGENERATE_METRIC = "degenerate"  # the metric of the row that refuses a degenerate candidate (`decide`)

# the two-sided level of every interval; a fail is one-sided at ALPHA / 2 after Holm
ALPHA = 0.05
N_BOOT = 4000


@dataclass
class RunData:
    """What the gate needs of one run, as plain values (the caller reads the DB)."""

    run_id: str
    metrics: dict[tuple[str, str], float]  # (task, metric) -> aggregate value
    samples: dict[tuple[str, str], dict[str, float]]  # (task, doc_id) -> {metric: value}
    # (task, metric) -> (ci_lo, ci_hi, n) stored with an aggregate (group tasks, derived metrics, AUROCs)
    intervals: dict[tuple[str, str], tuple[float, float, int | None]] = field(default_factory=dict)
    # pair metric -> why this run cannot have it against the other (no first-token top-k stored)
    lacks: dict[str, str] = field(default_factory=dict)
    pairing: Any = None  # compare.Pairing of the two runs' top-k (event space, K cut, tokenizers); None: not paired
    # registry metric -> why the run did not compute it (the run row's `unavailable`: `evalkit run --metrics`
    # skipped it, or its engine cannot); a rule on it is then "not computed", never a fail
    not_computed: dict[str, str] = field(default_factory=dict)
    # task -> why the run's output there is degenerate (`scoring.degenerate`, the `degenerate` table): the
    # upgrade rules pass no candidate that has one
    degenerate: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class VerdictRow:
    """One checked (rule, task) pair."""

    kind: RuleKind
    task: str | None  # None when the rule matched no task
    metric: str
    status: RowStatus
    reason: str  # one human line
    observed: float | None = None  # candidate: its value (threshold) or paired mean (regression)
    baseline: float | None = None  # baseline paired mean (regression)
    op: str | None = None  # threshold operator
    limit: float | None = None  # threshold bound, or the tolerated drop in the metric's units
    margin: str | None = None  # the regression's margin as the rule gave it ("0.05", "10 % of baseline")
    drop: float | None = None  # how much worse the candidate is (regression), over the paired prompts
    ci: tuple[float, float] | None = None  # 95 % interval of the drop (regression) or of the value (threshold)
    n: int | None = None  # paired prompts (regression), prompts (threshold)
    method: str | None = None  # the test behind the interval
    p_fail: float | None = None  # one-sided p of "no worse than the limit"; Holm runs over these
    decide_n: int | None = None  # about how many prompts would decide an inconclusive row
    higher_is_better: bool = True

    @property
    def name(self) -> str:
        return f"{self.task or '*'}/{self.metric}"


@dataclass(frozen=True)
class Verdict:
    outcome: GateOutcome
    rows: list[VerdictRow]
    family: int = 0  # checks Holm corrected over

    @property
    def passed(self) -> bool:
        return self.outcome == "pass"

    @property
    def reasons(self) -> list[str]:
        """One line per failing row (per inconclusive row when none fails)."""
        status = "fail" if self.outcome == "fail" else "inconclusive"
        return [f"{r.kind} {r.name}: {r.reason}" for r in self.rows if r.status == status]

    def count(self, status: RowStatus) -> int:
        return sum(1 for r in self.rows if r.status == status)

    @property
    def summary(self) -> str:
        """How the outcome was reached, in one line under the table."""
        return (f"A fail needs the 95 % interval wholly past its limit and Holm's correction over the "
                f"{self.family} checks that could fail (family-wise false-fail rate at most {100 * ALPHA / 2:g} %, "
                "one-sided); a pass needs every check's interval wholly on the right side; anything else is "
                "inconclusive." + (
                    " Under the default rules a 0/1 check its outcomes cannot decide at this size is left to its "
                    "exact, continuous twin on the same task when the twin passes (answer_hit to answer_prob); "
                    "such rows are marked skipped and say so." if any(r.reason.startswith(TWIN_WORDS) for r in self.rows)
                    else "") + (
                    f" {_rows_read(sum(r.reason.startswith(NOT_COMPUTED_WORDS) for r in self.rows))} a metric a run "
                    "did not compute (evalkit run --metrics skipped it, or its engine cannot): under the default rules such a "
                    "row is left to the metric that stands for it (its exact twin, or its stand-in) where that "
                    "passes, else it is inconclusive; it never fails." if any(
                        r.reason.startswith(NOT_COMPUTED_WORDS) for r in self.rows) else ""))


def _rows_read(n: int) -> str:
    """How many rows read something, the verb agreeing.

    >>> _rows_read(1), _rows_read(4)
    ('1 row reads', '4 rows read')
    """
    return "1 row reads" if n == 1 else f"{n} rows read"


def _value(v: Any) -> float | None:
    """A per-sample or aggregate value as a finite float; None when null, NaN or not a number."""
    if v is None or isinstance(v, str):
        return None
    try:
        f = float(v)  # bools and numpy scalars too
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _metric_tasks(run: RunData) -> dict[str, set[str]]:
    """metric -> tasks where the run has per-sample values of it.

    Regressions pair per-sample values, so only these tasks can carry one; a
    group task (aggregate rows only, e.g. `firsttoken`) is left to thresholds.
    """
    found: dict[str, set[str]] = {}
    for (task, _doc), values in run.samples.items():
        for metric, v in values.items():
            if _value(v) is not None:
                found.setdefault(metric, set()).add(task)
    return found


def fmt(x: float | None) -> str:
    """A number as the verdict shows it (4 significant digits; -0 as 0)."""
    if x is None:
        return ""
    return f"{x + 0.0:.4g}"  # + 0.0 turns −0.0 into 0.0


def _prompts(n: int | None) -> str:
    if n is None:
        return "no number of prompts would decide it (the estimate sits on the limit)"
    if n > paired.MAX_DECIDE_N:
        return f"more than {paired.MAX_DECIDE_N:,} prompts would be needed to decide it"
    return f"about {n:,} prompts would decide it"
