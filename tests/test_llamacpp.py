"""The llama.cpp engine (`--model llamacpp`) and the OpenAI-compatible server backend (`--model server`).

Every number is checked against an independent computation: llama-cpp-python's own high-level
`Llama` built with `logits_all=True` (its `scores` rows, put through a plain softmax), on the
real default GGUF. The server tests start llama-cpp-python's server on 127.0.0.1 and compare
its first step with the native engine's.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from evalkit.engines import kvpolicy  # noqa: E402
from evalkit.engines.plan import DEFAULT_GGUF, default_model_dir  # noqa: E402
from evalkit.engines.resolve import resolve  # noqa: E402
from evalkit.errors import BadInput  # noqa: E402

PROMPT = "What is the capital of France?"
CANDIDATES = ["Paris", "Of course", "Sure", "I'd be happy", "好的", "当然", "L'Étoile", "The"]
# llama.cpp's numbers depend on how tokens are batched (its matmul kernels differ by batch size):
# a trie node scored in a batch of many and the same token scored at the end of one long batch
# agree to 2.5 % on this Q4_1 model (measured: 0 to 0.0245 relative), never better than that
BATCH_RTOL = 0.05
# the server's first-step logprobs against the native engine's, same GGUF, same settings (flash
# attention off in both, prompt prefilled in one batch in both): measured 0.0 here
SERVER_ATOL = 1e-3


@pytest.fixture(scope="module")
def gguf(default_model_available):
    return str(default_model_dir() / DEFAULT_GGUF)


@pytest.fixture(scope="module")
def eng(gguf):
    from evalkit.engines.llamacpp.firststep import LlamaCppEngine

    engine = LlamaCppEngine(gguf, n_ctx=2048)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ref(gguf):
    """The independent reference: llama-cpp-python's high-level Llama keeping every position's logits."""
    return llama_cpp.Llama(model_path=gguf, n_ctx=512, logits_all=True, verbose=False)


@pytest.fixture(scope="module")
def context(eng):
    from evalkit.engines.llamacpp.tokenizer import GGUFTokenizer

    return GGUFTokenizer(eng).apply_chat_template([{"role": "user", "content": PROMPT}])


def ref_logprobs(ref, ids: list[int]) -> np.ndarray:
    """log-softmax of the reference's logits after each of `ids`: (len(ids), V), a plain softmax."""
    ref.reset()
    ref.eval(ids)
    logits = np.array(ref.scores[: len(ids)], dtype=np.float64)
    m = logits.max(axis=1, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(axis=1, keepdims=True))


# --- the engine -------------------------------------------------------------------------------


def test_chat_template_renders_as_llama_cpp_pythons_own_formatter(eng, context):
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from evalkit.engines.llamacpp.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer(eng)
    theirs = Jinja2ChatFormatter(template=tok.chat_template, eos_token=tok.eos_token, bos_token=tok.bos_token,
                                 add_generation_prompt=True)(messages=[{"role": "user", "content": PROMPT}])
    assert context == theirs.prompt
    assert context.endswith("<|im_start|>assistant\n") and PROMPT in context


def test_first_step_equals_the_reference_softmax(eng, ref, context):
    from evalkit.engines.llamacpp import probe as llamacpp

    step = llamacpp.probe(eng, [context], top_k=50, max_new_tokens=0)[0]
    lp = ref_logprobs(ref, step.context_ids)[-1]
    top = np.argsort(-lp)[:50]
    assert step.topk_ids[:10] == [int(t) for t in top[:10]]
    assert np.allclose(step.topk_logprobs, lp[top], atol=1e-4)
    p = np.exp(lp)
    assert step.entropy == pytest.approx(float(-(p * lp).sum()), abs=1e-3)
    assert np.allclose(step.logprobs.numpy(), lp, atol=1e-4)
    # the default model's first token on this prompt is "L" (of "L'Étoile"), not "The": the seed's flip
    assert eng.decode([step.topk_ids[0]]) == "L"


