"""Placement policies: decide where chunks go and which ones to evict. They never copy bytes themselves.

A policy is a small object the chunk manager consults; the manager performs the moves it decides. This
keeps the mechanism (copies, storage identity, accounting) in one place and lets policies be swapped.

- :class:`StaticPlacement` (ZeRO-Offload style): a fixed share of the device budget for chunks, decided
  before training; least recently used chunk evicted first.
- :class:`AutoPlacement` (PatrickStar): during warm-up chunks use a small share of the device (model data that
  fits that share starts its optimizer side on the device: [Note: where the warm-up steps]); afterwards
  the room for chunks at moment ``t`` is ``budget - non_model[t]`` from the warm-up trace, victims are
  first the chunks the yardstick's plan does not keep at ``t`` ([Note: the yardstick] in ``yardstick.py``),
  then those whose next use is farthest away (Belady), a clean one (its eviction copies nothing) before a
  dirty one at the same distance; chunks are prefetched along the trace by bytes ([Note: fetch and prefetch]
  in ``lookahead.py``), and optimizer-state families that fit the margin at the optimizer step stay on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from lightning_pstar.planning.tiers import optimizer_starts_on_host, setup_chunk_room
from lightning_pstar.runtime.chunk import Chunk, ChunkKind
from lightning_pstar.runtime.state import ChunkState, Tier

if TYPE_CHECKING:
    from lightning_pstar.runtime.tracer import MemoryTracer, Trace

__all__ = ["AutoPlacement", "PlacementPolicy", "StaticPlacement", "make_policy"]

log = logging.getLogger(__name__)


class PlacementPolicy(Protocol):
    """What the chunk manager asks a placement policy."""

    name: str

    def optimizer_tier(self, *, model_data_bytes: int, device_budget: int | None) -> Tier:
        """Where optimizer-side chunks (fp32 master, grads, moments) start."""
        ...

    def chunk_room(self, device_budget: int | None, min_bytes: int) -> int | None:
        """Bytes chunks may occupy on the device at the current moment (None: unlimited, always so when
        ``device_budget`` is None: the residency then skips the eviction bookkeeping)."""
        ...

    def next_chunk_room(self, device_budget: int | None, min_bytes: int) -> int | None:
        """Bytes chunks may occupy at the next moment (for prefetching; None: unlimited or unknown)."""
        ...

    def touch(self, chunk: Chunk, tick: int) -> None:
        """Record that ``chunk`` was accessed at ``tick`` (a counter that only grows)."""
        ...

    def victims(self, candidates: Sequence[Chunk], needed_bytes: int) -> list[Chunk]:
        """Chunks among ``candidates`` (resident on DEVICE) to evict to free ``needed_bytes``.

        May return fewer bytes than needed when the candidates do not have them; the manager raises.
        """
        ...

    def prefetch(self) -> tuple[int, ...]:
        """Chunk families worth fetching now for the next moment (empty when unknown)."""
        ...

    def adopt_plan(self, keep: dict[int, frozenset[int]]) -> None:
        """After the warm-up: per trace moment, the families the yardstick's plan keeps on the device."""
        ...


def _lru(candidates: Sequence[Chunk], needed_bytes: int, last_use: dict[int, int]) -> list[Chunk]:
    movable = [c for c in candidates if c.state is ChunkState.HOLD and c.kind is ChunkKind.PARAM]
    # oldest use first; ties (never used) by chunk id so the choice is deterministic
    movable.sort(key=lambda c: (last_use.get(c.chunk_id, -1), c.chunk_id))
    return _take(movable, needed_bytes)


def _take(ordered: Sequence[Chunk], needed_bytes: int) -> list[Chunk]:
    chosen: list[Chunk] = []
    freed = 0
    for chunk in ordered:
        if freed >= needed_bytes:
            break
        chosen.append(chunk)
        freed += chunk.nbytes
    return chosen


class StaticPlacement:
    """Baseline policy: ``chunk_fraction`` of the device budget is for chunks; LRU eviction.

    Optimizer-side chunks stay on DEVICE only when all model data fits the chunks' share; otherwise they
    live on HOST for the whole run and the optimizer step runs there (ZeRO-Offload style).
    """

    name = "static"

    def __init__(self, chunk_fraction: float = 1.0) -> None:
        self.chunk_fraction = chunk_fraction
        self._last_use: dict[int, int] = {}

    def optimizer_tier(self, *, model_data_bytes: int, device_budget: int | None) -> Tier:
        on_host = optimizer_starts_on_host(
            "static",
            model_data_bytes=model_data_bytes,
            device_budget=device_budget,
            static_fraction=self.chunk_fraction,
        )
        return Tier.HOST if on_host else Tier.DEVICE

    def chunk_room(self, device_budget: int | None, min_bytes: int) -> int | None:
        return setup_chunk_room(  # setup checked that one module's chunks fit
            "static", device_budget=device_budget, min_bytes=min_bytes, static_fraction=self.chunk_fraction,
            warmup_fraction=1.0,
        )  # fmt: skip

    def next_chunk_room(self, device_budget: int | None, min_bytes: int) -> int | None:
        return self.chunk_room(device_budget, min_bytes)

    def touch(self, chunk: Chunk, tick: int) -> None:
        self._last_use[chunk.chunk_id] = tick

    def victims(self, candidates: Sequence[Chunk], needed_bytes: int) -> list[Chunk]:
        return _lru(candidates, needed_bytes, self._last_use)

    def prefetch(self) -> tuple[int, ...]:
        return ()

    def adopt_plan(self, keep: dict[int, frozenset[int]]) -> None:
        return None  # a fixed share and LRU: no plan


