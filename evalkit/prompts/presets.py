"""Named grids of needle lengths (`--needle-lengths default|long`), importable without anything heavy.

Owns: the presets' names and lengths. `long` reaches past the default grid into the lengths
where the embedded SmolLM2 (context 8192) loses the first sentence; its longest length is
7680, not 8192, because a prompt of 8192 tokens (plus the 2 % tolerance and 48 tokens to
answer) does not fit an 8192-token context. Its cost on CPU is in docs/cli.md (Tasks).
Does not: build documents (`prompts.needle`).
"""

from __future__ import annotations

DEFAULT_LENGTHS = (256, 512, 1024, 2048)
LENGTH_PRESETS = {
    "default": DEFAULT_LENGTHS,
    "long": (2048, 4096, 7680),
}
