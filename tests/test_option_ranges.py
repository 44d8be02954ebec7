"""Every integer option has a range (issue 36, class 7): one click type, `options.whole`.

A command's integer option that takes any Python int lets a number through that no command
can use or store (`evalkit runs --limit 9223372036854775808` reached DuckDB as a
ConversionException). This walks every registered command and holds each integer option
(and the integer items of a list option) to a click IntRange with both ends set, within what
an INTEGER column holds; then the numbers beyond it are one usage line, exit 2.
"""

from __future__ import annotations

import click
import pytest

from evalkit.cli import cli
from evalkit.cli.options import INT_MAX, whole

HUGE = ["9223372036854775808", "-9223372036854775809", "2147483648", "1" + "0" * 400]


def integer_options():
    for name, command in sorted(cli.commands.items()):
        for param in command.params:
            if isinstance(param.type, click.types.IntParamType):
                yield name, param


def test_the_storage_bound_is_the_run_configs():
    from evalkit.runner.config import INT32_MAX

    assert INT_MAX == INT32_MAX
    with pytest.raises(ValueError):
        whole(0, INT_MAX + 1)


@pytest.mark.parametrize("command,param", list(integer_options()),
                         ids=[f"{n}-{p.name}" for n, p in integer_options()])
def test_every_integer_option_is_bounded(command, param):
    assert isinstance(param.type, click.IntRange), f"evalkit {command} {param.opts[0]} takes any int: use options.whole"
    assert param.type.min is not None and param.type.max is not None
    assert param.type.max <= INT_MAX


def test_no_option_is_an_untyped_integer():
    """An option whose default is an int but whose type is not an integer type would take text."""
    for name, command in cli.commands.items():
        for param in command.params:
            if isinstance(param.default, int) and not isinstance(param.default, bool) and param.callback is None:
                assert isinstance(param.type, click.IntRange), f"evalkit {name} {param.opts[0]}"


ARGS = {  # what else each command needs to reach its option
    "run": ["--model", "evalkit-fake", "--tasks", "firsttoken"],
    "drift-corpus": ["{text}", "--quant", "fp32,bf16"],
    "inspect": ["hello"],
    "report": ["--out", "{tmp}/r"],
}


@pytest.mark.parametrize("number", HUGE)
@pytest.mark.parametrize("command,param", list(integer_options()),
                         ids=[f"{n}-{p.name}" for n, p in integer_options()])
def test_a_number_beyond_the_range_is_one_line(invoke, tmp_path, command, param, number):
    (tmp_path / "t.txt").write_text("some text\n")
    args = [a.format(tmp=tmp_path, text=tmp_path / "t.txt") for a in ARGS.get(command, [])]
    res = invoke(command, *args, param.opts[0], number)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2, res.output
    assert len(lines) == 1 and lines[0].startswith("evalkit: error: ") and param.opts[0] in lines[0], res.stderr
    assert not (tmp_path / "evalkit.duckdb").exists()


@pytest.mark.parametrize("value", ["9223372036854775808", "256,2147483648", "0"])
def test_needle_lengths_items_are_bounded(invoke, value):
    res = invoke("run", "--model", "evalkit-fake", "--tasks", "needle", "--needle-lengths", value)
    assert res.exit_code == 2, res.output
    assert "--needle-lengths" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_runs_limit_beyond_int64(invoke, fake_run, tmp_path):
    db = tmp_path / "r.duckdb"
    fake_run(db)
    before = db.read_bytes()
    res = invoke("runs", "--limit", "9223372036854775808", "--db", db)
    assert res.exit_code == 2 and "--limit" in res.stderr and "ConversionException" not in res.stderr, res.output
    assert db.read_bytes() == before
    assert invoke("runs", "--limit", str(INT_MAX), "--db", db).exit_code == 0
