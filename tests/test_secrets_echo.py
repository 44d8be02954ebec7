"""Secrets a server sends back: the API key and a URL's password never reach a text evalkit prints,
stores or logs, whole or in any form the server may quote them in.

The rule lives in `evalkit/redact.py` (values registered as the client reads them: `envvars.api_key`,
`redact.register_url` from the server resolver and client); the choke points call it (the CLI's one
error line, `store.rows` for every run and result row, `store.spool._write`, `store.journal._dumps`,
log records, progress bars). The end-to-end test runs a server whose 4xx/5xx bodies quote the
request's Authorization header (and the password percent-encoded, JSON-escaped, in lower-case hex) and
greps the DB file, its spool, journal, the report, a Parquet export, JUnit and every command's output.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import urllib.parse

import pytest

from evalkit import redact
from tests.fake_server import FakeServer, Reply, completion

KEY = "sk-echo-KEY-71c3e9"
# a password holding each character a URL pattern stops at, or percent-encoding reads
PASSWORD = "pw'\"<> %@:Q7z"
CHARS = ["'", '"', "<", ">", " ", "%", "@", ":"]


def forms_of(secret: str) -> list[str]:
    """Independent of `redact.forms`: the spellings a grep must not find."""
    q = urllib.parse.quote(secret, safe="")
    return [secret, q, lower_hex(q), urllib.parse.quote_plus(secret, safe=""), json.dumps(secret)[1:-1]]


def lower_hex(quoted: str) -> str:
    return re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), quoted)


def echo_body(headers: dict[str, str]) -> bytes:
    """An error body that quotes what the request sent, the way a proxy's debug page might."""
    auth = headers.get("Authorization", "")
    said = {"error": f"unauthorized: Authorization: {auth}", "headers": headers}
    if auth.startswith("Basic "):
        pair = base64.b64decode(auth[6:]).decode()
        pw = pair.split(":", 1)[1]
        said["password"] = pw
        said["quoted"] = urllib.parse.quote(pw, safe="")
        said["lower"] = lower_hex(urllib.parse.quote(pw, safe=""))
        said["plus"] = urllib.parse.quote_plus(pw)
    if auth.startswith("Bearer "):
        said["quoted"] = urllib.parse.quote(auth[7:], safe="")
    text = json.dumps(said)  # JSON-escaped ...
    return (text + " raw: " + auth + " " + said.get("password", "")).encode()  # ... and as it was


def echoing(fake_holder: list, fail_on: str, after: int = 0) -> callable:
    """A server answering /models, and /completions well except `fail_on` ("echo": the prompt-logprobs
    requests get a 400; "all": every completion after the first `after` gets a 500), the error quoting
    the request."""
    served = [0]

    def answer(method, path, body):
        headers = fake_holder[0].headers[-1]
        if path == "/models":
            return Reply({"object": "list", "data": [{"id": "fake-model"}]})
        if path == "/completions":
            if fail_on == "all" and not (isinstance(body, dict) and body.get("echo")):
                served[0] += 1  # completions, not the prompt-logprobs requests
            if (fail_on == "all" and served[0] > after) or (fail_on == "echo" and isinstance(body, dict)
                                                             and body.get("echo")):
                return Reply(echo_body(headers), status=500 if fail_on == "all" else 400)
            return Reply(completion(WORD[0], {WORD[0]: -0.2}, offset=len(body.get("prompt", ""))))
        return Reply({"error": "not found"}, status=404)
    return answer


WORD: list[str] = []


@pytest.fixture
def word(tiny_model_dir):
    from transformers import AutoTokenizer

    from evalkit.engines.server.model import piece_ids

    ids = piece_ids(AutoTokenizer.from_pretrained(tiny_model_dir))
    WORD[:] = [[t for t in ids if t.strip().isalpha() and len(t.strip()) > 2][0]]
    return WORD[0]


def grep(paths, outputs, secrets) -> list[str]:
    found = []
    for secret in secrets:
        for form in forms_of(secret):
            found += [f"{p} holds {form!r}" for p in paths if form.encode() in p.read_bytes()]
            found += [f"output {i} holds {form!r}" for i, o in enumerate(outputs) if form in o]
    return found


