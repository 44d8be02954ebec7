"""Drift by position on the default model (docs/drift.md): where does quantization error show first?

Each `--quant` variant that runs on the CPU teacher-forces the greedy responses of the q4_1 base
(the embedded GGUF dequantized, chat template, the firsttoken tasks at `--limit N`) and is compared
with it at every response position. Then the variant that drifts most is measured again under the
`direct` and `plain` templates, and a text is scored in corpus mode (llama-perplexity's chunks)
with that variant. All into a throwaway DB (or `--db`).

It prints and writes (`--out`, default bench/drift_results.md):
- the by-position table per variant: mean KLD ± uncertainty and same-top share per bucket;
- drift_first_ratio with its bootstrap 95 % CI, and drift_kld@0;
- the cost: each candidate run's plain evaluation (lm-eval, the first-step probe and the greedy
  response) and its teacher-forced pass, both timed inside the same run; budget 1.5×;
- the storage of the kept base distributions per 1,000 prompts (values, and DuckDB on disk);
- the KLD bound of the compact base (the largest per-position bound, and the mean);
- the corpus-mode summary of one variant beside its first-token numbers.

    python bench/drift.py [--limit 20] [--variants int8-dynamic,int8-weight,...] [--n-ctx 512]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = "int8-dynamic,int8-weight,int4-weight,nf4,hqq8,hqq4"
BUCKETS = ["0", "1", "2-3", "4-7", "8-15", "16+", "all"]


def default_corpus() -> Path:
    """A fixed English text every Python install has: the interpreter's LICENSE (~3,500 tokens)."""
    return Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "LICENSE.txt"


def storage(con, db_dir: Path, base: str) -> dict:
    """Bytes of the kept distributions per 1,000 prompts: the values, and a DuckDB file holding the base's
    rows copied to at least 1,000 prompts (doc ids suffixed), so block granularity does not dominate."""
    import math

    import duckdb

    n_prompts = con.execute("SELECT count(*) FROM response_tokens WHERE run_id = ?", [base]).fetchone()[0]
    n_pos, n_tok, values = con.execute(
        "SELECT count(*), sum(len(token_ids)), sum(len(token_ids) * 8 + 8) FROM drift_base WHERE run_id = ?",
        [base]).fetchone()
    tok_bytes = con.execute("SELECT sum(len(token_ids) * 4) FROM response_tokens WHERE run_id = ?",
                            [base]).fetchone()[0]
    base_rows = con.execute("SELECT * FROM drift_base WHERE run_id = ?", [base]).to_arrow_table()  # noqa: F841
    token_rows = con.execute("SELECT * FROM response_tokens WHERE run_id = ?", [base]).to_arrow_table()  # noqa: F841
    copies = math.ceil(1000 / n_prompts)
    sizes = {}
    for name, k in (("empty", 0), ("full", copies)):
        path = db_dir / f"storage-{name}.duckdb"
        if path.exists():
            path.unlink()
        out = duckdb.connect(str(path))
        out.execute("CREATE TABLE drift_base AS SELECT * FROM base_rows LIMIT 0")
        out.execute("CREATE TABLE response_tokens AS SELECT * FROM token_rows LIMIT 0")
        for i in range(k):
            out.execute(f"INSERT INTO drift_base SELECT * REPLACE (doc_id || '#{i}' AS doc_id) FROM base_rows")
            out.execute(f"INSERT INTO response_tokens SELECT * REPLACE (doc_id || '#{i}' AS doc_id) FROM token_rows")
        out.execute("CHECKPOINT")
        out.close()
        sizes[name] = path.stat().st_size
    per = 1000 / n_prompts
    return {"prompts": n_prompts, "positions": n_pos, "listed_per_position": n_tok / n_pos,
            "values_per_1000": values * per, "tokens_per_1000": tok_bytes * per,
            "duckdb_per_1000": (sizes["full"] - sizes["empty"]) * 1000 / (n_prompts * copies),
            "full_vocab_float32_per_1000": n_pos * per * 4 * 49152}  # SmolLM2's vocabulary