def test_candidate_trie_in_one_batch_matches_teacher_forcing(eng, ref, context):
    """ft_hit_prob's terms: the trie over the cached prompt (one batch, several sequences per token)
    against the product of softmax terms of the reference run on prompt + candidate tokens."""
    from evalkit.engines.llamacpp import probe as llamacpp

    step = llamacpp.probe(eng, [context], [CANDIDATES], max_new_tokens=0, tolerance=0.0)[0]
    assert step.unscored_mass == 0.0 and step.candidate_positions > 0
    multi = 0
    for cand in CANDIDATES:
        toks = step.candidate_tokens[cand]
        multi += len(toks) > 1
        lp = ref_logprobs(ref, step.context_ids + toks)
        n = len(step.context_ids)
        expected = math.exp(sum(lp[n - 1 + d][toks[d]] for d in range(len(toks))))
        assert step.candidate_probs[cand] == pytest.approx(expected, rel=BATCH_RTOL), cand
    assert multi >= 4  # the trie is exercised beyond its first level


def test_tolerance_leaves_out_at_most_its_mass_and_keeps_answers_exact(eng, context):
    from evalkit.engines.llamacpp import probe as llamacpp
    from evalkit.scoring.lexicon import load_lexicon

    cands = ["Paris", *load_lexicon().entries]
    exact = llamacpp.probe(eng, [context], [cands], max_new_tokens=0, tolerance=0.0)[0]
    pruned = llamacpp.probe(eng, [context], [cands], max_new_tokens=0, tolerance=1e-4,
                            exact_candidates=[["Paris"]])[0]
    assert pruned.candidate_positions < exact.candidate_positions
    assert 0 < pruned.unscored_mass <= 1e-4
    assert pruned.candidate_probs["Paris"] == exact.candidate_probs["Paris"]
    # what is left out is at most the tolerance; the two tries are batched differently, which moves
    # llama.cpp's numbers by up to BATCH_RTOL (the exact one is one batch of every prefix)
    total = sum(exact.candidate_probs.values())
    shortfall = total - sum(pruned.candidate_probs.values())
    assert -BATCH_RTOL * total <= shortfall <= pruned.unscored_mass + BATCH_RTOL * total


def test_greedy_response_is_the_references_greedy_continuation(eng, ref, context):
    from evalkit.engines.llamacpp import probe as llamacpp

    step = llamacpp.probe(eng, [context], max_new_tokens=8)[0]
    ref.reset()
    theirs = []
    for token in ref.generate(step.context_ids, temp=0.0):  # prefill in one batch, then one token a decode
        if len(theirs) == 8 or token in eng.eog:
            break
        theirs.append(token)
    assert step.response_ids == theirs
    assert eng.decode(step.response_ids).startswith("L'")


def test_units_complete_a_split_character(eng):
    """A byte token of a split Chinese character has no whole character alone; its unit is the
    character its greedy continuation completes."""
    from evalkit.engines.llamacpp import probe as llamacpp

    ids = eng.tokenize("递归")
    assert len(ids) >= 2 and "\ufffd" in eng.decode(ids[:1])
    ctx = "<|im_start|>user\n什么是递归？<|im_end|>\n<|im_start|>assistant\n"
    n = len(eng.tokenize(ctx))
    eng.prefill(eng.tokenize(ctx))
    units = llamacpp.complete_units(eng, n, [ids[0], eng.tokenize("The")[0]])
    assert units[eng.tokenize("The")[0]] == "The"
    assert units[ids[0]] and "\ufffd" not in units[ids[0]]


def test_loglikelihood_against_the_reference(gguf, ref):
    from evalkit.engines.llamacpp.model import EvalkitLlamaCpp

    class Req:
        def __init__(self, *args):
            self.args = args

    lm = EvalkitLlamaCpp(gguf, n_ctx=512)
    reqs = [Req("The capital of France is", " Paris"), Req("The capital of France is", " Lyon, a city"),
            Req("2 + 2 =", " 4")]
    got = lm.loglikelihood(reqs)
    for (total, greedy), req in zip(got, reqs):
        ctx, cont = lm._encode_pair(*req.args)
        lp = ref_logprobs(ref, ctx + cont)
        expected = sum(lp[len(ctx) - 1 + d][cont[d]] for d in range(len(cont)))
        assert total == pytest.approx(expected, abs=0.05)
        assert greedy == all(int(np.argmax(lp[len(ctx) - 1 + d])) == cont[d] for d in range(len(cont)))
    assert got[0][0] > got[1][0]


