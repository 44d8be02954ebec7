"""The converted-model cache checks what it reads against what it wrote (`convert.changed`).

Fast tests run the real `convert` with transformers' GGUF loading swapped for the tiny random
Llama (the "GGUF" is a few bytes naming the cache folder); one slow test converts the packaged
SmolLM2, zeroes a tensor of the cached safetensors and checks that the next load converts it
again, to the same logits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from evalkit.engines.transformers import convert
from evalkit.errors import BadInput

WEIGHTS = "model.safetensors"


def zero_one_tensor(folder: Path) -> str:
    """Zero the first tensor of the folder's safetensors with the `safetensors` library; its name."""
    tensors = load_file(folder / WEIGHTS)
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})
    return name


@pytest.fixture
def written(tiny_model_dir, tmp_path) -> Path:
    """A copy of the tiny model with its manifest, as `convert` leaves a folder."""
    folder = tmp_path / "converted"
    shutil.copytree(tiny_model_dir, folder)
    convert.write_manifest(folder)
    (folder / convert.DONE).write_text("converted\n", encoding="utf-8")
    return folder


def test_the_manifest_records_each_file(written):
    files = json.loads((written / convert.MANIFEST).read_text(encoding="utf-8"))["files"]
    assert sorted(files) == sorted(p.name for p in written.iterdir() if p.name not in (convert.MANIFEST, convert.DONE))
    for name, rec in files.items():
        st = (written / name).stat()
        assert rec == {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "sha256": hashlib.sha256((written / name).read_bytes()).hexdigest()}
    assert convert.changed(written) is None


def test_a_zeroed_tensor_is_caught(written):
    zero_one_tensor(written)
    assert convert.changed(written) == f"{WEIGHTS} changed since it was written"


def test_a_rewrite_that_keeps_size_and_mtime_is_caught(written):
    """Every load rehashes: bytes changed in place with the size and mtime_ns put back are caught."""
    path = written / WEIGHTS
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert convert.changed(written) == f"{WEIGHTS} changed since it was written"


def test_a_changed_config_is_caught(written):
    config = json.loads((written / "config.json").read_text(encoding="utf-8"))
    config["rms_norm_eps"] = 0.5
    (written / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert convert.changed(written) == "config.json changed since it was written"


def test_an_extra_file_is_caught(written):
    (written / "extra.safetensors").write_bytes(b"x")
    assert convert.changed(written) == "extra.safetensors was added"


def test_a_missing_file_is_caught(written):
    (written / "tokenizer.json").unlink()
    assert convert.changed(written) == "tokenizer.json is missing"


def test_a_deleted_or_unreadable_manifest_is_caught(written):
    (written / convert.MANIFEST).write_text("{not json", encoding="utf-8")
    assert convert.changed(written) == f"{convert.MANIFEST} is unreadable"
    (written / convert.MANIFEST).unlink()
    assert convert.changed(written) == f"{convert.MANIFEST} is missing"


@pytest.fixture
def fake_gguf(tiny_model_dir, tmp_path, monkeypatch):
    """A "GGUF" file that transformers (swapped) loads as the tiny model, and a count of the
    conversions `cached_args` makes of it, in a cache of this test's own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.tiny import load_tiny

    tiny_model, tiny_tokenizer = load_tiny(tiny_model_dir)
    loads = []

    def model(*args, **kwargs):
        loads.append(kwargs.get("gguf_file"))
        return tiny_model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer)
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "models" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"a stand-in for a GGUF file")
    return gguf, loads


def test_a_changed_folder_is_converted_again(fake_gguf, tiny_model_dir, caplog):
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    gguf, loads = fake_gguf
    args = {"pretrained": str(gguf.parent), "gguf_file": gguf.name}
    folder = Path(convert.cached_args(args)["pretrained"])
    assert loads == ["m.gguf"] and convert.changed(folder) is None
    manifest = (folder / convert.MANIFEST).read_text(encoding="utf-8")
    assert convert.cached_args(args)["pretrained"] == str(folder) and len(loads) == 1  # unchanged: read as it is

    zero_one_tensor(folder)
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        assert convert.cached_args(args)["pretrained"] == str(folder)
    assert len(loads) == 2
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("evalkit")]
    assert warnings == [f"evalkit: {folder}/{WEIGHTS} changed since it was written; converting again"]
    assert convert.changed(folder) is None
    rebuilt = json.loads((folder / convert.MANIFEST).read_text(encoding="utf-8"))["files"]
    assert {n: r["sha256"] for n, r in rebuilt.items()} == \
        {n: r["sha256"] for n, r in json.loads(manifest)["files"].items()}
    # the concrete classes: the Auto classes are the fixture's stand-ins
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    reference = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    ids = torch.tensor([tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.parametrize("tamper", ["extra file", "deleted manifest", "changed config.json", "no manifest at all"])
def test_each_change_has_the_folder_converted_again(fake_gguf, tamper, caplog):
    gguf, loads = fake_gguf
    args = {"pretrained": str(gguf.parent), "gguf_file": gguf.name}
    folder = Path(convert.cached_args(args)["pretrained"])
    if tamper == "extra file":
        (folder / "adapter_model.safetensors").write_bytes(b"x")
    elif tamper == "deleted manifest":
        (folder / convert.MANIFEST).unlink()
    elif tamper == "changed config.json":
        text = (folder / "config.json").read_text(encoding="utf-8")
        (folder / "config.json").write_text(text.replace('"rms_norm_eps"', '"rms_norm_eps": 0.5, "x"'),
                                            encoding="utf-8")
    else:  # a folder an older evalkit converted: DONE, no manifest
        (folder / convert.MANIFEST).unlink()
        (folder / "config.json").touch()
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        convert.cached_args(args)
    assert len(loads) == 2 and convert.changed(folder) is None
    assert not (folder / "adapter_model.safetensors").exists()
    assert len([r for r in caplog.records if "converting again" in r.getMessage()]) == 1


def test_a_changed_folder_that_cannot_be_rewritten_is_refused(fake_gguf, monkeypatch):
    gguf, loads = fake_gguf
    args = {"pretrained": str(gguf.parent), "gguf_file": gguf.name}
    folder = Path(convert.cached_args(args)["pretrained"])
    zero_one_tensor(folder)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(convert, "convert", read_only)
    with pytest.raises(BadInput, match="cannot write the converted-model cache"):
        convert.cached_args(args)


@pytest.mark.slow
def test_the_default_model_converted_again_after_a_zeroed_tensor(default_model_available, tmp_path, monkeypatch,
                                                                  caplog):
    """The adversarial case on the real model: one tensor of the cached safetensors zeroed; the next
    load names the file, converts the GGUF again, and the model gives a fresh conversion's logits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see test_integration_smollm2.one_thread
    try:
        _convert_tamper_reconvert(tmp_path, monkeypatch, caplog)
    finally:
        torch.set_num_threads(threads)


def _convert_tamper_reconvert(tmp_path, monkeypatch, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evalkit.engines.plan import default_model_args

    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    folder = Path(convert.cached_args(default_model_args())["pretrained"])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tokenizer("What is the capital of France?", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        fresh = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits
    zero_one_tensor(folder)
    with caplog.at_level(logging.WARNING, logger="evalkit"):
        assert convert.cached_args(default_model_args())["pretrained"] == str(folder)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("evalkit")] == \
        [f"evalkit: {folder}/{WEIGHTS} changed since it was written; converting again"]
    with torch.no_grad():
        assert torch.equal(AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits, fresh)
