"""Drift by position (docs/drift.md): the statistics against direct computations, the teacher-forced
pass against plain full-sequence forwards of the tiny model, and the compact base's KLD bound."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from evalkit.scoring import drift


def _logsoftmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def _random_logprobs(rng, v: int, scale: float) -> np.ndarray:
    return _logsoftmax(rng.normal(size=v) * scale)


# --- the compact base distribution -------------------------------------------------------


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
@pytest.mark.parametrize("eps", [0.0, 1e-4, 1e-2])
def test_compact_kld_is_within_its_bound_of_the_full_vocabulary_kld(scale, eps):
    rng = np.random.default_rng(int(scale * 10) + int(eps * 1e4))
    for _ in range(20):
        p = _random_logprobs(rng, 500, scale)
        q = _logsoftmax(p + rng.normal(size=500) * 0.7)
        c = drift.compact(p, eps)
        assert c.tail <= eps + 1e-12
        assert abs(np.exp(c.logprobs.astype(float)).sum() + c.tail - 1) < 1e-5
        # fewest tokens: dropping the last listed one would leave more than eps outside
        if c.ids.size > 1:
            assert c.tail + math.exp(float(c.logprobs[-1])) > eps
        exact = drift.kld_full(p, q)
        d = drift.compare_position(c, q)
        assert d.kld <= exact + 1e-5
        assert exact <= d.kld + d.bound + 1e-5
        assert d.bound <= c.tail * (q.max() - q.min()) + 1e-9  # never beyond tail × the log-prob range
        # same top and Δp of the greedy token against the full distributions
        assert d.same_top == (int(np.argmax(q)) == int(np.argmax(p)))
        y = int(np.argmax(p))
        assert d.dp == pytest.approx(math.exp(q[y]) - math.exp(p[y]), abs=1e-6)


def test_compact_keeps_a_scored_token_from_the_tail():
    p = np.log(np.array([0.9, 0.0999, 0.00005, 0.00005]))
    c = drift.compact(p, 1e-3, keep=3)
    assert c.ids.tolist() == [0, 1, 3] and c.tail == pytest.approx(0.00005)
    d = drift.compare_position(c, np.log(np.array([0.25] * 4)), token=3)
    assert d.dp == pytest.approx(0.25 - 0.00005, abs=1e-7)
    assert d.nll_base == pytest.approx(-math.log(0.00005), rel=1e-5)


def test_compact_rows_in_torch_equals_the_numpy_compact():
    from evalkit.engines.transformers.teacher import compact_rows

    rng = np.random.default_rng(3)
    rows = np.stack([_random_logprobs(rng, 300, s) for s in (0.3, 2.0, 6.0, 12.0)])
    for c_torch, row in zip(compact_rows(torch.tensor(rows), 1e-4, keep=[5, 6, 7, 8]), rows):
        c_np = drift.compact(row, 1e-4, keep=None)
        k = c_np.ids.size
        assert c_torch.ids[:k].tolist() == c_np.ids.tolist()
        extra = c_torch.ids.size - k
        assert extra in (0, 1)
        assert c_torch.tail == pytest.approx(c_np.tail - (math.exp(row[c_torch.ids[-1]]) if extra else 0), abs=1e-12)


# --- llama.cpp's summary ---------------------------------------------------------------


def test_summary_matches_direct_formulas():
    rng = np.random.default_rng(0)
    n = 1000
    kld = rng.exponential(0.05, n)
    dp = rng.normal(0, 0.03, n)
    top = rng.random(n) < 0.9
    s = drift.summary(kld, dp, top)
    assert s.n == n
    # mean ± sqrt(population variance / (n - 1)) == the sample std / sqrt(n)
    assert s.kld_mean == pytest.approx(kld.mean())
    assert s.kld_unc == pytest.approx(kld.std(ddof=1) / math.sqrt(n))
    assert s.dp_unc == pytest.approx(dp.std(ddof=1) / math.sqrt(n))
    assert s.dp_rms == pytest.approx(math.sqrt(np.mean(dp ** 2)))
    assert s.dp_rms_unc == pytest.approx(0.5 / s.dp_rms * (dp ** 2).std(ddof=1) / math.sqrt(n))
    assert s.same_top == pytest.approx(top.mean())
    assert s.same_top_unc == pytest.approx(math.sqrt(top.mean() * (1 - top.mean()) / (n - 1)))
    # llama.cpp's percentile is numpy's linear method
    for label, frac in (("99.9", 0.999), ("99", 0.99), ("95", 0.95), ("90", 0.9), ("10", 0.1), ("5", 0.05),
                        ("1", 0.01), ("0.1", 0.001)):
        assert s.kld_pct[label] == pytest.approx(np.percentile(kld, 100 * frac))
    assert s.dp_pct["75"] == pytest.approx(np.percentile(dp, 75))
    assert s.kld_pct["median"] == pytest.approx(np.median(kld))
    assert s.kld_pct["max"] == kld.max() and s.dp_pct["min"] == dp.min()
    assert list(s.kld_pct) == ["max", "99.9", "99", "95", "90", "median", "10", "5", "1", "0.1", "min"]
    row = s.to_row()
    assert row["kld_p999"] == s.kld_pct["99.9"] and row["kld_p01"] == s.kld_pct["0.1"] and row["dp_p25"]


def test_summary_uncertainty_is_zero_at_ten_values_or_fewer_as_in_llama_cpp():
    s = drift.summary([0.1, 0.3] * 5, [0.0] * 10, [True] * 10)
    assert s.kld_unc == 0.0 and s.kld_mean == pytest.approx(0.2)
    s = drift.summary([0.1, 0.3] * 6, [0.0] * 12, [True] * 12)
    assert s.kld_unc > 0
    with pytest.raises(ValueError):
        drift.summary([], [], [])


def test_perplexity_lines_match_direct_formulas():
    rng = np.random.default_rng(1)
    nll_b = rng.exponential(2.0, 500)
    nll = nll_b + rng.normal(0.05, 0.1, 500)
    s = drift.summary(np.zeros(500), np.zeros(500), np.ones(500, bool), nll=nll, nll_base=nll_b)
    assert s.ppl["ppl"] == pytest.approx(math.exp(nll.mean()))
    assert s.ppl["ppl_base"] == pytest.approx(math.exp(nll_b.mean()))
    # the log-ratio's error is the std error of the paired difference
    assert s.ppl["ln_ratio_unc"] == pytest.approx((nll - nll_b).std(ddof=1) / math.sqrt(500), rel=1e-6)
    assert s.ppl["cor"] == pytest.approx(np.corrcoef(nll, nll_b)[0, 1], rel=1e-6)
    text = drift.format_summary(s)
    assert "Mean PPL(Q)" in text and "Mean    KLD:" in text and "99.9%   KLD:" in text
    assert " 5.0%   Δp:" in text and "Same top p:" in text and "RMS Δp    :" in text


def test_first_ratio_against_a_direct_computation_and_its_interval():
    rng = np.random.default_rng(2)
    prompts = [list(rng.exponential(0.2, 1)) + list(rng.exponential(0.05, int(rng.integers(1, 30))))
               for _ in range(200)]
    r = drift.first_ratio(prompts, n_boot=1000, seed=0)
    first = np.mean([p[0] for p in prompts])
    rest = np.concatenate([p[1:] for p in prompts]).mean()
    assert r.value == pytest.approx(first / rest) and r.n == 200
    assert r.lo < r.value < r.hi and r.lo > 1  # 0.2 / 0.05 = 4, far above 1 with 200 prompts
    # the interval is the bootstrap's: resampling prompts by hand gives the same spread
    idx = np.random.default_rng(9).integers(0, 200, size=(1000, 200))
    by_hand = [np.mean([prompts[i][0] for i in row]) / np.concatenate([prompts[i][1:] for i in row]).mean()
               for row in idx[:300]]
    lo, hi = np.quantile(by_hand, [0.025, 0.975])
    assert abs(lo - r.lo) < 0.25 * (r.hi - r.lo) and abs(hi - r.hi) < 0.25 * (r.hi - r.lo)
    # no drift beyond the first token: ratio well below one
    flat = drift.first_ratio([[0.01, 0.5, 0.5]] * 20 + [[0.02, 0.4]] * 20, n_boot=200)
    assert flat.hi < 1
    with pytest.raises(ValueError):
        drift.first_ratio([[0.1]])


def test_by_bucket_splits_positions():
    pos = list(range(20)) * 3
    kld = [float(p) for p in pos]
    out = drift.by_bucket(pos, kld, [0.0] * 60, [True] * 60)
    assert list(out) == [drift.ALL, "0", "1", "2-3", "4-7", "8-15", "16+"]
    assert out["4-7"].kld_mean == pytest.approx(5.5) and out["16+"].n == 12 and out[drift.ALL].n == 60


# --- the teacher-forced pass on the tiny model --------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from tests.tiny import load_tiny

    return load_tiny(tiny_model_dir)


def _direct(model, context: list[int], target: list[int]) -> torch.Tensor:
    """softmax(model(ids).logits[0]) at each target position, one unpadded sequence."""
    ids = torch.tensor([context + target[:-1]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    return torch.log_softmax(logits, -1)[len(context) - 1:]


def test_teacher_force_equals_plain_forwards_whatever_the_batching(tiny):
    from evalkit.engines.transformers.teacher import Forced, teacher_force

    model, tok = tiny
    rng = np.random.default_rng(0)
    items = [Forced([int(t) for t in rng.integers(5, 500, size=n)], [int(t) for t in rng.integers(5, 500, size=m)])
             for n, m in ((7, 5), (3, 9), (12, 1), (5, 0), (9, 4))]
    for batch_size in (1, 3, 8):
        got = dict(teacher_force(model, items, batch_size=batch_size, pad_id=tok.pad_token_id))
        assert sorted(got) == [0, 1, 2, 4]  # the empty target is skipped
        for i, lp in got.items():
            want = _direct(model, items[i].context_ids, items[i].target_ids)
            assert lp.shape == (len(items[i].target_ids), model.config.vocab_size)
            torch.testing.assert_close(lp, want, atol=2e-5, rtol=1e-5)


def test_teacher_forced_base_tops_are_its_greedy_response(tiny):
    from evalkit.engines.transformers import firststep as engine
    from evalkit.engines.transformers.teacher import Forced, base_pass

    model, tok = tiny
    contexts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
                "<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n"]
    steps = engine.probe(model, tok, contexts, max_new_tokens=16)
    items = [Forced(s.context_ids, s.response_ids) for s in steps]
    assert all(len(it.target_ids) >= 2 for it in items)
    bases = base_pass(model, items, pad_id=tok.pad_token_id)
    for it, comp in zip(items, bases):
        assert [c.top for c in comp] == it.target_ids


def test_drift_pass_against_a_direct_full_vocabulary_comparison(tiny):
    from evalkit.engines.transformers import firststep as engine
    from evalkit.engines.transformers.teacher import Forced, base_pass, drift_pass

    model, tok = tiny
    cand = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in cand.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    contexts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
                "<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n",
                "<|im_start|>user\nCount to five.<|im_end|>\n<|im_start|>assistant\n"]
    steps = engine.probe(model, tok, contexts, max_new_tokens=12)
    items = [Forced(s.context_ids, s.response_ids) for s in steps]
    bases = base_pass(model, items, eps=1e-4, batch_size=2, pad_id=tok.pad_token_id)
    # the base against itself: no drift at all
    same = drift_pass(model, items, bases, pad_id=tok.pad_token_id)
    for rows in same:
        assert all(abs(r.kld) < 1e-6 and r.same_top and abs(r.dp) < 1e-6 for r in rows)
    got = drift_pass(cand, items, bases, batch_size=3, pad_id=tok.pad_token_id)
    n_diff = 0
    for it, rows in zip(items, got):
        p_full = _direct(model, it.context_ids, it.target_ids).double().numpy()
        q_full = _direct(cand, it.context_ids, it.target_ids).double().numpy()
        assert len(rows) == len(it.target_ids)
        for j, r in enumerate(rows):
            exact = drift.kld_full(p_full[j], q_full[j])
            assert r.kld - 1e-5 <= exact <= r.kld + r.bound + 1e-5
            assert r.same_top == (int(np.argmax(q_full[j])) == it.target_ids[j])
            y = it.target_ids[j]
            assert r.dp == pytest.approx(math.exp(q_full[j][y]) - math.exp(p_full[j][y]), abs=1e-5)
            n_diff += exact > 1e-4
    assert n_diff > 0  # the perturbation moved something: the test can fail


def test_corpus_chunks_score_the_second_half_as_llama_perplexity():
    from evalkit.engines.transformers.teacher import corpus_chunks, scored_items

    chunks = corpus_chunks(list(range(100, 125)), 8, bos_id=1)
    assert len(chunks) == 3 and all(c[0] == 1 and len(c) == 8 for c in chunks)
    items = scored_items(chunks)
    # n_ctx 8: first = 4, scored tokens 5, 6, 7 (n_ctx - 1 - first = 3 of them), predicted from 0..4, 0..5, 0..6
    assert items[0].context_ids == [1, 101, 102, 103, 104] and items[0].target_ids == [105, 106, 107]
    assert corpus_chunks(list(range(10)), 8, bos_id=None) == [list(range(8))]


# --- a sweep with --drift on the tiny model: rows, summaries, views, metrics --------------


def test_sweep_with_drift_stores_positions_summaries_and_metrics(tiny_model_dir, tmp_path):
    import duckdb

    import evalkit
    from evalkit.store import drift as store

    db = str(tmp_path / "d.duckdb")
    runs = evalkit.run_all(tasks="firsttoken_en", model_args=f"pretrained={tiny_model_dir}", limit=4,
                           quant="fp32,bf16", drift_base="first", keep_distributions=True, db=db)
    base, cand = runs[0].id, runs[1].id
    con = duckdb.connect(db, read_only=True)
    try:
        n_tok = con.execute("SELECT count(*), sum(len(token_ids)) FROM response_tokens WHERE run_id = ?",
                            [base]).fetchone()
        assert n_tok[0] == 4 and n_tok[1] > 4
        # the kept base: one compact distribution per greedy token, the token itself listed first
        kept = con.execute("SELECT count(*) FROM drift_base WHERE run_id = ?", [base]).fetchone()[0]
        assert kept == n_tok[1]
        rows = con.execute("SELECT doc_id, position, kld, same_top, dp, kld_bound FROM drift WHERE run_id = ? "
                           "AND base_run_id = ? ORDER BY doc_id, position", [cand, base]).fetchall()
        assert len(rows) == n_tok[1]
        assert all(r[2] >= -1e-9 and r[5] >= 0 for r in rows) and any(r[2] > 0 for r in rows)
        # the SQL views restate the Python summary: same means per bucket
        summ = {r["bucket"]: r for r in store.pair_summary(con, base, cand) if r["task"] == "firsttoken_en"}
        view = {b: (n, k, st) for b, n, k, st in con.execute(
            "SELECT bucket, n, kld_mean, same_top FROM drift_by_bucket WHERE run_id = ?", [cand]).fetchall()}
        assert set(view) | {"all"} == set(summ)
        for b, (n, k, st) in view.items():
            assert summ[b]["n"] == n and summ[b]["kld_mean"] == pytest.approx(k) and summ[b]["same_top"] == \
                pytest.approx(st)
        assert summ["all"]["n"] == len(rows)
        # the metrics the gate and compare read
        metrics = dict(con.execute("SELECT metric, value FROM metrics WHERE run_id = ? AND metric LIKE 'drift%'",
                                   [cand]).fetchall())
        first = [r[2] for r in rows if r[1] == 0]
        assert metrics["drift_kld@0"] == pytest.approx(np.mean(first))
        rest = [r[2] for r in rows if r[1] > 0]
        assert metrics["drift_first_ratio"] == pytest.approx(np.mean(first) / np.mean(rest))
        assert con.execute("SELECT count(*) FROM drift_runs WHERE run_id = ? AND quant = 'bf16' AND "
                           "base_quant = 'fp32'", [cand]).fetchone()[0] >= 1
    finally:
        con.close()
    # a later run against the stored base: the same rows as in the sweep (same model, same tokens)
    again = evalkit.run_all(tasks="firsttoken_en", model_args=f"pretrained={tiny_model_dir}", limit=4,
                            quant="bf16", drift_base=base, db=db)
    con = duckdb.connect(db, read_only=True)
    try:
        a = con.execute("SELECT doc_id, position, kld FROM drift WHERE run_id = ? ORDER BY ALL", [cand]).fetchall()
        b = con.execute("SELECT doc_id, position, kld FROM drift WHERE run_id = ? ORDER BY ALL",
                        [again[0].id]).fetchall()
        assert [x[:2] for x in a] == [x[:2] for x in b]
        assert np.allclose([x[2] for x in a], [x[2] for x in b], atol=1e-6)
    finally:
        con.close()
    # the report draws the drift section for these runs, and leaves it out for runs without drift
    from evalkit.report.build import DRIFT_PNG, build_report

    report = build_report(db, runs=[base, cand], out=tmp_path / "report")
    drift = next(s for s in report.sections if s.key == "drift")
    assert drift.omitted is None and (tmp_path / "report" / DRIFT_PNG).stat().st_size > 1000
    assert DRIFT_PNG in (tmp_path / "report" / "index.html").read_text()
    plain = build_report(db, runs=[base], out=tmp_path / "report-base")
    assert next(s for s in plain.sections if s.key == "drift").omitted.startswith("no run here teacher-forced")


def test_drift_options_refused_with_one_line(tiny_model_dir, tmp_path):
    import evalkit
    from evalkit.errors import BadInput

    db = str(tmp_path / "e.duckdb")
    with pytest.raises(BadInput, match="--quant BASE,CAND"):
        evalkit.run_all(tasks="firsttoken_en", model_args=f"pretrained={tiny_model_dir}", limit=1,
                        drift_base="first", db=db)
    first = evalkit.run_all(tasks="firsttoken_en", model_args=f"pretrained={tiny_model_dir}", limit=1, db=db)
    with pytest.raises(BadInput, match="kept no distributions"):
        evalkit.run_all(tasks="firsttoken_en", model_args=f"pretrained={tiny_model_dir}", limit=1,
                        drift_base=first[0].id, db=db)


# --- corpus mode on the tiny model, every formula against a direct computation -------------


def test_corpus_mode_matches_a_direct_full_vocabulary_computation(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from evalkit.runner.corpus import corpus_drift

    text = " ".join(f"The {w} sat on the mat and the cat said {i}." for i, w in
                    enumerate(["cat", "dog", "bird", "fish", "fox", "owl"] * 12))
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    # one chunk per forward, as the direct computation runs it (batching is checked above)
    (res,) = corpus_drift(path, ["fp32", "int8-weight"], model_args=f"pretrained={tiny_model_dir}", n_ctx=64,
                          batch_size=1)
    from evalkit.engines import resolve as models

    # the same two variants as evalkit loads them; the direct computation is unpadded, one chunk at a
    # time, over the full vocabulary
    base, cand = (models.load(models.resolve("hf", f"pretrained={tiny_model_dir}", quant_name=q)).model
                  for q in ("fp32", "int8-weight"))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokens = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"]
    n_chunks = len(tokens) // 64
    assert res.n_chunks == n_chunks >= 2
    kld, dp, top, nll, nll_b = [], [], [], [], []
    for c in range(n_chunks):
        chunk = [tok.bos_token_id] + tokens[c * 64 + 1:(c + 1) * 64]
        ids = torch.tensor([chunk])
        with torch.no_grad():
            lp = torch.log_softmax(base(ids).logits[0].float(), -1).double().numpy()
            lq = torch.log_softmax(cand(ids).logits[0].float(), -1).double().numpy()
        for j in range(32, 63):  # llama.cpp: logits first = n_ctx/2 .. n_ctx - 2 predict tokens j + 1
            y = chunk[j + 1]
            kld.append(drift.kld_full(lp[j], lq[j]))
            dp.append(math.exp(lq[j][y]) - math.exp(lp[j][y]))
            top.append(int(np.argmax(lq[j])) == int(np.argmax(lp[j])))
            nll.append(-lq[j][y])
            nll_b.append(-lp[j][y])
    s = res.summary
    assert s.n == len(kld) == n_chunks * 31
    kld = np.array(kld)
    # the compact base loses at most its bound per position
    assert s.kld_mean <= kld.mean() + 1e-4 and kld.mean() <= s.kld_mean + s.kld_bound_max + 1e-4
    assert s.kld_mean == pytest.approx(kld.mean(), rel=0.02, abs=1e-4)
    assert s.kld_unc == pytest.approx(kld.std(ddof=1) / math.sqrt(kld.size), rel=0.05)
    assert s.kld_pct["median"] == pytest.approx(np.median(kld), rel=0.05, abs=1e-4)
    assert s.kld_pct["99"] == pytest.approx(np.percentile(kld, 99), rel=0.05, abs=1e-4)
    assert s.dp_mean == pytest.approx(np.mean(dp), abs=1e-4)
    assert s.dp_rms == pytest.approx(math.sqrt(np.mean(np.square(dp))), rel=1e-3, abs=1e-5)
    assert s.dp_pct["95"] == pytest.approx(np.percentile(dp, 95), abs=1e-4)
    assert s.same_top == pytest.approx(np.mean(top), abs=1e-9)
    assert s.ppl["ppl"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-3)
    assert s.ppl["ppl_base"] == pytest.approx(math.exp(np.mean(nll_b)), rel=1e-4)
    assert s.ppl["ln_ratio"] == pytest.approx(np.mean(nll) - np.mean(nll_b), abs=1e-4)
    assert kld.mean() > 1e-6  # int8 weights moved the distributions: the comparison can fail


def test_drift_corpus_command_prints_llama_cpp_lines_and_refuses_short_text(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from evalkit.cli import cli

    path = tmp_path / "c.txt"
    path.write_text("word " * 400, encoding="utf-8")
    args = ["drift-corpus", str(path), "--quant", "fp32,bf16", "--model-args", f"pretrained={tiny_model_dir}",
            "--n-ctx", "32", "--chunks", "2"]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for line in ("Mean    KLD:", "Maximum KLD:", "99.9%   KLD:", "Median  KLD:", " 0.1%   KLD:", "Minimum KLD:",
                 "Mean    Δp:", "RMS Δp    :", "Same top p:", "Mean PPL(Q)", "30 positions, 2 chunks"):
        assert line in result.output
    short = tmp_path / "s.txt"
    short.write_text("a few words", encoding="utf-8")
    result = CliRunner().invoke(cli, ["drift-corpus", str(short), "--quant", "fp32,bf16", "--model-args",
                                      f"pretrained={tiny_model_dir}", "--n-ctx", "32"])
    assert result.exit_code == 2 and "needs at least 64" in result.output


def test_drift_plot_series_and_png(tmp_path):
    from evalkit.report.drift_plot import drift_plot, position_series

    rng = np.random.default_rng(4)
    rows = [{"label": v, "position": p, "kld": float(rng.exponential(0.1 * (p + 1))), "same_top": rng.random() < 0.8}
            for v in ("int8-weight", "hqq4") for p in range(20) for _ in range(24)]  # 24: enough for an interval
    rows.append({"label": "hqq4", "position": 30, "kld": 0.0, "same_top": True})  # one prompt: no interval
    series = position_series(rows)
    pts = {p["position"]: p for p in series["hqq4"]}
    want = [r["kld"] for r in rows if r["label"] == "hqq4" and r["position"] == 3]
    assert pts[3]["kld"] == pytest.approx(np.mean(want)) and pts[3]["n"] == 24
    assert pts[3]["kld_lo"] <= pts[3]["kld"] <= pts[3]["kld_hi"]
    assert pts[30]["kld_lo"] is None and pts[30]["n"] == 1
    path = drift_plot(rows, tmp_path / "d.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError):
        position_series([])


def test_drift_refuses_other_engines_and_policy_lists_before_writing(tmp_path):
    from evalkit.errors import BadInput
    from evalkit.runner.config import RunConfig
    from evalkit.runner.drift import session

    db = str(tmp_path / "x.duckdb")
    with pytest.raises(BadInput, match="--model hf or llamacpp"):
        with session(RunConfig(tasks=["firsttoken_en"], model="vllm", drift_base="first", quant="fp32,bf16", db=db)):
            pass
    with pytest.raises(BadInput, match="one --kv-cache"):
        with session(RunConfig(tasks=["firsttoken_en"], drift_base="first", quant="fp32,bf16",
                               kv_cache="full,window:8", db=db)):
            pass
    with session(RunConfig(tasks=["firsttoken_en"], db=db)) as s:
        assert s is None
    assert not (tmp_path / "x.duckdb").exists()


def test_run_command_drift_options_are_one_line_errors(tiny_model_dir, tmp_path):
    from click.testing import CliRunner

    from evalkit.cli import cli

    base = ["run", "--tasks", "firsttoken_en", "--model-args", f"pretrained={tiny_model_dir}", "--limit", "1",
            "--db", str(tmp_path / "c.duckdb")]
    r = CliRunner().invoke(cli, base + ["--drift"])
    assert r.exit_code == 2 and "--quant BASE,CAND" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(cli, base + ["--quant", "fp32,bf16", "--drift", "--drift-base", "latest"])
    assert r.exit_code == 2 and "not both" in r.output
    r = CliRunner().invoke(cli, base + ["--drift-base", "nosuchrun"])
    assert r.exit_code == 2 and "no evalkit database" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "c.duckdb").exists()  # refused before anything was written


# --- engine drift: the same GGUF through llama.cpp and through transformers ----------------


@pytest.mark.slow
def test_llama_cpp_teacher_forcing_matches_its_own_reference_and_drifts_little_from_transformers(
        default_model_available):
    llama_cpp = pytest.importorskip("llama_cpp")
    from evalkit.engines import resolve as models
    from evalkit.engines.llamacpp.tokenizer import GGUFTokenizer
    from evalkit.engines.plan import DEFAULT_GGUF, default_model_dir
    from evalkit.engines.llamacpp.firststep import LlamaCppEngine
    from evalkit.engines.transformers.teacher import Forced, base_pass, drift_pass, forced

    gguf = str(default_model_dir() / DEFAULT_GGUF)
    eng = LlamaCppEngine(gguf, n_ctx=1024)
    try:
        context = GGUFTokenizer(eng).apply_chat_template([{"role": "user", "content": "What is the capital of "
                                                                                       "France?"}])
        ctx_ids = eng.tokenize(context)
        target = eng.tokenize(" The capital of France is Paris, a city on the Seine.")
        items = [Forced(ctx_ids, target)]
        ((i, lp),) = list(forced(eng, items))
        assert i == 0 and lp.shape == (len(target), eng.n_vocab)
        # the independent reference: llama-cpp-python's high-level Llama keeping every position's logits
        ref = llama_cpp.Llama(model_path=gguf, n_ctx=512, logits_all=True, verbose=False)
        ref.eval(ctx_ids + target[:-1])
        logits = np.array(ref.scores[len(ctx_ids) - 1: len(ctx_ids) + len(target) - 1], dtype=np.float64)
        want = logits - logits.max(1, keepdims=True)
        want = want - np.log(np.exp(want).sum(1, keepdims=True))
        p, q = np.exp(lp.numpy()), np.exp(want)
        assert np.abs(p - q).max() < 0.03  # llama.cpp's kernels differ by batch shape (tests/test_llamacpp.py)
        # engine drift: transformers on the same GGUF, dequantized, teacher-forcing the same tokens
        hf = models.load(models.resolve("hf", None, quant_name="q4_1")).model
        bases = base_pass(hf, items)
        rows = drift_pass(eng, items, bases)[0]
        assert len(rows) == len(target)
        kld = np.array([r.kld for r in rows])
        assert kld.mean() < 0.05 and np.mean([r.same_top for r in rows]) >= 0.8
    finally:
        eng.close()
