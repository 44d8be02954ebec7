"""Finished runs that could not be written yet: kept in a file bound to their DB, brought in later.

Owns: `identity` (the DB's `db_uuid` and `spool_key` from `evalkit_meta`, migration m017),
`keep` (a run's whole row and results as a small evalkit DuckDB file, with a manifest
beside it that names the DB's uuid and the run and signs the file's SHA-256 with the DB's
key), `pending_files` and `ingest` (bring kept runs into the DB: each file verified, the
run row replaced and its results inserted in one transaction, then the file and its
manifest removed). Does not: decide when a write has failed (the runner does).

Where a kept run waits: the spool folder `<db>.spool/`, or, when that cannot be written
(a full disk, a file in the way), a per-user folder named by the DB's uuid,
`<tmp>/evalkit-spool-<uid>/<db_uuid>/` — never a folder named after the DB's file name, which
another project's `evalkit.duckdb` would share.

What is trusted (docs/reliability.md): only a file whose manifest names this DB's uuid,
whose signature verifies with this DB's key, whose SHA-256 matches, and which holds exactly
the run its manifest names. A run already `done` in the DB is never replaced. Anything else
in a spool folder — a planted `*.duckdb`, an empty or truncated file, another DB's kept run —
is set aside as `NAME.bad` with one warning and never blocks a writer. `evalkit ingest PATH`
refuses such a file with one line and leaves it as it is: ingest removes only files it
verified as kept by this DB.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb

from evalkit.errors import BadInput
from evalkit.paths import distrust, file_sha256, read_input
from evalkit.store import rows
from evalkit.store.db import db_path, in_transaction, inspect_con, migrate, open_writer

SUFFIX = ".duckdb"
MANIFEST = ".spool.json"  # beside RUN.duckdb: RUN.duckdb.spool.json
FORMAT = 1
MAX_MANIFEST_BYTES = 64 << 10  # a manifest: the uuid, the run, a SHA-256 and a signature
log = logging.getLogger("evalkit")


@dataclass(frozen=True)
class Identity:
    """Who a DB is: its uuid (names its fallback folder and its kept runs) and its signing key."""

    db_uuid: str
    key: str

    def sign(self, run_id: str, sha256: str) -> str:
        message = f"evalkit-spool/{FORMAT}\n{self.db_uuid}\n{run_id}\n{sha256}".encode()
        return hmac.new(bytes.fromhex(self.key), message, hashlib.sha256).hexdigest()


def identity(con: duckdb.DuckDBPyConnection, database: str | None = None) -> Identity | None:
    """The open DB's identity, None for a DB written before m017 (migrate gives it one)."""
    prefix = f'"{database}".main.' if database else ""
    rows = dict(con.execute(f"SELECT key, value FROM {prefix}evalkit_meta "
                            "WHERE key IN ('db_uuid', 'spool_key')").fetchall())
    if "db_uuid" not in rows or "spool_key" not in rows:
        return None
    return Identity(rows["db_uuid"], rows["spool_key"])


def file_id(path: Path) -> str:
    """The identity of the DB file itself: its inode, which a copy never shares and a rename keeps.
    (The device number is left out: it changes across reboots and containers for the same file.)"""
    return str(os.stat(path).st_ino)


def owned_identity(con: duckdb.DuckDBPyConnection, path: Path) -> Identity | None:
    """The open DB's identity when it is this file's own (reads only): None for a copy of another
    DB file (its recorded file id is another's) that has not been re-keyed yet, or a DB without one.
    A DB that has recorded no file id yet (written before evalkit recorded it) is taken as its own."""
    ident = identity(con)
    if ident is None:
        return None
    recorded = con.execute("SELECT value FROM evalkit_meta WHERE key = 'file_id'").fetchall()
    return ident if not recorded or recorded == [(file_id(path),)] else None


def bind_file(con: duckdb.DuckDBPyConnection, path: Path) -> Identity | None:
    """Make the open DB's identity this file's own, inside the caller's write transaction; return it.

    The first write records the file's id beside its uuid (`evalkit_meta.file_id`). A file whose
    recorded id is another's is a copy (cp, a restore, a move to another file system): it gets a
    new uuid and key here (an INFO log line; the write may yet fail), so it never takes the kept runs or journals of the
    file it was copied from, which keep their identity. Called by the writes that use the
    identity (a new run, a resume, `evalkit ingest`); the writer's upkeep only reads it
    (`owned_identity`), so a refused command still writes nothing."""
    ident = identity(con)
    if ident is None:
        return None
    here = file_id(path)
    recorded = con.execute("SELECT value FROM evalkit_meta WHERE key = 'file_id'").fetchall()
    if recorded == [(here,)]:
        return ident
    if recorded:
        import secrets
        import uuid

        ident = Identity(uuid.uuid4().hex, secrets.token_hex(32))
        con.execute("UPDATE evalkit_meta SET value = ? WHERE key = 'db_uuid'", [ident.db_uuid])
        con.execute("UPDATE evalkit_meta SET value = ? WHERE key = 'spool_key'", [ident.key])
        con.execute("UPDATE evalkit_meta SET value = ? WHERE key = 'file_id'", [here])
        log.info("evalkit: %s is a copy of another evalkit DB (or was moved to another file system): it has its "
                    "own identity now, and leaves the other file's kept runs and journals to it", path)
    else:
        con.execute("INSERT INTO evalkit_meta VALUES ('file_id', ?)", [here])
    return ident


