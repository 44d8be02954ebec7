"""A running run's journal: each finished prompt's response, bound to one DB, so a run that
stops before its end can be resumed where it stopped.

Owns: the journal file `RUN.journal` (where it lives, its format, writing and verifying
it), the configuration `fingerprint` a resume must match, and `Journal.batch`, through
which a backend computes or replays one batch. Does not: run anything, or decide which
runs may resume (`runner.resume` does).

Where it lives: beside the DB's kept runs, in `<db>.spool/`, or, when that folder cannot
be written, in the per-user folder named by the DB's uuid (`spool.fallback_dir`).

The format is JSON lines. The first line is the header: the format, the DB's uuid, the
run id, the configuration's fingerprint and a signature over them with the DB's key
(`evalkit_meta.spool_key`). Every later line is one prompt's response as soon as that prompt
is finished (`record_row`: its batch's key — the SHA-256 of what defines the batch, its place
in the request list and its prompts — its row in the batch, the batch's size, the response),
or a whole batch's responses at once (`record`, for a backend that finishes a batch at once),
each with a signature chained to the line before it. A kill loses only the prompts in flight. So a journal of another DB, another run, a
changed configuration, or with a line changed, removed, moved or added, fails to verify,
and resume refuses it with one line naming the file. A last line cut short by a crash
(no newline) is dropped: its batch simply runs again — the file is cut back to its verified
lines only when the resumed run writes its first batch, so a refused resume changes nothing.
The file is read line by line (`paths.open_input`: a regular file, not a link, at most
MAX_JOURNAL_BYTES, each line at most MAX_LINE_BYTES, the header MAX_HEADER_BYTES), never whole.

Why a batch is still the unit of replay: a backend's numbers depend on the batch a prompt was
padded in, and on the batch's seed. A resumed run forms the same batches from the same request
list and replays those whose every prompt is in the journal; a batch of which only some prompts
were journaled runs again whole (its rows come out the same), and the prompts already journaled
are not written twice. So its rows are the rows of an uninterrupted run.

What a row costs: `bench/journal_rows.py` times encoding, signing, writing and flushing
(`fsync`) one prompt's line against one line per batch of 32 prompts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evalkit import redact
from evalkit.contract import FirstStepResult
from evalkit.errors import BadInput
from evalkit.paths import open_input, read_lines
from evalkit.store import spool

FORMAT = 2  # 2: lines of one prompt ("row"); a format-1 journal (whole batches only) still reads
FORMATS = (1, 2)
SUFFIX = ".journal"
MAX_JOURNAL_BYTES = 16 << 30  # a journal is read line by line; one larger than this is refused
MAX_HEADER_BYTES = 1 << 20  # its first line: the format, the DB's uuid, the run and its fingerprint
MAX_LINE_BYTES = 256 << 20  # one batch's responses (64 prompts x a 49k-token top-k: about 110 MB)
log = logging.getLogger("evalkit")


def path_in(folder: Path, run_id: str) -> Path:
    return folder / f"{run_id}{SUFFIX}"


def find(db: Path, ident: spool.Identity, run_id: str) -> Path | None:
    """The journal of `run_id` in the DB's spool folder or its fallback folder, None when there is none."""
    for folder in (spool.spool_dir(db), spool.fallback_dir(ident)):
        path = path_in(folder, run_id)
        if os.path.lexists(path) and spool.trusted(db, folder):
            return path
    return None


