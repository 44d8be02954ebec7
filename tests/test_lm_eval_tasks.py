"""lm-eval's own tasks through `evalkit run`: names, offline data, and what the DB stores.

The datasets are served from local files: `serve_dataset` writes a tiny version of a hub
dataset where `datasets` looks offline (HF_DATASETS_CACHE/<org>___<name>/<config>/0.0.0/<hash>/,
arrow files and dataset_info.json, as `load_dataset` leaves them), so `allenai/sciq`
(multiple_choice) and `openai/gsm8k` (generate_until, two filters) load with no hub.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from evalkit.prompts import lm_eval_tasks

ROOT = Path(__file__).resolve().parents[1]
FAKE = ["--model", "evalkit-fake"]


def serve_dataset(cache: Path, repo: str, config: str | None, splits: dict[str, list[dict]]) -> None:
    """Write `splits` (split -> rows) as the prepared copy of hub dataset `repo` that `datasets`
    finds in `cache` when offline."""
    import datasets

    org, name = repo.split("/")
    work = cache.parent / f"serve-{org}-{name}"
    files = {}
    for split, rows in splits.items():
        path = work / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        files[split] = str(path)
    builder = datasets.load_dataset_builder("json", data_files=files, cache_dir=str(work / "prepared"))
    builder.download_and_prepare()
    out = cache / f"{org}___{name}" / (config or "default") / "0.0.0" / ("0" * 16)
    out.mkdir(parents=True)
    for arrow in Path(builder.cache_dir).glob("*.arrow"):  # json-test.arrow -> sciq-test.arrow
        shutil.copy(arrow, out / arrow.name.replace("json-", f"{name}-", 1))
    info = json.loads(Path(builder.cache_dir, "dataset_info.json").read_text(encoding="utf-8"))
    info.update(builder_name=name, dataset_name=name, config_name=config or "default")
    for split in info["splits"].values():
        split["dataset_name"] = name
    (out / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")


SCIQ = [{"question": f"Which number is {i}?", "distractor1": "ten", "distractor2": "eleven", "distractor3": "twelve",
         "correct_answer": str(i), "support": f"The number is {i}."} for i in range(4)]
GSM8K = [{"question": f"Tom has {i} apples and gets one more. How many?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}
         for i in range(8)]


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A datasets cache holding tiny sciq and gsm8k, read offline (in this process and its children)."""
    import datasets
    import huggingface_hub.constants

    cache = tmp_path / "hf-datasets"
    serve_dataset(cache, "allenai/sciq", None, {"train": SCIQ, "validation": SCIQ, "test": SCIQ})
    serve_dataset(cache, "openai/gsm8k", "main", {"train": GSM8K, "test": GSM8K})
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)  # read once, at import
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(lm_eval_tasks, "_LOADED", set())
    return cache


def _rows(db: Path, sql: str, *params) -> list[dict]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        cur = con.execute(sql, list(params))
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]
    finally:
        con.close()


def test_evalkit_names_never_index_lm_eval(invoke, tmp_path, monkeypatch):
    """evalkit's own tasks start in milliseconds: lm-eval's ~14,700 built-in YAMLs are not indexed."""
    from lm_eval.tasks import TaskManager

    indexed = []
    real_init = TaskManager.__init__

    def counting_init(self, *args, include_defaults=True, **kwargs):
        indexed.append(include_defaults)
        real_init(self, *args, include_defaults=include_defaults, **kwargs)

    monkeypatch.setattr(TaskManager, "__init__", counting_init)
    fresh = functools.lru_cache(maxsize=1)(lm_eval_tasks.index.__wrapped__)  # as if no run had built it yet
    monkeypatch.setattr(lm_eval_tasks, "index", fresh)
    res = invoke("run", *FAKE, "--tasks", "firsttoken", "--limit", 1, "--db", tmp_path / "e.duckdb")
    assert res.exit_code == 0, res.output
    assert indexed and not any(indexed), indexed  # evalkit's own TaskManager only (include_defaults=False)
    assert fresh.cache_info().currsize == 0