def spool_dir(db: Path) -> Path:
    """The spool folder of a DB file: `reports/evalkit.duckdb` -> `reports/evalkit.duckdb.spool`."""
    return Path(str(db) + ".spool")


def fallback_dir(ident: Identity) -> Path:
    """The per-user folder of one DB's kept runs when its spool folder cannot be written."""
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"evalkit-spool-{uid}" / ident.db_uuid


class UntrustedFolder(PermissionError):
    """A spool folder evalkit will not use: a link, not a folder, someone else's, or open to others."""


def _check_folder(folder: Path, private: bool) -> None:
    """UntrustedFolder unless `folder` is a real folder (not a link) owned by this user and, when
    `private`, closed to everyone else (no group or other bits), else at least not writable by them."""
    st = os.lstat(folder)
    why = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a folder" if not stat.S_ISDIR(st.st_mode)
           else distrust(st, private))
    if why:
        raise UntrustedFolder(f"the spool folder {folder} is {why}; evalkit uses only a folder of its user's, "
                              "closed to others (remove it, or fix its owner and mode)")


def _chain(db: Path, folder: Path) -> list[tuple[Path, bool]]:
    """(folder, private) for each level evalkit makes of a spool folder: `<db>.spool`, or the
    fallback's `evalkit-spool-<uid>` and its `<db_uuid>` (both private: they sit in a shared tmp)."""
    if folder == spool_dir(db):
        return [(folder, False)]
    return [(folder.parent, True), (folder, True)]


def trusted(db: Path, folder: Path) -> bool:
    """Whether a spool folder may be read: absent (nothing to read), or every level passes the check;
    a folder that fails is one warning and is not read."""
    try:
        for level, private in _chain(db, folder):
            _check_folder(level, private)
    except FileNotFoundError:
        return False
    except UntrustedFolder as exc:
        log.warning("evalkit: %s", exc)
        return False
    return True


def make_folder(db: Path, folder: Path) -> Path:
    """Create a spool folder (each level 0700) or take the existing one, checked before use;
    UntrustedFolder (an OSError, so the next folder is tried) when it fails the check."""
    for level, private in _chain(db, folder):
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:
            pass
        _check_folder(level, private)
    return folder


def _folders(db: Path, ident: Identity | None) -> list[Path]:
    """The spool folders of `db` that exist and pass the check, the DB's own first."""
    return [f for f in [spool_dir(db)] + ([fallback_dir(ident)] if ident else []) if trusted(db, f)]


def manifest_of(path: Path) -> Path:
    return Path(str(path) + MANIFEST)


def keep(db: Path, ident: Identity, row: dict[str, Any], *, metrics, samples, topk, lead=(), attention=(),
         flags=(), first_char=()) -> Path:
    """Write one finished run (its complete `runs` row and its results) to a spool file; return its path.

    The file is written under a temporary name and renamed when complete; its manifest
    (uuid, run, SHA-256, signature) is written the same way after it, so a file without a
    manifest is never a kept run. Raises OSError / duckdb.Error when neither the spool folder
    nor the DB's fallback folder can hold it.
    """
    errors = []
    for folder in (spool_dir(db), fallback_dir(ident)):
        try:
            return _write(make_folder(db, folder), ident, row, metrics=metrics, samples=samples, topk=topk, lead=lead,
                          attention=attention, flags=flags, first_char=first_char)
        except (OSError, duckdb.Error) as exc:
            errors.append(f"{folder}: {str(exc).splitlines()[0]}")
    raise OSError("cannot keep the run's results anywhere (" + "; ".join(errors) + ")")