def key_of(parts: Any) -> str:
    """The key of one batch: the SHA-256 of what defines it, as canonical JSON.

    >>> key_of(["gen", 0, ["a", "b"]]) == key_of(["gen", 0, ["a", "b"]]) != key_of(["gen", 8, ["a", "b"]])
    True
    """
    return hashlib.sha256(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


# ---- responses as JSON ------------------------------------------------------------------


def encode(result: FirstStepResult) -> dict[str, Any]:
    """A FirstStepResult as JSON values; `decode` gives back an equal object (floats round-trip exactly)."""
    return {
        "text": result.text, "first_token_id": result.first_token_id, "first_token": result.first_token,
        "first_unit": result.first_unit, "topk": [list(t) for t in result.topk], "entropy": result.entropy,
        "metrics": result.metrics, "answer_text": result.answer_text,
        "units": [[int(k), v] for k, v in result.units.items()], "layers": result.layers,
        "token_ids": [int(t) for t in result.token_ids], "skipped": list(result.skipped),
        "first_chars": [[e, p] for e, p in result.first_chars], "fc_rest_mass": result.fc_rest_mass,
        "fc_unresolved_mass": result.fc_unresolved_mass,
    }


def decode(data: dict[str, Any]) -> FirstStepResult:
    return FirstStepResult(
        text=data["text"], first_token_id=data["first_token_id"], first_token=data["first_token"],
        first_unit=data["first_unit"], topk=[(int(i), str(t), float(lp)) for i, t, lp in data["topk"]],
        entropy=data["entropy"], metrics=dict(data["metrics"]), answer_text=data["answer_text"],
        units={int(k): v for k, v in data["units"]}, layers={k: list(v) for k, v in data["layers"].items()},
        token_ids=[int(t) for t in data["token_ids"]], skipped=tuple(data.get("skipped") or ()),
        first_chars=[(str(e), float(p)) for e, p in data.get("first_chars") or ()],
        fc_rest_mass=data.get("fc_rest_mass"), fc_unresolved_mass=data.get("fc_unresolved_mass"),
    )


# ---- the file ---------------------------------------------------------------------------


def _dumps(value: Any) -> str:
    """A journal line's text: every line written and signed passes here, its secrets as `***` (`redact`)."""
    if redact.active():
        value = redact.value(value)
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _sign(ident: spool.Identity, previous: str, payload: str) -> str:
    message = f"evalkit-journal/{FORMAT}\n{ident.db_uuid}\n{previous}\n{payload}".encode()
    return hmac.new(bytes.fromhex(ident.key), message, hashlib.sha256).hexdigest()


@dataclass
class Journal:
    """One run's journal, open for appending; `batch` replays a batch it holds or computes and appends it."""

    path: Path | None  # None: the run keeps no journal (no folder could hold one)
    ident: spool.Identity
    run_id: str
    last_sig: str
    batches: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # key -> every response of the batch
    rows: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)  # key -> {row: response}, batches in part
    replayed: int = 0  # batches served from the journal in this process
    computed: int = 0  # batches computed in this process
    _fd: int | None = None
    _resume_at: tuple[int, int, int] | None = None  # resumed: (device, inode, verified bytes), cut to on first write

    # -- opening --------------------------------------------------------------

    @classmethod
    def create(cls, db: Path, ident: spool.Identity, run_id: str, fingerprint: dict[str, Any]) -> Journal:
        """A new, empty journal for a run that starts now. When no folder can hold it the run goes
        on without one, with one warning: a journal only saves work, it holds no result."""
        header = {"format": FORMAT, "kind": "evalkit-journal", "db_uuid": ident.db_uuid, "run_id": run_id,
                  "fingerprint": fingerprint}
        payload = _dumps(header)
        sig = _sign(ident, "", payload)
        errors = []
        for folder in (spool.spool_dir(db), spool.fallback_dir(ident)):
            try:
                path = path_in(spool.make_folder(db, folder), run_id)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            except OSError as exc:
                errors.append(f"{folder}: {exc.strerror or exc}")
                continue
            journal = cls(path, ident, run_id, sig, _fd=fd)
            if journal._append({"header": header, "sig": sig}):
                return journal
            path.unlink(missing_ok=True)
            errors.append(f"{folder}: cannot be written")
        log.warning("evalkit: run %s keeps no journal, so it cannot be resumed (%s)", run_id, "; ".join(errors))
        return cls(None, ident, run_id, sig)

    @classmethod
    def resume(cls, path: Path, ident: spool.Identity, run_id: str) -> tuple[Journal, dict[str, Any]]:
        """The journal at `path` verified, with its header's fingerprint; BadInput naming the file
        when it is not this DB's journal of this run, or was changed. Nothing is written here: the
        file is opened for appending (and a last line cut short by a crash dropped) when the
        resumed run writes its first batch, so a resume refused after this leaves it as it was."""
        batches, rows, last_sig, header, good_bytes, ino = _read(path, ident, run_id)
        return (cls(path, ident, run_id, last_sig, batches, rows, _resume_at=(*ino, good_bytes)),
                header["fingerprint"])

    def _writable(self) -> bool:
        """Whether lines can be appended; a resumed journal is opened (and cut back to the lines
        that verified) on its first write, only if it is still the file that was verified."""
        if self._fd is None and self._resume_at is not None and self.path is not None:
            dev, ino, good_bytes = self._resume_at
            self._resume_at = None
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            except OSError as exc:
                log.warning("evalkit: the journal %s of run %s cannot be written (%s); a resume would run the "
                            "rest again", self.path, self.run_id, exc.strerror or exc)
                return False
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (dev, ino) or st.st_size < good_bytes:
                os.close(fd)
                log.warning("evalkit: the journal %s of run %s changed after it was verified; it is left as it is "
                            "and this run keeps no journal", self.path, self.run_id)
                self.path = None
                return False
            try:
                os.truncate(fd, good_bytes)  # a last line cut short by a crash goes
            except OSError as exc:
                os.close(fd)
                log.warning("evalkit: the journal %s of run %s cannot be written (%s)", self.path, self.run_id,
                            exc.strerror or exc)
                return False
            self._fd = fd
        return self._fd is not None

    # -- use ------------------------------------------------------------------

    def batch(self, parts: Any, compute: Callable[[], Sequence[FirstStepResult]]) -> list[FirstStepResult]:
        """The responses of the batch `parts` defines: replayed from the journal when it holds them,
        else computed and appended."""
        held = self.held(parts)
        if held is not None:
            return held
        results = list(compute())
        self.record(parts, results)
        return results

    def held(self, parts: Any) -> list[FirstStepResult] | None:
        """The responses the journal holds for the batch `parts` defines (counted as replayed), or None."""
        held = self.batches.get(key_of(parts))
        if held is None:
            return None
        self.replayed += 1
        return [decode(d) for d in held]

    def record(self, parts: Any, results: Sequence[FirstStepResult]) -> None:
        """Append the responses computed for the batch `parts` defines (once its last one is done);
        the prompts of it already journaled one by one are not written again."""
        key = key_of(parts)
        self.computed += 1
        if key in self.batches:
            return
        held = self.rows.get(key)
        if held:
            for i, result in enumerate(results):
                if i not in held:
                    self._append_row(key, i, len(results), result)
            return
        if self._writable():
            encoded = [encode(r) for r in results]
            payload = _dumps({"key": key, "results": encoded})
            sig = _sign(self.ident, self.last_sig, payload)
            if self._append({"key": key, "results": encoded, "sig": sig}):
                self.last_sig = sig
                self.batches[key] = encoded

    def record_row(self, parts: Any, row: int, size: int, result: FirstStepResult) -> None:
        """Append the response of prompt `row` of the batch `parts` defines (`size` prompts), as soon
        as it is finished; once every prompt of the batch is in, a resume replays the batch. A prompt
        already journaled (a batch run again) is not written twice. The backend still calls `record`
        when the whole batch is done (which counts it as computed and writes what is missing)."""
        self.record_rows([(parts, row, size, result)])

    def record_rows(self, finished: Sequence[tuple[Any, int, int, FirstStepResult]]) -> None:
        """`record_row` for several prompts that finished together (one decode step's), written and
        flushed to disk at once: one fsync, not one a prompt."""
        todo: list[tuple[str, int, int, FirstStepResult]] = []
        seen: set[tuple[str, int]] = set()
        for parts, row, size, result in finished:
            key = key_of(parts)
            if key not in self.batches and row not in self.rows.get(key, {}) and (key, row) not in seen:
                seen.add((key, row))
                todo.append((key, row, size, result))
        if todo:
            self._append_rows(todo)

    def _append_row(self, key: str, row: int, size: int, result: FirstStepResult) -> None:
        self._append_rows([(key, row, size, result)])

    def _append_rows(self, rows: Sequence[tuple[str, int, int, FirstStepResult]]) -> None:
        if not self._writable():
            return
        lines: list[dict[str, Any]] = []
        encoded = [encode(result) for _, _, _, result in rows]
        sig = self.last_sig
        for (key, row, size, _), enc in zip(rows, encoded):
            sig = _sign(self.ident, sig, _dumps({"key": key, "row": row, "of": size, "result": enc}))
            lines.append({"key": key, "row": row, "of": size, "result": enc, "sig": sig})
        if self._append(*lines):
            self.last_sig = sig
            for (key, row, size, _), enc in zip(rows, encoded):
                _held_row(self.batches, self.rows, key, row, size, enc)

    @property
    def prompts(self) -> int:
        """Prompts whose responses the journal holds, in whole batches and in part."""
        return sum(len(r) for r in self.batches.values()) + sum(len(r) for r in self.rows.values())

    def _append(self, *lines: dict[str, Any]) -> bool:
        """Append lines and flush them to disk (one write, one fsync); on a write error stop
        journaling, with one warning. A crash part-way leaves whole lines, then at most one cut short."""
        data = "".join(_dumps(line) + "\n" for line in lines).encode()
        try:
            assert self._fd is not None
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(f"short write ({written} of {len(data)} bytes)")
            os.fsync(self._fd)
            return True
        except OSError as exc:
            log.warning("evalkit: the journal %s of run %s stops here (%s); a resume would run the rest again",
                        self.path, self.run_id, exc.strerror or exc)
            self.close()
            return False

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def discard(self) -> None:
        """Remove the journal: the run's results are stored (or kept) without it."""
        self.close()
        if self.path is not None:
            try:
                self.path.unlink(missing_ok=True)
            except OSError as exc:  # the results are stored already: a journal left behind loses nothing
                log.warning("evalkit: the journal %s of run %s could not be removed (%s); the run is stored, "
                            "remove the file by hand", self.path, self.run_id, exc.strerror or exc)
                return
            try:
                self.path.parent.rmdir()  # the spool folder goes too when nothing else waits there
            except OSError:
                pass


