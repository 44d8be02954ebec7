"""The few exceptions library code raises; only the CLI turns them into messages and exit codes.

Owns: the exception types. Does not: print, exit, or format anything.
"""


class EvalkitError(Exception):
    """Base of every error evalkit raises on purpose."""

    exit_code = 1
    label = "error"  # how the CLI's one line names it: `evalkit: <label>: <message>`; "" when the message does


class BadInput(EvalkitError):
    """The user asked for something that cannot be done as asked (exit 2, DB untouched)."""

    exit_code = 2


class StorageFault(BadInput):
    """The DB's file system refused a write: full, over quota, read-only, not permitted (exit 2, one line)."""


class RunFailed(EvalkitError):
    """A run or gate failed at run time (exit 1)."""

    exit_code = 1

class GateInconclusive(EvalkitError):
    """The gate could neither pass nor fail the candidate: some check's interval straddles its limit (exit 3).
    A verdict, not an error: its message begins "gate inconclusive" and the CLI prints it with no "error:"."""

    exit_code = 3
    label = ""


class DatabaseBusy(RunFailed):
    """Another process held the DuckDB file's lock for longer than evalkit waits (exit 1)."""


class ResultsKept(RunFailed):
    """A run finished but its results could not be written to the DB; they wait in a spool file (exit 1)."""
