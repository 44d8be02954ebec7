"""Every file evalkit opens from a path a user or a folder supplies goes through one door.

The door is `paths.open_input` (evalkit reads the file: a regular file, a size limit, a FIFO
opened without waiting) or, for a library that opens by path, `paths.check_input_path` (the
path's kind checked first: a regular file or a folder as expected, no FIFO, device or socket in
it; `engines.plan.check_local_files` applies it to every model arg naming a local path).

`test_every_read_site_is_behind_the_door` lists every call in `evalkit/` that opens or parses a
file by path (read from the AST, not by regex): `open(`, `os.open(`, `.read_text(`,
`.read_bytes(`, `.from_pretrained(`, `.from_file(`, `json.load(`, `yaml.load(` /
`yaml.safe_load(`, `np.load(` / `torch.load(` / `pickle.load(`, `GGUFReader(`, `Llama(`,
`llama_model_load_from_file(`, `TaskManager(`, `safe_open(` / `load_file(`, and lm-eval's
`create_from_arg_obj(` (the model load), and fails on one that is not in `DOOR`, the allow-list
of the functions that hold such a call, each with why its call is behind the door. Then a
FIFO at each path a user or a folder names: one line, exit 2, at once.
"""

from __future__ import annotations

import ast
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "evalkit"

_ATTRS = {"open", "read_text", "read_bytes", "from_pretrained", "from_file", "llama_model_load_from_file",
          "GGUFReader", "Llama", "safe_open", "load_file", "TaskManager", "create_from_arg_obj"}
_NAMES = {"open", "GGUFReader", "Llama", "TaskManager", "safe_open", "load_file"}
_LOADERS = {("json", "load"), ("yaml", "load"), ("yaml", "safe_load"), ("yaml", "full_load"), ("np", "load"),
            ("numpy", "load"), ("torch", "load"), ("pickle", "load")}

# (function, call) -> why the call is behind the door. A function is named by its qualified name
# in its module (a move between modules keeps it); the call as `sites` spells it.
DOOR: dict[tuple[str, str], str] = {
    # ---- the door itself, and files evalkit creates for itself
    ("open_input", "os.open"): "the door: O_NONBLOCK (a FIFO never waited on), fstat kind and size checked",
    ("is_duckdb_file", "os.open"): "O_RDONLY|O_NONBLOCK, fstat: anything but a regular file is no DuckDB file",
    ("_fsync", "os.open"): "a file or folder evalkit has just written (write_file, atomic_folder)",
    ("write_file", "os.open"): "creates a new temporary with O_CREAT|O_EXCL: an output, never read",
    ("append_file", "os.open"): "O_NOFOLLOW|O_NONBLOCK and fstat kind checked before a byte is written",
    ("create", "os.open"): "cachedir.create: O_CREAT|O_EXCL|O_NOFOLLOW, an entry evalkit writes",
    ("Journal.create", "os.open"): "a new journal: O_CREAT|O_EXCL|O_NOFOLLOW in a checked spool folder",
    ("Journal._writable", "os.open"): "the journal evalkit created: O_NOFOLLOW, append only, verified first",
    ("process_start", "open"): "/proc/PID/stat: the kernel's file, no path a user or folder supplies",
    ("_process_gone", "open"): "/proc/PID/stat: the kernel's file, no path a user or folder supplies",
    # ---- files parsed after the door read them
    ("read_yaml", "yaml.load"): "parses bytes read by paths.read_input (task YAMLs: kind and size checked)",
    ("_read", "yaml.safe_load"): "templates: parses bytes read by paths.read_input",
    ("_load", "yaml.safe_load"): "opener lexicon: parses bytes read by paths.read_input",
    ("load_rules", "yaml.load"): "rules: parses text read by paths.read_input",
    # ---- libraries that open by path, the path checked first
    ("task_manager", "TaskManager"): "catalog.task_names first reads every *.yaml lm-eval will read through the "
                                     "door (and each include: target's kind)",
    ("index", "TaskManager"): "lm-eval's own installed task folder, no include path: no path a user supplies",
    ("_load_offline", "TaskManager"): "a folder of lm-eval's installed tasks (task_file found it there)",
    ("task_file", ".read_text"): "lm-eval's installed task YAMLs, found under lm_eval.__file__",
    ("model_types", ".read_text"): "lm-eval's installed model modules, found under its package",
    ("load", ".create_from_arg_obj"): "engines.resolve.load: check_local_files (every model arg naming a local "
                                      "path) first, the load wrapped in loaderrors.loading",
    ("_causal_config", ".from_pretrained"): "check_input_path(folder) first, wrapped in loaderrors.loading",
    ("_gguf_model_type", "GGUFReader"): "check_input_path(path, file) first; any parse error is BadInput",
    ("convert", ".from_pretrained"): "check_input_path(gguf, file) first (it also passed check_local_files), "
                                     "wrapped in loaderrors.loading",
    ("_load_tokenizer", ".from_pretrained"): "needle tokenizer: check_input_path of the folder and its GGUF, "
                                             "wrapped in loaderrors.loading",
    ("_skeleton", ".from_pretrained"): "sweep: check_local_files(args) first",
    ("LlamaCppEngine.__init__", ".llama_model_load_from_file"): "check_input_path(path, file) first",
    ("load_tokenizer", ".from_pretrained"): "server tokenizer: check_input_path(folder) first, wrapped in "
                                            "loaderrors.loading",
    ("_gguf_tensor_types", "GGUFReader"): "check_input_path(path, file) first; a detail, None on any error",
    ("requantize", ".from_pretrained"): "from_pretrained(None, state_dict=...): tensors in memory, no path",
}


