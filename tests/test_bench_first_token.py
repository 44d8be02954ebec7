"""bench/first_token_vs_sampling.py runs end to end (on the tiny model), so it cannot rot.

The numbers it prints on the tiny model mean nothing; the test checks that every path
runs, that (b') agrees with (b) and that the cost breakdown is printed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_first_token_bench_runs_on_the_tiny_model(tiny_model_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "first_token_vs_sampling.py"),
         "--model-args", f"pretrained={tiny_model_dir}", "--per-lang", "1", "--repeats", "2"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert re.search(r"\(a\)/\(b\) = [\d.]+x\s+target >= 50x", text)
    assert re.search(r"\(a\)/\(c\) = [\d.]+x", text)
    worst = float(re.search(r"max \|metric difference\| ([\d.e+-]+)", text).group(1))
    assert worst < 1e-4
    assert re.search(r"forwards per prompt: \d+ prompt tokens \+ \d+ candidate-trie positions", text)
    assert "en-0001" in text and "zh-0001" in text
