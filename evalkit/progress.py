"""Progress for long work that has no natural count: named phases, with a clock that ticks.

Owns: `phases`, a tqdm bar over a few named steps (loading a model, converting a GGUF once)
whose elapsed time is refreshed every second by a small thread while a step runs, so a
minute of silent work reads as a minute of visible work. Does not: count prompts (the
backends' own bars do, per prompt, within a batch).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence

from tqdm import tqdm

BAR_FORMAT = "{desc}: {n}/{total}{postfix} [{elapsed}]"


@contextlib.contextmanager
def phases(desc: str, names: Sequence[str], *, disable: bool | None = None) -> Iterator[Callable[[str], None]]:
    """A bar `desc: k/N, <step> [elapsed]`; call the yielded function with each step's name as it
    starts (one of `names`, in order). The bar closes, complete, when the block ends. Shown on
    a terminal only (`disable=None`, tqdm's rule): a log or a pipe gets no carriage-return noise."""
    bar = tqdm(total=len(names), desc=desc, bar_format=BAR_FORMAT, disable=disable, leave=True)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            bar.refresh()

    started = [0]

    def step(name: str) -> None:
        if started[0]:
            bar.update(1)
        started[0] += 1
        bar.set_postfix_str(name)

    clock = threading.Thread(target=tick, daemon=True)
    if not bar.disable:
        clock.start()
    try:
        yield step
        if started[0]:
            bar.update(1)
        bar.set_postfix_str("done")
    finally:
        stop.set()
        if clock.is_alive():
            clock.join()
        bar.close()
