"""Options shared by several commands: one decorator per group.

Owns: `--db` and `--format` (each with its EVALKIT_* environment variable), and the option
groups `evalkit run` and `evalkit inspect` both take — the model (`model_options`: model
args, `--quant`, `--kv-cache`, `--device`), the prompt (`prompt_options`: `--template`,
`--templates-file`) and the first step (`first_step_options`: `--temperature`,
`--attention`) — spelled once, their defaults read from `evalkit.defaults` and the help of
`--quant` and `--kv-cache` built from the variant table (`quant.QUANTS`) and the policy
grammar (`kvpolicy.POLICY_HELP`). A `Variant` says which command a group is for: `run`
takes comma lists (one run per variant or policy), `inspect` one of each. Does not: check
values (`runner.config`, `engines.resolve`) or hold the commands' own options.

And the one type of every integer option (`whole`): a click `IntRange` with both ends set,
at most `INT_MAX`, so a number no command can use or store (`--limit 9223372036854775808`)
is one usage line (exit 2) before any work. tests/test_option_ranges.py walks every command
and holds each integer option to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

import click

from evalkit.engines import kvpolicy
from evalkit.engines.transformers import quant
from evalkit.defaults import AUTO_BATCH, DEFAULT_TEMPERATURE, DEFAULT_TEMPLATE

F = TypeVar("F", bound=Callable[..., Any])
INT_MAX = 2**31 - 1  # the largest whole number an option takes: runs store them as INTEGER (runner.config.INT32_MAX)


class WholeNumber(click.IntRange):
    """An IntRange whose refusal names the option and its range in evalkit's words."""

    name = "whole number"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            option = param.opts[0] if param is not None and param.opts else "the value"
            self.fail(f"{option} must be a whole number from {self.min} to {self.max}, got {str(value)[:40]!r}",
                      param, ctx)


def whole(minimum: int, maximum: int = INT_MAX) -> WholeNumber:
    """The type of an integer option: a whole number in [minimum, maximum], at most INT_MAX.

    >>> whole(1).convert("7", None, None), whole(1).max
    (7, 2147483647)
    """
    if not minimum <= maximum <= INT_MAX:
        raise ValueError(f"an option's range [{minimum}, {maximum}] must lie within [.., {INT_MAX}]")
    return WholeNumber(minimum, maximum)


class WholeOrAuto(WholeNumber):
    """A whole number in range, or "auto" (any case): `--batch-size`, as lm-eval users spell it."""

    name = "whole number or auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.strip().lower() == AUTO_BATCH:
            return AUTO_BATCH
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter:
            option = param.opts[0] if param is not None and param.opts else "the value"
            self.fail(f"{option} must be a whole number from {self.min} to {self.max} or {AUTO_BATCH}, "
                      f"got {str(value)[:40]!r}", param, ctx)


def whole_or_auto(minimum: int, maximum: int = INT_MAX) -> WholeOrAuto:
    """`whole`, or "auto".

    >>> whole_or_auto(1).convert("AUTO", None, None), whole_or_auto(1).convert("8", None, None)
    ('auto', 8)
    """
    whole(minimum, maximum)  # the same range checks
    return WholeOrAuto(minimum, maximum)


Variant = Literal["run", "inspect"]  # the command an option group is for: `run` sweeps, `inspect` looks once

db_option = click.option(
    "--db",
    envvar="EVALKIT_DB",
    type=click.Path(dir_okay=False),
    default=None,
    help="DuckDB file [env EVALKIT_DB; default reports/evalkit.duckdb].",
)

format_option = click.option(
    "--format",
    "fmt",
    envvar="EVALKIT_FORMAT",
    type=click.Choice(["table", "csv", "json"]),
    default="table",
    show_default=True,
    help="Output format [env EVALKIT_FORMAT].",
)


def _stack(*decorators: Callable[[F], F]) -> Callable[[F], F]:
    """The decorators applied so that `--help` lists the options in the order given."""

    def apply(f: F) -> F:
        for decorator in reversed(decorators):
            f = decorator(f)
        return f

    return apply


def quant_help(variant: Variant) -> str:
    """`--quant`'s help: every variant of `quant.QUANTS`, `[:G]` where it takes a group size.

    >>> quant_help("inspect").startswith("One weight variant: q4_1 (the embedded GGUF as loaded), fp32, bf16")
    True
    """
    names = ", ".join(
        q.name + ("[:G]" if q.grouped else "") + (" (GPU)" if q.gpu_only else "")
        + (" (the embedded GGUF as loaded)" if q.name == quant.DEFAULT_EMBEDDED else "")
        for q in quant.QUANTS.values()
    )
    if variant == "run":
        return f"Weight variant: {names}; comma-separated: one run per variant."
    return f"One weight variant: {names}."


def kv_cache_help(variant: Variant) -> str:
    """`--kv-cache`'s help: the policy grammar of `kvpolicy.POLICY_HELP`.

    >>> kv_cache_help("inspect").startswith("KV-cache policy (default full): full, window:W, sinkwindow:S:W, fp8")
    True
    """
    one = f"KV-cache policy (default {kvpolicy.FULL_SPEC}): {kvpolicy.POLICY_HELP}"
    return one + ("; a comma list runs one run per policy." if variant == "run" else ".")


def model_options(variant: Variant) -> Callable[[F], F]:
    """`--model-args`, `--quant`, `--kv-cache`, `--device`: which model, quantized how, cached how, where."""
    return _stack(
        click.option("--model-args", default=None,
                     help="K=V,... passed to the model (pretrained=...,gguf_file=...,dtype=...); "
                          "none: the embedded SmolLM2."),
        click.option("--quant", default=None, help=quant_help(variant)),
        click.option("--kv-cache", default=None, help=kv_cache_help(variant)),
        click.option("--device", default=None, help="cpu, cuda, cuda:0 ... (default: cuda if available)."),
    )


def prompt_options(f: F) -> F:
    """`--template`, `--templates-file`: how a prompt is put to the model."""
    return _stack(
        click.option("--template", default=DEFAULT_TEMPLATE, show_default=True,
                     help="Prompt template: chat, plain, direct, or yours."),
        click.option("--templates-file", envvar="EVALKIT_TEMPLATES", default=None, type=click.Path(dir_okay=False),
                     help="YAML file of extra templates [env EVALKIT_TEMPLATES]."),
    )(f)


_ATTENTION_HELP: dict[Variant, str] = {
    "run": "Read the prefill's attention (hf backend, eager attention): sink_rate, needle_attn, question_attn.",
    "inspect": "Also list the prompt tokens the last position attends to most (eager attention).",
}


def first_step_options(variant: Variant) -> Callable[[F], F]:
    """`--temperature`, `--attention`: what is read off the first step besides its distribution."""
    return _stack(
        click.option("--temperature", type=float, default=DEFAULT_TEMPERATURE, show_default=True,
                     help="T of top3_mass@T."),
        click.option("--attention", is_flag=True, help=_ATTENTION_HELP[variant]),
    )
