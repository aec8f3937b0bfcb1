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
  exhausted machine) and one warning says so; the decision is taken per buffer, so once blocks are given back
  (:meth:`PinnedArena.release`) new buffers are pinned again;
- gives the idle blocks back to the driver (:meth:`PinnedArena.release`): at the end of the warm-up (after the
  hybrid plan moved optimizer states), when the host budget would refuse a buffer, and family by family at
  teardown.

There is one arena per process (:func:`host_arena`) because there is one caching host allocator per process:
the arena is the ledger of what that allocator holds for the chunks, whichever engine allocated them.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass

import torch

from lightning_pstar.planning.tiers import block_bytes  # one function for the arena and the setup's host need
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
    """The buffers of one block size and the blocks the allocator holds for them (counts kept as they change)."""

    block: int  # bytes of one block
    buffers: int = 0  # buffers of this class alive (handed out and not collected)
    live: int = 0  # of them, those whose storage holds their block now
    held: int = 0  # blocks: the high-water mark of live buffers (freed blocks stay cached)


@dataclass
class _Buffer:
    """The ledger's entry for one buffer: its size class and the bytes it counts as live."""

    ref: weakref.ref[torch.Tensor]
    size_class: _SizeClass
    live_nbytes: int = 0  # numel * itemsize while the storage holds its block, else 0


