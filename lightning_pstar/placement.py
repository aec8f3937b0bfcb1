"""Placement policies: decide where chunks go and which ones to evict. They never copy bytes themselves.

A policy is a small object the chunk manager consults; the manager performs the moves it decides. This
keeps the mechanism (copies, storage identity, accounting) in one place and lets policies be swapped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from lightning_pstar.chunk import Chunk, ChunkKind
from lightning_pstar.state import ChunkState, Tier

__all__ = ["PlacementPolicy", "StaticPlacement", "make_policy"]


class PlacementPolicy(Protocol):
    """What the chunk manager asks a placement policy."""

    def optimizer_tier(self, *, model_data_bytes: int, device_budget: int | None) -> Tier:
        """Where optimizer-side chunks (fp32 master, grads, moments) live for the whole run."""
        ...

    def touch(self, chunk: Chunk, tick: int) -> None:
        """Record that ``chunk`` was accessed at ``tick`` (a counter that only grows)."""
        ...

    def victims(self, candidates: Sequence[Chunk], needed_bytes: int) -> list[Chunk]:
        """Chunks among ``candidates`` (resident on DEVICE, not in use) to evict to free ``needed_bytes``.

        May return fewer bytes than needed when the candidates do not have them; the manager raises.
        """
        ...


class StaticPlacement:
    """Baseline policy: the whole device budget is for chunks; least recently used chunk evicted first.

    Optimizer-side chunks stay on DEVICE only when all model data fits the device budget; otherwise they
    live on HOST for the whole run and the optimizer step runs there (ZeRO-Offload style).
    """

    def __init__(self) -> None:
        self._last_use: dict[int, int] = {}

    def optimizer_tier(self, *, model_data_bytes: int, device_budget: int | None) -> Tier:
        if device_budget is None or model_data_bytes <= device_budget:
            return Tier.DEVICE
        return Tier.HOST

    def touch(self, chunk: Chunk, tick: int) -> None:
        self._last_use[chunk.chunk_id] = tick

    def victims(self, candidates: Sequence[Chunk], needed_bytes: int) -> list[Chunk]:
        movable = [c for c in candidates if c.state is ChunkState.HOLD and c.kind is ChunkKind.PARAM]
        # oldest use first; ties (never used) by chunk id so the choice is deterministic
        movable.sort(key=lambda c: (self._last_use.get(c.chunk_id, -1), c.chunk_id))
        chosen: list[Chunk] = []
        freed = 0
        for chunk in movable:
            if freed >= needed_bytes:
                break
            chosen.append(chunk)
            freed += chunk.nbytes
        return chosen


def make_policy(name: str) -> PlacementPolicy:
    """The policy registered under ``name`` (validated by :class:`~lightning_pstar.config.PStarConfig`)."""
    policies: dict[str, type[StaticPlacement]] = {"static": StaticPlacement}
    if name not in policies:
        raise ValueError(f"unknown placement policy {name!r}; accepted: {sorted(policies)}")
    return policies[name]()


def total_bytes(chunks: Iterable[Chunk]) -> int:
    return sum(c.nbytes for c in chunks)
