"""What an in-process model load may fetch from the hub at run time: no code, unless asked.

Owns: transformers' hub kernels for every model evalkit loads in its process. transformers 5
loads with `use_kernels=True` by default, and on CUDA / ROCm / XPU its `kernelize` and
`lazy_load_kernel` fetch compiled code from the hub (`kernels-community/rotary`, ...) at load or
at the first forward: offline that fetch raises, online it runs code that was not installed and
that can change the numbers between a CPU and a GPU run. So, unless the user opts in
(`EVALKIT_HUB_KERNELS=1`, or the model arg `use_kernels=True`, which the run row records),
`guard` sets `USE_HUB_KERNELS=0` in this process (transformers reads it at each load and each
lazy kernel fetch, whatever the environment said) and gives `from_pretrained`
`use_kernels=False`; `check_args` refuses, before any work, the model args that would fetch a
kernel anyway (an `attn_implementation` naming a hub repo, as transformers' own `is_kernel`
reads it, or `flash_attention_N` without its flash-attn package, which transformers replaces by
a hub kernel, `FLASH_ATTN_KERNEL_FALLBACK`) or that mean nothing without kernels
(`kernel_config`, `allow_all_kernels`).
Does not: stop a hub id in `pretrained=` / `tokenizer=` from being downloaded (the user named
it; a local model runs with HF_HUB_OFFLINE=1, `engines.resolve.load`), nor police remote code
(`trust_remote_code` stays off unless asked, `models.plan`).
"""

from __future__ import annotations

import os
from typing import Any

from evalkit import envvars
from evalkit.errors import BadInput

SWITCH = "USE_HUB_KERNELS"  # transformers' own switch, read at call time (`hub_kernels._kernels_enabled`)
OPT_IN = "EVALKIT_HUB_KERNELS"
# model args that only mean something with hub kernels on
KERNEL_ARGS = ("kernel_config", "allow_all_kernels")

_before: dict[str, str | None] = {}  # SWITCH as the environment had it before evalkit first set it


def allowed(args: dict[str, Any]) -> bool:
    """Whether this load may use hub kernels: EVALKIT_HUB_KERNELS on, or `use_kernels=True` asked.

    >>> allowed({"use_kernels": False})
    False
    """
    return envvars.hub_kernels() or args.get("use_kernels") is True


def hub_kernel_attention(args: dict[str, Any]) -> str | None:
    """The `attn_implementation` of `args` when it names a hub kernel repo (transformers'
    `is_kernel`: "kernels-community/flash-attn2", "org/repo@v1:fn", "paged|org/repo"), else None."""
    value = args.get("attn_implementation")
    if not isinstance(value, str):
        return None
    from transformers.integrations.hub_kernels import is_kernel

    name = value.split("|", 1)[1] if "|" in value else value
    return value if is_kernel(name) else None


def flash_fallback(args: dict[str, Any]) -> str | None:
    """The hub kernel transformers fetches instead of `attn_implementation=flash_attention_N` when
    the flash-attn package of that version is not installed (its own FLASH_ATTN_KERNEL_FALLBACK and
    availability checks), else None."""
    value = args.get("attn_implementation")
    if not isinstance(value, str) or not value.startswith("flash_attention_"):
        return None
    from transformers.modeling_flash_attention_utils import (
        FLASH_ATTENTION_COMPATIBILITY_MATRIX,
        FLASH_ATTN_KERNEL_FALLBACK,
    )

    for version, entry in FLASH_ATTENTION_COMPATIBILITY_MATRIX.items():
        if value == f"flash_attention_{version}" and not entry["general_availability_check"]():
            return FLASH_ATTN_KERNEL_FALLBACK.get(value)
    return None


def check_args(args: dict[str, Any]) -> None:
    """BadInput (one line) for model args that fetch a hub kernel, or need one, without the opt-in."""
    if allowed(args):
        return
    attention = hub_kernel_attention(args)
    if attention:
        raise BadInput(f"--model-args attn_implementation={attention} is a hub kernel, fetched and run at load "
                       f"time; set {OPT_IN}=1 (or use_kernels=True) to allow it, or use sdpa / eager")
    fallback = flash_fallback(args)
    if fallback:
        raise BadInput(f"--model-args attn_implementation={args['attn_implementation']}: its flash-attn package is "
                       f"not installed, and transformers would fetch the hub kernel {fallback} instead; install "
                       f"the package, set {OPT_IN}=1 to allow the fetch, or use sdpa / eager")
    for key in KERNEL_ARGS:
        if args.get(key) not in (None, False):
            raise BadInput(f"--model-args {key}= applies to hub kernels, which are off; "
                           f"set {OPT_IN}=1 (or use_kernels=True) to turn them on")


def guard(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The `from_pretrained` keyword arguments of a load, with hub kernels off unless allowed
    (`use_kernels=False`, and USE_HUB_KERNELS=0 in this process for the lazy fetches at forward
    time); with the opt-in, USE_HUB_KERNELS is put back as the environment had it."""
    check_args(kwargs)
    # the variable is named in full at each use: tests/test_envvars.py finds every read by its name
    if SWITCH not in _before:
        _before[SWITCH] = os.environ.get("USE_HUB_KERNELS")
    if allowed(kwargs):
        before = _before[SWITCH]
        if before is not None:
            os.environ["USE_HUB_KERNELS"] = before
        elif os.environ.get("USE_HUB_KERNELS") is not None:
            del os.environ["USE_HUB_KERNELS"]
        return kwargs
    os.environ["USE_HUB_KERNELS"] = "0"
    return {**kwargs, "use_kernels": False}


def hub_kernels_off() -> bool:
    """Whether transformers, as it reads its switch now, would fetch no hub kernel."""
    from transformers.integrations.hub_kernels import _kernels_enabled

    return not _kernels_enabled()
