"""Secrets: credentials in a URL are never stored or shown, and the server engine's API key is
sent to its own host only, never kept anywhere.

`evalkit/redact.py` holds the rule for URLs (`user:pass@` and secret query values shown as
`***`); `envvars.api_key` reads the key (`EVALKIT_API_KEY`, or the variable
`--model-args api_key_env=NAME` names) and the server engine's `Client` sends it as
`Authorization: Bearer` to requests of its base URL's origin only (it follows no redirect, so a
redirect elsewhere gets nothing). The end-to-end test runs a server run with both secrets and
searches the DB file's bytes and every text column, the report's files, and every command's
stdout and stderr: neither secret is found.
"""

from __future__ import annotations

import duckdb
import pytest

from evalkit import envvars, redact
from evalkit.errors import BadInput
from tests.fake_server import FakeServer, Reply, healthy

PASSWORD = "hunter2-pw-5f1c"
KEY = "sk-live-TOPSECRET-8d2e"


@pytest.mark.parametrize("url, shown", [
    ("http://bob:pw@h:8/v1", "http://***@h:8/v1"),
    ("https://bob@h/v1", "https://***@h/v1"),
    ("http://a:p@ss@h/v1", "http://***@h/v1"),  # an unencoded '@' in the password
    ("HTTP://A:B@H/V1?x=1", "HTTP://***@H/V1?x=1"),
    ("http://h/v1?api_key=abc&model=m", "http://h/v1?api_key=***&model=m"),
    ("http://h/v1?model=m&access_token=abc#f", "http://h/v1?model=m&access_token=***#f"),
    ("http://h/v1?x=mail@example.com", "http://h/v1?x=mail@example.com"),  # an '@' after the path is no user
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
])
def test_the_url_rule(url, shown):
    assert redact.text(url) == shown
    assert redact.text(f'{{"base_url": "{url}", "n": 1}}') == f'{{"base_url": "{shown}", "n": 1}}'


def test_value_reaches_every_string():
    row = {"a": "http://u:p@h/v1", "b": ["x", ("http://u:p@h",)], "c": 3, "d": None}
    assert redact.value(row) == {"a": "http://***@h/v1", "b": ["x", ("http://***@h",)], "c": 3, "d": None}


def test_the_key_variables(monkeypatch):
    monkeypatch.delenv("EVALKIT_API_KEY", raising=False)
    assert envvars.api_key() is None
    monkeypatch.setenv("EVALKIT_API_KEY", KEY)
    assert envvars.api_key() == KEY
    monkeypatch.setenv("MY_KEY", "other")
    assert envvars.api_key("MY_KEY") == "other"
    monkeypatch.setenv("MY_KEY", "has space " + KEY)
    with pytest.raises(BadInput, match="MY_KEY is set to a value evalkit cannot send") as info:
        envvars.api_key("MY_KEY")
    assert KEY not in str(info.value)
    monkeypatch.delenv("MY_KEY")
    with pytest.raises(BadInput, match="MY_KEY is not set"):
        envvars.api_key("MY_KEY")
    with pytest.raises(BadInput, match="expected the name of an environment variable"):
        envvars.api_key("1-not a name")


def test_the_key_goes_to_the_base_url_only_and_never_after_a_redirect(monkeypatch):
    from evalkit.engines.server.model import Client, ServerError

    monkeypatch.setenv("EVALKIT_API_KEY", KEY)
    other = FakeServer(lambda method, path, body: Reply({"data": [{"id": "m"}]}))
    with other as elsewhere:
        elsewhere_root = elsewhere.removesuffix("/v1")

        def answer(method, path, body):
            return Reply(b"", status=302, headers={"Location": f"{elsewhere_root}/v1/models"})

        with FakeServer(answer) as url:
            client = Client(url, retries=0, timeout=5, api_key=envvars.api_key())
            with pytest.raises(ServerError):
                client.get("/models")
        # the redirect's target saw nothing: no request, so no key
        assert other.requests == []
    assert not any(KEY in str(h) for h in other.headers)


