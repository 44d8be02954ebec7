"""Progress for long work: bars on a terminal, dated lines in a log, and a clock that ticks
even while the work says nothing.

Owns: `bar` (a tqdm bar on a terminal; into a log or a pipe a `LineBar`, which writes a
newline-terminated line at most every `LOG_TICK_S` seconds — phase, done / total, rate, ETA —
and one at the end, never a carriage return), `keep_ticking`, a small thread that redraws a bar
every second until it closes, so a minute of silent work — a prefill, the candidate trie, a model
load on a busy machine — reads as a minute of visible work and never as a hang; and `phases`, a
ticking bar over a few named steps (loading a model, converting a GGUF once), which into a log
announces itself in one line as it starts. Does not: count prompts (the backends' own bars do,
per prompt, within a batch, and tick with `keep_ticking`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from tqdm import tqdm

from evalkit.textsafe import term_line

BAR_FORMAT = "{desc}: {n}/{total}{postfix} [{elapsed}]"
TICK_S = 1.0  # seconds between redraws of a bar on a terminal
LOG_TICK_S = 15.0  # ... and between lines into a file or a pipe (a CI log gets a line every 15 s, not every second)


def is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(callable(isatty) and isatty())
    except ValueError:  # a closed stream
        return False


class LineBar(tqdm):
    """A tqdm bar for a log: each draw is a whole line ending in a newline, at most one every
    `LOG_TICK_S` seconds (the first draw, the bar's creation, always unless `announce=False`;
    `final`: one more as it closes, with the whole run's rate). No carriage return, no bar
    glyphs, so a 40-minute run redirected to a file reads as lines, not one line of redraws:

        first-token probe: 120/470 prompts (26 %), 2.41 prompts/s, elapsed 00:49, ETA 02:25, batch 4/15 decode (12 rows)

    `steps=True` (the phases of `phases`): `desc: <step> [elapsed]`."""

    def __init__(self, *args: Any, final: bool = True, steps: bool = False, announce: bool = True,
                 **kwargs: Any) -> None:
        self._last_line: float | None = None if announce else time.monotonic()
        self._last_text = ""
        self._final = final
        self._steps = steps
        kwargs["disable"] = False
        kwargs.setdefault("file", sys.stderr)
        super().__init__(*args, **kwargs)

    def text(self) -> str:
        """The line as it reads now."""
        d = self.format_dict
        desc, phase, elapsed = d["prefix"] or "", d["postfix"] or "", d["elapsed"]
        if self._steps:
            return f"{desc}: {phase} [{self.format_interval(elapsed)}]"
        n, total, unit = d["n"], d["total"], d["unit"]
        done = f"{int(n)}/{int(total)} {unit}s ({int(100 * n / total)} %)" if total else f"{int(n)} {unit}s"
        rate = n / elapsed if elapsed > 0 and n > 0 else None
        speed = "rate ?" if rate is None else f"{rate:.3g} {unit}s/s"
        eta = ("?" if rate is None or not total else self.format_interval(max(total - n, 0) / rate))
        return f"{desc}: {done}, {speed}, elapsed {self.format_interval(elapsed)}, ETA {eta}" + (
            f", {phase}" if phase else "")

    def line(self, force: bool = False) -> bool:
        """Write the current line if `LOG_TICK_S` passed since the last one (or `force`)."""
        now = time.monotonic()
        if not force and self._last_line is not None and now - self._last_line < LOG_TICK_S:
            return False
        text = " ".join(self.text().split())  # one line, whatever the phase's text holds
        if text == self._last_text:
            return False
        self._last_line, self._last_text = now, text
        try:
            self.fp.write(text + "\n")
            self.fp.flush()
        except ValueError:  # the stream was closed under us: nothing more to tell
            pass
        return True

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # tqdm clearing the line (leave=False): nothing to clear in a log
            return True
        return self.line()

    def close(self) -> None:
        if getattr(self, "disable", True):  # closed already, or never opened
            return
        with self._lock:
            self.disable = True  # ends `keep_ticking`'s thread, as tqdm.close does
            self._decr_instances(self)
            if self._final:
                self.line(force=True)


def bar(*args: Any, file: IO[str] | None = None, disable: bool | None = False, quiet: bool = False,
        **kwargs: Any) -> tqdm:
    """A progress bar: tqdm on a terminal (`args` and `kwargs` as tqdm takes them), a `LineBar` into
    a log or a pipe (`quiet`: no first and last line, only the ticks of a long wait). `disable=True`
    gives a disabled bar; None disables it off a terminal (tqdm's own rule)."""
    stream = file if file is not None else sys.stderr
    if isinstance(kwargs.get("desc"), str):  # what a bar shows never holds a secret (`redact`)
        from evalkit import redact

        kwargs["desc"] = redact.text(kwargs["desc"])
    if disable or (disable is None and not is_terminal(stream)):
        return tqdm(*args, file=stream, disable=True, **kwargs)
    if is_terminal(stream):
        return tqdm(*args, file=stream, disable=False, **kwargs)
    return LineBar(*args, file=stream, final=not quiet, announce=not quiet, **kwargs)


def keep_ticking(bar: tqdm) -> Callable[[], None]:
    """Redraw `bar` (its elapsed time, its postfix as the work last set it) every `TICK_S` seconds on
    a terminal, every `LOG_TICK_S` elsewhere, from a daemon thread that ends when the bar closes or
    when the returned function is called. Nothing for a disabled bar.

    tqdm redraws only when the count moves; a step that moves nothing for minutes (a busy
    machine's prefill, the candidate trie) would leave its bar frozen."""
    stop = threading.Event()
    if bar.disable:
        return stop.set
    # a LineBar keeps its own pace (a line every LOG_TICK_S): asked every second, it writes on time
    every = TICK_S if isinstance(bar, LineBar) or is_terminal(bar.fp) else LOG_TICK_S

    def tick() -> None:
        while not stop.wait(every) and not bar.disable:  # tqdm.close() sets disable
            bar.refresh()

    threading.Thread(target=tick, daemon=True, name=f"tick {bar.desc}").start()
    return stop.set


@contextlib.contextmanager
def phases(desc: str, names: Sequence[str], *, disable: bool | None = None,
           file: IO[str] | None = None) -> Iterator[Callable[[str], None]]:
    """A bar `desc: k/N, <step> [elapsed]`; call the yielded function with each step's name as it
    starts (one of `names`, in order). The bar closes, complete, when the block ends. On a
    terminal a ticking tqdm bar; into a log or a pipe (`file`, default stderr) one line as the
    first step starts (`desc: step [00:00]`: the announcement), then a line every `LOG_TICK_S`
    while it lasts, never a carriage return. `disable=True`: nothing at all."""
    stream = file if file is not None else sys.stderr
    shown: tqdm
    if disable or is_terminal(stream):
        shown = tqdm(total=len(names), desc=term_line(desc), bar_format=BAR_FORMAT, disable=bool(disable), leave=True,
                     file=stream)
    else:
        shown = LineBar(total=len(names), desc=term_line(desc), leave=True, file=stream, steps=True, final=False,
                        announce=False)
    started = [0]

    def step(name: str) -> None:
        if started[0]:
            shown.update(1)
        started[0] += 1
        shown.set_postfix_str(term_line(name), refresh=not isinstance(shown, LineBar))
        if isinstance(shown, LineBar) and started[0] == 1:
            shown.line(force=True)  # the announcement: what is starting

    stop = keep_ticking(shown)
    try:
        yield step
        if started[0]:
            shown.update(1)
        shown.set_postfix_str("done", refresh=not isinstance(shown, LineBar))
    finally:
        stop()
        shown.close()
