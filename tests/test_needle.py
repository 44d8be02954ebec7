"""Needle documents, needle metrics and needle plots (docs/metrics.md §1.6), with fake token counters."""

import random
import re
import unicodedata

import pytest

from evalkit.errors import BadInput
from evalkit.prompts.catalog import data_path
from evalkit.prompts.needle import (
    DEFAULT_DEPTHS,
    build_doc,
    build_grid,
    load_haystack,
    make_key,
    needle_sentence,
    question,
    split_sentences,
)
from evalkit.report.needle_plot import heatmap, policy_depth_lines, policy_heatmaps, recall_by_depth_plot
from evalkit.scoring.needle import middle_gap, needle_recall, normalize_key

# the constant stands for the chat template's overhead
WORD_COUNTER = lambda s: 30 + len(s.split())  # noqa: E731
CHAR_COUNTER = lambda s: 25 + len(s) // 3  # noqa: E731
ZH_CHAR_COUNTER = lambda s: 20 + len(s)  # noqa: E731 - roughly a token per Chinese character

COUNTERS = {
    "en": {"words": WORD_COUNTER, "chars": CHAR_COUNTER},
    "zh": {"chars": CHAR_COUNTER, "per-char": ZH_CHAR_COUNTER},
}
CASES = [(lang, name) for lang, counters in COUNTERS.items() for name in counters]


def body_sentences(doc):
    """Sentences before the question, in order."""
    body, tail = doc["prompt"].rsplit("\n\n", 1)
    assert tail == question(doc["lang"], doc["hint"], doc["depth"])
    return split_sentences(body, doc["lang"])


# --- placement ---------------------------------------------------------------


@pytest.mark.parametrize("lang,counter", CASES)
@pytest.mark.parametrize("hint", [False, True])
def test_depth_zero_puts_needle_first(lang, counter, hint):
    doc = build_doc(COUNTERS[lang][counter], lang=lang, length=512, depth=0.0, hint=hint, seed=7)
    sentences = body_sentences(doc)
    assert sentences[0] == doc["needle"] == needle_sentence(doc["key"], lang)
    assert doc["needle_index"] == 0
    assert sum(doc["needle"] in s for s in sentences) == 1


@pytest.mark.parametrize("lang,counter", CASES)
def test_depth_one_puts_needle_last_before_question(lang, counter):
    doc = build_doc(COUNTERS[lang][counter], lang=lang, length=512, depth=1.0, hint=False, seed=7)
    sentences = body_sentences(doc)
    assert sentences[-1] == doc["needle"]
    assert doc["needle_index"] == len(sentences) - 1 == doc["n_sentences"] - 1
    assert doc["prompt"].index(doc["needle"]) < doc["prompt"].index("\n\n")


@pytest.mark.parametrize("lang,counter", CASES)
def test_depth_half_puts_needle_near_middle(lang, counter):
    doc = build_doc(COUNTERS[lang][counter], lang=lang, length=1024, depth=0.5, hint=False, seed=7)
    sentences = body_sentences(doc)
    position = sentences.index(doc["needle"])
    assert position == doc["needle_index"]
    assert len(sentences) >= 10
    assert abs(position - (len(sentences) - 1) / 2) <= 1
    # and the needle sits near the middle of the text, not just of the sentence list
    share = doc["prompt"].index(doc["needle"]) / doc["prompt"].index("\n\n")
    assert 0.35 < share < 0.65


def test_needle_index_follows_depth_across_grid():
    docs = build_grid(CHAR_COUNTER, langs=["en"], lengths=[1024], depths=DEFAULT_DEPTHS,
                      hint=False, seed=3)
    positions = [body_sentences(d).index(d["needle"]) / (d["n_sentences"] - 1) for d in docs]
    for doc, position in zip(docs, positions):
        assert abs(position - doc["depth"]) <= 0.05
    assert positions == sorted(positions)


# --- lengths -----------------------------------------------------------------


@pytest.mark.parametrize("lang,counter", CASES)
@pytest.mark.parametrize("length", [256, 512, 1024, 2048, 3000])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_length_within_two_percent(lang, counter, length, depth):
    count = COUNTERS[lang][counter]
    doc = build_doc(count, lang=lang, length=length, depth=depth, hint=True, seed=1)
    assert doc["n_tokens"] == count(doc["prompt"])
    assert abs(doc["n_tokens"] - length) <= 0.02 * length
    assert doc["length"] == length
    assert doc["prompt"].count(doc["needle"]) == 1
    assert doc["prompt"].endswith(question(lang, True, depth))


def test_coarse_sentences_get_trimmed_not_the_needle():
    # a token per character: whole sentences overshoot a +-2 % window of 150
    count = lambda s: 20 + len(s)  # noqa: E731
    for depth in (0.0, 1.0):
        doc = build_doc(count, lang="en", length=150, depth=depth, hint=False, seed=2)
        assert abs(doc["n_tokens"] - 150) <= 3
        assert doc["needle"] in body_sentences(doc)
        assert doc["prompt"].endswith(question("en", False))


