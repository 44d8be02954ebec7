"""Every environment variable evalkit reads: one record each, all checked before any work.

Owns: the records (`VARIABLES`: name, kind, default, one-line meaning), what each kind
accepts, `check_environment()` — every set variable parsed, and a RANK or LOCAL_RANK above
0 refused outside a real distributed launch, with one line (BadInput) before a command or
an API call writes a row or loads a model — and the typed getters the rest of evalkit
reads (`lock_timeout()`, `heartbeat_s()`, `debug()`, `rank()`, ...). An empty value is
the same as an unset one (as click takes it). `python -m evalkit.envvars` prints the
table of docs/environment.md. Does not: decide what a value does (the module that reads
it does), or read what only the libraries under evalkit read (lm-eval, torch,
transformers, HF_HUB_*).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast, get_args

from evalkit.errors import BadInput

# path: any path (it may not exist yet); file / folder: one that exists; seconds: a finite
# number in [low, high]; int: a whole number >= low; flag: on or off; choice: one of
# `choices`; text: anything; secret: printable ASCII without spaces (an HTTP header's token),
# never shown in a message
Kind = Literal["path", "file", "folder", "seconds", "int", "flag", "choice", "text", "secret"]
KINDS: tuple[str, ...] = get_args(Kind)

FLAG_ON = ("1", "true", "yes", "on")
FLAG_OFF = ("0", "false", "no", "off")
CACHE_OFF = ("none", "off", "0")  # EVALKIT_CACHE spellings that turn the model cache off
DEFAULT_DB = Path("reports") / "evalkit.duckdb"
# the variables a distributed launcher (torchrun, `accelerate launch`, deepspeed) sets
# besides RANK / LOCAL_RANK / WORLD_SIZE; one of them tells a launch from a leftover RANK
LAUNCH_MARKERS = ("MASTER_ADDR", "TORCHELASTIC_RUN_ID")
DEFAULT_API_KEY_VAR = "EVALKIT_API_KEY"
MAX_SECRET_CHARS = 8192
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: what it is, what it accepts, what it means."""

    name: str
    kind: Kind
    default: str | None  # spelled as a user would set it; None: the meaning says what happens unset
    meaning: str
    low: float | None = None  # seconds / int: the smallest value accepted
    above_low: bool = False  # seconds: `low` itself is refused (a timeout of 0)
    high: float | None = None  # seconds: the largest value accepted
    choices: tuple[str, ...] = ()  # choice: the values accepted
    off: tuple[str, ...] = ()  # path: the spellings that turn the thing off

    @property
    def accepted(self) -> str:
        """What the variable accepts, as the end of "expected ...".

        >>> VARS["EVALKIT_LOCK_TIMEOUT"].accepted
        'a finite number of seconds >= 0'
        """
        if self.kind in ("seconds", "int"):
            low = ">" if self.above_low else ">="
            bounds = [f"{op} {bound:g}" for op, bound in ((low, self.low), ("<=", self.high)) if bound is not None]
            what = "a finite number of seconds" if self.kind == "seconds" else "a whole number"
            return " ".join([what, " and ".join(bounds)]).strip()
        if self.kind == "flag":
            return "one of " + ", ".join(f"{on}/{off}" for on, off in zip(FLAG_ON, FLAG_OFF))
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "path" and self.off:
            return f"a path, or {self.off[0]} to turn it off"
        if self.kind == "secret":
            return f"printable ASCII without spaces, at most {MAX_SECRET_CHARS} characters"
        return {"path": "a path", "file": "an existing file", "folder": "an existing folder", "text": "any text"}[self.kind]

    def raw(self) -> str | None:
        """The value as set, None when unset or empty."""
        return os.environ.get(self.name) or None

    def parse(self, raw: str) -> Any:
        """`raw` as this kind's value (Path, float, int, bool or str; None for an `off` spelling),
        or BadInput naming the variable, the value and what is accepted.

        >>> VARS["EVALKIT_DEBUG"].parse("off")
        False
        """
        value = self._parse(raw)
        if value is _BAD and self.kind == "secret":  # the value is never shown
            raise BadInput(f"{self.name} is set to a value evalkit cannot send: expected {self.accepted}")
        if value is _BAD:
            raise BadInput(f"{self.name}={raw!r}: expected {self.accepted}")
        return value

    def _parse(self, raw: str) -> Any:
        text = raw.strip()
        if self.kind == "text":
            return raw
        if self.kind == "secret":
            ok = 0 < len(raw) <= MAX_SECRET_CHARS and all("!" <= c <= "~" for c in raw)
            return raw if ok else _BAD
        if not text:  # set to blanks only
            return _BAD
        if self.kind == "flag":
            low = text.lower()
            return True if low in FLAG_ON else False if low in FLAG_OFF else _BAD
        if self.kind == "choice":  # as given: click's `--format` choice takes it unstripped too
            return raw if raw in self.choices else _BAD
        if self.kind in ("seconds", "int"):
            return self._number(text)
        if text.lower() in self.off:
            return None
        path = Path(raw)  # a path as given: `--db` takes $EVALKIT_DB unstripped too
        if (self.kind == "file" and not path.is_file()) or (self.kind == "folder" and not path.is_dir()):
            return _BAD
        return path

    def _number(self, text: str) -> Any:
        try:
            value = float(text) if self.kind == "seconds" else int(text)
        except ValueError:
            return _BAD
        if not math.isfinite(value) or (self.high is not None and value > self.high):
            return _BAD
        if self.low is not None and (value < self.low or (self.above_low and value == self.low)):
            return _BAD
        return value

    def get(self) -> Any:
        """The parsed value, else the parsed default (None when there is none)."""
        raw = self.raw() or self.default
        return None if raw is None else self.parse(raw)


