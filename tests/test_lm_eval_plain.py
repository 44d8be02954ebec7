"""The first-token tasks under plain lm-eval, without evalkit's runner or store."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import lm_eval
import pytest
from lm_eval.tasks import TaskManager

from tests import fake_lm
from tests.fake_lm import FakeLM

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tasks"


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(TASKS), include_defaults=False)


def test_task_manager_sees_the_tasks(task_manager):
    assert {"firsttoken", "firsttoken_en", "firsttoken_zh", "firsttoken_user"} <= set(task_manager.all_tasks)


def test_simple_evaluate_with_an_lm_instance(task_manager):
    start = len(fake_lm.CALLS)
    results = lm_eval.simple_evaluate(
        model=FakeLM(mode="hit"), tasks=["firsttoken"], task_manager=task_manager, limit=3,
    )
    res = results["results"]
    for task in ("firsttoken_en", "firsttoken_zh"):
        assert res[task]["ft_hit,none"] == 1.0
        assert res[task]["opener_rate,none"] == 0.0
        assert results["n-samples"][task]["effective"] == 3
    assert res["firsttoken"]["ft_hit,none"] == 1.0  # the group's aggregate
    contexts = [c for c, _ in fake_lm.CALLS[start:]]
    assert len(contexts) == 6
    assert "What is recursion?" in contexts  # no chat template unless asked
    logged = results["samples"]["firsttoken_zh"][0]
    assert logged["doc"]["answers"] == ["递归"] and logged["ft_hit"] == 1.0


def test_simple_evaluate_by_model_name_with_chat_template(task_manager):
    start = len(fake_lm.CALLS)
    results = lm_eval.simple_evaluate(
        model="evalkit-fake", model_args="mode=opener", tasks=["firsttoken_en", "firsttoken_zh"],
        task_manager=task_manager, limit=3, apply_chat_template=True, system_instruction="Be brief.",
    )
    for task in ("firsttoken_en", "firsttoken_zh"):
        assert results["results"][task]["ft_hit,none"] == 0.0
        assert results["results"][task]["opener_rate,none"] == 1.0
    contexts = [c for c, _ in fake_lm.CALLS[start:]]
    assert "<system>Be brief.</system><user>What is recursion?</user><assistant>" in contexts


def test_user_prompts_task_through_metadata(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "Name the largest planet.", "answers": ["Jupiter"], "lang": "en"}\n', encoding="utf-8")
    tm = TaskManager(include_path=str(TASKS), include_defaults=False, metadata={"prompts_file": str(path)})
    results = lm_eval.simple_evaluate(model=FakeLM(mode="hit"), tasks=["firsttoken_user"], task_manager=tm)
    assert results["results"]["firsttoken_user"]["ft_hit,none"] == 1.0
    assert results["n-samples"]["firsttoken_user"]["effective"] == 1


def test_lm_eval_cli_on_the_tiny_model(tiny_model_dir):
    """`python -m lm_eval` (0.4.13 inserts `run` when no command is given) with lm-eval's own hf model.

    `device=cpu` goes in `--device`: inside `--model_args` it collides with the CLI's own device
    (lm-eval 0.4.13: "HFLM() got multiple values for keyword argument 'device'")."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}  # a tiny model: threads only wait
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={tiny_model_dir}",
         "--device", "cpu", "--include_path", str(TASKS), "--tasks", "firsttoken_en", "--limit", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    task = None
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 7 and cells[0]:
            task = cells[0] if cells[0] != "Tasks" else None
        if len(cells) >= 7 and cells[4] in ("ft_hit", "opener_rate", "answer_hit"):
            rows[(task, cells[4])] = float(cells[6])
    # text-level metrics under plain HFLM; answer_hit too (en-0002 "capital of France" is checkable)
    assert set(rows) == {("firsttoken_en", m) for m in ("ft_hit", "opener_rate", "answer_hit")}, proc.stdout
    assert all(0.0 <= v <= 1.0 for v in rows.values())
    assert re.search(r"limit: 2", proc.stdout)
