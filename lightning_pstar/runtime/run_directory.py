"""The disk tier's directory of one run: created unique, locked for the run's life, removed at its end.

[Note: run directory]
A run keeps its disk-resident chunks in ``<disk_path>/pstar-run-<name>/``, one file per key named
``<key>.pstar``, beside a lock file ``run.lock`` held with ``fcntl.flock(LOCK_EX)`` for as long as the run lives.
The kernel drops a flock when its holder dies, however it dies (SIGKILL, OOM killer), so "the lock can be taken"
means "no live process owns this directory".

- Creation is atomic: the directory is made under a hidden temporary name, its lock taken, and only then renamed
  to its final name; a visible run directory therefore always has a held lock while its run lives (one left
  under its temporary name by a run killed in that instant is cleaned once it is ``TMP_GRACE_S`` old). A rename
  onto a final name that exists fails (the directory holds its lock file), so two runs cannot share one
  directory even when both ask for the same ``run_name``.
- At start, every directory of this naming whose lock can be taken (or that has no lock file) belongs to a dead
  run: it is named in a log line and its files of the store's own naming are removed, then the directory. A
  file the disk tier did not create is never touched: a directory holding one is left with it, and the log line
  names the files.
- At the end (:meth:`RunDirectory.close`, a ``with`` block, garbage collection or interpreter exit, whichever
  comes first) the files the run created are removed, then the lock, then the directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import time
import weakref
from dataclasses import dataclass

__all__ = ["DATA_SUFFIX", "LOCK_NAME", "RUN_PREFIX", "RunDirectory", "RunDirectoryInUseError", "clean_stale_runs"]

log = logging.getLogger(__name__)

RUN_PREFIX = "pstar-run-"
"""Name prefix of a run directory inside ``disk_path``."""
LOCK_NAME = "run.lock"
"""The lock file inside a run directory."""
DATA_SUFFIX = ".pstar"
"""Suffix of the data files the disk tier creates (``<key>.pstar``)."""

TMP_GRACE_S = 600.0
"""Age below which a run directory still under its temporary name is never cleaned: between creating its lock file
and locking it, a starting run's lock looks free."""

_NAME = r"[A-Za-z0-9_-]+"
_RUN_DIR = re.compile(rf"^{re.escape(RUN_PREFIX)}{_NAME}$")
_TMP_DIR = re.compile(rf"^\.{re.escape(RUN_PREFIX)}{_NAME}\.[0-9a-f]+\.tmp$")
_OWN_FILE = re.compile(rf"^[A-Za-z0-9_.-]+{re.escape(DATA_SUFFIX)}$")


class RunDirectoryInUseError(RuntimeError):
    """Another live run holds the lock of the run directory asked for."""


@dataclass
class _Held:
    """What a run directory's finalizer removes (the finalizer must not hold the :class:`RunDirectory` itself)."""

    path: str
    lock_fd: int
    files: set[str]
    pid: int  # the creating process: a forked child (a DataLoader worker) shares the lock but never removes
    closed: bool = False


def _remove(held: _Held) -> None:
    """Remove the run's own files, its lock and its directory, and drop the lock (idempotent)."""
    if held.closed or os.getpid() != held.pid:
        return
    held.closed = True
    for name in sorted(held.files):
        try:
            os.unlink(os.path.join(held.path, name))
        except FileNotFoundError:
            pass
    held.files.clear()
    try:
        try:
            os.unlink(os.path.join(held.path, LOCK_NAME))
            os.rmdir(held.path)
        except FileNotFoundError:
            pass  # a starting run cleaning stale directories raced us to it
        except OSError as err:
            left = sorted(os.listdir(held.path)) if os.path.isdir(held.path) else []
            log.warning(
                "Left the disk-tier directory %s (%s): it holds files the run did not create: %s", held.path, err, left
            )
    finally:
        os.close(held.lock_fd)


