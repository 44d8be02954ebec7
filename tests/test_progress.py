"""Visible progress: the probe tells its phases as they go and the share done only grows;
the phase bar's clock ticks while a silent step runs."""

from __future__ import annotations

import io
import time

from evalkit.engines.transformers import firststep as engine
from evalkit.progress import phases
from tests.tiny import load_tiny

CONTEXTS = ["The capital of France is", "One, two, three,", "Water boils at", "Hello"]


def test_the_probe_reports_each_phase_and_a_share_that_only_grows(tiny_model_dir):
    model, tokenizer = load_tiny(tiny_model_dir)
    told: list[tuple[str, float]] = []
    steps = engine.probe(model, tokenizer, CONTEXTS, [["Paris"], ["four"], ["100"], ["Hi"]], max_new_tokens=6,
                         batch_size=2, progress=lambda phase, share: told.append((phase, share)))
    plain = engine.probe(model, tokenizer, CONTEXTS, [["Paris"], ["four"], ["100"], ["Hi"]], max_new_tokens=6,
                         batch_size=2)
    assert [s.response_ids for s in steps] == [s.response_ids for s in plain]  # telling changes nothing
    shares = [share for _, share in told]
    assert shares == sorted(shares) and 0 < shares[0] and shares[-1] == 1.0
    phases_seen = [phase for phase, _ in told]
    assert phases_seen.count("batch done") == 2  # two batches of two prompts
    assert {"prefill done", "candidate trie"} <= set(phases_seen)
    assert any(p.startswith("decode (") and p.endswith(" rows)") for p in phases_seen)
    halfway = told[phases_seen.index("batch done")][1]
    assert halfway == 0.5  # the first batch is half of all prompts


def test_the_phase_bar_ticks_while_a_step_is_silent():
    out = io.StringIO()
    import evalkit.progress as progress

    real = progress.tqdm
    progress.tqdm = lambda *a, **k: real(*a, **{**k, "file": out, "mininterval": 0})
    try:
        with phases("converting x once", ["reading", "saving"], disable=False) as step:
            step("reading")
            time.sleep(2.3)  # nothing else reports: only the clock refreshes the bar
            step("saving")
    finally:
        progress.tqdm = real
    frames = out.getvalue().replace("\r", "\n").splitlines()
    reading = [f for f in frames if "reading" in f]
    assert any("[00:02]" in f for f in reading), frames
    assert frames[-1].startswith("converting x once: 2/2, done")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_probe_bar_ticks_while_the_engine_is_silent_and_stops_when_it_closes():
    """The first-token probe's bar froze for minutes in the candidate trie on a busy machine: the engine
    reports phases, not time. `keep_ticking` redraws it every second, until the bar closes."""
    from tqdm import tqdm

    from evalkit.progress import keep_ticking

    out = _Tty()
    bar = tqdm(total=4, desc="first-token probe", file=out, mininterval=0, bar_format="{desc}: {n}/{total} [{elapsed}]")
    keep_ticking(bar)
    bar.set_postfix_str("batch 1/2 candidate trie", refresh=False)
    time.sleep(2.5)  # the engine says nothing
    frames = out.getvalue().replace("\r", "\n").splitlines()
    assert any("[00:02]" in f for f in frames), frames  # the clock moved with no update
    bar.close()
    closed = len(out.getvalue())
    time.sleep(1.5)
    assert len(out.getvalue()) == closed  # nothing drawn after close: the thread ended


def test_into_a_log_the_bar_ticks_less_often():
    from tqdm import tqdm

    from evalkit import progress

    out = io.StringIO()  # not a terminal
    bar = tqdm(total=1, desc="x", file=out, mininterval=0)
    stop = progress.keep_ticking(bar)
    time.sleep(1.5)
    assert out.getvalue().count("\r") <= 2  # the first draw only, no per-second redraws
    stop()
    bar.close()
