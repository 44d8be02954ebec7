"""A non-editable install carries the tasks: build the wheel, install it in a fresh venv, and run
a first-token task from another directory.

The fresh venv gets evalkit from the wheel alone; its dependencies (torch, lm-eval, ...) come
from this environment's site-packages on PYTHONPATH, where evalkit itself is only an editable
finder that a plain path entry does not load, so nothing of the checkout can leak in.
"""

from __future__ import annotations

import os
import re
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_in_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "evalkit").rglob("__init__.py")}
    assert found | {"evalkit.tasks"} == listed


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = out.glob("evalkit_firsttoken-*.whl")  # the distribution name, normalised
    return path


def test_the_wheel_holds_the_tasks_and_their_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("evalkit/tasks/firsttoken/_firsttoken_common.yaml", "evalkit/tasks/firsttoken/utils.py",
                 "evalkit/tasks/firsttoken/data/firsttoken_en.jsonl", "evalkit/tasks/needle/data/haystack_zh.txt",
                 "evalkit/tasks/needle/needle_en_hint.yaml", "evalkit/data/openers.yaml", "evalkit/data/templates.yaml"):
        assert name in names, name
    assert not [n for n in names if "__pycache__" in n or n.startswith("tests/")]


def test_an_installed_wheel_runs_a_task_from_another_directory(wheel, tiny_model_dir, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300)
    deps = [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if Path(p).is_dir()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(deps)), "HF_HUB_OFFLINE": "1",
           "EVALKIT_DB": str(tmp_path / "wheel.duckdb")}
    env.pop("EVALKIT_TASKS", None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    where = subprocess.run([str(py), "-c", "import evalkit; print(evalkit.__file__)"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(venv)), where  # the wheel's evalkit, not the checkout's
    tasks = subprocess.run([str(venv / "bin" / "evalkit"), "tasks-path"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert tasks.startswith(str(venv)) and (Path(tasks) / "firsttoken" / "firsttoken_en.yaml").is_file()

    run = subprocess.run([str(venv / "bin" / "evalkit"), "run", "--model-args", f"pretrained={tiny_model_dir}",
                          "--tasks", "firsttoken_en", "--limit", "2", "--device", "cpu"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^run \S+  done  2 samples", run.stdout, re.M), run.stdout
    print(f"\nwheel {wheel.name} installed in a fresh venv; `evalkit tasks-path` -> {tasks}\n"
          + "\n".join(run.stdout.splitlines()[:6]))
