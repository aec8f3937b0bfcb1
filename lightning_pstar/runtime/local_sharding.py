"""One rank's sharding: a null object with the verbs of :class:`~lightning_pstar.runtime.sharding.GroupCoordinator`.

This rank owns every chunk family, nothing is gathered or reduced, and gradients go straight to the chunks, so
the manager calls the same verbs at one rank as at many without a branch for the one-rank case.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
from lightning_pstar.runtime.grads import GradStore

__all__ = ["LocalSharding"]


class LocalSharding:
    """The one-rank case as a null object: this rank owns every family, nothing is gathered or reduced,
    gradients go straight to the chunks."""

    distributed = False
    gathers = 0
    prefetches = 0
    reductions = 0
    second_rounds = 0
    keep: frozenset[int] = frozenset()

    def __init__(self, grads: GradStore) -> None:
        self.grads = grads

    def owns(self, family: ChunkFamily) -> bool:
        return True

    def start(self, records: Sequence[ParamRecord], layout: tuple[int, int, int, int], detail: str) -> None:
        """Setup: nothing to agree on with peers."""

    def begin_pass(self, *, training: bool = True) -> None: ...

    def begin_backward(self) -> None: ...

    def flush(self) -> None: ...

    def ensure_gathered(
        self, families: list[ChunkFamily], protect: set[int], *, in_backward: bool, module: int | None = None
    ) -> None: ...

    def release_passed(self) -> None: ...

    def grad_ready(self, record: ParamRecord, grad: torch.Tensor) -> None:
        self.grads.store_local(record, grad)

    def plan(self, prefetch_fits: bool, keep_groups: int) -> bool:
        return False

    def num_groups(self) -> int:
        return 0

    def group_bytes(self) -> int:
        return 0

    def discard(self) -> None: ...

    def point_at_poison(self, record: ParamRecord) -> None:  # pragma: no cover - every family is owned here
        raise AssertionError("one rank owns every chunk")

    def poison_ptrs(self) -> set[int]:
        """Addresses of the NaN views remote parameters point at: none here."""
        return set()
