"""Pinned host memory, accounted as it is held.

[Note: pinned memory]
On CUDA every HOST chunk buffer is pinned (page-locked) so that its copies to and from the device run
asynchronously. The storage behind ``torch.empty(..., pin_memory=True)`` comes from torch's caching host
allocator (``ATen/core/CachingHostAllocator.h``), which

1. rounds every request up to a power of two (``c10::llvm::PowerOf2Ceil``; the ``pinned_max_round_threshold_mb``
   setting that would stop it hands out any block of the same log2 bucket, smaller ones included, so it is not
   used here): a 1.0009 GiB fp32 chunk pins 2 GiB;
2. keeps every freed block in its cache for the life of the process and hands it to the next request of the
   same size class, so the bytes it holds are the high-water mark of live blocks per class, not the live ones.

A chunk owns one storage per tier for its whole life and frees it in place with ``resize_(0)`` ([Note: storage
identity] in ``chunk.py``), so each host buffer must be its own resizable storage from that allocator; a slab
carved into views could not be freed one view at a time. :class:`PinnedArena` therefore

- backs a pinned buffer with its whole size class (:func:`block_bytes`), so what the chunk accounts is what the
  allocator hands out, and warns once when a chunk's bytes are not a power of two (the rounding is accounted,
  never hidden); on CUDA the engine lays chunks out with power-of-two capacities
  (:func:`~lightning_pstar.planning.requirements.chunk_layout` ``allocator_friendly``), which makes every
  kind's bytes a power of two and the waste zero;
- counts the blocks the cache holds per size class (:attr:`PinnedArena.held_bytes`, reported as
  ``MemoryReport.pinned_bytes``) and the idle ones among them (:meth:`PinnedArena.idle_bytes`), which the host
  budget counts as held;
- pins a new buffer only while the pinned bytes it could ever hold stay under a share of the machine's RAM
  (:func:`pin_decision`, :data:`PINNED_RAM_SHARE`); past it the buffer is pageable (slower copies, never an
  exhausted machine) and one warning says so;
- gives the idle blocks back to the driver at teardown (:meth:`PinnedArena.release`).

There is one arena per process (:func:`host_arena`) because there is one caching host allocator per process:
the arena is the ledger of what that allocator holds for the chunks, whichever engine allocated them.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass

import torch

from lightning_pstar.report import format_bytes

__all__ = [
    "PINNED_RAM_SHARE",
    "PinnedArena",
    "block_bytes",
    "host_arena",
    "mem_total_bytes",
    "pin_decision",
    "rounding_waste",
]

log = logging.getLogger(__name__)

PINNED_RAM_SHARE = 0.5
"""Most of the machine's RAM (``MemTotal``) that chunk buffers pin; past it new buffers are pageable."""


def block_bytes(nbytes: int) -> int:
    """The block torch's caching host allocator hands out for a request of ``nbytes``: the next power of two."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def rounding_waste(nbytes: int) -> int:
    """Bytes the allocator pins beyond a request of ``nbytes``."""
    return block_bytes(nbytes) - nbytes


def mem_total_bytes() -> int:
    """The machine's RAM: ``MemTotal`` of ``/proc/meminfo`` (physical pages where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def pin_decision(*, reserved: int, nbytes: int, mem_total: int, share: float = PINNED_RAM_SHARE) -> bool:
    """Whether one more pinned buffer of ``nbytes`` (its whole block) may be pinned when buffers that could
    pin ``reserved`` bytes exist: the sum must stay within ``share`` of ``mem_total``."""
    return reserved + block_bytes(nbytes) <= int(mem_total * share)


@dataclass
class _SizeClass:
    """The buffers of one block size and the blocks the allocator holds for them."""

    buffers: list[weakref.ref[torch.Tensor]]
    held: int = 0  # blocks: the high-water mark of live buffers (freed blocks stay cached)

    def live(self) -> int:
        alive = [ref for ref in self.buffers if ref() is not None]
        self.buffers[:] = alive
        return sum(1 for ref in alive if (buf := ref()) is not None and buf.untyped_storage().nbytes() > 0)


