"""What `--model hf` takes, checked before anything loads, resolved into a `ModelPlan`.

Owns: the transformers engine's resolver (`resolve_hf`: the embedded SmolLM2 when no model is
named, `--quant`, `--kv-cache`, `--attention`, tolerance and the first-step options), the model
args every lm-eval model type of the Hugging Face kind takes and their checks (`lm_eval_args`,
shared with vLLM and with lm-eval model types evalkit does not wrap: `resolve_other`), and the
checks of an hf model made before anything loads (`check_hf_model`: its local files read with
their own parsers — a GGUF header, config.json, the architecture a causal LM — and every model
arg one that HFLM, evalkit's subclass or `from_pretrained` takes).
Does not: load or run the model (`model`), or define the `--quant` variants (`quant`).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import re
import warnings
from pathlib import Path
from typing import Any

from evalkit.defaults import DEFAULT_ANSWER_TOKENS, DEFAULT_TOLERANCE
from evalkit import memo
from evalkit.engines import EngineRecord, engine_for, kvpolicy
from evalkit.engines.plan import (
    DEFAULT_NAME,
    ModelPlan,
    ModelRequest,
    default_model_args,
    is_local,
    parse_model_args,
)
from evalkit.engines.transformers import offline, quant, quantize
from evalkit.errors import BadInput
from evalkit.labels import model_label
from evalkit.loaderrors import loading
from evalkit.paths import check_input_path, read_input

MAX_CONFIG_BYTES = 16 << 20  # a model's config.json: kB; far larger is not one

# model args that say which model to load: with none of them, `hf` runs the embedded SmolLM2
IDENTITY_ARGS = ("pretrained", "gguf_file", "tokenizer", "peft", "delta")


def lm_eval_args(record: EngineRecord | None, ask: ModelRequest) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model args of an lm-eval model type of the Hugging Face kind (pretrained=, dtype=, device= ...),
    checked: (args with the embedded model's filled in, what else the plan needs: device, policy, quant,
    embedded). Refuses what only an in-process hf model honours (`--quant`, a `--kv-cache` policy other
    than full, `--attention`) for every other model type, and what no model type takes in --model-args."""
    model_type, quant_name, device = ask.model_type, ask.quant_name, ask.device
    hf = bool(record and record.in_process_hf)
    quant.check(quant_name, in_process_hf=hf, model_type=model_type, device=device)
    policy = ask.kv_policy or kvpolicy.FULL
    if policy.kind == "ggml":
        raise BadInput(f"--kv-cache {policy.spec} is one of llama.cpp's own cache types: it runs with --model llamacpp")
    if not policy.is_full and not hf:
        raise BadInput(f"--kv-cache {policy.spec} applies to the hf backend only (got --model {model_type})")
    kvpolicy.check_available(policy)
    args = parse_model_args(ask.model_args)
    if "device" in args:  # the device is the plan's, given to the backend once
        if device is not None and str(args["device"]) != str(device):
            raise BadInput(f"--device {device} and --model-args device={args['device']} disagree")
        device = str(args.pop("device"))
        quant.check(quant_name, in_process_hf=hf, model_type=model_type, device=device)
    if ask.attention and not hf:
        raise BadInput(f"--attention applies to the hf backend only (got --model {model_type}): "
                       "attention weights are read inside this process")
    if ask.attention and "attn_implementation" in args:
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
    return args, {"device": device, "policy": policy, "quant": quant_name, "embedded": embedded}


def lm_eval_plan(record: EngineRecord | None, ask: ModelRequest, args: dict[str, Any], checked: dict[str, Any],
                 backend_args: dict[str, Any], stored_k: int | None) -> ModelPlan:
    """The plan of an lm-eval model type of the Hugging Face kind, from its checked args (`lm_eval_args`)."""
    embedded, quant_name = checked["embedded"], checked["quant"]
    hf = bool(record and record.in_process_hf)
    return ModelPlan(
        model_type=ask.model_type,
        lm_type=record.name if record else ask.model_type,
        backend=record,
        args=args,
        backend_args={k: v for k, v in backend_args.items() if v is not None},
        embedded=embedded,
        label=DEFAULT_NAME if embedded else model_label(ask.model_type, args),
        quant=quant_name,
        dtype=quant.dtype(quant_name, args.get("dtype"), embedded=embedded),
        top_k=stored_k,
        device=checked["device"],
        kv_policy=checked["policy"] if hf else None,
    )


# lm-eval arguments HFLM takes that evalkit-hf never uses: said once per process (`say_ignored`), never
# dropped silently
HF_IGNORED = {
    "max_batch_size": "evalkit-hf sizes its own batches (--batch-size auto derives them from the model's "
                      "shapes), so lm-eval's batch-size search that reads it never runs",
    "think_end_token": "it applies to lm-eval's generate_until, which evalkit-hf's first step replaces",
    "truncation": "evalkit truncates no prompt (one that does not fit the context is refused)",
}
_said: set[str] = set()


def say_ignored(args: dict[str, Any], ignored: dict[str, str], engine: str) -> list[str]:
    """One note on stderr for each model arg in `ignored` the args give (once per process); the notes."""
    import sys

    notes = [f"evalkit: note: --model-args {key} is an lm-eval argument {engine} does not use: {why}"
             for key, why in ignored.items() if key in args and key not in _said]
    for key in ignored:
        if key in args:
            _said.add(key)
    for note in notes:
        print(note, file=sys.stderr, flush=True)
    return notes


