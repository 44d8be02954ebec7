"""Bad model files and unknown model args under `evalkit run --model hf`: one line, exit 2, no run
row, before the model loads.

The files are made here (a few-hundred-byte GGUF written with the `gguf` package, a copy of the
tiny random Llama with its config.json broken); nothing is downloaded.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest
from click.testing import CliRunner

from evalkit.engines import resolve as models
from evalkit.engines.transformers import resolve as hf_resolve
from evalkit.cli import cli


def write_gguf(path: Path, architecture: str) -> Path:
    """A GGUF file of one tiny tensor, its header naming `architecture`."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def run_hf(model_args: str, db: Path):
    return CliRunner().invoke(cli, ["run", "--tasks", "firsttoken", "--limit", "1", "--db", str(db),
                                    "--model", "hf", "--model-args", model_args], catch_exceptions=False)


def assert_refused(result, db: Path, *fragments: str) -> str:
    """Exit 2, one line on stderr holding each fragment, and no run row in the DB."""
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.stderr + result.stdout
    assert len(lines) == 1 and lines[0].startswith("evalkit: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    if db.exists():
        con = duckdb.connect(str(db), read_only=True)
        try:
            assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 0
        finally:
            con.close()
    return lines[0]


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if the model is loaded: every refusal here comes before the load."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load", load)


def broken_copy(tiny_model_dir: Path, tmp_path: Path, config_text: str) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "config.json").write_text(config_text, encoding="utf-8")
    return folder


def test_truncated_gguf(tmp_path, no_load):
    whole = write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[: len(whole) - 40])
    line = assert_refused(run_hf(f"pretrained={tmp_path},gguf_file=cut.gguf", tmp_path / "e.duckdb"),
                          tmp_path / "e.duckdb", str(tmp_path / "cut.gguf"), "not a readable GGUF file")
    assert "Traceback" not in line


def test_truncated_gguf_header(tmp_path, no_load):
    whole = write_gguf(tmp_path / "whole.gguf", "llama").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:30])
    assert_refused(run_hf(f"pretrained={tmp_path},gguf_file=cut.gguf", tmp_path / "e.duckdb"),
                   tmp_path / "e.duckdb", str(tmp_path / "cut.gguf"), "not a readable GGUF file")


def test_text_file_named_gguf(tmp_path, no_load):
    (tmp_path / "notes.gguf").write_text("this is not a model\n", encoding="utf-8")
    assert_refused(run_hf(f"pretrained={tmp_path},gguf_file=notes.gguf", tmp_path / "e.duckdb"),
                   tmp_path / "e.duckdb", str(tmp_path / "notes.gguf"), "GGUF magic invalid")


def test_gguf_given_as_pretrained(tmp_path, no_load):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    assert_refused(run_hf(f"pretrained={path}", tmp_path / "e.duckdb"), tmp_path / "e.duckdb",
                   str(path), "gguf_file=")


def test_gguf_of_unknown_architecture(tmp_path, no_load):
    write_gguf(tmp_path / "m.gguf", "nosucharch")
    assert_refused(run_hf(f"pretrained={tmp_path},gguf_file=m.gguf", tmp_path / "e.duckdb"),
                   tmp_path / "e.duckdb", str(tmp_path / "m.gguf"), "'nosucharch'")


def test_gguf_of_a_model_that_is_not_causal(tmp_path, no_load):
    write_gguf(tmp_path / "m.gguf", "t5")
    assert_refused(run_hf(f"pretrained={tmp_path},gguf_file=m.gguf", tmp_path / "e.duckdb"),
                   tmp_path / "e.duckdb", str(tmp_path / "m.gguf"), "not a causal language model")


def test_config_json_that_is_not_json(tiny_model_dir, tmp_path, no_load):
    folder = broken_copy(tiny_model_dir, tmp_path, '{"model_type": "llama",')
    assert_refused(run_hf(f"pretrained={folder}", tmp_path / "e.duckdb"), tmp_path / "e.duckdb",
                   str(folder / "config.json"), "is not JSON")


def test_unknown_architecture(tiny_model_dir, tmp_path, no_load):
    folder = broken_copy(tiny_model_dir, tmp_path, '{"model_type": "nosucharch"}')
    assert_refused(run_hf(f"pretrained={folder}", tmp_path / "e.duckdb"), tmp_path / "e.duckdb",
                   str(folder), "nosucharch")


