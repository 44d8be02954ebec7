"""`evalkit inspect "PROMPT"`: one prompt's first-token distribution as a bar list, and with
`--attention` the prompt tokens its last position attends to most."""

from __future__ import annotations

import json
import unicodedata

import click

from evalkit.cli.options import first_step_options, format_option, model_options, prompt_options, whole
from evalkit.cli.output import render
from evalkit.defaults import (
    DEFAULT_ATTENTION_LAYERS,
    DEFAULT_INSPECT_TASK,
    DEFAULT_INSPECT_TOP_K,
    SINK_TOKENS,
    UNSTABLE_BELOW,
)
from evalkit.scoring import firsttoken
from evalkit.textsafe import term_line

BAR_WIDTH = 40  # characters for probability 1
_EIGHTHS = " ▏▎▍▌▋▊▉"


def bar(prob: float, width: int = BAR_WIDTH) -> str:
    """Full blocks for probability × width, then an eighth block for the remainder.

    >>> bar(0.5, 8), bar(1.0, 4), bar(0.0, 4), bar(0.125, 4)
    ('████', '████', '', '▌')
    """
    eighths = round(max(0.0, min(1.0, prob)) * width * 8)
    full, part = divmod(eighths, 8)
    return "█" * full + (_EIGHTHS[part] if part else "")


def _cells(text: str) -> int:
    """Terminal columns of `text` as `_pad` shows it (CJK wide and fullwidth characters take two)."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in term_line(text))


def _pad(text: str, width: int) -> str:
    text = term_line(text)  # a token may hold any character: shown, never obeyed
    return text + " " * max(0, width - _cells(text))


@click.command("inspect")
@click.argument("prompt")
@prompt_options
@model_options("inspect")
@click.option("--top-k", type=whole(1), default=DEFAULT_INSPECT_TOP_K, show_default=True, help="First tokens to list.")
@first_step_options("inspect")
@click.option("--task", default=DEFAULT_INSPECT_TASK, show_default=True,
              help="The task whose generation settings (stop strings, max tokens) the response uses.")
@click.option("--attention-layers", type=whole(1), default=DEFAULT_ATTENTION_LAYERS, show_default=True,
              help="With --attention: average the last N layers (and every head).")
@format_option
def inspect_command(prompt, template, templates_file, quant, kv_cache, top_k, model_args, temperature, task, device,
                    attention, attention_layers, fmt):
    """Show the first-token distribution of one PROMPT, put through a template as a run would.

    Lists the top-k first tokens (rank, id, token, probability, bar, cumulative
    mass), then the entropy, top3_mass@T and the greedy first unit and response.
    With --attention, then the top-k prompt tokens by the attention the last prompt
    position (the one that picks the first token) gives them, mean over heads and
    the last --attention-layers layers, and the prompt's sink_rate (docs/metrics.md §1.8).

    \b
    Examples:
      evalkit inspect "What is recursion?"
      evalkit inspect "什么是递归？" --template direct --top-k 20
      evalkit inspect "What is the capital of France?" --quant int8-dynamic
      evalkit inspect "$(cat long_prompt.txt)" --kv-cache sinkwindow:4:256
      evalkit inspect "Hi" --model-args pretrained=/models/qwen --format json
      evalkit inspect --attention "The code is 4417. What is the code?" --attention-layers 8
    """
    from dataclasses import asdict

    from evalkit.inspection import inspect_prompt

    r = inspect_prompt(prompt, template=template, quant=quant, top_k=top_k, model_args=model_args,
                       temperature=temperature, templates_file=templates_file, task=task, device=device,
                       kv_cache=kv_cache, attention=attention, attention_layers=attention_layers)
    if fmt == "json":
        click.echo(json.dumps(asdict(r), ensure_ascii=False, indent=2))
        return
    cols = ["rank", "token_id", "token", "unit", "prob", "cum"]
    rows = [[t.rank, t.token_id, t.token, t.unit, t.prob, t.cum] for t in r.tokens]
    if fmt == "csv":
        click.echo(render(cols, rows, "csv"))
        if attention:
            click.echo()
            click.echo(render(["rank", "position", "token_id", "token", "attention"],
                              [[t.rank, t.position, t.token_id, t.token, t.weight] for t in r.attention], "csv"))
        return
    quant = f" ({r.quant})" if r.quant else ""
    click.echo(f"model     {r.model}{quant}   kv cache {r.kv_cache}")
    click.echo(f"template  {r.template}   context {r.n_context_tokens} tokens: {r.context!r}")
    click.echo()
    width = max([len("token")] + [_cells(t.token) for t in r.tokens])
    uwidth = max([len("unit")] + [_cells(t.unit) for t in r.tokens])
    click.echo(f"{'rank':>4}  {'id':>7}  {_pad('token', width)}  {_pad('unit', uwidth)}  {'prob':>8}  "
               f"{'':<{BAR_WIDTH}}  {'cum':>8}")
    for t in r.tokens:
        click.echo(f"{t.rank:>4}  {t.token_id:>7}  {_pad(t.token, width)}  {_pad(t.unit, uwidth)}  {t.prob:8.6f}  "
                   f"{bar(t.prob):<{BAR_WIDTH}}  {t.cum:8.6f}")
    click.echo("unit: the first whole character or word the token starts (a byte of a split character is "
               "completed greedily)")
    click.echo()
    unstable = f"  unstable (< {UNSTABLE_BELOW:.2f})" if firsttoken.unstable(r.top3_mass) else ""
    click.echo(f"entropy            {r.entropy:.4f} nats")
    click.echo(f"top3_mass@{r.temperature:g}{'':<{max(0, 8 - len(f'{r.temperature:g}'))}} {r.top3_mass:.4f}{unstable}"
               f"   (@1: {r.top3_mass_t1:.4f})")
    click.echo(f"greedy first token {r.first_token}")
    click.echo(f"greedy first unit  {r.first_unit!r}")
    click.echo(f"greedy response    {r.response!r}")
    if attention:
        _print_attention(r)


def _print_attention(r) -> None:
    """The top prompt tokens by the last position's attention, as a bar list (bar: attention × 40)."""
    first, last = r.attention_layers[0], r.attention_layers[-1]
    span = f"layer {first}" if first == last else f"layers {first}–{last}"
    click.echo()
    click.echo(f"attention of the last prompt position, mean over heads and {span} (of {r.n_layers}; 0 = first)")
    width = max([len("token")] + [_cells(t.token) for t in r.attention])
    click.echo(f"{'rank':>4}  {'pos':>5}  {'id':>7}  {_pad('token', width)}  {'attention':>9}")
    for t in r.attention:
        click.echo(f"{t.rank:>4}  {t.position:>5}  {t.token_id:>7}  {_pad(t.token, width)}  {t.weight:9.6f}  "
                   f"{bar(t.weight)}")
    click.echo()
    question = f"   question_attn {r.question_attn:.4f} (all layers)" if r.question_attn is not None else ""
    click.echo(f"sink_rate          {r.sink_rate:.4f} (first {min(SINK_TOKENS, r.n_context_tokens)} tokens){question}")


COMMANDS = [inspect_command]
