"""The optimizer's arithmetic: torch's fused Adam/AdamW and SGD kernels, the global norm and clipping.

Functions over tensors (slot views of chunks, or plain tensors) and the hyper-parameters of one param
group as they are now (an LR scheduler may have changed them since the last step). Nothing here knows
chunks, records or the manager, so every path of the step (whole family, record by record, host-resident
parameters) runs the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.adam import adam as adam_functional
from torch.optim.sgd import sgd as sgd_functional

__all__ = [
    "WholeFamilyPlan",
    "adam_on_plan",
    "clip_coefficient",
    "fused_adam",
    "fused_sgd",
    "grad_norms",
    "join_norms",
    "local_norms",
    "momentum_sgd",
    "read_norm_and_finite",
    "scale_and_clamp",
    "total_norm",
]


# ---- update kernels ---------------------------------------------------------------------------------------
def fused_adam(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
) -> None:
    """torch's fused Adam/AdamW kernel, in place, with the hyper-parameters of one param group."""
    beta1, beta2 = group["betas"]
    adam_functional(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        fused=True,
        decoupled_weight_decay=bool(group.get("decoupled_weight_decay", False)),
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=bool(group["maximize"]),
    )


def fused_sgd(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor | None],
) -> None:
    """torch's fused SGD kernel, in place, with the hyper-parameters of one param group. A ``None`` buffer
    (with momentum) is created by the kernel as a copy of the first gradient and written back into the list."""
    sgd_functional(
        params,
        grads,
        momentum_buffers,
        fused=True,
        weight_decay=group["weight_decay"],
        momentum=group["momentum"],
        lr=group["lr"],
        dampening=group["dampening"],
        nesterov=bool(group["nesterov"]),
        maximize=bool(group["maximize"]),
    )


def momentum_sgd(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    buffers: list[torch.Tensor],
    started: Sequence[bool],
) -> None:
    """SGD with momentum buffers that live in given storage (slot views of a chunk).

    ``started[i]``: ``buffers[i]`` holds a momentum value. torch starts a buffer as a copy of the first
    gradient (not as zeros): the kernel creates the fresh ones, and they are copied into their storage.
    Afterwards every buffer is started.
    """
    old = [i for i, s in enumerate(started) if s]
    fresh = [i for i, s in enumerate(started) if not s]
    if old:
        fused_sgd(group, [params[i] for i in old], [grads[i] for i in old], [buffers[i] for i in old])
    if fresh:
        new_bufs: list[torch.Tensor | None] = [None] * len(fresh)
        fused_sgd(group, [params[i] for i in fresh], [grads[i] for i in fresh], new_bufs)
        for i, buf in zip(fresh, new_bufs, strict=True):
            assert buf is not None
            buffers[i].copy_(buf)


# ---- gradient norm and clipping ---------------------------------------------------------------------------
def grad_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of every gradient of ``grads`` (not empty), stacked where they live: what :func:`local_norms`
    computes for one list before moving it to its device."""
    return torch.stack(torch._foreach_norm(grads, 2.0))


def local_norms(
    grad_lists: Iterable[list[torch.Tensor]], *, check_finite: bool, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The 2-norm of every gradient, stacked on ``device`` (None without any), and, with ``check_finite``,
    the count of non-finite gradients there (a 0-d tensor; None otherwise).

    Device reductions only, no host synchronisation: one ``torch._foreach_norm`` per list (plus one
    inf-norm per list for the check: a gradient is finite iff its largest magnitude is, whereas its 2-norm
    can overflow on finite values) and one transfer per list. The caller reads the result once a step.
    """
    norms: list[torch.Tensor] = []
    bad: list[torch.Tensor] = []
    for grads in grad_lists:
        if not grads:
            continue
        norms.append(grad_norms(grads).to(device))
        if check_finite:
            peaks = torch.stack(torch._foreach_norm(grads, float("inf")))
            bad.append((~torch.isfinite(peaks)).sum().to(device, torch.float32).reshape(1))
    stacked = torch.cat(norms) if norms else None
    nonfinite = torch.cat(bad).sum() if bad else (torch.zeros((), device=device) if check_finite else None)
    return stacked, nonfinite


