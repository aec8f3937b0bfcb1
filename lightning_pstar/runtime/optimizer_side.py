"""The optimizer side's placement: which tier each family's optimizer states (and so its step) use.

:func:`plan_hybrid_optimizer` keeps whole optimizer-state families on the device as far as the margin at the step
allows, at the warm-up's end ([Note: where the warm-up steps] in ``placement.py``); :func:`optimizer_placement_summary`
says where the step runs, for the memory report. Both read and move the chunks of a :class:`Residency`
(``Residency.optimizer_tier_of`` stays with it: the per-module verbs ask it).
"""

from __future__ import annotations

import logging

from lightning_pstar.planning.requirements import step_temporary_bytes
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.residency import Residency
from lightning_pstar.runtime.state import Tier

__all__ = ["optimizer_placement_summary", "plan_hybrid_optimizer"]

log = logging.getLogger(__name__)


def plan_hybrid_optimizer(residency: Residency, peak_non_model: int) -> None:
    """Keep whole optimizer-state families on the device as far as the margin at the step allows, in family
    order: a family on the host that fits comes to the device, one on the device that does not fit goes to the
    host (its pinned blocks are given back by the caller, :func:`~lightning_pstar.runtime.warmup.end_warmup`)."""
    assert residency.device_budget is not None
    params = sum(f.param_chunk.nbytes for f in residency.families)
    # CUDA: the device-side step's fp32 gradient copy of one family at a time is budgeted too (issue 12; the
    # simulated device measures saved tensors only, no temporaries)
    on_cuda = [f for f in residency.families if f.trainable and residency.device.type == "cuda"]
    temporary = max((step_temporary_bytes(f.capacity, mixed=ChunkKind.MASTER in f.chunks) for f in on_cuda), default=0)
    margin = residency.device_budget - peak_non_model - params - temporary
    on_device = 0
    for family in residency.families:
        if not family.trainable:
            continue  # a frozen family's fp32 copy is only read by state dicts
        side = [c for k, c in family.chunks.items() if k is not ChunkKind.PARAM and c.tier is not None]
        nbytes = sum(c.nbytes for c in side)
        if not side or any(c.tier is Tier.DISK for c in side):
            continue  # a disk family stays where the plan put it ([Note: disk families])
        # [Note: where the warm-up steps] in placement.py: families that started on the device and do not fit
        # the margin go to the host, the others stay; families on the host that fit come to the device
        tier = Tier.DEVICE if nbytes <= margin else Tier.HOST
        moving = [c for c in side if c.tier is not tier]
        if moving and family.family_id in residency.stepping and residency.finish_stepping is not None:
            residency.finish_stepping()  # the warm-up step's tail ("next_forward") still steps these states
        for chunk in moving:
            if tier is Tier.HOST:
                residency.check_host_room(chunk.nbytes, chunk=chunk)
                residency.optimizer_tier = Tier.HOST  # optimizer chunks created later start on the host
            chunk.move_to(tier)
        if moving:
            for record in family.records:
                if record.grad_in_param_slot:  # the parameter reads its master (see point_at_chunk)
                    residency.point_at_chunk(record)
        if tier is Tier.DEVICE:
            margin -= nbytes
            on_device += 1
    log.debug("PatrickStar: %d of %d optimizer-state families run on the device", on_device, len(residency.families))


def optimizer_placement_summary(residency: Residency) -> str:
    """Where the optimizer steps, for the memory report: one tier, or how the families split between two."""
    tiers = [residency.optimizer_tier_of(f) for f in residency.families if f.trainable and len(f.chunks) > 1]
    if not tiers:
        return residency.optimizer_tier.value
    on_device = sum(t is Tier.DEVICE for t in tiers)
    on_disk = sum(t is Tier.DISK for t in tiers)
    if on_disk:
        return f"host for {len(tiers) - on_disk} of {len(tiers)} families, disk for the rest"
    if on_device in (0, len(tiers)):
        return tiers[0].value
    return f"device for {on_device} of {len(tiers)} families, host for the rest"
