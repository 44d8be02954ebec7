"""The batch, position and trie caps derived from a memory budget and a model's shapes (`engines.caps`)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from evalkit import defaults
from evalkit.engines import caps
from evalkit.engines.caps import Caps, Shapes, derive

SMOLLM2_135M = Shapes(layers=30, kv_heads=3, head_dim=64, hidden=576, intermediate=1536, vocab=49152, dtype_bytes=4)
QWEN25_05B = Shapes(layers=24, kv_heads=2, head_dim=64, hidden=896, intermediate=4864, vocab=151936, dtype_bytes=4)
LLAMA32_1B = Shapes(layers=16, kv_heads=8, head_dim=64, hidden=2048, intermediate=8192, vocab=128256, dtype_bytes=4)
GEMMA3_270M = Shapes(layers=18, kv_heads=1, head_dim=256, hidden=640, intermediate=2048, vocab=262144, dtype_bytes=4)
LLAMA31_8B_BF16 = Shapes(layers=32, kv_heads=8, head_dim=128, hidden=4096, intermediate=14336, vocab=128256,
                         dtype_bytes=2)


def test_the_default_model_under_the_default_budget_keeps_its_measured_caps():
    """32 prompts, 4608 padded positions and 512-position trie levels were measured on SmolLM2-135M in
    fp32 to keep the whole suite under 2 GB; the derivation gives them back."""
    from evalkit.engines.transformers import firststep

    got = derive(SMOLLM2_135M, defaults.MEMORY_BUDGET)
    assert (got.batch_prompts, got.batch_positions, got.trie_positions) == (
        defaults.DEFAULT_BATCH_SIZE, defaults.BATCH_TOKENS, firststep.TRIE_POSITIONS) == (32, 4608, 512)


@pytest.mark.parametrize("shapes, expected", [
    # bytes a position / a trie position: 97,280 / 705,024; 73,728-byte positions for SmolLM2
    (QWEN25_05B, (24, 3584, 128)),
    # 65,536 + 131,072 = 196,608 bytes a position -> 1,820 -> 1,536; trie 709,632 -> 252 -> 128
    (LLAMA32_1B, (10, 1536, 128)),
    # 36,864 + 34,816 = 71,680 -> 4,993 -> 4,608; trie 1,120,256 -> 159 -> 128
    (GEMMA3_270M, (32, 4608, 128)),
    # 131,072 + 2 x (16,384 + 43,008) = 249,856 -> 1,432 -> 1,024; trie 762,880 -> 234 -> 128
    (LLAMA31_8B_BF16, (7, 1024, 128)),
])
def test_worked_numbers(shapes, expected):
    got = derive(shapes)
    assert (got.batch_prompts, got.batch_positions, got.trie_positions) == expected


def test_caps_shrink_as_the_model_grows_and_grow_with_the_budget():
    base = derive(SMOLLM2_135M)
    deeper = derive(dataclasses.replace(SMOLLM2_135M, layers=60))
    wider_vocab = derive(dataclasses.replace(SMOLLM2_135M, vocab=262144))
    assert deeper.batch_positions < base.batch_positions and deeper.batch_prompts < base.batch_prompts
    # the vocabulary prices the trie's logits, not the batch's positions
    assert wider_vocab.trie_positions < base.trie_positions
    assert wider_vocab.batch_positions == base.batch_positions
    bigger = derive(SMOLLM2_135M, 8 * defaults.MEMORY_BUDGET)
    assert bigger.batch_positions >= 8 * base.batch_positions - caps.POSITION_STEP
    assert bigger.trie_positions == 8 * base.trie_positions
    assert bigger.batch_prompts == bigger.batch_positions // caps.PROMPT_POSITIONS


def test_the_caps_fit_their_shares_of_the_budget():
    for shapes in (SMOLLM2_135M, QWEN25_05B, LLAMA32_1B, GEMMA3_270M, LLAMA31_8B_BF16):
        for budget in (2**26, 2**30, 80 * 2**30):
            got = derive(shapes, budget)
            assert got.batch_positions * shapes.position_bytes <= budget * caps.POSITION_SHARE
            assert got.trie_positions * shapes.trie_bytes <= budget * caps.TRIE_SHARE or got.trie_positions == 1
            assert 1 <= got.batch_prompts <= defaults.MAX_BATCH_SIZE
            assert got.batch_prompts * caps.ROW_COPIES * caps.LOGIT_BYTES * shapes.vocab <= budget * caps.ROW_SHARE


def test_an_explicit_batch_size_is_kept_and_the_positions_still_derived():
    got = derive(LLAMA32_1B, batch_prompts=64)
    assert got == Caps(batch_prompts=64, batch_positions=1536, trie_positions=128, budget=defaults.MEMORY_BUDGET)


def test_a_budget_too_small_for_one_step_still_gives_a_batch():
    got = derive(LLAMA31_8B_BF16, budget=2**20)
    assert got.batch_prompts == 1 and got.batch_positions == 1 and got.trie_positions == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_budgets_and_batches_are_refused(bad):
    with pytest.raises(ValueError, match="budget"):
        derive(SMOLLM2_135M, bad)  # type: ignore[arg-type]
    if bad is not None:
        with pytest.raises(ValueError, match="batch_prompts"):
            derive(SMOLLM2_135M, batch_prompts=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Shapes.vocab"):
        dataclasses.replace(SMOLLM2_135M, vocab=bad)  # type: ignore[arg-type]


def test_shapes_are_read_off_a_loaded_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assert caps.shapes_of(model) == Shapes(layers=3, kv_heads=2, head_dim=16, hidden=64, intermediate=96, vocab=300,
                                           dtype_bytes=4)
    model = model.to(torch.bfloat16)
    assert caps.shapes_of(model).dtype_bytes == 2
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=None, head_dim=32, vocab_size=300)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    shapes = caps.shapes_of(model)
    assert (shapes.kv_heads, shapes.head_dim) == (4, 32)  # no KV heads given: as many as heads


def _run_row(db) -> dict:
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    try:
        cur = con.execute("SELECT * FROM runs")
        return dict(zip([d[0] for d in cur.description], cur.fetchone()))
    finally:
        con.close()


@pytest.mark.parametrize("asked", ["auto", "3"])
def test_a_run_stores_the_caps_it_ran_under(invoke, tiny_model_dir, tmp_path, asked):
    """`--batch-size auto` derives the prompts a batch from the model's shapes (lm-eval never searches for
    one); a number is kept. Either way the run row holds the caps and `evalkit show` prints them."""
    from transformers import AutoModelForCausalLM

    db = tmp_path / "runs.duckdb"
    res = invoke("run", "--model", "hf", "--model-args", f"pretrained={tiny_model_dir}", "--device", "cpu",
                 "--tasks", "firsttoken_en", "--limit", "2", "--batch-size", asked, "--db", db)
    assert res.exit_code == 0, res.output
    expected = derive(caps.shapes_of(AutoModelForCausalLM.from_pretrained(tiny_model_dir)), defaults.MEMORY_BUDGET,
                      None if asked == "auto" else int(asked))
    row = _run_row(db)
    assert (row["batch_size"], row["batch_positions"], row["trie_positions"], row["memory_budget"]) == (
        expected.batch_prompts, expected.batch_positions, expected.trie_positions, defaults.MEMORY_BUDGET)
    assert row["batch_size"] == (expected.batch_prompts if asked == "auto" else 3)
    assert json.loads(row["config"])["batch_size"] == (asked if asked == "auto" else 3)
    shown = invoke("show", "latest", "--db", db).stdout
    assert re.search(rf"batch_positions: {expected.batch_positions}\n", shown), shown
    assert re.search(rf"trie_positions: {expected.trie_positions}\n", shown), shown


@pytest.mark.parametrize("bad", ["automatic", "0", "auto:4", "4097"])
def test_a_batch_size_neither_whole_nor_auto_is_one_line(invoke, tmp_path, bad):
    res = invoke("run", "--model", "evalkit-fake", "--tasks", "firsttoken", "--batch-size", bad,
                 "--db", tmp_path / "r.duckdb")
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--batch-size" in lines[0] and "auto" in lines[0], res.stderr
    assert not (tmp_path / "r.duckdb").exists()


def test_the_library_takes_auto_and_refuses_other_text():
    from evalkit.errors import BadInput
    from evalkit.runner.config import RunConfig, _check_numbers

    _check_numbers(RunConfig(tasks=["firsttoken"], batch_size="auto"))
    with pytest.raises(BadInput, match="--batch-size must be a whole number from 1 to 4096 or 'auto'"):
        _check_numbers(RunConfig(tasks=["firsttoken"], batch_size="big"))  # type: ignore[arg-type]


def test_a_fake_backend_run_with_auto_stores_no_caps(invoke, tmp_path):
    """A backend without caps (here the fake LM) leaves them NULL and batch_size NULL under auto."""
    db = tmp_path / "runs.duckdb"
    res = invoke("run", "--model", "evalkit-fake", "--tasks", "firsttoken", "--limit", "1", "--batch-size", "auto",
                 "--db", db)
    assert res.exit_code == 0, res.output
    row = _run_row(db)
    assert (row["batch_size"], row["batch_positions"], row["trie_positions"], row["memory_budget"]) == (
        None, None, None, None)
