"""Fuzz: the server protocol (`--model server`) against a scripted server on 127.0.0.1: generated JSON
bodies (well-formed answers with values and shapes mutated, and arbitrary JSON), status codes,
headers (Content-Length that lies, odd types), the body cut into chunks with delays, and bytes.

Every request ends in a checked first step or in one of evalkit's named errors on one line, within
its deadline: no request outlives `timeout` by more than the scheduler's slack."""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evalkit.engines import validate
from evalkit.engines.server.client import served_models
from evalkit.engines.server.model import ECHO_PROBE, EvalkitServer
from evalkit.contract import FirstStepResult
from evalkit.errors import BadInput
from tests.fake_server import FakeServer, Reply, completion
from tests.fuzz import fuzz, one_line

TIMEOUT = 1  # seconds a request may take (the client's deadline)
SLACK = 1.0  # seconds past it a request may end (thread scheduling on a loaded machine)


class Script:
    """The fake server's current reply: the load's probe is answered well, every other request by `reply`."""

    def __init__(self, words):
        self.reply = Reply({"choices": [{"text": ""}]})
        self.good = completion(words[0], {words[0]: -0.1})

    def __call__(self, method, path, body):
        if path == "/models":
            return Reply({"data": [{"id": "m"}]})
        if isinstance(body, dict) and str(body.get("prompt", "")).startswith(ECHO_PROBE):
            return Reply(self.good)
        return self.reply


@pytest.fixture(scope="module")
def words(tiny_model_dir):
    from transformers import AutoTokenizer

    from evalkit.engines.server.model import piece_ids

    ids = piece_ids(AutoTokenizer.from_pretrained(tiny_model_dir))
    return [t for t in ids if t.strip().isalpha() and len(t.strip()) > 2][:6]


@pytest.fixture(scope="module")
def served(tiny_model_dir, words):
    script = Script(words)
    with FakeServer(script) as url:
        lm = EvalkitServer(url, tokenizer=str(tiny_model_dir), retries=0, timeout=TIMEOUT, top_k=5, top_logprobs=5,
                           temperature=1.0)
        yield lm, script


# -- generated answers --------------------------------------------------------------------------------

finite = st.floats(-30, 0, allow_nan=False)
odd_numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**20, 10**20), st.booleans(),
                        st.none(), st.text(max_size=4))
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.floats(), st.text(max_size=5)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                   st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                           max_leaves=12)


@st.composite
def answers(draw, words):
    """A completion answer: well-formed with probability ~1/3, else with one part mutated."""
    tops = draw(st.lists(st.dictionaries(st.sampled_from(words), st.one_of(finite, finite, odd_numbers), max_size=5),
                         min_size=0, max_size=3))
    n = len(tops)
    lp = {"tokens": draw(st.lists(st.sampled_from(words), min_size=n, max_size=n)),
          "token_logprobs": draw(st.lists(st.one_of(finite, st.none()), min_size=n, max_size=n)),
          "top_logprobs": tops,
          "text_offset": list(range(n))}
    choice = {"text": draw(st.text(max_size=10)), "logprobs": lp}
    mutation = draw(st.sampled_from(["none", "none", "value", "drop", "logprobs", "choices", "top", "any"]))
    if mutation == "value":
        lp[draw(st.sampled_from(sorted(lp)))] = draw(json_values)
    elif mutation == "drop":
        lp.pop(draw(st.sampled_from(sorted(lp))))
    elif mutation == "logprobs":
        choice["logprobs"] = draw(json_values)
    elif mutation == "choices":
        return {"choices": draw(st.one_of(json_values, st.lists(json_values, max_size=2)))}
    elif mutation == "top":
        choice["text"] = draw(json_values)
    elif mutation == "any":
        return draw(json_values)
    return {"choices": [choice]}


def _end(lm, context="Q: x\nA:", doc=None):
    t0 = time.monotonic()
    try:
        result = lm._one(context, {"until": ["\n"], "max_gen_toks": 4},
                         doc or {"kind": "firsttoken", "prompt": "x", "answers": ["Paris", "巴黎"]})
    except Exception as exc:  # noqa: BLE001 - anything not named and one line is a finding
        one_line(exc)
        result = None
    took = time.monotonic() - t0
    assert took < TIMEOUT + SLACK, f"the request took {took:.1f} s, past its deadline of {TIMEOUT} s"
    if result is not None:
        assert isinstance(result, FirstStepResult)
        validate.check_result(result, source="again", prompt="x")
        assert all(math.isfinite(v) for v in result.metrics.values())
    return result


@fuzz(60, deadline_s=TIMEOUT + 2 * SLACK)
@given(data=st.data())
def test_generated_answers(served, words, data):
    lm, script = served
    script.reply = Reply(data.draw(answers(words)))
    _end(lm)


@fuzz(40, deadline_s=TIMEOUT + 2 * SLACK)
@given(body=st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode()),
                      st.just(b"[" * 50_000), st.just(b'{"choices": [{"text": NaN}]}')),
       status=st.sampled_from([200, 200, 200, 201, 204, 301, 400, 404, 418, 429, 500, 503]))
def test_arbitrary_bodies_and_statuses(served, body, status):
    lm, script = served
    script.reply = Reply(body, status=status)
    _end(lm)


@fuzz(20, deadline_s=TIMEOUT + 2 * SLACK)
@given(data=st.data(),
       length=st.one_of(st.none(), st.integers(-5, 400).map(str), st.sampled_from(["abc", "", "1e3", "99999999999"])),
       extra=st.dictionaries(st.sampled_from(["Content-Type", "Transfer-Encoding", "Content-Encoding", "X-Odd"]),
                             st.sampled_from(["text/html", "chunked", "gzip", "identity", "", "\x7f"]), max_size=2),
       chunk=st.integers(0, 40),
       delay=st.one_of(st.just(0.0), st.just(0.0), st.floats(0.0, 0.25)),
       trickle=st.one_of(st.just(0.0), st.just(0.0), st.just(0.0), st.floats(0.0, 0.05)))
def test_headers_chunking_and_delays(served, words, data, length, extra, chunk, delay, trickle):
    lm, script = served
    body = json.dumps(data.draw(answers(words))).encode()
    headers = dict(extra)
    if length is not None:
        headers["Content-Length"] = length
    script.reply = Reply(body, headers=headers, chunk=chunk, delay=delay, trickle_headers=trickle,
                         length=length is None and data.draw(st.booleans()))
    _end(lm)


@fuzz(100)
@given(listed=json_values)
def test_models_answers(listed):
    try:
        ids = served_models(listed, "http://h/v1")
    except BadInput as exc:
        one_line(exc)
        return
    assert ids and all(i is None or isinstance(i, str) for i in ids)
