"""Progress for long work: bars whose clock ticks even while the work says nothing.

Owns: `keep_ticking`, a small thread that redraws a tqdm bar every second (on a terminal; every
`LOG_TICK_S` into a log or a pipe) until the bar closes, so a minute of silent work — a
prefill, the candidate trie, a model load on a busy machine — reads as a minute of visible
work and never as a hang; and `phases`, a ticking bar over a few named steps (loading a model,
converting a GGUF once). Does not: count prompts (the backends' own bars do, per prompt, within a
batch, and tick with `keep_ticking`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

from tqdm import tqdm

from evalkit.textsafe import term_line

BAR_FORMAT = "{desc}: {n}/{total}{postfix} [{elapsed}]"
TICK_S = 1.0  # seconds between redraws of a bar on a terminal
LOG_TICK_S = 15.0  # ... and into a file or a pipe (a CI log gets a line every 15 s, not every second)


def keep_ticking(bar: tqdm) -> Callable[[], None]:
    """Redraw `bar` (its elapsed time, its postfix as the work last set it) every `TICK_S` seconds on
    a terminal, every `LOG_TICK_S` elsewhere, from a daemon thread that ends when the bar closes or
    when the returned function is called. Nothing for a disabled bar.

    tqdm redraws only when the count moves; a step that moves nothing for minutes (a busy
    machine's prefill, the candidate trie) would leave its bar frozen."""
    stop = threading.Event()
    if bar.disable:
        return stop.set
    isatty = getattr(bar.fp, "isatty", None)
    every = TICK_S if callable(isatty) and isatty() else LOG_TICK_S

    def tick() -> None:
        while not stop.wait(every) and not bar.disable:  # tqdm.close() sets disable
            bar.refresh()

    threading.Thread(target=tick, daemon=True, name=f"tick {bar.desc}").start()
    return stop.set


@contextlib.contextmanager
def phases(desc: str, names: Sequence[str], *, disable: bool | None = None) -> Iterator[Callable[[str], None]]:
    """A bar `desc: k/N, <step> [elapsed]`; call the yielded function with each step's name as it
    starts (one of `names`, in order). The bar closes, complete, when the block ends. Shown on
    a terminal only (`disable=None`, tqdm's rule): a log or a pipe gets no carriage-return noise."""
    bar = tqdm(total=len(names), desc=term_line(desc), bar_format=BAR_FORMAT, disable=disable, leave=True)
    started = [0]

    def step(name: str) -> None:
        if started[0]:
            bar.update(1)
        started[0] += 1
        bar.set_postfix_str(term_line(name))  # a step may name a model or a file

    stop = keep_ticking(bar)
    try:
        yield step
        if started[0]:
            bar.update(1)
        bar.set_postfix_str("done")
    finally:
        stop()
        bar.close()