def test_kv_cache_types_map_onto_llama_cpp(eng, context):
    from evalkit.engines.llamacpp import probe as llamacpp
    from evalkit.engines.llamacpp.firststep import KV_TYPES

    assert set(kvpolicy.GGML_TYPES) <= set(KV_TYPES)
    tops = {}
    try:
        for kind in ("f32", "f16", "q8_0", "q4_0"):
            eng.set_kv_type(kind)
            assert eng.flash_attn == (kind in ("q8_0", "q4_0"))  # a quantized V cache needs flash attention
            tops[kind] = llamacpp.probe(eng, [context], max_new_tokens=0)[0].topk_logprobs[:5]
    finally:
        eng.set_kv_type("f16")
    # each cache type reaches the numbers (measured, top-1 logprob: f32 -2.052, f16 -1.884, q8_0 -1.990,
    # q4_0 flips the top token), and the 8- and 16-bit caches stay near the f32 one
    assert len({tuple(v) for v in tops.values()}) == 4
    assert np.allclose(tops["f32"], tops["f16"], atol=0.3) and np.allclose(tops["f32"], tops["q8_0"], atol=0.3)


# --- what the engine refuses, before anything loads ---------------------------------------------


@pytest.mark.parametrize("kwargs, said", [
    ({"quant_name": "bf16"}, "re-quantize weights inside transformers"),
    ({"attention": True}, "does not expose attention weights"),
    ({"kv_cache": "window:256"}, "token-by-token prefill"),
    ({"kv_cache": "sinkwindow:4:256"}, "token-by-token prefill"),
    ({"kv_cache": "fp8"}, "ggml:f16|q8_0|q4_0"),
    ({"device": "cuda"}, "runs on the CPU"),
])
def test_refusals(default_model_available, kwargs, said):
    with pytest.raises(BadInput, match=re.escape(said)):
        resolve("llamacpp", **kwargs)


def test_hf_refuses_llama_cpps_cache_types(default_model_available):
    with pytest.raises(BadInput, match="--model llamacpp"):
        resolve("hf", kv_cache="ggml:q8_0")


def test_refusal_is_one_line_and_exit_2(invoke, default_model_available):
    res = invoke("run", "--model", "llamacpp", "--tasks", "firsttoken_en", "--limit", "1", "--quant", "int8-dynamic")
    assert res.exit_code == 2
    assert len(res.stderr.strip().splitlines()) == 1 and "--quant" in res.stderr


def test_plan_records_the_ggufs_own_quantization(gguf, tmp_path):
    plan = resolve("llamacpp")
    assert (plan.engine, plan.quant, plan.kv_cache, plan.top_k) == ("llama.cpp", "q4_1", "ggml:f16", 50)
    assert plan.args["model"] == gguf and plan.embedded
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(BadInput, match="not a GGUF file"):
        resolve("llamacpp", f"model={bad}")
    with pytest.raises(BadInput, match="unknown --model-args key 'n_gpu'"):
        resolve("llamacpp", "n_gpu=3")
    empty = tmp_path / "empty.gguf"  # a GGUF header with no tensors: refused by llama.cpp with one line
    empty.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 40)
    from evalkit.engines.llamacpp.model import EvalkitLlamaCpp

    with pytest.raises(BadInput, match=f"llama.cpp cannot load {re.escape(str(empty))}"):
        EvalkitLlamaCpp(resolve("llamacpp", f"model={empty}").args["model"])


def test_quant_detail_bits_per_weight_against_the_gguf_tensors(gguf):
    """bits per weight from llama.cpp's model size / parameter count against the gguf package's own
    tensor sizes (an independent reader of the same file)."""
    from gguf import GGUFReader

    from evalkit.engines.llamacpp.model import EvalkitLlamaCpp

    detail = EvalkitLlamaCpp(gguf, n_ctx=256).quant_detail
    tensors = GGUFReader(gguf).tensors
    expected = 8 * sum(int(t.n_bytes) for t in tensors) / sum(int(t.n_elements) for t in tensors)
    assert detail["gguf_file_type"] == "Q4_1" and detail["engine"] == "llama.cpp"
    assert detail["bits_per_weight"] == pytest.approx(expected, rel=0.01)
    assert detail["version"] == llama_cpp.__version__ and detail["kv_cache_type"] == "f16"


# --- a stored run, shown and compared -------------------------------------------------------------


@pytest.fixture(scope="module")
def native_runs(tmp_path_factory, default_model_available):
    """Two stored llama.cpp runs (f16 and q8_0 caches) of 3 English prompts."""
    import evalkit

    db = tmp_path_factory.mktemp("lc") / "lc.duckdb"
    runs = [evalkit.run(tasks="firsttoken_en", model="llamacpp", limit=3, db=db, kv_cache=kv, name=f"lc-{kv}")
            for kv in (None, "ggml:q8_0")]
    return db, runs


