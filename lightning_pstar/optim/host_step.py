"""One family's host-side optimizer step as a :class:`~lightning_pstar.runtime.pipeline.HostJob`.

The job runs the whole-family Adam of the serial step (``SerialFamilyStep._step_whole_family`` in
``optim/serial_step.py``) on the same values: see [Note: the step pipeline] in
:mod:`lightning_pstar.runtime.pipeline` for what makes it bitwise the serial step. :func:`host_job` builds it on
the calling thread (every piece of bookkeeping before the stages run), or returns None where the family does not
step this way (the caller then runs the serial step).

[Note: gradient parts]
In mixed precision a record's gradient may have two parts: this micro-batch's, in the compute dtype in its param slot
(chunk reuse), and an fp32 sum in the GRAD chunk, of the earlier micro-batches of an accumulation (one rank) or of
every micro-batch (several ranks, where a reduced gradient is added to the sum). The step reads their sum,
``slot.float() + sum`` (:func:`~lightning_pstar.optim.grads.family_grads`). The job's Adam stage builds the same
values into its fp32 scratch (:class:`GradParts`): the slot converted from the host copy its D2H stage made, then the
sum added, elementwise the same two roundings as the serial step's, so an accumulated step is as bitwise the serial
step as one without accumulation. A record with no gradient at all does not step (its step count stays), which
only the record-by-record serial step does: such a family steps serially.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import torch

import lightning_pstar.optim.kernels as kernels
from lightning_pstar.optim.kernels import WholeFamilyPlan
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.disk_tier import DiskTier
from lightning_pstar.runtime.family import ChunkFamily
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.parked import ParkedParameterError, park, unpark
from lightning_pstar.runtime.pipeline import HostJob
from lightning_pstar.runtime.state import Tier

__all__ = ["GradParts", "ParkedParameterError", "grads_in_place", "host_job", "park", "snapshot_groups", "unpark"]


def snapshot_groups(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the param groups' hyper-parameters as they are now (a tensor value is cloned): what a job in
    flight reads, whatever an LR scheduler does to the groups meanwhile."""
    out = []
    for group in param_groups:
        copy = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}
        out.append(copy)
    return out


def grads_in_place(family: ChunkFamily, *, mixed: bool) -> bool:
    """Whether every record of ``family`` holds exactly this micro-batch's gradient where the whole-family step
    reads it (mixed precision: in the param slot, nothing summed in the GRAD chunk; 32-true: in the GRAD chunk):
    the condition of :func:`~lightning_pstar.optim.grads.whole_family_grad_range`, without building the range."""
    for record in family.records:
        in_slot, in_grad_chunk = record.grad_in_param_slot, record.grad_in_grad_chunk
        if (not in_slot or in_grad_chunk) if mixed else not in_grad_chunk:
            return False
    return True


@dataclass(frozen=True)
class GradParts:
    """Where the parts of a mixed-precision family's gradients are, record by record ([Note: gradient parts]):
    ``in_slot[i]``, this micro-batch's gradient in the compute dtype in the param slot; ``summed[i]``, the fp32
    sum of earlier micro-batches (or, at several ranks, of every micro-batch) in the GRAD chunk."""

    in_slot: tuple[bool, ...]
    summed: tuple[bool, ...]

    @classmethod
    def of(cls, family: ChunkFamily) -> GradParts | None:
        """The parts of ``family``'s gradients, or None where a record has no gradient (it does not step, which
        only the record-by-record step knows how to skip)."""
        in_slot = tuple(r.grad_in_param_slot for r in family.records)
        summed = tuple(r.grad_in_grad_chunk for r in family.records)
        if not all(a or b for a, b in zip(in_slot, summed, strict=True)):
            return None
        return cls(in_slot, summed)

    def build(self, plan: WholeFamilyPlan, out: torch.Tensor, slots: torch.Tensor, sums: torch.Tensor | None) -> None:
        """Write the fp32 gradients of ``plan``'s range into ``out``: ``slots`` is the param chunk's buffer (its
        compute-dtype copy on the host), ``sums`` the GRAD chunk's. Per element exactly what
        :func:`~lightning_pstar.optim.grads.family_grads` computes: ``slot.float().add_(sum)``, the slot alone
        converted, or a copy of the sum."""
        start, end = plan.start, plan.end
        any_sum = any(self.summed)
        if all(self.in_slot) and (all(self.summed) or not any_sum):  # one range op each (the usual cases)
            out.copy_(slots[start:end])  # exactly Tensor.float()
            if any_sum:
                assert sums is not None
                out.add_(sums[start:end])
            return
        if not any(self.in_slot) and all(self.summed):
            assert sums is not None
            out.copy_(sums[start:end])
            return
        assert sums is not None  # some records have a sum and some a slot gradient only
        views = zip(plan.range_slots(out), plan.slots(slots), plan.slots(sums), strict=True)
        for (target, slot, total), in_slot, summed in zip(views, self.in_slot, self.summed, strict=True):
            if in_slot:
                target.copy_(slot)
                if summed:
                    target.add_(total)
            else:
                target.copy_(total)


