"""Visible progress: the probe tells its phases as they go and the share done only grows;
the phase bar's clock ticks while a silent step runs."""

from __future__ import annotations

import io
import re
import time

from evalkit.engines.transformers import firststep as engine
from evalkit.progress import phases
from tests.tiny import load_tiny

CONTEXTS = ["The capital of France is", "One, two, three,", "Water boils at", "Hello"]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


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
    out = _Tty()
    import evalkit.progress as progress

    real = progress.tqdm
    progress.tqdm = lambda *a, **k: real(*a, **{**k, "mininterval": 0})
    try:
        with phases("converting x once", ["reading", "saving"], disable=False, file=out) as step:
            step("reading")
            time.sleep(2.3)  # nothing else reports: only the clock refreshes the bar
            step("saving")
    finally:
        progress.tqdm = real
    frames = out.getvalue().replace("\r", "\n").splitlines()
    reading = [f for f in frames if "reading" in f]
    assert any("[00:02]" in f for f in reading), frames
    assert frames[-1].startswith("converting x once: 2/2, done")




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


# ---- into a log: lines, not redraws ------------------------------------------------------------


def test_into_a_log_progress_is_lines_at_most_every_tick_with_phase_count_rate_and_eta(monkeypatch):
    """A CI log got one 22 KB line of carriage-return redraws. Off a terminal the bar writes whole
    lines, newline-terminated, no more often than LOG_TICK_S (shortened here), and one at the end."""
    from evalkit import progress

    monkeypatch.setattr(progress, "LOG_TICK_S", 0.4)
    out = io.StringIO()  # not a terminal
    bar = progress.bar(total=40, desc="first-token probe", unit="prompt", file=out)
    assert isinstance(bar, progress.LineBar)
    stop = progress.keep_ticking(bar)
    t0 = time.monotonic()
    for i in range(40):  # an update every 50 ms: a terminal bar would redraw each time
        bar.n = i + 1
        bar.set_postfix_str(f"batch {i // 10 + 1}/4 candidate trie")
        time.sleep(0.05)
    took = time.monotonic() - t0
    bar.close()
    stop()
    text = out.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    assert 3 <= len(lines) <= 2 + took / 0.4, lines  # the first, one per tick at most, the last
    assert lines[0].startswith("first-token probe: 0/40 prompts (0 %), rate ?")
    assert lines[-1].startswith("first-token probe: 40/40 prompts (100 %), ")
    for line in lines[1:]:
        assert re.fullmatch(r"first-token probe: \d+/40 prompts \(\d+ %\), [\d.]+ prompts/s, elapsed 00:0\d, "
                            r"ETA \d\d:\d\d, batch \d/4 candidate trie", line), line
    time.sleep(0.5)
    assert out.getvalue() == text  # closed: nothing more


def test_a_silent_phase_still_gets_a_line_every_tick_in_a_log(monkeypatch):
    from evalkit import progress

    monkeypatch.setattr(progress, "LOG_TICK_S", 0.5)
    out = io.StringIO()
    bar = progress.bar(total=4, desc="first-token probe", unit="prompt", file=out)
    stop = progress.keep_ticking(bar)
    bar.set_postfix_str("batch 1/1 decode (4 rows)", refresh=False)
    time.sleep(2.2)  # the engine says nothing; the clock does
    stop()
    lines = out.getvalue().splitlines()
    assert 3 <= len(lines) <= 5 and all("decode (4 rows)" in line for line in lines[1:]), lines


def test_model_load_and_conversion_announce_themselves_in_one_line_in_a_log():
    out = io.StringIO()
    with phases("loading SmolLM2-135M-Instruct (q4_1)", ["loading the model"], file=out) as step:
        step("loading the model")
    assert out.getvalue() == "loading SmolLM2-135M-Instruct (q4_1): loading the model [00:00]\n"
    out = io.StringIO()
    with phases("converting m.gguf once into the model cache", ["reading the GGUF", "saving"], file=out) as step:
        step("reading the GGUF")
        step("saving")  # within the tick: no second line
    assert out.getvalue().splitlines() == ["converting m.gguf once into the model cache: reading the GGUF [00:00]"]
    out = io.StringIO()
    with phases("loading x", ["loading the model"], file=out, disable=True) as step:
        step("loading the model")
    assert out.getvalue() == ""


def test_on_a_terminal_the_bar_is_tqdms():
    from tqdm import tqdm

    from evalkit import progress

    bar = progress.bar(total=1, desc="x", file=_Tty())
    assert type(bar) is tqdm and not bar.disable
    bar.close()
    assert progress.bar(total=1, desc="x", file=io.StringIO(), disable=True).disable
