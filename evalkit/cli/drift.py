"""`evalkit drift-corpus FILE --quant BASE,CAND`: a text scored as `llama-perplexity --kl-divergence` scores it."""

from __future__ import annotations

import click

from evalkit.cli.options import whole
from evalkit.runner.corpus import DEFAULT_N_CTX


@click.command("drift-corpus")
@click.argument("text_file", type=click.Path(dir_okay=False))
@click.option("--quant", required=True,
              help="Comma list of --quant variants; the first is the base, e.g. q4_1,int8-weight.")
@click.option("--model", default="hf", show_default=True, help="lm-eval model type (the hf engine only).")
@click.option("--model-args", default=None, help="K=V,... (default: the embedded SmolLM2 GGUF).")
@click.option("--n-ctx", type=whole(8), default=DEFAULT_N_CTX, show_default=True,
              help="Chunk length in tokens; the second half of each chunk is scored.")
@click.option("--chunks", type=whole(1), default=None, help="Score only the first N chunks.")
@click.option("--batch-size", type=whole(1), default=4, show_default=True)
@click.option("--device", default=None, help="cpu, cuda, cuda:0, mps.")
def drift_corpus_command(text_file, quant, model, model_args, n_ctx, chunks, batch_size, device):
    """KL divergence, Δp and same top of each variant against the first over a text, in llama.cpp's lines.

    The text is tokenised with BOS first and cut into chunks of --n-ctx tokens (each chunk's first
    token replaced by BOS); every position of the second half of a chunk is scored, as
    `llama-perplexity --kl-divergence` scores it. Nothing is stored.

    \b
    Examples:
      evalkit drift-corpus wiki.test.raw --quant q4_1,int8-weight
      evalkit drift-corpus book.txt --quant q4_1,int4-weight,hqq4 --n-ctx 256 --chunks 20
    """
    from evalkit.engines.transformers.quant import parse_sweep
    from evalkit.runner.corpus import corpus_drift
    from evalkit.scoring.drift import format_summary

    def show(result) -> None:
        click.echo(f"== {result.variant} against {result.base}: {result.summary.n} positions, "
                   f"{result.n_chunks} chunks of {result.n_ctx} tokens, {result.seconds:.1f}s ==")
        click.echo(format_summary(result.summary))
        click.echo()

    corpus_drift(text_file, parse_sweep(quant), model=model, model_args=model_args, n_ctx=n_ctx, chunks=chunks,
                 batch_size=batch_size, device=device, on_variant=show)


COMMANDS = [drift_corpus_command]