def resolve_hf(record: EngineRecord | None, ask: ModelRequest) -> ModelPlan:
    """The plan of a run on transformers in this process (`--model hf`): with no model named in the
    model args (none of IDENTITY_ARGS), the embedded SmolLM2, the other model args applied to it."""
    args, checked = lm_eval_args(record, ask)
    say_ignored(args, HF_IGNORED, "evalkit-hf")
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
    policy = checked["policy"]
    backend_args = {"quant": checked["quant"], "top_k": ask.top_k, "temperature": ask.temperature,
                    "first_temperature": ask.first_temperature, "ban_openers": ask.ban_openers,
                    "probe_seed": ask.seed, "attention": True if ask.attention else None}
    if not policy.is_full:  # `full` leaves the backend's arguments as they were before policies
        backend_args["kv_cache"] = policy  # the resolved policy itself, not its text
    check_hf_model(args)
    return lm_eval_plan(record, ask, args, checked, backend_args, ask.top_k)


def resolve_other(record: EngineRecord | None, ask: ModelRequest) -> ModelPlan:
    """The plan of an lm-eval model type evalkit does not wrap: its own model args, checked as lm-eval's
    hf-style ones, and none of the options only evalkit's engines honour."""
    args, checked = lm_eval_args(record, ask)
    if ask.first_temperature is not None or ask.ban_openers:
        raise BadInput(f"--first-temperature and --ban-openers apply to the hf backend only (got --model {ask.model_type})")
    return lm_eval_plan(record, ask, args, checked, {}, None)


def check_hf_model(args: dict[str, Any]) -> None:
    """Refuse (BadInput, one line naming the path or the key) what would fail only once the hf
    model loads: a local model whose files do not read (`model_config`), or a model arg none
    of HFLM, evalkit's subclass, `from_pretrained` or the model's config takes (`hf_model_keys`).
    A hub id is not checked: its config is not here to say which keys it takes.

    Both name lists cost seconds of imports; they are remembered on disk (`memo.names`) for as long
    as the packages, evalkit's model class and the model's config file are the ones they came from,
    so a run with a bad key is refused in under a second from the second run on."""
    if not is_local(args):
        return
    source = _config_source(args)
    if source is None or args.get("trust_remote_code"):  # no file to key on, or code that may answer any name
        with quantize.quiet_imports():  # transformers' model classes import torchao, which warns on import
            config = model_config(args)
            known = hf_model_keys()
        taken = {key for key in args if key in known or hasattr(config, key)}
    else:
        with quantize.quiet_imports():  # as above, when the lists are computed
            attrs = memo.names("hf-config-attrs", source, lambda: _config_names(args))  # refuses a bad file first
            known = memo.names("hf-model-args", _keys_identity(), hf_model_keys)
        taken = {key for key in args if key in known or key in attrs}
    for key in args:
        if key not in taken:
            from evalkit.scoring.registry import suggest

            raise BadInput(f"unknown --model-args key {key!r} for --model hf{suggest(key, sorted(known))}: "
                           "not an argument of HFLM, evalkit-hf or from_pretrained, nor of the model's config")


def _keys_identity() -> dict[str, Any]:
    """What `hf_model_keys` depends on: lm-eval's and transformers' versions and evalkit's HFLM subclass."""
    return {"lm_eval": memo.package_version("lm_eval"), "transformers": memo.package_version("transformers"),
            "evalkit_hf": memo.module_stamp(engine_for("hf").module)}


def _config_source(args: dict[str, Any]) -> dict[str, Any] | None:
    """The file `model_config` reads for `args` (stamped), None where it would refuse or read none."""
    from evalkit.engines.transformers import convert

    path, gguf = _local_paths(args)
    try:
        if gguf is not None:
            folder = convert.cached_folder(gguf)
            done = folder / convert.DONE if folder is not None else None
            return {"gguf": memo.file_stamp(gguf), "converted": memo.file_stamp(done) if done and done.is_file()
                    else None, "transformers": memo.package_version("transformers")}
        return {"config": memo.file_stamp(path / "config.json"), "transformers": memo.package_version("transformers")}
    except OSError:
        return None


def _local_paths(args: dict[str, Any]) -> tuple[Path, Path | None]:
    """The local model folder `args` name (pretrained + subfolder), and its GGUF file when one is named."""
    path = Path(os.path.expanduser(str(args.get("pretrained")))) / str(args.get("subfolder") or "")
    gguf = args.get("gguf_file")
    return path, (None if not gguf else Path(gguf) if Path(gguf).is_absolute() else path / gguf)


def _config_names(args: dict[str, Any]) -> set[str]:
    """Every name `hasattr(config, name)` finds on the model's config: its attributes, its class's,
    and the aliases of its `attribute_map` (transformers' configs answer no other names)."""
    config = model_config(args)
    names = set(dir(config)) | set(getattr(config, "attribute_map", None) or {})
    # reading a deprecated property logs a warning each time
    with quantize.quiet_imports(also=("transformers",)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {n for n in names if hasattr(config, n)}


def model_config(args: dict[str, Any]):
    """The transformers config of the local model `args` name, read without its weights (None
    for a hub id); BadInput naming the path for a GGUF file that is not one transformers can
    load, a folder without config.json, a config.json that is not JSON, an architecture
    transformers does not know, or one that is not a causal LM."""
    from evalkit.engines.transformers import convert

    if not is_local(args):
        return None
    path, gguf = _local_paths(args)
    trust = bool(args.get("trust_remote_code"))
    if gguf is not None:
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
        json.loads(read_input(config_file, "model config", MAX_CONFIG_BYTES).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadInput(f"{config_file} is not JSON ({exc})") from exc
    return _causal_config(str(path), trust, str(path))


def _causal_config(folder: str, trust: bool, where: str):
    """AutoConfig of `folder`, refused unless transformers knows it as a causal LM."""
    from transformers import AutoConfig

    check_input_path(folder, "model folder", "folder")
    with loading("config of the model", where):
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust, local_files_only=True)
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
