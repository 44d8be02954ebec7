"""The real packaged SmolLM2-135M-Instruct (Q4_1 GGUF): one `evalkit run --tasks firsttoken --limit 3`
through the CLI, its rows in DuckDB, and one Chinese prompt's probabilities recomputed here with a
separately loaded copy of the same GGUF and plain forwards."""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import shutil

import duckdb
import pytest
import torch
from click.testing import CliRunner

from evalkit.engines.plan import DEFAULT_GGUF, default_model_dir
from evalkit.cli import cli
from evalkit.scoring.lexicon import load_lexicon

pytestmark = pytest.mark.slow

LIMIT = 3
K = 50
TOLERANCE = 1e-4  # the runs' default: any sum of candidate probabilities falls short by at most this


def cache_kw(model) -> str:
    """transformers 5 renamed the forward's `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a 2-core machine shared with other processes, OpenMP's barriers make a
    135M-parameter forward 2-4x slower with two threads than with one (and it changes no result
    the tests compare beyond float noise)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run_db(default_model_available, tmp_path_factory):
    db = tmp_path_factory.mktemp("smollm2") / "smollm2.duckdb"
    result = CliRunner().invoke(
        cli, ["run", "--tasks", "firsttoken", "--limit", str(LIMIT), "--db", str(db)],
        catch_exceptions=False, env={"HF_HUB_OFFLINE": "1"},
    )
    assert result.exit_code == 0, result.output
    assert "firsttoken_zh" in result.stdout and "ft_hit_prob" in result.stdout
    con = duckdb.connect(str(db), read_only=True)
    yield con
    con.close()


def dicts(con, sql, params=()):
    cur = con.execute(sql, list(params))
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


@pytest.fixture(scope="module")
def reference(default_model_available):
    """The same GGUF loaded with plain transformers (once per module)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=DEFAULT_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=DEFAULT_GGUF).eval()
    return model, tokenizer


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def string_probs(model, tokenizer, context, strings, chunk=64) -> dict[str, float]:
    """P(response starts with s): the product of softmax(logits) terms over s's tokens, s tokenised
    together with the context. Plain transformers calls: one forward of the context, then the strings
    right-padded in batches after a repeated copy of its KV cache (causal: padding after a token
    cannot change its logits). No trie, no 4-D mask, no pruning: none of evalkit's engine."""
    ctx = ids_of(tokenizer, context)
    with torch.no_grad():
        prefill = model(torch.tensor([ctx]), use_cache=True)
    first = torch.softmax(prefill.logits[0, -1].float(), dim=-1)
    out = {}
    for start in range(0, len(strings), chunk):
        part = strings[start : start + chunk]
        fulls = [ids_of(tokenizer, context + s) for s in part]
        for s, full in zip(part, fulls):
            assert full[: len(ctx)] == ctx and len(full) > len(ctx), s
        tails = [full[len(ctx) :] for full in fulls]
        width = max(len(t) for t in tails)
        probs = None
        if width > 1:
            with torch.no_grad():
                out_ctx = model(torch.tensor([ctx]), use_cache=True)
                cache = out_ctx.cache if getattr(out_ctx, "cache", None) is not None else out_ctx.past_key_values
                cache.batch_repeat_interleave(len(part))
                batch = torch.tensor([t[:-1] + [0] * (width - len(t)) for t in tails])
                probs = torch.softmax(model(batch, **{cache_kw(model): cache}).logits.float(), dim=-1)
        for row, tail in enumerate(tails):
            p = float(first[tail[0]])
            for i in range(1, len(tail)):
                p *= float(probs[row, i - 1, tail[i]])
            out[part[row]] = p
    return out


# ---- what the run stored --------------------------------------------------------------------------


def test_run_row(run_db):
    (row,) = dicts(run_db, "SELECT * FROM runs")
    assert row["status"] == "done" and row["error"] is None
    assert row["model"] == "SmolLM2-135M-Instruct"
    assert row["quant"] == "q4_1" and row["dtype"] == "float32"
    assert row["template"] == "chat" and row["tasks"] == ["firsttoken"]
    assert row["sample_limit"] == LIMIT and row["top_k"] == K
    assert row["opener_lexicon_version"] == load_lexicon().version
    gguf = default_model_dir() / DEFAULT_GGUF
    assert row["model_fingerprint"] == "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    args = json.loads(row["model_args"])
    assert args["gguf_file"] == DEFAULT_GGUF and args["trust_remote_code"] is False


