"""`evalkit run`: evaluate a model on evalkit tasks and store the run."""

from __future__ import annotations

import click

from evalkit.cli.options import db_option, first_step_options, model_options, prompt_options, whole, whole_or_auto
from evalkit.cli.output import lead_table, metric_table, next_steps
from evalkit.defaults import (
    BATCH_TOKENS,
    DEFAULT_BATCH_SIZE,
    DEFAULT_METRICS,
    DEFAULT_MODEL,
    DEFAULT_SEED,
    MAX_BATCH_SIZE,
    DEFAULT_TOP_K,
    MIN_TOP_K,
)
from evalkit.engines import model_help
from evalkit.prompts.presets import LENGTH_PRESETS


def _csv_list(kind, presets=None):
    def convert(ctx, param, value):
        if value is None:
            return None
        if presets and value.strip() in presets:
            return list(presets[value.strip()])
        try:
            if isinstance(kind, click.IntRange):  # each item a whole number held to the option type's range
                items = [int(v) for v in value.split(",") if v.strip()]
                if any(not kind.min <= v <= kind.max for v in items):
                    raise click.BadParameter(f"{param.opts[0]} must be a whole number from {kind.min} to "
                                             f"{kind.max} in each item, got {value!r}")
                return items
            return [kind(v) for v in value.split(",") if v.strip()]
        except ValueError:
            named = f" or one of {', '.join(presets)}" if presets else ""
            raise click.BadParameter(f"expected a comma-separated list of numbers{named}, got {value!r}") from None

    return convert


@click.command("run")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help=model_help())
@model_options("run")
@click.option("--tasks", default=None, help="Comma-separated tasks or groups: evalkit's (firsttoken, needle, ...) "
              "or lm-eval's own (gsm8k, mmlu_anatomy, ...; see docs/cli.md).")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="Your own prompts as JSONL (see docs/cli.md), scored like firsttoken.")
@prompt_options
@click.option("--limit", type=whole(1), default=None,
              help="At most N prompts per first-token or needle_conflict task (conflict documents are listed "
                   "pair by pair); the needle grid always runs whole: narrow it with --needle-lengths / "
                   "--needle-depths.")
@click.option("--seed", type=whole(0), default=DEFAULT_SEED, show_default=True)
@click.option("--batch-size", type=whole_or_auto(1, MAX_BATCH_SIZE), default=DEFAULT_BATCH_SIZE, show_default=True,
              help="Prompts per batch, or auto: derived, like a batch's padded positions (on the default "
              f"model {BATCH_TOKENS}: long prompts go fewer at a time), from the model's shapes and a "
              "memory budget (on a GPU, the memory free after the load; docs/performance.md).")
@click.option("--top-k", type=whole(1), default=DEFAULT_TOP_K, show_default=True,
              help=f"First-token candidates stored per prompt (>= {MIN_TOP_K}).")
@first_step_options("run")
@click.option("--first-temperature", type=float, default=None, help="Sample the first token at T1 (0: argmax).")
@click.option("--ban-openers", is_flag=True, help="Mask opener-initial tokens at step 1 only.")
@click.option("--needle-lengths", callback=_csv_list(whole(1), LENGTH_PRESETS), default=None,
              help="Needle and conflict prompt lengths in the model's tokens, e.g. 256,512, or a preset: "
                   + ", ".join(f"{k} ({','.join(map(str, v))})" for k, v in LENGTH_PRESETS.items()) + ".")
@click.option("--needle-depths", callback=_csv_list(float), default=None,
              help="Needle depths in [0,1], 0 = the first sentence [default: 0,0.1,...,1].")
@click.option("--include-path", type=click.Path(file_okay=False, exists=True), default=None,
              help="Extra folder of lm-eval task YAMLs.")
@click.option("--metrics", default=DEFAULT_METRICS, show_default=True, metavar="gate|all|NAME,...",
              help="What to compute: gate (what `evalkit gate`'s default rules read: the first-step "
                   "distribution and the probabilities of the answers and openers, no decode: under a quarter "
                   "of a full run's CPU time), all, or metric names (`evalkit metrics`). The engine skips the "
                   "phases nothing selected reads; each skipped metric is NULL with its reason (docs/cli.md).")
@click.option("--name", default=None, help="A label stored with the run.")
@click.option("--resume", "resume_ref", default=None, metavar="RUN",
              help="Continue a stopped run (interrupted, abandoned, failed) from its journal: only its "
                   "unfinished batches run. Takes no other run option.")
