"""The `evalkit` command group: one module per command, errors mapped to exit codes here.

Exit codes: 0 ok; 1 a gate failed or a run failed at run time; 2 bad input; 3 the gate
was inconclusive (printed as `evalkit: gate inconclusive ...`, a verdict, not an error).
Library code raises `evalkit.errors`; only this package turns those into one
line on stderr and an exit code. Every command starts by checking the environment
(`envvars.check_environment`), before it reads or writes anything. Heavy imports
(torch, lm-eval, duckdb) happen inside commands, so `evalkit --help` stays fast.
"""

from __future__ import annotations

import importlib
import sys

import click

from evalkit import envvars, redact
from evalkit.version import __version__
from evalkit.errors import BadInput, EvalkitError
from evalkit.textsafe import term_line, term_text


class CliError(click.ClickException):
    """An evalkit error on its way out: one line, the error's own exit code."""

    def __init__(self, message: str, exit_code: int, label: str = "error") -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click declares it per class; evalkit's vary per error
        self.label = label

    def show(self, file=None) -> None:
        label = f"{self.label}: " if self.label else ""  # a verdict (gate inconclusive) is not an error
        click.echo(term_text(f"evalkit: {label}{redact.text(self.format_message())}"), err=True)  # names in it stay text


class EvalkitGroup(click.Group):
    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:  # one line, not click's usage block
            raise CliError(exc.format_message(), 2) from exc
        except KeyboardInterrupt as exc:  # before click's Abort, which prints a blank line first
            raise CliError("interrupted", 130) from exc
        except EvalkitError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            raise CliError(str(exc), exc.exit_code, exc.label) from exc


@click.group(cls=EvalkitGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="evalkit")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors [env EVALKIT_DEBUG].")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """evalkit: first-token, opener and needle metrics on lm-eval, kept in DuckDB.

    \b
    Examples:
      evalkit run --tasks firsttoken --limit 20
      evalkit runs
      evalkit query "SELECT template, metric, value FROM leaderboard"
    """
    ctx.ensure_object(dict)
    redact.install_log_scrub()  # every log line, evalkit's and libraries', without the process's secrets
    envvars.api_key()  # the key in the environment is registered, so no command shows it (`redact`)
    envvars.check_environment()  # a bad value is one line, exit 2, before any work
    ctx.obj["debug"] = debug or envvars.debug()


# one module per command (or small family of commands), each exporting COMMANDS
_COMMAND_MODULES = [
    "run",
    "runs",
    "query",
    "needle",
    "compare",
    "inspect",
    "export",
    "report",
    "gate",
    "tags",
    "metrics",
    "db",
    "tasks",
    "drift",
]

for _name in _COMMAND_MODULES:
    for _cmd in importlib.import_module(f"evalkit.cli.{_name}").COMMANDS:
        cli.add_command(_cmd)


def main() -> None:
    """Console entry point: unexpected errors become one line unless --debug."""
    debug = "--debug" in sys.argv or _debug_env()
    try:
        cli.main(standalone_mode=False, prog_name="evalkit")
    except click.exceptions.Abort:
        click.echo("evalkit: aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("evalkit: interrupted", err=True)
        sys.exit(130)
    except Exception as exc:  # a bug: keep it to one line unless asked
        if debug:
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        click.echo(term_line(f"evalkit: internal error: {type(exc).__name__}: {redact.text(first)} (rerun with --debug)"),
                   err=True)
        sys.exit(1)


def _debug_env() -> bool:
    """EVALKIT_DEBUG, read before click runs; a value it does not accept reads as off here, and
    the group's `check_environment` refuses it with one line (exit 2)."""
    try:
        return envvars.debug()
    except BadInput:
        return False