def host_job(
    manager: ChunkManager,
    family: ChunkFamily,
    plan: WholeFamilyPlan,
    *,
    groups: list[dict[str, Any]],
    steps_of: Callable[[], list[torch.Tensor]],
    inv_scale: float,
    coef: float,
    clip_value: float | None,
    streams: tuple[Any, Any] | None = None,
) -> HostJob | None:
    """The pipelined host step of ``family`` (Adam over ``plan``), or None where the serial step must run: its
    optimizer states are not on the host, its param chunk is not on the device, or its gradients are not where
    the whole-family step reads them. ``groups``: :func:`snapshot_groups` of the optimizer's groups; ``steps_of``:
    gives the records' step counts on the host (called once the job is sure to run: a count is state);
    ``streams``: the pipeline's two copy streams (CUDA only)."""
    residency = manager.residency
    chunk = family.param_chunk
    mixed = manager.mixed
    tier = residency.optimizer_tier_of(family)
    disk = residency.disk if tier is Tier.DISK else None
    if tier is not Tier.HOST and disk is None or chunk.tier is not Tier.DEVICE:
        return None
    grad_chunk = family.chunks.get(ChunkKind.GRAD)
    parts: GradParts | None = None
    if mixed:
        parts = GradParts.of(family)
        if parts is None:
            return None
        if any(parts.summed) and (grad_chunk is None or grad_chunk.tier is not Tier.HOST):
            return None  # the sums are on the device (an undeclared accumulation that fit there): serial step
    elif not grads_in_place(family, mixed=False) or grad_chunk is None or grad_chunk.tier is not Tier.HOST:
        return None
    master_chunk = family.chunks.get(ChunkKind.MASTER)
    if mixed and (master_chunk is None or master_chunk.tier is not tier):
        return None
    if disk is not None and not disk.free_sets:
        return None  # the caller finishes a disk job in flight first (see ChunkedOptimizer._step_families)
    steps = steps_of()
    # a disk family's states are read into a lent buffer set now; the Adam stage waits for them, and issues their
    # write-back, which the finish waits for (read k+1, Adam k and write k-1 overlap: [Note: disk families])
    reads = disk.begin_load(family) if disk is not None else []
    writes: list[Future[None]] = []
    host, current = residency.stage_host(family)
    device = chunk.device_buffer
    states = (family.chunks[ChunkKind.EXP_AVG].data, family.chunks[ChunkKind.EXP_AVG_SQ].data)
    master = master_chunk.data if mixed and master_chunk is not None else host
    grads_32 = grad_chunk.data if grad_chunk is not None else None  # 32-true: the gradients; mixed: the sums
    copies = _Copies(device, host, skip_out=current, streams=streams)
    numel = plan.end - plan.start

    def adam(scratch: torch.Tensor) -> None:
        for read in reads:
            read.result()
        if parts is not None:
            grad_range = scratch
            parts.build(plan, grad_range, host, grads_32)
            if inv_scale != 1.0:
                grad_range.mul_(inv_scale)
        else:
            assert grads_32 is not None
            grad_range = grads_32[plan.start : plan.end]
            if inv_scale != 1.0:
                grad_range = grad_range.mul(inv_scale)
        masters = kernels.adam_on_plan(
            plan, groups, grad_range, (master, *states), steps, coef=coef, clip_value=clip_value
        )
        if mixed:
            torch._foreach_copy_(plan.slots(host), masters)
        if disk is not None:
            writes.extend(disk.begin_write(family))

    def finish(copied_back: bool) -> None:
        if disk is not None:
            disk.end_load(family, writes)  # raises a failed write-back, naming its file
        if copied_back:
            copies.wait_back()
            residency.unstage(family)
        else:  # the new weights stay in the host buffer: the param chunk lives there now
            residency.unstage_to_host(family)
        for record in family.records:
            if mixed:
                manager.slot_holds_weight(record)  # the parameter points at the new weight again
            else:
                residency.point_at_chunk(record)

    job = HostJob(
        family_id=family.family_id,
        d2h=copies.out,
        adam=adam,
        h2d=copies.back,
        finish=finish,
        scratch_numel=numel if mixed else 0,
        copies_use_cpu=not device.is_cuda,
        copies_out=not current,
        opened=copies.opened,
    )
    if disk is not None:  # a stage raised: every transfer ends and the buffer set is freed, then the error goes on
        job.failed.append(lambda: _end_failed_load(disk, family, [*reads, *writes]))
    return job