_BAD = object()  # what `_parse` returns for a value the kind does not accept

# a run on another host is taken for abandoned when its heartbeat is 10 minutes old
# (`store.rows.STALE_AFTER`): a beat may be skipped once and the run still look alive
HEARTBEAT_MAX_S = 300.0

VARIABLES: tuple[EnvVar, ...] = (
    EnvVar("EVALKIT_DB", "path", str(DEFAULT_DB), "The DuckDB file every command reads or writes (`--db`)."),
    EnvVar("EVALKIT_FORMAT", "choice", "table", "Output format of the commands that print tables (`--format`).",
           choices=("table", "csv", "json")),
    EnvVar("EVALKIT_LOCK_TIMEOUT", "seconds", "120",
           "How long to wait for another process's lock on the DB file before giving up.", low=0),
    EnvVar("EVALKIT_HEARTBEAT_S", "seconds", "60",
           "Seconds between a running run's heartbeats (0: none; runs on other hosts then look abandoned "
           "after 10 minutes).", low=0, high=HEARTBEAT_MAX_S),
    EnvVar("EVALKIT_QUERY_TIMEOUT", "seconds", "300",
           "Seconds `evalkit query` lets the SQL run before it stops it (`--timeout`).", low=0, above_low=True),
    EnvVar("EVALKIT_DEBUG", "flag", "off", "Show tracebacks instead of one-line errors (`--debug`)."),
    EnvVar("EVALKIT_CACHE", "path", None,
           "Folder of GGUF models converted once, and of the model-arg names `--model hf` checks before a load (default `$XDG_CACHE_HOME/evalkit`, else `~/.cache/evalkit`).",
           off=CACHE_OFF),
    EnvVar("XDG_CACHE_HOME", "path", None, "Where `EVALKIT_CACHE` defaults to (`~/.cache` when unset)."),
    EnvVar("EVALKIT_TASKS", "folder", None, "evalkit's lm-eval task YAMLs, instead of the installed `evalkit.tasks`."),
    EnvVar("EVALKIT_TEMPLATES", "file", None,
           "YAML file of extra prompt templates, added to the packaged ones (`--templates-file`)."),
    EnvVar("EVALKIT_OPENERS", "file", None, "Opener lexicon YAML used instead of the packaged `data/openers.yaml`."),
    EnvVar("EVALKIT_HUB_KERNELS", "flag", "off",
           "Let transformers fetch and run hub kernels (`kernels-community/...`) for the models evalkit loads; "
           "off: evalkit sets `USE_HUB_KERNELS=0` in its process and loads with `use_kernels=False`."),
    EnvVar("USE_HUB_KERNELS", "text", None,
           "transformers' own hub-kernel switch: evalkit sets it to 0 in its process unless "
           "`EVALKIT_HUB_KERNELS` (or `--model-args use_kernels=True`) opts in; then transformers reads it as set."),
    EnvVar("OMP_WAIT_POLICY", "text", None,
           "How torch's OpenMP threads wait (libgomp reads it: ACTIVE spins, PASSIVE sleeps). Unset and the "
           "1-minute load average at least the usable cores when a model loads: evalkit sets PASSIVE in its "
           "process and says so (docs/performance.md, \"On a shared machine\"); any value set is left as it is."),
    EnvVar(DEFAULT_API_KEY_VAR, "secret", None,
           "API key the server engine (`--model server`) sends as `Authorization: Bearer` to its `base_url`'s "
           "host only; `--model-args api_key_env=NAME` reads it from another variable. Never stored or shown."),
    EnvVar("GITHUB_STEP_SUMMARY", "path", None, "File `evalkit gate` appends its verdict to (set by GitHub Actions)."),
    EnvVar("RANK", "int", "0", "This process's global rank in a distributed launch; only rank 0 stores the run.",
           low=0),
    EnvVar("LOCAL_RANK", "int", "0", "This process's rank on its node; the rank when RANK is unset.", low=0),
    EnvVar("WORLD_SIZE", "int", None, "How many processes a distributed launch runs (unset: not a launch).", low=1),
    EnvVar("MASTER_ADDR", "text", None, "Set by torchrun / `accelerate launch`: marks a real distributed launch."),
    EnvVar("TORCHELASTIC_RUN_ID", "text", None, "Set by torchrun: marks a real distributed launch."),
)
VARS: dict[str, EnvVar] = {v.name: v for v in VARIABLES}


