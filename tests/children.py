"""The test suite's child processes end with it.

Two guards, so that stopping `pytest` (Ctrl-C, or a kill of pytest alone) never leaves an
`evalkit run` child running:

- `die_with_parent()`: the child asks Linux to SIGKILL it when the process that started it
  ends (`prctl(PR_SET_PDEATHSIG)`); the launchers (`tests.fake_cli`, `tests.kill_cli`) call it
  first thing, and `preexec` does it between fork and exec for any other `Popen`. It holds even
  when pytest itself is killed with SIGKILL. (Linux ties it to the thread that forked the child:
  the suite starts its children from the main thread.)
- `end_children()`: every descendant of this process still alive, killed; conftest's
  session-scoped finalizer calls it as the session ends, Ctrl-C included.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send `sig` to this process when its parent ends; exit now if the parent
    (pid `parent`, when given) has already ended. Nothing where prctl is missing (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:  # the parent died before prctl ran
        os._exit(1)


def preexec(restore_sigint: bool = True) -> Callable[[], None]:
    """A `preexec_fn` for `subprocess.Popen`: the child dies with this process and, with
    `restore_sigint`, handles SIGINT by default (a shell's background job ignores it, and
    children inherit that)."""
    parent = os.getpid()

    def run() -> None:
        if restore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        die_with_parent(parent=parent)

    return run


def descendants(pid: int | None = None) -> list[int]:
    """Pids of every live descendant of `pid` (default this process), read from /proc."""
    root = os.getpid() if pid is None else pid
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        here = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == here]
        found += kids
        frontier += kids
    return found


def end_children(grace: float = 3.0) -> list[int]:
    """SIGTERM every live descendant of this process, then SIGKILL those left after `grace`
    seconds; returns the pids it signalled."""
    pids = descendants()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while sig == signal.SIGTERM and time.monotonic() < deadline and set(pids) & set(descendants()):
            time.sleep(0.1)
        pids_left = set(pids) & set(descendants())
        if not pids_left:
            break
    for pid in pids:  # reap our own children, so none stays a zombie
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    return pids
