"""How evalkit's compute threads wait when other jobs share the CPU.

PyTorch's CPU kernels run on an OpenMP pool (GNU libgomp). By default a thread that finishes
its share of a kernel spins for a while before it sleeps, waiting for the others. On cores of
its own that is the fastest choice; on cores shared with other jobs (a CI runner whose load
average is several times its core count) a spinning thread burns the time slice the thread it
waits for needs, and every kernel's barrier waits for a descheduled thread. Measured on 2 cores
with 8 other busy processes (load average 9), 200 prompts of `evalkit run --metrics gate`: 621 s
wall and 239 CPU s spinning, 184 s and 47 CPU s with the threads waiting passively; on the same
cores idle, passive waiting costs 3–6 % (gate) to 12 % (a full run) of wall time
(docs/performance.md, "On a shared machine").

Owns: `usable_cores()`, the pure rule `wait_policy()` (passive when the 1-minute load average
is at least the usable cores, and the user set no policy), `settle_wait_policy()`, which applies
it to this process before torch loads (a run's first step, `api.run_all` and `api.resume`: planning
a `--model hf` run loads torch), and `announce()`, which says so as the model loads. Does not: set thread counts, or choose for a
user who set OMP_WAIT_POLICY (any value is theirs) or for a process that loaded torch already
(libgomp reads the variable once, when it loads).
"""

from __future__ import annotations

import os
import sys

from evalkit import envvars

POLICY_VAR = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def wait_policy(load: float | None, cores: int, chosen: str | None) -> str | None:
    """The wait policy to set: PASSIVE when no policy is `chosen` and the load average is at least
    the cores (other jobs already fill them); None: leave it to the default (or to the user).

    >>> wait_policy(9.2, 2, None), wait_policy(1.1, 2, None), wait_policy(2.0, 2, None)
    ('PASSIVE', None, 'PASSIVE')
    >>> wait_policy(9.2, 2, "ACTIVE"), wait_policy(None, 2, None)
    (None, None)
    """
    if chosen or load is None:
        return None
    return PASSIVE if load >= cores else None


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not available on this platform
        return None


_pending: list[str] = []  # the note of a policy set and not yet announced


def settle_wait_policy() -> str | None:
    """Set OMP_WAIT_POLICY=PASSIVE for this process when the machine is busy (`wait_policy`), while
    torch is not loaded yet; returns the one-line note `announce` prints, or None when nothing was set.
    Silent itself: it runs before a run's options are checked, whose errors must stay one line."""
    if "torch" in sys.modules:  # libgomp has read the environment already
        return None
    load, cores = _load_average(), usable_cores()
    chosen = envvars.VARS[POLICY_VAR].raw()
    policy = wait_policy(load, cores, chosen.strip() or None if chosen else None)
    if policy is None or load is None:
        return None
    os.environ["OMP_WAIT_POLICY"] = policy
    line = (f"evalkit: note: load average {load:.1f} on {cores} usable cores: compute threads wait "
            f"passively ({POLICY_VAR}={policy}; set {POLICY_VAR} to choose)")
    _pending.append(line)
    return line


def announce() -> None:
    """Print the note of a policy `settle_wait_policy` set, once (as the model loads)."""
    while _pending:
        print(_pending.pop(0), file=sys.stderr, flush=True)