def stored_text(path) -> str:
    """Every value of every table of a DuckDB or Parquet file, as text: their bytes may be compressed,
    so a byte grep alone could miss a stored secret."""
    import duckdb

    con = duckdb.connect()
    try:
        if path.suffix == ".parquet":
            return repr(con.execute("SELECT * FROM read_parquet(?)", [str(path)]).fetchall())
        con.execute(f"ATTACH '{path}' AS f (READ_ONLY)")
        tables = [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables "
                                            "WHERE table_catalog = 'f' AND table_type = 'BASE TABLE'").fetchall()]
        return "\n".join(repr(con.execute(f'SELECT * FROM f.main."{t}"').fetchall()) for t in tables)
    finally:
        con.close()


def test_a_server_quoting_the_secrets_back_is_never_shown_or_stored(invoke, tiny_model_dir, word, tmp_path,
                                                                   monkeypatch, caplog):
    db = tmp_path / "runs.duckdb"
    outputs: list[str] = []

    def cli(*args):
        res = invoke(*args)
        outputs.append(res.stdout + res.stderr)
        return res

    holder: list = []
    fake = FakeServer(echoing(holder, "echo"))
    holder.append(fake)
    monkeypatch.setenv("EVALKIT_API_KEY", KEY)
    caplog.set_level(logging.DEBUG)
    with fake as url:
        with_pw = url.replace("http://", "http://bob:" + PASSWORD + "@")
        args = f"base_url={with_pw},tokenizer={tiny_model_dir},retries=0,timeout=5,top_logprobs=2"
        good = cli("run", "--model", "server", "--model-args", args, "--tasks", "firsttoken_en", "--limit", 2,
                   "--name", "echo-good", "--db", db)
        assert good.exit_code == 0, good.stdout + good.stderr
    assert any(h.get("Authorization") == f"Bearer {KEY}" for h in fake.headers)  # the key was sent
    # without the key the password goes as Basic auth, and every completion's 500 quotes it
    monkeypatch.delenv("EVALKIT_API_KEY")
    holder.clear()
    fake = FakeServer(echoing(holder, "all"))
    holder.append(fake)
    with fake as url:
        with_pw = url.replace("http://", "http://bob:" + PASSWORD + "@")
        args = f"base_url={with_pw},tokenizer={tiny_model_dir},retries=0,timeout=5,top_logprobs=2"
        bad = cli("run", "--model", "server", "--model-args", args, "--tasks", "firsttoken_en", "--limit", 2,
                  "--name", "echo-bad", "--db", db)
        assert bad.exit_code == 1, bad.stdout + bad.stderr
        assert "HTTP 500" in bad.stderr and "***" in bad.stderr, bad.stderr
        assert any(h.get("Authorization", "").startswith("Basic ") for h in fake.headers)
    # a run whose results the DB cannot take: kept in a spool file (copied aside: the next write ingests it)
    import shutil

    from evalkit.store import runs as store_runs

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    holder.clear()
    fake = FakeServer(echoing(holder, "echo"))
    holder.append(fake)
    with fake as url, monkeypatch.context() as m:
        m.setattr(store_runs, "finish_run", full)
        with_pw = url.replace("http://", "http://bob:" + PASSWORD + "@")
        args = f"base_url={with_pw},tokenizer={tiny_model_dir},retries=0,timeout=5,top_logprobs=2"
        kept = cli("run", "--model", "server", "--model-args", args, "--tasks", "firsttoken_en", "--limit", 2,
                   "--name", "echo-kept", "--db", db)
    assert "kept in" in kept.stderr, kept.stderr
    spools = [p for p in tmp_path.rglob("*") if p.is_file() and p != db and "parquet" not in str(p)]
    assert spools, "no spool file"
    for p in spools:
        shutil.copy(p, tmp_path / f"copy-{p.name}")
    # a failing run of the server engine keeps no journal (it journals no batches); `store.journal._dumps`
    # scrubs every journal line of the engines that do (test_the_journal_and_the_spool_write_no_registered_secret)
    basic = base64.b64encode(f"bob:{PASSWORD}".encode()).decode()
    monkeypatch.setenv("EVALKIT_API_KEY", KEY)  # the commands below run where the key is set, too
    report, parquet, junit = tmp_path / "report", tmp_path / "parquet", tmp_path / "gate.xml"
    for args in (["runs"], ["show", "echo-good"], ["show", "echo-bad"], ["query", "SELECT * FROM runs"],
                 ["report", "--out", report], ["export", "--parquet", parquet],
                 ["compare", "echo-good", "echo-good"], ["promote", "echo-good", "--tag", "prod"], ["tags"],
                 ["gate", "--candidate", "echo-good", "--baseline", "tag:prod", "--junit", junit],
                 ["gate", "--candidate", "echo-bad", "--baseline", "tag:prod"]):
        cli(*args, "--db", db)
    outputs.append("\n".join(r.getMessage() for r in caplog.records))
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    error, = con.execute("SELECT error FROM runs WHERE name = 'echo-bad'").fetchone()
    unavailable, model_args = con.execute("SELECT unavailable, model_args FROM runs WHERE name = 'echo-good'").fetchone()
    assert con.execute("SELECT count(*) FROM runs WHERE name = 'echo-kept'").fetchone()[0] == 1  # ingested
    con.close()
    assert error and "HTTP 500" in error and "***" in error, error  # the row says what happened, secrets hidden
    assert unavailable and "HTTP 400" in unavailable and "***" in unavailable, unavailable
    assert "***" in model_args
    (tmp_path / "outputs.txt").write_text("\n".join(outputs), encoding="utf-8")  # every command's, for a grep
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name.startswith("copy-") for p in files)  # the kept run's spool file
    assert junit in files and any(p.suffix == ".parquet" for p in files) and (report / "index.html") in files
    tables = [stored_text(p) for p in files if p.suffix in (".duckdb", ".parquet")]
    assert len(tables) >= 3 and any("echo-good" in t for t in tables)  # the search reads the rows
    assert grep(files, outputs + tables, [KEY, PASSWORD, basic]) == []


