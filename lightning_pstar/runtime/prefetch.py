"""The prefetcher: starts param-chunk fetches ahead of the moments that need them, for one residency.

What to fetch and which chunks to evict early for it is decided by :func:`~lightning_pstar.runtime.lookahead.
plan_prefetch` (pure, over the trace); this object builds its view of the residency, performs the plan through the
residency's moves and keeps the bookkeeping: which prefetched chunks are still ahead of their moment (the tide
evicts them last) and the counters of the memory report. See [Note: fetch and prefetch] in ``lookahead.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from lightning_pstar.runtime.chunk import ChunkKind, TransferStats
from lightning_pstar.runtime.family import ChunkFamily
from lightning_pstar.runtime.inflight import EvictionsInFlight
from lightning_pstar.runtime.lookahead import LookaheadState, plan_prefetch
from lightning_pstar.runtime.placement import AutoPlacement, PlacementPolicy
from lightning_pstar.runtime.state import ChunkState, Tier
from lightning_pstar.runtime.tracer import MomentKind, Trace

__all__ = ["PREFETCH_MODES", "Prefetcher"]

PREFETCH_MODES = ("lookahead", "next", "off")
"""``lookahead``: by bytes along the trace (the default); ``next``: the next moment's chunks into free room only (the
rule before it, kept to compare against); ``off``: every fetch on demand."""

_PARAM, _DEVICE, _HOST = ChunkKind.PARAM, Tier.DEVICE, Tier.HOST


class _Mover(Protocol):
    """What the prefetcher reads and calls of its residency (``runtime/residency.py``'s ``Residency``; a protocol,
    so that this module does not import the residency that imports it)."""

    families: list[ChunkFamily]
    device_budget: int | None
    policy: PlacementPolicy
    min_device_bytes: int
    owns: Callable[[ChunkFamily], bool]
    stats: TransferStats
    pinned: set[int]
    stepping: set[int]
    evicting: EvictionsInFlight

    def device_used(self) -> int: ...

    def chunk_room(self) -> int | None: ...

    def move_param_chunk(self, family: ChunkFamily, tier: Tier, *, asynchronous: bool = False) -> None: ...


class Prefetcher:
    """Prefetches for one :class:`~lightning_pstar.runtime.residency.Residency` (it performs every move)."""

    def __init__(self, residency: _Mover) -> None:
        self.residency = residency
        self._mode = "lookahead"
        self.ahead: dict[int, int] = {}  # prefetched family -> the trace moment it is due (until it is used)
        self._owns_all: bool | None = None  # one rank owns every family (the lookahead plans only then)
        # per trace and budget (fixed after the warm-up): families, rooms and stops of every moment, chunk sizes
        self._static: tuple[int, int, Sequence[tuple[int, ...]], list[int], frozenset[int], dict[int, int]] | None
        self._static = None

    @property
    def mode(self) -> str:
        """One of :data:`PREFETCH_MODES` (internal: the tests compare the three)."""
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in PREFETCH_MODES:
            raise ValueError(f"prefetch mode must be one of {list(PREFETCH_MODES)}, got {value!r}")
        self._mode = value

    def run(self) -> None:
        """Prefetch now, as :attr:`mode` says (called after a training moment's own fetches)."""
        if self._mode == "off":
            return
        if self._mode == "lookahead" and self.residency.device_budget is not None:
            state = self._state()
            if state is not None:
                self._perform(state)
                return
        self._next_moment()

    # ---- "next": the previous rule ---------------------------------------------------------------------------
    def _next_moment(self) -> None:
        """The next moment's chunks, when they fit this moment's free room and the next one's, evicting nothing."""
        residency = self.residency
        fids = residency.policy.prefetch()
        if not fids:
            return
        families = residency.families
        wanted = [
            fid for fid in fids if families[fid].param_chunk.tier is not _DEVICE and residency.owns(families[fid])
        ]
        if not wanted:
            return
        room = residency.chunk_room()
        room_next = residency.policy.next_chunk_room(residency.device_budget, residency.min_device_bytes)
        if room is not None and room_next is not None:
            room = min(room, room_next)
        for fid in wanted:
            chunk = families[fid].param_chunk
            if room is not None and residency.device_used() + residency.evicting.held() + chunk.nbytes > room:
                return
            if chunk.tier is _HOST:
                self._start(fid, due=-1, lead=1)

    # ---- "lookahead" ---------------------------------------------------------------------------------------------
    def _state(self) -> LookaheadState | None:
        """The planner's view of now (None where it does not plan: several ranks, or off the trace)."""
        residency = self.residency
        policy = residency.policy
        room = residency.chunk_room()
        if not isinstance(policy, AutoPlacement) or room is None or not self._single_rank():
            return None
        view = policy.lookahead_view()
        if view is None:
            return None
        trace, cursor, keep = view
        _, _, families, rooms, stops, sizes = self._static_of(trace)
        held = residency.pinned | residency.stepping
        on_device = [f for f in residency.families if _PARAM in f.chunks and f.param_chunk.tier is _DEVICE]
        return LookaheadState(
            cursor=cursor,
            families=families,
            rooms=rooms,
            stops=stops,
            sizes=sizes,
            resident=frozenset(f.family_id for f in on_device if f.family_id not in held),
            busy=frozenset(f.family_id for f in on_device if f.param_chunk.state is ChunkState.COMPUTE),
            on_host=frozenset(
                f.family_id for f in residency.families if _PARAM in f.chunks and f.param_chunk.tier is _HOST
            ),
            used=residency.device_used() + residency.evicting.held(),
            room_now=room,
            keep=keep,
            clean=frozenset(f.family_id for f in on_device if f.param_chunk.host_copy_current),
            ahead=dict(self.ahead),
            next_use=trace.next_use,
        )

    def _static_of(
        self, trace: Trace
    ) -> tuple[int, int, Sequence[tuple[int, ...]], list[int], frozenset[int], dict[int, int]]:
        budget = self.residency.device_budget
        assert budget is not None
        cached = self._static
        if cached is not None and cached[0] == id(trace) and cached[1] == budget:
            return cached
        moments = trace.moments
        self._static = (
            id(trace),
            budget,
            [m.families for m in moments],
            [budget - m.non_model_bytes for m in moments],
            frozenset(i for i, m in enumerate(moments) if m.kind is MomentKind.STEP),
            {f.family_id: f.param_chunk.nbytes for f in self.residency.families if _PARAM in f.chunks},
        )
        return self._static

    def _perform(self, state: LookaheadState) -> None:
        """The plan's early evictions, then its fetches while they fit the room now (on CUDA an eviction's block is
        reusable only once its copy ends: a fetch that does not fit yet waits for a later moment's plan, never for
        the copy)."""
        residency = self.residency
        plan = plan_prefetch(state)
        for fid in plan.evict:
            residency.move_param_chunk(residency.families[fid], _HOST)
            residency.stats.early_evictions += 1
        n = len(state.families)
        for fid, due in plan.fetch:
            chunk = residency.families[fid].param_chunk
            if residency.device_used() + residency.evicting.held() + chunk.nbytes > state.room_now:
                return
            self._start(fid, due=due, lead=(due - state.cursor) % n)

    def _start(self, fid: int, *, due: int, lead: int) -> None:
        residency = self.residency
        with torch.profiler.record_function("pstar::prefetch"):
            residency.move_param_chunk(residency.families[fid], _DEVICE, asynchronous=True)
        residency.stats.prefetches += 1
        residency.stats.prefetch_lead_moments += lead
        self.ahead[fid] = due

    def _single_rank(self) -> bool:
        if self._owns_all is None:  # ownership is fixed at setup
            residency = self.residency
            self._owns_all = all(residency.owns(f) for f in residency.families)
        return self._owns_all
