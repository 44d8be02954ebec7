"""Fuzz: `--model-args` text through `engines.plan.parse_model_args` alone and through the
server engine's resolver (which reads no model file and opens no connection).

Every case ends in a dict or one BadInput line; a value is never an internal error (Unicode numerals,
which `str.isnumeric` accepts and `int` does not, included), and a parsed dict says what was written:
each key once, each value the text written, typed as lm-eval types it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from evalkit.engines.plan import parse_model_args
from evalkit.errors import BadInput
from tests.fuzz import fuzz, one_line

NUMERALS = ["²", "½", "٣", "５", "Ⅻ", "〇", "1_000", "0x10", "1e400", "nan", "-inf", "", " 8 ", "True", "FALSE", "0.5", "8"]
KEYS = ["pretrained", "dtype", "base_url", "tokenizer", "top_logprobs", "concurrency", "timeout", "gguf_file",
        "run_timeout", "batch_size", "x", "a-b", "é", "k k", ""]
values = st.one_of(st.sampled_from(NUMERALS), st.text(max_size=10))
parts = st.builds(lambda k, sep, v: f"{k}{sep}{v}", st.one_of(st.sampled_from(KEYS), st.text(max_size=6)),
                  st.sampled_from(["=", "==", "", " = "]), values)
texts = st.one_of(st.lists(parts, max_size=5).map(",".join), st.text(max_size=40))


def _typed_as_written(value: object, written: str) -> bool:
    written = written.strip()
    if isinstance(value, bool):
        return written.lower() == str(value).lower()
    if isinstance(value, (int, float)):
        return float(written) == value or value != value  # nan
    return value == written


@fuzz(300)
@given(text=texts)
def test_model_args_parse_or_one_line(text):
    try:
        args = parse_model_args(text)
    except BadInput as exc:
        one_line(exc)
        return
    written = [p.partition("=") for p in text.split(",") if p.strip()]
    assert list(args) == [k.strip() for k, _, _ in written]
    for (key, _, value), parsed in zip(written, args.values()):
        assert _typed_as_written(parsed, value), (key, value, parsed)


@fuzz(150)
@given(value=values, key=st.sampled_from(["top_logprobs", "concurrency", "retries", "timeout", "run_timeout",
                                          "answer_max_tokens"]))
def test_server_numbers_resolve_or_one_line(tmp_path_factory, value, key):
    from evalkit.engines.resolve import resolve

    tok = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.write_text("{}", encoding="utf-8")
    text = f"base_url=http://127.0.0.1:9/v1,tokenizer={tok},{key}={value}"
    try:
        plan = resolve("server", text)
    except BadInput as exc:
        one_line(exc)
        return
    assert plan.args[key] == parse_model_args(text)[key]