def teacher_only(base_items: dict, quant: str, batch_size: int = 8) -> tuple[dict, float]:
    """A variant's teacher-forced pass over a stored base's responses, with no run of its own:
    (the by-bucket table, drift_first_ratio, drift_kld@0, bounds), and the pass's seconds."""
    import gc

    from evalkit.engines import resolve as models
    from evalkit.engines.transformers.teacher import Forced, drift_pass
    from evalkit.scoring import drift, stats

    lm = models.load(models.resolve("hf", None, quant_name=quant), batch_size=batch_size)
    tok = lm.tokenizer
    keys = sorted(k for k, it in base_items.items() if it.token_ids)
    items = [Forced(list(tok(base_items[k].context, add_special_tokens=False)["input_ids"]),
                    base_items[k].token_ids) for k in keys]
    t0 = time.monotonic()
    rows = drift_pass(lm.model, items, [base_items[k].dists for k in keys], batch_size=batch_size,
                      pad_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
    seconds = time.monotonic() - t0
    del lm
    gc.collect()
    flat = [(p, r) for per in rows for p, r in enumerate(per)]
    sums = drift.by_bucket([p for p, _ in flat], [r.kld for _, r in flat], [r.dp for _, r in flat],
                           [r.same_top for _, r in flat], [r.bound for _, r in flat])
    r = drift.first_ratio([[x.kld for x in per] for per in rows if per])
    first = [per[0].kld for per in rows if per]
    mean, _ = stats.mean_stderr(first)
    lo, hi = stats.interval(first, binary=False)
    return {"buckets": {b: {"n": s.n, "kld": s.kld_mean, "kld_unc": s.kld_unc, "same_top": s.same_top,
                            "same_top_unc": s.same_top_unc, "dp_rms": s.dp_rms, "bound": s.kld_bound_max}
                        for b, s in sums.items()},
            "ratio": r.value, "lo": r.lo, "hi": r.hi, "n": r.n, "kld0": mean, "kld0_lo": lo, "kld0_hi": hi,
            "kld_rest": r.kld_rest, "bound_max": max(x.bound for _, x in flat),
            "bound_mean": sum(x.bound for _, x in flat) / len(flat), "seconds": seconds}, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=20, help="prompts per first-token task (en and zh), table")
    parser.add_argument("--template-limit", type=int, default=10, help="prompts per task under direct / plain")
    parser.add_argument("--cost-limit", type=int, default=4, help="prompts per task of the cost runs")
    parser.add_argument("--cost-variants", default="int8-weight", help="variants timed as whole runs")
    parser.add_argument("--tasks", default="firsttoken")
    parser.add_argument("--base", default="q4_1")
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--templates", default="direct,plain", help="for the variant that drifts most")
    parser.add_argument("--corpus", default=str(default_corpus()))
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--db", default=None, help="keep the runs in this DB (default: a throwaway one)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "drift_results.md"))
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import duckdb

    import evalkit
    from evalkit.runner import drift as run_drift
    from evalkit.runner.corpus import corpus_drift
    from evalkit.scoring.drift import format_summary
    from evalkit.store import drift as store

    tmp = tempfile.TemporaryDirectory()
    db = Path(args.db) if args.db else Path(tmp.name) / "bench.duckdb"
    results: dict = {"limit": args.limit, "tasks": args.tasks, "base": args.base, "variants": {}, "templates": {},
                     "cost": {}, "template_limit": args.template_limit, "cost_limit": args.cost_limit}
    t_all = time.monotonic()

    def run(quant, limit, **kw):
        (r,) = evalkit.run_all(tasks=args.tasks, db=db, limit=limit, quant=quant, **kw)
        return r

    def base_of(run_id):
        con = duckdb.connect(str(db), read_only=True)
        try:
            return store.load_base(con, run_id)
        finally:
            con.close()

    # 1. the base: its greedy responses, teacher-forced through itself and kept compact; each variant's
    # teacher-forced pass over them
    base = run(args.base, args.limit, keep_distributions=True, name=f"drift-base-{args.base}")
    print(f"base {args.base}: run {base.id}, eval {base.eval_s:.1f}s, base pass {run_drift.SECONDS[base.id]:.1f}s",
          flush=True)
    items = base_of(base.id)
    for v in [x.strip() for x in args.variants.split(",") if x.strip()]:
        try:
            entry, _ = teacher_only(items, v)
        except Exception as exc:  # noqa: BLE001  (a variant this machine cannot run: said, and skipped)
            print(f"{v}: skipped ({str(exc).splitlines()[0]})", flush=True)
            results["variants"][v] = {"error": str(exc).splitlines()[0]}
            continue
        results["variants"][v] = entry
        print(f"{v}: KLD@0 {entry['kld0']:.4f}  KLD>=1 {entry['kld_rest']:.4f}  ratio {entry['ratio']:.3f} "
              f"[{entry['lo']:.3f}, {entry['hi']:.3f}]  ({entry['seconds']:.1f}s)", flush=True)
    ok = {v: e for v, e in results["variants"].items() if "error" not in e}
    worst = max(ok, key=lambda v: ok[v]["buckets"]["all"]["kld"])
    results["worst"] = worst
    # 2. the variant that drifts most, under the other templates
    for template in [t.strip() for t in args.templates.split(",") if t.strip()]:
        b = run(args.base, args.template_limit, template=template, keep_distributions=True,
                name=f"drift-base-{template}")
        entry, _ = teacher_only(base_of(b.id), worst)
        results["templates"][template] = entry
        print(f"{worst} under {template}: ratio {entry['ratio']:.3f} [{entry['lo']:.3f}, {entry['hi']:.3f}]",
              flush=True)
    # 3. the cost: whole runs with the drift pass, the plain evaluation and the pass timed in the same run
    cost_base = run(args.base, args.cost_limit, keep_distributions=True, name="drift-cost-base")
    for v in [x.strip() for x in args.cost_variants.split(",") if x.strip()]:
        c = run(v, args.cost_limit, drift_base=cost_base.id, name=f"drift-cost-{v}")
        tf = run_drift.SECONDS[c.id]
        results["cost"][v] = {"run": c.id, "eval_s": c.eval_s, "drift_s": tf, "cost": (c.eval_s + tf) / c.eval_s}
        print(f"cost {v}: eval {c.eval_s:.1f}s + teacher-forced {tf:.1f}s = {(c.eval_s + tf) / c.eval_s:.3f}x",
              flush=True)
    results["cost"]["base pass"] = {"run": cost_base.id, "eval_s": cost_base.eval_s,
                                    "drift_s": run_drift.SECONDS[cost_base.id],
                                    "cost": (cost_base.eval_s + run_drift.SECONDS[cost_base.id]) / cost_base.eval_s}
    con = duckdb.connect(str(db), read_only=True)
    try:
        results["storage"] = storage(con, Path(tmp.name), base.id)
    finally:
        con.close()
    results["bound"] = {"max": max(e["bound_max"] for e in ok.values()),
                        "mean": sum(e["bound_mean"] for e in ok.values()) / len(ok)}
    # 4. corpus mode, the variant that drifts most
    t0 = time.monotonic()
    (corpus,) = corpus_drift(args.corpus, [args.base, worst], n_ctx=args.n_ctx)
    results["corpus"] = {"file": args.corpus, "n_ctx": args.n_ctx, "chunks": corpus.n_chunks,
                         "seconds": time.monotonic() - t0, "summary": corpus.summary.to_row(),
                         "ppl": corpus.summary.ppl, "text": format_summary(corpus.summary)}
    results["total_s"] = time.monotonic() - t_all
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    Path(args.out).write_text(render(results), encoding="utf-8")
    print(render(results))
    return 0