@click.option("--drift", "drift_first", is_flag=True,
              help="Drift by position: each later --quant variant teacher-forces the first variant's greedy "
                   "responses and is compared with it at every position (docs/drift.md).")
@click.option("--drift-base", default=None, metavar="RUN",
              help="Drift by position against a stored run that kept its distributions (--keep-distributions).")
@click.option("--keep-distributions", is_flag=True,
              help="Store this run's (or the sweep's first variant's) compact next-token distributions along "
                   "its greedy responses, as a base for --drift-base.")
@db_option
def run_command(**opts):
    """Evaluate a model and store the run in DuckDB; print its id and metrics.

    \b
    Examples:
      evalkit run --tasks firsttoken
      evalkit run --tasks firsttoken_zh --template direct --limit 20
      evalkit run --tasks firsttoken --quant int8-dynamic --name int8
      evalkit run --tasks firsttoken --limit 100 --metrics gate
      evalkit run --tasks firsttoken --quant bf16,int8-weight,int4-weight --limit 40
      evalkit run --tasks firsttoken --quant bf16,int8-weight,int4-weight --drift --limit 40
      evalkit run --tasks needle_en --kv-cache full,window:256,sinkwindow:4:256,fp8
      evalkit run --prompts my_prompts.jsonl
      evalkit run --model hf --model-args pretrained=/models/qwen --tasks firsttoken
      evalkit run --tasks needle_en,needle_en_hint --needle-lengths long --needle-depths 0,0.5,1 --attention
      evalkit run --tasks needle_conflict --needle-lengths 256,512,1024
    """
    from evalkit import api

    def started(rid: str) -> None:
        click.echo(f"run {rid} started", err=True)

    resume_ref = opts.pop("resume_ref")
    if resume_ref is not None:
        _resume(resume_ref, opts, started)
        return
    if opts.pop("drift_first"):
        if opts.get("drift_base"):
            from evalkit.errors import BadInput

            raise BadInput("give --drift (the sweep's first variant is the base) or --drift-base RUN, not both")
        opts["drift_base"] = "first"
    lists = [f"--{k.replace('_', '-')} {opts[k]}" for k in ("quant", "kv_cache") if "," in (opts.get(k) or "")]
    runs = api.run_all(opts.pop("tasks") or "", opts.pop("model"), on_start=started, on_done=_print_result, **opts)
    stored = [r for r in runs if not r.status.startswith("not stored")]  # a non-zero rank stores nothing
    if len(stored) > 1:
        ids = " ".join(r.id for r in stored)
        click.echo(f"sweep of {len(runs)} runs ({', '.join(lists)}): {ids}")
        click.echo(f"compare them: evalkit compare {ids}")


def _resume(ref: str, opts: dict, started) -> None:
    """`--resume RUN`: the run's own configuration, so any other run option given is refused."""
    from click.core import ParameterSource

    from evalkit import api
    from evalkit.errors import BadInput

    ctx = click.get_current_context()
    given = [f"--{k.replace('_', '-')}" for k in opts
             if k != "db" and ctx.get_parameter_source(k) not in (ParameterSource.DEFAULT, None)]
    if given:
        raise BadInput(f"--resume continues a run with its own configuration; drop {', '.join(given)}")
    result = api.resume(ref, db=opts.get("db"), on_start=started)
    if result.replayed is not None:
        click.echo(f"resumed run {result.id}: {result.replayed} batches replayed from its journal, "
                   f"{result.computed} computed now")
    else:
        click.echo(f"run {result.id}: its kept results were brought in")
    _print_result(result)


def _print_result(result) -> None:
    if result.status.startswith("not stored"):  # a non-zero rank of a launch: its id names no stored run
        click.echo(f"{result.status} (eval {result.eval_s:.1f}s)")
        return
    click.echo(f"run {result.id}  {result.status}  {result.n_samples} samples  "
               f"load {result.load_s:.1f}s  eval {result.eval_s:.1f}s  total {result.duration_s:.1f}s")
    if result.metrics:
        click.echo(metric_table(result.metrics))
    lead = [r for r in result.lead if r["category"] == "*"]
    if lead:
        click.echo()
        click.echo(lead_table(lead))
    if result.metrics:
        click.echo(next_steps(result.id))
    if result.degenerate:  # one line, after everything else (docs/metrics.md "Degenerate output")
        said = "; ".join(f"{flag['task']}: {flag['reason']}" for flag in result.degenerate)
        click.echo(f"evalkit: warning: run {result.id} gave degenerate output, not ranked ({said})", err=True)


COMMANDS = [run_command]
