"""The serial step of one family: what :class:`~lightning_pstar.optim.optimizer.ChunkedOptimizer` runs for a family
no pipelined host job steps (:mod:`lightning_pstar.optim.host_step`), on the tier its optimizer states live on.

Two paths, with the same fused kernels (:mod:`lightning_pstar.optim.kernels`):

- whole family (Adam, every record holding exactly this micro-batch's gradient, slots in record order):
  one gradient conversion and one fused call per param group for the whole chunk range;
- record by record (the rest: accumulated or missing gradients, SGD).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Protocol

import torch

import lightning_pstar.optim.kernels as kernels
from lightning_pstar.optim.grads import family_grads, whole_family_grad_range
from lightning_pstar.optim.kernels import WholeFamilyPlan
from lightning_pstar.optim.state_dict import OptimizerBook
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
from lightning_pstar.runtime.state import Tier

if TYPE_CHECKING:
    from lightning_pstar.runtime.manager import ChunkManager

__all__ = ["SerialFamilyStep", "step_host_params"]


class _Groups(Protocol):
    """What :class:`SerialFamilyStep` reads of the optimizer it serves (``ChunkedOptimizer``; a protocol, so that
    this module does not import the optimizer that imports it): both are read at every step."""

    param_groups: list[dict[str, Any]]
    gradient_policy: Any


class SerialFamilyStep:
    """Steps one family at a time with the user's optimizer's kernels (the optimizer's own bookkeeping)."""

    def __init__(self, optimizer: _Groups, manager: ChunkManager, book: OptimizerBook) -> None:
        self._optimizer = optimizer
        self._manager = manager
        self._book = book
        # family id -> how to step it as a whole, None where it cannot be (layout and groups are fixed)
        self._whole_plans: dict[int, WholeFamilyPlan | None] = {}

    def step_family(self, family: ChunkFamily, coef: float) -> None:
        """Step ``family`` where its optimizer states live (fetched to the device, or on the host, or on buffers
        read from disk and written back after)."""
        manager = self._manager
        tier = manager.residency.optimizer_tier_of(family)
        if tier is Tier.DISK:  # the host step on buffers read from disk, written back after ([Note: disk families])
            manager.residency.move_param_chunk(family, Tier.HOST)
            assert manager.disk is not None
            with manager.disk.loaded(family, write=True):
                self._step_family_here(family, coef)
            return
        if tier is Tier.HOST:
            manager.residency.move_param_chunk(family, Tier.HOST)  # the update runs where the optimizer states live
        else:
            manager.residency.fetch(family, protect={family.family_id})
        self._step_family_here(family, coef)

    def _step_family_here(self, family: ChunkFamily, coef: float) -> None:
        """The step of ``family`` on the tier its param chunk and optimizer states are on now."""
        manager = self._manager
        if self._book.is_adam and self._step_whole_family(family, coef):
            return
        policy = self._optimizer.gradient_policy
        grads = family_grads(family, self._book.group_of, mixed=manager.mixed, inv_scale=policy.inv_scale)
        if not grads:
            return
        kernels.scale_and_clamp(list(grads.values()), coef, policy.clip_value)
        master = family.chunks.get(ChunkKind.MASTER, family.param_chunk)
        by_group: dict[int, list[ParamRecord]] = defaultdict(list)
        for record in family.records:
            if record.index in grads:
                by_group[self._book.group_of[record.index]].append(record)
        for gi, records in sorted(by_group.items()):
            params = [master.slot_view(r.slot) for r in records]
            device = params[0].device
            group_grads = [
                grads[r.index] if grads[r.index].device == device else grads[r.index].to(device) for r in records
            ]
            self._update_records(self._optimizer.param_groups[gi], family, records, params, group_grads)
        if manager.mixed:
            for record in family.records:
                if record.index in grads:
                    family.param_chunk.slot_view(record.slot).copy_(master.slot_view(record.slot))
                    manager.slot_holds_weight(record)  # the parameter points at the new weight again

    def _update_records(
        self,
        group: dict[str, Any],
        family: ChunkFamily,
        records: list[ParamRecord],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
    ) -> None:
        """The kernel of the user's optimizer on some records of one param group (their master slots)."""
        book = self._book
        if book.is_adam:
            exp_avg = family.chunks[ChunkKind.EXP_AVG]
            exp_avg_sq = family.chunks[ChunkKind.EXP_AVG_SQ]
            kernels.fused_adam(
                group,
                params,
                grads,
                [exp_avg.slot_view(r.slot) for r in records],
                [exp_avg_sq.slot_view(r.slot) for r in records],
                [book.step_tensor(r, params[0].device) for r in records],
            )
        elif group["momentum"] == 0:
            kernels.fused_sgd(group, params, grads, [None] * len(params))
        else:
            buffers = family.chunks[ChunkKind.EXP_AVG]
            started = [r.index in book.momentum_started for r in records]
            kernels.momentum_sgd(group, params, grads, [buffers.slot_view(r.slot) for r in records], started)
            book.momentum_started.update(r.index for r in records)

    def whole_family_plan(self, family: ChunkFamily) -> WholeFamilyPlan | None:
        """The family's plan, or None when a record is outside the optimizer's param groups or the slots are
        not in record order (computed once: layout and groups are fixed)."""
        if family.family_id not in self._whole_plans:
            group_of = self._book.group_of
            plan = None
            if all(r.index in group_of for r in family.records):
                plan = WholeFamilyPlan.build(
                    [(r.slot.offset, r.slot.numel) for r in family.records],
                    [group_of[r.index] for r in family.records],
                )
            self._whole_plans[family.family_id] = plan
        return self._whole_plans[family.family_id]

    def _step_whole_family(self, family: ChunkFamily, coef: float) -> bool:
        """Adam on a whole family at once (the same arithmetic as record by record); False when it does not
        apply (see :func:`~lightning_pstar.optim.grads.whole_family_grad_range`)."""
        plan = self.whole_family_plan(family)
        if plan is None:
            return False
        manager, policy = self._manager, self._optimizer.gradient_policy
        grad_range = whole_family_grad_range(family, plan, mixed=manager.mixed, inv_scale=policy.inv_scale)
        if grad_range is None:
            return False
        param_chunk = family.param_chunk
        master = family.chunks.get(ChunkKind.MASTER, param_chunk).data
        masters = kernels.adam_on_plan(
            plan,
            self._optimizer.param_groups,
            grad_range,
            (master, family.chunks[ChunkKind.EXP_AVG].data, family.chunks[ChunkKind.EXP_AVG_SQ].data),
            [self._book.step_tensor(r, master.device) for r in family.records],
            coef=coef,
            clip_value=policy.clip_value,
        )
        if manager.mixed:
            torch._foreach_copy_(plan.slots(param_chunk.data), masters)
            for record in family.records:
                manager.slot_holds_weight(record)  # the parameter points at the new weight again
        return True


def step_host_params(
    book: OptimizerBook,
    param_groups: list[dict[str, Any]],
    grads: dict[int, torch.Tensor],
    coef: float,
    clip_value: float | None,
) -> None:
    """Step the host-resident parameters (``cpu_embedding``) of ``param_groups`` that have gradients (``grads``, by
    ``id``) with the same fused kernels as the chunks; their states live beside them, in ``book.host_state``."""
    if not grads:
        return
    host_state = book.host_state
    for group in param_groups:
        params = [p for p in group["params"] if id(p) in grads]
        if not params:
            continue
        g = [grads[id(p)] for p in params]
        kernels.scale_and_clamp(g, coef, clip_value)
        data = [p.detach() for p in params]
        if book.is_adam:
            states = [host_state.setdefault(id(p), {}) for p in params]
            for p, st in zip(params, states, strict=True):
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs = [st["exp_avg"] for st in states]
            kernels.fused_adam(
                group, data, g, exp_avgs, [st["exp_avg_sq"] for st in states], [st["step"] for st in states]
            )
            continue
        for p, x, grad in zip(params, data, g, strict=True):
            # one call per parameter: each momentum buffer starts on its parameter's first step
            state = host_state.setdefault(id(p), {})
            bufs: list[torch.Tensor | None] = [state.get("momentum_buffer")]
            kernels.fused_sgd(group, [x], [grad], bufs)
            if bufs[0] is not None:
                state["momentum_buffer"] = bufs[0]
