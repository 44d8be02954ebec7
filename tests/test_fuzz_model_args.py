"""Fuzz: `--model-args` as a user types it, through each engine's resolver (no model is loaded).

Every key an engine takes, each given any text — Unicode numerals (`²`, `½`, `١٢`, `Ⅻ`),
quotes, padding, huge numbers, NaN, separators — ends in a plan or in one `BadInput` line;
never another exception (`str.isnumeric()` once typed "²" as a number that `int()` then
refused deep in a resolver). A plan's numeric args are the ASCII text's own numbers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evalkit.engines.resolve import resolve
from evalkit.engines.server.resolve import SERVER_ARGS
from evalkit.errors import BadInput
from tests.fuzz import fuzz

NUMERALS = ["²", "½", "١٢", "٣", "Ⅻ", "一", "５", "𝟙", "⁰", "۳۴"]
EDGES = [*NUMERALS, "", " ", "'x'", '"1"', "0", "-1", "1e309", "nan", "inf", "9" * 40, "1_000", "0x10", "true",
         "None", "=", "a=b", "\t7", "7 ", "\x00"]
values = st.one_of(st.sampled_from(EDGES), st.text(max_size=8), st.integers(-2**70, 2**70).map(str),
                   st.floats(allow_nan=True, allow_infinity=True).map(repr))
HF_KEYS = ["answer_max_tokens", "tolerance", "dtype", "trust_remote_code", "revision", "max_length", "use_cache",
           "attn_implementation", "subfolder", "device_map", "max_batch_size"]


def _ends_well(model_type: str, args: str, key: str, value: str) -> None:
    try:
        plan = resolve(model_type, args)
    except BadInput as exc:
        assert "\n" not in str(exc) and str(exc).strip(), repr(str(exc))
        return
    got = plan.args.get(key)
    if isinstance(got, (int, float)) and not isinstance(got, bool):
        assert value.strip().isascii(), (key, value, got)  # a number only from ASCII text


@fuzz(60, deadline_s=30)
@given(key=st.sampled_from(HF_KEYS), value=values)
def test_hf_model_args(tiny_model_dir, key, value):
    _ends_well("hf", f"pretrained={tiny_model_dir},{key}={value}", key, value)


@fuzz(60, deadline_s=30)
@given(key=st.sampled_from(sorted(set(SERVER_ARGS) - {"base_url", "tokenizer"})), value=values)
def test_server_model_args(tiny_model_dir, key, value):
    _ends_well("server", f"base_url=http://127.0.0.1:9/v1,tokenizer={tiny_model_dir},{key}={value}", key, value)


@pytest.mark.parametrize("value", NUMERALS)
def test_a_unicode_numeral_is_never_a_number(tiny_model_dir, value):
    for key in ("answer_max_tokens", "tolerance"):
        with pytest.raises(BadInput, match=key):
            resolve("hf", f"pretrained={tiny_model_dir},{key}={value}")
