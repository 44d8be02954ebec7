"""While a run works: its heartbeat, and what a signal does to it.

Owns: `Heartbeat` (a daemon thread that refreshes the run row's `heartbeat_at` every
`EVALKIT_HEARTBEAT_S` seconds, default 60; a busy DB just skips a beat) and
`exit_on_signals` (SIGINT, SIGTERM and SIGHUP mark the run `interrupted` and end the
process). A run killed without a word (kill -9, power loss) is recognised later from
its pid and heartbeat (`store.rows.is_abandoned`). Does not: decide what a run does.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from evalkit import envvars
from evalkit.store import runs

SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


class Heartbeat:
    """Refreshes one run's heartbeat in the background until `stop()`."""

    def __init__(self, db, run_id: str) -> None:
        self.db, self.run_id = db, run_id
        self.interval = envvars.heartbeat_s()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"evalkit-heartbeat-{run_id}", daemon=True)

    def start(self) -> Heartbeat:
        if self.interval > 0:
            self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                runs.heartbeat(self.db, self.run_id)
            except Exception:  # noqa: BLE001  (a busy or missing DB only costs one beat)
                pass

    def stop(self) -> None:
        """Stop and wait, so that no beat overlaps the run's final write."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def exit_on_signals(db, run_id: str, t0: float, writer: bool,
                    note: Callable[[], str] | None = None) -> Callable[[], None]:
    """While a run is under way, SIGINT, SIGTERM and SIGHUP mark it `interrupted` and end the process.

    The handler records the run and leaves with `os._exit(128 + signum)` rather than
    raising: an exception raised from a signal handler while torch or another native
    library is calling back into Python (an import, a forward hook) cannot unwind
    through C++ and aborts the process instead. Results not yet committed are simply
    never written, so no partial metrics exist. Returns the function that puts the
    previous handlers back. `note`: what to add to the message (how to resume the run).
    """

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if writer:
            try:
                runs.mark_interrupted(db, run_id, f"interrupted by {name}", time.monotonic() - t0)
            except BaseException:  # noqa: BLE001  (leaving is what matters now; readers see it abandoned)
                pass
        hint = note() if note else ""
        sys.stderr.write(f"evalkit: error: interrupted{hint}\n" if signum == signal.SIGINT
                         else f"evalkit: terminated{hint}\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    previous = {}
    try:
        for sig in SIGNALS:
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: Python delivers signals to the main thread only
        pass

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore
