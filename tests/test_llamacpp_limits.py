"""What llama.cpp cannot hold is refused before the load (issue 36, class 8): a native abort
(GGML_ASSERT, exit 134 with a backtrace) must never reach the user."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from evalkit.engines.llamacpp.firststep import MIN_N_CTX, SEQ_MAX, context_refusal  # noqa: E402
from evalkit.engines.plan import DEFAULT_GGUF, default_model_dir  # noqa: E402
from evalkit.engines.resolve import resolve  # noqa: E402
from evalkit.errors import BadInput  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_the_smallest_context_is_one_output_row_per_sequence():
    assert MIN_N_CTX == SEQ_MAX == 256
    assert context_refusal(256) is None and context_refusal(8192) is None
    for n in (1, 16, 64, 255):
        assert "n_ctx >= 256" in context_refusal(n)
    assert context_refusal(4096, n_batch=128) is not None  # the batch is the bound, not only n_ctx


@pytest.mark.parametrize("n_ctx", [16, 64, 255])
def test_a_context_llama_cpp_would_abort_on_is_refused_before_the_load(default_model_available, n_ctx):
    with pytest.raises(BadInput, match=r"--model-args n_ctx: llama.cpp needs n_ctx >= 256 here"):
        resolve("llamacpp", f"n_ctx={n_ctx}")


def test_the_engine_refuses_it_too_instead_of_aborting(default_model_available):
    from evalkit.engines.llamacpp.firststep import LlamaCppEngine

    with pytest.raises(ValueError, match="n_ctx >= 256"):
        LlamaCppEngine(str(default_model_dir() / DEFAULT_GGUF), n_ctx=64)


def test_the_cli_says_one_line_and_exits_2(default_model_available, tmp_path):
    # issue 36: exit 134 and 41 lines of backtrace from GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max)
    db = tmp_path / "runs.duckdb"
    proc = subprocess.run([sys.executable, "-m", "evalkit", "run", "--model", "llamacpp", "--model-args", "n_ctx=64",
                           "--tasks", "firsttoken_en", "--limit", "1", "--db", str(db)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("evalkit: error: --model-args n_ctx: llama.cpp needs n_ctx >= 256")
    assert not db.exists()


def test_prompts_whose_trie_does_not_fit_are_refused_before_any_is_computed(default_model_available, invoke,
                                                                             tmp_path):
    # n_ctx=256 passes the load; the default prompts need ~460-520 cells (prompt + the trie of the
    # answers and the opener lexicon + the answer): refused at once, not after minutes of work
    # (measured before: 8.5 min on a loaded 2-core machine, then "llama_decode failed (code 1)")
    import time

    db = tmp_path / "runs.duckdb"
    t0 = time.monotonic()
    res = invoke("run", "--model", "llamacpp", "--model-args", "n_ctx=256", "--tasks", "firsttoken_en", "--limit", 2,
                 "--db", db)
    assert res.exit_code == 2, res.output
    errors = [line for line in res.stderr.splitlines() if "evalkit: error: " in line]
    assert len(errors) == 1 and "Traceback" not in res.stderr
    assert "2 prompts do not fit llama.cpp's context of n_ctx=256 cells" in errors[0]
    assert "en-0001 (" in errors[0] and "raise --model-args n_ctx" in errors[0]
    assert time.monotonic() - t0 < 120


def test_cells_needed_counts_the_trie_of_every_candidate(default_model_available):
    from evalkit.engines.llamacpp.model import EvalkitLlamaCpp
    from evalkit.engines.llamacpp.probe import candidate_ids

    lm = EvalkitLlamaCpp(str(default_model_dir() / DEFAULT_GGUF), n_ctx=1024)
    context = lm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    doc = {"kind": "firsttoken", "prompt": "What is the capital of France?", "answers": ["Paris"]}
    ids = lm.eng.tokenize(context)
    cands = lm._candidates(doc).strings
    prefixes = set()
    for c in cands:
        toks = candidate_ids(lm.eng, context, c, ids)
        prefixes |= {tuple(toks[:d]) for d in range(1, len(toks) + 1)}
    assert lm.cells_needed(context, doc, 8) == len(ids) + len(prefixes) + 8
    assert len(prefixes) > 100  # the opener lexicon's trie dominates
