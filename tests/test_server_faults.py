"""What a server engine (`--model server`) does when the server misbehaves (issue 36, classes 2 and 3):
numbers no distribution holds, deadlines a slow server tries to defeat, and answers of every wrong
shape. Each ends in one line naming the server and what it did; nothing it sent is stored."""

from __future__ import annotations

import math
import time

import duckdb
import pytest

from evalkit.engines import validate
from evalkit.engines.server.client import Client, ServerError, completion, read_json, served_models
from evalkit.engines.server.model import ECHO_PROBE, EvalkitServer
from evalkit.errors import BadInput, RunFailed
from tests.fake_server import FakeServer, Reply, healthy
from tests.fake_server import completion as answer_of


@pytest.fixture(scope="module")
def words(tiny_model_dir):
    """Four token texts the tiny tokenizer maps to single ids."""
    from transformers import AutoTokenizer

    from evalkit.engines.server.model import piece_ids

    ids = piece_ids(AutoTokenizer.from_pretrained(tiny_model_dir))
    found = [t for t in ids if t.strip().isalpha() and len(t.strip()) > 2][:4]
    assert len(found) == 4
    return found


def fixed(reply: Reply, models: Reply | None = None):
    """A server answering /models well (or with `models`) and every other request with `reply`."""
    def answer(method, path, body):
        if path == "/models":
            return models or Reply({"data": [{"id": "m"}]})
        return reply
    return answer


# -- deadlines -------------------------------------------------------------------------------------


@pytest.mark.parametrize("reply", [
    Reply({"choices": [{"text": "x" * 40}]}, chunk=1, delay=0.5),  # the body, one byte every 0.5 s
    Reply({"choices": []}, trickle_headers=0.5),  # the status line and headers, one byte every 0.5 s
    Reply({"choices": []}, chunk=1, delay=0.5, length=False),  # no length: read to the end, slowly
])
def test_a_trickling_server_cannot_hold_a_request_past_its_timeout(reply):
    # issue 36: one byte every 0.5 s with timeout=2, retries=0 had not finished after 240 s
    with FakeServer(fixed(reply)) as url:
        client = Client(url, timeout=2, retries=0)
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=r"no whole answer within 2 s") as info:
            client.post("/completions", {"prompt": "p"})
        took = time.monotonic() - t0
    assert took < 3.5, took
    assert "\n" not in str(info.value)


def test_the_run_deadline_bounds_every_request_and_retry_together():
    with FakeServer(fixed(Reply({"error": "busy"}, status=503))) as url:
        client = Client(url, timeout=30, retries=50, run_timeout=1.5)
        t0 = time.monotonic()
        with pytest.raises(ServerError, match=r"run's deadline passed \(--model-args run_timeout=1.5 s\)"):
            client.post("/completions", {"prompt": "p"})
        assert time.monotonic() - t0 < 3


def test_a_slow_body_under_the_run_deadline_is_cut_at_the_deadline():
    with FakeServer(fixed(Reply({"choices": [{"text": "x" * 40}]}, chunk=1, delay=0.3))) as url:
        client = Client(url, timeout=60, retries=0, run_timeout=1.0)
        t0 = time.monotonic()
        with pytest.raises(ServerError, match="no whole answer within 1 s"):
            client.post("/completions", {"prompt": "p"})
        assert time.monotonic() - t0 < 2.5


def test_a_healthy_answer_within_the_deadline_is_read_whole():
    with FakeServer(fixed(Reply({"choices": [{"text": "ok"}]}, chunk=3, delay=0.01))) as url:
        assert Client(url, timeout=5, retries=0).post("/completions", {})["choices"][0]["text"] == "ok"


# -- shapes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw, said", [
    (b"<html>busy</html>", "not JSON"),
    (b'{"choices": [', "not JSON"),
    (b"\xff\xfe", "not UTF-8"),
    (b'{"a": 1, "a": 2}', "key 'a' twice"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deep"),
])
def test_an_answer_that_is_not_json_is_one_line(raw, said):
    with pytest.raises(ServerError, match=said) as info:
        read_json(raw, "http://h/v1/completions")
    assert "\n" not in str(info.value) and "http://h/v1/completions" in str(info.value)


