"""CPU-vs-device agreement of stored runs: the same runs made on the CPU and on another device.

Reads two DuckDB files written by scripts/gpu_check.sh (the same `evalkit run` commands,
once with `--device cpu`, once with `--device DEVICE`), pairs their runs by what makes a run
(quant, kv_cache, attention, tasks, sample_limit) and their prompts by (task, doc_id), and
prints per pair of runs, against a stated tolerance:

  - top-k: the share of prompts whose top-1 token differs (flip), the largest
    |Δ logprob| over the CPU run's top-10 tokens, and the mean JS divergence (bits, both
    stored top-k lists plus a rest bucket, as `evalkit compare` computes it);
  - the largest per-prompt |Δ| of ft_hit_prob, opener_mass, prior_drift, top1_prob and entropy,
    and under --attention of sink_rate, needle_attn and question_attn;
  - the share of prompts whose stored response differs.

Tolerances: fp32 is the same arithmetic up to reassociation (the kernels differ), so its
bounds are tight; bf16 keeps 8 bits of mantissa, and a CPU and a GPU round at different
places, so its bounds are those of bf16 noise; a flip needs a near-tie, so a few are
allowed in bf16. A pair outside a bound prints FAIL; the exit code is 1 when any does.

    python bench/device_check.py CPU_DB DEVICE_DB [--device cuda]
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

# per compute dtype: the largest difference allowed between the CPU and the device
TOLERANCE = {
    "float32": {"flip": 0.02, "logprob": 1e-3, "js": 1e-5, "metric": 1e-3, "attention": 1e-3, "sink_rate": 0.02,
                "response": 0.05},
    "bfloat16": {"flip": 0.10, "logprob": 0.15, "js": 5e-3, "metric": 0.05, "attention": 0.02, "sink_rate": 0.05,
                 "response": 0.30},
}
METRICS = ("ft_hit_prob", "opener_mass", "prior_drift", "top1_prob")
ATTENTION = ("needle_attn", "question_attn")
RUN_KEY = ("quant", "kv_cache", "attention", "tasks", "sample_limit")


@dataclass
class Check:
    what: str
    value: float | None
    bound: float

    @property
    def ok(self) -> bool:
        return self.value is None or self.value <= self.bound


def runs(con, db: str) -> dict[tuple, dict]:
    cur = con.execute(f"SELECT * FROM {db}.runs WHERE status = 'done' ORDER BY created_at")
    cols = [d[0] for d in cur.description]
    out = {}
    for row in cur.fetchall():
        run = dict(zip(cols, row))
        out[tuple(str(run.get(k)) for k in RUN_KEY)] = run
    return out


def compare(con, a: dict, b: dict) -> tuple[int, list[Check]]:
    """(shared prompts, the checks) of run `a` (CPU) against run `b` (device)."""
    from evalkit.compare import prompt_drift

    dtype = a.get("dtype") or "float32"
    tol = TOLERANCE["bfloat16" if "bfloat16" in str(dtype) else "float32"]
    shared = con.execute(
        "SELECT count(*), avg(CASE WHEN sa.first_token_id IS DISTINCT FROM sb.first_token_id THEN 1.0 ELSE 0 END), "
        "avg(CASE WHEN sa.response IS DISTINCT FROM sb.response THEN 1.0 ELSE 0 END) "
        "FROM cpu.samples sa JOIN dev.samples sb USING (task, doc_id) WHERE sa.run_id = ? AND sb.run_id = ?",
        [a["id"], b["id"]]).fetchone()
    n = int(shared[0] or 0)
    checks: list[Check] = []
    topk: dict[tuple, dict] = {}
    for side, run in (("cpu", a), ("dev", b)):
        for task, doc, ids, lps in con.execute(
                f"SELECT task, doc_id, list(token_id ORDER BY rank), list(logprob ORDER BY rank) "
                f"FROM {side}.first_token_topk WHERE run_id = ? GROUP BY task, doc_id", [run["id"]]).fetchall():
            topk.setdefault((task, doc), {})[side] = (list(ids), list(lps))
    pairs = [v for v in topk.values() if len(v) == 2]
    if pairs:
        flips = sum(p["cpu"][0][0] != p["dev"][0][0] for p in pairs) / len(pairs)
        worst = 0.0
        for p in pairs:
            dev = dict(zip(*p["dev"]))
            for t, lp in zip(p["cpu"][0][:10], p["cpu"][1][:10]):
                if t in dev:
                    worst = max(worst, abs(lp - dev[t]))
                else:  # fell out of the device's top-k: at least the gap to its last stored token
                    worst = max(worst, abs(lp - p["dev"][1][-1]))
        js = sum(prompt_drift(p["cpu"], p["dev"])["js_div"] for p in pairs) / len(pairs)
        checks += [Check("top-1 flip rate", flips, tol["flip"]), Check("max |Δ logprob| top-10", worst, tol["logprob"]),
                   Check("mean JS (bits)", js, tol["js"])]
    columns = {r[0] for r in con.execute("SELECT column_name FROM duckdb_columns() WHERE database_name = 'cpu' "
                                         "AND table_name = 'samples'").fetchall()}
    for metric in (*METRICS, "entropy", "sink_rate", *ATTENTION):
        if metric not in columns:
            continue
        (worst_m,) = con.execute(
            f"SELECT max(abs(sa.{metric} - sb.{metric})) FROM cpu.samples sa JOIN dev.samples sb USING (task, doc_id) "
            "WHERE sa.run_id = ? AND sb.run_id = ?", [a["id"], b["id"]]).fetchone()
        if worst_m is None:
            continue
        bound = (tol["sink_rate"] if metric == "sink_rate" else tol["attention"] if metric in ATTENTION
                 else 10 * tol["metric"] if metric == "entropy" else tol["metric"])
        checks.append(Check(f"max |Δ {metric}|", float(worst_m), bound))
    checks.append(Check("responses that differ", float(shared[2] or 0.0), tol["response"]))
    return n, checks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cpu_db")
    ap.add_argument("device_db")
    ap.add_argument("--device", default="cuda", help="the device the second DB's runs ran on (for the heading)")
    args = ap.parse_args()

    import duckdb

    con = duckdb.connect()
    con.execute(f"ATTACH '{args.cpu_db}' AS cpu (READ_ONLY)")
    con.execute(f"ATTACH '{args.device_db}' AS dev (READ_ONLY)")
    on_cpu, on_dev = runs(con, "cpu"), runs(con, "dev")
    missing = sorted(set(on_cpu) ^ set(on_dev))
    failed = 0
    print(f"CPU vs {args.device}: {len(set(on_cpu) & set(on_dev))} pairs of runs "
          f"(quant x kv_cache x attention), prompts paired by task and doc id")
    for key in sorted(set(on_cpu) & set(on_dev)):
        a, b = on_cpu[key], on_dev[key]
        n, checks = compare(con, a, b)
        label = f"--quant {a['quant']} --kv-cache {a['kv_cache'] or 'full'}" + (" --attention" if a["attention"] else "")
        print(f"\n{label}  ({n} prompts, {a['dtype']})")
        for c in checks:
            shown = "n/a" if c.value is None or (isinstance(c.value, float) and math.isnan(c.value)) else f"{c.value:.2e}"
            print(f"    {c.what:<28} {shown:>10}   tolerance <= {c.bound:g}   {'ok' if c.ok else 'FAIL'}")
            failed += not c.ok
    for key in missing:
        print(f"\nunpaired run {dict(zip(RUN_KEY, key))}: made on one side only")
        failed += 1
    print(f"\nagreement: {'PASS' if not failed else f'FAIL ({failed} checks outside their tolerance)'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