def test_length_too_small_raises_bad_input():
    with pytest.raises(BadInput, match="too small"):
        build_doc(WORD_COUNTER, lang="en", length=20, depth=0.5, hint=False, seed=0)
    with pytest.raises(BadInput, match="too small"):
        build_doc(CHAR_COUNTER, lang="zh", length=30, depth=0.0, hint=True, seed=0)


def test_counter_that_never_grows_raises_bad_input():
    with pytest.raises(BadInput, match="not reachable"):
        build_doc(lambda s: 40, lang="en", length=256, depth=0.5, hint=False, seed=0)


@pytest.mark.parametrize("bad", [{"lang": "fr"}, {"depth": 1.5}, {"length": 0}])
def test_invalid_arguments_raise_bad_input(bad):
    args = {"lang": "en", "length": 256, "depth": 0.5, "hint": False, "seed": 0} | bad
    with pytest.raises(BadInput):
        build_doc(WORD_COUNTER, **args)


# --- seeding -----------------------------------------------------------------


def test_same_seed_gives_identical_docs():
    a = build_grid(CHAR_COUNTER, langs=["en", "zh"], lengths=[256, 512], depths=[0.0, 0.5, 1.0],
                   hint=(False, True), seed=11)
    b = build_grid(CHAR_COUNTER, langs=["en", "zh"], lengths=[256, 512], depths=[0.0, 0.5, 1.0],
                   hint=(False, True), seed=11)
    assert a == b
    assert len({d["doc_id"] for d in a}) == len(a) == 24


def test_different_seed_gives_different_keys():
    a = build_grid(CHAR_COUNTER, langs=["en"], lengths=[256, 512], depths=DEFAULT_DEPTHS,
                   hint=False, seed=1)
    b = build_grid(CHAR_COUNTER, langs=["en"], lengths=[256, 512], depths=DEFAULT_DEPTHS,
                   hint=False, seed=2)
    assert [d["doc_id"] for d in a] == [d["doc_id"] for d in b]
    assert sum(x["key"] != y["key"] for x, y in zip(a, b)) >= len(a) - 1
    # the filler starts at a seed-dependent sentence too
    assert sum(x["prompt"][:40] != y["prompt"][:40] for x, y in zip(a[1:], b[1:])) >= len(a) // 2


def test_hint_and_plain_variants_share_the_key():
    plain = build_doc(WORD_COUNTER, lang="en", length=512, depth=0.4,
                      hint=False, seed=5)
    hinted = build_doc(WORD_COUNTER, lang="en", length=512, depth=0.4, hint=True, seed=5)
    assert plain["key"] == hinted["key"]
    assert plain["doc_id"] == "en-L512-d0.4-plain" and hinted["doc_id"] == "en-L512-d0.4-hint"
    assert "middle" in hinted["prompt"] and "middle" not in plain["prompt"].split("\n\n")[-1]


def test_doc_fields():
    doc = build_doc(CHAR_COUNTER, lang="zh", length=256, depth=0.0, hint=True, seed=0)
    assert set(doc) == {"doc_id", "lang", "depth", "length", "n_tokens", "hint", "key", "needle",
                        "needle_index", "n_sentences", "prompt", "answers"}
    assert doc["answers"] == [doc["key"]]
    assert doc["needle"] == f"编号是{doc['key']}。"
    assert doc["prompt"].endswith("请看第一句话。上文提到的编号是多少？只回答编号。")


def test_make_key_shape():
    rng = random.Random(0)
    keys = [make_key(rng) for _ in range(300)]
    assert all(re.fullmatch(r"[1-9][0-9]{3}-[0-9]{4}", k) for k in keys)
    assert len(set(keys)) > 290


# --- metrics -----------------------------------------------------------------


@pytest.mark.parametrize("response", [
    "2025-0419", "2025 0419", "２０２５-０４１９", "2025–0419", "2025_0419", "20250419",
    "The access code is 2025-0419.", "编号是２０２５０４１９。", "Code: 2025 - 0419", "2025-0419 2025-0419",
])
def test_recall_accepts_key_variants(response):
    assert needle_recall(response, "2025-0419") == 1.0


@pytest.mark.parametrize("response", [
    "2025-0418", "2024-0419", "12025-0419", "2025-04190",
    "2025.0419", "2025\n0419", "", "I do not know.",
])
def test_recall_rejects_wrong_answers(response):
    assert needle_recall(response, "2025-0419") == 0.0


def test_normalize_key_forms_agree():
    forms = ["2025-0419", "2025 0419", "２０２５-０４１９", "2025–0419", "2025_0419"]
    assert {normalize_key(f) for f in forms} == {"20250419"}
    assert normalize_key("The Code is 2025-0419.") == "the code is 20250419."


def test_recall_needs_a_key_with_digits():
    with pytest.raises(ValueError):
        needle_recall("2025-0419", "no digits here")


