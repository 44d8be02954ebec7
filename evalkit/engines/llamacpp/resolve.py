"""What `--model llamacpp` takes, what llama.cpp refuses, checked before anything loads, resolved into a `ModelPlan`.

Owns: the llama.cpp engine's model args (`LLAMACPP_ARGS`, checked), its resolver
(`resolve_llamacpp`: the registry's refusals for `--quant`, `--attention`, `--device`, and the KV
policies llama.cpp cannot run, `llamacpp_refusal`), the GGUF file a run loads (the embedded
SmolLM2 when none is named) and the quantization type it records (`gguf_file_type`: the GGUF's
own, Q4_1, Q8_0, Q4_K_M ...). Does not: load or run anything (`model`, `firststep`).
"""

from __future__ import annotations

import os
from pathlib import Path

from evalkit.defaults import DEFAULT_ANSWER_TOKENS, DEFAULT_TOLERANCE
from evalkit.engines import EngineRecord, kvpolicy
from evalkit.engines.kvpolicy import GGML_TYPES, KVPolicy
from evalkit.engines.llamacpp.firststep import DEFAULT_KV, context_refusal
from evalkit.engines.plan import (
    DEFAULT_NAME,
    ModelPlan,
    ModelRequest,
    check_keys,
    default_model_args,
    parse_model_args,
    whole,
)
from evalkit.errors import BadInput

LLAMACPP_ARGS = {"model": "the .gguf file (none: the embedded SmolLM2)", "pretrained": "a folder, with gguf_file=",
                 "gguf_file": "the .gguf file in pretrained=", "n_ctx": "context cells (default: the model's, <= 8192; at least 256)",
                 "n_threads": "CPU threads (default: the usable cores)",
                 "prompt_batch": "prompts sharing one prefill and decoding loop (default 1: each as one request)",
                 "flash_attn": "llama.cpp's flash attention (default false; q8_0/q4_0 caches switch it on)",
                 "tolerance": f"opener probability left unscored per prompt (default {DEFAULT_TOLERANCE:g}, "
                              "as hf; 0: exact)",
                 "answer_max_tokens": f"how far a prompt with checkable answers is continued "
                                      f"(default {DEFAULT_ANSWER_TOKENS})",
                 "first_char": "true|false: the first-character distribution over the whole vocabulary "
                               "(first_char_topk, for comparisons across tokenizers; default false)",
                 "add_bos_token": "true|false: feed the BOS or not, whatever the GGUF declares "
                                  "(default: tokenizer.ggml.add_bos_token)",
                 "lead_space": "true|false: count the answers after leading whitespace in ft_hit_prob, "
                               "opener_mass and answer_prob (default true; docs/metrics.md)"}


def llamacpp_refusal(policy: KVPolicy) -> str | None:
    """Why llama.cpp cannot run `policy` (None: it can: `full`, an f32 cache, and `ggml:TYPE`)."""
    if policy.is_full or policy.kind == "ggml":
        return None
    if policy.evicts:
        return ("llama.cpp removes cached positions per sequence between decodes, not per query inside a "
                "prefill, so a window evicted as docs/metrics.md §1.10 defines it would need a token-by-token "
                "prefill; run it with --model hf")
    return (f"{policy.spec} is a transformers cache; llama.cpp rounds its cache with its own types: "
            f"--kv-cache ggml:{'|'.join(GGML_TYPES)}")


def gguf_file_type(path: Path) -> str:
    """The GGUF's own quantization type, lower case as runs.quant stores it (q4_1, q8_0, q4_k_m);
    BadInput naming the path for a file that is not a GGUF or whose header does not read.

    Reads the header's key-value pairs only, up to `general.file_type` (`engines.modelid`): the
    gguf package's full reader takes seconds on a big vocabulary, and this runs before the model loads."""
    from evalkit.engines.modelid import file_type_name, gguf_metadata

    return file_type_name(gguf_metadata(path, ("general.file_type",)).get("general.file_type")).lower()


def resolve_llamacpp(record: EngineRecord | None, ask: ModelRequest) -> ModelPlan:
    """The plan of a GGUF run on llama.cpp; refuses what llama.cpp cannot do (the record's refusals, the KV
    policies `llamacpp_refusal` names), an unknown model arg, a file that is not a GGUF."""
    assert record is not None
    model_type, top_k = ask.model_type, ask.top_k
    args = parse_model_args(ask.model_args)
    if ask.quant_name:
        raise record.refuse("--quant", model_type)
    if ask.attention:
        raise record.refuse("--attention", model_type)
    device = str(args.pop("device")) if "device" in args else ask.device
    if device is not None and not str(device).startswith("cpu"):
        raise record.refuse("--device", model_type)
    policy = kvpolicy.as_policy(ask.kv_policy, f"ggml:{DEFAULT_KV}")  # none asked: llama.cpp's own default
    why = llamacpp_refusal(policy)
    if why:
        raise BadInput(f"--kv-cache {policy.spec} cannot run with --model {model_type}: {why}")
    check_keys(args, LLAMACPP_ARGS, model_type)
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
    whole(args, "n_ctx", 1, 1 << 20)
    why = context_refusal(args["n_ctx"]) if "n_ctx" in args else None
    if why:
        raise BadInput(f"--model-args n_ctx: {why}")
    whole(args, "n_threads", 1, 1024)
    whole(args, "prompt_batch", 1, 64)
    args.setdefault("answer_max_tokens", DEFAULT_ANSWER_TOKENS)
    whole(args, "answer_max_tokens", 0, 4096)
    args.setdefault("tolerance", DEFAULT_TOLERANCE)  # recorded in the run row
    tolerance = args["tolerance"]
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise BadInput(f"--model-args tolerance must be a probability in [0, 1), got {tolerance!r}")
    args = {"model": str(path), **args}
    backend_args = {"top_k": top_k, "temperature": ask.temperature, "first_temperature": ask.first_temperature,
                    "ban_openers": ask.ban_openers or None, "probe_seed": ask.seed, "kv_cache": policy}
    return ModelPlan(
        model_type=model_type, lm_type=record.name, backend=record, args=args,
        backend_args={k: v for k, v in backend_args.items() if v is not None},
        embedded=embedded, label=DEFAULT_NAME if embedded else path.name, quant=file_type, dtype=None,
        top_k=top_k, device=device, kv_policy=policy,
    )
