"""ZeRO data parallelism over chunk groups: gather on access, release after use, reduce gradients.

Chunk *i* belongs to communication group ``i // world_size`` and is owned by rank ``i % world_size``
(:mod:`lightning_pstar.comm`). A rank keeps the param chunk, fp32 master and optimizer states only of the
families it owns. When a module needs a chunk of group *g*, every rank all-gathers the group's param
chunks into local storage; the remote ones are released once nothing computes with them. In backward each
rank writes its local gradients into a temporary fp32 buffer per family; when every trainable slot of a
group has its gradient, the group is reduce-scattered to the owners and averaged, and the remote chunks
are released.

Every decision that leads to a collective (gather a group, reduce a group) depends only on slot states,
which evolve identically on every rank as long as every rank runs the same modules in the same order.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from lightning_pstar.comm import ChunkComm
from lightning_pstar.state import TensorState, Tier

if TYPE_CHECKING:
    from lightning_pstar.chunk_manager import ChunkFamily, ChunkManager, ParamRecord

__all__ = ["GroupCoordinator"]

log = logging.getLogger(__name__)


class GroupCoordinator:
    """Gathers, releases and reduces the chunk groups of one chunk manager."""

    def __init__(self, manager: ChunkManager, comm: ChunkComm) -> None:
        self.manager = manager
        self.comm = comm
        self.world_size = comm.world_size
        self.rank = comm.rank
        self.gathered: set[int] = set()  # groups whose remote param chunks are present locally
        self.local_grads: dict[int, torch.Tensor] = {}  # family -> fp32 local gradients (capacity,)
        self.local_slots: dict[int, set[int]] = {}  # family -> records with a local gradient this backward
        self.waiting: dict[int, int] = {}  # group -> trainable slots still without a local gradient
        self.reduced: set[int] = set()  # groups reduced in the current backward
        self._poison: dict[torch.dtype, torch.Tensor] = {}

    # ---- ownership --------------------------------------------------------------------------------------
    def owns(self, family: ChunkFamily) -> bool:
        return family.family_id % self.world_size == self.rank

    def group_of(self, family: ChunkFamily) -> int:
        return family.family_id // self.world_size

    def members(self, group: int) -> list[ChunkFamily]:
        start = group * self.world_size
        return self.manager.families[start : start + self.world_size]

    def num_groups(self) -> int:
        return len(self.manager.families) // self.world_size

    # ---- parameters of released chunks ------------------------------------------------------------------
    def point_at_poison(self, record: ParamRecord) -> None:
        """A released remote chunk has no bytes here: its parameters read as NaN (never as stale weights)."""
        dtype = self.manager.compute_dtype
        poison = self._poison.get(dtype)
        if poison is None:
            poison = torch.full((1,), float("nan"), dtype=dtype, device=self.manager.device)
            self._poison[dtype] = poison
        record.param.data = poison.expand(record.slot.shape)

    # ---- forward / backward access ----------------------------------------------------------------------
    def ensure_gathered(self, families: list[ChunkFamily], protect: set[int]) -> None:
        """All-gather every group of ``families`` that is not present locally (collective, in group order)."""
        for group in sorted({self.group_of(f) for f in families}):
            if group in self.gathered:
                continue
            members = self.members(group)
            own = members[self.rank]
            manager = self.manager
            guard = protect | {f.family_id for f in members}
            manager.fetch(own, protect=guard)
            for family in members:
                if family is own:
                    continue
                chunk = family.param_chunk
                manager.ensure_device_room(chunk.nbytes, protect=guard)
                chunk.allocate(Tier.DEVICE, zero=False)
            with torch.profiler.record_function("pstar::all_gather"):
                self.comm.all_gather_chunks([f.param_chunk.data for f in members], self.rank)
            for family in members:
                if family is not own:
                    for record in family.records:
                        manager.point_at_chunk(record)
            self.gathered.add(group)

    def release_idle(self, families: list[ChunkFamily]) -> None:
        """Release the remote chunks of groups in which nothing computes (local gradients live elsewhere),
        unless the warm-up trace says the next moment uses the group again (saves a gather per module)."""
        upcoming = self.manager.next_moment_families()
        # in a training pass a group stays until every slot in it is done with this pass (forward: used,
        # so HOLD_AFTER_FWD; backward: its gradient taken or its module done, so not HOLD_AFTER_FWD any
        # more), as the original releases a remote chunk; without autograd it goes as soon as it is idle
        pending: TensorState | None = None
        if self.manager.in_training and torch.is_grad_enabled():
            pending = TensorState.HOLD_AFTER_FWD if self.manager.in_backward else TensorState.HOLD
        for group in sorted({self.group_of(f) for f in families}):
            if group not in self.gathered:
                continue
            if upcoming is not None and any(f.family_id in upcoming for f in self.members(group)):
                continue
            members = self.members(group)
            if any(s.state is TensorState.COMPUTE or s.state is pending for f in members for s in f.slots):
                continue
            self._release_group(group)

    def _release_group(self, group: int) -> None:
        for family in self.members(group):
            if self.owns(family):
                continue
            family.param_chunk.release()
            for record in family.records:
                self.point_at_poison(record)
        self.gathered.discard(group)

    def release_all(self) -> None:
        for group in sorted(self.gathered):
            members = self.members(group)
            if not any(s.state is TensorState.COMPUTE for f in members for s in f.slots):
                self._release_group(group)

    # ---- gradients --------------------------------------------------------------------------------------
    def begin_backward_bookkeeping(self) -> None:
        if self.waiting:
            return
        for group in range(self.num_groups()):
            count = sum(1 for f in self.members(group) if f.trainable for r in f.records)
            if count:
                self.waiting[group] = count

    def grad_ready(self, record: ParamRecord, grad: torch.Tensor) -> None:
        """Keep a local gradient until its group is complete, then reduce the group."""
        self.begin_backward_bookkeeping()
        family = record.family
        buf = self.local_grads.get(family.family_id)
        if buf is None:
            buf = torch.zeros(family.capacity, dtype=torch.float32, device=self.manager.device)
            self.local_grads[family.family_id] = buf
        view = buf[record.slot.offset : record.slot.offset + record.slot.numel].view(record.slot.shape)
        slots = self.local_slots.setdefault(family.family_id, set())
        if record.index in slots:  # pragma: no cover - autograd reports a leaf's gradient once per backward
            view.add_(grad)
        else:
            view.copy_(grad)
            slots.add(record.index)
        record.slot.set_state(TensorState.HOLD, chunk_id=family.family_id)  # the weight is still in the slot
        group = self.group_of(family)
        self.waiting[group] -= 1
        if self.waiting[group] == 0:
            self.reduce_group(group)

    def flush(self) -> None:
        """End of backward: reduce every trainable group not reduced yet (parameters without gradients)."""
        if self.waiting:
            for group in sorted(self.waiting):
                if group not in self.reduced:
                    self.reduce_group(group)
        self.waiting.clear()
        self.reduced.clear()
        self.release_all()

    def reduce_group(self, group: int) -> None:
        """Reduce-scatter (average) the group's local gradients into the owners' chunks."""
        manager = self.manager
        members = self.members(group)
        own = members[self.rank]
        device = manager.device
        # which slots received a gradient on any rank (a slot without one is not stepped, as in torch)
        local = [self.local_slots.pop(f.family_id, set()) for f in members]
        presence = torch.tensor(
            [r.index in got for f, got in zip(members, local, strict=True) for r in f.records],
            dtype=torch.uint8,
            device=device,
        )
        self.comm.all_reduce_max_(presence)
        inputs: list[torch.Tensor] = []
        for family in members:
            buf = self.local_grads.pop(family.family_id, None)
            inputs.append(buf if buf is not None else torch.zeros(family.capacity, dtype=torch.float32, device=device))
        output = torch.empty(own.capacity, dtype=torch.float32, device=device)
        with torch.profiler.record_function("pstar::reduce_scatter"):
            self.comm.reduce_scatter_chunks(inputs, output)
        present = presence.tolist()
        offset = sum(len(f.records) for f in members[: self.rank])
        for i, record in enumerate(own.records):
            if present[offset + i]:
                manager.store_reduced_grad(record, output[record.slot.offset : record.slot.offset + record.slot.numel])
        self.reduced.add(group)
        self.waiting[group] = 0
        self._release_group(group)

    def discard(self) -> None:
        """Forget local gradients that were never reduced (zero_grad before a step)."""
        self.local_grads.clear()
        self.local_slots.clear()
        self.waiting.clear()
        self.reduced.clear()
