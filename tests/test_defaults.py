"""Each default has one home (`evalkit.defaults`): the dataclass, the click options, the
resolver, the backends and `inspect` all read it, and the task YAMLs that must restate a
value agree with it."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import yaml

import evalkit
from evalkit import defaults
from evalkit.engines.transformers import firststep as engine
from evalkit.engines import resolve as models
from evalkit.cli.inspect import inspect_command
from evalkit.cli.run import run_command
from evalkit.inspection import inspect_prompt
from evalkit.prompts.catalog import generation_kwargs, tasks_path
from evalkit.runner.config import RunConfig


def _option_defaults(command) -> dict:
    return {p.name: p.default for p in command.params}


def _signature_defaults(fn) -> dict:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


def test_run_config_and_run_options_share_their_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    options = _option_defaults(run_command)
    expected = {"model": defaults.DEFAULT_MODEL, "template": defaults.DEFAULT_TEMPLATE, "seed": defaults.DEFAULT_SEED,
                "batch_size": defaults.DEFAULT_BATCH_SIZE, "top_k": defaults.DEFAULT_TOP_K,
                "temperature": defaults.DEFAULT_TEMPERATURE}
    for name, value in expected.items():
        assert fields[name] == value, name
        assert options[name] == value, name


def test_resolver_backend_and_inspect_read_the_same_defaults():
    resolve = _signature_defaults(models.resolve)
    assert (resolve["model_type"], resolve["top_k"], resolve["temperature"], resolve["seed"]) == (
        defaults.DEFAULT_MODEL, defaults.DEFAULT_TOP_K, defaults.DEFAULT_TEMPERATURE, defaults.DEFAULT_SEED)
    probe = _signature_defaults(engine.probe)
    assert (probe["top_k"], probe["batch_size"]) == (defaults.DEFAULT_TOP_K, defaults.DEFAULT_BATCH_SIZE)
    look = _signature_defaults(inspect_prompt)
    options = _option_defaults(inspect_command)
    for name in ("template", "top_k", "temperature", "task", "attention_layers"):
        assert look[name] == options[name], name
    assert options["top_k"] == defaults.DEFAULT_INSPECT_TOP_K
    assert options["temperature"] == defaults.DEFAULT_TEMPERATURE


def test_run_and_inspect_spell_their_shared_options_once():
    run = {p.name: p for p in run_command.params}
    look = {p.name: p for p in inspect_command.params}
    for name in ("model_args", "template", "templates_file", "quant", "kv_cache", "temperature", "device"):
        assert run[name].default == look[name].default, name
    assert "comma" in run["quant"].help and "comma" not in look["quant"].help
    from evalkit.engines.transformers import quant

    for name in quant.QUANTS:  # the help is built from the variant table
        assert name in run["quant"].help


def test_needle_task_yamls_restate_gen_tokens():
    for path in sorted(tasks_path().rglob("_*common.yaml")):
        cfg = yaml.safe_load(path.read_text(encoding="utf-8").replace("!function", ""))
        if "needle" in path.parent.name:
            assert cfg["generation_kwargs"]["max_gen_toks"] == defaults.GEN_TOKENS, path
    assert generation_kwargs("needle_en")["max_gen_toks"] == defaults.GEN_TOKENS


def test_unstable_is_one_function_at_the_named_threshold():
    from evalkit.scoring.firsttoken import unstable

    assert unstable(defaults.UNSTABLE_BELOW - 1e-9) == 1.0
    assert unstable(defaults.UNSTABLE_BELOW) == 0.0
    # every engine calls it: no module but firsttoken compares a mass with the cut itself
    package = Path(evalkit.__file__).parent
    comparing = [str(p.relative_to(package)) for p in sorted(package.rglob("*.py"))
                 if "< UNSTABLE_BELOW" in p.read_text(encoding="utf-8")]
    assert comparing == ["scoring/firsttoken.py"]


def test_every_backend_starts_from_the_same_defaults():
    """hf, llama.cpp and the server take their first-step, answer and batch defaults from
    `evalkit.defaults`, so a run on one engine and on another differ in the engine only."""
    import pytest

    from evalkit.engines.transformers.model import EvalkitHFLM
    from evalkit.engines.server.model import EvalkitServer
    from evalkit.engines.transformers.teacher import forced

    hf = _signature_defaults(EvalkitHFLM.__init__)
    server = _signature_defaults(EvalkitServer.__init__)
    assert (hf["top_k"], hf["temperature"], hf["tolerance"], hf["answer_max_tokens"]) == (
        defaults.DEFAULT_TOP_K, defaults.DEFAULT_TEMPERATURE, defaults.DEFAULT_TOLERANCE,
        defaults.DEFAULT_ANSWER_TOKENS)
    assert (server["top_k"], server["top_logprobs"], server["temperature"], server["answer_max_tokens"],
            server["max_gen_toks"]) == (defaults.DEFAULT_SERVER_LOGPROBS, defaults.DEFAULT_SERVER_LOGPROBS,
                                        defaults.DEFAULT_TEMPERATURE, defaults.DEFAULT_ANSWER_TOKENS,
                                        defaults.DEFAULT_MAX_GEN_TOKS)
    assert _signature_defaults(forced)["batch_size"] == defaults.DEFAULT_BATCH_SIZE
    assert _signature_defaults(models.load)["batch_size"] == defaults.DEFAULT_BATCH_SIZE
    pytest.importorskip("llama_cpp")
    from evalkit.engines.llamacpp import model as llamacpp
    from evalkit.engines.llamacpp import probe as llamacpp_probe

    native = _signature_defaults(llamacpp.EvalkitLlamaCpp.__init__)
    assert (native["top_k"], native["temperature"], native["tolerance"], native["answer_max_tokens"],
            native["batch_size"], native["max_gen_toks"]) == (
        defaults.DEFAULT_TOP_K, defaults.DEFAULT_TEMPERATURE, defaults.DEFAULT_TOLERANCE,
        defaults.DEFAULT_ANSWER_TOKENS, defaults.DEFAULT_BATCH_SIZE, defaults.DEFAULT_MAX_GEN_TOKS)
    probe = _signature_defaults(llamacpp_probe.probe)
    assert (probe["top_k"], probe["batch_size"]) == (defaults.DEFAULT_TOP_K, defaults.DEFAULT_BATCH_SIZE)
