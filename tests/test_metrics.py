"""Text-level metrics, `score` and `stored_fields`, and the opener lexicon against the task data."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest

from evalkit.contract import FirstStepResult
from evalkit.scoring import firsttoken as metrics
from evalkit.scoring.firsttoken import (
    candidate_strings,
    first_unit_text,
    ft_hit,
    ft_outcome,
    opener_rate,
    score,
    stored_fields,
    top3_share,
)
from evalkit.scoring.lexicon import load_lexicon
from evalkit.scoring.text import covers, starts_with

DATA = Path(__file__).resolve().parents[1] / "tasks" / "firsttoken" / "data"
OPENERS = ["Sure", "Of course", "Great question", "I'd be happy", "好的", "当然", "首先", "是的"]


def task_docs() -> list[dict]:
    docs = []
    for path in sorted(DATA.glob("*.jsonl")):
        docs += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return docs


# ---- worked examples -----------------------------------------------------------


@pytest.mark.parametrize(
    "response, starts, expected",
    [
        ("Paris is the capital of France.", ["Paris"], 1.0),
        ("The capital is Paris.", ["Paris"], 0.0),
        ("Recursion is when a function calls itself.", ["Recursion"], 1.0),
        ("Recursive functions call themselves.", ["Recursion"], 0.0),
        ("42", ["42"], 1.0),
        ("420", ["42"], 0.0),
        ("42等于17加25。", ["42", "四十二"], 1.0),
        ("四十二。", ["42", "四十二"], 1.0),
        ("递归是一种方法。", ["递归"], 1.0),
        ("递推", ["递归"], 0.0),
        ("ＰＡＲＩＳ！", ["Paris"], 1.0),
        ("Fleeting, like a dream.", ["Ephemeral", "Short-lived", "Fleeting"], 1.0),
        ("", ["Paris"], 0.0),
    ],
)
def test_ft_hit(response, starts, expected):
    assert ft_hit(response, starts) == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("Sure! Recursion is ...", 1.0),
        ("Of course. Paris.", 1.0),
        ("Great question! The answer", 1.0),
        ("I’d be happy to help.", 1.0),
        ("好的，递归是", 1.0),
        ("当然可以。", 1.0),
        ("Surely not", 0.0),
        ("Paris.", 0.0),
        ("递归是一种方法", 0.0),
        ("", 0.0),
    ],
)
def test_opener_rate(response, expected):
    assert opener_rate(response, OPENERS) == expected


@pytest.mark.parametrize(
    "response, starts, expected",
    [
        ("Paris.", ["Paris"], "hit"),
        ("Sure, Paris.", ["Paris"], "opener"),
        ("The capital is Paris.", ["Paris"], "other"),
        ("好的，巴黎。", ["巴黎"], "opener"),
        ("巴黎。", ["巴黎"], "hit"),
        # the documented overlap: the answer 是 and the opener 是的; a hit wins
        ("是的，水在100摄氏度沸腾。", ["是"], "hit"),
        ("是的。", ["对"], "opener"),
    ],
)
def test_ft_outcome(response, starts, expected):
    doc = {"kind": "firsttoken", "prompt": "Q", "answers": starts}
    assert ft_outcome(score(doc, response, OPENERS)) == expected


def test_top3_share():
    assert top3_share(["a", "a", "b", "c", "d"]) == pytest.approx(0.8)
    assert top3_share(["sure"] * 20) == 1.0
    assert top3_share([str(i) for i in range(20)]) == pytest.approx(3 / 20)
    assert top3_share(iter(["x", "y"])) == 1.0  # any iterable
    units = ["sure"] * 8 + ["paris"] * 4 + ["the"] * 2 + ["well", "so", "i", "ok", "hmm", "yes"]
    assert top3_share(units) == pytest.approx(14 / 20)  # exactly at the 0.70 stability line


@pytest.mark.parametrize(
    "starts, expected",
    [
        (["Recursion", "Le chat", "递归"], ["Recursion", "Le", "递归"]),
        (["42", "四十二"], ["42", "四十二"]),
        (["Paris", "Paris city", " Paris "], ["Paris"]),
        (["巴黎 市"], ["巴黎 市"]),  # CJK: the whole start
        (["", "  ", "Rome"], ["Rome"]),
        ([], []),
    ],
)
def test_candidate_strings(starts, expected):
    assert candidate_strings(starts) == expected


def test_first_unit_text():
    assert first_unit_text("  Sure, I can") == "sure"
    assert first_unit_text("递归是") == "递"
    assert first_unit_text("") == ""


# ---- empty input: an error, never a silent 0 -------------------------------------


def test_empty_inputs_raise():
    with pytest.raises(ValueError):
        ft_hit("Paris", [])
    with pytest.raises(ValueError):
        opener_rate("Sure", [])
    with pytest.raises(ValueError):
        top3_share([])
    with pytest.raises(ValueError):
        top3_share(iter([]))
    with pytest.raises(ValueError):
        score({"prompt": "Q", "answers": []}, "Paris", OPENERS)
    with pytest.raises(ValueError):
        score({"prompt": "Q"}, "Paris", OPENERS)
    with pytest.raises(ValueError):
        score({"prompt": "Q", "answers": ["Paris"]}, [], OPENERS)
    with pytest.raises(ValueError):
        score({"prompt": "Q", "answers": ["Paris"]}, "Paris", [])
    with pytest.raises(TypeError):
        score({"prompt": "Q", "answers": ["Paris"]}, 42, OPENERS)
    with pytest.raises(TypeError):
        score({"prompt": "Q", "answers": ["Paris"]}, FirstStepResult(None, None, "", ""), OPENERS)


# ---- score and stored_fields on the three response shapes ---------------------------

DOC = {"kind": "firsttoken", "prompt": "What is the capital of France?", "answers": ["Paris"], "lang": "en"}


def test_score_a_string():
    values = score(DOC, "Paris is the capital.", OPENERS)
    assert values == {"ft_hit": 1.0, "opener_rate": 0.0}
    assert ft_outcome(values) == "hit"
    assert stored_fields("Paris is the capital.") == {"response": "Paris is the capital.", "first_unit": "paris"}

    values = score(DOC, "Sure! It is Paris.", OPENERS)
    assert values == {"ft_hit": 0.0, "opener_rate": 1.0}
    assert ft_outcome(values) == "opener"
    assert ft_outcome({"ft_hit": 0.0, "opener_rate": 0.0}) == "other"


def test_score_sampled_strings():
    samples = ["Sure, Paris.", "Sure! Paris.", "Paris.", "The capital is Paris.", "Well, Paris."]
    values = score(DOC, samples, OPENERS)
    # the first sample is the response; top3_share over first units sure, sure, paris, the, well
    assert values["ft_hit"] == 0.0 and values["opener_rate"] == 1.0
    assert values["top3_share"] == pytest.approx(0.8)
    assert values["unstable"] == 0.0
    assert stored_fields(samples)["response"] == "Sure, Paris."
    assert ft_outcome(values) == "opener"

    spread = ["Paris", "Rome", "Sure", "The", "Well", "I", "A", "It", "So", "Hmm"]
    values = score(DOC, tuple(spread), OPENERS)
    assert values["top3_share"] == pytest.approx(0.3)
    assert values["unstable"] == 1.0
    assert values["ft_hit"] == 1.0


def test_score_a_first_step_result():
    probe = FirstStepResult(
        text="Paris is the capital.",
        first_token_id=123,
        first_token="Par",
        first_unit="Paris",
        topk=[(123, "Par", -0.1), (7, "The", -2.5)],
        entropy=0.6,
        metrics={"ft_hit_prob": 0.8, "opener_mass": 0.05, "top3_mass": 0.9, "prior_drift": None},
    )
    values = score(DOC, probe, OPENERS)
    assert values == {"ft_hit": 1.0, "opener_rate": 0.0, "ft_hit_prob": 0.8, "opener_mass": 0.05, "top3_mass": 0.9}
    fields = stored_fields(probe)
    assert fields["response"] == "Paris is the capital."
    assert fields["first_unit"] == "Paris"  # the token-level first unit wins over the text-level one
    assert fields["first_token"] == "Par" and fields["first_token_id"] == 123
    assert fields["topk"] == probe.topk


def test_score_chinese():
    doc = {"kind": "firsttoken", "prompt": "17加25等于多少？", "answers": ["42", "四十二"], "lang": "zh"}
    assert score(doc, "42等于", OPENERS)["ft_hit"] == 1.0
    assert score(doc, "四十二。", OPENERS)["ft_hit"] == 1.0
    values = score(doc, "好的，答案是42。", OPENERS)
    assert values == {"ft_hit": 0.0, "opener_rate": 1.0}
    assert stored_fields("好的，答案是42。")["first_unit"] == "好" and ft_outcome(values) == "opener"


def test_docstring_examples():
    assert doctest.testmod(metrics).failed == 0


# ---- the lexicon and the task data ----------------------------------------------------------


def test_lexicon_loads_with_version_and_languages():
    lex = load_lexicon()
    assert lex.version and isinstance(lex.version, str)
    assert {"en", "zh"} <= set(lex.by_lang)
    for entry in ["好的", "当然", "首先", "关于", "作为一个", "感谢你的问题", "嗯", "是的"]:
        assert entry in lex.by_lang["zh"], entry
    for entry in ["Sure", "Certainly", "Of course", "Absolutely", "Great question", "Okay", "Well",
                  "As an AI", "I'd be happy", "Hello"]:
        assert entry in lex.by_lang["en"], entry
    assert len(lex.entries) == len(set(lex.entries))
    assert all(e == e.strip() and e for e in lex.entries)


def test_lexicon_entries_that_cover_others_as_text():
    """Which entries another entry covers as text (whole words; characters for Chinese): the sums
    drop them where the tokens agree too (see test_units and test_probe)."""
    entries = load_lexicon().entries
    covered = {(a, b) for a in entries for b in entries if a != b and covers(a, b)}
    assert ("Sure", "Sure thing") in covered and ("好", "好的") in covered and ("当然", "当然可以") in covered
    assert ("So", "Sorry") not in covered  # "Sorry" is not the word "So"


def test_lexicon_from_env_file(tmp_path, monkeypatch):
    path = tmp_path / "openers.yaml"
    path.write_text('version: "test-1"\nen: ["Sure"]\nzh: ["好的"]\n', encoding="utf-8")
    monkeypatch.setenv("EVALKIT_OPENERS", str(path))
    lex = load_lexicon()
    assert lex.version == "test-1" and lex.entries == ["Sure", "好的"]


def test_no_accepted_answer_is_an_opener():
    """No accepted answer of the shipped data is matched by a lexicon entry: a direct answer is
    never counted as an opener. The one overlap is the other way round: the opener 是的 begins
    with the accepted answer 是 (yes/no questions), where ft_outcome calls 是的 a hit."""
    docs = task_docs()
    assert len(docs) == 470
    entries = load_lexicon().entries
    answers = {a for d in docs for a in d["answers"]}
    assert not [(a, e) for a in answers for e in entries if starts_with(a, e)]
    overlaps = {(a, e) for a in answers for e in entries if starts_with(e, a)}
    assert overlaps == {("是", "是的")}
    yes_docs = [d for d in docs if "是" in d["answers"]]
    assert yes_docs
    for d in yes_docs:
        assert ft_outcome(score(d, "是的，没错。", entries)) == "hit"


def test_no_answer_string_begins_with_an_opener_string():
    """Distribution level: the probabilities are of strings, with no word boundary, so an opener
    string must not be a prefix of an answer's candidate string either."""
    candidates = load_lexicon().entries
    clashes = [
        (d["id"], a, o) for d in task_docs() for a in candidate_strings(d["answers"]) for o in candidates
        if a.startswith(o)
    ]
    assert clashes == []


def test_every_doc_scores_a_hit_on_its_own_answer():
    entries = load_lexicon().entries
    for d in task_docs():
        for answer in d["answers"]:
            values = score(d, f"{answer} 。", entries)
            assert values["ft_hit"] == 1.0, (d["id"], answer)
            assert values["opener_rate"] == 0.0, (d["id"], answer)
            assert ft_outcome(values) == "hit"