class PinnedArena:
    """Host buffers of chunks: pinned within a share of RAM, backed by whole allocator blocks, accounted as held.

    ``pin=False`` (no CUDA) backs the buffers the caller asks to pin with pageable memory and keeps the same
    ledger, which is then the model of what the caching allocator would hold (the CPU tests check the
    arithmetic there). A buffer the caller does not ask to pin (the simulated device) is outside the ledger.
    """

    def __init__(self, *, pin: bool, mem_total: int | None = None, share: float = PINNED_RAM_SHARE) -> None:
        self.pin = pin
        self.mem_total = mem_total_bytes() if mem_total is None else mem_total
        self.share = share
        self._classes: dict[int, _SizeClass] = {}  # block bytes -> its buffers
        self._fallbacks = 0  # buffers made pageable because pinning them would pass the share of RAM
        self._warned_rounding = False
        # the buffers of the ledger, by id (a tensor's == is elementwise, so it cannot key a weak dict itself)
        self._managed: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    # ---- buffers ---------------------------------------------------------------------------------------------
    def unbacked(self, capacity: int, dtype: torch.dtype, *, pin: bool = True) -> torch.Tensor:
        """An empty host buffer for a chunk of ``capacity`` elements (no byte allocated yet): pinned when the arena
        and the caller (``pin``: the chunk's device is CUDA) pin, unless the pinned bytes it could hold would pass
        the share of RAM."""
        nbytes = capacity * dtype.itemsize
        if pin and not pin_decision(
            reserved=self.reserved_bytes(), nbytes=nbytes, mem_total=self.mem_total, share=self.share
        ):
            self._fallbacks += 1
            if self._fallbacks == 1:
                log.warning(
                    "PatrickStar: pinning another %s host chunk buffer would pass %.0f%% of this machine's RAM"
                    " (%s); it and later ones use pageable memory (slower host-device copies). HINT: lower"
                    " host_memory_limit or the model size, or add RAM.",
                    format_bytes(block_bytes(nbytes)),
                    100 * self.share,
                    format_bytes(self.mem_total),
                )
        if pin and self._fallbacks == 0:
            buf = torch.empty(0, dtype=dtype, pin_memory=self.pin)
            self._classes.setdefault(block_bytes(nbytes), _SizeClass(buffers=[])).buffers.append(weakref.ref(buf))
            self._managed[id(buf)] = buf
            return buf
        buf = torch.empty(capacity, dtype=dtype)  # pageable memory has no cache: shape now, storage freed
        buf.untyped_storage().resize_(0)
        return buf

    def back(self, buf: torch.Tensor, capacity: int) -> torch.Tensor:
        """Give ``buf``'s own storage its bytes in place (the same storage object, see [Note: storage identity])
        and, the first time, its ``capacity`` shape. A pinned buffer gets its whole block."""
        nbytes = capacity * buf.element_size()
        storage = buf.untyped_storage()
        if storage.nbytes() == 0:
            block = block_bytes(nbytes)
            size_class = self._classes.get(block) if self._managed.get(id(buf)) is buf else None
            if size_class is not None:
                if block != nbytes and not self._warned_rounding:
                    self._warned_rounding = True
                    log.warning(
                        "PatrickStar: a host chunk buffer of %s pins %s (torch's host allocator rounds to powers of"
                        " two; the rounding is accounted as held). HINT: chunk_size='auto' picks power-of-two"
                        " capacities on CUDA.",
                        format_bytes(nbytes, exact=True),
                        format_bytes(block, exact=True),
                    )
                storage.resize_(block)
                size_class.held = max(size_class.held, size_class.live())
            else:
                storage.resize_(nbytes)
        if buf.numel() != capacity:
            buf.set_(storage, 0, (capacity,), (1,))
        return buf

    # ---- accounting ------------------------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Pinned bytes the allocator holds for chunk buffers now: live blocks and cached idle ones."""
        return sum(block * c.held for block, c in self._classes.items())

    def live_bytes(self) -> int:
        """Pinned bytes of buffers that hold a chunk's data now."""
        return sum(block * c.live() for block, c in self._classes.items())

    def idle_bytes(self) -> int:
        """Pinned bytes held in the allocator's cache for chunk buffers that hold nothing now."""
        return sum(block * (c.held - c.live()) for block, c in self._classes.items())

    def reusable(self, nbytes: int) -> bool:
        """Whether a new pinned buffer of ``nbytes`` would take an idle cached block (holding nothing new)."""
        size_class = self._classes.get(block_bytes(nbytes))
        return size_class is not None and size_class.held > size_class.live()

    def extra_bytes(self) -> int:
        """What the allocator holds beyond the bytes of the chunks' live buffers: idle cached blocks and the
        rounding of live ones (what the host budget adds to the chunks' own bytes)."""
        live = 0
        for size_class in self._classes.values():
            for ref in size_class.buffers:
                buf = ref()
                if buf is not None and buf.untyped_storage().nbytes() > 0:
                    live += buf.numel() * buf.element_size()
        return self.held_bytes - live

    def added_bytes(self, nbytes: int, buf: torch.Tensor | None = None) -> int:
        """Host bytes held in addition once a chunk buffer of ``nbytes`` is backed: its whole block, none when an
        idle cached block takes it; ``nbytes`` where host buffers are pageable. ``buf``: the chunk's existing
        host buffer (a pinned one keeps its block after a fallback made later buffers pageable); None for a
        buffer not created yet."""
        if buf is not None:
            pinned = self._managed.get(id(buf)) is buf
        else:
            pinned = bool(self.pin or self._classes) and not self._fallbacks
        if not pinned:
            return nbytes
        return 0 if self.reusable(nbytes) else block_bytes(nbytes)

    def reserved_bytes(self) -> int:
        """The most the pinned buffers handed out could ever hold at once (each its whole block)."""
        return sum(block * max(len(c.buffers), c.held) for block, c in self._classes.items())

    @property
    def fallbacks(self) -> int:
        """Host buffers made pageable because pinning them would have passed the share of RAM."""
        return self._fallbacks

    # ---- teardown --------------------------------------------------------------------------------------------
    def release(self) -> None:
        """Give the idle cached blocks back to the driver (teardown, after the chunks freed their storage); blocks
        still live stay held."""
        for size_class in self._classes.values():
            size_class.held = size_class.live()
        self._classes = {b: c for b, c in self._classes.items() if c.held or c.buffers}
        if self.pin and torch.cuda.is_available():
            torch.accelerator.empty_host_cache()


_ARENA: list[PinnedArena] = []  # the process's one arena, created on first use (see the module note)


def host_arena() -> PinnedArena:
    """The arena of this process's caching host allocator; pins only where CUDA is available."""
    if not _ARENA:
        _ARENA.append(PinnedArena(pin=torch.cuda.is_available()))
    return _ARENA[0]