def check_environment() -> None:
    """Refuse (BadInput, one line) the first set variable evalkit cannot use, and a RANK or
    LOCAL_RANK above 0 outside a distributed launch, whose run would store nothing."""
    for var in VARIABLES:
        var.get()
    problem = launch_problem()
    if problem:
        raise BadInput(problem)


def launch_problem() -> str | None:
    """Why a non-zero RANK / LOCAL_RANK is not part of a real distributed launch, or None."""
    world = VARS["WORLD_SIZE"].get()
    for name in ("RANK", "LOCAL_RANK"):
        rank_ = VARS[name].get()
        if not rank_:
            continue
        if world is None:
            why = "WORLD_SIZE unset"
        elif world <= rank_:
            why = f"WORLD_SIZE={world} is not above it"
        elif not launched():
            why = f"none of {', '.join(LAUNCH_MARKERS)} is set"
        else:
            continue
        return f"{name}={rank_} is set but this is not a distributed launch ({why}): unset {name}"
    return None


def launched() -> bool:
    """Whether a distributed launcher started this process (it set one of LAUNCH_MARKERS)."""
    return any(VARS[name].get() for name in LAUNCH_MARKERS)


# ---- the typed getters the rest of evalkit reads -------------------------------------------


def db() -> Path:
    """The DB file: $EVALKIT_DB, else reports/evalkit.duckdb."""
    return cast(Path, VARS["EVALKIT_DB"].get())


def lock_timeout() -> float:
    """Seconds to wait for another process's lock on the DB (default 120)."""
    return cast(float, VARS["EVALKIT_LOCK_TIMEOUT"].get())


def heartbeat_s() -> float:
    """Seconds between a run's heartbeats (default 60; 0: no heartbeat)."""
    return cast(float, VARS["EVALKIT_HEARTBEAT_S"].get())


def debug() -> bool:
    """Whether EVALKIT_DEBUG asks for tracebacks."""
    return cast(bool, VARS["EVALKIT_DEBUG"].get())


def api_key(name: str | None = None) -> str | None:
    """The server engine's API key: the variable `name` names (`--model-args api_key_env=NAME`), which
    must then be set, else $EVALKIT_API_KEY (None when unset). BadInput (one line that never shows
    the value) for a name that is no variable name, an unset named variable, or a value that cannot
    be an HTTP header's token."""
    from evalkit import redact

    if name is None or name == DEFAULT_API_KEY_VAR:
        redact.register(VARS[DEFAULT_API_KEY_VAR].raw())  # hidden by value wherever evalkit writes text
        return cast("str | None", VARS[DEFAULT_API_KEY_VAR].get())
    if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
        raise BadInput(f"--model-args api_key_env={name!r}: expected the name of an environment variable")
    var = EnvVar(name, "secret", None, "the API key --model-args api_key_env names")
    if var.raw() is None:
        raise BadInput(f"--model-args api_key_env={name}: {name} is not set (or empty); set it to the API key")
    redact.register(var.raw())
    return cast(str, var.get())


def cache() -> Path | None:
    """The converted-model cache folder, None when EVALKIT_CACHE turns it off (none/off/0)."""
    var = VARS["EVALKIT_CACHE"]
    if var.raw() is not None:
        path = var.get()
        return None if path is None else path.expanduser()
    return (VARS["XDG_CACHE_HOME"].get() or Path.home() / ".cache") / "evalkit"


def tasks() -> Path | None:
    """$EVALKIT_TASKS (an existing folder), None when unset."""
    return cast("Path | None", VARS["EVALKIT_TASKS"].get())


def templates() -> Path | None:
    """$EVALKIT_TEMPLATES (an existing file), None when unset."""
    return cast("Path | None", VARS["EVALKIT_TEMPLATES"].get())


def openers() -> Path | None:
    """$EVALKIT_OPENERS (an existing file), None when unset."""
    return cast("Path | None", VARS["EVALKIT_OPENERS"].get())


def hub_kernels() -> bool:
    """Whether EVALKIT_HUB_KERNELS opts in to transformers' hub kernels (default off)."""
    return cast(bool, VARS["EVALKIT_HUB_KERNELS"].get())


def step_summary() -> Path | None:
    """$GITHUB_STEP_SUMMARY, None when unset."""
    return cast("Path | None", VARS["GITHUB_STEP_SUMMARY"].get())


def rank() -> int:
    """This process's rank: RANK, else LOCAL_RANK, else 0 (rank 0 is the one that stores runs)."""
    for name in ("RANK", "LOCAL_RANK"):
        if VARS[name].raw() is not None:
            return cast(int, VARS[name].get())
    return 0


def world_size() -> int:
    """How many processes the launch runs (1 outside a launch)."""
    return cast("int | None", VARS["WORLD_SIZE"].get()) or 1


# ---- the documentation -----------------------------------------------------------------------


def doc_table() -> str:
    """The markdown table of docs/environment.md, one row per record."""
    rows = ["| Variable | Accepts | Default | Meaning |", "| --- | --- | --- | --- |"]
    for var in VARIABLES:
        default = f"`{var.default}`" if var.default is not None else "unset"
        rows.append(f"| `{var.name}` | {var.accepted} | {default} | {var.meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(doc_table(), end="")
