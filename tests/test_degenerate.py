"""Degenerate output is named, never ranked (docs/metrics.md "Degenerate output"): the rule on real runs
kept as a fixture (Gemma-3-270M without its BOS answers "????"), its counts against an independent
recount, the stored flag and where it shows (run, runs, show, report, compare, gate), the upgrade gate
refusing a degenerate candidate; and every model's identity read from its own file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from evalkit.defaults import DEGENERATE_SHARE, DEGENERATE_SPECIAL_MASS, REPEAT_MAX_UNIT, REPEAT_MIN_COPIES
from evalkit.scoring.degenerate import degenerate, repeated_unit, task_rows

FIXTURE = Path(__file__).parent / "data" / "degenerate_runs.json"
GROUPS = {"firsttoken": ["firsttoken_en", "firsttoken_zh"]}


def reference_repeats(text: str) -> bool:
    """An independent reading of "one unit repeated": for each unit the text (its whitespace removed) may
    begin with, a regular expression of at least REPEAT_MIN_COPIES copies of it, then a proper prefix of it."""
    squeezed = re.sub(r"\s+", "", text)
    for size in range(1, min(REPEAT_MAX_UNIT, len(squeezed)) + 1):
        unit = squeezed[:size]
        tail = "|".join(re.escape(unit[:j]) for j in range(1, size))
        pattern = f"(?:{re.escape(unit)}){{{REPEAT_MIN_COPIES},}}" + (f"(?:{tail})?" if tail else "")
        if re.fullmatch(pattern, squeezed, re.S):
            return True
    return False


def reference_flag(samples: list[dict]) -> bool:
    """The rule restated from docs/metrics.md, on plain loops."""
    texts = [s["response"] for s in samples if s.get("response") is not None]
    bad = sum(1 for t in texts if not t.strip() or reference_repeats(t))
    masses = [s["special_mass"] for s in samples if s.get("special_mass") is not None]
    return bool(texts and bad / len(texts) > DEGENERATE_SHARE) or bool(
        masses and sum(masses) / len(masses) > DEGENERATE_SPECIAL_MASS)


@pytest.mark.parametrize("text", ["????????", "</h4></h4></h4></h", "？？？？", "ha ha ha", "25 25 25 25 ", "Paris",
                                  "??", "1000", "abcabcab", "The capital is Paris.", "。。。", "ab ab", "", "aaaaaaaaab",
                                  "123456789123456789123456789", "12345678123456781234567812"])
def test_repeated_unit_agrees_with_a_regular_expression(text):
    assert (repeated_unit(text) is not None) == reference_repeats(text)


def test_random_strings_agree_with_the_regular_expression():
    import random

    rng = random.Random(7)
    for _ in range(3000):
        unit = "".join(rng.choice("ab? 的") for _ in range(rng.randint(1, 10)))
        text = unit * rng.randint(1, 5) + "".join(rng.choice("ab") for _ in range(rng.randint(0, 3)))
        assert (repeated_unit(text) is not None) == reference_repeats(text), repr(text)


def test_a_half_is_not_more_than_half_and_specials_flag_alone():
    assert not degenerate(["Paris", "????????"]).degenerate
    assert degenerate(["Paris", "????????", ""]).degenerate
    assert degenerate([None, None], special_masses=[0.6, 0.5]).degenerate  # mean 0.55 > 0.5
    assert not degenerate([None, None], special_masses=[0.5, 0.5]).degenerate
    assert not degenerate([]).degenerate and degenerate([]).reason is None


# ------------------------------------------------------------------ real runs, kept


def fixture() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def test_the_fixture_says_how_it_was_made():
    data = fixture()
    assert data["how"] and all(run["command"].startswith("evalkit run") for run in data["runs"].values())
    nobos = data["runs"]["gemma_nobos_plain"]["samples"]
    assert sum("????" in s["response"] or "？？？？" in s["response"] for s in nobos) >= 5


@pytest.mark.parametrize("name, flagged", [("gemma_nobos_plain", True), ("gemma_bos_qa", False),
                                           ("smollm2_chat", False), ("gemma_bos_plain", True)])
def test_the_flag_on_real_runs(name, flagged):
    samples = fixture()["runs"][name]["samples"]
    rows = {r["task"]: r for r in task_rows("r", samples, GROUPS)}
    assert set(rows) == {"firsttoken", "firsttoken_en", "firsttoken_zh"}
    for task, row in rows.items():
        mine = [s for s in samples if task == "firsttoken" or s["task"] == task]
        assert row["degenerate"] == reference_flag(mine) == flagged, (task, row["reason"])
        texts = [s["response"] for s in mine]
        assert row["n"] == len(texts)
        assert row["n_repeated"] == sum(1 for t in texts if t.strip() and reference_repeats(t))
        assert row["n_empty"] == sum(1 for t in texts if not t.strip())
        assert row["special_mass"] == pytest.approx(sum(s["special_mass"] for s in mine) / len(mine))


def test_the_no_bos_reason_names_the_repeated_token():
    rows = {r["task"]: r for r in task_rows("r", fixture()["runs"]["gemma_nobos_plain"]["samples"], GROUPS)}
    assert "repeat one token or character" in rows["firsttoken_en"]["reason"]
    assert "？" in rows["firsttoken_zh"]["reason"] or "?" in rows["firsttoken_zh"]["reason"]


# ------------------------------------------------------------------ the gate, pure


def test_the_upgrade_rules_refuse_a_degenerate_candidate_that_would_pass():
    from evalkit.release.decide import RunData, decide
    from evalkit.release.rules import rule_set

    samples = {("firsttoken_en", f"d{i}"): {"ft_hit": 0.0, "opener_rate": 0.0, "ft_hit_prob": 0.01 + i / 1000}
               for i in range(200)}
    base = RunData("base", {}, samples)
    clean = RunData("cand", {}, samples)
    flagged = RunData("cand", {}, samples, degenerate={"firsttoken_en": "9 of 10 responses repeat one token"})
    assert decide(clean, base, rule_set("upgrade")).outcome == "pass"
    verdict = decide(flagged, base, rule_set("upgrade"))
    assert verdict.outcome == "fail"
    (row,) = [r for r in verdict.rows if r.status == "fail"]
    assert row.metric == "degenerate" and row.task == "firsttoken_en" and "9 of 10 responses" in row.reason
    assert decide(flagged, base, rule_set("same")).outcome == decide(clean, base, rule_set("same")).outcome


# ------------------------------------------------------------------ stored, and shown everywhere


@pytest.fixture(scope="module")
def stored(fake_run, tmp_path_factory):
    db = tmp_path_factory.mktemp("degenerate") / "runs.duckdb"
    return db, {"repeat": fake_run(db, "repeat", name="repeats", limit=20),
                "opener": fake_run(db, "opener", name="openers", limit=20),
                "other": fake_run(db, "other", name="others", limit=20)}


def test_the_run_says_so_in_one_line(invoke, tmp_path):
    res = invoke("run", "--model", "evalkit-fake", "--model-args", "mode=repeat", "--tasks", "firsttoken",
                 "--limit", "3", "--db", tmp_path / "one.duckdb", env={"HF_HUB_OFFLINE": "1"})
    assert res.exit_code == 0, res.output
    lines = [line for line in res.stderr.splitlines() if "degenerate" in line]
    assert len(lines) == 1 and lines[0].startswith("evalkit: warning:")
    assert "firsttoken_en: 3 of 3 responses repeat one token or character" in lines[0]
    clean = invoke("run", "--model", "evalkit-fake", "--model-args", "mode=hit", "--tasks", "firsttoken",
                   "--limit", "3", "--db", tmp_path / "one.duckdb", env={"HF_HUB_OFFLINE": "1"})
    assert "degenerate" not in clean.stderr


def test_the_flag_is_stored_per_task_and_shown_by_runs_and_show(invoke, stored):
    import duckdb

    db, ids = stored
    con = duckdb.connect(str(db), read_only=True)
    try:
        rows = con.execute("SELECT run_id, task, n, n_repeated, degenerate FROM degenerate ORDER BY run_id, task"
                           ).fetchall()
        view = con.execute("SELECT DISTINCT task, degenerate FROM leaderboard WHERE run_id = ?", [ids["repeat"]]
                           ).fetchall()
    finally:
        con.close()
    assert ("firsttoken_en" in {r[1] for r in rows}) and all(r[4] == (r[0] == ids["repeat"]) for r in rows)
    assert all(r[3] == r[2] == 20 for r in rows if r[0] == ids["repeat"] and r[1] != "firsttoken")
    assert {d for _, d in view} == {True}
    listing = invoke("runs", "--db", db).stdout
    (line,) = [ln for ln in listing.splitlines() if ids["repeat"] in ln]
    assert "⚠ firsttoken" in line
    assert not any("⚠" in ln for ln in listing.splitlines() if ids["other"] in ln)
    shown = invoke("show", ids["repeat"], "--db", db).stdout
    assert re.search(r"degenerate: .*⚠ firsttoken_en: 20 of 20 responses repeat", shown)


def test_the_report_marks_the_row_and_bolds_none_of_it(invoke, stored, tmp_path):
    db, ids = stored
    res = invoke("report", "--runs", f"{ids['repeat']},{ids['opener']}", "--out", tmp_path / "r", "--db", db)
    assert res.exit_code == 0, res.output
    md = (tmp_path / "r" / "summary.md").read_text(encoding="utf-8")
    marked = [ln for ln in md.splitlines() if ln.startswith("|") and "⚠ degenerate" in ln]
    assert marked and not any("**" in ln for ln in marked)  # its opener_rate of 0 would be "best"
    assert "degenerate output, not ranked" in md


def test_compare_notes_it(invoke, stored):
    db, ids = stored
    out = invoke("compare", ids["other"], ids["repeat"], "--db", db).stdout
    assert re.search(rf"note: B \({ids['repeat']}\) is degenerate output on firsttoken_en", out)
    data = json.loads(invoke("compare", ids["other"], ids["repeat"], "--db", db, "--format", "json").stdout)
    assert "firsttoken_en" in data["degenerate_b"] and not data["degenerate_a"]


def test_the_upgrade_gate_fails_a_degenerate_candidate_and_the_same_gate_notes_it(invoke, stored):
    db, ids = stored
    res = invoke("gate", "--candidate", ids["repeat"], "--baseline", ids["other"], "--rules", "upgrade",
                 "--db", db, "--no-record")
    assert res.exit_code == 1, res.stdout
    assert re.search(r"\| \*\*FAIL\*\* \| threshold \| firsttoken_en \| degenerate \|", res.stdout)
    assert "the upgrade rules pass no degenerate candidate" in res.stdout
    # the two runs' quality metrics are equal: without the flag the upgrade rules would not fail it
    clean = invoke("gate", "--candidate", ids["other"], "--baseline", ids["other"], "--rules", "upgrade",
                   "--db", db, "--no-record")
    assert clean.exit_code != 1
    same = invoke("gate", "--candidate", ids["repeat"], "--baseline", ids["other"], "--db", db, "--no-record")
    assert f"Note: the candidate {ids['repeat']} is degenerate output on firsttoken_en" in same.stdout
    assert "| degenerate |" not in same.stdout


# ------------------------------------------------------------------ the model's identity


def test_identity_of_the_default_gguf_against_the_gguf_package():
    from gguf import GGUFReader, LlamaFileType

    from evalkit.engines.modelid import model_identity
    from evalkit.engines.plan import default_model_args

    args = default_model_args()
    ident = model_identity(args)
    fields = GGUFReader(str(Path(args["pretrained"]) / args["gguf_file"])).fields
    assert ident.arch == fields["general.architecture"].contents()
    assert ident.file_type == LlamaFileType(fields["general.file_type"].contents()).name.removeprefix("MOSTLY_")
    assert ident.file_type == "Q4_1" and ident.arch == "llama"


def test_identity_of_gemma_on_both_engines_args():
    from tests.gemma import gemma_path, missing

    if missing():
        pytest.skip(missing())
    from evalkit.engines.modelid import model_identity

    path = gemma_path()
    expected = ("gemma-3-270M", "gemma3", "Q4_K_M")
    for args in ({"model": str(path)}, {"pretrained": str(path.parent), "gguf_file": path.name}):
        ident = model_identity(args)
        assert (ident.name, ident.arch, ident.file_type) == expected


def test_identity_of_a_model_folder_reads_its_config(tmp_path):
    from evalkit.engines.modelid import model_identity

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(
        {"_name_or_path": "Qwen/Qwen2.5-0.5B", "model_type": "qwen2", "torch_dtype": "bfloat16"}))
    ident = model_identity({"pretrained": str(tmp_path / "m")})
    assert (ident.name, ident.arch, ident.file_type) == ("Qwen2.5-0.5B", "qwen2", "bfloat16")
    (tmp_path / "m" / "config.json").write_text("not json")
    assert model_identity({"pretrained": str(tmp_path / "m")}).name == "m"  # never raises
    assert model_identity({"pretrained": "org/some-model"}).name == "some-model"


def test_the_run_row_names_every_model_as_its_file_does():
    from evalkit.engines.resolve import resolve
    from evalkit.runner.execute import identity_columns

    assert identity_columns(resolve()) == {"model_name": "SmolLM2-135M-Instruct", "model_arch": "llama",
                                           "model_file_type": "Q4_1", "quant": "q4_1"}
    from tests.gemma import gemma_path, missing

    if missing():
        pytest.skip(missing())
    path = gemma_path()
    expected = {"model_name": "gemma-3-270M", "model_arch": "gemma3", "model_file_type": "Q4_K_M", "quant": "q4_k_m"}
    assert identity_columns(resolve("llamacpp", f"model={path}")) == expected
    assert identity_columns(resolve("hf", f"pretrained={path.parent},gguf_file={path.name}")) == expected
    # an explicit --quant stays what the row's quant says
    assert identity_columns(resolve("hf", f"pretrained={path.parent},gguf_file={path.name}",
                                    quant_name="bf16"))["quant"] == "bf16"