def render(r: dict) -> str:
    lines = ["# Drift by position on the default model (bench/drift.py)", "",
             f"Base: `{r['base']}` (the embedded GGUF, dequantized), chat template, tasks `{r['tasks']}` at "
             f"--limit {r['limit']} per task. Each variant teacher-forces the base's greedy responses "
             "(16 tokens, or 48 where the prompt has a checkable answer) and is compared with the base at every "
             "position.", "",
             "## Mean KLD (nats, ± llama.cpp's uncertainty) by response position", "",
             "| variant | " + " | ".join(BUCKETS) + " |", "|---|" + "---|" * len(BUCKETS)]

    def rows(key, fmt):
        out = []
        named = [*r["variants"].items(), *((f"{r['worst']} ({t})", e) for t, e in r["templates"].items())]
        for name, e in named:
            if "error" in e:
                out.append(f"| {name} | skipped: {e['error']} |")
                continue
            out.append(f"| {name} | " + " | ".join(fmt(e["buckets"][b]) if b in e["buckets"] else "-"
                                                   for b in BUCKETS) + " |")
        return out

    lines += rows("kld", lambda x: f"{x['kld']:.4f} ± {x['kld_unc']:.4f}")
    lines += ["", "## Same-top share by response position", "",
              "| variant | " + " | ".join(BUCKETS) + " |", "|---|" + "---|" * len(BUCKETS)]
    lines += rows("same_top", lambda x: f"{100 * x['same_top']:.1f} ± {100 * x['same_top_unc']:.1f} %")
    first = next(e for e in r["variants"].values() if "error" not in e)
    lines += ["", "Positions per bucket (chat): " + ", ".join(f"{b}: {first['buckets'][b]['n']}" for b in BUCKETS
                                                            if b in first["buckets"]) +
              f"; templates direct / plain at --limit {r['template_limit']} per task.", "",
              "## drift_first_ratio = mean KLD at position 0 / mean KLD at positions >= 1 (bootstrap 95 % CI over "
              "prompts)", "",
              "| variant | drift_kld@0 [95 % CI] | mean KLD at >= 1 | drift_first_ratio [95 % CI] | prompts |",
              "|---|---|---|---|---|"]
    for name, e in [*r["variants"].items(), *((f"{r['worst']} ({t})", e) for t, e in r["templates"].items())]:
        if "error" not in e:
            lines.append(f"| {name} | {e['kld0']:.4f} [{e['kld0_lo']:.4f}, {e['kld0_hi']:.4f}] | {e['kld_rest']:.4f} "
                         f"| {e['ratio']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}] | {e['n']} |")
    lines += ["", f"## Cost: the teacher-forced pass beside the plain evaluation of the same run (--limit "
              f"{r['cost_limit']} per task; budget 1.5x)", "",
              "| run | plain evaluation (s) | teacher-forced pass (s) | run with drift / plain |", "|---|---|---|---|"]
    for v, e in r["cost"].items():
        lines.append(f"| {v} | {e['eval_s']:.1f} | {e['drift_s']:.1f} | {e['cost']:.3f}x |")
    s, b = r["storage"], r["bound"]
    lines += ["", "## Storage of a kept base and the KLD bound", "",
              f"- {s['prompts']} prompts, {s['positions']} positions, {s['listed_per_position']:.1f} tokens listed "
              "per position on average (eps = 1e-4)",
              f"- per 1,000 prompts: {s['values_per_1000'] / 1e6:.2f} MB of distribution values (4 B id + 4 B "
              f"log-prob per listed token, 8 B tail), {s['tokens_per_1000'] / 1e3:.0f} kB of response token ids; "
              f"{s['duckdb_per_1000'] / 1e6:.2f} MB in a DuckDB file (both tables, compressed); the full float32 "
              f"vocabulary would take {s['full_vocab_float32_per_1000'] / 1e9:.2f} GB",
              f"- KLD bound (exact minus stored, per position) over every variant's positions: max {b['max']:.2e} "
              f"nats, mean {b['mean']:.2e}", "",
              f"## Corpus mode: {r['worst']} against {r['base']} on {Path(r['corpus']['file']).name} "
              f"({r['corpus']['chunks']} chunks of {r['corpus']['n_ctx']} tokens)", "", "```",
              r["corpus"]["text"], "```", "",
              f"Beside it, the first-token numbers of {r['worst']} (chat): drift_kld@0 = "
              f"{r['variants'][r['worst']]['kld0']:.4f}, same top at position 0 = "
              f"{100 * r['variants'][r['worst']]['buckets']['0']['same_top']:.1f} %, mean KLD over every response "
              f"position = {r['variants'][r['worst']]['buckets']['all']['kld']:.4f}.", "",
              f"Total bench time: {r['total_s'] / 60:.1f} min on this machine (2 shared CPU cores)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