def _write(folder: Path, ident: Identity, row: dict[str, Any], *, metrics, samples, topk, lead=(),
           attention=(), flags=(), first_char=()) -> Path:
    row = rows.scrub_row(row)
    final = folder / f"{row['id']}{SUFFIX}"
    partial = folder / f".{row['id']}{SUFFIX}.partial"
    partial.unlink(missing_ok=True)
    con = duckdb.connect(str(partial))
    try:
        migrate(con)
        cols = [c for c in rows.RUN_COLUMNS if c in row]
        con.execute(f"INSERT INTO runs ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})",
                    [row[c] for c in cols])
        rows.insert_rows(con, "metrics", rows.METRIC_COLUMNS, metrics)
        rows.insert_rows(con, "samples", rows.SAMPLE_COLUMNS, samples)
        rows.insert_rows(con, "first_token_topk", rows.TOPK_COLUMNS, topk)
        rows.insert_rows(con, "lead_indicators", rows.LEAD_COLUMNS, list(lead))
        rows.insert_rows(con, "attention_layers", rows.ATTENTION_COLUMNS, list(attention))
        rows.insert_rows(con, "degenerate", rows.DEGENERATE_COLUMNS, list(flags))
        rows.insert_rows(con, "first_char_topk", rows.FIRST_CHAR_COLUMNS, list(first_char))
        con.execute("CHECKPOINT")
    finally:
        con.close()
    Path(str(partial) + ".wal").unlink(missing_ok=True)
    sha = file_sha256(partial)
    os.replace(partial, final)
    manifest = {"format": FORMAT, "db_uuid": ident.db_uuid, "run_id": row["id"], "sha256": sha,
                "signature": ident.sign(row["id"], sha)}
    tmp = folder / f".{row['id']}{MANIFEST}.partial"
    tmp.write_text(json.dumps(manifest), encoding="utf-8")
    os.replace(tmp, manifest_of(final))
    return final


def pending_files(db: Path, ident: Identity | None = None) -> list[Path]:
    """Kept-run files (each with a manifest) in `db`'s spool folder and, given its identity, its
    fallback folder, oldest first. Listed, not verified: `ingest` verifies each."""
    files = []
    for folder in _folders(db, ident):
        if folder.is_dir():
            files += sorted((p for p in folder.glob(f"*{SUFFIX}") if manifest_of(p).is_file()),
                            key=lambda p: p.stat().st_mtime)
    return files


def pending_ids(db: Path) -> set[str]:
    """Ids of the runs whose results wait in the spool folder (a reader shows them as `kept`)."""
    return {p.name[: -len(SUFFIX)] for p in pending_files(db)}


def _strangers(db: Path, ident: Identity | None) -> list[Path]:
    """Files in the spool folders that are no kept run: a `*.duckdb` without its manifest."""
    out = []
    for folder in _folders(db, ident):
        if folder.is_dir():
            out += [p for p in folder.glob(f"*{SUFFIX}") if not manifest_of(p).is_file()]
    return out


