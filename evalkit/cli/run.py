"""`evalkit run`: evaluate a model on evalkit tasks and store the run."""

from __future__ import annotations

import click

from evalkit.backends.models import BATCH_TOKENS
from evalkit.cli.options import db_option
from evalkit.cli.output import lead_table, metric_table, next_steps
from evalkit.prompts.presets import LENGTH_PRESETS


def _csv_list(kind, presets=None):
    def convert(ctx, param, value):
        if value is None:
            return None
        if presets and value.strip() in presets:
            return list(presets[value.strip()])
        try:
            return [kind(v) for v in value.split(",") if v.strip()]
        except ValueError:
            named = f" or one of {', '.join(presets)}" if presets else ""
            raise click.BadParameter(f"expected a comma-separated list of numbers{named}, got {value!r}") from None

    return convert


@click.command("run")
@click.option("--model", default="hf", show_default=True, help="lm-eval model type (hf, vllm, ...).")
@click.option("--model-args", default=None, help="K=V,... passed to the model; none: the embedded SmolLM2.")
@click.option("--tasks", default=None, help="Comma-separated tasks or groups (firsttoken, needle, ...).")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="Your own prompts as JSONL (see README), scored like firsttoken.")
@click.option("--template", default="chat", show_default=True, help="Prompt template: chat, plain, direct, or yours.")
@click.option("--templates-file", envvar="EVALKIT_TEMPLATES", default=None, type=click.Path(dir_okay=False),
              help="YAML file of extra templates [env EVALKIT_TEMPLATES].")
@click.option("--quant", default=None,
              help="q4_1 (GGUF as loaded), fp32, bf16, int8-dynamic, int8-weight, int4-weight[:G], nf4, int8-llm, "
                   "hqq4[:G], hqq8[:G], int4-tinygemm (GPU), gptq, awq; comma-separated: one run per variant.")
@click.option("--kv-cache", default=None,
              help="KV-cache policy: full (default), window:W, sinkwindow:S:W, fp8, quantized:BACKEND:BITS; "
                   "a comma list runs one run per policy.")
@click.option("--limit", type=int, default=None,
              help="At most N prompts per first-token or needle_conflict task (conflict documents are listed "
                   "pair by pair); the needle grid always runs whole: narrow it with --needle-lengths / "
                   "--needle-depths.")
@click.option("--seed", type=int, default=1234, show_default=True)
@click.option("--batch-size", type=int, default=8, show_default=True,
              help=f"Prompts per batch; a batch also holds at most {BATCH_TOKENS} padded positions "
              "(long prompts go fewer at a time).")
@click.option("--top-k", type=int, default=50, show_default=True, help="First-token candidates stored per prompt (>= 50).")
@click.option("--temperature", type=float, default=0.8, show_default=True, help="T of top3_mass@T.")
@click.option("--first-temperature", type=float, default=None, help="Sample the first token at T1 (0: argmax).")
@click.option("--ban-openers", is_flag=True, help="Mask opener-initial tokens at step 1 only.")
@click.option("--needle-lengths", callback=_csv_list(int, LENGTH_PRESETS), default=None,
              help="Needle and conflict prompt lengths in the model's tokens, e.g. 256,512, or a preset: "
                   + ", ".join(f"{k} ({','.join(map(str, v))})" for k, v in LENGTH_PRESETS.items()) + ".")
@click.option("--needle-depths", callback=_csv_list(float), default=None,
              help="Needle depths in [0,1], 0 = the first sentence [default: 0,0.1,...,1].")
@click.option("--device", default=None, help="cpu, cuda, cuda:0 ... (default: cuda if available).")
@click.option("--attention", is_flag=True,
              help="Read the prefill's attention (hf backend, eager attention): sink_rate, needle_attn, question_attn.")
@click.option("--include-path", type=click.Path(file_okay=False, exists=True), default=None,
              help="Extra folder of lm-eval task YAMLs.")
@click.option("--name", default=None, help="A label stored with the run.")
@db_option
def run_command(**opts):
    """Evaluate a model and store the run in DuckDB; print its id and metrics.

    \b
    Examples:
      evalkit run --tasks firsttoken
      evalkit run --tasks firsttoken_zh --template direct --limit 20
      evalkit run --tasks firsttoken --quant int8-dynamic --name int8
      evalkit run --tasks firsttoken --quant bf16,int8-weight,int4-weight --limit 40
      evalkit run --tasks needle_en --kv-cache full,window:256,sinkwindow:4:256,fp8
      evalkit run --prompts my_prompts.jsonl
      evalkit run --model hf --model-args pretrained=/models/qwen --tasks firsttoken
      evalkit run --tasks needle_en,needle_en_hint --needle-lengths long --needle-depths 0,0.5,1 --attention
      evalkit run --tasks needle_conflict --needle-lengths 256,512,1024
    """
    from evalkit import api

    def started(rid: str) -> None:
        click.echo(f"run {rid} started", err=True)

    lists = [f"--{k.replace('_', '-')} {opts[k]}" for k in ("quant", "kv_cache") if "," in (opts.get(k) or "")]
    runs = api.run_all(opts.pop("tasks") or "", opts.pop("model"), on_start=started, on_done=_print_result, **opts)
    stored = [r for r in runs if not r.status.startswith("not stored")]  # a non-zero rank stores nothing
    if len(stored) > 1:
        ids = " ".join(r.id for r in stored)
        click.echo(f"sweep of {len(runs)} runs ({', '.join(lists)}): {ids}")
        click.echo(f"compare them: evalkit compare {ids}")


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


COMMANDS = [run_command]