class PinnedArena:
    """Host buffers of chunks: pinned within a share of RAM, backed by whole allocator blocks, accounted as held.

    ``pin=False`` (no CUDA) backs the buffers the caller asks to pin with pageable memory and keeps the same
    ledger, which is then the model of what the caching allocator would hold (the CPU tests check the
    arithmetic there). A buffer the caller does not ask to pin (the simulated device) is outside the ledger.

    [Note: running totals]
    The host budget asks :meth:`extra_bytes` on every host-room check (once per eviction on CUDA), so the
    ledger keeps its totals as blocks are taken (:meth:`back`), given back (:meth:`free`, and a buffer
    collected: its weakref's callback) and released (:meth:`release`) instead of walking every buffer: each
    query is O(1) or O(size classes). A ledger buffer's storage must therefore be freed through :meth:`free`;
    one freed behind the arena's back (a bare ``resize_(0)``) is counted live until it is backed again, where
    :meth:`back` sees its empty storage and corrects the totals. :meth:`recount_extra_bytes` is the full walk
    the totals must equal.
    """

    def __init__(self, *, pin: bool, mem_total: int | None = None, share: float = PINNED_RAM_SHARE) -> None:
        self.pin = pin
        self.mem_total = mem_total_bytes() if mem_total is None else mem_total
        self.share = share
        self._classes: dict[int, _SizeClass] = {}  # block bytes -> its counts
        self._fallbacks = 0  # buffers made pageable because pinning them would pass the share of RAM
        self._warned_rounding = False
        # the buffers of the ledger, by id (a tensor's == is elementwise, so it cannot key a weak dict itself)
        self._buffers: dict[int, _Buffer] = {}
        self._live_nbytes = 0  # sum of live_nbytes over the ledger's buffers
        self._held_bytes = 0  # sum of block * held over the size classes

    def _entry(self, buf: torch.Tensor) -> _Buffer | None:
        entry = self._buffers.get(id(buf))
        return entry if entry is not None and entry.ref() is buf else None

    def _set_live(self, entry: _Buffer, nbytes: int) -> None:
        """Count ``entry`` live with ``nbytes`` (0: it holds nothing now)."""
        if (entry.live_nbytes > 0) != (nbytes > 0):
            entry.size_class.live += 1 if nbytes > 0 else -1
        self._live_nbytes += nbytes - entry.live_nbytes
        entry.live_nbytes = nbytes

    def _collected(self, key: int, ref: weakref.ref[torch.Tensor]) -> None:
        """A ledger buffer was collected: its block stays held in the cache (idle), it no longer counts."""
        entry = self._buffers.get(key)
        if entry is None or entry.ref is not ref:
            return
        del self._buffers[key]
        self._set_live(entry, 0)
        entry.size_class.buffers -= 1

    # ---- buffers ---------------------------------------------------------------------------------------------
    def unbacked(self, capacity: int, dtype: torch.dtype, *, pin: bool = True) -> torch.Tensor:
        """An empty host buffer for a chunk of ``capacity`` elements (no byte allocated yet): pinned when the arena
        and the caller (``pin``: the chunk's device is CUDA) pin, unless the pinned bytes it could hold would pass
        the share of RAM."""
        nbytes = capacity * dtype.itemsize
        pinned = pin and self.would_pin(nbytes)
        if pin and not pinned:
            self._fallbacks += 1
            if self._fallbacks == 1:
                log.warning(
                    "PatrickStar: pinning another %s host chunk buffer would pass %.0f%% of this machine's RAM"
                    " (%s); it, and any later one past that share, uses pageable memory (slower copies). HINT: lower"
                    " host_memory_limit or the model size, or add RAM.",
                    format_bytes(block_bytes(nbytes)),
                    100 * self.share,
                    format_bytes(self.mem_total),
                )
        if pinned:  # decided per buffer: once blocks are given back, new buffers are pinned again
            buf = torch.empty(0, dtype=dtype, pin_memory=self.pin)
            block = block_bytes(nbytes)
            size_class = self._classes.setdefault(block, _SizeClass(block=block))
            size_class.buffers += 1
            key = id(buf)
            ref = weakref.ref(buf, lambda dead: self._collected(key, dead))
            self._buffers[key] = _Buffer(ref=ref, size_class=size_class)
            return buf
        buf = torch.empty(capacity, dtype=dtype)  # pageable memory has no cache: shape now, storage freed
        buf.untyped_storage().resize_(0)
        return buf

    def back(self, buf: torch.Tensor, capacity: int) -> torch.Tensor:
        """Take a block: give ``buf``'s own storage its bytes in place (the same storage object, see [Note: storage
        identity]) and, the first time, its ``capacity`` shape. A pinned buffer gets its whole block."""
        nbytes = capacity * buf.element_size()
        storage = buf.untyped_storage()
        entry = self._entry(buf)
        if storage.nbytes() == 0:
            block = block_bytes(nbytes)
            if entry is not None and block != nbytes and not self._warned_rounding:
                self._warned_rounding = True
                log.warning(
                    "PatrickStar: a host chunk buffer of %s pins %s (torch's host allocator rounds to powers of"
                    " two; the rounding is accounted as held). HINT: chunk_size='auto' picks power-of-two"
                    " capacities on CUDA.",
                    format_bytes(nbytes, exact=True),
                    format_bytes(block, exact=True),
                )
            storage.resize_(block if entry is not None else nbytes)
        if buf.numel() != capacity:
            buf.set_(storage, 0, (capacity,), (1,))
        if entry is not None:  # also corrects the totals for a buffer freed behind the arena's back
            self._set_live(entry, buf.numel() * buf.element_size())
            size_class = entry.size_class
            if size_class.live > size_class.held:
                self._held_bytes += (size_class.live - size_class.held) * size_class.block
                size_class.held = size_class.live
        return buf

    def free(self, buf: torch.Tensor) -> None:
        """Give a block back: free ``buf``'s storage in place (``resize_(0)``). A ledger buffer's block stays held
        in the allocator's cache, idle; any other buffer (device, pageable) is only freed."""
        entry = self._entry(buf)
        if entry is not None:
            self._set_live(entry, 0)
        buf.untyped_storage().resize_(0)

    # ---- accounting ------------------------------------------------------------------------------------------
    @property
    def held_bytes(self) -> int:
        """Pinned bytes the allocator holds for chunk buffers now: live blocks and cached idle ones."""
        return self._held_bytes

    def live_bytes(self) -> int:
        """Pinned bytes of buffers that hold a chunk's data now."""
        return sum(block * c.live for block, c in self._classes.items())

    def idle_bytes(self) -> int:
        """Pinned bytes held in the allocator's cache for chunk buffers that hold nothing now."""
        return sum(block * (c.held - c.live) for block, c in self._classes.items())

    def reusable(self, nbytes: int) -> bool:
        """Whether a new pinned buffer of ``nbytes`` would take an idle cached block (holding nothing new)."""
        size_class = self._classes.get(block_bytes(nbytes))
        return size_class is not None and size_class.held > size_class.live

    def extra_bytes(self) -> int:
        """What the allocator holds beyond the bytes of the chunks' live buffers: idle cached blocks and the
        rounding of live ones (what the host budget adds to the chunks' own bytes). O(1): [Note: running
        totals]."""
        return self._held_bytes - self._live_nbytes

    def recount_extra_bytes(self) -> int:
        """:meth:`extra_bytes` by walking every buffer of the ledger (O(buffers)): what the running totals must
        equal while every free goes through :meth:`free`."""
        live = 0
        held = 0
        for block, size_class in self._classes.items():
            held += block * size_class.held
        for entry in self._buffers.values():
            buf = entry.ref()
            if buf is not None and buf.untyped_storage().nbytes() > 0:
                live += buf.numel() * buf.element_size()
        return held - live

    def added_bytes(self, nbytes: int, buf: torch.Tensor | None = None) -> int:
        """Host bytes held in addition once a chunk buffer of ``nbytes`` is backed: its whole block, none when an
        idle cached block takes it; ``nbytes`` where host buffers are pageable. ``buf``: the chunk's existing
        host buffer (a pinned one keeps its block after a fallback made later buffers pageable); None for a
        buffer not created yet."""
        if buf is not None:
            pinned = self._entry(buf) is not None
        else:
            pinned = bool(self.pin or self._classes) and self.would_pin(nbytes)
        if not pinned:
            return nbytes
        return 0 if self.reusable(nbytes) else block_bytes(nbytes)

    def would_pin(self, nbytes: int) -> bool:
        """Whether a new buffer of ``nbytes`` asked to be pinned would be, now (:func:`pin_decision`)."""
        return pin_decision(reserved=self.reserved_bytes(), nbytes=nbytes, mem_total=self.mem_total, share=self.share)

    def reserved_bytes(self) -> int:
        """The most the pinned buffers handed out could ever hold at once (each its whole block)."""
        return sum(block * max(c.buffers, c.held) for block, c in self._classes.items())

    @property
    def fallbacks(self) -> int:
        """Host buffers made pageable because pinning them would have passed the share of RAM."""
        return self._fallbacks

    # ---- teardown --------------------------------------------------------------------------------------------
    def release(self) -> None:
        """Give the idle cached blocks back to the driver (teardown, after the chunks freed their storage); blocks
        still live stay held."""
        for size_class in self._classes.values():
            size_class.held = size_class.live
        self._classes = {b: c for b, c in self._classes.items() if c.held or c.buffers}
        self._held_bytes = sum(block * c.held for block, c in self._classes.items())
        if self.pin and torch.cuda.is_available():
            _empty_host_cache()


def _empty_host_cache() -> None:
    """Give torch's caching host allocator's idle pinned blocks back: ``torch.accelerator.empty_host_cache`` from
    torch 2.13, the private binding before it (torch 2.11 on the first GPU box had only that); nothing where neither
    exists."""
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


_ARENA: list[PinnedArena] = []  # the process's one arena, created on first use (see the module note)


def host_arena() -> PinnedArena:
    """The arena of this process's caching host allocator; pins only where CUDA is available."""
    if not _ARENA:
        _ARENA.append(PinnedArena(pin=torch.cuda.is_available()))
    return _ARENA[0]