def test_samples(run_db):
    samples = dicts(run_db, "SELECT * FROM samples ORDER BY task, doc_id")
    assert [(s["task"], s["doc_id"]) for s in samples] == [
        ("firsttoken_en", f"en-000{i}") for i in range(1, LIMIT + 1)
    ] + [("firsttoken_zh", f"zh-000{i}") for i in range(1, LIMIT + 1)]
    for s in samples:
        assert s["response"] and s["response"].strip(), s["doc_id"]
        assert s["first_token"] is not None and s["first_token_id"] is not None
        assert s["first_unit"] and "\ufffd" not in s["first_unit"], s["doc_id"]
        assert s["prompt"].startswith("<|im_start|>system\n") and s["prompt"].endswith("<|im_start|>assistant\n")
        assert s["ft_outcome"] in ("hit", "opener", "other")
        assert s["lang"] == s["task"][-2:]
        if s["lang"] == "zh" and "\ufffd" not in s["response"][:1]:
            assert s["response"].lstrip().startswith(s["first_unit"])
        for name in ("ft_hit", "ft_token_hit", "ft_hit_prob", "opener_rate", "opener_mass", "prior_drift",
                     "top3_mass", "unstable"):
            assert s[name] is not None and 0.0 <= s[name] <= 1.0, (s["doc_id"], name)
        assert s["entropy"] > 0
        assert s["ft_hit_prob"] >= 0.0 and s["ft_hit"] == (1.0 if s["ft_outcome"] == "hit" else 0.0)
    # a sizeable answer probability somewhere: SmolLM2 answers "What is recursion?" with "Recursion"
    assert max(s["ft_hit_prob"] for s in samples) > 0.1


def test_topk_rows(run_db):
    rows = dicts(run_db, "SELECT * FROM first_token_topk ORDER BY task, doc_id, rank")
    by_prompt: dict[tuple, list] = {}
    for r in rows:
        by_prompt.setdefault((r["task"], r["doc_id"]), []).append(r)
    assert len(by_prompt) == 2 * LIMIT
    for key, ranked in by_prompt.items():
        assert [r["rank"] for r in ranked] == list(range(K)), key
        logprobs = [r["logprob"] for r in ranked]
        assert all(a >= b for a, b in zip(logprobs, logprobs[1:])), key
        assert all(lp <= 0 for lp in logprobs)
        assert sum(math.exp(lp) for lp in logprobs) <= 1.0 + 1e-6
        assert len({r["token_id"] for r in ranked}) == K
    first = dicts(run_db, "SELECT s.doc_id, s.first_token_id, t.token_id FROM samples s "
                          "JOIN first_token_topk t USING (task, doc_id) WHERE t.rank = 0")
    assert all(r["first_token_id"] == r["token_id"] for r in first)


def test_metric_rows(run_db):
    metrics = {(r["task"], r["metric"]): r for r in dicts(run_db, "SELECT * FROM metrics")}
    for task in ("firsttoken_en", "firsttoken_zh"):
        for name in ("ft_hit", "ft_token_hit", "ft_hit_prob", "opener_rate", "opener_mass", "prior_drift",
                     "top3_mass", "unstable"):
            row = metrics[(task, name)]
            assert 0.0 <= row["value"] <= 1.0 and row["n"] == LIMIT, (task, name)
            mean = run_db.execute(f"SELECT avg({name}) FROM samples WHERE task = ?", [task]).fetchone()[0]
            assert row["value"] == pytest.approx(mean, abs=1e-9)
        assert metrics[(task, "entropy")]["value"] > 0
    assert 0.0 <= metrics[("firsttoken", "ft_hit")]["value"] <= 1.0


# ---- against an independent computation --------------------------------------------------------------