class RunDirectory:
    """This run's locked directory inside ``disk_path`` (see [Note: run directory]).

    ``run_name`` (letters, digits, ``_`` and ``-``) names it ``pstar-run-<run_name>``; by default the process id and
    a random token. A name held by a live run raises :class:`RunDirectoryInUseError`.
    """

    def __init__(self, disk_path: str | os.PathLike[str], *, run_name: str | None = None) -> None:
        root = os.path.abspath(os.path.expanduser(os.fspath(disk_path)))
        if run_name is not None and not re.fullmatch(_NAME, run_name):
            raise ValueError(
                f"RunDirectory: run_name must be letters, digits, '_' or '-', got {run_name!r}."
                " HINT: leave it unset for a unique name."
            )
        clean_stale_runs(root)
        name = RUN_PREFIX + (run_name or f"{os.getpid()}-{secrets.token_hex(4)}")
        final = os.path.join(root, name)
        tmp = os.path.join(root, f".{name}.{secrets.token_hex(4)}.tmp")
        os.mkdir(tmp, 0o700)
        fd = os.open(os.path.join(tmp, LOCK_NAME), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file: nobody else can hold it
        try:
            os.rename(tmp, final)
        except OSError as err:
            os.unlink(os.path.join(tmp, LOCK_NAME))
            os.rmdir(tmp)
            os.close(fd)
            if err.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR, errno.ENOTDIR):
                raise RunDirectoryInUseError(
                    f"The disk-tier directory {final} is in use by another run (it exists and its lock"
                    f" {os.path.join(final, LOCK_NAME)} is held, or it holds files the disk tier did not create)."
                    " HINT: give each run its own run_name, or leave run_name unset for a unique one."
                ) from err
            raise
        self.path = final
        """Absolute path of the run directory."""
        self._held = _Held(path=final, lock_fd=fd, files=set(), pid=os.getpid())
        self._finalizer = weakref.finalize(self, _remove, self._held)

    def file_path(self, key: str) -> str:
        """The path of ``key``'s data file (``<run dir>/<key>.pstar``); the name is registered for removal."""
        name = key + DATA_SUFFIX
        if not _OWN_FILE.match(name) or name.startswith("."):
            raise ValueError(
                f"Disk-tier key must be letters, digits, '_', '-' or '.', not starting with '.', got {key!r}."
            )
        self._held.files.add(name)
        return os.path.join(self.path, name)

    @property
    def closed(self) -> bool:
        """Whether the directory has been removed."""
        return self._held.closed

    def close(self) -> None:
        """Remove the run's files, its lock and the directory (idempotent). Open file descriptors of the files
        must be closed first."""
        self._finalizer()


def clean_stale_runs(root: str) -> list[str]:
    """Remove the run directories in ``root`` left by dead runs (their lock is free); return their paths.

    Only files of the disk tier's own naming are removed; a directory that holds any other file is left and named
    in a log line.
    """
    removed: list[str] = []
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return removed
    now = time.time()
    for entry in entries:
        if not (_RUN_DIR.match(entry.name) or _TMP_DIR.match(entry.name)) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if _TMP_DIR.match(entry.name) and now - entry.stat(follow_symlinks=False).st_mtime < TMP_GRACE_S:
                continue  # a run being created right now: its lock file may not be locked yet
            if _clean_if_dead(entry.path):
                removed.append(entry.path)
        except FileNotFoundError:
            continue  # another run cleaned it first
    return removed


def _clean_if_dead(path: str) -> bool:
    lock_path = os.path.join(path, LOCK_NAME)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = -1  # a visible run directory has its lock until its run ends: without one, its run is gone
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a live run holds it
        own, foreign, nbytes = [], [], 0
        for item in os.scandir(path):
            if item.name == LOCK_NAME and item.is_file(follow_symlinks=False):
                continue
            if item.is_file(follow_symlinks=False) and _OWN_FILE.match(item.name):
                own.append(item)
                nbytes += item.stat(follow_symlinks=False).st_size
            else:
                foreign.append(item.name)
        for item in own:
            os.unlink(item.path)
        if fd >= 0:
            os.unlink(lock_path)
        if foreign:
            log.warning(
                "Cleaned the disk-tier directory %s of a dead run (%d data files, %d bytes) but left it: it holds files"
                " the disk tier did not create: %s",
                path,
                len(own),
                nbytes,
                sorted(foreign),
            )
            return False
        os.rmdir(path)
        log.warning(
            "Removed the stale disk-tier directory %s of a run that is no longer alive (%d data files, %d bytes).",
            path,
            len(own),
            nbytes,
        )
        return True
    finally:
        if fd >= 0:
            os.close(fd)
