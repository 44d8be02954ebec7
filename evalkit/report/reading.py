"""What a report reads: which runs it covers, and every row its sections show, in one pass.

Owns: picking the runs (the named ones, else the newest done runs), the SQL behind each
section — every number is read from the ``leaderboard``, ``needle_heatmap``,
``needle_gaps``, ``needle_attention``, ``attention_sink``, ``conflict_table`` and
``lead_indicators`` views or the ``runs``, ``samples`` and ``first_token_topk`` tables,
aggregated inside DuckDB so sample rows never reach Python — and each run's display
labels and trend key (`ReportData`). Does not: lay out sections (`report.sections`),
render (`report.rendering`) or write anything (the connection it is handed is read-only).
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass, field
from typing import Any

from evalkit import redact
from evalkit.compare import DIMENSIONS, quant_summary
from evalkit.errors import BadInput
from evalkit.labels import model_label
from evalkit.store.queries import resolve_run

MAX_DEFAULT_RUNS = 12  # runs a report covers when none are named: the newest done ones
RELIABILITY_BINS = 10  # equal-count ft_hit_prob bins per run in the reliability plot, at most ...
MIN_BIN_SIZE = 20  # ... and fewer when a run has under RELIABILITY_BINS * MIN_BIN_SIZE checkable prompts
IDS = "(SELECT unnest(?::VARCHAR[]))"  # a list parameter as a subquery: `run_id IN {IDS}`
# the runs columns a report shows, then the run dimensions of `evalkit compare` (the trend key)
RUN_COLUMNS = tuple(dict.fromkeys((
    "id", "name", "status", "model", "model_name", "model_args", "quant_detail", "tasks", "created_at", "duration_s",
    *DIMENSIONS)))


@dataclass
class ReportData:
    runs: list[dict]  # report order (oldest first), with a display label
    done: list[str]  # ids of the done runs among them
    leaderboard: list[dict]
    ft_runs: list[str]  # done runs with first_token_topk rows
    ft_prompts: list[dict]
    needle_cells: list[dict]
    needle_summary: list[dict]
    lead: list[dict]  # lead_indicators rows (category '*') of the done runs
    answers: list[dict]  # per checkable prompt: run, task, answer_hit and the first-token signals
    reliability: list[dict]  # per run and equal-count ft_hit_prob bin: mean ft_hit_prob, accuracy, n, Wilson CI
    generated: dt.datetime
    needle_gaps: list[dict] = field(default_factory=list)
    needle_attention: list[dict] = field(default_factory=list)
    sink_layers: list[dict] = field(default_factory=list)
    sink_runs: list[dict] = field(default_factory=list)
    conflict: list[dict] = field(default_factory=list)
    db: str = ""


def _rows(con, sql: str, params: list | None = None) -> list[dict]:
    cur = con.execute(sql, params or [])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]


def _select_runs(con, refs: list[str]) -> list[str]:
    if refs:
        return list(dict.fromkeys(resolve_run(con, ref) for ref in refs))
    ids = [r[0] for r in con.execute(
        "SELECT id FROM runs WHERE status = 'done' ORDER BY created_at DESC, id DESC LIMIT ?",
        [MAX_DEFAULT_RUNS],
    ).fetchall()]
    if not ids:
        raise BadInput("no finished runs to report on: " + _what_to_do(con))
    return ids


def _what_to_do(con) -> str:
    """With no done run: how to get one. A stopped run that can resume is named with the command
    that finishes it (the newest such run); a live one is waited for; else a first run."""
    from evalkit.store.queries import shown_status
    from evalkit.store.runs import RESUMABLE

    for (run_id,) in con.execute("SELECT id FROM runs ORDER BY created_at DESC, id DESC LIMIT 20").fetchall():
        status = shown_status(con, run_id)
        if status in RESUMABLE:
            return f"run {run_id} is {status}; finish it with `evalkit run --resume {run_id}`"
        if status == "running":
            return f"run {run_id} is still running; report once it is done"
    return "store one with `evalkit run` first"


def read_report(con, refs: list[str], prompts: int) -> ReportData:
    ids = _select_runs(con, refs)
    runs = _rows(con, f"""
        SELECT {", ".join("r." + c for c in RUN_COLUMNS)}, coalesce(s.n, 0) AS n_samples
        FROM runs r
        LEFT JOIN (SELECT run_id, count(*) AS n FROM samples WHERE run_id IN {IDS} GROUP BY run_id) s
          ON s.run_id = r.id
        WHERE r.id IN {IDS}
        ORDER BY r.created_at, r.id
    """, [ids, ids])
    runs = [redact.value(r) for r in runs]  # a run stored before URLs were redacted shows none of its credentials
    _label_runs(runs)
    done = [r["id"] for r in runs if r["status"] == "done"]

    leaderboard = _rows(con, f"""
        SELECT run_id, task, metric, value, stderr, ci_lo, ci_hi, n, degenerate, degenerate_reason
        FROM leaderboard WHERE run_id IN {IDS}
        ORDER BY task, metric
    """, [done])

    ft_runs = [r[0] for r in con.execute(
        f"SELECT DISTINCT run_id FROM first_token_topk WHERE run_id IN {IDS}", [done]
    ).fetchall()]
    ft_runs = [i for i in done if i in set(ft_runs)]
    ft_prompts = _first_token_prompts(con, ft_runs, prompts) if ft_runs and prompts else []

    needle_cells = _rows(con, f"""
        SELECT run_id, lang, hint, depth, length, recall, n FROM needle_heatmap
        WHERE run_id IN {IDS} ORDER BY run_id, lang, hint, length, depth
    """, [done])
    needle_summary = _rows(con, f"""
        SELECT run_id, lang, hint, sum(n) AS n, sum(recall * n) / sum(n) AS recall
        FROM needle_heatmap WHERE run_id IN {IDS}
        GROUP BY run_id, lang, hint ORDER BY run_id, lang, hint
    """, [done])
    needle_gaps = _rows(con, f"""
        SELECT run_id, task, lang, hint, length, recall_start, recall_after, start_gap, middle_gap
        FROM needle_gaps WHERE run_id IN {IDS} ORDER BY run_id, task, length
    """, [done])
    needle_attention = _rows(con, f"""
        SELECT run_id, task, lang, hint, depth, length, recall, needle_attn, n FROM needle_attention
        WHERE run_id IN {IDS} ORDER BY run_id, task, length, depth
    """, [done])
    sink_layers = _rows(con, f"""
        SELECT run_id, layer, sink_rate, sink_score, n FROM attention_sink
        WHERE run_id IN {IDS} ORDER BY run_id, layer
    """, [done])
    sink_runs = _rows(con, f"""
        SELECT run_id, count(*) AS n, avg(sink_rate) AS sink_rate FROM samples
        WHERE run_id IN {IDS} AND sink_rate IS NOT NULL GROUP BY run_id ORDER BY run_id
    """, [done])
    conflict = _rows(con, f"""
        SELECT run_id, task, lang, length, n, first_wins, last_wins, picked_both, picked_neither,
               recency_index, pairs, order_flip_rate
        FROM conflict_table WHERE run_id IN {IDS} ORDER BY run_id, task, length
    """, [done])
    lead = _rows(con, f"""
        SELECT run_id, task, signal, auroc, ci_lo, ci_hi, n, n_right, base_rate, reason
        FROM lead_indicators WHERE run_id IN {IDS} AND category = '*' ORDER BY run_id, task
    """, [done])
    from evalkit.scoring.lead import SIGNALS

    answers = _rows(con, f"""
        SELECT run_id, task, answer_hit, {', '.join(SIGNALS)} FROM samples
        WHERE run_id IN {IDS} AND answer_hit IS NOT NULL
    """, [done])
    reliability = _reliability(con, done)
    return ReportData(runs=runs, done=done, leaderboard=leaderboard, ft_runs=ft_runs,
                 ft_prompts=ft_prompts, needle_cells=needle_cells, needle_summary=needle_summary,
                 lead=lead, answers=answers, reliability=reliability,
                 generated=dt.datetime.now(dt.timezone.utc).replace(microsecond=0),
                 needle_gaps=needle_gaps, needle_attention=needle_attention, sink_layers=sink_layers,
                 sink_runs=sink_runs, conflict=conflict)


def _reliability(con, run_ids: list[str]) -> list[dict]:
    """Per run, its checkable prompts in equal-count bins by ft_hit_prob: as many bins as hold
    MIN_BIN_SIZE prompts each, at most RELIABILITY_BINS, at least one (bin sizes differ by at
    most one); each bin's mean ft_hit_prob, n, n_right, accuracy and the Wilson 95 % interval of
    the accuracy (`stats.interval`).

    Rows: {run_id, bin, bins, ft_hit_prob, n, n_right, accuracy, ci_lo, ci_hi}.
    """
    from evalkit.scoring.stats import interval

    rows = _rows(con, f"""
        WITH s AS (
            SELECT run_id, ft_hit_prob, answer_hit::INTEGER AS hit,
                   count(*) OVER (PARTITION BY run_id) AS n_run,
                   row_number() OVER (PARTITION BY run_id ORDER BY ft_hit_prob, task, doc_id) - 1 AS pos
            FROM samples WHERE run_id IN {IDS} AND answer_hit IS NOT NULL AND ft_hit_prob IS NOT NULL
        ), b AS (
            SELECT *, greatest(1, least(?, n_run // ?)) AS bins FROM s
        )
        SELECT run_id, (pos * bins // n_run)::INTEGER + 1 AS bin, any_value(bins)::INTEGER AS bins,
               avg(ft_hit_prob) AS ft_hit_prob, count(*) AS n, sum(hit)::INTEGER AS n_right,
               avg(hit) AS accuracy
        FROM b GROUP BY run_id, bin ORDER BY run_id, bin
    """, [run_ids, RELIABILITY_BINS, MIN_BIN_SIZE])
    for r in rows:
        ci = interval([1] * r["n_right"] + [0] * (r["n"] - r["n_right"]), binary=True)
        r["ci_lo"], r["ci_hi"] = ci if ci else (None, None)
    return rows


def _first_token_prompts(con, run_ids: list[str], limit: int) -> list[dict]:
    """The prompts shared by most runs where their top-1 first tokens disagree most (first-token
    prompts before needle documents), then the least certain ones (lowest top-1 probability, the
    only order left with one run), with each run's whole stored top-k (probabilities exp(logprob))
    and its top-k mass."""
    chosen = _rows(con, f"""
        WITH top1 AS (
            -- across tokenizers an id means different texts: the top-1 tokens are told apart by text
            SELECT run_id, task, doc_id,
                   CASE WHEN (SELECT count(DISTINCT tokenizer_hash) FROM runs WHERE id IN {IDS}) > 1
                        THEN arg_min(token, rank) ELSE CAST(arg_min(token_id, rank) AS VARCHAR) END AS token_id,
                   exp(arg_min(logprob, rank)) AS p
            FROM first_token_topk WHERE run_id IN {IDS}
            GROUP BY run_id, task, doc_id
        ), first_token AS (
            SELECT DISTINCT task, doc_id FROM samples WHERE run_id IN {IDS} AND ft_outcome IS NOT NULL
        ), per_prompt AS (
            SELECT t.task, t.doc_id, count(*) AS n_runs, count(DISTINCT t.token_id) AS n_top1,
                   max(t.p) - min(t.p) AS p_spread, max(t.p) AS p_top1,
                   any_value(f.task IS NOT NULL) AS is_first_token
            FROM top1 t LEFT JOIN first_token f ON f.task = t.task AND f.doc_id = t.doc_id
            GROUP BY t.task, t.doc_id
        )
        SELECT task, doc_id, n_runs, n_top1, p_spread, p_top1 FROM per_prompt
        WHERE n_runs = (SELECT max(n_runs) FROM per_prompt)
        ORDER BY is_first_token DESC, n_top1 DESC, p_spread DESC, p_top1, task, doc_id
        LIMIT ?
    """, [run_ids, run_ids, run_ids, limit])
    if not chosen:
        return []
    tasks = [c["task"] for c in chosen]
    docs = [c["doc_id"] for c in chosen]
    wanted = "(SELECT unnest(?::VARCHAR[]) AS task, unnest(?::VARCHAR[]) AS doc_id)"
    dists = _rows(con, f"""
        SELECT t.run_id, t.task, t.doc_id, sum(exp(t.logprob)) AS mass,
               list(struct_pack(rank := t.rank, token_id := t.token_id, token := t.token, unit := t.unit,
                                p := exp(t.logprob)) ORDER BY t.rank) AS tokens
        FROM first_token_topk t JOIN {wanted} w ON t.task = w.task AND t.doc_id = w.doc_id
        WHERE t.run_id IN {IDS}
        GROUP BY t.run_id, t.task, t.doc_id
        ORDER BY t.run_id, t.task, t.doc_id  -- fixes which of two equally likely tokens is listed first
    """, [tasks, docs, run_ids])
    texts = {(r["task"], r["doc_id"]): r for r in _rows(con, f"""
        SELECT s.task, s.doc_id, arg_min(s.prompt, s.run_id) AS prompt, arg_min(r.template, s.run_id) AS template,
               any_value(s.target) AS target
        FROM samples s JOIN {wanted} w ON s.task = w.task AND s.doc_id = w.doc_id JOIN runs r ON r.id = s.run_id
        WHERE s.run_id IN {IDS}
        GROUP BY s.task, s.doc_id
    """, [tasks, docs, run_ids])}
    systems = _template_systems()
    for c in chosen:
        key = (c["task"], c["doc_id"])
        c["prompt"] = (texts.get(key) or {}).get("prompt")
        c["question"] = question(c["prompt"], systems.get((texts.get(key) or {}).get("template") or ""))
        c["target"] = (texts.get(key) or {}).get("target")
        c["runs"] = {d["run_id"]: d for d in dists if (d["task"], d["doc_id"]) == key}
    return chosen


# the user's turn in the chat markups models ship: ChatML (SmolLM2, Qwen), Llama 3, Gemma, Phi-3,
# Mistral / Llama 2 (its <<SYS>> block skipped), DeepSeek; and the test fake LM's <user>...</user>
_USER_TURNS = tuple(re.compile(p, re.DOTALL) for p in (
    r"<\|im_start\|>user\s*\n(.*?)<\|im_end\|>",
    r"<\|start_header_id\|>user<\|end_header_id\|>\s*(.*?)<\|eot_id\|>",
    r"<start_of_turn>user\s*\n(.*?)<end_of_turn>",
    r"<\|user\|>\s*(.*?)<\|end\|>",
    r"\[INST\](?:\s*<<SYS>>.*?<</SYS>>)?(.*?)\[/INST\]",
    r"<｜User｜>(.*?)<｜Assistant｜>",
    r"<user>(.*?)</user>",
))


def question(context: str | None, system: str | None = None) -> str:
    """The user's question in a stored prompt (`samples.prompt` is the templated context the model
    saw): the last user turn of a known chat markup, else the context less the run template's
    system text in front of it (a template without chat), else the context as is.

    >>> question("<|im_start|>system\\nYou are SmolLM.<|im_end|>\\n<|im_start|>user\\nWhat is 2+2?<|im_end|>\\n"
    ...          "<|im_start|>assistant\\n")
    'What is 2+2?'
    >>> question("Answer directly.\\n\\nWhat is 2+2?", "Answer directly."), question("What is 2+2?", None)
    ('What is 2+2?', 'What is 2+2?')
    """
    text = context or ""
    for pattern in _USER_TURNS:
        turns = pattern.findall(text)
        if turns and turns[-1].strip():
            return turns[-1].strip()
    if system and text.startswith(system):
        return text[len(system):].strip()
    return text.strip()


def _template_systems() -> dict[str, str]:
    """template name -> its system text (`prompts.templates`; {} when the templates do not read)."""
    from evalkit.prompts.templates import load_templates

    try:
        return {name: t.system for name, t in load_templates().items() if t.system}
    except BadInput:
        return {}


def _model_label(model: str | None, model_args: str | None) -> str:
    """What a reader calls the model (`labels.model_label`) of a run stored without a model_name;
    with no model named, the model type and its short args.

    >>> _model_label("hf", '{"pretrained": "/m/SmolLM2-360M"}'), _model_label("vllm", '{"max_logprobs": 50}')
    ('SmolLM2-360M', 'vllm max_logprobs=50')
    """
    try:
        args = json.loads(model_args) if model_args else {}
    except (TypeError, ValueError):
        args = {}
    if not isinstance(args, dict):
        args = {}
    if args.get("pretrained"):
        return model_label(model or "", args)
    noise = {"trust_remote_code", "device", "dtype", "batch_size"}
    shown = ",".join(f"{k}={v}" for k, v in sorted(args.items()) if k not in noise)
    label = f"{model} {shown}".strip() if shown else (model or "?")
    return label if len(label) <= 48 else label[:47] + "…"


def trend_key(run: dict[str, Any]) -> tuple:
    """The configuration a trend line may join runs of: every run dimension `evalkit compare`
    reports a difference in (`compare.DIMENSIONS`: model, engine, quant, KV cache, template,
    first-step temperature, banned openers ...); a run stored without a model fingerprint
    counts its model args instead.

    >>> a = {"model": "hf", "model_fingerprint": "f1", "quant": None, "template": "chat", "first_temperature": None}
    >>> trend_key(a) == trend_key(dict(a)), trend_key(a) == trend_key({**a, "first_temperature": 0.7})
    (True, False)
    """
    return tuple((run.get("model_args") or "") if d == "model_fingerprint" and not run.get(d) else run.get(d)
                 for d in DIMENSIONS)


def kv_label(policy: str | None) -> str:
    """A run's KV-cache policy in a configuration label: empty for the full cache (the default)."""
    return "" if policy in (None, "full") else f"kv {policy}"


def config_line(run: dict) -> str:
    """A run's configuration on one line: model · quant · KV cache · template · engine, then the other
    dimensions a trend line keeps fixed (`compare.DIMENSIONS`) where they are not the default.

    >>> config_line({"model_label": "SmolLM2", "quant": "bf16", "kv_cache": "full", "template": "chat",
    ...              "engine": "transformers", "first_temperature": 0.7, "ban_openers": True})
    'SmolLM2 · bf16 · chat · transformers · T1 0.7 · openers banned'
    """
    first_t = run.get("first_temperature")
    extra = (run.get("engine"), f"T1 {first_t:g}" if first_t is not None else None,
             "openers banned" if run.get("ban_openers") else None)
    return " · ".join(x for x in (run["model_label"], run.get("quant"), kv_label(run.get("kv_cache")),
                                  run.get("template"), *extra) if x)


def _label_runs(runs: list[dict]) -> None:
    """Give each run its display label: its name (if any), then its configuration (`config_line`),
    and the end of its id where two runs would read the same.

    >>> runs = [{"id": f"2601010000-00000{i}", "name": n, "model": "hf", "model_name": "SmolLM2", "model_args": None,
    ...          "quant": "q4_1", "template": "chat", "engine": "llama.cpp"} for i, n in enumerate(["a", None, None])]
    >>> _label_runs(runs); [r["label"] for r in runs]
    ['a · SmolLM2 · q4_1 · chat · llama.cpp', 'SmolLM2 · q4_1 · chat · llama.cpp · 000001', 'SmolLM2 · q4_1 · chat · llama.cpp · 000002']
    """
    for r in runs:
        r["model_label"] = r["model_name"] or _model_label(r["model"], r["model_args"])
        r["config"] = config_line(r)
        r["config_key"] = trend_key(r)
        r["quant_applied"] = _quant_applied(r.get("quant"), r.get("quant_detail"))
    base = [" · ".join(x for x in (r["name"], r["config"]) if x) for r in runs]
    for r, b in zip(runs, base):
        r["label"] = b if base.count(b) == 1 else f"{b} · {r['id'][-6:]}"


def _quant_applied(quant: str | None, detail: str | None) -> str:
    """What `--quant` applied (library, bits, group size, modules), from runs.quant_detail."""
    try:
        parsed = json.loads(detail) if detail else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return ""
    return quant_summary(quant, parsed).split(": ", 1)[-1]
