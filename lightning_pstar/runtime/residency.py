"""Residency: which tier holds each chunk's bytes, within the two budgets.

:class:`Residency` allocates chunks, fetches param chunks to the device, evicts the victims the placement
policy chooses, prefetches what the trace says comes next, checks the host budget before every byte lands
there, and keeps every parameter pointing at its slot in the buffer of the tier that holds its chunk
([Note: storage identity] in ``chunk.py``). Policies decide; this object performs the moves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from lightning_pstar.planning.requirements import MemoryBudgetError
from lightning_pstar.report import format_bytes
from lightning_pstar.runtime.chunk import Chunk, ChunkKind, TransferStats
from lightning_pstar.runtime.disk_tier import DISK_KINDS, DiskTier
from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
from lightning_pstar.runtime.inflight import EvictionsInFlight
from lightning_pstar.runtime.new_storage import keep_new_storage, moved
from lightning_pstar.runtime.parked import park, unpark
from lightning_pstar.runtime.pinned import host_arena
from lightning_pstar.runtime.placement import PlacementPolicy
from lightning_pstar.runtime.prefetch import Prefetcher
from lightning_pstar.runtime.state import Tier
from lightning_pstar.runtime.yardstick import Bounds

__all__ = ["Residency"]

# module-level: an Enum member read through its class costs a lookup, and these are read per parameter
_DEVICE, _PARAM, _MASTER = Tier.DEVICE, ChunkKind.PARAM, ChunkKind.MASTER

# [Note: stationary chunks]
# On one rank, once the warm-up is over, every param chunk is often on the device for good: without a device
# budget (the simulated device) nothing is ever evicted, and with one the chunks may fit beside the warm-up's
# peak of non-model memory at every moment. Then the per-module verbs have nothing to decide: no fetch, no
# room to make, no prefetch, no trace to follow for the placement. :meth:`Residency.nothing_moves` says so at
# the start of every training micro-batch (``ChunkManager.stationary``), and for that micro-batch
#
# - a module's forward only moves its slots' states (the transition guard still runs, and a mixed-precision
#   forward's in-place writes still reach the fp32 masters);
# - no backward hooks are registered (pre-backward and post-backward only make chunks resident again and let
#   them move): the slots wait in ``HOLD_AFTER_FWD`` and go to ``HOLD_AFTER_BWD`` when their gradient lands, or
#   to ``HOLD`` when the backward is finished, which the transition table allows from either state;
# - the memory report's per-moment chunk bytes are what the device holds at the step (nothing moved).
#
# The first micro-batch after anything moved a chunk (an evaluation with a budget, a load) is stationary only if
# the check passes again, and an access finds a param chunk on the host before it takes the short path.
# Several ranks gather and release chunks every iteration: never stationary.


class Residency:
    """Places the chunks of one model's families between DEVICE and HOST."""

    def __init__(
        self,
        families: list[ChunkFamily],
        *,
        device: torch.device,
        device_budget: int | None,
        host_budget: int,
        policy: PlacementPolicy,
        min_device_bytes: int,
        owns: Callable[[ChunkFamily], bool],
    ) -> None:
        self.families = families
        self.device = device
        self.device_budget = device_budget
        self.host_budget = host_budget
        self.policy = policy
        self.min_device_bytes = min_device_bytes  # one module's chunks: the least room chunks ever get
        self.owns = owns
        self.stats = TransferStats()
        self.optimizer_tier = Tier.DEVICE  # where optimizer-side chunks start (set by the manager at setup)
        self.hybrid_optimizer = True  # placement.optimizer="auto": the warm-up's end moves families that fit
        # families whose param chunk must stay where it is: send buffers of in-flight gathers (sharding)
        self.pinned: set[int] = set()
        # families whose host-side step is in flight: their param chunk stays, their staging copy is kept
        # ([Note: the step pipeline] in runtime/pipeline.py)
        self.stepping: set[int] = set()
        self.finish_stepping: Callable[[], None] | None = None  # ends them (the manager's), when room is short
        self.repoint = False  # parameters follow their chunk's moves (off while materialising)
        self._tick = 0
        self._copy_stream: torch.cuda.Stream | None = None  # CUDA: every fetch and eviction copies on it
        self.evicting = EvictionsInFlight()  # CUDA: evictions whose copy has not ended (their blocks are held)
        self.prefetcher = Prefetcher(self)  # [Note: fetch and prefetch] in lookahead.py
        self.setup_peak_device_bytes = 0  # chunks plus materialisation temporaries, at their highest in setup
        # [Note: clean evictions] in chunk.py: fetched param chunks keep their host bytes while the host budget
        # allows, so that evicting them again copies nothing
        self.clean_evictions = True
        self.step_open = False  # an optimizer step runs: fetches keep no host copy (it writes the chunks)
        # [Note: parameters given new storage] in new_storage.py: values user code gave parameters that a fetch or an
        # eviction re-pointed before they were adopted (record index -> record, value), and the addresses of storages
        # the engine points parameters at outside the chunks (several ranks: the NaN views of released chunks)
        self.kept_values: dict[int, tuple[ParamRecord, torch.Tensor]] = {}
        self.shared_ptrs: Callable[[], set[int]] = set
        self._param_versions: dict[int, tuple[int, ...]] = {}  # family -> its parameters' versions at fetch
        # bytes copied by chunk moves: at the start of the current iteration, and in the last whole one
        self._iteration_mark: int | None = None
        self._stepped_since_mark = False
        self.last_iteration_moved_bytes: int | None = None
        self.iterations_measured = 0
        # what the warm-up's optimizer step found (the yardstick's model of who writes what) and the yardstick
        self.warmup_grad_in_slot: frozenset[int] = frozenset()  # families whose param slots held gradients
        self.warmup_stepped: frozenset[int] = frozenset()  # families the step updated
        self.bounds: Bounds | None = None
        # the optimizer step's temporaries on the host, held back from the host budget: [Note: the host need]
        self.host_scratch_bytes = 0
        self.disk: DiskTier | None = None  # the disk families and their files: [Note: disk families] in disk_tier.py

    # ---- chunks ------------------------------------------------------------------------------------------
    def new_chunk(self, family: ChunkFamily, kind: ChunkKind, dtype: torch.dtype) -> Chunk:
        chunk = Chunk(
            chunk_id=family.family_id,
            kind=kind,
            dtype=dtype,
            capacity=family.capacity,
            slots=family.slots,
            device=self.device,
            stats=self.stats,
        )
        family.chunks[kind] = chunk
        return chunk

    def allocate_optimizer_side(self, chunk: Chunk) -> None:
        """Give an fp32 master/gradient/state chunk storage on the optimizer's tier (a disk family's master and
        states: their file, [Note: disk families] in ``disk_tier.py``)."""
        disk = self.disk
        if disk is not None and chunk.kind in DISK_KINDS and chunk.chunk_id in disk.family_ids:
            disk.place(chunk)
            return
        if self.optimizer_tier is Tier.DEVICE:
            self.ensure_device_room(chunk.nbytes, protect=set())
        else:
            self.check_host_room(chunk.nbytes, chunk=chunk)
        chunk.allocate(self.optimizer_tier)

    def add_optimizer_chunks(self, families: Sequence[ChunkFamily], kinds: Sequence[ChunkKind]) -> None:
        """Zeroed fp32 chunks of ``kinds`` (optimizer states, the GRAD chunk) for each family lacking them."""
        for family in families:
            for kind in kinds:
                if kind not in family.chunks:
                    self.allocate_optimizer_side(self.new_chunk(family, kind, torch.float32))

    def allocate_on_host(self, chunk: Chunk) -> None:
        self.check_host_room(chunk.nbytes, chunk=chunk)
        chunk.allocate(Tier.HOST)

    def device_used(self) -> int:
        return self.stats.per_tier_bytes[Tier.DEVICE]

    def chunk_room(self) -> int | None:
        """Bytes chunks may occupy on the device now (None: unlimited)."""
        return self.policy.chunk_room(self.device_budget, self.min_device_bytes)

    # ---- parameters --------------------------------------------------------------------------------------
    def point_at_chunk(self, record: ParamRecord) -> None:
        """Point the parameter at its slot in the buffer of the tier that holds its chunk.

        See [Note: storage identity] in ``chunk.py``: parameters move between the two storages of their
        chunk only when the chunk moves, which never happens while a module computes with it. While the
        param slot holds the gradient (mixed precision, between backward and the step) the parameter
        points at its fp32 master instead, so that reading it gives the weight, never the gradient.
        """
        if moved(record):
            keep_new_storage(self, record)  # [Note: parameters given new storage] in new_storage.py
        chunks = record.family.chunks
        chunk = chunks[_PARAM]
        if record.grad_in_param_slot:
            chunk = chunks.get(_MASTER, chunk)
        if self.disk is not None:  # a master on disk: the parameter stays at its slot, parked ([Note: disk families])
            unpark(record.param)
            if chunk.tier is Tier.DISK:
                view = chunks[_PARAM].buffer_view(record.slot)
                record.param.data = view
                record.pointed, record.strided = view.data_ptr(), False  # [Note: parameters given new storage]
                park([record.param], [record.names[0]])
                return
        if chunk.pending and chunk.tier is _DEVICE:  # never into bytes still being copied: once the copy is waited on
            chunk.on_landed(lambda: self._point_family(record.family))  # ([Note: fetch and prefetch], lookahead.py)
            return
        view = chunk.buffer_view(record.slot)  # taken once per buffer: [Note: cached views]
        record.param.data = view
        record.pointed, record.strided = view.data_ptr(), False  # [Note: parameters given new storage]

    def move_param_chunk(self, family: ChunkFamily, tier: Tier, *, asynchronous: bool = False) -> None:
        """Move ``family``'s param chunk to ``tier`` and re-point its parameters there.

        On CUDA a fetch (``asynchronous``: a prefetch, or a demand fetch that waits at once) and every eviction copy
        on the side stream, by the rules of [Note: streams] in ``chunk.py``; the chunk orders its next reader after
        the copy, and the parameters point at a device buffer only once that is done (:meth:`point_at_chunk`). A
        fetch keeps the host bytes when it may, and an eviction whose host copy is still current copies nothing
        ([Note: clean evictions] in ``chunk.py``).
        """
        chunk = family.param_chunk
        if chunk.tier is tier:
            return
        if tier is Tier.HOST:
            if chunk.has_host_copy and self._params_written(family):
                chunk.drop_host_copy()  # a weight was written in place through the parameter itself
            self.check_host_room(0 if chunk.has_host_copy else chunk.nbytes, spare=chunk)
        keep = tier is Tier.DEVICE and self.clean_evictions and not self.step_open
        stream = self.copy_stream() if asynchronous or tier is Tier.HOST else None
        chunk.move_to(tier, stream=stream, keep_host_copy=keep)
        if tier is Tier.HOST:
            if self.prefetcher.ahead.pop(family.family_id, None) is not None:
                self.stats.prefetches_wasted += 1  # prefetched, then evicted before its moment
            event = chunk.copy_event
            if event is not None:  # its device block is reusable once the copy ends
                self.evicting.add(event, chunk.nbytes)
        if self.repoint:  # a fetch in flight: once it is waited on (point_at_chunk)
            self._point_family(family)
        if chunk.has_host_copy:
            self._param_versions[family.family_id] = tuple(r.param._version for r in family.records)

    def _point_family(self, family: ChunkFamily) -> None:
        for record in family.records:
            self.point_at_chunk(record)

    def _params_written(self, family: ChunkFamily) -> bool:
        """Whether a parameter of ``family`` was written in place since its chunk was fetched."""
        before = self._param_versions.get(family.family_id)
        return before is None or before != tuple(r.param._version for r in family.records)

    # ---- host copies ([Note: clean evictions] in chunk.py) -------------------------------------------------
    def open_step(self, *, record: bool = False) -> None:
        """An optimizer step begins: the chunks it writes on the device lose their host copies, and fetches
        keep none until it ends (fused optimizer kernels do not bump version counters). ``record``: the
        warm-up's step, whose gradients tell the yardstick which chunks backward and the step write."""
        if record:
            self.warmup_grad_in_slot = frozenset(
                f.family_id for f in self.families if any(r.grad_in_param_slot for r in f.records)
            )
            self.warmup_stepped = frozenset(f.family_id for f in self.families if f.trainable and f.has_grads())
        self.step_open = True
        for family in self.families:
            chunk = family.chunks.get(ChunkKind.PARAM)
            if chunk is not None and family.trainable and self.optimizer_tier_of(family) is Tier.DEVICE:
                chunk.drop_host_copy()

    def close_step(self) -> None:
        self.step_open = False

    def drop_host_copies(self) -> None:
        """Forget every host copy (weights were loaded or written outside the iteration's paths)."""
        for family in self.families:
            chunk = family.chunks.get(ChunkKind.PARAM)
            if chunk is not None:
                chunk.drop_host_copy()

    def _free_host_copies(self, nbytes: int, spare: Chunk | None) -> None:
        """Drop host copies but ``spare``'s, stale ones first, until ``nbytes`` are free or none is left."""
        held = [
            f.param_chunk
            for f in self.families
            if ChunkKind.PARAM in f.chunks
            and f.param_chunk.has_host_copy
            and f.param_chunk is not spare
            and f.family_id not in self.stepping
        ]
        held.sort(key=lambda c: (c.host_copy_current, -c.chunk_id))
        freed = 0
        for chunk in held:
            if freed >= nbytes:
                return
            chunk.drop_host_copy()
            freed += chunk.nbytes

    # ---- the host-side step's staging ([Note: the step pipeline] in runtime/pipeline.py) -----------------------
    def stage_host(self, family: ChunkFamily) -> tuple[torch.Tensor, bool]:
        """The host buffer a host-side step of ``family`` copies its param chunk into (within the host budget),
        and whether it already holds the device bytes. The family is ``stepping`` until :meth:`unstage`."""
        chunk = family.param_chunk
        if chunk.has_host_copy and chunk.tier is Tier.DEVICE and self._params_written(family):
            chunk.drop_host_copy()  # a weight was written in place since the last step: the host copy is stale
        if not chunk.has_host_copy:
            self.check_host_room(chunk.nbytes, spare=chunk)
        staged = chunk.stage_host_copy()
        self.stepping.add(family.family_id)
        if staged[1]:  # the host copy is current: the step's first stage copies nothing (as a clean move)
            self.stats.clean_bytes += chunk.nbytes
        else:  # the step's first stage copies it
            self.stats.step_d2h_bytes += chunk.nbytes
            self.stats.d2h_bytes += chunk.nbytes
            self.stats.moved_bytes += chunk.nbytes  # what placing the step on the host costs, as a move would
        return staged

    def unstage(self, family: ChunkFamily) -> None:
        """The host-side step of ``family`` is done: its host buffer is a current copy of the device bytes."""
        self.stepping.discard(family.family_id)
        chunk = family.param_chunk
        if self.clean_evictions:
            chunk.adopt_host_copy()
        else:  # no host copies are kept ([Note: clean evictions] in chunk.py)
            chunk.drop_host_copy()
        self.stats.step_h2d_bytes += chunk.nbytes
        self.stats.h2d_bytes += chunk.nbytes
        self.stats.moved_bytes += chunk.nbytes
        self._param_versions[family.family_id] = tuple(r.param._version for r in family.records)

    def unstage_to_host(self, family: ChunkFamily) -> None:
        """The host-side step of ``family`` is done but its copy back did not run: the host buffer holds the new
        bytes, and the param chunk now lives there (its device storage is freed, as after a serial host step)."""
        self.stepping.discard(family.family_id)
        family.param_chunk.settle_on_host()
        self._param_versions.pop(family.family_id, None)

    # ---- iterations --------------------------------------------------------------------------------------
    def note_step(self) -> None:
        self._stepped_since_mark = True

    def begin_batch(self, *, warmed_up: bool) -> None:
        """A training micro-batch starts (or training ends): an iteration closes after a step, once warmed up."""
        if not warmed_up:
            self._stepped_since_mark = False
            return
        if self._iteration_mark is None:
            self._iteration_mark = self.stats.moved_bytes  # the first iteration after the warm-up starts
            if self.disk is not None:
                self.disk.store.reset_iteration()
        elif self._stepped_since_mark:
            if self.disk is not None:
                self.disk.end_iteration()
            self.last_iteration_moved_bytes = self.stats.moved_bytes - self._iteration_mark
            self._iteration_mark = self.stats.moved_bytes
            self.iterations_measured += 1
        self._stepped_since_mark = False

    def copy_stream(self) -> torch.cuda.Stream | None:
        """The side stream of every asynchronous copy (CUDA only; None on any other device)."""
        if self.device.type != "cuda":
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return self._copy_stream

    # ---- budgets -----------------------------------------------------------------------------------------
    def ensure_device_room(self, nbytes: int, *, protect: set[int]) -> None:
        """Evict the policy's victims until ``nbytes`` more fit the room chunks have now."""
        room = self.chunk_room()
        if room is None:
            return
        evicting = self.evicting
        missing = self.device_used() + evicting.held() + nbytes - room
        if missing > 0 and evicting.held():  # blocks of evictions in flight: reusable once their copies end
            missing -= evicting.settle(missing)
        if missing <= 0:
            return
        asked = protect
        protect = protect | self.pinned | self.stepping
        candidates = [
            f.param_chunk
            for f in self.families
            if f.family_id not in protect
            and ChunkKind.PARAM in f.chunks
            and f.param_chunk.tier is Tier.DEVICE
            and self.owns(f)  # remote chunks are released, never evicted
        ]
        # chunks prefetched for a later moment count as kept until it ([Note: fetch and prefetch] in lookahead.py)
        ahead = self.prefetcher.ahead
        victims = self.policy.victims([c for c in candidates if c.chunk_id not in ahead], missing)
        if sum(v.nbytes for v in victims) < missing and ahead:
            victims = self.policy.victims(candidates, missing)
        if sum(v.nbytes for v in victims) < missing and self.stepping and self.finish_stepping is not None:
            self.finish_stepping()  # families whose step is in flight may be evicted once it is done
            self.ensure_device_room(nbytes, protect=asked)
            return
        if sum(v.nbytes for v in victims) < missing:
            in_use = [f.family_id for f in self.families if f.family_id in protect]
            raise MemoryBudgetError(
                f"cannot make room for {format_bytes(nbytes, exact=True)} on the device:"
                f" {format_bytes(self.device_used(), exact=True)} of the {format_bytes(room, exact=True)} chunks"
                f" may use now are held by chunks in use (families {in_use}) or not evictable. HINT: raise"
                " device_memory_limit or lower chunk_size."
            )
        for victim in victims:
            self.move_param_chunk(self.families[victim.chunk_id], Tier.HOST)
            self.stats.evictions += 1
        if evicting.held():  # the caller allocates next: the victims' blocks must be reusable first
            evicting.settle(self.device_used() + evicting.held() + nbytes - room)

    def check_host_room(self, nbytes: int, *, spare: Chunk | None = None, chunk: Chunk | None = None) -> None:
        """Raise unless ``nbytes`` more (for ``chunk``, or ``spare``) fit the host budget, after dropping host
        copies kept for clean evictions (but ``spare``'s: the chunk about to leave the device through its copy).
        Pinned blocks count as torch's host allocator holds them: [Note: pinned memory]."""
        arena = host_arena()
        owner = chunk if chunk is not None else spare
        buf = owner.host_buffer if owner is not None else None
        need = arena.added_bytes(nbytes, buf)
        held = self.stats.host_copy_bytes
        used = self.stats.per_tier_bytes[Tier.HOST] + held + arena.extra_bytes() + self.host_scratch_bytes
        if used + need > self.host_budget and self.stats.host_copy_bytes:
            self._free_host_copies(used + need - self.host_budget, spare)
            need = arena.added_bytes(nbytes, buf)  # a dropped pinned copy leaves an idle block it may reuse
            held = self.stats.host_copy_bytes
            used = self.stats.per_tier_bytes[Tier.HOST] + held + arena.extra_bytes() + self.host_scratch_bytes
        if used + need > self.host_budget and arena.idle_bytes():
            arena.release()  # idle cached blocks (after evictions, moves) go back to the driver before refusing
            need = arena.added_bytes(nbytes, buf)
            held = self.stats.host_copy_bytes
            used = self.stats.per_tier_bytes[Tier.HOST] + held + arena.extra_bytes() + self.host_scratch_bytes
        if used + need > self.host_budget:
            raise MemoryBudgetError(
                f"host budget exceeded: {format_bytes(used, exact=True)} in use (of which"
                f" {format_bytes(self.host_scratch_bytes, exact=True)} held for the optimizer step's temporaries),"
                f" {format_bytes(nbytes, exact=True)} more needed, budget {format_bytes(self.host_budget, exact=True)}."
                " The setup check counts every chunk that can be on the host at once, so this is a bug in its"
                " figures: please report it. HINT: raise host_memory_limit."
            )

    # ---- access ------------------------------------------------------------------------------------------
    def nothing_moves(self, peak_non_model: int) -> bool:
        """Whether no chunk can move during a training iteration, so the per-module verbs may skip what only moves
        need ([Note: stationary chunks]): every param chunk is on the device with no copy in
        flight, every trainable family's optimizer steps there (a host step moves its param chunk), and without
        a budget, or with the chunks already on the device within the least room the
        placement gives them at any moment of the trace (the budget less the warm-up's peak of non-model memory,
        and the static policy's share), no fetch, eviction or prefetch would ever run."""
        if self.stats.param_chunks_on_host:
            return False
        for family in self.families:
            chunk = family.chunks.get(_PARAM)
            if chunk is None or not chunk.ready:
                return False
            if family.trainable and self.optimizer_tier_of(family) is not _DEVICE:
                return False  # its step moves the param chunk to the host and back
        budget = self.device_budget
        if budget is None:
            return True
        room = self.chunk_room()
        least = budget - peak_non_model if room is None else min(room, budget - peak_non_model)
        return self.device_used() <= least

    def fetch(self, family: ChunkFamily, *, protect: set[int]) -> None:
        """Make ``family``'s param chunk resident on DEVICE, evicting others if the budget requires."""
        chunk = family.param_chunk
        ahead = self.prefetcher.ahead
        if ahead and ahead.pop(family.family_id, None) is not None:
            self.stats.prefetch_hits += 1
        if self.device_budget is None and chunk.ready:
            return  # resident, and without a budget nothing is ever evicted: the policy's use record is unread
        self._tick += 1
        self.policy.touch(chunk, self._tick)
        if chunk.tier is Tier.DEVICE:
            chunk.wait()  # a prefetch may still be in flight: the compute stream waits on its event
            return
        # a demand fetch: the module waits for it (a stall); on the copy stream all the same, so that the CPU does
        # not synchronise and the compute stream waits on its event ([Note: fetch and prefetch] in lookahead.py)
        self.stats.demand_fetches += 1
        self.ensure_device_room(chunk.nbytes, protect=protect | {family.family_id})
        self.move_param_chunk(family, Tier.DEVICE, asynchronous=True)
        chunk.wait()

    def prefetch(self) -> None:
        """Fetch chunks ahead of their moments ([Note: fetch and prefetch] in lookahead.py)."""
        if self.stats.param_chunks_on_host:  # else every param chunk is on the device: nothing to bring
            self.prefetcher.run()

    @property
    def eviction_waits(self) -> int:
        """CPU waits for an eviction's copy (CUDA: a fetch needed its block)."""
        return self.evicting.waits

    # ---- the optimizer's side (its hybrid plan and report summary: optimizer_side.py) ----------------------
    @staticmethod
    def optimizer_tier_of(family: ChunkFamily) -> Tier:
        """Where ``family``'s optimizer step runs: the tier of its optimizer-side chunks (DISK when any is on disk:
        the step runs on the host, on buffers loaded from disk)."""
        tier = None
        for kind, chunk in family.chunks.items():
            if kind is not ChunkKind.PARAM and chunk.tier is not None:
                if chunk.tier is Tier.DISK:
                    return Tier.DISK
                tier = tier or chunk.tier
        return tier or Tier.DEVICE

    def storage_ptrs(self, chunks: Sequence[Chunk]) -> set[int]:
        """Addresses of the chunks' storages now, on both tiers (the tracer tells model data from the rest)."""
        ptrs: set[int] = set()
        for chunk in chunks:
            for buf in (chunk.device_buffer, chunk.host_buffer):
                if buf is not None:
                    ptr = buf.untyped_storage().data_ptr()
                    if ptr:
                        ptrs.add(ptr)
        return ptrs