def sites(package: Path = PACKAGE) -> list[tuple[str, str, str, int]]:
    """(file, function, call, line) of every call in `package` that opens or parses a file by path."""
    out = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        rel = str(path.relative_to(package.parent))

        def walk(node: ast.AST, scope: list[str]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    walk(child, [*scope, child.name])
                    continue
                if isinstance(child, ast.Call):
                    name = _callee(child.func)
                    if name:
                        out.append((rel, ".".join(scope) or "<module>", name, child.lineno))
                walk(child, scope)

        walk(tree, [])
    return out


def _callee(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id if func.id in _NAMES else None
    if isinstance(func, ast.Attribute):
        base = func.value.id if isinstance(func.value, ast.Name) else None
        if (base, func.attr) in _LOADERS:
            return f"{base}.{func.attr}"
        if func.attr in _ATTRS:
            return (f"{base}." if base in ("os", "io", "gzip", "bz2", "lzma") else ".") + func.attr
    return None


def test_every_read_site_is_behind_the_door():
    found = sites()
    outside = [f"{file}:{line}: {call} in {fn}" for file, fn, call, line in found if (fn, call) not in DOOR]
    assert not outside, "calls that open a file by path outside the door (paths.open_input / check_input_path); " \
                        "route them through it, or add them to DOOR with why they need not:\n" + "\n".join(outside)
    stale = sorted(set(DOOR) - {(fn, call) for _, fn, call, _ in found})
    assert not stale, f"DOOR names calls that are gone: {stale}"
    print(f"{len(found)} call sites, all behind the door")


def test_the_lister_finds_each_kind_of_call(tmp_path):
    pkg = tmp_path / "evalkit"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "import json, os, yaml\nfrom pathlib import Path\n"
        "def f(p):\n    open(p)\n    Path(p).read_text()\n    json.load(open(p))\n    yaml.safe_load(p)\n"
        "class C:\n    def g(self, p):\n        os.open(p, 0)\n        AutoTokenizer.from_pretrained(p)\n"
        "        GGUFReader(p)\n        llama_cpp.Llama(model_path=p)\n",
        encoding="utf-8")
    got = [(fn, call) for _, fn, call, _ in sites(pkg)]
    assert got == [("f", "open"), ("f", ".read_text"), ("f", "json.load"), ("f", "open"), ("f", "yaml.safe_load"),
                   ("C.g", "os.open"), ("C.g", ".from_pretrained"), ("C.g", "GGUFReader"), ("C.g", ".Llama")]


# ---- a FIFO at each path a user or a folder names: one line, exit 2, at once ------------------------


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """TimeoutError when the block takes longer: a read blocked on a FIFO is interrupted, not waited on."""
    def expired(signum, frame):
        raise TimeoutError(f"still waiting after {seconds} s: a read that waits on a FIFO")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def one_line_exit_2(invoke, *args, env=None, expect: str) -> str:
    with deadline(60):
        res = invoke(*[str(a) for a in args], env=env)
    lines = res.stderr.strip().splitlines()
    shown = f"\n--- stderr ---\n{res.stderr}--- stdout ---\n{res.stdout}"
    assert res.exit_code == 2, f"exit {res.exit_code}{shown}"
    assert len(lines) == 1 and lines[0].startswith("evalkit: error: "), shown
    assert expect in lines[0], shown
    return lines[0]


def fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def test_a_fifo_yaml_in_an_include_path(invoke, tmp_path):
    inc = tmp_path / "inc"
    fifo(inc / "sub" / "t.yaml")
    one_line_exit_2(invoke, "run", "--model", "hf", "--tasks", "firsttoken", "--include-path", inc,
                    "--db", tmp_path / "e.duckdb", expect="t.yaml in it is a FIFO")


def test_a_fifo_yaml_in_evalkit_tasks(invoke, tmp_path):
    from evalkit.prompts import catalog

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for path in catalog.yaml_files(catalog.tasks_path()):  # a copy of evalkit's own, and one FIFO beside them
        target = tasks / path.relative_to(catalog.tasks_path())
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(path.read_bytes())
    fifo(tasks / "zz.yaml")
    catalog._yaml_config.cache_clear()
    one_line_exit_2(invoke, "run", "--model", "hf", "--tasks", "firsttoken", "--db", tmp_path / "e.duckdb",
                    env={"EVALKIT_TASKS": str(tasks)}, expect="zz.yaml in it is a FIFO")


def test_a_fifo_include_target(invoke, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "t.yaml").write_text("task: mine\ninclude: ../outside/base.yml\n", encoding="utf-8")
    fifo(tmp_path / "outside" / "base.yml")  # outside the include path: lm-eval reads it all the same
    one_line_exit_2(invoke, "run", "--model", "hf", "--tasks", "firsttoken", "--include-path", inc,
                    "--db", tmp_path / "e.duckdb", expect="base.yml: it is a FIFO")


def test_a_fifo_module_beside_an_include_path_yaml(invoke, tmp_path):
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "t.yaml").write_text("task: mine\nprocess_docs: !function utils.docs\n", encoding="utf-8")
    fifo(inc / "utils.py")
    one_line_exit_2(invoke, "run", "--model", "hf", "--tasks", "firsttoken", "--include-path", inc,
                    "--db", tmp_path / "e.duckdb", expect="utils.py in it is a FIFO")