def test_run_row_and_samples(native_runs):
    import evalkit

    db, (run, _) = native_runs
    con = evalkit.connect(db)
    try:
        row = con.execute("SELECT engine, quant, kv_cache, top_k, unavailable, model_fingerprint FROM runs "
                          "WHERE id = ?", [run.id]).fetchone()
        samples = con.execute("SELECT entropy, ft_hit_prob, opener_mass, prior_drift, top3_mass, first_unit "
                              "FROM samples WHERE run_id = ?", [run.id]).fetchall()
        n_topk = con.execute("SELECT count(*) FROM first_token_topk WHERE run_id = ?", [run.id]).fetchone()[0]
    finally:
        con.close()
    assert row[:5] == ("llama.cpp", "q4_1", "ggml:f16", 50, None) and row[5].startswith("sha256:")
    assert len(samples) == 3 and all(v is not None for s in samples for v in s)
    assert n_topk == 150
    # answer_prob: NULL without checkable answers (en-0001); where the answer is the accepted start
    # itself ("Paris", en-0002) it is ft_hit_prob exactly; "42" adds "forty-two" and "Forty two" ...
    con = evalkit.connect(db)
    try:
        probs = dict((d, (a, f)) for d, a, f in con.execute(
            "SELECT doc_id, answer_prob, ft_hit_prob FROM samples WHERE run_id = ?", [run.id]).fetchall())
    finally:
        con.close()
    assert probs["en-0001"][0] is None
    assert probs["en-0002"][0] == pytest.approx(probs["en-0002"][1], rel=1e-9, abs=1e-12)
    assert probs["en-0003"][0] >= probs["en-0003"][1] - 1e-9  # "42" is both a start and an answer


def test_runs_and_compare_show_the_engine(native_runs, invoke):
    db, (a, b) = native_runs
    listed = invoke("runs", "--db", db)
    assert listed.exit_code == 0 and "engine" in listed.stdout and "llama.cpp" in listed.stdout
    out = invoke("compare", a.id, b.id, "--db", db, "--format", "json")
    assert out.exit_code == 0
    assert json.loads(out.stdout)["dimensions"]["kv_cache"] == ["ggml:f16", "ggml:q8_0"]


