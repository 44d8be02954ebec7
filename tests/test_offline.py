"""No code is fetched from the hub at run time: transformers' hub kernels are off for every load.

- The process evalkit loads a model in has hub kernels off (transformers' own switch reads
  off), whatever USE_HUB_KERNELS said, and the model is not kernelized.
- A load with every kernel fetch patched to raise (as offline on a GPU) still succeeds.
- EVALKIT_HUB_KERNELS=1 or use_kernels=True opts in: transformers then reads USE_HUB_KERNELS
  as the environment set it, and kernelizes.
- A hub-kernel attention implementation, kernel_config or allow_all_kernels without the
  opt-in is refused before the model loads (exit 2, DB untouched).
"""

from __future__ import annotations

import pytest
import transformers.integrations.hub_kernels as hub_kernels
import transformers.modeling_utils as modeling_utils

from evalkit.engines.transformers import offline
from evalkit.errors import BadInput


@pytest.fixture
def fetch_raises(monkeypatch):
    """Every way transformers fetches a hub kernel raises, as it does offline on a CUDA machine;
    returns the list of fetches tried."""
    tried: list[str] = []

    def refuse(name):
        def raise_(*args, **kwargs):
            tried.append(name)
            raise ValueError(f"{name}: 'kernels-community/rotary' is not available in the local cache "
                             "and Hugging Face Hub is in offline mode")
        return raise_

    monkeypatch.setattr(modeling_utils, "kernelize", refuse("kernelize"))  # load time (set_use_kernels)
    monkeypatch.setattr(hub_kernels, "kernelize", refuse("kernelize"))
    monkeypatch.setattr(hub_kernels, "get_kernel", refuse("get_kernel"))  # lazy_load_kernel, attention kernels
    monkeypatch.setattr(hub_kernels, "lazy_load_kernel", refuse("lazy_load_kernel"))
    return tried


@pytest.fixture
def restore_switch(monkeypatch):
    """USE_HUB_KERNELS and evalkit's record of it as they were before the test."""
    monkeypatch.setattr(offline, "_before", {})
    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    yield monkeypatch


def load(tiny_model_dir, **kwargs):
    from evalkit.engines.transformers.model import EvalkitHFLM

    return EvalkitHFLM(pretrained=str(tiny_model_dir), device="cpu", batch_size=2, **kwargs)


@pytest.mark.parametrize("env", [None, "1", "yes"])
def test_the_loading_process_has_hub_kernels_off_and_a_raising_fetch_is_never_reached(
        tiny_model_dir, fetch_raises, restore_switch, env):
    if env is not None:
        restore_switch.setenv("USE_HUB_KERNELS", env)  # the environment asks for them: evalkit says no
    assert not offline.hub_kernels_off()  # transformers, left alone, would fetch
    lm = load(tiny_model_dir)
    assert offline.hub_kernels_off()
    assert lm.model.use_kernels is False
    assert fetch_raises == []
    # and the model runs: the lazy fetches at forward time read the same switch
    import torch

    with torch.no_grad():
        out = lm.model(torch.tensor([[1, 2, 3]]))
    assert out.logits.shape[-1] == lm.model.config.vocab_size
    assert fetch_raises == []


def test_without_evalkit_the_same_load_fails_at_the_fetch(tiny_model_dir, fetch_raises, restore_switch):
    """The fixture reaches the path a GPU load takes: transformers' plain load kernelizes, and fails."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="offline mode"):
        AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert fetch_raises == ["kernelize"]


def test_use_kernels_true_opts_in(tiny_model_dir, fetch_raises, restore_switch):
    offline.guard({})  # an earlier load in this process turned them off
    with pytest.raises(ValueError, match="offline mode"):  # asked for: transformers kernelizes again
        load(tiny_model_dir, use_kernels=True)
    assert fetch_raises == ["kernelize"]


def test_evalkit_hub_kernels_opts_in_and_leaves_the_switch_as_set(restore_switch):
    restore_switch.setenv("USE_HUB_KERNELS", "yes")
    assert offline.guard({}) == {"use_kernels": False}
    assert offline.hub_kernels_off()
    restore_switch.setenv("EVALKIT_HUB_KERNELS", "1")
    assert offline.guard({}) == {}  # transformers' default (use_kernels on) and USE_HUB_KERNELS as set
    assert not offline.hub_kernels_off()
    restore_switch.setenv("EVALKIT_HUB_KERNELS", "0")
    assert offline.guard({}) == {"use_kernels": False}


@pytest.mark.parametrize("args, needle", [
    ({"attn_implementation": "kernels-community/flash-attn2"}, "hub kernel"),
    ({"attn_implementation": "paged|kernels-community/flash-attn3@v2"}, "hub kernel"),
    ({"kernel_config": "x"}, "kernel_config"),
    ({"allow_all_kernels": True}, "allow_all_kernels"),
])
def test_args_that_fetch_a_kernel_are_refused_without_the_opt_in(args, needle, restore_switch):
    with pytest.raises(BadInput, match=needle):
        offline.check_args(args)
    offline.check_args({**args, "use_kernels": True})
    restore_switch.setenv("EVALKIT_HUB_KERNELS", "1")
    offline.check_args(args)


@pytest.mark.parametrize("value", ["sdpa", "eager", "evalkit_eager", None])
def test_plain_attention_implementations_pass(value):
    offline.check_args({"attn_implementation": value})


def test_flash_attention_without_its_package_is_refused_as_the_hub_fetch_it_becomes(monkeypatch, restore_switch):
    from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX

    installed = FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]["general_availability_check"]()
    args = {"attn_implementation": "flash_attention_2"}
    if installed:
        offline.check_args(args)  # the package itself: nothing fetched
        monkeypatch.setitem(FLASH_ATTENTION_COMPATIBILITY_MATRIX[2], "general_availability_check", lambda: False)
    with pytest.raises(BadInput, match="kernels-community/"):
        offline.check_args(args)
    monkeypatch.setitem(FLASH_ATTENTION_COMPATIBILITY_MATRIX[2], "general_availability_check", lambda: True)
    offline.check_args(args)


def test_cli_refuses_a_hub_kernel_attention_before_any_work(invoke, tiny_model_dir, tmp_path):
    db = tmp_path / "r.duckdb"
    result = invoke("run", "--model", "hf", "--model-args",
                    f"pretrained={tiny_model_dir},attn_implementation=kernels-community/flash-attn2",
                    "--tasks", "firsttoken_en", "--limit", "1", "--db", str(db))
    assert result.exit_code == 2, result.output
    assert "EVALKIT_HUB_KERNELS" in result.output
    assert not db.exists()
