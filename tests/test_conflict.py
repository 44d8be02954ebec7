"""Conflicting facts (docs/metrics.md §1.9) and start_gap (§1.6): documents, picks, flips and derived metrics."""

from __future__ import annotations

import pytest

from evalkit.errors import BadInput
from evalkit.prompts.conflict import build_conflict_doc, build_conflict_grid
from evalkit.prompts.needle import needle_sentence, question, split_sentences
from evalkit.scoring.conflict import conflict_pick, derived_metrics, order_flip, pick_of, pick_values
from evalkit.scoring.needle import derived_metrics as needle_derived
from evalkit.scoring.needle import start_gap

WORDS = lambda s: 30 + len(s.split())  # noqa: E731  (the constant stands for the template)
CHARS = lambda s: 20 + len(s)  # noqa: E731


def sentences(doc):
    body, tail = doc["prompt"].rsplit("\n\n", 1)
    assert tail == question(doc["lang"], False)
    return split_sentences(body, doc["lang"])


@pytest.mark.parametrize("lang,count", [("en", WORDS), ("zh", CHARS)])
@pytest.mark.parametrize("length", [256, 1024])
def test_the_values_are_the_first_and_the_last_sentence(lang, count, length):
    ab = build_conflict_doc(count, lang=lang, length=length, pair=3, order="ab", seed=5)
    ba = build_conflict_doc(count, lang=lang, length=length, pair=3, order="ba", seed=5)
    for doc in (ab, ba):
        body = sentences(doc)
        assert body[0] == doc["first"] == needle_sentence(doc["first_key"], lang)
        assert body[-1] == doc["last"] == needle_sentence(doc["last_key"], lang)
        assert doc["first_key"] != doc["last_key"]
        assert abs(doc["n_tokens"] - length) <= 0.02 * length and doc["n_tokens"] == count(doc["prompt"])
        assert sum(doc["first_key"] in s or doc["last_key"] in s for s in body) == 2
    # the two orders swap the values and nothing else
    assert (ab["first_key"], ab["last_key"]) == (ba["last_key"], ba["first_key"])
    assert sentences(ab)[1:-1] == sentences(ba)[1:-1]
    assert ab["pair_id"] == ba["pair_id"] == f"{lang}-L{length}-p3"
    assert (ab["doc_id"], ba["doc_id"]) == (f"{lang}-L{length}-p3-ab", f"{lang}-L{length}-p3-ba")
    a, b = ab["first_key"].split("-"), ab["last_key"].split("-")
    assert not set(a) & set(b)  # the values differ in both halves


def test_grid_is_pair_major_so_a_limit_keeps_pairs_whole():
    docs = build_conflict_grid(WORDS, langs=["en"], lengths=[256, 512], pairs=3, seed=1)
    assert len(docs) == 3 * 2 * 2 and len({d["doc_id"] for d in docs}) == len(docs)
    first8 = docs[:8]  # 2 pairs x 2 lengths x 2 orders
    assert {d["pair"] for d in first8} == {0, 1}
    assert sorted((d["length"], d["order"]) for d in first8) == sorted([(256, "ab"), (256, "ba"), (512, "ab"),
                                                                         (512, "ba")] * 2)
    assert build_conflict_grid(WORDS, langs=["en"], lengths=[256, 512], pairs=3, seed=1) == docs
    other = build_conflict_grid(WORDS, langs=["en"], lengths=[256, 512], pairs=3, seed=2)
    assert all(x["first_key"] != y["first_key"] for x, y in zip(docs, other))


@pytest.mark.parametrize("bad", [{"order": "ca"}, {"length": 0}, {"lang": "fr"}, {"length": 20}])
def test_bad_arguments_raise_bad_input(bad):
    args = {"lang": "en", "length": 256, "pair": 0, "order": "ab", "seed": 0} | bad
    with pytest.raises(BadInput):
        build_conflict_doc(WORDS, **args)
    with pytest.raises(BadInput, match="pairs"):
        build_conflict_grid(WORDS, langs=["en"], lengths=[256], pairs=0, seed=0)