def join_norms(
    parts: list[tuple[torch.Tensor | None, torch.Tensor | None]], *, check_finite: bool, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What :func:`local_norms` gives for several lists at once, from its results per list (in order): the same
    stacked norms and non-finite count, built part by part so that each part's gradients can be freed first."""
    norms = [n for n, _ in parts if n is not None]
    bad = [b.reshape(1) for _, b in parts if b is not None]
    stacked = torch.cat(norms) if norms else None
    nonfinite = torch.cat(bad).sum() if bad else (torch.zeros((), device=device) if check_finite else None)
    return stacked, nonfinite


def total_norm(norms: torch.Tensor | None) -> torch.Tensor | None:
    """The global 2-norm of gradients whose norms are ``norms`` (None without any)."""
    return torch.linalg.vector_norm(norms, 2.0) if norms is not None else None


def read_norm_and_finite(
    total: torch.Tensor | None, nonfinite: torch.Tensor | None
) -> tuple[bool, torch.Tensor | None]:
    """One host synchronisation for the step: whether every gradient is finite, and the global norm as a
    CPU fp32 scalar (None without gradients)."""
    parts = [t.reshape(1).to(torch.float32) for t in (total, nonfinite) if t is not None]
    if not parts:
        return True, None
    values = torch.cat([p.to(parts[0].device) for p in parts]).cpu()  # the one sync
    finite = nonfinite is None or bool(values[-1] == 0)
    return finite, values[0].clone() if total is not None else None


def clip_coefficient(clip_norm: float, total: torch.Tensor) -> float:
    """The factor clipping by norm applies to every gradient, as ``torch.nn.utils.clip_grad_norm_`` computes
    it (nan for a non-finite norm, as that function with ``error_if_nonfinite=False`` gives)."""
    coef = min(1.0, float(clip_norm / (total + 1e-6)))
    if not math.isfinite(float(total)):
        coef = float("nan")
    return coef


def scale_and_clamp(grads: list[torch.Tensor], coef: float, clip_value: float | None) -> None:
    """In place: multiply by the clipping-by-norm coefficient, then clip by value."""
    if coef != 1.0:
        torch._foreach_mul_(grads, coef)
    if clip_value is not None:
        for g in grads:
            g.clamp_(-clip_value, clip_value)


# ---- the whole-family step --------------------------------------------------------------------------------
@dataclass(frozen=True)
class WholeFamilyPlan:
    """A family whose slots lie in record order: ``buffer[start:end]`` split by ``sizes`` gives every slot
    (even parts) and the gaps between them (odd parts: padding). ``groups``: each param group holding some
    of the family's records, with their positions in the family's records (ascending group index)."""

    start: int
    end: int
    sizes: list[int]
    groups: list[tuple[int, list[int]]]

    def slots(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """1-D views of every slot of ``buffer`` (a chunk's 1-D buffer, or a range of it), in record order."""
        return list(buffer[self.start : self.end].split_with_sizes(self.sizes)[::2])

    def range_slots(self, values: torch.Tensor) -> list[torch.Tensor]:
        """1-D views of every slot of ``values``, a tensor holding ``buffer[start:end]``."""
        return list(values.split_with_sizes(self.sizes)[::2])

    @classmethod
    def build(cls, spans: Sequence[tuple[int, int]], group_of: Sequence[int]) -> WholeFamilyPlan | None:
        """The plan for slots ``spans`` (``(offset, numel)`` per record, in record order) whose records are in
        param groups ``group_of``; None when the slots are not in record order (or overlap)."""
        if not spans:
            return None
        sizes: list[int] = []
        start = end = spans[0][0]
        for offset, numel in spans:
            if offset < end:
                return None  # not in record order (or overlapping): step record by record
            if sizes:
                sizes.append(offset - end)  # the gap before this slot
            sizes.append(numel)
            end = offset + numel
        by_group: dict[int, list[int]] = {}
        for position, gi in enumerate(group_of):
            by_group.setdefault(gi, []).append(position)
        return cls(start=start, end=end, sizes=sizes, groups=sorted(by_group.items()))


def adam_on_plan(
    plan: WholeFamilyPlan,
    param_groups: list[dict[str, Any]],
    grad_range: torch.Tensor,
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    steps: list[torch.Tensor],
    *,
    coef: float,
    clip_value: float | None,
) -> list[torch.Tensor]:
    """Adam on every slot of a family at once: one fused call per param group.

    ``grad_range``: the fp32, unscaled gradients of ``[plan.start, plan.end)`` (scaled and clamped in place,
    padding included in the temporary, never written to a chunk); ``buffers``: the 1-D master, exp_avg and
    exp_avg_sq buffers; ``steps``: the step count of each record. Returns the master's slot views.
    """
    master, exp_avg, exp_avg_sq = buffers
    grads = plan.range_slots(grad_range)
    scale_and_clamp(grads, coef, clip_value)
    params = plan.slots(master)
    device = params[0].device
    if grad_range.device != device:
        grads = plan.range_slots(grad_range.to(device))
    exp_avgs = plan.slots(exp_avg)
    exp_avg_sqs = plan.slots(exp_avg_sq)
    for gi, positions in plan.groups:
        fused_adam(
            param_groups[gi],
            [params[i] for i in positions],
            [grads[i] for i in positions],
            [exp_avgs[i] for i in positions],
            [exp_avg_sqs[i] for i in positions],
            [steps[i] for i in positions],
        )
    return params
