"""Gradients: the one way a gradient is written into the chunks, summed over micro-batches, or discarded.

A parameter's final gradient of a backward lands in one of two places (:class:`GradLocation`):

- mixed precision, last micro-batch before a step: the parameter's own slot of the param chunk, in the
  compute dtype ("chunk reuse": the weight is not needed again this iteration, the fp32 master holds it),
  which is what makes model data 14 bytes/param;
- otherwise (32-true, or a micro-batch whose gradient is summed with the next ones): the fp32 GRAD chunk.

Both can hold a part at once (accumulated micro-batches in GRAD, the last one in the param slot): the
optimizer adds them. With several ranks the gradient first goes to the sharding layer, which reduces it
across ranks and stores the owner's share through :meth:`GradStore.store`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_pstar.runtime.chunk import Chunk, ChunkKind, Slot
from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
from lightning_pstar.runtime.residency import Residency
from lightning_pstar.runtime.state import SOURCES_OF, GradLocation, MicroBatch, TensorState, Tier

__all__ = ["GradStore"]

# module-level: an Enum member read through its class costs a lookup, and these are read per parameter
_DEVICE, _PARAM, _MASTER = Tier.DEVICE, ChunkKind.PARAM, ChunkKind.MASTER
_FINAL, _HOLD_AFTER_BWD = MicroBatch.FINAL, TensorState.HOLD_AFTER_BWD
_TO_HOLD_AFTER_BWD = SOURCES_OF[TensorState.HOLD_AFTER_BWD]


class GradStore:
    """Writes, sums and discards the gradients of one model's families."""

    def __init__(self, residency: Residency, *, mixed: bool, simulated: bool) -> None:
        self.residency = residency
        self.mixed = mixed
        self.simulated = simulated
        self.micro_batch = MicroBatch.FINAL

    @property
    def accumulating(self) -> bool:
        return self.micro_batch is MicroBatch.ACCUMULATING

    def store(self, record: ParamRecord, grad: torch.Tensor) -> None:
        """Store the gradient averaged over ranks for a slot this rank owns (ZeRO data parallelism)."""
        family = record.family
        view = grad.view(record.slot.shape)
        if self.mixed and not self.accumulating and ChunkKind.GRAD not in family.chunks:
            self._copy_in(family.param_chunk, record.slot, view, add=False)  # chunk reuse: 14 bytes/param
            self.grad_to_param_slot(record)
        else:
            self._copy_in(self.grad_chunk(family), record.slot, view, add=record.grad_in_grad_chunk)
            record.grad_in_grad_chunk = True
        if not self.accumulating:
            record.set_state(TensorState.HOLD_AFTER_BWD)

    def store_local(self, record: ParamRecord, grad: torch.Tensor) -> None:
        """One rank: store the final gradient and mark the slot (``HOLD`` while it sums micro-batches)."""
        if self.mixed and self.micro_batch is _FINAL:  # chunk reuse, the common case: inlined
            chunks = record.family.chunks
            chunk, slot = chunks[_PARAM], record.slot
            target = chunk.slot_view(slot)
            if not self.simulated and chunk.tier is not _DEVICE:
                self.residency.stats.d2h_bytes += grad.numel() * grad.element_size()
            target.copy_(grad)
            if not record.grad_in_param_slot:  # the parameter reads its fp32 master meanwhile
                record.grad_in_param_slot = True
                record.param.data = chunks.get(_MASTER, chunk).buffer_view(slot)  # as Residency.point_at_chunk
            if slot.state not in _TO_HOLD_AFTER_BWD:
                record.set_state(_HOLD_AFTER_BWD)  # raises
            slot.state = _HOLD_AFTER_BWD
            return
        self._copy_in(self.grad_chunk(record.family), record.slot, grad, add=record.grad_in_grad_chunk)
        record.grad_in_grad_chunk = True
        record.set_state(TensorState.HOLD if self.accumulating else _HOLD_AFTER_BWD)

    def grad_to_param_slot(self, record: ParamRecord) -> None:
        """The param slot now holds (a part of) the gradient: the parameter reads its fp32 master meanwhile."""
        if not record.grad_in_param_slot:
            record.grad_in_param_slot = True
            self.residency.point_at_chunk(record)

    def weight_to_param_slot(self, record: ParamRecord) -> None:
        """The param slot holds the weight again (written by the optimizer or a load): the parameter points at it."""
        if record.grad_in_param_slot:
            record.grad_in_param_slot = False
            self.residency.point_at_chunk(record)

    def set_location(self, record: ParamRecord, location: GradLocation) -> None:
        """Say where ``record``'s gradient lives; the parameter follows its weight (the fp32 master while its
        param slot holds the gradient, the param slot again afterwards)."""
        moved = (GradLocation.PARAM_SLOT in location) != record.grad_in_param_slot
        record.grad = location
        if moved:
            self.residency.point_at_chunk(record)

    def grad_chunk(self, family: ChunkFamily) -> Chunk:
        chunk = family.chunks.get(ChunkKind.GRAD)
        if chunk is None:
            # mixed precision sums micro-batch gradients in fp32. Declared runs (``accumulates=True``)
            # allocate it at setup within the plan; otherwise it goes to the device only if it fits there
            # without evicting anything in the middle of a backward.
            residency = self.residency
            chunk = residency.new_chunk(family, ChunkKind.GRAD, torch.float32)
            tier = residency.optimizer_tier
            room = residency.chunk_room()
            if tier is Tier.DEVICE and room is not None and residency.device_used() + chunk.nbytes > room:
                tier = Tier.HOST
            if tier is Tier.HOST:
                residency.check_host_room(chunk.nbytes, chunk=chunk)
            chunk.allocate(tier)
        return chunk

    def _copy_in(self, chunk: Chunk, slot: Slot, grad: torch.Tensor, *, add: bool) -> None:
        target = chunk.slot_view(slot)
        if chunk.tier is not _DEVICE and not self.simulated:
            self.residency.stats.d2h_bytes += grad.numel() * grad.element_size()
        if add:
            target.add_(grad.to(target.device))
        else:
            target.copy_(grad)

    def carry_over(self, records: Sequence[ParamRecord]) -> None:
        """A new micro-batch starts while gradients of the last backward wait for a step (manual accumulation:
        ``manual_backward`` on several batches before ``opt.step()``): they are kept for the step, summed with
        the coming ones. A gradient in the param slot moves into the fp32 GRAD chunk and the slot gets its
        weight back from the master, so the next forward computes with the weight."""
        for record in records:
            if record.slot.state is not _HOLD_AFTER_BWD:
                continue
            if record.grad_in_param_slot:
                family = record.family
                slot = record.slot
                with torch.no_grad():
                    self._copy_in(
                        self.grad_chunk(family),
                        slot,
                        family.param_chunk.slot_view(slot).float(),
                        add=record.grad_in_grad_chunk,
                    )
                    family.param_chunk.slot_view(slot).copy_(family.chunks[ChunkKind.MASTER].slot_view(slot))
                self.set_location(record, GradLocation.GRAD_CHUNK)
            record.set_state(TensorState.HOLD)

    def discard(self, records: Sequence[ParamRecord]) -> None:
        """Forget the gradients of ``records`` (``zero_grad``); weights overwritten by gradients are restored
        from the masters."""
        with torch.no_grad():
            for record in records:
                if record.grad_in_param_slot:
                    family = record.family
                    family.param_chunk.slot_view(record.slot).copy_(
                        family.chunks[ChunkKind.MASTER].slot_view(record.slot)
                    )
                    self.weight_to_param_slot(record)
                record.grad_in_grad_chunk = False
                if record.slot.state is _HOLD_AFTER_BWD:
                    record.set_state(TensorState.HOLD)
