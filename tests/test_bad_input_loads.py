"""Bad model and tokenizer files, and values Python half-reads: one line, exit 2, DB untouched.

Each case goes through the CLI. The rules that hold them, one place each:
- `engines.plan._typed`: a `--model-args` value is a number only when written in ASCII
  (`str.isnumeric()` takes "²" and "½", which `int()` does not); whole numbers elsewhere
  (`--kv-cache`, batch sizes) are read from ASCII digits only;
- `engines.plan.parse_model_args`: a quoted value is refused (the shell's quotes belong around
  the whole option);
- `loaderrors.loading`: every exception a library raises loading a user's model or tokenizer
  (a config.json field of the wrong type, a tokenizer file that is not one, an unknown dtype, a
  model type missing its optional packages) is one BadInput line naming the path, around every
  engine's load (`engines.resolve.load`) and the hf config read;
- the server resolver: `tokenizer=` a .gguf whose header reads, or a folder holding a tokenizer;
- `store.db.open_waiting` (`paths.utf8_path`): a DB path DuckDB cannot take.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.fuzz import error_lines

ARGS = ["--tasks", "firsttoken", "--limit", "1"]


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(invoke, tmp_path, *args, expect: str, env=None) -> str:
    dbdir = tmp_path / "dbs"
    dbdir.mkdir(exist_ok=True)
    before = snapshot(dbdir)
    res = invoke(*[str(a) for a in args], "--db", dbdir / "evalkit.duckdb", env=env)
    lines = error_lines(res.stderr)  # a model load's progress line may precede the error
    shown = f"\n--- stderr ---\n{res.stderr}--- stdout ---\n{res.stdout}"
    assert res.exit_code == 2, f"exit {res.exit_code}{shown}"
    assert len(lines) == 1 and lines[0].startswith("evalkit: error: "), shown
    assert "Traceback" not in res.output + res.stderr and "internal error" not in res.stderr, shown
    assert expect in lines[0], shown
    assert snapshot(dbdir) == before, f"the DB folder changed{shown}"
    return lines[0]


def hf(folder, extra=""):
    return ["run", "--model", "hf", "--model-args", f"pretrained={folder}{extra}", *ARGS]


@pytest.mark.parametrize("value", ["²", "½", "١٢", "٣", "Ⅻ", "一"])
def test_unicode_numerals_in_model_args(invoke, tiny_model_dir, tmp_path, value):
    one_line(invoke, tmp_path, *hf(tiny_model_dir, f",answer_max_tokens={value}"),
             expect=f"answer_max_tokens must be a whole number from 0 to 4096, got {value!r}")
    one_line(invoke, tmp_path, "run", "--model", "server", "--model-args",
             f"base_url=http://127.0.0.1:9/v1,tokenizer={tiny_model_dir},top_logprobs={value}", *ARGS,
             expect=f"top_logprobs must be a whole number")
    one_line(invoke, tmp_path, "run", "--model", "hf", "--kv-cache", f"window:{value}", "--model-args",
             f"pretrained={tiny_model_dir}", *ARGS, expect="must be a whole number")


def test_the_typed_values_are_lm_evals_for_ascii():
    from evalkit.engines.plan import parse_model_args

    assert parse_model_args("a=8,b=0.5,c=true,d=x,e=²,f=1e3,g=-2") == \
        {"a": 8, "b": 0.5, "c": True, "d": "x", "e": "²", "f": 1000.0, "g": -2.0}


@pytest.mark.parametrize("dtype", ["", "float77", "torch.float16x"])
def test_an_empty_or_unknown_dtype(invoke, tiny_model_dir, tmp_path, dtype):
    one_line(invoke, tmp_path, *hf(tiny_model_dir, f",dtype={dtype}"), expect=f"cannot load the model")


@pytest.mark.parametrize("quote", ["'", '"'])
def test_a_quoted_path(invoke, tiny_model_dir, tmp_path, quote):
    one_line(invoke, tmp_path, *hf(f"{quote}{tiny_model_dir}{quote}"), expect="the quotes are part of the value")


@pytest.mark.parametrize("field, value", [("hidden_size", [1]), ("num_hidden_layers", "two"),
                                          ("vocab_size", None), ("rms_norm_eps", {"a": 1})])
def test_a_config_with_a_field_of_the_wrong_type(invoke, tiny_model_dir, tmp_path, field, value):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    (folder / "config.json").write_text(json.dumps({**config, field: value}), encoding="utf-8")
    line = one_line(invoke, tmp_path, *hf(folder), expect=str(folder))
    assert "cannot load" in line or "config" in line


@pytest.mark.parametrize("content", [b'{"model": 5}', b"not json at all", b"\xff\xfe\x00", b"[]"])
def test_a_tokenizer_file_that_is_not_one(invoke, tiny_model_dir, tmp_path, content):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "tokenizer.json").write_bytes(content)
    one_line(invoke, tmp_path, *hf(folder), expect=f"cannot load the model model {folder}")


def _server(tok) -> list[str]:
    return ["run", "--model", "server", "--model-args", f"base_url=http://127.0.0.1:9/v1,tokenizer={tok}", *ARGS]


def test_a_server_tokenizer_that_is_an_empty_folder_or_a_device(invoke, tmp_path):
    (tmp_path / "empty").mkdir()
    one_line(invoke, tmp_path, *_server(tmp_path / "empty"), expect="holds no tokenizer")
    one_line(invoke, tmp_path, *_server("/dev/zero"), expect="a character device")


def _gguf_header(n_kv: int = 1) -> bytes:
    import struct

    key = b"general.architecture"
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + struct.pack("<Q", len(key)) + key
            + struct.pack("<I", 8) + struct.pack("<Q", 5) + b"llama")


def _gguf_key_past_any_file() -> bytes:
    import struct

    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**63)  # a key 2**63 bytes long


@pytest.mark.parametrize("content", [os.urandom(4096), b"GGUF" + os.urandom(60), _gguf_header(3), b"GGUF", b"",
                                     _gguf_key_past_any_file()])
def test_a_server_tokenizer_gguf_that_is_truncated_or_random(invoke, tmp_path, content):
    path = tmp_path / "tok.gguf"
    path.write_bytes(content)
    one_line(invoke, tmp_path, *_server(path), expect=str(path))


@pytest.mark.skipif(importlib.util.find_spec("tenacity") is not None, reason="lm-eval's API extras are installed")
def test_an_api_model_without_its_optional_packages(invoke, tmp_path):
    line = one_line(invoke, tmp_path, "run", "--model", "local-completions", "--model-args",
                    "base_url=http://127.0.0.1:9/v1/completions,model=m", *ARGS,
                    expect="needs a package that is not installed")
    assert "tenacity" in line


def test_a_db_path_with_a_byte_that_is_not_utf8(invoke, tmp_path):
    db = os.fsdecode(os.fsencode(str(tmp_path)) + b"/a\xffb.duckdb")
    for args in (["runs"], ["run", "--model", "evalkit-fake", "--model-args", "mode=hit", *ARGS]):
        res = invoke(*args, "--db", db)
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1, res.stderr
        assert "holds a byte that is not UTF-8" in lines[0] and "a\\xffb.duckdb" in lines[0], lines
    assert os.listdir(tmp_path) == []


# ---- a server's text fields (`engines.server.client.check_text`, called by `completion`) --------------

ODD_STRINGS = {"lone high surrogate": "\ud800", "lone low surrogate in a word": "ab\udfffc", "NUL": "\x00",
               "NUL in a word": "Par\x00is", "U+FFFD": "\ufffd", "U+FFFD in a word": "caf\ufffd",
               "1 MB token": "a" * 1_000_000}


def _odd_answer(field: str, odd: str):
    from tests.fake_server import Reply, completion

    def answer(method, path, body):
        if path == "/models":
            return Reply({"object": "list", "data": [{"id": "odd-model"}]})
        good = completion("Paris", {"Paris": -0.1, "London": -2.5}, offset=len((body or {}).get("prompt", "")))
        choice = good["choices"][0]
        if field == "text":
            choice["text"] = odd
        elif field == "tokens":
            choice["logprobs"]["tokens"] = [odd]
        else:
            choice["logprobs"]["top_logprobs"] = [{"Paris": -0.1, odd: -2.5}]
        return Reply(good)

    return answer


@pytest.mark.parametrize("kind", list(ODD_STRINGS))
@pytest.mark.parametrize("field", ["top_logprobs key", "text", "tokens"])
def test_a_server_text_field_holding_an_odd_string(invoke, tiny_model_dir, tmp_path, field, kind):
    """Each ends in one line naming the server, the field and the token: the run's error, never a
    library's TypeError."""
    import duckdb

    from tests.fake_server import FakeServer

    odd = ODD_STRINGS[kind]
    db = tmp_path / "odd.duckdb"
    with FakeServer(_odd_answer(field, odd)) as url:
        res = invoke("run", "--model", "server", "--model-args",
                     f"base_url={url},tokenizer={tiny_model_dir},retries=0,timeout=10,top_logprobs=2",
                     "--tasks", "firsttoken_en", "--limit", 1, "--db", db)
    lines = [line for line in error_lines(res.stderr) if not line.startswith("run ")]  # "run ID started"
    assert res.exit_code == 1 and len(lines) == 1, res.stderr[-2000:]
    line = lines[0]
    assert line.startswith("evalkit: error: ") and url in line and "the server's" in line, line
    where = {"text": "completion text", "tokens": "logprobs.tokens[0]",
             "top_logprobs key": "logprobs.top_logprobs[0] key"}[field]
    assert where in line, line
    assert "TypeError" not in res.stderr and "Traceback" not in res.stderr and len(line) < 1000
    con = duckdb.connect(str(db), read_only=True)
    error, = con.execute("SELECT error FROM runs").fetchone()
    con.close()
    assert where in error and "TypeError" not in error, error
