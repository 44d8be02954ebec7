"""From lm-eval's results dict to evalkit's rows (metrics, samples, first_token_topk, attention_layers).

Owns: reading `results["results"]`, `results["n-samples"]` and the logged
samples, and shaping one row per metric, per prompt, per top-k token and per
(prompt, layer) of the prefill's attention. lm-eval's own tasks too: one sample row per
document however many filters logged it (`metric,filter` keys in its `metrics` JSON), a
generated response's first step read off its `FirstStepText`, and `first_step_metrics`
(the means of those first-step values, which lm-eval's tasks do not aggregate).
Does not: score a response (the tasks' `process_results` did, once) or write
to the DB.
"""

from __future__ import annotations

import json
import math
from typing import Any

from evalkit.contract import CONFLICT, FIRSTTOKEN, NEEDLE, FirstStepResult, FirstStepText, doc_kind
from evalkit.scoring.conflict import pick_of
from evalkit.scoring.firsttoken import ft_outcome, stored_fields
from evalkit.store.rows import ATTENTION_COLUMNS, SAMPLE_METRIC_COLUMNS


def _num(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def metric_rows(run_id: str, results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (task or group, metric, filter) that lm-eval aggregated."""
    n_samples = results.get("n-samples", {})
    rows = []
    for task, values in sorted(results.get("results", {}).items()):
        n = n_samples.get(task, {}).get("effective")
        for key, value in sorted(values.items()):
            if "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            val = _num(value)
            if val is None:
                continue
            rows.append({
                "run_id": run_id, "task": task, "metric": metric, "filter": filt,
                "value": val, "stderr": _num(values.get(f"{metric}_stderr,{filt}")), "n": n,
            })
    return rows


def _doc_id(sample: dict[str, Any]) -> str:
    doc = sample.get("doc") or {}
    return str(doc.get("doc_id") or doc.get("id") or sample["doc_id"])


def _response(resp: Any) -> str:
    """The stored text of a response of some other task (a loglikelihood pair, say): JSON."""
    return resp if isinstance(resp, str) else json.dumps(resp, ensure_ascii=False, default=str)


def _first_step(sample: dict[str, Any]) -> FirstStepResult | None:
    """The first step behind an lm-eval task's generated response (`FirstStepText`), or None."""
    for resps in sample.get("resps") or []:
        for resp in resps if isinstance(resps, list) else [resps]:
            if isinstance(resp, FirstStepText):
                return resp.step
    return None


def _values(sample: dict[str, Any], step: FirstStepResult | None) -> dict[str, float | None]:
    """A logged sample's per-prompt metric values: `metric` under lm-eval's "none" filter (evalkit's
    tasks), `metric,filter` under any other; with a first step, its distribution-level values too.

    >>> _values({"metrics": ["acc"], "acc": True, "filter": "none"}, None)
    {'acc': 1.0}
    >>> _values({"metrics": ["exact_match"], "exact_match": 0, "filter": "strict-match"}, None)
    {'exact_match,strict-match': 0.0}
    """
    filt = sample.get("filter") or "none"
    values = {m if filt == "none" else f"{m},{filt}": _num(sample[m])
              for m in sample.get("metrics", []) if m in sample}
    if step is not None:
        for name, value in step.metrics.items():
            values.setdefault(name, _num(value))
    return values


def attention_rows(run_id: str, task: str, doc_id: str, layers: dict[str, list[float]]) -> list[dict]:
    """One `attention_layers` row per layer of a response's per-layer values (none without --attention)."""
    n = max((len(v) for v in layers.values()), default=0)
    return [{"run_id": run_id, "task": task, "doc_id": doc_id, "layer": i,
             **{c: _num(layers[c][i]) for c in ATTENTION_COLUMNS[4:] if c in layers and i < len(layers[c])}}
            for i in range(n)]


def first_char_rows(run_id: str, results: dict[str, Any]) -> list[dict]:
    """The `first_char_topk` rows of one lm-eval results dict: each response's likeliest first-character
    events (`FirstStepResult.first_chars`), one row a rank; none for an engine that read none."""
    out: list[dict] = []
    seen: set[tuple[str, str]] = set()
    for task, logged in sorted(results.get("samples", {}).items()):
        for s in logged:
            resp = s["filtered_resps"][0] if s.get("filtered_resps") else s["resps"][0][0]
            step = _first_step(s) or (resp if isinstance(resp, FirstStepResult) else None)
            doc_id = _doc_id(s)
            if step is None or not step.first_chars or (task, doc_id) in seen:
                continue
            seen.add((task, doc_id))
            out += [{"run_id": run_id, "task": task, "doc_id": doc_id, "rank": rank, "event": event, "prob": p}
                    for rank, (event, p) in enumerate(step.first_chars)]
    out.sort(key=lambda r: (r["task"], r["doc_id"], r["rank"]))
    return out


def collect(run_id: str, results: dict[str, Any]) -> tuple[list[dict], list[dict], list[dict], list[dict]]:
    """(metric rows, sample rows, top-k rows, attention rows) of one lm-eval results dict
    (`first_char_rows` gives its first_char_topk rows).

    Metric values are the ones the task's `process_results` computed (lm-eval logs them
    with the sample); nothing is scored again here.
    """
    metrics = metric_rows(run_id, results)
    samples, topk, attention = [], [], []
    by_doc: dict[tuple[str, Any], dict] = {}  # (task, lm-eval's doc index) -> its row
    for task, logged in sorted(results.get("samples", {}).items()):
        for s in logged:
            doc = s.get("doc") or {}
            kind = doc_kind(doc)
            resp = s["filtered_resps"][0] if s.get("filtered_resps") else s["resps"][0][0]
            step = _first_step(s)  # an lm-eval task's generated response, as evalkit's backend read it
            values = _values(s, step)
            seen = by_doc.get((task, s["doc_id"])) if s.get("doc_id") is not None else None
            if seen is not None:  # lm-eval logs a doc once per filter (gsm8k: strict-match, flexible-extract)
                seen["metrics"] = json.dumps({**json.loads(seen["metrics"]), **values}, sort_keys=True)
                continue
            if step is not None:
                fields = stored_fields(step)
            elif isinstance(resp, FirstStepResult) or kind == FIRSTTOKEN:
                fields = stored_fields(resp)
            else:  # a loglikelihood pair, or one per choice of a multiple_choice doc
                many = len(s.get("filtered_resps") or []) > 1
                fields = {"response": _response(s["filtered_resps"] if many else resp)}
            logged_values = json.dumps(values, sort_keys=True)
            if isinstance(resp, FirstStepResult) and resp.entropy is not None:
                values.setdefault("entropy", _num(resp.entropy))
            needle, sized = kind == NEEDLE, kind in (NEEDLE, CONFLICT)
            doc_id = _doc_id(s)
            row = {
                "run_id": run_id,
                "task": task,
                "doc_id": doc_id,
                "prompt_hash": s.get("prompt_hash"),
                "prompt": s["arguments"][0][0] if s.get("arguments") else None,
                "target": json.dumps(doc.get("answers", [s.get("target")]), ensure_ascii=False),
                "response": fields.get("response"),
                "first_token": fields.get("first_token"),
                "first_token_id": fields.get("first_token_id"),
                "first_unit": fields.get("first_unit"),
                "ft_outcome": ft_outcome(values) if kind == FIRSTTOKEN and values.get("ft_hit") is not None else None,
                "lang": doc.get("lang"),
                "category": doc.get("category"),
                "needle_depth": doc.get("depth") if needle else None,
                "needle_length": doc.get("length") if sized else None,
                "needle_tokens": doc.get("n_tokens") if sized else None,
                "needle_hint": doc.get("hint") if needle else None,
                "metrics": logged_values,
                "conflict_pick": pick_of(values) if kind == CONFLICT else None,
                "conflict_pair": doc.get("pair_id") if kind == CONFLICT else None,
                "conflict_order": doc.get("order") if kind == CONFLICT else None,
                "answer": fields.get("answer"),
            }
            chars = step if step is not None else resp if isinstance(resp, FirstStepResult) else None
            if chars is not None and chars.first_chars:
                row["fc_rest_mass"], row["fc_unresolved_mass"] = chars.fc_rest_mass, chars.fc_unresolved_mass
            for m in SAMPLE_METRIC_COLUMNS:
                row[m] = values.get(m)
            samples.append(row)
            if s.get("doc_id") is not None:
                by_doc[(task, s["doc_id"])] = row
            units = {int(k): v for k, v in (fields.get("units") or {}).items()}
            for rank, (token_id, token, logprob) in enumerate(fields.get("topk") or []):
                topk.append({
                    "run_id": run_id, "task": task, "doc_id": doc_id, "rank": rank,
                    "token_id": int(token_id), "token": token, "logprob": float(logprob),
                    "unit": units.get(int(token_id)),
                })
            layered = step if step is not None else resp
            if isinstance(layered, FirstStepResult) and layered.layers:
                attention += attention_rows(run_id, task, doc_id, layered.layers)
    samples.sort(key=lambda r: (r["task"], r["doc_id"]))
    attention.sort(key=lambda r: (r["task"], r["doc_id"], r["layer"]))
    return metrics, samples, topk, attention


def first_step_metrics(run_id: str, sample_rows: list[dict], metric_rows: list[dict]) -> list[dict]:
    """Aggregate rows (filter "none", the mean over prompts) of the first-step values that samples
    hold but no task aggregated. For the samples of lm-eval's own generating tasks (gsm8k ...),
    whose `process_results` knows nothing of them; evalkit's tasks say what they aggregate."""
    from evalkit.scoring import registry
    from evalkit.scoring.stats import mean_stderr

    have = {(r["task"], r["metric"]) for r in metric_rows}
    names = [m for m in SAMPLE_METRIC_COLUMNS
             if (spec := registry.get(m)) is not None and spec.level in ("distribution", "attention")]
    values: dict[tuple[str, str], list[float]] = {}
    for s in sample_rows:
        for m in names:
            if s.get(m) is not None and (s["task"], m) not in have:
                values.setdefault((s["task"], m), []).append(s[m])
    rows = []
    for (task, metric), vals in sorted(values.items()):
        value, stderr = mean_stderr(vals)
        rows.append({"run_id": run_id, "task": task, "metric": metric, "filter": "none", "value": value,
                     "stderr": stderr, "n": len(vals)})
    return rows


def add_intervals(metric_rows: list[dict], sample_rows: list[dict], group_subtasks: dict[str, list[str]]) -> None:
    """Give each aggregate of a per-sample metric its interval (`stats.interval`: Wilson for
    proportions, bootstrap percentile otherwise) from the prompts' values, and a group's row
    (e.g. `firsttoken`, over `firsttoken_en` and `firsttoken_zh`) its prompt count; a mean's value,
    stderr and n are taken over the prompts that define the metric; in place."""
    from evalkit.scoring import registry
    from evalkit.scoring.stats import interval, mean_stderr

    by_task: dict[str, list[dict]] = {}
    for s in sample_rows:
        by_task.setdefault(s["task"], []).append(s)

    def members(task: str) -> list[str]:
        subs = group_subtasks.get(task)
        return [t for sub in subs for t in members(sub)] if subs else [task]

    for row in metric_rows:
        spec = registry.get(row["metric"])
        if spec is None or not spec.per_sample or row.get("ci_lo") is not None:
            continue
        values = [s[row["metric"]] for t in members(row["task"]) for s in by_task.get(t, [])
                  if s.get(row["metric"]) is not None]
        if values and spec.aggregation == "mean":
            # lm-eval counts and weighs a task by its prompts, but a metric that only some prompts
            # define (answer_hit: the checkable ones) is a mean over those prompts alone
            row["value"], row["stderr"] = mean_stderr(values)
            row["n"] = len(values)
        elif row.get("n") is None and values:
            row["n"] = len(values)
        ci = interval(values, binary=spec.binary) if values else None
        if ci:
            row["ci_lo"], row["ci_hi"] = ci
