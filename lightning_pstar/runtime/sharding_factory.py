"""Which sharding a run gets: :data:`Sharding`, what the chunk manager talks to (the same verbs at one rank and at
many), and :func:`make_sharding`, which picks one by the world size."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from lightning_pstar.runtime.comm import ChunkComm
from lightning_pstar.runtime.family import ChunkFamily
from lightning_pstar.runtime.grads import GradStore
from lightning_pstar.runtime.local_sharding import LocalSharding
from lightning_pstar.runtime.residency import Residency
from lightning_pstar.runtime.sharding import DEFAULT_BUCKET_BYTES, GroupCoordinator

__all__ = ["Sharding", "make_sharding"]


Sharding = LocalSharding | GroupCoordinator
"""What the manager talks to: the same verbs at one rank (a null object) and at many."""


def make_sharding(
    families: list[ChunkFamily],
    comm: ChunkComm,
    *,
    residency: Residency,
    grads: GradStore,
    compute_dtype: torch.dtype,
    module_groups: Sequence[Iterable[int]] = (),
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Sharding:
    if comm.world_size == 1:
        return LocalSharding(grads)
    return GroupCoordinator(
        families,
        comm,
        residency=residency,
        grads=grads,
        compute_dtype=compute_dtype,
        module_groups=module_groups,
        bucket_bytes=bucket_bytes,
    )
