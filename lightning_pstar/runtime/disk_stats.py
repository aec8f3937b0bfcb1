"""Counters of the disk tier: bytes, operations and busy time, in total and per iteration.

Busy time is wall time during which at least one transfer of the kind was in flight (the union of the threads'
intervals, not their sum), so ``bytes / seconds`` is the rate the disk achieved for this run, comparable with
the machine's ``O_DIRECT`` ceiling (``benchmarks/disk_tier.py``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

__all__ = ["DiskMeter", "DiskStats"]

_KINDS = ("read", "write")
_BYTES = {"read": "bytes_read", "write": "bytes_written"}


@dataclass(frozen=True, kw_only=True)
class DiskStats:
    """What the disk tier moved in a span of time (a run, or one iteration)."""

    bytes_read: int = 0
    """Bytes read from the disk into tensors (each key's own bytes, not its file's padding)."""
    bytes_written: int = 0
    """Bytes written from tensors to the disk."""
    reads: int = 0
    """Completed read operations (one per ``read`` call)."""
    writes: int = 0
    """Completed write operations."""
    read_seconds: float = 0.0
    """Wall time during which at least one read was in flight."""
    write_seconds: float = 0.0
    """Wall time during which at least one write was in flight."""
    busy_seconds: float = 0.0
    """Wall time during which any transfer was in flight."""

    @property
    def read_gbps(self) -> float:
        """Achieved read rate in GB/s (1e9 bytes per second) while reading; 0.0 when nothing was read."""
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else 0.0

    @property
    def write_gbps(self) -> float:
        """Achieved write rate in GB/s while writing; 0.0 when nothing was written."""
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds > 0 else 0.0


class DiskMeter:
    """Thread-safe counters behind :class:`DiskStats`; the I/O threads call :meth:`begin` and :meth:`end` around
    each block transfer and :meth:`count` once per completed operation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = dict.fromkeys(_KINDS, 0)
        self._since = dict.fromkeys((*_KINDS, "any"), 0.0)
        self._total = DiskStats()
        self._iteration = DiskStats()

    def begin(self, kind: str) -> None:
        with self._lock:
            now = time.perf_counter()
            if self._active[kind] == 0:
                self._since[kind] = now
            if sum(self._active.values()) == 0:
                self._since["any"] = now
            self._active[kind] += 1

    def end(self, kind: str, nbytes: int) -> None:
        with self._lock:
            now = time.perf_counter()
            self._active[kind] -= 1
            add: dict[str, float] = {_BYTES[kind]: nbytes}
            if self._active[kind] == 0:
                add[f"{kind}_seconds"] = now - self._since[kind]
            if sum(self._active.values()) == 0:
                add["busy_seconds"] = now - self._since["any"]
            self._add(add)

    def count(self, kind: str) -> None:
        with self._lock:
            self._add({f"{kind}s": 1})

    def totals(self) -> DiskStats:
        with self._lock:
            return self._with_open_intervals(self._total)

    def iteration(self) -> DiskStats:
        with self._lock:
            return self._with_open_intervals(self._iteration)

    def reset_iteration(self) -> DiskStats:
        """Close the running iteration (time in flight so far counts to it) and start a new one."""
        with self._lock:
            now = time.perf_counter()
            add: dict[str, float] = {}
            for kind in _KINDS:
                if self._active[kind]:
                    add[f"{kind}_seconds"] = now - self._since[kind]
                    self._since[kind] = now
            if sum(self._active.values()):
                add["busy_seconds"] = now - self._since["any"]
                self._since["any"] = now
            self._add(add)
            finished, self._iteration = self._iteration, DiskStats()
            return finished

    def _add(self, add: dict[str, float]) -> None:
        self._total = _plus(self._total, add)
        self._iteration = _plus(self._iteration, add)

    def _with_open_intervals(self, stats: DiskStats) -> DiskStats:
        """``stats`` with the time of transfers still in flight counted up to now."""
        now = time.perf_counter()
        add = {f"{k}_seconds": now - self._since[k] for k in _KINDS if self._active[k]}
        if sum(self._active.values()):
            add["busy_seconds"] = now - self._since["any"]
        return _plus(stats, add)


def _plus(stats: DiskStats, add: dict[str, float]) -> DiskStats:
    return replace(stats, **{name: getattr(stats, name) + value for name, value in add.items()})
