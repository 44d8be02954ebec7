"""Start-up budgets: `evalkit --help` < 0.5 s; `evalkit run` overhead before the model loads < 2 s.

Usage: python bench/cli_startup.py [--repeat 7] [--importtime]

What is measured (wall clock, median over --repeat fresh processes):
  help      `evalkit --help` (the console script), spawn to exit.
  run/fake  `evalkit run --model evalkit-fake --tasks firsttoken --limit 1`:
            from spawning the process to the moment the model object is
            constructed (a subclass of the fake LM stamps time.time() in its
            __init__, then exits). Covers interpreter start, click, option
            parsing, validation (templates, lexicon, task names), the run row's
            INSERT into DuckDB, and the imports lm-eval needs before a model.
  run/hf    the same for the default `evalkit run --tasks firsttoken --limit 1`
            (packaged SmolLM2 GGUF). Held against the budget: spawn to the hand-off
            to the backend (`model_class start`), which covers hashing the weights
            file for runs.model_fingerprint and the run row's INSERT. Shown beside
            it: spawn to entry of EvalkitHFLM.__init__, which adds importing torch,
            transformers and lm-eval's HFLM, the first part of loading the model.
With --importtime, the slowest imports of `evalkit --help` and of the run path
(python -X importtime, cumulative) are listed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELP_BUDGET_S = 0.5
RUN_BUDGET_S = 2.0

# child program: print "PHASE <seconds since time.time() in $T0> <label>" at each step of a run
# up to the model object's construction, then leave (os._exit: the rest is not measured)
STAMP = """
import os, sys, time
T0 = float(os.environ["T0"])
def mark(label):
    sys.stderr.write(f"PHASE {time.time() - T0:.4f} {label}\\n"); sys.stderr.flush()
mark("interpreter up")
if os.environ.get("FAKE"):
    from tests.fake_lm import register_fake_lm
    register_fake_lm()
    mark("fake LM registered (imports lm_eval.api)")
import evalkit.cli
mark("evalkit.cli imported")
from evalkit.engines import resolve as models
from evalkit.runner import execute as runner

def timed(fn, label):
    def wrapper(*args, **kwargs):
        mark(label + " start")
        out = fn(*args, **kwargs)
        mark(label + " end")
        return out
    return wrapper

runner.plan_run = timed(runner.plan_run, "plan_run (every check that needs no model)")
model_class = timed(models.model_class, "model_class")

def stamped_model_class(name):
    cls = model_class(name)
    def init(self, *args, **kwargs):
        mark("model constructed")
        os._exit(0)
    cls.__init__ = init
    return cls

models.model_class = stamped_model_class
sys.argv = ["evalkit"] + sys.argv[1:]
evalkit.cli.main()
"""


def evalkit_exe() -> list[str]:
    script = Path(sys.executable).parent / "evalkit"
    return [str(script)] if script.exists() else [sys.executable, "-c", "from evalkit.cli import main; main()"]


def env(db: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "EVALKIT_DB": str(db), "HF_HUB_OFFLINE": "1"}


def time_help(repeat: int, db: Path) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([*evalkit_exe(), "--help"], env=env(db), capture_output=True, check=True)
        out.append(time.perf_counter() - t0)
    return out


def time_to_model(args: list[str], repeat: int, db: Path, fake: bool) -> tuple[list[float], dict[str, list[float]]]:
    """Seconds from spawn to the model's construction, and per phase label its seconds since spawn."""
    out, phases = [], {}
    for _ in range(repeat):
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", STAMP, *args], cwd=ROOT,
                              env={**env(db), "T0": repr(t0), **({"FAKE": "1"} if fake else {})},
                              capture_output=True, text=True)
        marks = [line.split(" ", 2)[1:] for line in proc.stderr.splitlines() if line.startswith("PHASE ")]
        if not marks or marks[-1][1] != "model constructed":
            raise SystemExit(f"no model was constructed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        for at, label in marks:
            phases.setdefault(label, []).append(float(at))
        out.append(float(marks[-1][0]))
    return out, phases


def phase_table(phases: dict[str, list[float]]) -> str:
    """Median time since spawn at each mark, and the step since the previous mark."""
    rows, prev = [], 0.0
    for label, ats in phases.items():
        at = statistics.median(ats)
        rows.append(f"    {at:6.3f} s  (+{at - prev:5.3f})  {label}")
        prev = at
    return "\n".join(rows)


def importtime(args: list[str], program: str | None, db: Path, top: int = 15, extra_env=None) -> str:
    cmd = [sys.executable, "-X", "importtime", "-c", program or "from evalkit.cli import main; main()", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env={**env(db), **(extra_env or {})}, capture_output=True, text=True)
    rows = []  # (cumulative µs, nesting depth, module)
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _self_us, cum_us, name = line[len("import time:"):].split("|")
        rows.append((int(cum_us), len(name) - len(name.lstrip()) - 1, name.strip()))
    rows.sort(reverse=True)
    return "\n".join(f"    {cum / 1e6:6.3f} s  {'  ' * (depth // 2)}{name}" for cum, depth, name in rows[:top])


def report(label: str, times: list[float], budget: float) -> str:
    med = statistics.median(times)
    verdict = "ok" if med < budget else "OVER BUDGET"
    return (f"{label:<10} median {med:6.3f} s  (min {min(times):.3f}, max {max(times):.3f}, n={len(times)})"
            f"   target < {budget} s: {verdict}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--importtime", action="store_true")
    parser.add_argument("--no-hf", action="store_true", help="skip the default-model measurement")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="evalkit-startup-") as tmp:
        db = Path(tmp) / "evalkit.duckdb"
        print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
        lines = [report("help", time_help(args.repeat, db), HELP_BUDGET_S)]
        fake = ["run", "--model", "evalkit-fake", "--tasks", "firsttoken", "--limit", "1", "--db", str(db)]
        times, fake_phases = time_to_model(fake, args.repeat, db, fake=True)
        lines.append(report("run/fake", times, RUN_BUDGET_S))
        hf_phases = None
        if not args.no_hf:
            hf = ["run", "--tasks", "firsttoken", "--limit", "1", "--db", str(db)]
            times, hf_phases = time_to_model(hf, max(3, args.repeat // 2), db, fake=False)
            # the budget's "before the model loads": up to the hand-off to the backend, whose
            # first act is importing torch, transformers and lm-eval's HFLM (part of loading it)
            lines.append(report("run/hf, until the backend starts loading", hf_phases["model_class start"], RUN_BUDGET_S))
            med = statistics.median(times)
            lines.append(f"run/hf, until EvalkitHFLM.__init__ (backend imports included): median {med:.3f} s (information)")
        print("\n".join(lines))
        print("\nrun/fake, median seconds since spawn at each step:")
        print(phase_table(fake_phases))
        if hf_phases:
            print("\nrun/hf (default model), median seconds since spawn at each step:")
            print(phase_table(hf_phases))
        if args.importtime:
            print("\nslowest imports, `evalkit --help` (cumulative):")
            print(importtime(["--help"], None, db))
            print("\nslowest imports, `evalkit run` up to the fake model (cumulative):")
            print(importtime(fake, STAMP, db, extra_env={"FAKE": "1", "T0": repr(time.time())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
