"""The disk tier's setup check: a ``disk_path`` that cannot hold what the plan puts on disk is refused with the
figures before anything is allocated (re-exported by :mod:`lightning_pstar.runtime.disk`)."""

from __future__ import annotations

import os
import threading

from lightning_pstar.planning.requirements import MemoryBudgetError

__all__ = ["DISK_FREE_FRACTION", "check_disk_path"]

DISK_FREE_FRACTION = 0.8
"""Share of the free space of ``disk_path`` (at setup) used as the disk budget when ``disk_memory_limit`` is unset."""


def check_disk_path(
    path: str | os.PathLike[str] | None, need_bytes: int, limit: int | None, *, fraction: float = DISK_FREE_FRACTION
) -> int:
    """Refuse a ``disk_path`` that cannot hold ``need_bytes`` before anything is allocated; return the budget.

    The budget is ``limit`` (``memory.disk_limit`` in bytes) or, when None, ``fraction`` of the free space of
    ``path`` now. Raises ``ValueError`` for a path that does not exist, is not a directory or is not writable, and
    :class:`~lightning_pstar.MemoryBudgetError` when ``need_bytes`` exceeds the budget or the free space; each
    message names the path, the figures and a HINT.
    """
    if path is None:
        raise ValueError(f"`disk_path` is unset but the plan puts {need_bytes:,} bytes on disk. HINT: set disk_path.")
    where = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.path.exists(where):
        raise ValueError(
            f"`disk_path` {where!r} does not exist. HINT: create the directory (on a local SSD) or point disk_path"
            " at an existing one."
        )
    if not os.path.isdir(where):
        raise ValueError(f"`disk_path` {where!r} is not a directory. HINT: point disk_path at a directory.")
    _probe_writable(where)
    vfs = os.statvfs(where)
    free = vfs.f_bavail * vfs.f_frsize
    budget = limit if limit is not None else int(fraction * free)
    source = "disk_memory_limit" if limit is not None else f"{fraction:g} of its free space"
    if need_bytes > budget:
        raise MemoryBudgetError(
            f"`disk_path` {where!r}: the plan needs {need_bytes:,} bytes on disk, but the disk budget is"
            f" {budget:,} bytes ({source}; {free:,} bytes free). HINT: raise disk_memory_limit, free space on the"
            " disk, or raise host_memory_limit so fewer families go to disk."
        )
    if need_bytes > free:
        raise MemoryBudgetError(
            f"`disk_path` {where!r}: the plan needs {need_bytes:,} bytes on disk, but only {free:,} bytes are free"
            f" (disk_memory_limit is {budget:,}). HINT: free space on the disk or choose another disk_path."
        )
    return budget


def _probe_writable(where: str) -> None:
    probe = os.path.join(where, f".pstar-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise ValueError(
            f"`disk_path` {where!r} is not writable ({err.strerror}). HINT: point disk_path at a directory this"
            " process may create files in."
        ) from None
    os.close(fd)
    os.unlink(probe)