def _end_failed_load(disk: DiskTier, family: ChunkFamily, pending: list[Future[None]]) -> None:
    with suppress(Exception):  # the stage's own error is the one to see
        disk.end_load(family, pending)


class _Copies:
    """The job's two copies between the device buffer and the staging host buffer: plain copies on a CPU; on CUDA
    on side streams, ordered after the compute stream's work at submission ([Note: streams] in ``chunk.py``)."""

    def __init__(
        self, device: torch.Tensor, host: torch.Tensor, *, skip_out: bool, streams: tuple[Any, Any] | None
    ) -> None:
        self.device, self.host, self.skip_out = device, host, skip_out
        self.cuda = device.is_cuda
        self._ready: torch.cuda.Event | None = None
        self._open: torch.cuda.Event | None = None
        self._back: torch.cuda.Event | None = None
        if self.cuda:  # the gradients were written by kernels queued on the compute stream until now
            assert streams is not None, "a CUDA job needs the pipeline's copy streams"
            self._out_stream, self._back_stream = streams
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(device.device))

    def out(self) -> None:
        if self.skip_out:
            return
        if not self.cuda:
            self.host.copy_(self.device)
            return
        assert self._ready is not None
        with torch.cuda.stream(self._out_stream):
            self._out_stream.wait_event(self._ready)
            self.host.copy_(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._out_stream)
        done.synchronize()  # the Adam stage reads the host bytes next

    def opened(self) -> None:
        """The calling thread: the copy back may run from now on. On CUDA it waits for the compute stream's work
        queued until now: kernels of the backward that read the device bytes may still be queued when the engine
        lets it run (at the backward's end, or inside it once nothing autograd saved reads them any more)."""
        if self.cuda:
            self._open = torch.cuda.Event()
            self._open.record(torch.cuda.current_stream(self.device.device))

    def back(self) -> None:
        if not self.cuda:
            self.device.copy_(self.host)
            return
        with torch.cuda.stream(self._back_stream):
            after = self._open if self._open is not None else self._ready
            if after is not None:
                self._back_stream.wait_event(after)
            self.device.copy_(self.host, non_blocking=True)
            self._back = torch.cuda.Event()
            self._back.record(self._back_stream)

    def wait_back(self) -> None:
        """The calling thread: the compute stream waits for the copy back (no CPU synchronisation)."""
        if self._back is not None:
            torch.cuda.current_stream(self.device.device).wait_event(self._back)