def test_unknown_name_suggests_from_both_sets(invoke, tmp_path):
    db = tmp_path / "e.duckdb"
    res = invoke("run", *FAKE, "--tasks", "mmlu_anatomyy", "--db", db)
    assert res.exit_code == 2
    assert "unknown task 'mmlu_anatomyy' (did you mean mmlu_anatomy?)" in res.stderr
    res = invoke("run", *FAKE, "--tasks", "firsttoken_enn", "--db", db)  # evalkit's name first
    assert res.exit_code == 2 and "did you mean firsttoken_en?" in res.stderr
    assert not db.exists()


def test_offline_task_without_data_fails_in_one_line(tmp_path, tiny_model_dir):
    """A real process, offline, with an empty datasets cache: one line naming the task, exit 2, no
    run row (no DB at all)."""
    db = tmp_path / "e.duckdb"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "EVALKIT_DB": str(db),
           "HF_DATASETS_CACHE": str(tmp_path / "empty-cache"), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-m", "evalkit", "run", "--model", "hf", "--model-args", f"pretrained={tiny_model_dir}",
         "--device", "cpu", "--tasks", "firsttoken_en,arithmetic_1dc", "--limit", "1"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("evalkit: error: lm-eval task 'arithmetic_1dc': its data is not in the local "
                               "datasets cache and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set")
    assert "fetch it once where the hub can be reached (evalkit run --tasks arithmetic_1dc --limit 1)" in lines[0]
    assert "HF_DATASETS_CACHE" in lines[0]
    assert "run " not in proc.stdout and not db.exists()  # no run row, no DB


def test_missing_data_stops_before_the_model_loads(invoke, served, tmp_path, monkeypatch):
    """In process: the data check is part of the plan, before `models.load` and the run row."""
    from evalkit.engines import resolve as models

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the data check")

    monkeypatch.setattr(models, "load", no_load)
    db = tmp_path / "e.duckdb"
    fresh = functools.lru_cache(maxsize=1)(lm_eval_tasks.index.__wrapped__)  # as if no run had built it yet
    monkeypatch.setattr(lm_eval_tasks, "index", fresh)
    res = invoke("run", *FAKE, "--tasks", "sciq,arithmetic_1dc", "--db", db)  # sciq is served, arithmetic not
    assert res.exit_code == 2
    assert res.stderr.startswith("evalkit: error: lm-eval task 'arithmetic_1dc': its data is not in the local "
                                 "datasets cache")
    assert len(res.stderr.strip().splitlines()) == 1 and not db.exists()
    assert fresh.cache_info().currsize == 0  # offline, plain tasks are checked without lm-eval's slow index


def test_offline_a_task_is_refused_or_loaded_without_the_index(served, monkeypatch, tmp_path):
    """With no hub to reach (HF_*_OFFLINE, or no network), a task's own folder is built with data from the
    cache alone: a task never fetched is refused in seconds (arithmetic_1dc took 294 s on a busy machine,
    indexing 14k files and retrying the hub), a cached one (sciq, served) passes, neither builds the index."""
    from evalkit.errors import BadInput

    def no_index():
        raise AssertionError("lm-eval's index was built")

    monkeypatch.setattr(lm_eval_tasks, "index", no_index)
    assert lm_eval_tasks.task_file("arithmetic_1dc").name == "arithmetic_1dc.yaml"
    assert lm_eval_tasks.task_file("mmlu") is None  # a group: the index decides
    lm_eval_tasks.check_names(["sciq"], ["firsttoken"])
    lm_eval_tasks.check_data(["sciq"])  # loaded once, not again
    with pytest.raises(BadInput, match=r"'arithmetic_1dc': its data is not in the local datasets cache .*"
                                       r"fetch it once where the hub can be reached"):
        lm_eval_tasks.check_names(["arithmetic_1dc"], ["firsttoken"])