def _held_row(batches: dict[str, list[dict[str, Any]]], rows: dict[str, dict[int, dict[str, Any]]], key: str,
              row: int, size: int, encoded: dict[str, Any]) -> None:
    """Keep one prompt's response; its batch moves to `batches` once every prompt of it is in."""
    held = rows.setdefault(key, {})
    held[row] = encoded
    if len(held) == size:
        batches[key] = [held[i] for i in range(size)]
        del rows[key]


def _read(path: Path, ident: spool.Identity, run_id: str):
    """(batches, rows, last signature, header, bytes that verified, (device, inode)) of a journal,
    read line by line; BadInput when it does not verify."""
    def bad(why: str) -> BadInput:
        return BadInput(f"journal {path} {why}; resume refused (run it again without --resume)")

    try:
        with open_input(path, "journal", MAX_JOURNAL_BYTES, follow_links=False) as fh:
            st = os.fstat(fh.fileno())
            first = fh.readline(MAX_HEADER_BYTES + 1)  # a file of zeros is refused here, after 1 MiB
            return (*_verify(first, read_lines(fh, "journal", path, MAX_LINE_BYTES), bad, ident, run_id),
                    (st.st_dev, st.st_ino))
    except BadInput as exc:
        if str(exc).startswith("journal "):
            raise
        raise bad(f"cannot be read ({str(exc).split(': ', 1)[-1]})") from None


