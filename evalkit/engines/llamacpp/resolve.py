"""Run requests for the llama.cpp and OpenAI-compatible-server engines, resolved into a `ModelPlan`.

Owns: what `--model llamacpp` and `--model server` take (their model args, checked), what
each refuses before anything loads and why (`REFUSALS`: one record per engine and option),
the GGUF file a llama.cpp run loads (the embedded SmolLM2 when none is named) and the
quantization type it records (`gguf_file_type`: the GGUF's own, Q4_1, Q8_0, Q4_K_M ...).
Does not: load or run anything (`llamacpp`, `server`), or resolve the hf and vLLM backends
(`models.resolve`, which hands these two engines to `resolve_llamacpp` / `resolve_server`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from evalkit.engines import Backend
from evalkit.engines.transformers import kvcache
from evalkit.engines.llamacpp.firststep import DEFAULT_KV, context_refusal
from evalkit.defaults import (
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_SERVER_CONCURRENCY,
    DEFAULT_SERVER_LOGPROBS,
    DEFAULT_SERVER_RETRIES,
    DEFAULT_SERVER_TIMEOUT_S,
    DEFAULT_TOLERANCE,
)
from evalkit.errors import BadInput

MAX_RUN_TIMEOUT_S = 30 * 86400  # a run's deadline (--model server run_timeout=): up to 30 days

# (engine, option) -> why the engine refuses it; the message every refusal prints
REFUSALS = {
    ("llama.cpp", "--quant"): "the --quant variants re-quantize weights inside transformers; llama.cpp runs the GGUF's "
                              "own quantization: pick the GGUF file (Q4_1, Q8_0, Q4_K_M ...) instead",
    ("llama.cpp", "--attention"): "llama.cpp does not expose attention weights (run --attention with --model hf)",
    ("llama.cpp", "--device"): "this llama.cpp build runs on the CPU",
    ("openai-server", "--quant"): "the server holds the weights: quantize what it serves",
    ("openai-server", "--attention"): "a server returns no attention weights",
    ("openai-server", "--kv-cache"): "the server owns its KV cache: set it where the server starts",
    ("openai-server", "--first-temperature"): "the first step is the server's: evalkit cannot sample it apart",
    ("openai-server", "--ban-openers"): "the first step is the server's: evalkit cannot mask it",
}
LLAMACPP_ARGS = {"model": "the .gguf file (none: the embedded SmolLM2)", "pretrained": "a folder, with gguf_file=",
                 "gguf_file": "the .gguf file in pretrained=", "n_ctx": "context cells (default: the model's, <= 8192; at least 256)",
                 "n_threads": "CPU threads (default: the usable cores)",
                 "prompt_batch": "prompts sharing one prefill and decoding loop (default 1: each as one request)",
                 "flash_attn": "llama.cpp's flash attention (default false; q8_0/q4_0 caches switch it on)",
                 "tolerance": f"opener probability left unscored per prompt (default {DEFAULT_TOLERANCE:g}, "
                              "as hf; 0: exact)",
                 "answer_max_tokens": f"how far a prompt with checkable answers is continued "
                                      f"(default {DEFAULT_ANSWER_TOKENS})"}
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
               "repeat_penalty": "sent as llama.cpp servers' repeat_penalty (1: none; llama-cpp-python's default 1.1)"}


def refuse(engine: str, option: str, model_type: str) -> BadInput:
    return BadInput(f"{option} cannot run with --model {model_type}: {REFUSALS[(engine, option)]}")


def _check_keys(args: dict[str, Any], known: dict[str, str], model_type: str) -> None:
    from evalkit.scoring.registry import suggest

    for key in args:
        if key not in known:
            raise BadInput(f"unknown --model-args key {key!r} for --model {model_type}{suggest(key, sorted(known))} "
                           f"(known: {', '.join(known)})")


def _whole(args: dict[str, Any], key: str, lo: int, hi: int) -> None:
    value = args.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi):
        raise BadInput(f"--model-args {key} must be a whole number from {lo} to {hi}, got {value!r}")


# GGUF metadata value types -> struct format of a scalar (8: string, 9: array)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_file_type(path: Path) -> str:
    """The GGUF's own quantization type, lower case as runs.quant stores it (q4_1, q8_0, q4_k_m);
    BadInput naming the path for a file that is not a GGUF or whose header does not read.

    Reads the header's key-value pairs only, up to `general.file_type` (llama.cpp's LLAMA_FTYPE
    numbering, named by the gguf package): the gguf package's full reader takes seconds on a big
    vocabulary, and this runs before the model loads."""
    import struct

    try:
        with open(path, "rb") as fh:
            data = fh.read(64 << 20)  # the header: far less than this for any vocabulary
    except OSError as exc:
        raise BadInput(f"cannot read {path}: {exc.strerror or exc}") from None
    if data[:4] != b"GGUF":
        raise BadInput(f"{path} is not a GGUF file (no GGUF magic)")
    value = None
    try:
        n_kv = struct.unpack_from("<Q", data, 16)[0]
        at = 24

        def skip(kind: int) -> int:
            nonlocal at
            if kind in _GGUF_SCALARS:
                found = struct.unpack_from("<" + _GGUF_SCALARS[kind], data, at)[0]
                at += struct.calcsize(_GGUF_SCALARS[kind])
                return found
            if kind == 8:
                at += 8 + struct.unpack_from("<Q", data, at)[0]
                return -1
            if kind == 9:
                inner, count = struct.unpack_from("<IQ", data, at)
                at += 12
                if inner in _GGUF_SCALARS:
                    at += count * struct.calcsize(_GGUF_SCALARS[inner])
                else:
                    for _ in range(count):
                        skip(inner)
                return -1
            raise ValueError(f"unknown metadata type {kind}")

        for _ in range(n_kv):
            size = struct.unpack_from("<Q", data, at)[0]
            key = data[at + 8 : at + 8 + size].decode("utf-8", "replace")
            at += 8 + size
            kind = struct.unpack_from("<I", data, at)[0]
            at += 4
            got = skip(kind)
            if key == "general.file_type":
                value = int(got)
                break
    except (struct.error, ValueError, RecursionError) as exc:
        raise BadInput(f"{path}: the GGUF header does not read ({exc})") from None
    if value is None:
        return "unknown"
    from gguf import LlamaFileType

    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()
    except ValueError:
        return f"file_type_{value}"


def resolve_llamacpp(backend: Backend, model_type: str, args: dict[str, Any], *, quant_name, device, top_k,
                     temperature, first_temperature, ban_openers, seed, kv_policy, attention):
    """The plan of a GGUF run on llama.cpp; refuses what llama.cpp cannot do (REFUSALS, the KV policies
    `kvcache.llamacpp_refusal` names), an unknown model arg, a file that is not a GGUF."""
    from evalkit.engines.resolve import DEFAULT_NAME, ModelPlan, default_model_args

    engine = backend.engine or "llama.cpp"
    if quant_name:
        raise refuse(engine, "--quant", model_type)
    if attention:
        raise refuse(engine, "--attention", model_type)
    device = str(args.pop("device")) if "device" in args else device
    if device is not None and not str(device).startswith("cpu"):
        raise refuse(engine, "--device", model_type)
    policy = kvcache.as_policy(kv_policy, f"ggml:{DEFAULT_KV}")  # none asked: llama.cpp's own default
    why = kvcache.llamacpp_refusal(policy)
    if why:
        raise BadInput(f"--kv-cache {policy.spec} cannot run with --model {model_type}: {why}")
    _check_keys(args, LLAMACPP_ARGS, model_type)
    for key in ("batch_size", "top_k", "quant", "kv_cache"):
        if key in args:
            raise BadInput(f"--model-args {key}= is set with --{key.replace('_', '-')}, not in --model-args")
    if "model" in args and ("pretrained" in args or "gguf_file" in args):
        raise BadInput("--model-args: name the GGUF either as model=FILE or as pretrained=DIR,gguf_file=FILE")
    embedded = not any(k in args for k in ("model", "pretrained", "gguf_file"))
    if embedded:
        default = default_model_args()
        path = Path(default["pretrained"]) / default["gguf_file"]
    elif "model" in args:
        path = Path(os.path.expanduser(str(args.pop("model"))))
    else:
        if "pretrained" not in args or "gguf_file" not in args:
            raise BadInput("--model-args pretrained=DIR needs gguf_file=FILE with --model llamacpp (or give model=FILE)")
        gguf = Path(str(args.pop("gguf_file")))
        path = gguf if gguf.is_absolute() else Path(os.path.expanduser(str(args.pop("pretrained")))) / gguf
        args.pop("pretrained", None)
    if not path.is_file():
        raise BadInput(f"GGUF file not found: {path}")
    file_type = gguf_file_type(path)
    _whole(args, "n_ctx", 1, 1 << 20)
    why = context_refusal(args["n_ctx"]) if "n_ctx" in args else None
    if why:
        raise BadInput(f"--model-args n_ctx: {why}")
    _whole(args, "n_threads", 1, 1024)
    _whole(args, "prompt_batch", 1, 64)
    args.setdefault("answer_max_tokens", DEFAULT_ANSWER_TOKENS)
    _whole(args, "answer_max_tokens", 0, 4096)
    args.setdefault("tolerance", DEFAULT_TOLERANCE)  # recorded in the run row
    tolerance = args["tolerance"]
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise BadInput(f"--model-args tolerance must be a probability in [0, 1), got {tolerance!r}")
    args = {"model": str(path), **args}
    backend_args = {"top_k": top_k, "temperature": temperature, "first_temperature": first_temperature,
                    "ban_openers": ban_openers or None, "probe_seed": seed, "kv_cache": policy}
    return ModelPlan(
        model_type=model_type, lm_type=backend.name, backend=backend, args=args,
        backend_args={k: v for k, v in backend_args.items() if v is not None},
        embedded=embedded, label=DEFAULT_NAME if embedded else path.name, quant=file_type, dtype=None,
        top_k=top_k, device=device, kv_policy=policy,
    )


def resolve_server(backend: Backend, model_type: str, args: dict[str, Any], *, quant_name, device, top_k,
                   temperature, first_temperature, ban_openers, seed, kv_policy, attention):
    """The plan of a run through an OpenAI-compatible server: K = min(--top-k, the server's cap)."""
    from evalkit.engines.resolve import ModelPlan

    engine = backend.engine or "openai-server"
    for asked, option in ((quant_name, "--quant"), (attention, "--attention"), (first_temperature is not None,
                          "--first-temperature"), (ban_openers, "--ban-openers")):
        if asked:
            raise refuse(engine, option, model_type)
    if kv_policy is not None and not kv_policy.is_full:
        raise refuse(engine, "--kv-cache", model_type)
    if device is not None or "device" in args:
        raise BadInput(f"--device does not apply to --model {model_type}: the server runs where it was started")
    _check_keys(args, SERVER_ARGS, model_type)
    url = args.get("base_url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise BadInput(f"--model {model_type} needs --model-args base_url=http://HOST:PORT/v1 (got {url!r})")
    for key, lo, hi in (("top_logprobs", 1, 1 << 16), ("concurrency", 1, 256), ("retries", 0, 100),
                        ("timeout", 1, 86400)):
        _whole(args, key, lo, hi)
    args.setdefault("answer_max_tokens", DEFAULT_ANSWER_TOKENS)
    _whole(args, "answer_max_tokens", 0, 4096)
    run_timeout = args.get("run_timeout")
    if run_timeout is not None and (isinstance(run_timeout, bool) or not isinstance(run_timeout, (int, float))
                                    or not 0 < run_timeout <= MAX_RUN_TIMEOUT_S):
        raise BadInput(f"--model-args run_timeout must be a number of seconds above 0 and at most "
                       f"{MAX_RUN_TIMEOUT_S}, got {run_timeout!r}")
    tok = args.get("tokenizer")
    if tok is None:
        raise BadInput(f"--model {model_type} needs --model-args tokenizer=PATH (a .gguf file or tokenizer folder): "
                       "the chat template, and the ids of the token texts a server returns")
    if not Path(os.path.expanduser(str(tok))).exists():
        raise BadInput(f"--model-args tokenizer: {tok} not found")
    k = min(top_k, int(args.get("top_logprobs") or DEFAULT_SERVER_LOGPROBS))
    return ModelPlan(
        model_type=model_type, lm_type=backend.name, backend=backend, args=args,
        backend_args={"top_k": k, "temperature": temperature, "seed": seed},
        embedded=False, label=str(args.get("model") or url), quant=None, dtype=None, top_k=k, device=None,
    )
