"""Text-level answer starts (docs/metrics.md §1.1): normalisation, the first word, matching a start."""

from __future__ import annotations

import doctest

import pytest

from evalkit.scoring import text as units
from evalkit.scoring.text import drop_covered, first_word, is_cjk, is_punct, matched_start, normalize, starts_with


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Paris", "paris"),
        ("  Paris  is\n\tthe   capital ", "paris is the capital"),  # whitespace collapsed and stripped
        ("ＰＡＲＩＳ", "paris"),  # full-width Latin (NFKC)
        ("４２等于", "42等于"),  # full-width digits
        ("ﬁne", "fine"),  # ligature (NFKC)
        ("Straße", "strasse"),  # casefold, not lower
        ("ΣΊΣΥΦΟΣ", "σίσυφοσ"),
        ("**Sure!** Here", "sure!** here"),  # leading punctuation only
        ("...«Paris»", "paris»"),
        ("「巴黎」", "巴黎」"),  # CJK brackets are punctuation too
        ("，。！好的", "好的"),  # full-width CJK punctuation
        ("“Paris,” she said", 'paris," she said'),  # curly quotes folded to ASCII
        ("I’d be happy", "i'd be happy"),
        ("", ""),
        ("  ...  ", ""),
    ],
)
def test_normalize(text, expected):
    assert normalize(text) == expected


@pytest.mark.parametrize(
    "response, start, expected",
    [
        # English: the start ends at a word boundary
        ("Paris is the capital.", "Paris", True),
        ("paris.", "Paris", True),
        ("PARIS!", "paris", True),
        ('"Paris," she said.', "Paris", True),
        ("**Paris** is", "Paris", True),  # markdown bold: the first word stripped of punctuation is "paris"
        ("Parisian food", "Paris", False),
        ("The capital is Paris", "Paris", False),
        ("Recursion's base case", "Recursion", False),  # the apostrophe belongs to the word
        ("Surely not", "Sure", False),
        ("Sure! Here", "Sure", True),
        ("Sure thing, here", "Sure", True),
        # multi-word openers
        ("Of course! Here it is", "Of course", True),
        ("Of  course", "Of course", True),
        ("Of courses", "Of course", False),
        ("Of", "Of course", False),
        ("I’d be happy to help", "I'd be happy", True),
        ("That's a great question!", "That's a great question", True),
        ("Let's see", "Let", False),
        ("As an AI language model, I", "As an AI", True),
        # a start's own trailing punctuation is ignored
        ("Recursion is", "Recursion!", True),
        # full-width response
        ("ＰＡＲＩＳ is", "Paris", True),
        # CJK: the first k characters, k = the start's length
        ("递归是一种方法", "递归", True),
        ("递", "递归", False),
        ("递推", "递归", False),
        ("  「巴黎」是法国的首都", "巴黎", True),
        ("巴黎。", "巴黎", True),
        ("是的，水在100摄氏度沸腾。", "是", True),
        ("四十二", "四十", True),
        ("好的，我来解释", "好的", True),
        ("好", "好的", False),
        # digits: a number must end where the start ends
        ("42", "42", True),
        ("42.", "42", True),
        ("42 is the answer", "42", True),
        ("420", "42", False),
        ("42", "420", False),
        ("42等于多少", "42", True),
        ("４２等于", "42", True),
        ("42等于", "42等", True),
        # empty sides never match
        ("", "Paris", False),
        ("Paris", "", False),
        ("Paris", "!!", False),
    ],
)
def test_starts_with(response, start, expected):
    assert starts_with(response, start) is expected


@pytest.mark.parametrize("response, start", [("4.2 metres", "4"), ("42,000 people", "42"), ("3.14159", "3")])
def test_starts_with_number_continues_past_a_separator(response, start):
    assert starts_with(response, start) is False


@pytest.mark.parametrize("response, start", [("Well-known physicists agree", "Well"), ("So-called dark matter", "So")])
def test_starts_with_hyphenated_word_is_one_word(response, start):
    assert starts_with(response, start) is False


@pytest.mark.parametrize(
    "text, expected",
    [
        ("  Sure, here is", "sure"),
        ('  "Hello," world', "hello"),
        ("Paris.", "paris"),
        ("42等于", "42"),
        ("好的，我来解释", "好"),
        ("「巴黎」是", "巴"),
        ("ＰＡＲＩＳ is", "paris"),
        ("...", ""),
        ("", ""),
        ("   ", ""),
    ],
)
def test_first_word(text, expected):
    assert first_word(text) == expected


def test_matched_start_returns_the_first_match_in_order():
    assert matched_start("Sure thing!", ["Sure thing", "Sure"]) == "Sure thing"
    assert matched_start("Sure thing!", ["Sure", "Sure thing"]) == "Sure"
    assert matched_start("Paris", ["London", "Rome"]) is None
    assert matched_start("Paris", []) is None


def test_drop_covered():
    assert drop_covered(["Sure", "Sure thing", "Of course", "Su"]) == ["Sure", "Of course", "Su"]
    assert drop_covered(["So", "Sorry", "Some"]) == ["So", "Sorry", "Some"]  # words, not strings
    assert drop_covered(["好的", "好", "当然可以", "当然"]) == ["好", "当然"]
    # with tokens: dropped only where the covering string's tokens are a prefix of the covered one's
    assert drop_covered(["好", "好的"], {"好": [5], "好的": [5, 9]}) == ["好"]
    assert drop_covered(["好", "好的"], {"好": [5], "好的": [77]}) == ["好", "好的"]
    assert drop_covered(["Sure", "Sure thing"], {"Sure": [3], "Sure thing": [3, 4]}) == ["Sure"]
    assert drop_covered(["a", "a", "", "b"]) == ["a", "b"]
    assert drop_covered([]) == []


def test_character_classes():
    assert all(is_cjk(c) for c in "递归巴黎かなカナ한")
    assert not any(is_cjk(c) for c in "Paris42，。")
    assert all(is_punct(c) for c in ",.!?«»，。「」！*")
    assert not any(is_punct(c) for c in "a1递 ")


def test_docstring_examples():
    assert doctest.testmod(units).failed == 0


def _byte_bpe(corpus, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_coverage_follows_each_tokenizer():
    """One tokenizer has a token for 好的 (and for Sorry): its 好的 is not inside P(好), so both
    are summed. A bytes-only tokenizer spells 好的 as 好's bytes and more: 好 covers it. "Sure"
    covers "Sure thing" in both; "So" never covers "Sorry" (not the same word)."""
    from evalkit.engines.transformers.firststep import candidate_ids

    merged = _byte_bpe(["好的 好的 好的 好的 好 Sorry Sorry Sorry So Sure thing Sure"] * 50, 400)
    bytes_only = _byte_bpe(["x"], 257)
    strings = ["好", "好的", "Sure", "Sure thing", "So", "Sorry"]
    summed = {}
    for name, tok in (("merged", merged), ("bytes", bytes_only)):
        context = "Answer:\n"
        tokens = {s: candidate_ids(tok, context, s) for s in strings}
        summed[name] = drop_covered(strings, tokens)
    assert len(candidate_ids(merged, "Answer:\n", "好的")) == 1  # the premise of the first case
    assert summed["merged"] == ["好", "好的", "Sure", "So", "Sorry"]
    assert summed["bytes"] == ["好", "Sure", "So", "Sorry"]