def test_the_key_is_sent_as_a_bearer_header(monkeypatch):
    from evalkit.engines.server.model import Client

    fake = FakeServer(lambda method, path, body: Reply({"data": [{"id": "m"}]}))
    with fake as url:
        Client(url, retries=0, timeout=5, api_key=KEY).get("/models")
        Client(url, retries=0, timeout=5).get("/models")
    assert fake.headers[0].get("Authorization") == f"Bearer {KEY}"
    assert "Authorization" not in fake.headers[1]


def test_a_request_to_another_origin_carries_no_key():
    from evalkit.engines.server.model import Client

    client = Client("https://api.example.com:8443/v1", retries=0, timeout=5, api_key=KEY)
    assert client.auth_for("https://api.example.com:8443/v1/completions") == {"Authorization": f"Bearer {KEY}"}
    for elsewhere in ("http://api.example.com:8443/v1/models", "https://api.example.com/v1/models",
                      "https://api.example.com:8444/v1/models", "https://evil.example.com:8443/v1/models",
                      "https://api.example.com.evil.net:8443/v1/models"):
        assert client.auth_for(elsewhere) == {}, elsewhere
    assert Client("http://h/v1", retries=0, timeout=5).auth_for("http://h/v1/models") == {}


def _text_columns_holding(db, needle: str) -> list[str]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        found = []
        cols = con.execute("SELECT table_name, column_name FROM information_schema.columns "
                           "WHERE table_schema = 'main' AND data_type = 'VARCHAR' "
                           "AND table_name IN (SELECT table_name FROM information_schema.tables "
                           "WHERE table_type = 'BASE TABLE')").fetchall()
        for table, col in cols:
            n = con.execute(f'SELECT count(*) FROM "{table}" WHERE strpos("{col}", ?) > 0', [needle]).fetchone()[0]
            if n:
                found.append(f"{table}.{col}")
        return found
    finally:
        con.close()


def test_a_run_with_secrets_keeps_and_shows_neither(invoke, tiny_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from evalkit.engines.server.model import piece_ids

    ids = piece_ids(AutoTokenizer.from_pretrained(tiny_model_dir))
    word = [t for t in ids if t.strip().isalpha() and len(t.strip()) > 2][0]
    fake = FakeServer(healthy({word: -0.2}))
    db, out = tmp_path / "runs.duckdb", tmp_path / "report"
    monkeypatch.setenv("EVALKIT_API_KEY", KEY)
    outputs = []
    with fake as url:
        with_user = url.replace("http://", f"http://bob:{PASSWORD}@")
        res = invoke("run", "--model", "server", "--model-args",
                     f"base_url={with_user},tokenizer={tiny_model_dir},retries=0,timeout=5,top_logprobs=2",
                     "--tasks", "firsttoken_en", "--limit", 2, "--name", "secret-run", "--db", db)
        outputs.append(res.output + res.stderr)
        assert res.exit_code == 0, res.output + res.stderr
        bad = invoke("run", "--model", "server", "--model-args",  # an error naming the URL: shown redacted
                     f"base_url={with_user.replace('/v1', '/v2')}x,tokenizer={tiny_model_dir},retries=0,timeout=2,"
                     "top_logprobs=2", "--tasks", "firsttoken_en", "--limit", 1, "--db", tmp_path / "other.duckdb")
        outputs.append(bad.output + bad.stderr)
        assert bad.exit_code != 0 and "***@" in bad.stderr, bad.stderr
    assert all(h.get("Authorization") == f"Bearer {KEY}" for h in fake.headers)  # the key was sent, to its host
    for args in (["runs"], ["query", "SELECT * FROM runs"], ["report", "--out", out], ["compare", "latest", "latest"]):
        res = invoke(*args, "--db", db)
        outputs.append(res.output + res.stderr)
    files = [db, *(p for p in tmp_path.rglob("*") if p.is_file())]
    for secret in (PASSWORD, KEY):
        assert not [str(p) for p in files if secret.encode() in p.read_bytes()]
        assert not [o for o in outputs if secret in o]
        assert _text_columns_holding(db, secret) == []
    # the search sees the columns: the redacted URL is there
    assert "runs.model_args" in _text_columns_holding(db, "http://***@127.0.0.1")