def test_architecture_that_is_not_causal(tiny_model_dir, tmp_path, no_load):
    folder = broken_copy(tiny_model_dir, tmp_path, '{"model_type": "t5"}')
    assert_refused(run_hf(f"pretrained={folder}", tmp_path / "e.duckdb"), tmp_path / "e.duckdb",
                   str(folder), "'t5' model is not a causal language model")


def test_empty_model_folder(tmp_path, no_load):
    folder = tmp_path / "empty"
    folder.mkdir()
    assert_refused(run_hf(f"pretrained={folder}", tmp_path / "e.duckdb"), tmp_path / "e.duckdb",
                   str(folder), "no config.json")


def test_folder_of_a_gguf_without_gguf_file(tmp_path, no_load):
    write_gguf(tmp_path / "m.gguf", "llama")
    assert_refused(run_hf(f"pretrained={tmp_path}", tmp_path / "e.duckdb"), tmp_path / "e.duckdb",
                   str(tmp_path), "gguf_file=m.gguf")


def test_missing_gguf_file(tiny_model_dir, tmp_path, no_load):
    assert_refused(run_hf(f"pretrained={tmp_path},gguf_file=gone.gguf", tmp_path / "e.duckdb"),
                   tmp_path / "e.duckdb", str(tmp_path / "gone.gguf"), "not found")


def test_unknown_model_arg_is_refused_before_the_load(tiny_model_dir, tmp_path, no_load):
    hf_resolve.hf_model_keys()  # the imports (torch, lm-eval) the load would make anyway
    start = time.monotonic()
    result = run_hf(f"pretrained={tiny_model_dir},attn_implmentation=eager", tmp_path / "e.duckdb")
    elapsed = time.monotonic() - start
    assert_refused(result, tmp_path / "e.duckdb", "'attn_implmentation'", "did you mean attn_implementation?")
    assert elapsed < 5, elapsed
    result = run_hf(f"pretrained={tiny_model_dir},foo=bar", tmp_path / "e.duckdb")
    assert_refused(result, tmp_path / "e.duckdb", "unknown --model-args key 'foo'")


def test_unknown_model_arg_of_the_embedded_model(tmp_path, no_load, default_model_available):
    assert_refused(run_hf("foo=bar", tmp_path / "e.duckdb"), tmp_path / "e.duckdb",
                   "unknown --model-args key 'foo'")


def test_the_keys_hflm_passes_on_to_from_pretrained_stay_accepted(tiny_model_dir):
    """HFLM's own parameters, evalkit-hf's, from_pretrained's (named or read out of its **kwargs)
    and the model config's attributes all pass the check; only the rest is refused."""
    import inspect

    from lm_eval.models.huggingface import HFLM

    from evalkit.engines.transformers.model import EvalkitHFLM

    keys = hf_resolve.hf_model_keys()
    for cls in (HFLM, EvalkitHFLM):
        named = {p.name for p in inspect.signature(cls.__init__).parameters.values()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)} - {"self"}
        assert named <= keys, named - keys
    assert {"attn_implementation", "device_map", "revision", "local_files_only", "dtype", "load_in_4bit"} <= keys
    args = {"pretrained": str(tiny_model_dir), "attn_implementation": "eager", "device_map": "cpu",
            "use_cache": False, "tie_word_embeddings": False, "trust_remote_code": False}
    hf_resolve.check_hf_model(args)  # use_cache, tie_word_embeddings: the config's own attributes
    plan = models.resolve("hf", f"pretrained={tiny_model_dir},attn_implementation=eager,use_cache=false")
    assert plan.args["attn_implementation"] == "eager"


# ---- the remembered name lists (evalkit/memo.py): the same decisions, without the imports ----


def _decision(args: dict) -> str | None:
    from evalkit.errors import BadInput

    try:
        hf_resolve.check_hf_model(args)
    except BadInput as exc:
        return str(exc)
    return None