@pytest.mark.parametrize("answer, said", [
    ([], "a JSON list"),
    ({}, "without choices"),
    ({"choices": []}, r'"choices": \[\]'),
    ({"choices": "x"}, '"choices": a string'),
    ({"choices": [3]}, r'"choices": \[a number'),
    ({"choices": [{"text": 3}]}, "text is a number"),
    ({"choices": [{"text": "a", "logprobs": []}]}, "logprobs are a JSON list"),
    ({"choices": [{"text": "a", "logprobs": {"tokens": "a"}}]}, "logprobs.tokens is a string"),
    ({"choices": [{"text": "a", "logprobs": {"token_logprobs": ["x"]}}]}, r"token_logprobs\[0\] is 'x'"),
    ({"choices": [{"text": "a", "logprobs": {"token_logprobs": [True]}}]}, r"token_logprobs\[0\] is True"),
    ({"choices": [{"text": "a", "logprobs": {"top_logprobs": [{"a": "x"}]}}]}, r"top_logprobs\[0\]\['a'\] is 'x'"),
    ({"choices": [{"text": "a", "logprobs": {"top_logprobs": [[1]]}}]}, r"top_logprobs\[0\] is \[1\]"),
    ({"choices": [{"text": "a", "logprobs": {"text_offset": [0.5]}}]}, r"text_offset\[0\] is 0.5"),
])
def test_every_completion_shape_is_checked(answer, said):
    with pytest.raises(ServerError, match=said) as info:
        completion(answer, "http://h/v1/completions")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("listed", [[{"id": "m"}], "m", {"data": "m"}, {"data": [{"name": "m"}]}, {"data": [3]}, None])
def test_a_models_answer_of_another_shape_is_bad_input(listed):
    # issue 36: /v1/models answering a JSON list ended in "internal error: AttributeError"
    with pytest.raises(BadInput, match="answered /models with .*--model-args model=NAME"):
        served_models(listed, "http://h/v1")


def test_a_models_list_at_load_is_one_line_exit_2(tiny_model_dir):
    with FakeServer(fixed(Reply(), models=Reply([{"id": "m"}]))) as url:
        with pytest.raises(BadInput, match="answered /models with a JSON list") as info:
            EvalkitServer(url, tokenizer=str(tiny_model_dir), retries=0, timeout=5)
    assert info.value.exit_code == 2


def test_an_http_error_body_is_shown_on_one_line():
    with FakeServer(fixed(Reply(b"line one\nline two\n\tthree", status=400))) as url:
        with pytest.raises(ServerError, match="HTTP 400: line one line two three"):
            Client(url, retries=0, timeout=5).post("/completions", {})


def test_a_connection_refused_is_one_line():
    with pytest.raises(ServerError, match=r"no answer after 1 tries \(ConnectionRefusedError") as info:
        Client("http://127.0.0.1:9/v1", retries=0, timeout=2).get("/models")
    assert "\n" not in str(info.value)


# -- the numbers: validated before anything is scored or stored --------------------------------------


def bad_after_probe(words, top):
    """A server that answers the load's echo probe well and every prompt with the first-step `top`."""
    good, bad = healthy({words[0]: -0.1}), healthy(top, text=words[0])

    def answer(method, path, body):
        probe = isinstance(body, dict) and str(body.get("prompt", "")).startswith(ECHO_PROBE)
        return (good if probe else bad)(method, path, body)
    return answer


def test_a_healthy_server_gives_checked_first_steps(tiny_model_dir, words):
    top = {words[0]: -0.3, words[1]: -2.5, words[2]: -3.0}  # 0.741 + 0.082 + 0.050
    with FakeServer(healthy(top)) as url:
        lm = EvalkitServer(url, tokenizer=str(tiny_model_dir), retries=0, timeout=5, top_k=3, top_logprobs=3,
                           temperature=1.0)
        result = lm._one("Q: a question\nA:", {"until": ["\n"], "max_gen_toks": 4}, {"prompt": "a question"})
    assert [t for _, t, _ in result.topk] == words[:3]
    assert result.metrics["top1_prob"] == pytest.approx(math.exp(-0.3))
    assert result.metrics["top3_mass"] == pytest.approx(math.exp(-0.3) + math.exp(-2.5) + math.exp(-3.0))