def test_zh_probabilities_match_plain_softmax_product(run_db, reference):
    model, tokenizer = reference
    (sample,) = dicts(run_db, "SELECT * FROM samples WHERE doc_id = 'zh-0001'")
    context = sample["prompt"]  # the exact text the model saw
    answers = json.loads(sample["target"])
    assert answers == ["递归"]

    hit = string_probs(model, tokenizer, context, answers)
    assert len(ids_of(tokenizer, context + "递归")) - len(ids_of(tokenizer, context)) >= 2  # several tokens
    assert sample["ft_hit_prob"] == pytest.approx(sum(hit.values()), abs=1e-4)
    assert sample["ft_hit_prob"] > 0.05  # not a comparison of two near-zeros

    entries = list(dict.fromkeys(load_lexicon().entries))
    openers = [e for e in entries if not any(o != e and e.startswith(o) for o in entries)]
    expected = sum(string_probs(model, tokenizer, context, openers).values())
    got = sample["opener_mass"]
    # prefixes left out only drop mass, at most TOLERANCE in all (float noise aside)
    assert -1e-5 <= expected - got <= TOLERANCE + 1e-5

    # the stored top-k is the plain forward's
    ctx = ids_of(tokenizer, context)
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([ctx])).logits[0, -1].float(), dim=-1)
    stored = dicts(run_db, "SELECT token_id, logprob FROM first_token_topk WHERE doc_id = 'zh-0001' ORDER BY rank")
    for r in stored:
        assert math.exp(r["logprob"]) == pytest.approx(float(probs[r["token_id"]]), abs=1e-4)
    assert stored[0]["token_id"] == int(torch.argmax(probs))
    top = torch.topk(probs, K)
    assert sum(math.exp(r["logprob"]) for r in stored) == pytest.approx(float(top.values.sum()), abs=1e-4)