@pytest.mark.parametrize("char", CHARS)
def test_a_password_with_each_character_is_hidden_by_what_urllib_reads(char):
    from evalkit.engines.server.resolve import check_base_url

    password = f"pa{char}ss{char}word9"
    url = f"http://bob:{password}@127.0.0.1:8000/v1"
    check_base_url(url)
    texts = [f"the server at {url} does not answer", json.dumps({"base_url": url}),
             f"Authorization: Basic {base64.b64encode(f'bob:{password}'.encode()).decode()}",
             *(f"echo: {form} end" for form in forms_of(password))]
    for text in texts:
        shown = redact.text(text)
        assert not any(form in shown for form in forms_of(password)), shown
        assert base64.b64encode(f"bob:{password}".encode()).decode() not in shown
    assert redact.text(f"the server at {url} x") == "the server at http://bob:***@127.0.0.1:8000/v1 x" or \
        redact.text(f"the server at {url} x") == "the server at http://***@127.0.0.1:8000/v1 x"


@pytest.mark.parametrize("url", ["http://bob:a/b@h/v1", "http://[::1/v1", "http://h:99999/v1", "http://bob:x#y@h/v1",
                                 "http://:pw@/v1"])
def test_a_base_url_urllib_cannot_read_is_one_line(invoke, tiny_model_dir, tmp_path, url):
    from tests.fuzz import error_lines

    res = invoke("run", "--model", "server", "--model-args", f"base_url={url},tokenizer={tiny_model_dir}",
                 "--tasks", "firsttoken_en", "--limit", 1, "--db", tmp_path / "x.duckdb")
    lines = error_lines(res.stderr)
    assert res.exit_code == 2 and len(lines) == 1 and "cannot be read" in lines[0], res.stderr
    assert "a/b" not in res.stderr and "x#y" not in res.stderr
    assert not (tmp_path / "x.duckdb").exists()


def test_the_journal_and_the_spool_write_no_registered_secret(tmp_path):
    from evalkit.store import journal, rows

    secret = "sk-journal-5e5e5e"
    redact.register(secret)
    line = journal._dumps({"error": f"echo {secret} and {urllib.parse.quote(secret)}", "n": 1})
    assert secret not in line and "***" in line
    assert secret not in json.dumps(rows.scrub_row({"error": secret, "unavailable": json.dumps({"x": secret})}))


def test_a_log_record_holding_a_secret_is_scrubbed(caplog):
    secret = "sk-logged-9a9a9a"
    redact.register(secret)
    redact.install_log_scrub()
    with caplog.at_level(logging.WARNING):
        logging.getLogger("some.library").warning("got %s back", f"Bearer {secret}")
    assert caplog.records and secret not in caplog.records[-1].getMessage()
