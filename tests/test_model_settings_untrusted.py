"""Model settings a user or a model folder gives that would reach the library as something else.

The rules, one place each:
- `engines.plan.check_type` (called by `parse_model_args`, which every engine's resolver reads its
  `--model-args` through): an lm-eval model arg of a known type (`LM_EVAL_TYPES`, HFLM's signature)
  whose value does not have it (`max_length=٣٢` stayed the text "٣٢") is one line, exit 2;
- `engines.transformers.resolve.say_ignored` (called by `resolve_hf`): an lm-eval arg evalkit-hf
  takes but never uses (`HF_IGNORED`) is said once, not dropped silently;
- `engines.resolve.check_context_fields` (called by `engines.resolve.load`, every engine's load): a
  config whose context length is not a whole number above 0 (`max_position_embeddings: 0`) is one
  line, exit 2, before any run row.
"""

from __future__ import annotations

import inspect
import json
import shutil

import pytest

from tests.test_bad_input_loads import hf, one_line


@pytest.mark.parametrize("value", ["٣٢", "３２", "32.0", "0x20", "²", "0", "-1", "true"])
def test_a_typed_model_arg_that_cannot_have_its_type(invoke, tiny_model_dir, tmp_path, value):
    line = one_line(invoke, tmp_path, *hf(tiny_model_dir, f",max_length={value}"), expect="--model-args max_length=")
    assert "lm-eval takes max_length as a whole number" in line


@pytest.mark.parametrize("arg", ["trust_remote_code=1", "use_fast_tokenizer=yes", "logits_cache=٠"])
def test_a_flag_that_is_not_true_or_false(invoke, tiny_model_dir, tmp_path, arg):
    one_line(invoke, tmp_path, *hf(tiny_model_dir, f",{arg}"), expect="as true or false")


@pytest.mark.parametrize("arg", ["first_char=flase", "lead_space=1", "ban_openers=on", "attention=yes"])
def test_an_evalkit_switch_that_is_not_true_or_false(invoke, tiny_model_dir, tmp_path, arg):
    """evalkit's engines read a switch as on unless it says false: a misspelt `first_char=flase` ran with the
    first-character distribution on. It is refused before anything loads."""
    line = one_line(invoke, tmp_path, *hf(tiny_model_dir, f",{arg}"), expect="as true or false")
    assert line.startswith(f"evalkit: error: --model-args {arg.split('=')[0]}=") and "evalkit takes" in line


def test_the_switches_are_the_engines_bool_arguments():
    """`EVALKIT_FLAGS` is every bool argument of the hf and llama.cpp engines that lm-eval does not type."""
    from evalkit.engines.llamacpp.model import EvalkitLlamaCpp
    from evalkit.engines.plan import EVALKIT_FLAGS, LM_EVAL_TYPES
    from evalkit.engines.transformers.model import EvalkitHFLM

    found = {name for cls in (EvalkitHFLM, EvalkitLlamaCpp)
             for name, p in inspect.signature(cls.__init__).parameters.items()
             if p.annotation in (bool, "bool") and name not in LM_EVAL_TYPES}
    assert found == EVALKIT_FLAGS


def test_the_known_types_are_hflms():
    """`LM_EVAL_TYPES` holds exactly HFLM's arguments typed int or bool (with None), less add_bos_token,
    whose value evalkit reads itself."""
    from lm_eval.models.huggingface import HFLM

    from evalkit.engines.plan import LM_EVAL_TYPES

    derived = {}
    for name, p in inspect.signature(HFLM.__init__).parameters.items():
        text = str(p.annotation).replace("typing.", "")
        kinds = {k.strip() for k in text.replace("Optional[", "").replace("]", "").split("|")} - {"None"}
        if kinds in ({"int"}, {"bool"}) and name != "add_bos_token":
            derived[name] = int if kinds == {"int"} else bool
    assert derived == LM_EVAL_TYPES


def test_an_lm_eval_arg_evalkit_hf_ignores_is_said_once(tiny_model_dir, capsys):
    from evalkit.engines.transformers import resolve as hf_resolve

    hf_resolve._said.discard("max_batch_size")
    args = {"pretrained": str(tiny_model_dir), "max_batch_size": 8}
    first = hf_resolve.say_ignored(args, hf_resolve.HF_IGNORED, "evalkit-hf")
    again = hf_resolve.say_ignored(args, hf_resolve.HF_IGNORED, "evalkit-hf")
    err = capsys.readouterr().err
    assert len(first) == 1 and again == [] and err.count("max_batch_size") == 1
    assert err.startswith("evalkit: note: --model-args max_batch_size is an lm-eval argument evalkit-hf does not use")


@pytest.mark.parametrize("field, value", [("max_position_embeddings", 0), ("max_position_embeddings", -5),
                                          ("n_positions", 0)])
def test_a_config_whose_context_is_not_a_length(invoke, tiny_model_dir, tmp_path, field, value):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    one_line(invoke, tmp_path, *hf(folder), expect=f"its config gives {field} = {value!r}")


def _no_chat_template(tiny_model_dir, folder):
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    (folder / "chat_template.json").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_a_server_tokenizer_without_a_chat_template_is_refused_before_the_run(invoke, tiny_model_dir, tmp_path):
    """`runner.checks.check_against_model` renders one prompt through `render_prompt` for every engine
    before the run; the server engine has no context length, so `check_prompts_fit` never did it."""
    from tests.fake_server import FakeServer, healthy

    folder = _no_chat_template(tiny_model_dir, tmp_path / "tok")
    with FakeServer(healthy({"Paris": -0.1, "London": -2.0})) as url:
        line = one_line(invoke, tmp_path, "run", "--model", "server", "--model-args",
                        f"base_url={url},tokenizer={folder},retries=0,timeout=5,top_logprobs=2",
                        "--template", "chat", "--tasks", "firsttoken_en", "--limit", 1,
                        expect="needs a chat template and this tokenizer has none")
    assert "--template plain" in line
