"""Setup of a run over several ranks: every rank must have built the same model, and starts from rank 0's
weights, as DDP does (:meth:`~lightning_pstar.runtime.sharding.GroupCoordinator.start`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from lightning_pstar.runtime.comm import ChunkComm
from lightning_pstar.runtime.family import ParamRecord

__all__ = ["agree_on_model"]


def agree_on_model(
    comm: ChunkComm,
    records: Sequence[ParamRecord],
    layout: tuple[int, int, int, int],
    detail: str,
    *,
    bucket_bytes: int,
) -> None:
    """Setup, before any chunk exists: every rank must have built the same model (``layout``: parameters,
    elements, chunk size, families; ``detail``: names, shapes, trainability), and as DDP does every rank
    starts from rank 0's weights (meta-initialised ones come from their owner)."""
    # a digest (hash() differs per process), and the bucket size: it decides which collectives run
    mine = (*layout, hashlib.sha1(detail.encode()).hexdigest(), bucket_bytes)
    every = comm.all_gather_object(mine)
    for rank, theirs in enumerate(every):
        if theirs[:-1] != mine[:-1]:
            raise ValueError(
                f"The model differs between ranks: rank {comm.rank} has {mine[0]} parameters with"
                f" {mine[1]:,} elements in {mine[3]} chunks of {mine[2]:,}, rank {rank} has {theirs[0]}"
                f" parameters with {theirs[1]:,} elements in {theirs[3]} chunks of {theirs[2]:,}"
                " (or other names/shapes). HINT: build the same model on every rank (same config, same"
                " frozen parameters) and set chunk_size explicitly if the device budgets differ."
            )
        if theirs[-1] != mine[-1]:
            raise ValueError(
                f"`chunks.bucket_bytes` differs between ranks: rank {comm.rank} has {mine[-1]:,} bytes, rank"
                f" {rank} {theirs[-1]:,}. HINT: give every rank the same PatrickStar config."
            )
    with torch.no_grad():
        for record in records:
            if not record.param.is_meta:
                comm.broadcast_(record.param.data, src=0)
