"""Page-aligned host buffers for direct I/O, and a small arena of them.

``O_DIRECT`` reads and writes move bytes between the disk and user memory without the page cache, so the
kernel asks that the buffer address, the file offset and the length are all multiples of the device's
logical block size. :data:`ALIGNMENT` (4096 bytes, one page) covers every block size in use today.

torch has no aligned allocator, so :func:`aligned_empty` over-allocates a ``uint8`` tensor by one alignment and
returns a view that starts at the first aligned address; the view keeps the whole storage alive. A
:class:`AlignedArena` is a fixed set of such blocks handed out and taken back by the disk store's threads (the
staging buffers of tensors that are not aligned themselves, and the padded tail of every tensor whose size is
not a multiple of the alignment). On CUDA the arena's one allocation is page-locked in place with
``cudaHostRegister`` so that the same bytes serve the disk and asynchronous device copies; torch's caching host
allocator is not used because it rounds every request up to a power of two ([Note: pinned memory] in
``pinned.py``).
"""

from __future__ import annotations

import logging
import queue

import torch

__all__ = ["ALIGNMENT", "AlignedArena", "aligned_empty", "align_up", "is_aligned"]

log = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch's pinned memory is

ALIGNMENT = 4096
"""Byte alignment of ``O_DIRECT`` buffers, offsets and lengths (one page; a multiple of every logical block
size of current disks)."""


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-nbytes // alignment) * alignment


def is_aligned(tensor: torch.Tensor, alignment: int = ALIGNMENT) -> bool:
    """Whether ``tensor`` is a contiguous host tensor whose first byte sits on an ``alignment`` boundary."""
    return tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.data_ptr() % alignment == 0


def aligned_empty(nbytes: int, *, alignment: int = ALIGNMENT) -> torch.Tensor:
    """An uninitialised 1-D ``uint8`` host tensor of ``nbytes`` bytes whose first byte is ``alignment``-aligned.

    The returned tensor is a view into a storage ``alignment`` bytes larger; view it as another dtype with
    ``.view(dtype)``. Its storage must not be resized (the view's offset would then point past the data).
    """
    if nbytes < 0:
        raise ValueError(f"aligned_empty: nbytes must be >= 0, got {nbytes}.")
    base = torch.empty(nbytes + alignment, dtype=torch.uint8)
    offset = -base.data_ptr() % alignment
    view = base[offset : offset + nbytes]
    assert view.data_ptr() % alignment == 0
    return view


class AlignedArena:
    """``count`` aligned blocks of ``block_bytes`` each, carved from one allocation, lent to one user at a time.

    :meth:`acquire` blocks until a block is free; :meth:`release` gives it back. A disk store with ``n`` I/O
    threads needs ``n`` blocks: each thread holds at most one while it runs one block of I/O. On CUDA
    (``pin=True`` and a CUDA build with a device) the allocation is registered with ``cudaHostRegister``;
    :meth:`close` unregisters it.
    """

    def __init__(self, block_bytes: int, count: int, *, pin: bool = False) -> None:
        if block_bytes <= 0 or block_bytes % ALIGNMENT:
            raise ValueError(
                f"AlignedArena: block_bytes must be a positive multiple of {ALIGNMENT}, got {block_bytes}."
            )
        if count <= 0:
            raise ValueError(f"AlignedArena: count must be >= 1, got {count}.")
        self.block_bytes = block_bytes
        self.count = count
        self._data = aligned_empty(block_bytes * count)  # (count * block_bytes,) uint8
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for index in range(count):
            self._free.put(index)
        self.registered = False
        if pin and torch.cuda.is_available():
            self._register()

    @property
    def nbytes(self) -> int:
        """Bytes of the arena's blocks (the allocation holds one alignment more)."""
        return self.block_bytes * self.count

    def block(self, index: int) -> torch.Tensor:
        """Block ``index`` as a ``(block_bytes,)`` uint8 view (aligned)."""
        start = index * self.block_bytes
        return self._data[start : start + self.block_bytes]

    def acquire(self) -> int:
        """The index of a free block, waiting for one if all are lent."""
        return self._free.get()

    def release(self, index: int) -> None:
        """Give block ``index`` back."""
        self._free.put(index)

    def _register(self) -> None:
        # [Note: registered arena] cudaHostRegister page-locks memory that torch allocated as ordinary pageable
        # memory: copies between it and the device then run asynchronously, as from torch's pinned allocator,
        # without that allocator's power-of-two rounding. The whole allocation (aligned, a multiple of the page
        # size) is registered once and unregistered before torch frees it.
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self._data.data_ptr(), self.nbytes, _HOST_REGISTER_PORTABLE)
        if int(err) != 0:
            log.warning(
                "cudaHostRegister of the %d-byte disk staging arena failed (cudaError %d): its device copies are"
                " synchronous.",
                self.nbytes,
                int(err),
            )
            return
        self.registered = True

    def close(self) -> None:
        """Unregister the allocation from CUDA (no-op when it was not registered)."""
        if self.registered:
            self.registered = False
            err = torch.cuda.cudart().cudaHostUnregister(self._data.data_ptr())
            if int(err) != 0:
                log.warning("cudaHostUnregister of the disk staging arena failed (cudaError %d).", int(err))
