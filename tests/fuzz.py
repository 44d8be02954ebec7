"""Settings of the property-based fuzz suite (tests/test_fuzz_*.py), bounded for CI.

Each fuzz test takes `fuzz(n)`: n generated cases in CI (derandomized, so a CI run is repeatable,
and no example database is written into the repository). `EVALKIT_FUZZ_EXAMPLES=N` runs N cases
per test instead, with fresh randomness each time, to search longer locally:

    EVALKIT_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz_*.py -x -q

What a case may end in, everywhere: a result, or one of evalkit's named errors (`EvalkitError`)
whose message is one line, with every input file and the DB keeping their bytes.
"""

from __future__ import annotations

import hashlib
import os
import re
from datetime import timedelta
from pathlib import Path

from hypothesis import HealthCheck, settings

from evalkit.errors import EvalkitError


def _examples() -> int | None:
    raw = os.environ.get("EVALKIT_FUZZ_EXAMPLES", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"EVALKIT_FUZZ_EXAMPLES must be a whole number >= 1, got {raw!r}")
    return int(raw)


LONG = _examples()


def fuzz(ci_examples: int, *, deadline_s: float = 5.0) -> settings:
    """Hypothesis settings: `ci_examples` cases (EVALKIT_FUZZ_EXAMPLES overrides), each within `deadline_s`."""
    return settings(
        max_examples=LONG or ci_examples,
        deadline=timedelta(seconds=deadline_s),
        derandomize=LONG is None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                               HealthCheck.data_too_large, HealthCheck.filter_too_much],
        print_blob=True,
    )


# a progress line of a log (`progress.LineBar`, stderr not a terminal): "loading tiny0: loading the model [00:00]",
# "first-token probe: 3/8 prompts (40 %), ..., ETA 00:10"; such lines may come before a one-line error
PROGRESS_LINE = re.compile(r"^(?!evalkit: ).*(\[\d\d:\d\d(:\d\d)?\]|, ETA [\d:?]+.*)$")


# a note evalkit prints as the model loads, not an error ("evalkit: note: load average 9.0 on 2 usable cores: ...")
NOTE_LINE = re.compile(r"^evalkit: note: ")


def error_lines(stderr: str) -> list[str]:
    """The lines of `stderr` that are not a log's progress lines or notes."""
    return [line for line in stderr.strip().splitlines() if not PROGRESS_LINE.match(line) and not NOTE_LINE.match(line)]


def one_line(exc: BaseException) -> None:
    """Assert an error is one of evalkit's named errors, with a one-line message."""
    assert isinstance(exc, EvalkitError), f"{type(exc).__name__} is not an evalkit error: {exc}"
    text = str(exc)
    assert text and "\n" not in text and "\r" not in text, f"not one line: {text!r}"


def fingerprint(*paths: Path) -> dict[str, str]:
    """SHA-256 of every file under `paths` (files or folders), to show nothing changed."""
    out = {}
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in files:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