def _verify(first: bytes, lines: Iterator[bytes], bad: Callable[[str], BadInput], ident: spool.Identity,
            run_id: str):
    """(batches, rows, last signature, header, bytes that verified) of a journal: its first line, then the rest."""
    if len(first) > MAX_HEADER_BYTES:
        raise bad(f"has no header line within its first {MAX_HEADER_BYTES:,} bytes")
    if not first.endswith(b"\n"):  # the part after the last newline is a line cut short
        raise bad("is empty or has no complete header")
    try:
        parsed = json.loads(first)
        header, sig = parsed["header"], parsed["sig"]
        if not isinstance(header, dict) or header.get("kind") != "evalkit-journal":
            raise ValueError("no journal header")
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested past Python's stack
        raise bad("is not an evalkit journal") from None
    if header.get("db_uuid") != ident.db_uuid:
        raise bad(f"belongs to another DB (uuid {header.get('db_uuid')!r})")
    if header.get("run_id") != run_id or header.get("format") not in FORMATS:
        raise bad(f"is not the journal of run {run_id} (it names {header.get('run_id')!r})")
    if not isinstance(sig, str) or not hmac.compare_digest(_sign(ident, "", _dumps(header)), sig):
        raise bad("has a header whose signature does not verify")
    good_bytes = len(first)
    batches: dict[str, list[dict[str, Any]]] = {}
    rows: dict[str, dict[int, dict[str, Any]]] = {}
    for n, raw in enumerate(lines, start=2):
        if not raw.endswith(b"\n"):  # a last line cut short by a crash: its prompts run again
            break
        try:
            line = json.loads(raw)
            key, line_sig = line["key"], line["sig"]
            if "row" in line:  # one prompt (format 2)
                row, size, results = line["row"], line["of"], [line["result"]]
                signed = {"key": key, "row": row, "of": size, "result": line["result"]}
                if type(row) is not int or type(size) is not int or not 0 <= row < size:
                    raise ValueError("bad row")
            else:
                results = line["results"]
                signed = {"key": key, "results": results}
        except (ValueError, KeyError, TypeError, RecursionError):
            raise bad(f"line {n} is not a journal entry") from None
        expected = _sign(ident, sig, _dumps(signed))
        if not isinstance(line_sig, str) or not hmac.compare_digest(expected, line_sig):
            raise bad(f"was changed after it was written (line {n}'s signature does not verify)")
        try:
            [decode(d) for d in results]
        # a signed line of another shape (a list where an object goes, an infinite token id)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
            raise bad(f"line {n} holds responses of another shape") from None
        if "row" in signed:
            if key not in batches:
                _held_row(batches, rows, key, signed["row"], signed["of"], results[0])
        else:
            batches[key] = results
        sig = line_sig
        good_bytes += len(raw)
    return batches, rows, sig, header, good_bytes


# ---- what a resume must match ----------------------------------------------------------


def differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`key: stored -> current` for each fingerprint entry that differs, in key order, nested
    entries named by their path and every value whole (a resume refused names what changed).

    >>> differences({"seed": 1, "quant": None}, {"seed": 2, "quant": None})
    ['seed: 1 -> 2']
    >>> differences({"config": {"batch_size": 2, "tasks": ["a"]}}, {"config": {"batch_size": 3, "tasks": ["a"]}})
    ['config.batch_size: 2 -> 3']
    """
    out = []
    for key in sorted(set(stored) | set(current)):
        old, new = stored.get(key), current.get(key)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            out += [f"{key}.{change}" for change in differences(old, new)]
        else:
            out.append(f"{key}: {_shown(old) if key in stored else '(none)'} -> "
                       f"{_shown(new) if key in current else '(none)'}")
    return out


def _shown(value: Any) -> str:
    return value if isinstance(value, str) else _dumps(value)
