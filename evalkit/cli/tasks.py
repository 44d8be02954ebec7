"""`evalkit tasks-path`: where evalkit's lm-eval task YAMLs are installed (for `lm_eval --include_path`)."""

from __future__ import annotations

import click


@click.command("tasks-path")
def tasks_path_command():
    """Print the folder of evalkit's lm-eval tasks, to use them under plain lm-eval.

    \b
    Examples:
      evalkit tasks-path
      lm_eval --include_path "$(evalkit tasks-path)" --tasks firsttoken --model hf --model_args pretrained=M
    """
    from evalkit.prompts.catalog import tasks_path

    click.echo(str(tasks_path()))


COMMANDS = [tasks_path_command]