def verify(path: Path, ident: Identity) -> str:
    """The run id of a kept-run file that this DB wrote, checked; BadInput saying what is wrong otherwise."""
    manifest = manifest_of(path)
    try:
        meta = json.loads(read_input(manifest, "spool manifest", MAX_MANIFEST_BYTES).decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not an object")
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested past Python's stack
        raise BadInput(f"{path} is not a spool file of this DB (its manifest {manifest.name} cannot be read: "
                       f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    run_id, sha, sig = meta.get("run_id"), meta.get("sha256"), meta.get("signature")
    if meta.get("db_uuid") != ident.db_uuid:
        raise BadInput(f"{path} was kept for another DB (uuid {meta.get('db_uuid')!r}), not this one")
    if not all(isinstance(v, str) for v in (run_id, sha, sig)) or path.name != f"{run_id}{SUFFIX}":
        raise BadInput(f"{path} is not a spool file of this DB (its manifest does not name it)")
    if not hmac.compare_digest(ident.sign(run_id, sha), sig):
        raise BadInput(f"{path} is not a spool file of this DB (its signature does not verify)")
    try:
        actual = file_sha256(path)
    except OSError as exc:
        raise BadInput(f"{path} cannot be read ({exc.strerror or exc})") from None
    if actual != sha:
        raise BadInput(f"{path} changed after it was kept (its SHA-256 differs from its manifest's)")
    return run_id


def _set_aside(path: Path, why: str) -> None:
    """Rename a file that is no kept run of this DB (and its manifest) to NAME.bad, with one warning."""
    moved = []
    for p in (path, manifest_of(path)):
        if p.exists():
            try:
                os.replace(p, Path(str(p) + ".bad"))
                moved.append(p.name)
            except OSError:
                pass
    where = f"; set aside as {path.name}.bad" if moved else "; left in place (its folder cannot be written)"
    log.warning("evalkit: %s%s", why, where)


def _ingest_file(con: duckdb.DuckDBPyConnection, path: Path, run_id: str) -> None:
    """Bring one verified kept-run file into the open DB (one transaction)."""
    alias = "evalkit_spool"
    con.execute(f"ATTACH '{str(path).replace(chr(39), chr(39) * 2)}' AS {alias} (READ_ONLY)")
    try:
        state = inspect_con(con, alias)
        if state.kind != "evalkit" or state.pending or state.unknown:
            raise BadInput(f"{path} is not an evalkit spool file of this version")
        ids = [r[0] for r in con.execute(f"SELECT id FROM {alias}.main.runs").fetchall()]
        if ids != [run_id]:
            raise BadInput(f"{path} is not an evalkit spool file (it holds runs {ids}, not {run_id!r} alone)")
        done = con.execute("SELECT status FROM main.runs WHERE id = ?", [run_id]).fetchall()
        if done and done[0][0] == "done":
            raise BadInput(f"{path} would replace run {run_id}, which is already done; a kept run never does")
        with in_transaction(con):
            for table in ("runs", *rows.RESULT_TABLES):
                key = "id" if table == "runs" else "run_id"
                con.execute(f"DELETE FROM main.{table} WHERE {key} = ?", [run_id])
                cols = ", ".join(rows.RUN_COLUMNS if table == "runs" else rows.RESULT_TABLES[table])
                con.execute(f"INSERT INTO main.{table} ({cols}) SELECT {cols} FROM {alias}.main.{table}")
    finally:
        con.execute(f"DETACH {alias}")


def ingest_pending(con: duckdb.DuckDBPyConnection, db: Path, files: Iterable[Path] | None = None) -> list[str]:
    """Bring kept runs (default: every pending one of `db`) into the open DB; remove each once it is in.

    Named `files` that do not verify raise BadInput and stay as they are; found ones that do
    not verify are set aside, so a bad file never blocks a writer.
    """
    ident = owned_identity(con, db)
    if ident is None:  # a DB migrated before m017 has no kept runs; a copy not re-keyed yet takes none
        return []
    named = files is not None
    if not named:
        for stranger in _strangers(db, ident):
            _set_aside(stranger, f"{stranger} is no run kept by this DB (it has no manifest)")
    done = []
    for path in list(files) if named else pending_files(db, ident):
        try:
            run_id = verify(path, ident)
            if not _already_in(con, run_id):
                _ingest_file(con, path, run_id)
        except (BadInput, duckdb.Error) as exc:
            if named:
                raise BadInput(str(exc).splitlines()[0]) from None
            _set_aside(path, str(exc).splitlines()[0])
            continue
        _remove_kept(path, run_id)
        done.append(run_id)
    return done


def _already_in(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    """Whether a verified kept run is in the DB already, done, with its results: brought in by an
    ingest that committed but could not remove the file after (its folder not writable)."""
    rows = con.execute("SELECT status FROM main.runs WHERE id = ?", [run_id]).fetchall()
    return rows == [("done",)] and bool(
        con.execute("SELECT count(*) FROM main.metrics WHERE run_id = ?", [run_id]).fetchall()[0][0])


def _remove_kept(path: Path, run_id: str) -> None:
    """Remove a kept run's file and manifest once the run is in the DB. The commit is what counts:
    a file that cannot be removed (its folder read-only, immutable) is one warning, never an error,
    and a later ingest finds the run in and only tries to remove it again."""
    for p in (path, manifest_of(path)):
        try:
            p.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("evalkit: run %s is in the DB, but its kept file %s could not be removed (%s); "
                        "remove it by hand", run_id, p, exc.strerror or exc)
            return


def ingest(db, paths: Iterable[str | os.PathLike] = ()) -> list[str]:
    """`evalkit ingest [PATH ...]`: bring in the named kept runs, or every pending one; return run ids.

    A named file must be a run this DB kept (see `verify`); anything else is refused with
    one line and left as it is — the DB itself, another DB, a planted or changed file.
    """
    files = [Path(p) for p in paths]
    target = db_path(db)
    for path in files:
        if not path.is_file():
            raise BadInput(f"no spool file at {path}")
        if target.exists() and os.path.samefile(path, target):
            raise BadInput(f"{path} is the DB itself, not a spool file")
        if not manifest_of(path).is_file():
            raise BadInput(f"{path} is not an evalkit spool file of this DB (no manifest {manifest_of(path).name} "
                           "beside it); it is left as it is")
    with open_writer(target) as con:
        with in_transaction(con):
            bind_file(con, target)  # a copy is re-keyed first: it never takes the kept runs of the file it copies
        ids = ingest_pending(con, target, files or None)
        rows.mark_abandoned(con)
    return ids