def test_remembered_names_decide_as_the_imports_do(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    base = {"pretrained": str(tiny_model_dir)}
    config = hf_resolve.model_config(base)
    known = hf_resolve.hf_model_keys()
    keys = ["attn_implementation", "device_map", "revision", "dtype", "use_cache", "tie_word_embeddings",
            "hidden_size", "num_attention_heads", "to_dict", "torch_dtype", "foo", "attn_implmentation", "_private"]
    for key in keys:
        expected = key in known or hasattr(config, key)
        first = _decision({**base, key: 1})  # computes and keeps the lists
        again = _decision({**base, key: 1})  # reads them back
        assert (first is None) == expected and (again is None) == expected, (key, first, again)
        assert first == again
    kept = sorted((tmp_path / "cache" / "names").glob("*.json"))
    assert [p.name.split("-")[1] for p in kept] == ["config", "model"], kept


def test_a_changed_config_file_is_read_again(tiny_model_dir, tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    args = {"pretrained": str(folder), "my_extra_flag": 1}
    assert "my_extra_flag" in (_decision(args) or "")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    (folder / "config.json").write_text(json.dumps({**config, "my_extra_flag": True}), encoding="utf-8")
    assert _decision(args) is None  # the config now has the attribute: its new stamp misses the kept list


def test_a_kept_list_that_does_not_read_is_computed_again(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    args = {"pretrained": str(tiny_model_dir), "foo": 1}
    assert "'foo'" in (_decision(args) or "")
    for path in (tmp_path / "cache" / "names").glob("*.json"):
        path.write_text('{"identity": "someone else", "names": ["foo"]}', encoding="utf-8")
    assert "'foo'" in (_decision(args) or "")  # a planted list does not make 'foo' a key
    for path in (tmp_path / "cache" / "names").glob("*.json"):
        path.write_bytes(b"\xff\x00 not json")
    assert "'foo'" in (_decision({**args}) or "")
    assert _decision({"pretrained": str(tiny_model_dir), "use_cache": False}) is None


def test_with_the_cache_off_nothing_is_kept(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("EVALKIT_CACHE", "none")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert "'foo'" in (_decision({"pretrained": str(tiny_model_dir), "foo": 1}) or "")
    assert not (tmp_path / "xdg").exists()


def test_a_remembered_refusal_imports_neither_torch_nor_transformers(tiny_model_dir, tmp_path):
    """The point of the lists: a second run refuses a bad key before the seconds of imports."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "EVALKIT_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(Path(__file__).parents[1])}
    code = ("import sys\nfrom evalkit.engines.transformers import resolve as hf_resolve\nfrom evalkit.errors import BadInput\n"
            f"try:\n    hf_resolve.check_hf_model({{'pretrained': {str(tiny_model_dir)!r}, 'foo': 1}})\n"
            "except BadInput as exc:\n    print('refused', exc)\n"
            "print('heavy', sorted(m for m in ('torch', 'transformers', 'lm_eval') if m in sys.modules))\n")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "refused unknown --model-args key 'foo'" in first.stdout, first.stderr
    assert "heavy ['lm_eval', 'torch', 'transformers']" in first.stdout
    assert "refused unknown --model-args key 'foo'" in again.stdout and "heavy []" in again.stdout, again.stdout


def test_a_gguf_s_tensor_types_are_read_once_per_file(tmp_path, monkeypatch):
    """The run row's gguf_tensor_types parse the whole GGUF; they are kept for the file as it is: read
    back the next time, read again once the file changes or the kept list does not read."""
    import os

    from evalkit.engines.transformers import quantdetail

    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", "llama")
    parsed: list[str] = []
    parse = quantdetail._gguf_tensor_types
    monkeypatch.setattr(quantdetail, "_gguf_tensor_types", lambda p: parsed.append(str(p)) or parse(p))
    assert quantdetail.gguf_tensor_types(path) == {"F32": 1}
    assert quantdetail.gguf_tensor_types(path) == {"F32": 1} and len(parsed) == 1  # read back, not parsed
    (kept,) = (tmp_path / "cache" / "names").glob("gguf-tensor-types-*.json")
    kept.write_text(kept.read_text().replace('"F32": 1', '"F32": "many"'), encoding="utf-8")
    assert quantdetail.gguf_tensor_types(path) == {"F32": 1} and len(parsed) == 2  # not a count: parsed again
    os.utime(path, ns=(0, 12345))
    assert quantdetail.gguf_tensor_types(path) == {"F32": 1} and len(parsed) == 3  # another stamp: parsed again
    monkeypatch.setenv("EVALKIT_CACHE", "none")
    assert quantdetail.gguf_tensor_types(path) == {"F32": 1} and len(parsed) == 4
    assert quantdetail.gguf_tensor_types(tmp_path / "missing.gguf") is None
