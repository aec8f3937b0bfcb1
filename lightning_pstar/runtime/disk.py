"""The disk tier's I/O: one file per key in the run's own directory, read and written with ``O_DIRECT`` on a few
threads, asynchronously.

[Note: disk tier]
The fp32 masters and optimizer states of the chunk families that do not fit host memory live on a local disk.
The optimizer step reads them, steps them and writes them back; with the disk at 1-3 GB/s that step is bound by
the disk unless its three stages overlap, so :class:`DiskStore` is built to be one stage of a pipeline:

    done = store.read("f0.master", buf[0])                         # buf: 3 host buffers, rotating
    written = [None, None, None]
    for k in range(n):
        nxt = None
        if k + 1 < n:                                                 # read family k+1 ...
            if written[(k + 1) % 3] is not None:
                written[(k + 1) % 3].result()                         #   (its buffer's last write is out)
            nxt = store.read(f"f{k + 1}.master", buf[(k + 1) % 3])
        done.result(); adam(buf[k % 3])                               # ... while Adam runs on family k ...
        written[k % 3] = store.write(f"f{k}.master", buf[k % 3])      # ... and k-1's write-back still runs
        done = nxt
    store.wait()                                                      # every write on disk

- ``write(key, tensor)`` and ``read(key, out)`` return a ``concurrent.futures.Future`` at once; its ``result()``
  is None or raises the transfer's :class:`DiskIOError`. The caller must not change ``tensor`` until its write is
  done, nor read ``out`` before its read is. Operations on one key run in the order they were issued (a read
  after a write of the same key sees the written bytes); operations on different keys run concurrently.
- A key's size and dtype are fixed by its first write (or :meth:`DiskStore.reserve`); its file is allocated in
  full then (``posix_fallocate``), so a full disk is reported by the call that creates a key (setup), never
  half-way through a later step, and a failed write never touches another key's file.
- Each transfer is cut into blocks of ``block_bytes`` (4-16 MiB) spread over ``threads`` worker threads
  (``os.preadv``/``os.pwritev`` release the GIL). A host tensor whose first byte is 4096-aligned
  (:func:`~lightning_pstar.runtime.aligned.aligned_empty`) moves straight between its own bytes and the disk;
  any other tensor (unaligned, on a device) and every size's tail past the last 4096 multiple go through an
  aligned staging block of the store's arena (one block per thread; registered with ``cudaHostRegister`` when
  the store's device is CUDA). Files are padded to a multiple of 4096 bytes; the padding is never read back.
- Where the filesystem refuses ``O_DIRECT`` (``EINVAL`` at open: tmpfs before Linux 6.6, some network file
  systems) the store falls back to buffered I/O and drops the file's pages after each transfer with
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` (written pages after an ``fdatasync``), so the page cache does not grow
  with the model; one log line says so. (On tmpfs the file's pages are its storage: nothing can be dropped.)
- :meth:`DiskStore.stats` and :meth:`DiskStore.iteration_stats` count bytes, operations and the wall time during
  which at least one read (write, transfer) was in flight, from which the achieved GB/s follow.

The directory, its lock, the cleaning of dead runs' directories and the removal at the end are
:class:`~lightning_pstar.runtime.run_directory.RunDirectory` ([Note: run directory]).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

import torch

from lightning_pstar.planning.requirements import MemoryBudgetError
from lightning_pstar.runtime.aligned import ALIGNMENT, AlignedArena, align_up, is_aligned
from lightning_pstar.runtime.disk_check import DISK_FREE_FRACTION, check_disk_path
from lightning_pstar.runtime.disk_ops import DiskOp, copy_outcome
from lightning_pstar.runtime.disk_stats import DiskMeter, DiskStats
from lightning_pstar.runtime.run_directory import RunDirectory

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_THREADS",
    "DISK_FREE_FRACTION",
    "DiskIOError",
    "DiskStats",
    "DiskStore",
    "check_disk_path",
]

log = logging.getLogger(__name__)

DEFAULT_BLOCK_BYTES = 8 << 20
"""Bytes of one I/O call (measured: 4-16 MiB blocks on 2-4 threads reach a local SSD's ``O_DIRECT`` ceiling)."""
DEFAULT_THREADS = 4
"""I/O worker threads of a :class:`DiskStore`."""


class DiskIOError(OSError):
    """A disk-tier transfer failed (a full disk, an I/O error, a short read); the message names the path, the
    operation, the byte counts and what to do. ``errno`` is the system's error number."""


@dataclass
class _KeyFile:
    """One key's open file."""

    path: str
    fd: int
    direct: bool
    numel: int
    dtype: torch.dtype
    nbytes: int  # logical bytes (numel * itemsize); the file holds align_up(nbytes)
    failed: str | None = None  # why the last write failed: the file's bytes are then undefined


class DiskStore:
    """Tensors by key in files of this run's directory inside ``disk_path``; see [Note: disk tier].

    Args:
        disk_path: an existing directory on a local disk (``memory.disk_path``).
        limit_bytes: most bytes of files the store may hold (``memory.disk_limit``); None: no limit of its own.
        threads: I/O worker threads (1-16; 2-4 saturate a local SSD).
        block_bytes: bytes of one I/O call, a positive multiple of 4096 (4-16 MiB in production).
        device: the device the engine computes on; CUDA registers the staging arena with ``cudaHostRegister``.
        run_name: the run directory's name (``pstar-run-<run_name>``); default unique.
    """

    def __init__(
        self,
        disk_path: str | os.PathLike[str],
        *,
        limit_bytes: int | None = None,
        threads: int = DEFAULT_THREADS,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        device: torch.device | str = "cpu",
        run_name: str | None = None,
    ) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 16:
            raise ValueError(f"DiskStore: threads must be an int in [1, 16], got {threads!r}.")
        if (
            isinstance(block_bytes, bool)
            or not isinstance(block_bytes, int)
            or block_bytes <= 0
            or block_bytes % ALIGNMENT
        ):
            raise ValueError(f"DiskStore: block_bytes must be a positive multiple of {ALIGNMENT}, got {block_bytes!r}.")
        if limit_bytes is not None and limit_bytes <= 0:
            raise ValueError(f"DiskStore: limit_bytes must be positive or None, got {limit_bytes!r}.")
        self.limit_bytes = limit_bytes
        self.block_bytes = block_bytes
        self.directory = RunDirectory(disk_path, run_name=run_name)
        self._arena = AlignedArena(block_bytes, threads, pin=torch.device(device).type == "cuda")
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pstar-disk")
        self._files: dict[str, _KeyFile] = {}
        self._open_lock = threading.Lock()  # callers on several threads may create keys at once
        self._last: dict[str, Future[None]] = {}  # the last operation issued per key (the per-key order)
        self._pending: set[Future[None]] = set()
        self._lock = threading.Lock()
        self._meter = DiskMeter()
        self._said_buffered = False
        self.direct: bool | None = None
        """Whether the store's files use ``O_DIRECT`` (False: the buffered fallback); None before the first file."""
        self._closed = False

    # ---- the API -------------------------------------------------------------------------------------------
    @property
    def path(self) -> str:
        """The run directory (absolute)."""
        return self.directory.path

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of the store's files (each key's bytes rounded up to 4096)."""
        return sum(align_up(f.nbytes) for f in self._files.values())

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the staging arena (``threads * block_bytes`` plus one alignment), held for the store's life:
        count them in the host budget."""
        return self._arena.nbytes + ALIGNMENT

    def keys(self) -> list[str]:
        """The keys written or reserved so far."""
        return list(self._files)

    def reserve(self, key: str, numel: int, dtype: torch.dtype) -> None:
        """Create ``key``'s file for ``numel`` elements of ``dtype`` and allocate its blocks now, so a full disk or
        the disk budget is reported here (at setup) rather than by a later write. No-op for a reserved key of that
        shape; raises for another shape."""
        self._open(key, numel, dtype)

    def write(self, key: str, tensor: torch.Tensor) -> Future[None]:
        """Write ``tensor`` (contiguous, any device) as ``key``; the future completes when it is on disk.

        Raises at once for a wrong argument, the disk budget, or a full disk when this creates the key's file.
        """
        self._check_tensor(tensor, key, "write")
        kf = self._open(key, tensor.numel(), tensor.dtype)
        return self._issue(key, lambda: self._launch(kf, tensor, write=True))

    def read(self, key: str, out: torch.Tensor) -> Future[None]:
        """Read ``key`` into ``out`` (contiguous, any device, the key's numel and dtype); the future completes
        when ``out`` holds the bytes."""
        self._check_tensor(out, key, "read")
        kf = self._files.get(key)
        if kf is None:
            raise KeyError(f"Disk tier: no key {key!r} in {self.path}. HINT: write (or reserve) it before reading.")
        if out.numel() != kf.numel or out.dtype != kf.dtype:
            raise ValueError(
                f"Disk tier: key {key!r} holds {kf.numel} elements of {kf.dtype}, but `out` has {out.numel()}"
                f" of {out.dtype}. HINT: read into a tensor of the shape and dtype written."
            )
        return self._issue(key, lambda: self._launch(kf, out, write=False))

    def write_sync(self, key: str, tensor: torch.Tensor) -> None:
        """:meth:`write` and wait for it."""
        self.write(key, tensor).result()

    def read_sync(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """:meth:`read` and wait for it; returns ``out``."""
        self.read(key, out).result()
        return out

    def wait(self) -> None:
        """Wait for every operation issued so far; raises the first error among them."""
        with self._lock:
            pending = list(self._pending)
        errors = [f.exception() for f in pending]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def discard(self, key: str) -> None:
        """Delete ``key`` and its file (after its pending operations)."""
        last = self._last.get(key)
        if last is not None:
            last.exception()
        kf = self._files.pop(key, None)
        self._last.pop(key, None)
        if kf is not None:
            os.close(kf.fd)
            os.unlink(kf.path)

    def stats(self) -> DiskStats:
        """Totals since the store was opened."""
        return self._meter.totals()

    def iteration_stats(self) -> DiskStats:
        """Counts since the last :meth:`reset_iteration` (or since the store was opened)."""
        return self._meter.iteration()

    def reset_iteration(self) -> DiskStats:
        """Start a new iteration's counts; returns the finished iteration's."""
        return self._meter.reset_iteration()

    def close(self) -> None:
        """Wait for pending operations, stop the threads, close the files and remove the run directory (also
        done at garbage collection and interpreter exit). Idempotent; errors of pending operations are dropped
        (their futures still hold them)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.exception()
        self._pool.shutdown(wait=True)
        for kf in self._files.values():
            os.close(kf.fd)
        self._files.clear()
        self._arena.close()
        self.directory.close()

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ---- files ---------------------------------------------------------------------------------------------
    def _check_tensor(self, tensor: torch.Tensor, key: str, op: str) -> None:
        if self._closed:
            raise RuntimeError(f"Disk tier: {op} of {key!r} on a closed store ({self.path}).")
        if not tensor.is_contiguous() or tensor.numel() == 0:
            raise ValueError(
                f"Disk tier: {op} of {key!r} needs a contiguous tensor with at least one element, got shape"
                f" {tuple(tensor.shape)} (contiguous: {tensor.is_contiguous()})."
            )

    def _open(self, key: str, numel: int, dtype: torch.dtype) -> _KeyFile:
        with self._open_lock:
            return self._open_locked(key, numel, dtype)

    def _open_locked(self, key: str, numel: int, dtype: torch.dtype) -> _KeyFile:
        kf = self._files.get(key)
        if kf is not None:
            if (kf.numel, kf.dtype) != (numel, dtype):
                raise ValueError(
                    f"Disk tier: key {key!r} holds {kf.numel} elements of {kf.dtype}; cannot store {numel} of"
                    f" {dtype} there. HINT: a key's size and dtype are fixed by its first write; discard it first."
                )
            return kf
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        size = align_up(nbytes)
        if self.limit_bytes is not None and self.bytes_on_disk + size > self.limit_bytes:
            raise MemoryBudgetError(
                f"Disk tier: key {key!r} needs {size:,} bytes in {self.path}, but {self.bytes_on_disk:,} of the"
                f" disk budget of {self.limit_bytes:,} bytes are in use. HINT: raise disk_memory_limit"
                " (memory.disk_limit) or host_memory_limit so fewer families go to disk."
            )
        path = self.directory.file_path(key)
        fd, direct = self._open_fd(path)
        try:
            _allocate(fd, size)
        except OSError as err:
            os.close(fd)
            os.unlink(path)
            raise _io_error(err, path=path, op="allocate", nbytes=size, offset=0, done=0) from None
        kf = _KeyFile(path=path, fd=fd, direct=direct, numel=numel, dtype=dtype, nbytes=nbytes)
        self.direct = direct if self.direct is None else self.direct and direct
        self._files[key] = kf
        return kf

    def _open_fd(self, path: str) -> tuple[int, bool]:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise _io_error(err, path=path, op="open", nbytes=0, offset=0, done=0) from None
        if not self._said_buffered:
            self._said_buffered = True
            log.warning(
                "The filesystem of %s refuses O_DIRECT: the disk tier uses buffered I/O and drops each file's pages"
                " after every transfer (posix_fadvise DONTNEED), which is slower. HINT: put disk_path on a local"
                " ext4 or xfs filesystem for direct I/O.",
                self.path,
            )
        return os.open(path, flags, 0o600), False

    # ---- transfers -----------------------------------------------------------------------------------------
    def _issue(self, key: str, launch: Callable[[], Future[None]]) -> Future[None]:
        """Start ``launch`` after the previous operation on ``key``; return the operation's future."""
        outer: Future[None] = Future()
        with self._lock:
            previous = self._last.get(key)
            self._last[key] = outer
            self._pending.add(outer)
        outer.add_done_callback(lambda done: self._forget(key, done))

        def start(_: object = None) -> None:
            try:
                inner = launch()
            except BaseException as err:  # noqa: B036 - handed to the caller through the future
                outer.set_exception(err)
                return
            inner.add_done_callback(lambda f: copy_outcome(f, outer))

        if previous is None:
            start()
        else:
            previous.add_done_callback(start)
        return outer

    def _forget(self, key: str, future: Future[None]) -> None:
        # a done future keeps its callbacks (and through them the operation's tensor): drop the store's references
        with self._lock:
            self._pending.discard(future)
            if self._last.get(key) is future:
                del self._last[key]

    def _launch(self, kf: _KeyFile, tensor: torch.Tensor, *, write: bool) -> Future[None]:
        if not write and kf.failed is not None:
            raise DiskIOError(
                errno.EIO,
                f"Disk tier: cannot read {kf.path}: its last write failed ({kf.failed}). HINT: write the key again.",
            )
        data = tensor.detach().reshape(-1).view(torch.uint8)  # (nbytes,)
        direct_bytes = (kf.nbytes // ALIGNMENT) * ALIGNMENT if is_aligned(data) else 0
        spans = [(o, min(self.block_bytes, direct_bytes - o), False) for o in range(0, direct_bytes, self.block_bytes)]
        spans += [
            (o, min(self.block_bytes, kf.nbytes - o), True) for o in range(direct_bytes, kf.nbytes, self.block_bytes)
        ]
        kind = "write" if write else "read"
        outer: Future[None] = Future()
        op = DiskOp(outer, len(spans), finish=lambda: self._finish(kf, kind))
        if write:
            kf.failed = None
        for offset, length, staged in spans:
            part = self._pool.submit(self._transfer, kf, data, offset, length, staged, write)
            part.add_done_callback(op.part_done)
        return outer

    def _finish(self, kf: _KeyFile, kind: str) -> None:
        self._meter.count(kind)
        if kf.direct:
            return
        if kind == "write":
            os.fdatasync(kf.fd)  # written pages are clean only after writeback: then DONTNEED drops them
        os.posix_fadvise(kf.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def _transfer(self, kf: _KeyFile, data: torch.Tensor, offset: int, length: int, staged: bool, write: bool) -> None:
        """One block: ``data[offset : offset + length]`` to or from the file at ``offset``."""
        kind = "write" if write else "read"
        self._meter.begin(kind)
        index = self._arena.acquire() if staged else -1
        moved = 0
        try:
            with torch.profiler.record_function(f"pstar::disk_{kind}"):
                self._move(kf, data, offset, length, index, write)
            moved = length
        except DiskIOError as err:
            if write:
                kf.failed = f"{os.strerror(err.errno or errno.EIO)}, errno {err.errno}"
            raise
        finally:
            if staged:
                self._arena.release(index)
            self._meter.end(kind, moved)  # failed blocks count no bytes

    def _move(self, kf: _KeyFile, data: torch.Tensor, offset: int, length: int, index: int, write: bool) -> None:
        """The system calls of one block, through arena block ``index`` (staged) unless it is -1."""
        padded = align_up(length)
        done = 0
        try:
            if index >= 0:
                block = self._arena.block(index)[:padded]
                if write:
                    block[:length].copy_(data[offset : offset + length])
                    block[length:].zero_()
                view = block.numpy().data
            else:
                view = data[offset : offset + padded].numpy().data
            call = os.pwritev if write else os.preadv
            while done < padded:
                moved = call(kf.fd, [view[done:]], offset + done)
                if moved <= 0:
                    raise OSError(errno.EIO, "short read: end of file" if not write else "no bytes written")
                done += moved
            if index >= 0 and not write:
                data[offset : offset + length].copy_(block[:length])
            if not kf.direct:
                os.posix_fadvise(kf.fd, offset, padded, os.POSIX_FADV_DONTNEED)
        except OSError as err:
            kind = "write" if write else "read"
            raise _io_error(err, path=kf.path, op=kind, nbytes=padded, offset=offset, done=done) from None


def _allocate(fd: int, size: int) -> None:
    """Give the file ``size`` bytes of disk blocks now (a full disk fails here, at the key's creation)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        # no fallocate on this filesystem (glibc's emulation writes through the O_DIRECT descriptor and fails):
        # a sparse file of the size; its blocks are allocated by the first write
        os.ftruncate(fd, size)


_HINTS = {
    errno.ENOSPC: "the filesystem is full: free space there or lower the disk budget (disk_memory_limit); the files"
    " written before this one are intact",
    errno.EDQUOT: "the disk quota is exhausted: raise it or lower the disk budget (disk_memory_limit)",
    errno.EIO: "the disk (or the file) failed: check the drive (dmesg) and that no other process truncated the file",
    errno.EINVAL: "the filesystem refused a direct (O_DIRECT) transfer: put disk_path on a local ext4 or xfs"
    " filesystem",
}


def _io_error(err: OSError, *, path: str, op: str, nbytes: int, offset: int, done: int) -> DiskIOError:
    """``err`` as a :class:`DiskIOError` naming the path, the operation, the byte counts and a HINT."""
    code = err.errno if err.errno is not None else errno.EIO
    reason = err.strerror or str(err)
    hint = _HINTS.get(code, "check the path, its filesystem and its free space")
    if reason.startswith("short read"):
        reason = f"short read: got {done:,} of {nbytes:,} bytes"
    return DiskIOError(
        code,
        f"Disk tier: {op} of {nbytes:,} bytes at offset {offset:,} of {path} failed after {done:,} bytes: {reason}."
        f" HINT: {hint}.",
    )
