"""Load budget: the default model loads in < 5 s from the second time on (the converted-model cache).

Usage: python bench/model_load.py [--repeat 2]

Each load runs in a fresh process, with torch, transformers and lm-eval imported
first (not timed: every `evalkit run` pays them before it loads a model), then times
`models.load(models.resolve())` — the default SmolLM2 GGUF through lm-eval's HFLM, as
a run loads it. Three cases, in one script on the same machine:
  direct  EVALKIT_CACHE=none: the GGUF parsed, dequantised and its tokenizer converted;
  first   an empty cache: the same, plus saving the converted folder;
  later   the cache filled: safetensors and tokenizer.json read back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 5.0
CHILD = """
import time
import torch, transformers, lm_eval  # noqa: F401
from lm_eval.models.huggingface import HFLM  # noqa: F401
import evalkit.engines.transformers.model  # noqa: F401
from evalkit.engines import resolve as models
t = time.perf_counter()
lm = models.load(models.resolve(), batch_size=1)
print(f"LOAD {time.perf_counter() - t:.3f}")
"""


def load_seconds(cache: str) -> float:
    env = {**os.environ, "EVALKIT_CACHE": cache, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return float(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("LOAD ")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="evalkit-cache-") as cache:
        direct = [load_seconds("none") for _ in range(args.repeat)]
        first = load_seconds(cache)
        later = [load_seconds(cache) for _ in range(args.repeat)]
    d, lt = statistics.median(direct), statistics.median(later)
    print(f"direct (GGUF every time)  median {d:6.2f} s  {direct}")
    print(f"first  (GGUF + convert)          {first:6.2f} s")
    print(f"later  (converted cache)  median {lt:6.2f} s  {later}")
    print(f"first / later = {first / lt:.1f}x   direct / later = {d / lt:.1f}x   "
          f"target later < {TARGET_S} s: {'ok' if lt < TARGET_S else 'OVER BUDGET'}")
    return 0 if lt < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