def test_a_fifo_hf_gguf_file(invoke, tmp_path):
    fifo(tmp_path / "m" / "model.gguf")
    one_line_exit_2(invoke, "run", "--model", "hf", "--model-args", f"pretrained={tmp_path / 'm'},gguf_file=model.gguf",
                    "--tasks", "firsttoken", "--db", tmp_path / "e.duckdb", expect="model.gguf in it is a FIFO")
    fifo(tmp_path / "abs.gguf")  # an absolute gguf_file= outside the folder
    (tmp_path / "n").mkdir()
    one_line_exit_2(invoke, "run", "--model", "hf", "--model-args",
                    f"pretrained={tmp_path / 'n'},gguf_file={tmp_path / 'abs.gguf'}",
                    "--tasks", "firsttoken", "--db", tmp_path / "e.duckdb", expect="it is a FIFO")


def test_a_fifo_in_an_hf_model_folder(invoke, tiny_model_dir, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "config.json").unlink()
    fifo(folder / "config.json")
    one_line_exit_2(invoke, "run", "--model", "hf", "--model-args", f"pretrained={folder}", "--tasks", "firsttoken",
                    "--db", tmp_path / "e.duckdb", expect="config.json in it is a FIFO")


def test_a_fifo_server_tokenizer(invoke, tmp_path):
    tok = fifo(tmp_path / "tok.gguf")
    one_line_exit_2(invoke, "run", "--model", "server", "--model-args",
                    f"base_url=http://127.0.0.1:9/v1,tokenizer={tok}", "--tasks", "firsttoken",
                    "--db", tmp_path / "e.duckdb", expect="it is a FIFO")
    folder = tmp_path / "tokdir"
    fifo(folder / "tokenizer.json")
    one_line_exit_2(invoke, "run", "--model", "server", "--model-args",
                    f"base_url=http://127.0.0.1:9/v1,tokenizer={folder}", "--tasks", "firsttoken",
                    "--db", tmp_path / "e.duckdb", expect="tokenizer.json in it is a FIFO")


def test_a_fifo_llamacpp_model(invoke, tmp_path):
    pytest.importorskip("llama_cpp")
    model = fifo(tmp_path / "m.gguf")
    one_line_exit_2(invoke, "run", "--model", "llamacpp", "--model-args", f"model={model}", "--tasks", "firsttoken",
                    "--db", tmp_path / "e.duckdb", expect="it is a FIFO")


def test_a_fifo_weights_file_is_not_hashed(tmp_path):
    from evalkit.engines.plan import fingerprint

    folder = tmp_path / "m"
    (folder).mkdir()
    (folder / "a.safetensors").write_bytes(b"x")
    fifo(folder / "b.safetensors")
    with deadline(10):
        assert fingerprint({"pretrained": str(folder)}).startswith("sha256:")  # the FIFO is no weights file


def test_a_fifo_parquet_is_no_parquet_file(tmp_path):
    from evalkit.store.sandbox import is_parquet_file

    with deadline(10):
        assert not is_parquet_file(fifo(tmp_path / "t.parquet"))
