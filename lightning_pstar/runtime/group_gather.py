"""One all-gather of chunk groups in flight (:class:`GroupGather`), and the packing of a bucket of groups into one
buffer per rank and back ([Note: buckets of chunk groups] in ``sharding.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lightning_pstar.runtime.family import ChunkFamily

__all__ = ["GroupGather", "pack_bucket", "unpack_bucket"]


@dataclass(eq=False)
class GroupGather:
    """One all-gather in flight: of one group into its chunks, or of a bucket of groups packed per rank."""

    groups: list[int]  # in sweep order; the first is the one gathered for use, the others ride along
    work: Any  # the collective's handle (None with a fake)
    packed: list[torch.Tensor] | None  # a bucket: one buffer per rank, this rank's chunks copied into its own


def pack_bucket(own: list[torch.Tensor], rank: int, world_size: int) -> list[torch.Tensor]:
    """The all-gather buffers of a bucket: this rank's chunks ``own`` copied into its buffer (a copy: nothing
    needs to stay in place), an empty one of the same size per peer."""
    send = torch.cat(own)
    return [send if r == rank else torch.empty_like(send) for r in range(world_size)]


def unpack_bucket(packed: list[torch.Tensor], families: list[ChunkFamily], rank: int) -> None:
    """Copy every peer's part of a gathered bucket (``packed``: one buffer per rank) into its chunks; ``families``:
    the members of the bucket's groups, in order."""
    width = len(packed)
    chunks = [f.param_chunk.data for f in families]
    sizes = [f.capacity for f in families[rank::width]]
    parts = [buf.split(sizes) for buf in packed]
    targets = [c for i, c in enumerate(chunks) if i % width != rank]
    sources = [parts[i % width][i // width] for i in range(len(chunks)) if i % width != rank]
    torch._foreach_copy_(targets, sources)