def test_a_killed_llama_cpp_run_resumes_to_the_rows_of_an_uninterrupted_run(native_runs, tmp_path):
    """The journal works for llama.cpp as for hf (tests/test_resume.py): killed after its first batch of
    2 prompts, the run continues from the journal, and its rows equal the uninterrupted run's."""
    import shutil

    from click.testing import CliRunner

    from evalkit.cli import cli as main
    from tests.test_determinism import TABLES, differences

    ref_db, (ref, _) = native_runs
    db = tmp_path / "lc.duckdb"
    shutil.copy(ref_db, db)
    args = ["run", "--model", "llamacpp", "--tasks", "firsttoken_en", "--limit", "3", "--batch-size", "2",
            "--db", str(db)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "HF_HUB_OFFLINE": "1", "KILL_AT": "1", "KILL_SIG": "SIGKILL"}
    proc = subprocess.run([sys.executable, "-m", "tests.kill_cli", *args], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    run_id = next(ln.split()[1] for ln in proc.stderr.splitlines() if ln.startswith("run ") and ln.endswith(" started"))
    result = CliRunner().invoke(main, ["run", "--resume", run_id, "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert f"resumed run {run_id}: 1 batches replayed from its journal, 1 computed now" in result.output
    for table in TABLES:
        n_ref, n_resumed, diff = differences(db, table, ref.id, run_id)
        assert n_ref == n_resumed > 0 and diff == [], (table, n_ref, n_resumed, diff)


# --- the OpenAI-compatible server backend, against llama-cpp-python's own server --------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(gguf):
    """llama-cpp-python's OpenAI-compatible server on 127.0.0.1 with the default GGUF, up to 90 s to
    start; stopped (terminate, then kill after 10 s) when the module is done."""
    pytest.importorskip("uvicorn")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "2048", "--verbose", "False"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 90
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/models", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the llama-cpp-python server did not answer within 90 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_server_run_matches_the_native_engine(server, gguf, native_runs):
    import evalkit

    db, (native, _) = native_runs
    run = evalkit.run(tasks="firsttoken_en", model="server", limit=3, db=db, temperature=1.0,
                      model_args=f"base_url={server},tokenizer={gguf},concurrency=2,top_logprobs=20,repeat_penalty=1")
    con = evalkit.connect(db)
    try:
        row = con.execute("SELECT engine, top_k, unavailable FROM runs WHERE id = ?", [run.id]).fetchone()
        pairs = con.execute(
            """
            SELECT s.doc_id, s.rank, s.token_id, s.logprob, n.token_id, n.logprob
            FROM first_token_topk s JOIN first_token_topk n
              ON n.run_id = ? AND n.task = s.task AND n.doc_id = s.doc_id AND n.rank = s.rank
            WHERE s.run_id = ? ORDER BY s.doc_id, s.rank
            """, [native.id, run.id]).fetchall()
        texts = con.execute(
            "SELECT s.response = n.response, s.ft_hit_prob, n.ft_hit_prob, s.entropy, s.top1_prob FROM samples s "
            "JOIN samples n ON n.run_id = ? AND n.task = s.task AND n.doc_id = s.doc_id WHERE s.run_id = ?",
            [native.id, run.id]).fetchall()
    finally:
        con.close()
    engine, k, unavailable = row
    assert engine == "openai-server" and k == 20
    reasons = json.loads(unavailable)
    assert {"entropy", "opener_mass", "prior_drift"} <= set(reasons)
    assert len(pairs) >= 3 * 18  # a token text that several ids share may be left out
    top1 = [p for p in pairs if p[1] == 0]
    assert len(top1) == 3 and all(p[2] == p[4] for p in top1)
    by_id = {(p[0], p[4]): p[5] for p in pairs}
    for doc, _, token, logprob, _, _ in pairs:
        if (doc, token) in by_id:
            assert abs(logprob - by_id[(doc, token)]) <= SERVER_ATOL
    assert all(t[0] for t in texts)  # the same greedy response (repeat_penalty=1: llama-cpp-python's is 1.1)
    assert all(t[3] is None for t in texts)  # entropy: NULL, with its reason in the run row
    # llama-cpp-python 0.3.36 pairs each echoed prompt token with the distribution one position late
    # when the model adds no BOS (SmolLM2 adds none): the echo check finds it, ft_hit_prob stays NULL
    assert "misaligned" in reasons["ft_hit_prob"]
    assert reasons["answer_prob"] == reasons["ft_hit_prob"]  # read from the same echo: NULL with the reason
    assert all(t[1] is None and t[2] is not None for t in texts)


def test_echo_gives_the_starts_tokens_after_the_prompt():
    """ft_hit_prob's terms from an echoed completion: the tokens at or after the prompt's end, and None
    when a token straddles it (the server merged the boundary); a canned OpenAI answer, no server."""
    from evalkit.engines.server.model import EvalkitServer

    lm = EvalkitServer.__new__(EvalkitServer)
    answer = {"text_offset": [0, 4, 11, 14, 18, 21], "token_logprobs": [None, -1.0, -0.5, -0.25, -0.125, -2.0],
              "top_logprobs": [None, {"a": -1.0}, {"b": -0.5}, {"c": -0.25}, {"d": -0.125}, {"e": -0.1}]}
    lm._complete = lambda prompt, **body: {"logprobs": answer}
    # "The capital is" ends at 14: " Par" (14) and "is!" (18) are the start's; 21 is the generated token
    assert lm._echo("The capital is", " Paris!") == (-0.375, True)
    answer["top_logprobs"][4] = {"d": -0.125, "x": -0.01}  # another token was likelier: not greedy
    assert lm._echo("The capital is", " Paris!") == (-0.375, False)
    answer["text_offset"] = [0, 4, 11, 13, 18, 21]  # a token from 13 straddles the prompt's end
    assert lm._echo("The capital is", " Paris!") == (None, False)


def test_server_refusals(default_model_available):
    with pytest.raises(BadInput, match="base_url"):
        resolve("server")
    with pytest.raises(BadInput, match="needs --model-args tokenizer"):
        resolve("server", "base_url=http://127.0.0.1:1/v1")
    with pytest.raises(BadInput, match="owns its KV cache"):
        resolve("server", f"base_url=http://127.0.0.1:1/v1,tokenizer={default_model_dir() / DEFAULT_GGUF}",
                kv_cache="window:8")
    with pytest.raises(BadInput, match="does not answer"):
        from evalkit.engines.server.model import EvalkitServer

        EvalkitServer("http://127.0.0.1:9/v1", tokenizer=str(default_model_dir() / DEFAULT_GGUF), retries=0,
                      timeout=2)
    assert os.environ.get("EVALKIT_DB")  # the autouse fixture's DB, untouched by any of this
