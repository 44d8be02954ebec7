"""Two real models side by side (README "Compare two models"): the commands a user runs, timed, and the table.

SmolLM2-135M-Instruct (the default model, instruction-tuned, transformers engine) under `chat`, and
Gemma-3-270M (base, Q4_K_M GGUF, llama.cpp engine) under `qa` ("Question: {{prompt}}\\nAnswer:"), on the
firsttoken suite, both with the first characters (`first_char=true`: the cross-tokenizer comparison reads
them) and the whitespace-led event (`lead_space=true`: Gemma answers " Paris" after "Answer:"). Each
command runs as a user types it (`evalkit run`, `compare`, `gate --rules upgrade`, `report`) into one DB;
the script prints each command's output, the metric table per model and language, and the CPU seconds a
prompt of each run (the evalkit process's user + system time, children included).

    python bench/two_models.py [--limit 100] [--db reports/two_models.duckdb] [--out reports/two_models]

Needs the Gemma GGUF (`bash scripts/test-deps.sh` fetches it into ~/.cache/evalkit-test/gemma/).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GEMMA = Path.home() / ".cache" / "evalkit-test" / "gemma" / "gemma-3-270m-q4_k_m.gguf"
METRICS = ("ft_hit", "ft_hit_prob", "answer_hit", "answer_prob", "opener_rate", "opener_mass", "prior_drift",
           "ws_mass", "entropy", "top1_prob")


def _evalkit() -> str:
    here = Path(sys.executable).parent / "evalkit"
    return str(here) if here.exists() else (shutil.which("evalkit") or "evalkit")


def _timed(argv: list[str]) -> tuple[int, float, float]:
    """Run a command, print its output; (exit code, CPU seconds of it, wall seconds)."""
    print("$ " + " ".join(a if " " not in a else repr(a) for a in argv), flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [ln for ln in proc.stdout.splitlines() if "prompts/s" not in ln and "ETA" not in ln]
    print("\n".join(lines[-60:]))
    print(f"[exit {proc.returncode}, {cpu:.1f} CPU s, {wall:.1f} s wall]\n", flush=True)
    return proc.returncode, cpu, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=100, help="prompts a task (firsttoken_en, firsttoken_zh)")
    parser.add_argument("--db", default=str(ROOT / "reports" / "two_models.duckdb"))
    parser.add_argument("--out", default=str(ROOT / "reports" / "two_models"), help="the report's folder")
    args = parser.parse_args()
    if not GEMMA.is_file():
        print(f"Gemma-3-270M is not at {GEMMA}: `bash scripts/test-deps.sh` fetches it", file=sys.stderr)
        return 2
    ek, db, limit = _evalkit(), args.db, str(args.limit)
    for suffix in ("", ".wal"):
        Path(db + suffix).unlink(missing_ok=True)
    runs = {
        "smollm2-chat": [ek, "run", "--tasks", "firsttoken", "--limit", limit, "--model-args",
                         "first_char=true,lead_space=true", "--name", "smollm2-chat", "--db", db],
        "gemma-qa": [ek, "run", "--model", "llamacpp", "--model-args",
                     f"model={GEMMA},first_char=true,lead_space=true", "--template", "qa", "--tasks", "firsttoken",
                     "--limit", limit, "--name", "gemma-qa", "--db", db],
    }
    cpu: dict[str, float] = {}
    for name, argv in runs.items():
        rc, cpu[name], _ = _timed(argv)
        if rc != 0:
            print(f"{name}: exit {rc}", file=sys.stderr)
            return 1
    _timed([ek, "compare", "smollm2-chat", "gemma-qa", "--db", db])
    gate_rc, _, _ = _timed([ek, "gate", "--candidate", "gemma-qa", "--baseline", "smollm2-chat", "--rules", "upgrade",
                            "--db", db])
    _timed([ek, "report", "--out", args.out, "--db", db])

    import duckdb

    con = duckdb.connect(db, read_only=True)
    ids = dict(con.execute("SELECT name, id FROM runs WHERE name IN ('smollm2-chat', 'gemma-qa')").fetchall())
    print("metric means per task (n prompts), smollm2-chat | gemma-qa")
    rows = con.execute(
        "SELECT r.name, m.task, m.metric, m.value, m.n FROM metrics m JOIN runs r ON r.id = m.run_id "
        "WHERE m.run_id IN (SELECT unnest(?)) AND m.filter = 'none'", [list(ids.values())]).fetchall()
    table: dict[tuple[str, str], dict[str, tuple[float, int]]] = {}
    for name, task, metric, value, n in rows:
        table.setdefault((task, metric), {})[name] = (value, n)
    for task in sorted({t for t, _ in table}):
        print(f"  {task}")
        for metric in METRICS:
            got = table.get((task, metric), {})
            cells = [f"{got[k][0]:.4f} (n={got[k][1]})" if k in got and got[k][0] is not None else "-"
                     for k in ("smollm2-chat", "gemma-qa")]
            print(f"    {metric:<13} {cells[0]:>18} | {cells[1]:<18}")
    print("does the first token predict the answer? AUROC of ft_hit_prob against answer_hit")
    for name, task, auroc, lo, hi, n in con.execute(
            "SELECT r.name, l.task, l.auroc, l.ci_lo, l.ci_hi, l.n FROM lead_indicators l JOIN runs r ON r.id = l.run_id "
            "WHERE l.signal = 'ft_hit_prob' AND l.category = '*' ORDER BY l.task, r.name").fetchall():
        ci = f"[{lo:.3f}, {hi:.3f}]" if lo is not None else "no interval"
        print(f"  {task:<14} {name:<13} {'-' if auroc is None else f'{auroc:.3f}'} {ci} n={n}")
    print("seconds a prompt (CPU, the whole `evalkit run` process, load included)")
    for name, (n,) in ((k, con.execute("SELECT count(*) FROM samples WHERE run_id = ?", [v]).fetchone())
                       for k, v in ids.items()):
        print(f"  {name:<13} {cpu[name] / n:.2f} CPU s a prompt over {n} prompts")
    degenerate = con.execute("SELECT r.name, d.task FROM degenerate d JOIN runs r ON r.id = d.run_id WHERE d.degenerate").fetchall()
    print(f"degenerate flags: {degenerate or 'none'}")
    print(f"gate --rules upgrade (candidate gemma-qa, baseline smollm2-chat): exit {gate_rc}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