def test_the_converted_model_cache_holds_the_same_model(reference, tmp_path, monkeypatch):
    """The first load of a GGUF saves what transformers made of it; a later load from the cache
    gives the same weights, the same tokenizer and the same logits as loading the GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evalkit.engines.transformers.convert import DONE, cached_args
    from evalkit.engines.plan import default_model_args

    model, tokenizer = reference
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    args = cached_args(default_model_args())
    assert "gguf_file" not in args and (tmp_path / "cache" / "models").is_dir()
    assert (tmp_path / "cache" / "models" / args["pretrained"].rsplit("/", 1)[-1] / DONE).is_file()
    assert cached_args(default_model_args()) == args  # the second time reads the folder
    cached = AutoModelForCausalLM.from_pretrained(args["pretrained"]).eval()
    cached_tok = AutoTokenizer.from_pretrained(args["pretrained"])
    assert cached_tok.get_vocab() == tokenizer.get_vocab()
    assert cached_tok.chat_template == tokenizer.chat_template
    ours, theirs = cached.state_dict(), model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "什么是递归？"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = torch.tensor([ids_of(tokenizer, text)])
    assert ids_of(cached_tok, text) == ids[0].tolist()
    with torch.no_grad():
        assert torch.equal(cached(ids).logits, model(ids).logits)
    monkeypatch.setenv("EVALKIT_CACHE", "none")
    assert cached_args(default_model_args()) == default_model_args()


def test_the_shipped_gate_example_passes_the_default_model_and_fails_its_int8_variant(
        default_model_available, tmp_path):
    """examples/ci-gate.yml's gate and promote steps, run as the workflow runs them (the default
    rules): the first candidate becomes the baseline, the default model gated against itself
    passes, and its int8-dynamic variant is not promoted."""
    import os
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    steps = {s.get("name"): s.get("run") for s in
             yaml.safe_load((root / "examples" / "ci-gate.yml").read_text())["jobs"]["gate"]["steps"]}
    gate_step, promote_step = steps["Gate the candidate against production"], steps["Promote on pass"]
    work = tmp_path / "repo"
    shutil.copytree(root / "examples", work / "examples")
    db = work / "reports" / "evalkit.duckdb"
    summary = tmp_path / "summary.md"
    outputs = tmp_path / "outputs.txt"
    env = {**os.environ, "EVALKIT_DB": str(db), "GITHUB_STEP_SUMMARY": str(summary), "HF_HUB_OFFLINE": "1",
           "GITHUB_OUTPUT": str(outputs), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def step(script):
        return subprocess.run(["bash", "-e", "-c", script], cwd=work, env=env, capture_output=True, text=True)

    def candidate(*extra):
        res = CliRunner().invoke(cli, ["run", "--tasks", "firsttoken", "--limit", "20", "--db", str(db), *extra],
                                 catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return re.search(r"^run (\S+)", res.stdout, re.M).group(1)

    first = candidate("--name", "candidate")
    out = step(gate_step)  # no baseline and no word that this is the first: the job fails, nothing promoted
    assert out.returncode == 1 and "no run is tagged prod" in out.stderr, out.stdout + out.stderr
    env["FIRST_BASELINE"] = "true"
    out = step(gate_step)
    del env["FIRST_BASELINE"]
    assert out.returncode == 0 and "first baseline" in summary.read_text(), out.stdout + out.stderr
    assert outputs.read_text().splitlines()[-1] == "promote=true"
    assert step(promote_step).returncode == 0

    out = step(gate_step)  # the default model, gated against itself under the default rules the workflow uses
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout and (work / "gate.xml").is_file()
    assert outputs.read_text().splitlines()[-1] == "promote=true"

    worse = candidate("--name", "candidate", "--quant", "int8-dynamic")
    out = step(gate_step)
    # at 20 prompts a task the default rules fail int8-dynamic or cannot decide it (the calibration's
    # size is 100): either way the step does not promote it
    assert out.returncode in (0, 1), out.stdout + out.stderr
    if out.returncode == 1:
        assert f"gate failed for candidate {worse}" in out.stderr and "| **FAIL** | regression |" in out.stdout
    else:
        assert "## evalkit gate: INCONCLUSIVE" in out.stdout and "::warning::" in out.stdout
    assert outputs.read_text().splitlines() in (["promote=true"] * 2, ["promote=true"] * 2 + ["promote=false"])

    # the default rules at 20 prompts (the case that once passed): not a pass
    res = CliRunner().invoke(cli, ["gate", "--candidate", worse, "--baseline", first, "--db", str(db)])
    assert res.exit_code in (1, 3), res.output
    assert "## evalkit gate: PASS" not in res.stdout
    assert first != worse
    print("\n" + out.stderr.strip().splitlines()[-1])


def test_the_shipped_workflow_passes_a_benign_candidate_at_its_size(default_model_available, tmp_path):
    """examples/ci-gate.yml as shipped, at its own size (its candidate step's EVALKIT_RUN_ARGS: 100
    prompts a task, `--metrics gate`) and with its own rules (the calibrated defaults): the packaged
    model is the first baseline, and the same model in bf16 — a change users accept, calibrated as
    benign in docs/gate.md — is gated PASS and promoted. Not only "itself passes"."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    steps = yaml.safe_load((root / "examples" / "ci-gate.yml").read_text())["jobs"]["gate"]["steps"]
    by_name = {s.get("name"): s for s in steps}
    run_step = by_name["Run the candidate (or finish it, on a rerun)"]
    gate_step, promote_step = by_name["Gate the candidate against production"], by_name["Promote on pass"]
    shipped_args = run_step["env"]["EVALKIT_RUN_ARGS"]
    assert "--limit 100" in shipped_args and "--metrics gate" in shipped_args, shipped_args
    work = tmp_path / "repo"
    shutil.copytree(root / "examples", work / "examples")
    summary, outputs = tmp_path / "summary.md", tmp_path / "outputs.txt"
    env = {**os.environ, "EVALKIT_DB": str(work / "reports" / "evalkit.duckdb"), "HF_HUB_OFFLINE": "1",
           "GITHUB_STEP_SUMMARY": str(summary), "GITHUB_OUTPUT": str(outputs), "EVALKIT_RULES": "",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def step(script, **extra):
        return subprocess.run(["bash", "-e", "-c", script], cwd=work, env={**env, **extra}, capture_output=True,
                              text=True)

    out = step(run_step["run"], CANDIDATE_NAME="base", EVALKIT_RUN_ARGS=shipped_args)
    assert out.returncode == 0, out.stdout + out.stderr
    out = step(gate_step["run"], FIRST_BASELINE="true")
    assert out.returncode == 0 and step(promote_step["run"]).returncode == 0, out.stdout + out.stderr

    out = step(run_step["run"], CANDIDATE_NAME="bf16", EVALKIT_RUN_ARGS=f"{shipped_args} --quant bf16")
    assert out.returncode == 0, out.stdout + out.stderr
    out = step(gate_step["run"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "## evalkit gate: PASS" in out.stdout, out.stdout
    assert outputs.read_text().splitlines()[-1] == "promote=true"
    print("\n" + "\n".join(line for line in out.stdout.splitlines() if line.startswith(("## ", "| pass", "| fail",
                                                                                          "| inconclusive"))))
