"""The disk tier of the chunks: which families keep their optimizer side on disk, and lending them host buffers.

[Note: disk families]
When ``disk_path`` is set and the host budget cannot hold the optimizer side of every family whose optimizer
steps on the host, setup picks whole families (:func:`~lightning_pstar.planning.disk.plan_disk_tier`, shared with
the capacity planner: the last trainable families this rank owns first, until the host need fits; every family
moves the same bytes per element per step, so the order is the only choice) whose fp32 master (mixed
precision), ``exp_avg`` and ``exp_avg_sq`` chunks live in files of a
:class:`~lightning_pstar.runtime.disk.DiskStore` (keys ``f<family_id>.<kind>``). Their param chunk and fp32
GRAD chunk never go to disk: in 32-true the param chunk is the master and stays in memory.

A chunk on :attr:`~lightning_pstar.runtime.state.Tier.DISK` has no storage of its own. A reader (the optimizer
step, a state dict, the weight restored from the master after a gradient) borrows one of a few page-aligned host
buffer sets that :class:`DiskTier` owns for the run's whole life (:meth:`DiskTier.loaded`): the chunks' bytes are
read into them and lent to the chunks (:meth:`~lightning_pstar.runtime.chunk.Chunk.lend`), so the reader runs the
very code and kernels it runs on a host chunk, and the arithmetic is bitwise the same. A writer's loan ends with
the bytes written back before the buffers are handed on; a reader's ends without a write. The buffer sets and the
store's staging arena are held back from the host budget for the whole run (``Residency.host_scratch_bytes``),
so the host account never counts a loaded family twice and never refuses a load.

While a disk family's gradient is in its param slot (mixed precision, between its backward and its step), its
parameter cannot point at the fp32 master (on disk): it keeps pointing at the slot and is *parked* ([Note: parked
parameters] in ``runtime/parked.py``), so a read of the weight in that window fails loudly instead of reading the
gradient. The step (or ``zero_grad``) writes the weight back and unparks it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

from lightning_pstar.config import MemoryConfig
from lightning_pstar.planning.disk import (
    DISK_DEPTH,
    DISK_THREADS,
    DiskPlan,
    buffer_set_bytes,
    choose_disk_families,
    disk_block_bytes,
    disk_buffer_bytes,
    disk_bytes_per_element,
    plan_disk_tier,
)
from lightning_pstar.runtime.aligned import aligned_empty
from lightning_pstar.runtime.chunk import Chunk, ChunkKind
from lightning_pstar.runtime.disk import DiskStats, DiskStore
from lightning_pstar.runtime.family import ChunkFamily
from lightning_pstar.runtime.state import Tier

__all__ = [
    "DISK_DEPTH",
    "DISK_KINDS",
    "DISK_THREADS",
    "DiskPlan",
    "DiskTier",
    "choose_disk_families",
    "disk_loaded",
    "disk_one_at_a_time",
    "disk_block_bytes",
    "disk_buffer_bytes",
    "disk_bytes_per_element",
    "open_disk_tier",
    "plan_disk_tier",
]

log = logging.getLogger(__name__)

DISK_KINDS = (ChunkKind.MASTER, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ)
"""The chunk kinds a disk family keeps on disk (never PARAM, never GRAD)."""


def open_disk_tier(plan: DiskPlan, memory: MemoryConfig, *, mixed: bool, device: torch.device) -> DiskTier:
    """The disk tier of ``plan``: its store under ``memory.disk_path`` (the run directory is created now)."""
    assert memory.disk_path is not None
    store = DiskStore(
        memory.disk_path,
        limit_bytes=memory.disk_limit_bytes,
        threads=DISK_THREADS,
        block_bytes=disk_block_bytes(plan.capacity),
        device=device,
    )
    log.info("PatrickStar: %d families keep their optimizer side on disk in %s", len(plan.family_ids), store.path)
    return DiskTier(store, plan.family_ids, capacity=plan.capacity, kinds=3 if mixed else 2, depth=plan.depth)


class DiskTier:
    """The disk families of one run: their files (``store``) and the host buffer sets lent to them.

    Args:
        store: the run's :class:`~lightning_pstar.runtime.disk.DiskStore` (closed by :meth:`close`).
        family_ids: the families whose optimizer side is on disk.
        capacity: elements of the largest of those families' chunks.
        kinds: how many of a family's chunks are on disk at most (3: master and two Adam states).
        depth: buffer sets (families loaded at once: 1 for the serial step).
    """

    def __init__(self, store: DiskStore, family_ids: Sequence[int], *, capacity: int, kinds: int, depth: int) -> None:
        self.store = store
        self.family_ids = frozenset(family_ids)
        self.capacity = capacity
        self.kinds = kinds
        self._free: list[list[torch.Tensor]] = [
            [aligned_empty(capacity * 4).view(torch.float32) for _ in range(kinds)] for _ in range(depth)
        ]
        self._index = {kind: i for i, kind in enumerate(DISK_KINDS[len(DISK_KINDS) - kinds :])}  # kind -> buffer
        self._loans: dict[int, list[torch.Tensor]] = {}  # family id -> the buffer set lent to its chunks
        self._setup_family: ChunkFamily | None = None  # held (dirty) across setup's slot fills: :meth:`hold_for_setup`
        self._fresh: set[str] = set()  # keys never written: their bytes are zeros, a load zeroes instead of reading
        self.last_iteration: DiskStats | None = None  # what the last whole iteration after the warm-up moved

    @property
    def host_bytes(self) -> int:
        """Host bytes the tier holds for the run's life: the buffer sets and the store's staging arena."""
        depth = len(self._free) + len(self._loans)
        return buffer_set_bytes(capacity=self.capacity, kinds=self.kinds) * depth + self.store.staging_bytes

    def holds(self, family: ChunkFamily) -> bool:
        """Whether ``family``'s optimizer side is on disk."""
        return family.family_id in self.family_ids

    @staticmethod
    def key(chunk: Chunk) -> str:
        return f"f{chunk.chunk_id}.{chunk.kind.value}"

    def place(self, chunk: Chunk) -> None:
        """Give a new optimizer-side chunk its file (allocated in full now; it reads as zeros)."""
        self.store.reserve(self.key(chunk), chunk.capacity, chunk.dtype)
        self._fresh.add(self.key(chunk))
        chunk.place_on_disk()

    def chunks_of(self, family: ChunkFamily, kinds: Sequence[ChunkKind] = DISK_KINDS) -> list[Chunk]:
        return [c for k, c in family.chunks.items() if k in kinds and c.tier is Tier.DISK]

    # ---- loans ---------------------------------------------------------------------------------------------
    def load(self, family: ChunkFamily, kinds: Sequence[ChunkKind] = DISK_KINDS) -> list[Chunk]:
        """Read ``family``'s disk chunks of ``kinds`` into a buffer set and lend it to them; returns the chunks
        lent now (those already lent are left as they are)."""
        if self._setup_family is not None and self._setup_family is not family:
            self.flush_setup()
        chunks = [c for c in self.chunks_of(family, kinds) if not c.lent]
        if not chunks:
            return []
        buffers = self._loans.get(family.family_id)
        if buffers is None:
            if not self._free:
                raise RuntimeError(
                    f"PatrickStar internal error: the disk tier has no host buffer left for family"
                    f" {family.family_id} ({len(self._loans)} families loaded). HINT: please report this."
                )
            buffers = self._loans[family.family_id] = self._free.pop()
        futures = [self._read(chunk, buffers[self._index[chunk.kind]][: chunk.capacity]) for chunk in chunks]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.exception()  # every read is over before the buffers are handed on
            if not any(c.lent for c in self.chunks_of(family)):
                self._free.append(self._loans.pop(family.family_id))
            raise
        for chunk in chunks:
            chunk.lend(buffers[self._index[chunk.kind]][: chunk.capacity])
        return chunks

    def unload(self, family: ChunkFamily, chunks: Sequence[Chunk], *, write: bool) -> None:
        """End the loans of ``chunks`` (written back first when ``write``); the set is free once none is lent."""
        try:
            if write:
                self._fresh.difference_update(self.key(c) for c in chunks)
                futures = [self.store.write(self.key(c), c.data) for c in chunks]
                for future in futures:
                    future.result()
        finally:
            for chunk in chunks:
                chunk.take_back()
            if not any(c.lent for c in self.chunks_of(family)):
                buffers = self._loans.pop(family.family_id, None)
                if buffers is not None:
                    self._free.append(buffers)

    # ---- the pipelined step ([Note: the step pipeline] in runtime/pipeline.py) -------------------------------
    @property
    def free_sets(self) -> int:
        """Buffer sets not lent: how many more families :meth:`begin_load` can take now."""
        return len(self._free)

    def begin_load(self, family: ChunkFamily) -> list[Future[None]]:
        """The calling thread: lend ``family``'s disk chunks a buffer set and start reading them into it; the
        chunks' bytes are there once every returned future is done (the job's Adam stage waits for them)."""
        self.flush_setup()
        chunks = [c for c in self.chunks_of(family) if not c.lent]
        assert chunks and self._free and family.family_id not in self._loans, "begin_load: nothing to lend"
        buffers = self._loans[family.family_id] = self._free.pop()
        futures = []
        for chunk in chunks:
            buf = buffers[self._index[chunk.kind]][: chunk.capacity]
            futures.append(self._read(chunk, buf))
            chunk.lend(buf)
            self._fresh.discard(self.key(chunk))  # the job writes it back
        return futures

    def _read(self, chunk: Chunk, buf: torch.Tensor) -> Future[None]:
        """Start reading ``chunk``'s file into ``buf`` (a file never written: zeroes ``buf``, done at once)."""
        key = self.key(chunk)
        if key in self._fresh:
            buf.zero_()
            done: Future[None] = Future()
            done.set_result(None)
            return done
        return self.store.read(key, buf)

    def begin_write(self, family: ChunkFamily) -> list[Future[None]]:
        """A worker: start writing ``family``'s lent chunks back (no bookkeeping: the store is thread-safe)."""
        return [self.store.write(self.key(c), c.data) for c in self.chunks_of(family) if c.lent]

    def end_load(self, family: ChunkFamily, pending: Sequence[Future[None]]) -> None:
        """The calling thread: wait for ``pending`` transfers, end the loans and free the set; raises the first
        transfer's error (the loans end anyway)."""
        errors = [f.exception() for f in pending]
        for chunk in self.chunks_of(family):
            if chunk.lent:
                chunk.take_back()
        buffers = self._loans.pop(family.family_id, None)
        if buffers is not None:
            self._free.append(buffers)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    @contextmanager
    def loaded(
        self, family: ChunkFamily, *, write: bool, kinds: Sequence[ChunkKind] = DISK_KINDS
    ) -> Iterator[list[Chunk]]:
        """``family``'s disk chunks of ``kinds`` lent host buffers inside the block (re-entrant: chunks lent
        already stay lent after it); written back at its end when ``write`` (also when the block raises: a
        half-done write-back is worse than none only if the bytes are not the chunk's, and they are)."""
        chunks = self.load(family, kinds)
        try:
            yield chunks
        finally:
            if chunks:
                self.unload(family, chunks, write=write)

    @contextmanager
    def one_at_a_time(
        self, *, write: bool, kinds: Sequence[ChunkKind] = DISK_KINDS
    ) -> Iterator[Callable[[ChunkFamily], None]]:
        """Inside the block, ``need(family)`` loads ``family``'s disk chunks, ending the loan of the family needed
        before (written back when ``write``): for readers that go through records family after family."""
        current: list[tuple[ChunkFamily, list[Chunk]]] = []

        def need(family: ChunkFamily) -> None:
            if current and current[0][0] is family:
                return
            if current:
                self.unload(*current.pop(), write=write)
            if self.holds(family):
                current.append((family, self.load(family, kinds)))

        try:
            yield need
        finally:
            if current:
                self.unload(*current.pop(), write=write)

    def hold_for_setup(self, family: ChunkFamily) -> None:
        """Setup writes ``family``'s master slot by slot: keep it loaded until another family (or
        :meth:`flush_setup`) needs the buffers, so each family is read and written once."""
        if self._setup_family is family:
            return
        self.flush_setup()
        if self.load(family, (ChunkKind.MASTER,)):
            self._setup_family = family

    def flush_setup(self) -> None:
        """Write back the family :meth:`hold_for_setup` kept loaded."""
        family, self._setup_family = self._setup_family, None
        if family is not None:
            self.unload(family, [c for c in self.chunks_of(family) if c.lent], write=True)

    def end_iteration(self) -> None:
        """An iteration after the warm-up ended: keep its counts (the report's per-iteration figures)."""
        self.last_iteration = self.store.reset_iteration()

    def close(self) -> None:
        """Remove the run's files and directory (idempotent)."""
        self._setup_family = None
        self.store.close()


# ---- readers of a tier that may not exist (no family on disk) -------------------------------------------------
def disk_loaded(
    disk: DiskTier | None, family: ChunkFamily, *, write: bool, kinds: Sequence[ChunkKind] = DISK_KINDS
) -> AbstractContextManager[object]:
    """Inside the block ``family``'s chunks on disk (if any) are read into host buffers; written back at its end
    when ``write`` (:meth:`DiskTier.loaded`)."""
    return disk.loaded(family, write=write, kinds=kinds) if disk is not None and disk.holds(family) else nullcontext()


def disk_one_at_a_time(
    disk: DiskTier | None, *, write: bool, kinds: Sequence[ChunkKind] = DISK_KINDS
) -> AbstractContextManager[Callable[[ChunkFamily], None]]:
    """:meth:`DiskTier.one_at_a_time`, or a ``need`` that does nothing without a disk tier."""
    return disk.one_at_a_time(write=write, kinds=kinds) if disk is not None else nullcontext(_no_disk_need)


def _no_disk_need(family: ChunkFamily) -> None:
    """``need`` without a disk tier: nothing to load."""
