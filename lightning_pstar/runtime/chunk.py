"""A chunk: one contiguous 1-D buffer of one dtype holding many tensors at fixed offsets.

[Note: storage identity]
Autograd saves views of parameters for backward (a linear layer saves ``weight.t()``). If those views
pointed at memory that is freed and later replaced by a new allocation, backward would silently read the
wrong bytes. So a chunk owns ONE storage per tier for its whole life. Evicting from DEVICE copies the bytes
to the HOST buffer and frees the device storage in place with ``untyped_storage().resize_(0)``; fetching
back does ``resize_(nbytes)`` on the same storage and copies in, so every view autograd saved from the
device buffer reads the fetched bytes. (Checked on torch 2.13: re-pointing a parameter at a new device
tensor after forward gives wrong gradients; resizing the same storage gives exact ones.)

The parameters themselves point at the buffer of the tier that currently holds their chunk: the chunk
manager re-points them whenever the chunk moves (which never happens while a module computes with it).
A parameter therefore never refers to freed memory: reading a weight whose chunk is on HOST reads the
HOST copy instead of crashing the process. Before a module runs again its chunk is fetched, and the
parameter points at the (refilled) device storage again, before autograd can save anything new. (In mixed
precision, while a param slot holds its gradient -- after backward, until the step -- the parameter points
at its fp32 master instead: ``Residency.point_at_chunk``.)

Both buffers are created with an EMPTY storage (:func:`~lightning_pstar.runtime.buffers.unbacked`): a chunk
that starts on HOST never allocates a byte on the device, not even for an instant (``torch.empty(capacity,
device=cuda)`` followed by ``resize_(0)`` would take the block from the caching allocator and keep it
reserved), and a chunk that starts on DEVICE pins nothing on the host.

[Note: cached views]
A view of a slot (``chunk.buffer[a:b].view(shape)``) costs two tensor constructions, and the engine takes
one per parameter several times per step (storing a gradient, pointing a parameter at its weight, the
optimizer's kernels). So a chunk takes each slot's view of each tier's buffer once and hands out the same
view afterwards (:meth:`Chunk.slot_view`, :meth:`Chunk.buffer_view`). A view stays valid for the buffer's
whole life because the buffer keeps its storage object (storage identity, above): a view taken before an
eviction reads the refilled bytes after the fetch back, and the one ``set_`` a buffer ever gets (its shape,
the first time it is backed: ``buffers.backed``, ``HostArena.back``) keeps that storage too and comes before
any view. A cached view is handed out again only if it was taken from the very buffer tensor the chunk holds
now, so a buffer replaced by a new tensor gets fresh views. The views are shared: callers read and write
their elements, never their metadata (no ``resize_``, ``set_``, ``requires_grad_`` on them).

[Note: clean evictions]
A fetch may keep the HOST bytes it copied from (``move_to(DEVICE, keep_host_copy=True)``): while nothing writes
the chunk, that host copy is current, and evicting the chunk again only frees its device storage, with no copy
(a *clean* eviction; a *dirty* one copies the bytes back first). The copy is current while the device buffer's
version counter (bumped by every in-place write through a view of it: gradients stored in a slot, loads,
``copy_``) is what it was when the copy was made, and while the residency has not dropped it: the residency
also drops it when a parameter was written in place (its own version counter), when an optimizer step is
about to write the chunk (fused optimizer kernels do not bump version counters), and when the host budget
needs the bytes. A write that bypasses autograd's version counters (``param.data.mul_(...)``) is invisible
to this test: such writes to a weight must not happen between its module's forward and the optimizer step
(the engine's own writers all go through the counted paths or drop the copy themselves). The kept copy
counts as host memory held (``TransferStats.host_copy_bytes``).

[Note: streams]
On CUDA, copies between tiers run on one side stream (the residency's copy stream), by PyTorch's rules for
memory used across streams (``torch.cuda.Stream.wait_stream``, ``Tensor.record_stream``, ``torch.cuda.Event``):

1. Before a copy writes a device block, the copy stream waits for the compute stream
   (``copy.wait_stream(compute)``): the caching allocator hands out blocks per stream, and the block
   ``resize_`` just gave the target may have been freed by a kernel the compute stream has not run yet.
   The same wait orders an eviction after the kernels that last wrote the chunk.
2. A device block freed (``resize_(0)``) while a copy may still read or write it is first marked with
   ``record_stream(copy)``: the allocator then reuses it only after the copy stream's work queued so far
   is done. Evictions free their device source this way without waiting on the CPU; the block counts against
   the device budget until the copy ends, and a fetch that needs its room waits for that (``runtime/inflight.py``).
3. The copy records an event; a consumer waits on it where it reads the bytes (:meth:`Chunk.wait`). The
   compute stream waits on the event (``current_stream().wait_event``), the CPU never calls
   ``synchronize()`` for a fetch (a demand fetch included: [Note: fetch and prefetch] in ``lookahead.py``).
   Only a reader on the CPU (a host optimizer step, a state dict) blocks, on that one event, after an
   asynchronous eviction.
4. The pinned HOST source of a fetch is freed as soon as the compute stream waits: torch's caching host
   allocator records an event on every non-blocking copy from pinned memory and reuses the block only once
   that event has completed, so freeing early is safe.
Without a copy stream (the simulated device, or a copy on the CPU side) every copy is synchronous.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from lightning_pstar.runtime.buffers import backed, unbacked
from lightning_pstar.runtime.layout import ChunkKind, Slot
from lightning_pstar.runtime.pinned import host_arena
from lightning_pstar.runtime.state import ChunkState, TensorState, Tier
from lightning_pstar.runtime.transfer_stats import TransferStats

__all__ = ["Chunk", "ChunkKind", "Slot", "TransferStats"]

_ordinary_tensors = functools.partial(torch.inference_mode, False)  # [Note: storage identity]: buffers and views the
# engine makes while user code runs under torch.inference_mode() (an evaluation forward fetching chunks) must stay
# ordinary tensors: an inference tensor refuses the in-place writes (copies, the optimizer's update) made after it
_DEVICE = Tier.DEVICE  # module-level: an Enum member read through its class costs a lookup on the hot path


class Chunk:
    """One buffer of ``capacity`` elements of ``dtype`` that lives on exactly one tier at a time.

    The chunk never decides where it goes; the chunk manager and the placement policy do.
    """

    chunk_id: int
    kind: ChunkKind
    dtype: torch.dtype
    capacity: int  # elements
    slots: list[Slot]  # shared by every chunk of the family
    _device_buffer: torch.Tensor  # 1D, capacity elements; storage resized to 0 while not on DEVICE
    _host_buffer: torch.Tensor | None  # 1D, capacity elements; storage resized to 0 while not on HOST
    _tier: Tier | None

    def __init__(
        self,
        *,
        chunk_id: int,
        kind: ChunkKind,
        dtype: torch.dtype,
        capacity: int,
        slots: list[Slot],
        device: torch.device,
        stats: TransferStats,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"chunk capacity must be positive, got {capacity}")
        self.chunk_id = chunk_id
        self.kind = kind
        self.dtype = dtype
        self.capacity = capacity
        self.slots = slots
        self._device = device
        self._stats = stats
        self._pin_host = device.type == "cuda"
        self._device_buffer = unbacked(capacity, dtype, device)  # nothing allocated (see the module note)
        self._host_buffer = None
        self._tier = None
        self._pending: torch.cuda.Event | None = None  # an asynchronous copy in flight (see [Note: streams])
        self._on_landed: Callable[[], None] | None = None  # called once a fetch in flight is waited on
        # [Note: clean evictions]: while on DEVICE, whether the HOST buffer still holds a copy, the device
        # buffer's version when it was made, and (CUDA) the event of the fetch that read it
        self._host_copy = False
        self._host_copy_version = -1
        self._host_read: torch.cuda.Event | None = None
        # [Note: cached views]: per tier, id(slot) -> (slot, the buffer it was taken from, the view)
        self._device_views: dict[int, tuple[Slot, torch.Tensor, torch.Tensor]] = {}
        self._host_views: dict[int, tuple[Slot, torch.Tensor, torch.Tensor]] = {}
        self._lent: torch.Tensor | None = None  # on DISK: the host buffer holding the bytes while a reader needs them

    # ---- properties -------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.capacity * self.dtype.itemsize

    @property
    def tier(self) -> Tier | None:
        """The tier holding the bytes, or None when released."""
        return self._tier

    @property
    def state(self) -> ChunkState:
        if self._tier is None:
            return ChunkState.RELEASED
        if any(s.state is TensorState.COMPUTE for s in self.slots):
            return ChunkState.COMPUTE
        return ChunkState.HOLD

    @property
    def has_host_copy(self) -> bool:
        """Whether a HOST copy of the device-resident bytes is held (current or not: see :attr:`host_copy_current`)."""
        return self._host_copy

    @property
    def host_copy_current(self) -> bool:
        """Whether the held HOST copy still equals the device bytes as far as version counters tell
        ([Note: clean evictions])."""
        return self._host_copy and self._device_buffer._version == self._host_copy_version

    @property
    def host_buffer(self) -> torch.Tensor | None:
        """The HOST buffer, once created (its storage is empty while the chunk is on DEVICE)."""
        return self._host_buffer

    @property
    def device_buffer(self) -> torch.Tensor:
        """The DEVICE buffer; parameter views are taken from it once (see the storage-identity note)."""
        return self._device_buffer

    @property
    def data(self) -> torch.Tensor:
        """The 1-D buffer on the chunk's current tier (waits for an asynchronous fetch in flight)."""
        self.wait()
        return self.buffer

    @property
    def buffer(self) -> torch.Tensor:
        """The 1-D buffer on the chunk's current tier, without waiting: for taking views only."""
        if self._tier is Tier.DEVICE:
            return self._device_buffer
        if self._tier is Tier.HOST:
            assert self._host_buffer is not None
            return self._host_buffer
        if self._tier is Tier.DISK:
            if self._lent is None:
                raise RuntimeError(
                    f"PatrickStar internal error: chunk {self.chunk_id} ({self.kind.value}) is on the disk tier and was"
                    " read without being loaded. HINT: please report this with the model and the options."
                )
            return self._lent
        raise RuntimeError(f"chunk {self.chunk_id} ({self.kind.value}) is released and has no data")

    @property
    def pending(self) -> bool:
        """Whether an asynchronous copy is in flight (:meth:`wait` orders a reader after it)."""
        return self._pending is not None

    @property
    def copy_event(self) -> torch.cuda.Event | None:
        """The event of the asynchronous copy in flight, if any (an eviction's: its device block is reusable once
        it completes, [Note: fetch and prefetch] in ``lookahead.py``)."""
        return self._pending

    def on_landed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the fetch in flight is waited on (at once when none is): the residency points
        the parameters at the device buffer only then ([Note: fetch and prefetch] in ``lookahead.py``, point 2)."""
        if self._pending is None or self._tier is not _DEVICE:
            callback()
        else:
            self._on_landed = callback

    @property
    def ready(self) -> bool:
        """On the device with no copy in flight: a module may compute with it as it is."""
        return self._tier is _DEVICE and self._pending is None

    def slot_view(self, slot: Slot) -> torch.Tensor:
        """A view of ``slot`` in the buffer of the current tier, shaped like the parameter (waits for an
        asynchronous copy in flight). Shared: see [Note: cached views]."""
        if self._pending is not None:
            self.wait()
        if self._tier is _DEVICE:  # the hot case, looked up here: one call less per gradient stored
            hit = self._device_views.get(id(slot))
            if hit is not None and hit[0] is slot and hit[1] is self._device_buffer:
                return hit[2]
        return self.buffer_view(slot)

    def buffer_view(self, slot: Slot) -> torch.Tensor:
        """:meth:`slot_view` without waiting: for pointing a parameter at its slot ([Note: cached views])."""
        tier = self._tier
        buf = self._device_buffer if tier is _DEVICE else self.buffer  # the latter raises when released
        views = self._device_views if tier is _DEVICE else self._host_views
        hit = views.get(id(slot))
        if hit is not None and hit[0] is slot and hit[1] is buf:
            return hit[2]
        with _ordinary_tensors():  # a view taken in the user's inference mode would be one for good
            view = slot.view_in(buf)
        views[id(slot)] = (slot, buf, view)
        return view

    # ---- transitions ------------------------------------------------------------------------------------
    def allocate(self, tier: Tier, *, zero: bool = True) -> None:
        """Give the released chunk storage on ``tier``, zeroed unless it is about to be overwritten."""
        assert self._tier is None, f"chunk {self.chunk_id} is already allocated on {self._tier}"
        with _ordinary_tensors():
            storage = self._storage_for(tier, allocate=True)
        if zero:
            storage.zero_()
        self._set_tier(tier)
        self._stats.allocated(tier, self.nbytes)

    def move_to(self, tier: Tier, *, stream: torch.cuda.Stream | None = None, keep_host_copy: bool = False) -> None:
        """Copy the bytes to ``tier`` and free the source storage in place. A no-op if already there.

        With ``stream`` (CUDA) the copy runs asynchronously on that stream, by the rules of [Note: streams];
        :meth:`wait` (called by :attr:`data`) orders the reader after it. A fetch frees its host source there,
        an eviction frees its device source at once (protected by ``record_stream``). A fetch with
        ``keep_host_copy`` keeps its host source, and an eviction whose host copy is current copies nothing
        ([Note: clean evictions]).
        """
        self.wait()
        if self._tier is tier:
            return
        if self._tier is None:
            raise RuntimeError(f"chunk {self.chunk_id} is released; allocate it before moving it")
        if self.state is ChunkState.COMPUTE:
            raise RuntimeError(f"chunk {self.chunk_id} is in use by a module (COMPUTE) and cannot move")
        if tier is Tier.HOST and self.host_copy_current:
            self._evict_clean()
            return
        if tier is Tier.HOST and self._host_copy:  # stale: the copy below overwrites the same host storage
            self._host_copy = False
            self._host_read = None
            self._stats.host_copy_bytes -= self.nbytes
        source = self.buffer
        target = self._storage_for(tier, allocate=True)
        keep = keep_host_copy and tier is Tier.DEVICE
        if stream is not None and (source.is_cuda or target.is_cuda):
            self._copy_on_stream(source, target, stream)
        else:
            target.copy_(source, non_blocking=False)
            if not keep:
                host_arena().free(source)
        self._stats.freed(self._tier, self.nbytes)
        self._stats.allocated(tier, self.nbytes)
        self._stats.moved_bytes += self.nbytes
        if tier is Tier.DEVICE:
            self._stats.h2d_bytes += self.nbytes
            if keep:
                self._host_copy = True
                self._host_copy_version = self._device_buffer._version  # after the copy's own bump
                self._stats.host_copy_bytes += self.nbytes
        else:
            self._stats.d2h_bytes += self.nbytes
            self._stats.moves_off_device += 1
            self._stats.dirty_moves += 1
        self._set_tier(tier)

    def _evict_clean(self) -> None:
        """Leave the device without a copy: the held host copy is current ([Note: clean evictions])."""
        if self._host_read is not None:
            # a CPU reader of the host bytes comes next (a host optimizer step may write them): the fetch
            # that read them asynchronously must be done
            self._host_read.synchronize()
            self._host_read = None
        self._device_buffer.untyped_storage().resize_(0)  # blocks are stream-ordered: see [Note: streams]
        self._host_copy = False
        self._stats.host_copy_bytes -= self.nbytes
        self._stats.freed(Tier.DEVICE, self.nbytes)
        self._stats.allocated(Tier.HOST, self.nbytes)
        self._stats.moves_off_device += 1
        self._stats.clean_moves += 1
        self._stats.clean_bytes += self.nbytes
        self._set_tier(Tier.HOST)

    def drop_host_copy(self) -> None:
        """Free the host copy of a device-resident chunk (stale, or its bytes are needed): a no-op without one."""
        if not self._host_copy:
            return
        if self._host_read is not None:
            self._host_read = None  # the host allocator's event guards a pinned block ([Note: streams], rule 4)
        assert self._host_buffer is not None
        host_arena().free(self._host_buffer)
        self._host_copy = False
        self._stats.host_copy_bytes -= self.nbytes

    def stage_host_copy(self) -> tuple[torch.Tensor, bool]:
        """The HOST buffer of a device-resident chunk, backed, as the staging copy of a host-side optimizer step
        ([Note: the step pipeline] in ``runtime/pipeline.py``), and whether it already equals the device bytes.
        It counts as a host copy that is not current (:meth:`adopt_host_copy` makes it current once the step's
        copies are done); a CPU reader writes it next, so an asynchronous fetch that read it is waited for."""
        assert self._tier is _DEVICE, f"chunk {self.chunk_id} is not on the device"
        self.wait()
        current = self.host_copy_current
        if self._host_read is not None:
            self._host_read.synchronize()
            self._host_read = None
        if not self._host_copy:
            self._storage_for(Tier.HOST, allocate=True)
            self._host_copy = True
            self._stats.host_copy_bytes += self.nbytes
        self._host_copy_version = -1  # the step writes it: never current until adopted
        assert self._host_buffer is not None
        return self._host_buffer, current

    def adopt_host_copy(self) -> None:
        """The staged HOST buffer equals the device bytes now (the step copied it back): a current host copy."""
        assert self._host_copy, f"chunk {self.chunk_id} has no staged host copy"
        self._host_copy_version = self._device_buffer._version

    def settle_on_host(self) -> None:
        """Make the staged HOST buffer the chunk's bytes and free the device storage (a host-side step whose copy
        back did not run: the host buffer holds the newer bytes). Counted as a move off the device that copied
        nothing (the step's own copy was counted by the step)."""
        assert self._tier is _DEVICE and self._host_copy, f"chunk {self.chunk_id} has no staged host copy"
        self._device_buffer.untyped_storage().resize_(0)  # blocks are stream-ordered: see [Note: streams]
        self._host_copy = False
        self._host_read = None
        self._stats.host_copy_bytes -= self.nbytes
        self._stats.freed(Tier.DEVICE, self.nbytes)
        self._stats.allocated(Tier.HOST, self.nbytes)
        self._stats.moves_off_device += 1
        self._stats.clean_moves += 1
        self._set_tier(Tier.HOST)

    def _copy_on_stream(self, source: torch.Tensor, target: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """Rules 1-3 of [Note: streams]: wait for compute, copy, record the event; an eviction frees its
        device source at once under ``record_stream``."""
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            target.copy_(source, non_blocking=True)
            self._pending = torch.cuda.Event()
            self._pending.record(stream)
        if source.is_cuda:  # an eviction: the device block returns to the allocator after the copy only
            source.record_stream(stream)
            source.untyped_storage().resize_(0)
        else:  # a fetch: the device block is read on the compute stream, written on the copy stream
            target.record_stream(stream)

    def wait(self) -> None:
        """Order the reader after an asynchronous copy ([Note: streams], rules 3 and 4).

        After a fetch the compute stream waits on the copy's event (no CPU synchronisation) and the pinned
        host source is freed; after an eviction the CPU, about to read the host bytes, waits on the event.
        """
        pending = self._pending
        if pending is None:
            return
        self._pending = None
        if self._tier is Tier.DEVICE:
            torch.cuda.current_stream(self._device).wait_event(pending)
            assert self._host_buffer is not None
            if self._host_copy:
                self._host_read = pending  # kept for a clean eviction ([Note: clean evictions])
            else:
                host_arena().free(self._host_buffer)  # the host allocator's event guards the block
            landed, self._on_landed = self._on_landed, None
            if landed is not None:
                landed()
        else:
            pending.synchronize()

    def release(self) -> None:
        """Free the storage on every tier (the chunk's slots are no longer needed)."""
        if self._tier is None:
            return
        if self._tier is Tier.DISK:  # the file is the disk tier's to remove
            self._lent = None
            self._stats.freed(Tier.DISK, self.nbytes)
            self._set_tier(None)
            return
        self.drop_host_copy()
        host_arena().free(self.data)
        self._stats.freed(self._tier, self.nbytes)
        self._set_tier(None)

    def let_go(self) -> None:
        """The run is over: as :meth:`release`, but the tier's storage is let go instead of freed in place. It is
        freed with its last reference, this chunk's, unless user code kept a view of a weight past the run (a
        ``param.detach()`` taken in a callback): plain PyTorch's view of a parameter outlives ``fit`` and reads the
        final weight, and so does it here, where a storage freed in place under it would crash the process."""
        if self._tier is None or self._tier is Tier.DISK:
            self.release()
            return
        self.drop_host_copy()  # a copy nothing outside the engine points at (parameters point at the tier's buffer)
        self._device_views.clear()
        self._host_views.clear()
        if self._tier is _DEVICE:
            self._device_buffer = torch.empty(0, dtype=self.dtype, device=self._device_buffer.device)
        else:
            self._host_buffer = None  # a pinned buffer's ledger entry goes with it (HostArena._collected)
        self._stats.freed(self._tier, self.nbytes)
        self._set_tier(None)

    # ---- the disk tier ([Note: disk families] in runtime/disk_tier.py; the bytes move through its DiskStore) ----
    @property
    def lent(self) -> bool:
        """On DISK with a host buffer lent: :attr:`data` reads the bytes loaded into it."""
        return self._lent is not None

    def place_on_disk(self) -> None:
        """A released chunk whose bytes start on DISK (its file reads as zeros, or the caller writes it)."""
        assert self._tier is None, f"chunk {self.chunk_id} is already allocated on {self._tier}"
        self._stats.allocated(Tier.DISK, self.nbytes)
        self._set_tier(Tier.DISK)

    def leave_host_for_disk(self) -> None:
        """The HOST bytes were written to the chunk's file: free them, the chunk is on DISK now."""
        assert self._tier is Tier.HOST and not self._host_copy, f"chunk {self.chunk_id} is not on the host alone"
        assert self._host_buffer is not None
        host_arena().free(self._host_buffer)
        self._stats.freed(Tier.HOST, self.nbytes)
        self._stats.allocated(Tier.DISK, self.nbytes)
        self._set_tier(Tier.DISK)

    def lend(self, buffer: torch.Tensor) -> None:
        """Lend a DISK chunk the host ``buffer`` (``capacity`` elements of its dtype) its bytes were read into."""
        assert self._tier is Tier.DISK and self._lent is None, f"chunk {self.chunk_id}: lend on {self._tier}"
        assert buffer.numel() == self.capacity and buffer.dtype == self.dtype
        self._lent = buffer

    def take_back(self) -> torch.Tensor:
        """End the loan of :meth:`lend`; returns the buffer."""
        buffer = self._lent
        assert buffer is not None, f"chunk {self.chunk_id} has no host buffer lent"
        self._lent = None
        return buffer

    def _set_tier(self, tier: Tier | None) -> None:
        if self.kind is ChunkKind.PARAM:  # counted for the residency's prefetch (nothing to bring without one)
            self._stats.param_chunks_on_host += (tier is Tier.HOST) - (self._tier is Tier.HOST)
        self._tier = tier

    def _storage_for(self, tier: Tier, *, allocate: bool) -> torch.Tensor:
        with _ordinary_tensors():  # buffers made in the user's inference mode would refuse in-place writes after it
            return self._storage_for_tier(tier, allocate=allocate)

    def _storage_for_tier(self, tier: Tier, *, allocate: bool) -> torch.Tensor:
        if tier is Tier.DEVICE:
            buf = self._device_buffer
        else:  # pinned on CUDA, accounted as held: [Note: pinned memory] in pinned.py
            if self._host_buffer is None:
                self._host_buffer = host_arena().unbacked(self.capacity, self.dtype, pin=self._pin_host)
            return host_arena().back(self._host_buffer, self.capacity) if allocate else self._host_buffer
        return backed(buf, self.capacity) if allocate else buf

    def __repr__(self) -> str:
        tier = self._tier.value if self._tier else "released"
        return (
            f"Chunk(id={self.chunk_id}, kind={self.kind.value}, dtype={self.dtype}, capacity={self.capacity}, {tier})"
        )