class AutoPlacement:
    """PatrickStar's trace-driven placement (see the module docstring)."""

    name = "auto"

    def __init__(self, tracer: MemoryTracer, warmup_fraction: float = 0.25) -> None:
        self.tracer = tracer
        self.warmup_fraction = warmup_fraction
        self._last_use: dict[int, int] = {}
        self._keep: dict[int, frozenset[int]] = {}  # trace moment -> families the plan keeps on the device

    @property
    def _planning(self) -> bool:
        return self.tracer.warmed_up and self.tracer.matches

    def optimizer_tier(self, *, model_data_bytes: int, device_budget: int | None) -> Tier:
        # [Note: where the warm-up steps] model data that fits the warm-up's share of the budget starts (and
        # steps) on the device: nothing moves during the warm-up and nothing is pinned for optimizer states;
        # otherwise the optimizer side starts on HOST (safe during the warm-up). Either way the hybrid plan after
        # the warm-up keeps on the device the families that fit the margin at the step and moves the others
        # (plan_hybrid_optimizer in optimizer_side.py). The planner asks the same function.
        on_host = optimizer_starts_on_host(
            "auto",
            model_data_bytes=model_data_bytes,
            device_budget=device_budget,
            static_fraction=1.0,
            warmup_fraction=self.warmup_fraction,
        )
        return Tier.HOST if on_host else Tier.DEVICE

    def chunk_room(self, device_budget: int | None, min_bytes: int) -> int | None:
        if device_budget is None:
            return None
        tracer = self.tracer
        if not tracer.warmed_up:
            return setup_chunk_room(
                "auto", device_budget=device_budget, min_bytes=min_bytes, static_fraction=1.0,
                warmup_fraction=self.warmup_fraction,
            )  # fmt: skip
        if not tracer.matches or tracer.cursor < 0:
            return max(min_bytes, device_budget - tracer.trace.peak_non_model)
        # the end of warm-up checked that every moment's chunks fit beside its non-model memory
        return device_budget - tracer.trace.moments[tracer.cursor].non_model_bytes

    def next_chunk_room(self, device_budget: int | None, min_bytes: int) -> int | None:
        if device_budget is None or not self._planning:
            return None
        moments = self.tracer.trace.moments
        nxt = (self.tracer.cursor + 1) % len(moments)
        return device_budget - moments[nxt].non_model_bytes

    def touch(self, chunk: Chunk, tick: int) -> None:
        self._last_use[chunk.chunk_id] = tick

    def victims(self, candidates: Sequence[Chunk], needed_bytes: int) -> list[Chunk]:
        if not self._planning:
            return _lru(candidates, needed_bytes, self._last_use)
        trace, cursor = self.tracer.trace, max(self.tracer.cursor, 0)
        keep = self._keep.get(cursor, frozenset())
        movable = [c for c in candidates if c.state is ChunkState.HOLD and c.kind is ChunkKind.PARAM]
        # the plan's drops first, then Belady: farthest next use first, a clean chunk (its eviction copies
        # nothing) before a dirty one at the same distance; last ties by chunk id (deterministic on every rank)
        movable.sort(
            key=lambda c: (
                c.chunk_id in keep,
                -trace.next_use(c.chunk_id, cursor),
                not c.host_copy_current,
                c.chunk_id,
            )
        )
        return _take(movable, needed_bytes)

    def adopt_plan(self, keep: dict[int, frozenset[int]]) -> None:
        self._keep = dict(keep)

    def lookahead_view(self) -> tuple[Trace, int, dict[int, frozenset[int]]] | None:
        """The trace, the moment the iteration is at and the plan's kept families per moment, for prefetching by
        bytes ([Note: fetch and prefetch] in ``lookahead.py``); None off the trace."""
        tracer = self.tracer
        if not self._planning or not 0 <= tracer.cursor < len(tracer.trace.moments):
            return None
        return tracer.trace, tracer.cursor, self._keep

    def prefetch(self) -> tuple[int, ...]:
        if not self._planning:
            return ()
        moments = self.tracer.trace.moments
        nxt = self.tracer.cursor + 1
        if nxt >= len(moments):
            nxt = 0
        return moments[nxt].families


def make_policy(
    name: str, tracer: MemoryTracer, *, static_chunk_fraction: float = 1.0, warmup_chunk_fraction: float = 0.25
) -> PlacementPolicy:
    """The policy registered under ``name`` (validated by :class:`~lightning_pstar.config.PStarConfig`)."""
    if name == "static":
        return StaticPlacement(static_chunk_fraction)
    if name == "auto":
        return AutoPlacement(tracer, warmup_chunk_fraction)
    raise ValueError(f"unknown placement policy {name!r}; accepted: ['auto', 'static']")