def test_hub_reachable_asks_the_endpoint_or_trusts_a_proxy(monkeypatch):
    import socket

    from huggingface_hub import constants

    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    assert lm_eval_tasks.hub_reachable(timeout=2) is False
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{listening.getsockname()[1]}")
        assert lm_eval_tasks.hub_reachable(timeout=2) is True
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:3128")
    assert lm_eval_tasks.hub_reachable(timeout=2) is True  # the proxy's to reach


def test_lm_eval_tasks_stored_beside_evalkits(invoke, served, tiny_model_dir, tmp_path, monkeypatch):
    """sciq (multiple_choice: loglikelihood per choice) and gsm8k (generate_until through evalkit-hf's
    probe, two filters) in one run with an evalkit task, on the tiny random Llama."""
    from evalkit.engines.transformers.model import EvalkitHFLM

    monkeypatch.setattr(EvalkitHFLM, "max_gen_toks", property(lambda self: 8))  # gsm8k sets none: 256
    db = tmp_path / "e.duckdb"
    res = invoke("run", "--model", "hf", "--model-args", f"pretrained={tiny_model_dir}", "--device", "cpu",
                 "--tasks", "firsttoken_en,sciq,gsm8k", "--limit", 2, "--db", db,
                 env={"TOKENIZERS_PARALLELISM": "false"})
    assert res.exit_code == 0, res.output
    run_id = re.search(r"^run (\S+)  done  6 samples", res.stdout, re.M).group(1)
    assert "exact_match (strict-match)" in res.stdout  # the filter is shown where it is not "none"

    (run,) = _rows(db, "SELECT status, tasks FROM runs WHERE id = ?", run_id)
    assert run == {"status": "done", "tasks": ["firsttoken_en", "sciq", "gsm8k"]}
    metrics = {(r["task"], r["metric"], r["filter"]): r
               for r in _rows(db, "SELECT * FROM metrics WHERE run_id = ?", run_id)}
    for key in [("sciq", "acc", "none"), ("sciq", "acc_norm", "none"), ("gsm8k", "exact_match", "strict-match"),
                ("gsm8k", "exact_match", "flexible-extract"), ("firsttoken_en", "ft_hit", "none")]:
        assert key in metrics and metrics[key]["n"] == 2, key
        assert 0.0 <= metrics[key]["value"] <= 1.0
    # evalkit's first-step metrics, aggregated over gsm8k's generated responses; no interval from 2 prompts
    for name in ("top1_prob", "top3_mass", "entropy", "unstable"):
        row = metrics[("gsm8k", name, "none")]
        assert row["n"] == 2 and row["value"] is not None and row["ci_lo"] is None and row["ci_hi"] is None
    assert not any(t == "sciq" and m in ("top1_prob", "entropy") for t, m, _ in metrics)  # no generation there

    samples = {(s["task"], s["doc_id"]): s for s in _rows(db, "SELECT * FROM samples WHERE run_id = ?", run_id)}
    by_task = sorted(t for t, _ in samples)
    assert by_task == ["firsttoken_en"] * 2 + ["gsm8k"] * 2 + ["sciq"] * 2  # one row per doc, not per filter
    gsm = samples[("gsm8k", "0")]
    assert "Tom has 0 apples and gets one more. How many?" in gsm["prompt"]
    assert isinstance(gsm["response"], str) and gsm["first_token_id"] is not None
    assert gsm["top1_prob"] is not None and gsm["entropy"] is not None
    logged = json.loads(gsm["metrics"])
    assert {"exact_match,strict-match", "exact_match,flexible-extract", "top1_prob"} <= set(logged)
    sciq = samples[("sciq", "0")]
    choices = json.loads(sciq["response"])  # (loglikelihood, is_greedy) per choice
    assert len(choices) == 4 and all(isinstance(c[0], float) for c in choices)
    assert set(json.loads(sciq["metrics"])) == {"acc", "acc_norm"} and sciq["first_token"] is None
    topk = _rows(db, "SELECT task, count(*) AS n FROM first_token_topk WHERE run_id = ? GROUP BY task ORDER BY task",
                 run_id)
    assert [r["task"] for r in topk] == ["firsttoken_en", "gsm8k"]