def test_middle_gap_worked_example():
    recall = {0.0: 1.0, 0.1: 0.9, 0.3: 0.5, 0.5: 0.25, 0.7: 0.75, 0.8: 0.0, 1.0: 0.8}
    assert middle_gap(recall) == pytest.approx(0.9 - 0.5)
    assert middle_gap({0.0: 0.0, 1.0: 0.0, 0.5: 1.0}) == pytest.approx(-1.0)


@pytest.mark.parametrize("recall,group", [
    ({0.1: 1.0, 0.5: 0.5, 0.9: 1.0}, "0.0 or 1.0"),
    ({0.0: 1.0, 0.2: 0.5, 1.0: 1.0, 0.8: 0.0}, r"\[0.3, 0.7\]"),
    ({}, "0.0 or 1.0"),
])
def test_middle_gap_empty_group_raises(recall, group):
    with pytest.raises(ValueError, match=group):
        middle_gap(recall)


# --- plots -------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def plot_rows():
    rows = []
    for lang in ("en", "zh"):
        for hint in (False, True):
            for depth in DEFAULT_DEPTHS:
                for length in (256, 512):
                    for recall in (1.0, 0.0 if 0.3 <= depth <= 0.7 else 1.0):
                        rows.append({"lang": lang, "hint": hint, "depth": depth,
                                     "length": length, "recall": recall})
    return rows


def test_heatmap_writes_png(tmp_path):
    path = heatmap(plot_rows(), tmp_path / "plots" / "needle_heatmap.png", title="needle")
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 5000


def test_recall_by_depth_plot_writes_png(tmp_path):
    path = recall_by_depth_plot(iter(plot_rows()), tmp_path / "curve.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_policy_figures_write_pngs(tmp_path):
    """KV-cache comparison: heatmaps side by side (a column per policy) and one depth line per policy."""
    rows = plot_rows()
    evicted = [{**r, "recall": 0.0 if r["depth"] < 0.5 else r["recall"]} for r in rows]
    groups = [("full", rows), ("window:256", evicted)]
    assert policy_heatmaps(groups, tmp_path / "h.png").read_bytes()[:8] == PNG_SIGNATURE
    assert policy_depth_lines(groups, tmp_path / "d.png").read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError):
        policy_heatmaps([], tmp_path / "x.png")


def test_plots_reject_empty_rows(tmp_path):
    with pytest.raises(ValueError):
        heatmap([], tmp_path / "x.png")
    with pytest.raises(ValueError):
        recall_by_depth_plot([], tmp_path / "y.png")
    assert not list(tmp_path.iterdir())


# --- haystacks ---------------------------------------------------------------


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_haystack_has_no_digits_or_needle_words(lang):
    text = data_path("needle", "data", f"haystack_{lang}.txt").read_text(encoding="utf-8")
    assert not [c for c in text if c.isdigit() or unicodedata.category(c) == "Nd"]
    lowered = text.casefold()
    for word in ("code", "key", "number", "编号", "密码", "access"):
        assert word not in lowered, word
    assert not re.search(r"[二三四五六七八九十百千万零两]", text)


def test_haystack_sizes():
    en = data_path("needle", "data", "haystack_en.txt").read_text(encoding="utf-8")
    zh = data_path("needle", "data", "haystack_zh.txt").read_text(encoding="utf-8")
    assert len(en.split()) >= 3000
    assert len(re.findall(r"[\u4e00-\u9fff]", zh)) >= 5000
    assert len(load_haystack("en")) > 100 and len(load_haystack("zh")) > 100


def test_split_sentences():
    assert split_sentences("A b. C d!\nE?  ", "en") == ["A b.", "C d!", "E?"]
    assert split_sentences("甲乙。丙丁！\n戊？", "zh") == ["甲乙。", "丙丁！", "戊？"]


def test_limit_never_drops_a_needle_length_or_depth(tiny_model_dir, tmp_path):
    """--limit caps the first-token prompts; the needle grid runs whole (every length x depth cell)."""
    import duckdb
    from click.testing import CliRunner

    from evalkit.cli import cli

    db = tmp_path / "n.duckdb"
    res = CliRunner().invoke(cli, ["run", "--model-args", f"pretrained={tiny_model_dir}", "--device", "cpu",
                                   "--tasks", "needle_en,firsttoken_en", "--needle-lengths", "128,160",
                                   "--needle-depths", "0,0.5,1", "--limit", "2", "--db", str(db)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    con = duckdb.connect(str(db), read_only=True)
    cells = con.execute("SELECT needle_length, needle_depth FROM samples WHERE task = 'needle_en' ORDER BY ALL").fetchall()
    n_first = con.execute("SELECT count(*) FROM samples WHERE task = 'firsttoken_en'").fetchone()[0]
    con.close()
    assert cells == [(length, depth) for length in (128, 160) for depth in (0.0, 0.5, 1.0)]
    assert n_first == 2
