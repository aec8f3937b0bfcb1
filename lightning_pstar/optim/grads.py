"""The gradients an optimizer step reads: fp32 and unscaled, from wherever the engine left them.

:func:`grad_location_of` says where a record's gradient lives as a :class:`GradLocation`; the loops over records
here read the record's two bools it is made of (``grad_in_param_slot``, ``grad_in_grad_chunk``).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import TYPE_CHECKING

import torch

import lightning_pstar.optim.kernels as kernels
from lightning_pstar.optim.kernels import WholeFamilyPlan
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.comm import ChunkComm
from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
from lightning_pstar.runtime.state import GradLocation

if TYPE_CHECKING:
    from lightning_pstar.runtime.manager import ChunkManager

__all__ = ["family_grads", "global_norm", "grad_location_of", "host_grads", "whole_family_grad_range"]


def grad_location_of(record: ParamRecord) -> GradLocation:
    """Where ``record``'s gradient for the coming step lives."""
    return record.grad


def family_grads(
    family: ChunkFamily, in_optimizer: Container[int], *, mixed: bool, inv_scale: float
) -> dict[int, torch.Tensor]:
    """fp32, unscaled gradients of the family's records that have one and are in ``in_optimizer`` (record
    indices), keyed by record index.

    In 32-true these are views of the GRAD chunk (scaled copies when ``inv_scale`` is not 1); in mixed
    precision fresh fp32 tensors built from the param slot (this micro-batch) plus the fp32 accumulation
    slot (earlier micro-batches), so they may be scaled in place.
    """
    out: dict[int, torch.Tensor] = {}
    grad_chunk = family.chunks.get(ChunkKind.GRAD)
    for record in family.records:
        if record.index not in in_optimizer:
            continue
        grad: torch.Tensor | None = None
        if record.grad_in_param_slot:
            grad = family.param_chunk.slot_view(record.slot).float()
        if record.grad_in_grad_chunk:
            assert grad_chunk is not None
            acc = grad_chunk.slot_view(record.slot)
            if grad is not None:
                grad = grad.add_(acc.to(grad.device))
            else:
                grad = acc.clone() if mixed else acc  # never scale the accumulation buffer in place
        if grad is None:
            continue
        if inv_scale != 1.0:
            grad = grad.mul_(inv_scale) if mixed else grad.mul(inv_scale)
        out[record.index] = grad
    return out


def whole_family_grad_range(
    family: ChunkFamily, plan: WholeFamilyPlan, *, mixed: bool, inv_scale: float
) -> torch.Tensor | None:
    """The fp32, unscaled gradients of the slot range ``plan`` covers, when every record holds exactly this
    micro-batch's gradient (mixed precision: in the param slot, nothing accumulated; 32-true: in the GRAD
    chunk); None otherwise. One conversion for the whole range; padding is only read into the temporary."""
    for record in family.records:  # the record's two bools (its GradLocation costs a Flag per record)
        in_slot, in_grad_chunk = record.grad_in_param_slot, record.grad_in_grad_chunk
        if (not in_slot or in_grad_chunk) if mixed else not in_grad_chunk:
            return None
    if mixed:
        grad_range = family.param_chunk.data[plan.start : plan.end].float()
        if inv_scale != 1.0:
            grad_range.mul_(inv_scale)
        return grad_range
    grad_range = family.chunks[ChunkKind.GRAD].data[plan.start : plan.end]
    return grad_range.mul(inv_scale) if inv_scale != 1.0 else grad_range


def host_grads(params: Sequence[torch.Tensor], comm: ChunkComm, inv_scale: float) -> dict[int, torch.Tensor]:
    """Unscaled fp32 gradients of host-resident parameters (cpu_embedding), keyed by parameter id.

    Host parameters are replicated on every rank: with several ranks their gradients are averaged like DDP
    (a collective per parameter, so every rank passes the same ``params`` in the same order).
    """
    out: dict[int, torch.Tensor] = {}
    for p in params:
        if comm.distributed:
            g = p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
            flag = torch.tensor([0.0 if p.grad is None else 1.0])
            comm.all_reduce_max_(flag)
            comm.all_reduce_sum_(g)
            if flag.item() == 0.0:
                continue
            out[id(p)] = g.mul_(inv_scale / comm.world_size)
        elif p.grad is not None:
            g = p.grad.float()
            out[id(p)] = g.mul_(inv_scale) if g is not p.grad else g.mul(inv_scale)
    return out


def global_norm(
    manager: ChunkManager,
    families: Sequence[ChunkFamily],
    on_host: dict[int, torch.Tensor],
    in_optimizer: Container[int],
    inv_scale: float,
    check_finite: bool,
    norms_of: Callable[[ChunkFamily], torch.Tensor | None] | None,
) -> tuple[bool, torch.Tensor | None]:
    """Whether every gradient is finite, and the global 2-norm, over all ranks (each owns a share): of the gradients
    of ``families`` (their records in ``in_optimizer``) and of the host-resident ``on_host``. ``norms_of``: a
    family's norms computed during the backward, where they were ([Note: gradient norms inside the backward] in
    optim/overlap.py)."""
    mixed, device = manager.mixed, manager.device
    # family by family: one family's fp32 gradients exist at a time (not a copy of every gradient at once)
    parts: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    if on_host:
        parts.append(kernels.local_norms([list(on_host.values())], check_finite=check_finite, device=device))
    for family in families:
        done = norms_of(family) if norms_of is not None else None
        if done is not None:
            parts.append((done.to(device), None))
            continue
        grads = family_grads(family, in_optimizer, mixed=mixed, inv_scale=inv_scale)
        parts.append(kernels.local_norms([list(grads.values())], check_finite=check_finite, device=device))
        del grads
    norms, nonfinite = kernels.join_norms(parts, check_finite=check_finite, device=device)
    comm = manager.comm
    if not comm.distributed:
        return kernels.read_norm_and_finite(kernels.total_norm(norms), nonfinite)
    # every rank holds the gradients of the families it owns: sum squares and flags over ranks, on device
    zero = torch.zeros((), dtype=torch.float64, device=device)
    squares = norms.double().square().sum() if norms is not None else zero
    packed = torch.stack([squares, nonfinite.double() if nonfinite is not None else zero])
    comm.all_reduce_sum_(packed)
    return kernels.read_norm_and_finite(torch.sqrt(packed[0]), packed[1])
