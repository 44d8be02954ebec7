"""What `--model server` takes, what a server run refuses, checked before anything is sent, resolved into a `ModelPlan`.

Owns: the server engine's model args (`SERVER_ARGS`, checked) and its resolver (`resolve_server`:
the registry's refusals for the options the server, not evalkit, decides; a base URL and a
tokenizer that exists; K = min(--top-k, the server's cap)). Does not: send anything (`model`).
"""

from __future__ import annotations

import os
from pathlib import Path

from evalkit.defaults import (
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_SERVER_CONCURRENCY,
    DEFAULT_SERVER_LOGPROBS,
    DEFAULT_SERVER_RETRIES,
    DEFAULT_SERVER_TIMEOUT_S,
)
from evalkit.engines import EngineRecord
from evalkit.engines.plan import ModelPlan, ModelRequest, check_keys, parse_model_args, whole
from evalkit import envvars, redact
from evalkit.engines.llamacpp.resolve import gguf_file_type
from evalkit.errors import BadInput
from evalkit.paths import check_input_path

MAX_RUN_TIMEOUT_S = 30 * 86400  # a run's deadline (--model server run_timeout=): up to 30 days
SERVER_ARGS = {"base_url": "the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1",
               "model": "the served model's name (default: the server's first)",
               "tokenizer": "a .gguf file or tokenizer folder mapping the server's token texts to ids",
               "top_logprobs": f"the most logprobs per token the server allows (default {DEFAULT_SERVER_LOGPROBS}, "
                               "the OpenAI cap)",
               "concurrency": f"parallel requests (default {DEFAULT_SERVER_CONCURRENCY})",
               "retries": f"tries after a failed request (default {DEFAULT_SERVER_RETRIES})",
               "timeout": f"seconds a request may take, all of it (default {DEFAULT_SERVER_TIMEOUT_S})",
               "run_timeout": "seconds every request of the run may take together (default: no limit)",
               "answer_max_tokens": f"how far a prompt with checkable answers is continued "
                                    f"(default {DEFAULT_ANSWER_TOKENS})",
               "repeat_penalty": "sent as llama.cpp servers' repeat_penalty (1: none; llama-cpp-python's default 1.1)",
               "api_key_env": "the environment variable holding the API key sent as a bearer token "
                              "(default EVALKIT_API_KEY; never stored or shown)"}
# a folder `tokenizer=` names must hold one of these (transformers' own tokenizer file names)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def resolve_server(record: EngineRecord | None, ask: ModelRequest) -> ModelPlan:
    """The plan of a run through an OpenAI-compatible server: K = min(--top-k, the server's cap)."""
    assert record is not None
    model_type, top_k = ask.model_type, ask.top_k
    args = parse_model_args(ask.model_args)
    for asked, option in ((ask.quant_name, "--quant"), (ask.attention, "--attention"),
                          (ask.first_temperature is not None, "--first-temperature"), (ask.ban_openers, "--ban-openers")):
        if asked:
            raise record.refuse(option, model_type)
    if ask.kv_policy is not None and not ask.kv_policy.is_full:
        raise record.refuse("--kv-cache", model_type)
    if ask.device is not None or "device" in args:
        raise BadInput(f"--device does not apply to --model {model_type}: the server runs where it was started")
    check_keys(args, SERVER_ARGS, model_type)
    url = args.get("base_url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise BadInput(f"--model {model_type} needs --model-args base_url=http://HOST:PORT/v1 "
                       f"(got {redact.text(url) if isinstance(url, str) else url!r})")
    check_base_url(url)
    envvars.api_key(args.get("api_key_env"))  # checked now: a missing or unsendable key is one line, no work
    for key, lo, hi in (("top_logprobs", 1, 1 << 16), ("concurrency", 1, 256), ("retries", 0, 100),
                        ("timeout", 1, 86400)):
        whole(args, key, lo, hi)
    args.setdefault("answer_max_tokens", DEFAULT_ANSWER_TOKENS)
    whole(args, "answer_max_tokens", 0, 4096)
    run_timeout = args.get("run_timeout")
    if run_timeout is not None and (isinstance(run_timeout, bool) or not isinstance(run_timeout, (int, float))
                                    or not 0 < run_timeout <= MAX_RUN_TIMEOUT_S):
        raise BadInput(f"--model-args run_timeout must be a number of seconds above 0 and at most "
                       f"{MAX_RUN_TIMEOUT_S}, got {run_timeout!r}")
    tok = args.get("tokenizer")
    if tok is None:
        raise BadInput(f"--model {model_type} needs --model-args tokenizer=PATH (a .gguf file or tokenizer folder): "
                       "the chat template, and the ids of the token texts a server returns")
    check_tokenizer(Path(os.path.expanduser(str(tok))))
    k = min(top_k, int(args.get("top_logprobs") or DEFAULT_SERVER_LOGPROBS))
    return ModelPlan(
        model_type=model_type, lm_type=record.name, backend=record, args=args,
        backend_args={"top_k": k, "temperature": ask.temperature, "seed": ask.seed},
        embedded=False, label=redact.text(str(args.get("model") or url)), quant=None, dtype=None, top_k=k,
        device=None,
    )


def check_base_url(url: str) -> None:
    """Read `url` with urllib, the parser the client sends with, and register its password (`redact.register_url`:
    hidden by value wherever evalkit writes text, whatever characters it holds); BadInput, one line that
    does not show the URL, when urllib cannot read its host and port (a '/', '?' or '#' in a password
    ends the host early: those are written percent-encoded)."""
    try:
        parts = redact.register_url(url)
        ok = bool(parts.hostname)
    except ValueError:
        ok = False
    if not ok:
        raise BadInput("--model-args base_url cannot be read as http(s)://[USER:PASSWORD@]HOST[:PORT]/PATH by urllib, "
                       "which sends it (a '/', '?' or '#' in a password is written percent-encoded: %2F %3F %23); "
                       "the URL is not shown, as it may hold a password")


def check_tokenizer(path: Path) -> None:
    """Refuse a `tokenizer=` that cannot be the run's tokenizer, before anything is sent: missing,
    not a regular file or folder (a device, a FIFO: `paths.check_input_path`), a .gguf whose
    header does not read (the llama.cpp engine's check: truncated, random), another kind of
    file, or a folder holding none of `TOKENIZER_FILES`."""
    if not os.path.lexists(path):
        raise BadInput(f"--model-args tokenizer: {path} not found")
    check_input_path(path, "--model-args tokenizer=", "either")
    if path.is_dir():
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise BadInput(f"--model-args tokenizer: {path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    elif path.suffix == ".gguf":
        gguf_file_type(path)
    else:
        raise BadInput(f"--model-args tokenizer: {path} is neither a .gguf file nor a tokenizer folder")