@pytest.mark.parametrize("values, said", [
    ([3.0, -2.5], "logprob 3 for token .* a logprob is at most 0"),  # top1_prob would be 20.09
    ([float("nan"), -2.5], "logprob nan for token .* not a finite number"),
    ([-0.1, float("-inf")], "logprob -inf"),
    ([-0.1, -0.2], "probabilities sum to 1.72"),  # 0.905 + 0.819 > 1
])
def test_impossible_numbers_fail_the_request_naming_server_prompt_and_value(tiny_model_dir, words, values, said):
    top = dict(zip(words, values))
    with FakeServer(bad_after_probe(words, top)) as url:
        lm = EvalkitServer(url, tokenizer=str(tiny_model_dir), retries=0, timeout=5, top_k=2, top_logprobs=2)
        with pytest.raises(validate.EngineOutput, match=said) as info:
            lm._one("<chat>What is the capital?</chat>", {"until": ["\n"]}, {"prompt": "What is the capital?"})
    message = str(info.value)
    assert f"the server at {url}" in message and "'What is the capital?'" in message and "\n" not in message
    assert isinstance(info.value, RunFailed)


def test_a_top_logprobs_with_a_token_twice_is_refused(tiny_model_dir, words):
    raw = ('{"choices": [{"text": "%s", "logprobs": {"tokens": ["%s"], "token_logprobs": [-0.1], '
           '"top_logprobs": [{"%s": -0.1, "%s": -3.0}]}}]}' % ((words[0],) * 4)).encode()

    def answer(method, path, body):
        return Reply({"data": [{"id": "m"}]}) if path == "/models" else Reply(raw)

    with FakeServer(answer) as url:
        with pytest.raises(ServerError, match=f"key '{words[0]}' twice"):
            Client(url, retries=0, timeout=5).post("/completions", {})


def test_a_bad_logprob_in_the_load_probe_fails_the_load(tiny_model_dir, words):
    with FakeServer(healthy({words[0]: 3.0})) as url:
        with pytest.raises(validate.EngineOutput, match=f"the server at {url} returned logprob 3.0 at position 0"):
            EvalkitServer(url, tokenizer=str(tiny_model_dir), retries=0, timeout=5)


def test_a_bad_echo_logprob_is_refused():
    lm = EvalkitServer.__new__(EvalkitServer)
    lm.base_url = "http://h/v1"
    lm._complete = lambda prompt, **body: {"logprobs": {"text_offset": [0, 4], "token_logprobs": [None, 0.7],
                                                        "top_logprobs": [None, {"a": 0.7}]}}
    with pytest.raises(validate.EngineOutput, match="prompt logprob 0.7 at position 1"):
        lm._echo("The ", "cap")


def test_a_run_against_a_server_with_positive_logprobs_fails_and_stores_nothing(invoke, tiny_model_dir, words,
                                                                                   tmp_path):
    db = tmp_path / "runs.duckdb"
    with FakeServer(bad_after_probe(words, {words[0]: 3.0, words[1]: -2.5})) as url:
        res = invoke("run", "--model", "server", "--model-args",
                     f"base_url={url},tokenizer={tiny_model_dir},retries=0,timeout=5,top_logprobs=2",
                     "--tasks", "firsttoken_en", "--limit", 2, "--db", db)
    assert res.exit_code == 1, res.output
    errors = [line.split("evalkit: error: ", 1)[1] for line in res.stderr.splitlines() if "evalkit: error: " in line]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr  # the rest is progress
    assert f"the server at {url} returned logprob 3 for token '{words[0]}' of prompt 'What is" in errors[0]
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT status FROM runs").fetchall() == [("failed",)]
    assert con.execute("SELECT count(*) FROM metrics").fetchone() == (0,)
    assert con.execute("SELECT count(*) FROM samples").fetchone() == (0,)


def test_run_timeout_is_checked_as_a_model_arg(tiny_model_dir):
    from evalkit.engines.resolve import resolve

    for bad in ("0", "-1", "nan", "inf", "true", "soon", "99999999999"):
        with pytest.raises(BadInput, match="run_timeout must be a number of seconds"):
            resolve("server", f"base_url=http://127.0.0.1:9/v1,tokenizer={tiny_model_dir},run_timeout={bad}")
    plan = resolve("server", f"base_url=http://127.0.0.1:9/v1,tokenizer={tiny_model_dir},run_timeout=2.5")
    assert plan.args["run_timeout"] == 2.5