@pytest.mark.parametrize("response,pick", [
    ("1234-5678", "first"), ("The code is 9012 3456.", "last"), ("１２３４５６７８ and 9012-3456", "both"),
    ("I cannot tell.", "neither"), ("12345678 9", "first"), ("9012-34567", "neither"),
])
def test_conflict_pick(response, pick):
    assert conflict_pick(response, "1234-5678", "9012-3456") == pick
    assert pick_of(pick_values(pick)) == pick


def test_order_flip_is_about_the_value_given():
    # a model that always reads the end answers B, then A: the answer changes with the order
    assert order_flip("last", "last") and order_flip("first", "first")
    # one that always says A: first in ab, last in ba; no flip
    assert not order_flip("first", "last") and not order_flip("last", "first")
    assert not order_flip("both", "both") and not order_flip("neither", "neither")
    assert order_flip("first", "neither") and order_flip("both", "last")


def conflict_rows(spec):
    """samples rows from {length: [(pick_ab, pick_ba), ...]}; a None pick leaves that order out."""
    rows = []
    for length, pairs in spec.items():
        for i, picks in enumerate(pairs):
            for order, pick in zip(("ab", "ba"), picks):
                if pick is not None:
                    rows.append({"task": "needle_conflict_en", "doc_id": f"en-L{length}-p{i}-{order}",
                                 "conflict_pick": pick, "conflict_pair": f"en-L{length}-p{i}",
                                 "conflict_order": order, "needle_length": length})
    return rows


def test_derived_conflict_metrics_worked_example():
    rows = conflict_rows({256: [("last", "last"), ("last", "first")],  # end wins 3 of 4; one pair flips
                          512: [("first", "first"), ("both", None)]})  # a cut pair counts for picks, not flips
    got = {r["metric"]: r for r in derived_metrics("r", rows)}
    assert got["recency_index"]["value"] == pytest.approx(0.0)  # 3 of 7 last, 3 of 7 first
    assert got["order_flip_rate"]["value"] == pytest.approx(2 / 3) and got["order_flip_rate"]["n"] == 3
    assert got["last_wins@len256"]["value"] == 0.75 and got["first_wins@len256"]["value"] == 0.25
    assert got["recency_index@len256"]["value"] == pytest.approx(0.5)
    assert got["order_flip_rate@len256"]["value"] == 0.5
    assert got["recency_index@len512"]["value"] == pytest.approx(-2 / 3)
    assert got["order_flip_rate@len512"]["value"] == 1.0 and got["order_flip_rate@len512"]["n"] == 1
    assert all(r["run_id"] == "r" and r["task"] == "needle_conflict_en" for r in got.values())


def test_start_gap_worked_example():
    recall = {0.0: 0.0, 0.1: 1.0, 0.25: 1.0, 0.5: 1.0, 1.0: 0.5}
    assert start_gap(recall) == pytest.approx((1 + 1 + 0.5) / 3)  # depth 0.1 counts for neither side
    assert start_gap({0.0: 1.0, 0.5: 1.0}) == 0.0
    with pytest.raises(ValueError, match="depth 0.0"):
        start_gap({0.1: 1.0, 0.5: 1.0})
    with pytest.raises(ValueError, match=r"\[0.25, 1\]"):
        start_gap({0.0: 1.0, 0.1: 1.0})


def test_start_gap_shows_what_middle_gap_hides():
    """The 4096-token failure of the issue: only the depth-0 key is missed. middle_gap reads it as the
    edges doing worse than the middle; start_gap says the first sentence is lost."""
    rows = []
    for length in (2048, 4096):
        for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
            missed = length == 4096 and depth == 0.0
            rows.append({"task": "needle_en", "needle_depth": depth, "needle_length": length,
                         "needle_recall": 0.0 if missed else 1.0})
    got = {r["metric"]: r["value"] for r in needle_derived("r", rows)}
    assert got["middle_gap"] == pytest.approx(-0.25)
    assert got["start_gap"] == pytest.approx(0.5)
    assert got["start_gap@len4096"] == 1.0 and got["start_gap@len2048"] == 0.0
