"""`engines.tokenizer_id`: one hash per vocabulary, the same for the same tokenizer however it is
loaded and set up, different for a permuted copy or other normalisation (tokenizers built in-process)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from evalkit.engines.tokenizer_id import identify, of_json

WORDS = ["[UNK]", "Paris", "London", "the", "capital", "is", "of", "France", "中", "国"]


def fast(vocab: dict[str, int], *, lowercase: bool = False, special: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    if special:
        wrapped.add_special_tokens({"additional_special_tokens": list(special)})
    return wrapped


def test_the_same_vocabulary_hashes_the_same_and_a_permuted_one_differently():
    vocab = {w: i for i, w in enumerate(WORDS)}
    permuted = {w: (i * 3 + 1) % len(WORDS) for i, w in enumerate(WORDS)}
    assert sorted(permuted.values()) == list(range(len(WORDS)))
    a, b, p = identify(fast(vocab), "hf a"), identify(fast(dict(vocab)), "hf b"), identify(fast(permuted), "hf p")
    assert a.hash == b.hash != p.hash
    assert a.source == "hf a: tokenizer.json" and len(a.hash) == 64


def test_settings_of_a_load_do_not_change_it_and_normalizer_and_added_tokens_do():
    vocab = {w: i for i, w in enumerate(WORDS)}
    base = fast(vocab)
    before = identify(base, "hf").hash
    base.backend_tokenizer.enable_truncation(max_length=4)
    base.backend_tokenizer.enable_padding(length=8)
    assert identify(base, "hf").hash == before
    assert identify(fast(vocab, lowercase=True), "hf").hash != before
    assert identify(fast(vocab, special=("<|im_end|>",)), "hf").hash != before


def test_a_tokenizer_json_round_trips_to_the_same_identity(tmp_path):
    tok = fast({w: i for i, w in enumerate(WORDS)})
    assert of_json(tok.backend_tokenizer.to_str()).hash == identify(tok, "x").hash


def test_an_object_that_is_no_tokenizer_is_refused():
    with pytest.raises(TypeError, match="cannot identify"):
        identify(object(), "x")


def test_a_run_stores_its_tokenizer_and_drift_refuses_another(tiny_model_dir, tmp_path, invoke):
    import json
    import shutil

    from transformers import AutoTokenizer

    from evalkit.store.db import open_reader

    db = tmp_path / "t.duckdb"
    common = ["--tasks", "firsttoken_en", "--limit", "1", "--device", "cpu", "--db", db]
    res = invoke("run", "--model-args", f"pretrained={tiny_model_dir}", "--keep-distributions", "--name", "base",
                 *common)
    assert res.exit_code == 0, res.output
    with open_reader(db) as con:
        stored = con.execute("SELECT tokenizer_hash, tokenizer_source FROM runs WHERE name = 'base'").fetchone()
    assert stored[0] == identify(AutoTokenizer.from_pretrained(tiny_model_dir), "x").hash
    assert stored[1] == f"transformers {tiny_model_dir}: tokenizer.json"

    # the same weights under a tokenizer with two ids swapped: the base's ids would name other texts
    other = tmp_path / "swapped"
    shutil.copytree(tiny_model_dir, other)
    data = json.loads((other / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    res = invoke("run", "--model-args", f"pretrained={other}", "--drift-base", "base", *common)
    assert res.exit_code == 2 and "needs the base's tokenizer" in res.output
    with open_reader(db) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == 1  # refused before its run row


def test_a_gguf_vocabulary_through_llama_cpp(default_model_available):
    pytest.importorskip("llama_cpp")
    from evalkit.engines.llamacpp.firststep import LlamaCppEngine
    from evalkit.engines.llamacpp.model import GGUFTokenizer
    from evalkit.engines.plan import DEFAULT_GGUF, default_model_dir

    path = str(default_model_dir() / DEFAULT_GGUF)
    first = identify(GGUFTokenizer(LlamaCppEngine(path, vocab_only=True)), "llama.cpp m")
    again = identify(GGUFTokenizer(LlamaCppEngine(path, vocab_only=True)), "llama.cpp m")
    assert first == again and first.source == "llama.cpp m: GGUF vocabulary"
