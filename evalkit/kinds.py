"""The closed sets of values evalkit's modules pass between them, as `Literal` types.

Owns: each kind's name and its members, so a type checker (and a reader) sees every place
that takes one. Does not: hold defaults or behaviour; `typing.get_args(KIND)` lists the
members where code needs them at run time.
"""

from __future__ import annotations

from typing import Literal, get_args

# one checked (rule, task) pair of the release gate
CheckStatus = Literal["pass", "fail", "inconclusive"]
RowStatus = Literal["pass", "fail", "inconclusive", "skipped"]
# the gate as a whole: fail if any row fails, else inconclusive if any row is, else pass
GateOutcome = Literal["pass", "fail", "inconclusive"]
RuleKind = Literal["threshold", "regression"]
# a regression's tolerated drop: an absolute amount, or a share of the baseline's value
MarginKind = Literal["delta", "relative"]
ThresholdOp = Literal[">=", ">", "<=", "<", "=="]
# what exit 3 (inconclusive) becomes under `evalkit gate --on-inconclusive`
OnInconclusive = Literal["pass", "fail"]

ROW_STATUSES: tuple[str, ...] = get_args(RowStatus)
MARGIN_KINDS: tuple[str, ...] = get_args(MarginKind)
ON_INCONCLUSIVE: tuple[str, ...] = get_args(OnInconclusive)
