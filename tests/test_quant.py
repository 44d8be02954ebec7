"""`--quant` variants from the libraries people deploy with (torchao, bitsandbytes, HQQ), on the
tiny fp32 model: what each does to the logits (8-bit error > 0, 4-bit error larger), that the
probe reads the quantized model's own first step, the run row's `quant_detail`, the sweep and
`compare` with several candidates. Variants whose library is not installed are skipped here
(`pip install -e '.[quant]'`); their refusal is tested with the library hidden.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from evalkit.engines.transformers import firststep as engine
from evalkit.engines import resolve as models
from evalkit.engines.transformers import quant
from evalkit.errors import BadInput

# (8-bit variant, 4-bit variant, the library both need); the tiny model's layers are 32 and 64 wide
FAMILIES = [("int8-weight", "int4-weight", "torchao"), ("int8-llm", "nf4", "bitsandbytes"),
            ("hqq8:32", "hqq4:32", "hqq")]
CPU_VARIANTS = ["int8-weight", "int4-weight", "int8-llm", "nf4", "hqq8:32", "hqq4:32"]
LIBRARY = {"int8-weight": "torchao", "int4-weight": "torchao", "int8-llm": "bitsandbytes", "nf4": "bitsandbytes",
           "hqq8:32": "hqq", "hqq4:32": "hqq"}
CONTEXTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\n中国的首都是哪里？<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
]


def needs(library, variant=None, tiny=None):
    if not quant.installed(library):
        pytest.skip(f"{library} is not installed (pip install -e '.[quant]')")
    if variant == "nf4" and (why := _nf4_fails_here() or (_nf4_model_fails_here(tiny) if tiny else None)):
        pytest.skip(f"bitsandbytes cannot run nf4 on this CPU: {why}")


@functools.cache
def _nf4_fails_here() -> str | None:
    """Why bitsandbytes' 4-bit kernels fail on this CPU at the tiny model's width (32), or None.

    bitsandbytes takes another CPU path where AVX512-BF16 / AMX is present, and some of its
    releases fail there on narrow layers; what the library does on the CPU at hand is probed,
    not assumed. (The real model's nf4 run is checked where the library supports it.)
    """
    import bitsandbytes as bnb
    from bitsandbytes import functional as bnb_f

    try:
        w = torch.randn(32, 32)
        q, state = bnb_f.quantize_4bit(w, quant_type="nf4", blocksize=64)
        x = torch.randn(3, 32)
        y = bnb.matmul_4bit(x, q.t(), quant_state=state)
        if y.shape != (3, 32) or not torch.isfinite(y).all():
            return f"a 32-wide nf4 matmul gave shape {tuple(y.shape)}"
    except Exception as exc:  # noqa: BLE001 - any failure of the library is the reason to skip
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


@functools.cache
def _nf4_model_fails_here(tiny) -> str | None:
    """Why the tiny model loaded as nf4 cannot forward on this CPU, or None: the layer path
    transformers builds (its quantization config, double quantization) differs from a bare
    matmul, and on some CPUs of this kind only that path fails (a `[32, 0]` reshape)."""
    try:
        lm = load(tiny, "nf4")
        logits(lm.model, lm.tokenizer)
    except Exception as exc:  # noqa: BLE001 - any failure of the library is the reason to skip
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def load(tiny, name):
    plan = models.resolve("hf", f"pretrained={tiny}", quant_name=name, device="cpu")
    return models.load(plan, batch_size=4)


def logits(model, tokenizer):
    """Logits of every position of the CONTEXTS, each forwarded alone, as one (positions, vocab) tensor."""
    out = []
    with torch.inference_mode():
        for text in CONTEXTS:
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
            out.append(model(input_ids=ids).logits[0].float())
    return torch.cat(out)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    lm = load(tiny_model_dir, None)
    return logits(lm.model, lm.tokenizer)


def relative_error(lm, ref) -> float:
    """‖logits − fp32 logits‖ / ‖fp32 logits‖ over every position of the CONTEXTS."""
    got = logits(lm.model, lm.tokenizer)
    return float((got - ref).norm() / ref.norm())


# --- spelling a variant ----------------------------------------------------------------------------


def test_parse_names_groups_and_sweeps():
    assert quant.parse("int4-weight").group_size == 32
    assert quant.parse("hqq4").group_size == 64
    assert quant.parse("int4-weight:128").text == "int4-weight:128"
    assert quant.parse("int8-weight").group_size is None
    assert quant.parse_sweep("bf16,int8-weight, int4-weight:64") == ["bf16", "int8-weight", "int4-weight:64"]
    for bad, said in [("int3", "unknown --quant"), ("bf16:32", "takes no group size"),
                      ("int4-weight:0", "group size"), ("int4-weight:-4", "group size")]:
        with pytest.raises(BadInput, match=said):
            quant.parse(bad)
    for bad, said in [("bf16,bf16", "twice"), ("bf16,", "empty entry"), ("int4-weight:32,int4-weight:32", "twice")]:
        with pytest.raises(BadInput, match=said):
            quant.parse_sweep(bad)
    # a group size spelled two ways is one variant
    with pytest.raises(BadInput, match="twice"):
        quant.parse_sweep("hqq4:064,hqq4:64")


def test_a_missing_library_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(quant, "installed", lambda module: False)
    extra = "pip install 'evalkit-firsttoken[quant]' (in a clone: pip install -e '.[quant]')"
    for name, pip in [("int4-weight", extra), ("nf4", extra), ("hqq4", extra), ("gptq", "pip install gptqmodel optimum")]:
        with pytest.raises(BadInput) as err:
            quant.check(name, in_process_hf=True, model_type="hf", device="cpu")
        assert pip in str(err.value) and "\n" not in str(err.value)


def test_gpu_only_variant_is_refused_without_cuda(monkeypatch):
    monkeypatch.setattr(quant, "installed", lambda module: True)
    monkeypatch.setattr(quant, "_cuda_available", lambda: False)
    with pytest.raises(BadInput, match="needs a CUDA GPU.*tinygemm"):
        quant.check("int4-tinygemm", in_process_hf=True, model_type="hf")
    monkeypatch.setattr(quant, "_cuda_available", lambda: True)
    with pytest.raises(BadInput, match="--device cpu"):
        quant.check("int4-tinygemm", in_process_hf=True, model_type="hf", device="cpu")
    quant.check("int4-tinygemm", in_process_hf=True, model_type="hf", device="cuda")  # passes where CUDA is


def test_a_checkpoint_variant_checks_the_checkpoint(tiny_model_dir):
    with pytest.raises(BadInput, match="not a GPTQ checkpoint"):
        quant.check_model("gptq", embedded=False, args={"pretrained": str(tiny_model_dir)})
    with pytest.raises(BadInput, match="GGUF"):
        quant.check_model("awq", embedded=True, args={})


# --- what each variant does to the tiny fp32 model -----------------------------------------------


@pytest.mark.parametrize("eight,four,library", FAMILIES, ids=[f[2] for f in FAMILIES])
def test_logit_error_is_nonzero_and_grows_from_8_to_4_bits(tiny_model_dir, reference, eight, four, library):
    needs(library, four, tiny_model_dir)
    err8 = relative_error(load(tiny_model_dir, eight), reference)
    err4 = relative_error(load(tiny_model_dir, four), reference)
    print(f"{library}: relative logit error {eight} {err8:.4f}, {four} {err4:.4f}")
    assert 0 < err8 < err4
    assert err4 > 2 * err8  # 16x coarser rounding steps, measured ~10x the error here


@pytest.mark.parametrize("name", CPU_VARIANTS)
def test_probe_reads_the_quantized_models_own_first_step(tiny_model_dir, name):
    """engine.probe (left-padded batch, KV cache) equals a plain unpadded forward of the same quantized model."""
    needs(LIBRARY[name], name, tiny_model_dir)
    lm = load(tiny_model_dir, name)
    # LLM.int8() picks its outlier features over every row of a matmul: in a batch, a prompt's
    # result depends on its batch mates (measured up to 0.011 in probability here), so int8-llm
    # is compared one prompt at a time; the other variants in one left-padded batch
    batch = 1 if name == "int8-llm" else len(CONTEXTS)
    steps = engine.probe(lm.model, lm.tokenizer, CONTEXTS, top_k=50, max_new_tokens=0, batch_size=batch)
    with torch.inference_mode():
        for text, step in zip(CONTEXTS, steps):
            ids = torch.tensor([lm.tokenizer(text, add_special_tokens=False)["input_ids"]])
            plain = torch.log_softmax(lm.model(input_ids=ids).logits[0, -1].float(), -1)
            assert (step.logprobs.exp() - plain.exp()).abs().max().item() < 1e-4, name
            assert step.topk_ids[0] == int(plain.argmax())


@pytest.mark.parametrize("name", CPU_VARIANTS)
def test_quant_detail_says_what_was_applied(tiny_model_dir, name):
    needs(LIBRARY[name], name, tiny_model_dir)
    detail = load(tiny_model_dir, name).quant_detail
    assert detail["variant"] == name and detail["library"] == LIBRARY[name] and detail["version"]
    assert detail["bits"] in (4, 8) and detail["compute_dtype"] == "float32"
    # every linear layer of the two decoder layers, and neither embedding
    assert detail["n_quantized"] == 14
    assert set(detail["quantized"]) == {f"model.layers.*.{m}" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert detail["not_quantized"] == {"lm_head": 1, "model.embed_tokens": 1}
    if name.startswith(("int4-weight", "hqq")):
        assert detail["group_size"] == 32
    if name == "nf4":
        assert detail["group_size"] == 64  # bitsandbytes' block size, read off the quantized weights


def test_a_group_size_that_does_not_divide_a_layer_is_refused(tiny_model_dir):
    needs("torchao")
    with pytest.raises(BadInput, match="does not divide the input width 32, 64"):
        load(tiny_model_dir, "int4-weight:48")


# --- the sweep and compare --------------------------------------------------------------------------


def test_sweep_runs_each_variant_on_the_same_prompts_and_compare_shows_a_row_each(tiny_model_dir, tmp_path):
    needs("torchao")
    from click.testing import CliRunner

    from evalkit.cli import cli
    from evalkit.store.db import open_reader

    db = str(tmp_path / "sweep.duckdb")
    res = CliRunner().invoke(cli, ["run", "--model-args", f"pretrained={tiny_model_dir}", "--tasks", "firsttoken",
                                   "--limit", "2", "--quant", "fp32,int8-weight,int4-weight", "--name", "sw",
                                   "--db", db], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "sweep of 3 runs" in res.stdout and "evalkit compare" in res.stdout
    with open_reader(db) as con:
        rows = con.execute("SELECT id, name, quant, seed, config, quant_detail FROM runs ORDER BY created_at").fetchall()
        docs = con.execute("SELECT run_id, list(task || '/' || doc_id ORDER BY task, doc_id) FROM samples "
                           "GROUP BY run_id").fetchall()
        board = con.execute("SELECT DISTINCT quant, quant_detail IS NOT NULL FROM leaderboard ORDER BY 1").fetchall()
    assert [r[1] for r in rows] == ["sw-fp32", "sw-int8-weight", "sw-int4-weight"]
    assert [r[2] for r in rows] == ["fp32", "int8-weight", "int4-weight"]
    assert len({r[3] for r in rows}) == 1  # one seed
    configs = [json.loads(r[4]) for r in rows]
    assert all({k: v for k, v in c.items() if k not in ("quant", "name")} ==
               {k: v for k, v in configs[0].items() if k not in ("quant", "name")} for c in configs)
    assert len({tuple(d) for _, d in docs}) == 1 and len(docs) == 3  # the same prompts
    details = [json.loads(r[5]) for r in rows]
    assert [d["library"] for d in details] == ["torch", "torchao", "torchao"]
    assert details[2]["group_size"] == 32 and details[2]["n_quantized"] == 14
    assert board == [("fp32", True), ("int4-weight", True), ("int8-weight", True)]

    ids = [r[0] for r in rows]
    res = CliRunner().invoke(cli, ["compare", *ids, "--db", db], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert f"baseline {ids[0]}" in out and "torchao" in out and "group 32" in out
    drift = [ln.split() for ln in out.splitlines() if ln.startswith(("firsttoken_en ", "firsttoken_zh ", "all "))
             and len(ln.split()) == 10]
    for task in ("firsttoken_en", "firsttoken_zh", "all"):
        assert [row[2] for row in drift if row[0] == task] == ["int8-weight", "int4-weight"]
    assert "metric deltas run - baseline" in out and "ci_lo" in out

    data = json.loads(CliRunner().invoke(cli, ["compare", *ids, "--db", db, "--format", "json"]).stdout)
    assert data["baseline"] == ids[0] and set(data["runs"]) == set(ids)
    assert {d["run"] for d in data["drift"]} == set(ids[1:])
    assert data["runs"][ids[2]]["quant_detail"]["library"] == "torchao"
    csv = CliRunner().invoke(cli, ["compare", *ids, "--db", db, "--format", "csv"]).stdout.splitlines()
    assert csv[0] == "task,metric,run,quant,n,mean_base,mean,delta,ci_lo,ci_hi"
    assert any(ln.startswith(f"all,drift:js_div,{ids[2]},int4-weight,") for ln in csv)

    # the two-run form is unchanged, with each run's quant beside it
    two = CliRunner().invoke(cli, ["compare", ids[0], ids[2], "--db", db], catch_exceptions=False).stdout
    assert f"A = {ids[0]}   B = {ids[2]}" in two and "B quant  int4-weight: torchao" in two
    assert "runs differ in: quant fp32 -> int4-weight" in two


def test_a_quant_sweep_runs_every_kv_cache_policy_of_each_variant(tiny_model_dir, tmp_path):
    """`--quant A,B --kv-cache P,Q`: one model load per variant, every policy on it; the API says
    the same (`run_all`), and `run` refuses a list."""
    from click.testing import CliRunner

    import evalkit
    from evalkit.cli import cli

    db = tmp_path / "grid.duckdb"
    with pytest.raises(BadInput, match="run_all"):
        evalkit.run(tasks="firsttoken_en", model_args=f"pretrained={tiny_model_dir}", quant="fp32,bf16", db=db)
    assert not db.exists()
    done = []
    runs = evalkit.run_all(tasks="firsttoken_en", model_args=f"pretrained={tiny_model_dir}", limit=1,
                           quant="fp32,bf16", kv_cache="full,window:8", name="grid", db=db, on_done=done.append)
    assert [r.id for r in done] == [r.id for r in runs] and all(r.status == "done" for r in runs)
    with evalkit.connect(db) as con:
        rows = con.execute("SELECT name, quant, kv_cache, quant_detail IS NOT NULL FROM runs "
                           "ORDER BY created_at, id").fetchall()
    assert rows == [("grid-fp32 (full)", "fp32", "full", True), ("grid-fp32 (window:8)", "fp32", "window:8", True),
                    ("grid-bf16 (full)", "bf16", "full", True), ("grid-bf16 (window:8)", "bf16", "window:8", True)]
    res = CliRunner().invoke(cli, ["compare", *[r.id for r in runs], "--db", str(db)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "differs from the baseline in: kv_cache full -> window:8" in res.stdout
