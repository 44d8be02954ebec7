"""What evalkit's wait policy (evalkit/threads.py) buys on a CPU other jobs fill, and what it costs on an
idle one: the same `evalkit run` with torch's OpenMP threads left to libgomp's default (they spin before
they sleep) and with the policy evalkit sets on a busy machine (OMP_WAIT_POLICY=PASSIVE), on idle cores
and then beside `--spinners` busy processes, side by side in one script.

Each run is a fresh `python -m evalkit`-like process whose load average is fixed (0: evalkit keeps the
default; 99: evalkit sets PASSIVE), so only the policy differs between a pair; its wall time and its CPU
seconds (RUSAGE_CHILDREN) are printed with the ratios:

    python bench/shared_cpu.py                       # 30 prompts a task, --metrics gate, 4 spinners a core
    python bench/shared_cpu.py --limit 100 --metrics all --spinners 8
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evalkit.threads import usable_cores  # noqa: E402

CHILD = """import os, sys
os.getloadavg = lambda: ({load}, {load}, {load})
from evalkit.cli import main
sys.argv = ['evalkit', 'run', '--tasks', 'firsttoken', '--limit', '{limit}', '--metrics', '{metrics}', '--db', {db!r},
            '--name', {name!r}]
main()
"""


def one_run(db: str, name: str, load: float, limit: int, metrics: str) -> tuple[float, float]:
    """(wall s, CPU s) of one run whose machine reads as `load`."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"PYTHONPATH": str(ROOT),
                                                                           "HF_HUB_OFFLINE": "1"}
    code = CHILD.format(load=load, limit=limit, metrics=metrics, db=db, name=name)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise SystemExit(f"run {name} failed ({out.returncode}): {out.stderr.strip()[-800:]}")
    passive = "OMP_WAIT_POLICY=PASSIVE" in out.stderr
    if passive != (load > 0):
        raise SystemExit(f"run {name}: expected the policy {'set' if load else 'left'}, stderr: {out.stderr[-400:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=30, help="prompts a task (firsttoken_en, firsttoken_zh)")
    parser.add_argument("--metrics", default="gate")
    parser.add_argument("--spinners", type=int, default=4 * usable_cores(), help="busy processes beside the runs")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="evalkit-shared-cpu-") as tmp:
        db = str(Path(tmp) / "e.duckdb")
        one_run(db, "warm", 0, 2, "gate")  # the model converted and cached once, outside the timings
        for machine in ("idle", "busy"):
            spinners = []
            if machine == "busy":
                spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.spinners)]
                time.sleep(30)  # they settle in
            try:
                default = one_run(db, f"{machine}-default", 0, args.limit, args.metrics)
                passive = one_run(db, f"{machine}-passive", 99, args.limit, args.metrics)
                rows.append((machine, os.getloadavg()[0], default, passive))  # the last minute's, the runs
            finally:
                for p in spinners:
                    p.kill()
                for p in spinners:
                    p.wait()
    print(f"`evalkit run --tasks firsttoken --limit {args.limit} --metrics {args.metrics}` on {usable_cores()} cores; "
          f"busy: {args.spinners} spinning processes beside it")
    print()
    print("| machine | load average (1 min, after the pair) | default: wall s | default: CPU s | PASSIVE: wall s | PASSIVE: CPU s "
          "| wall default / PASSIVE |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for machine, load, (dw, dc), (pw, pc) in rows:
        print(f"| {machine} | {load:.1f} | {dw:.1f} | {dc:.1f} | {pw:.1f} | {pc:.1f} | {dw / pw:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
