"""Chunked optimizers: the user's Adam, AdamW or SGD, stepped family by family on the chunks.

The user's optimizer object keeps its ``param_groups`` (shared with this wrapper), so LR schedulers
created in ``configure_optimizers`` change the learning rate this optimizer uses at every step. The
arithmetic is torch's own fused kernels (``torch.optim.adam.adam`` / ``torch.optim.sgd.sgd`` with
``fused=True``), run on slot views of the fp32 master, gradient and state chunks.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.adam import adam as adam_functional
from torch.optim.sgd import sgd as sgd_functional

from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.manager import ChunkFamily, ChunkManager, ParamRecord
from lightning_pstar.runtime.state import Tier

__all__ = ["ChunkedOptimizer", "GradientPolicy", "SUPPORTED_OPTIMIZERS"]

log = logging.getLogger(__name__)

SUPPORTED_OPTIMIZERS: tuple[type[Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


@dataclass(kw_only=True)
class GradientPolicy:
    """What to do to the gradients before the update: set by the precision plugin every step."""

    inv_scale: float = 1.0  # 1 / loss scale (fp16)
    check_finite: bool = False  # fp16: skip the step on inf/nan
    clip_norm: float | None = None
    clip_value: float | None = None


@dataclass
class StepResult:
    """What the last :meth:`ChunkedOptimizer.step` did."""

    skipped: bool = False  # an inf/nan gradient skipped the update
    total_norm: float | None = None  # the global gradient norm, when clipping by norm


def _fused_adam(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
) -> None:
    """torch's fused Adam/AdamW kernel with the hyper-parameters of one param group (as they are now)."""
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


@dataclass(frozen=True)
class _WholeFamilyPlan:
    """A family whose slots lie in record order: ``buffer[start:end]`` split by ``sizes`` gives every slot
    (even parts) and the gaps between them (odd parts: padding). ``groups``: each param group holding some
    of the family's records, with their positions in ``family.records`` (ascending group index)."""

    start: int
    end: int
    sizes: list[int]
    groups: list[tuple[int, list[int]]]

    def slots(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """1-D views of every slot of ``buffer`` (a chunk's 1-D buffer), in record order."""
        return list(buffer[self.start : self.end].split_with_sizes(self.sizes)[::2])


class ChunkedOptimizer(Optimizer):
    """Steps ``optimizer``'s hyper-parameters on the chunks of ``manager``."""

    def __init__(self, optimizer: Optimizer, manager: ChunkManager) -> None:
        if type(optimizer) not in SUPPORTED_OPTIMIZERS:
            names = ", ".join(f"torch.optim.{c.__name__}" for c in SUPPORTED_OPTIMIZERS)
            raise TypeError(
                f"PatrickStar cannot run optimizer {type(optimizer).__module__}.{type(optimizer).__qualname__}."
                f" Supported: {names}. HINT: return one of these from `configure_optimizers`."
            )
        self._check_options(optimizer, manager)
        self._user_optimizer = optimizer
        self._manager = manager
        self._is_adam = isinstance(optimizer, torch.optim.Adam)  # AdamW subclasses Adam
        # the Optimizer interface (param_groups shared with the user's optimizer, so schedulers act here)
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state: defaultdict[Any, Any] = defaultdict(dict)
        # the hook tables Optimizer.__init__ would create (it is not called: it would re-add param groups)
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self.gradient_policy = GradientPolicy()
        self.last_step = StepResult()
        self._group_of: dict[int, int] = {}  # record index -> param group index
        self._steps: dict[int, torch.Tensor] = {}  # record index -> step count (float32 scalar, on its tier)
        self._momentum_started: set[int] = set()  # SGD: records whose momentum buffer holds a value
        self._host_group: dict[int, int] = {}  # id of a host-resident parameter (cpu_embedding) -> group
        self._host_state: dict[int, dict[str, torch.Tensor]] = {}  # its optimizer state, torch's names
        # family id -> how to step it as a whole (see _whole_family_plan), None where it cannot be
        self._whole_plans: dict[int, _WholeFamilyPlan | None] = {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if manager.is_host_param(p):
                    self._host_group[id(p)] = gi
                    continue
                record = manager.record_of(p)
                if record.trainable:
                    self._group_of[record.index] = gi
        kinds = [ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ] if self._is_adam else []
        if not self._is_adam and any(g["momentum"] != 0 for g in self.param_groups):
            kinds = [ChunkKind.EXP_AVG]
        manager.add_optimizer_chunks(kinds)

    @staticmethod
    def _check_options(optimizer: Optimizer, manager: ChunkManager) -> None:
        for gi, group in enumerate(optimizer.param_groups):
            for key in ("amsgrad", "capturable", "differentiable"):
                if group.get(key):
                    raise ValueError(
                        f"{type(optimizer).__name__}({key}=True) in param group {gi} is not supported by"
                        f" PatrickStar. HINT: set {key}=False."
                    )
            if group.get("foreach") or group.get("fused") is False:
                log.warning(
                    "PatrickStar always uses torch's fused optimizer kernels; the foreach/fused setting of"
                    " param group %d is ignored.",
                    gi,
                )
            for p in group["params"]:
                if manager.is_host_param(p):
                    continue
                try:
                    manager.record_of(p)
                except KeyError:
                    raise ValueError(
                        f"Param group {gi} of {type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)}"
                        " that is not a parameter of the LightningModule. HINT: build the optimizer from"
                        " `self.parameters()` inside `configure_optimizers`."
                    ) from None

    # ---- the step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # LR schedulers created on the user's optimizer check that its step ran before theirs
        self._user_optimizer._opt_called = True  # type: ignore[attr-defined]
        manager = self._manager
        policy = self.gradient_policy
        manager.step_moment()
        families = [f for f in manager.families if f.trainable and f.has_grads()]
        with torch.profiler.record_function("pstar::optimizer_step"):
            coef = 1.0
            self.last_step = StepResult()
            host_grads = self._host_grads()
            if policy.check_finite or policy.clip_norm is not None:
                finite, total = self._global_norm(families, host_grads)
                if not finite:
                    self.last_step = StepResult(skipped=True)
                    self.zero_grad()
                    return loss
                if policy.clip_norm is not None and total is not None:
                    self.last_step.total_norm = float(total)
                    coef = min(1.0, float(policy.clip_norm / (total + 1e-6)))
                    if not math.isfinite(float(total)):
                        coef = float("nan")  # as torch's clip_grad_norm_ (error_if_nonfinite=False) does
            for family in families:
                self._step_family(family, coef)
            manager.weights_version += 1  # weights autograd saved by reference are stale now
            self._step_host_params(host_grads, coef)
            self.zero_grad()
        return loss

    def _global_norm(
        self, families: list[ChunkFamily], host_grads: dict[int, torch.Tensor]
    ) -> tuple[bool, torch.Tensor | None]:
        """Whether every gradient is finite, and the global 2-norm, over all ranks (each owns a share)."""
        policy = self.gradient_policy
        norms: list[torch.Tensor] = []
        finite = True
        grad_lists = [list(host_grads.values())] if host_grads else []
        grad_lists += [list(self._family_grads(f).values()) for f in families]
        for grads in grad_lists:
            if not grads:
                continue
            norms.extend(n.to("cpu") for n in torch._foreach_norm(grads, 2.0))
            if policy.check_finite and finite:
                finite = all(bool(torch.isfinite(g).all()) for g in grads)
        comm = self._manager.comm
        if not comm.distributed:
            total = torch.linalg.vector_norm(torch.stack(norms), 2.0) if norms else None
            return finite, total
        # every rank holds the gradients of the families it owns: sum squares and flags over ranks
        device = self._manager.device
        packed = torch.tensor(
            [float(sum(float(n) ** 2 for n in norms)), 0.0 if finite else 1.0], dtype=torch.float64, device=device
        )
        comm.all_reduce_sum_(packed)
        return bool(packed[1] == 0), torch.sqrt(packed[0]).to(torch.float32).cpu()

    def _host_grads(self) -> dict[int, torch.Tensor]:
        """Unscaled fp32 gradients of host-resident parameters (cpu_embedding), keyed by parameter id."""
        out: dict[int, torch.Tensor] = {}
        inv_scale = self.gradient_policy.inv_scale
        comm = self._manager.comm
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in self._host_group:
                    continue
                if comm.distributed:
                    # host parameters are replicated on every rank: average their gradients like DDP
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

    def _step_host_params(self, grads: dict[int, torch.Tensor], coef: float) -> None:
        """Step host-resident parameters with the same fused kernels (their state lives beside them)."""
        if not grads:
            return
        for group in self.param_groups:
            params = [p for p in group["params"] if id(p) in grads]
            if not params:
                continue
            g = [grads[id(p)] for p in params]
            self._scale_and_clamp(g, coef)
            data = [p.detach() for p in params]
            if self._is_adam:
                states = [self._host_state.setdefault(id(p), {}) for p in params]
                for p, st in zip(params, states, strict=True):
                    if not st:
                        st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                _fused_adam(
                    group,
                    data,
                    g,
                    [st["exp_avg"] for st in states],
                    [st["exp_avg_sq"] for st in states],
                    [st["step"] for st in states],
                )
            else:
                for p, x, grad in zip(params, data, g, strict=True):
                    # one call per parameter: each momentum buffer starts on its parameter's first step
                    state = self._host_state.setdefault(id(p), {})
                    bufs: list[torch.Tensor | None] = [state.get("momentum_buffer")]
                    sgd_functional(
                        [x],
                        [grad],
                        bufs,
                        fused=True,
                        weight_decay=group["weight_decay"],
                        momentum=group["momentum"],
                        lr=group["lr"],
                        dampening=group["dampening"],
                        nesterov=bool(group["nesterov"]),
                        maximize=bool(group["maximize"]),
                    )
                    if bufs[0] is not None:
                        state["momentum_buffer"] = bufs[0]

    def _family_grads(self, family: ChunkFamily) -> dict[int, torch.Tensor]:
        """fp32, unscaled gradients of the family's parameters that have one, keyed by record index.

        In 32-true these are views of the GRAD chunk; in mixed precision fresh fp32 tensors built from
        the param slot (this micro-batch) plus the fp32 accumulation slot (earlier micro-batches).
        """
        manager = self._manager
        inv_scale = self.gradient_policy.inv_scale
        out: dict[int, torch.Tensor] = {}
        grad_chunk = family.chunks.get(ChunkKind.GRAD)
        for record in family.records:
            if record.index not in self._group_of:
                continue
            grad: torch.Tensor | None = None
            if record.slot_holds_grad:
                grad = family.param_chunk.slot_view(record.slot).float()
            if record.grad_chunk_has_data:
                assert grad_chunk is not None
                acc = grad_chunk.slot_view(record.slot)
                grad = acc if grad is None else grad.add_(acc.to(grad.device))
                if manager.mixed and record.slot_holds_grad is False:
                    grad = grad.clone()  # never scale the accumulation buffer in place
            if grad is None:
                continue
            if inv_scale != 1.0:
                grad = grad.mul_(inv_scale) if manager.mixed else grad.mul(inv_scale)
            out[record.index] = grad
        return out

    def _step_family(self, family: ChunkFamily, coef: float) -> None:
        manager = self._manager
        tier = manager.optimizer_tier_of(family)
        if tier is Tier.HOST:
            manager.move_param_chunk(family, Tier.HOST)  # the update runs where the optimizer states live
        else:
            manager.fetch(family, protect={family.family_id})
        if self._is_adam and self._step_whole_family(family, coef):
            return
        grads = self._family_grads(family)
        if not grads:
            return
        grad_list = list(grads.values())
        self._scale_and_clamp(grad_list, coef)
        master = family.chunks.get(ChunkKind.MASTER, family.param_chunk)
        by_group: dict[int, list[ParamRecord]] = defaultdict(list)
        for record in family.records:
            if record.index in grads:
                by_group[self._group_of[record.index]].append(record)
        for gi, records in sorted(by_group.items()):
            group = self.param_groups[gi]
            params = [master.slot_view(r.slot) for r in records]
            device = params[0].device
            group_grads = [
                grads[r.index] if grads[r.index].device == device else grads[r.index].to(device) for r in records
            ]
            if self._is_adam:
                self._adam(group, family, records, params, group_grads)
            else:
                self._sgd(group, family, records, params, group_grads)
        if manager.mixed:
            for record in family.records:
                if record.index in grads:
                    family.param_chunk.slot_view(record.slot).copy_(master.slot_view(record.slot))
                    manager.set_slot_holds_grad(record, False)  # the parameter points at the new weight again

    def _whole_family_plan(self, family: ChunkFamily) -> _WholeFamilyPlan | None:
        """The family's :class:`_WholeFamilyPlan`, or None when a record is outside the optimizer's param
        groups or the slots are not laid out in record order (computed once: layout and groups are fixed)."""
        if family.family_id in self._whole_plans:
            return self._whole_plans[family.family_id]
        plan: _WholeFamilyPlan | None = None
        if family.records and all(r.index in self._group_of for r in family.records):
            sizes: list[int] = []
            start = end = family.records[0].slot.offset
            for record in family.records:
                slot = record.slot
                if slot.offset < end:
                    break  # not in record order (or overlapping): step record by record
                if sizes:
                    sizes.append(slot.offset - end)  # the gap before this slot
                sizes.append(slot.numel)
                end = slot.offset + slot.numel
            else:
                by_group: dict[int, list[int]] = defaultdict(list)
                for i, record in enumerate(family.records):
                    by_group[self._group_of[record.index]].append(i)
                plan = _WholeFamilyPlan(start=start, end=end, sizes=sizes, groups=sorted(by_group.items()))
        self._whole_plans[family.family_id] = plan
        return plan

    def _step_whole_family(self, family: ChunkFamily, coef: float) -> bool:
        """Adam on a family where every record has exactly this micro-batch's gradient (mixed precision: in
        the param slot; 32-true: in the GRAD chunk): the same arithmetic as the record-by-record path, with
        one conversion of the gradient range and the slot views of each chunk made in one call. Padding is
        only read (into a temporary), never written. False when it does not apply."""
        plan = self._whole_family_plan(family)
        if plan is None:
            return False
        manager = self._manager
        mixed = manager.mixed
        records = family.records
        for record in records:
            has = record.slot_holds_grad and not record.grad_chunk_has_data if mixed else record.grad_chunk_has_data
            if not has:
                return False
        policy = self.gradient_policy
        inv_scale = policy.inv_scale
        param_chunk = family.param_chunk
        if mixed:
            grad_range = param_chunk.data[plan.start : plan.end].float()
            if inv_scale != 1.0:
                grad_range.mul_(inv_scale)
        else:
            grad_range = family.chunks[ChunkKind.GRAD].data[plan.start : plan.end]
            if inv_scale != 1.0:
                grad_range = grad_range.mul(inv_scale)
        grads = list(grad_range.split_with_sizes(plan.sizes)[::2])
        self._scale_and_clamp(grads, coef)
        master = family.chunks.get(ChunkKind.MASTER, param_chunk)
        params = plan.slots(master.data)
        device = params[0].device
        if grad_range.device != device:
            grads = list(grad_range.to(device).split_with_sizes(plan.sizes)[::2])
        exp_avgs = plan.slots(family.chunks[ChunkKind.EXP_AVG].data)
        exp_avg_sqs = plan.slots(family.chunks[ChunkKind.EXP_AVG_SQ].data)
        for gi, positions in plan.groups:
            _fused_adam(
                self.param_groups[gi],
                [params[i] for i in positions],
                [grads[i] for i in positions],
                [exp_avgs[i] for i in positions],
                [exp_avg_sqs[i] for i in positions],
                [self._step_tensor(records[i], device) for i in positions],
            )
        if mixed:
            torch._foreach_copy_(plan.slots(param_chunk.data), params)
            for record in records:
                manager.set_slot_holds_grad(record, False)  # the parameter points at the new weight again
        return True

    def _scale_and_clamp(self, grads: list[torch.Tensor], coef: float) -> None:
        """In place: the clipping-by-norm coefficient, then clipping by value (the gradient policy's)."""
        if coef != 1.0:
            torch._foreach_mul_(grads, coef)
        clip_value = self.gradient_policy.clip_value
        if clip_value is not None:
            for g in grads:
                g.clamp_(-clip_value, clip_value)

    def _step_tensor(self, record: ParamRecord, device: torch.device) -> torch.Tensor:
        step = self._steps.get(record.index)
        if step is None:
            step = torch.zeros((), dtype=torch.float32, device=device)
        elif step.device != device:
            step = step.to(device)
        self._steps[record.index] = step
        return step

    def _adam(
        self,
        group: dict[str, Any],
        family: ChunkFamily,
        records: list[ParamRecord],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
    ) -> None:
        exp_avg = family.chunks[ChunkKind.EXP_AVG]
        exp_avg_sq = family.chunks[ChunkKind.EXP_AVG_SQ]
        _fused_adam(
            group,
            params,
            grads,
            [exp_avg.slot_view(r.slot) for r in records],
            [exp_avg_sq.slot_view(r.slot) for r in records],
            [self._step_tensor(r, params[0].device) for r in records],
        )

    def _sgd(
        self,
        group: dict[str, Any],
        family: ChunkFamily,
        records: list[ParamRecord],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
    ) -> None:
        momentum = group["momentum"]
        kwargs = dict(
            weight_decay=group["weight_decay"],
            momentum=momentum,
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=bool(group["nesterov"]),
            maximize=bool(group["maximize"]),
        )
        if momentum == 0:
            sgd_functional(params, grads, [None] * len(params), fused=True, **kwargs)
            return
        buffers = family.chunks[ChunkKind.EXP_AVG]
        started = [i for i, r in enumerate(records) if r.index in self._momentum_started]
        fresh = [i for i, r in enumerate(records) if r.index not in self._momentum_started]
        if started:
            sgd_functional(
                [params[i] for i in started],
                [grads[i] for i in started],
                [buffers.slot_view(records[i].slot) for i in started],
                fused=True,
                **kwargs,
            )
        if fresh:
            # torch starts a momentum buffer as a copy of the first gradient: let the kernel create it
            new_bufs: list[torch.Tensor | None] = [None] * len(fresh)
            sgd_functional([params[i] for i in fresh], [grads[i] for i in fresh], new_bufs, fused=True, **kwargs)
            for i, buf in zip(fresh, new_bufs, strict=True):
                assert buf is not None
                buffers.slot_view(records[i].slot).copy_(buf)
                self._momentum_started.add(records[i].index)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "PatrickStar lays out chunks and optimizer states at setup, so parameter groups cannot be added"
            " during training (e.g. by a fine-tuning callback that unfreezes layers). HINT: put every"
            " parameter in a group in `configure_optimizers` and set requires_grad before `fit`."
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients (weights overwritten by gradients are restored from the masters)."""
        self._manager.discard_grads()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in self._host_group:
                    p.grad = None

    # ---- state dict in torch's standard layout -----------------------------------------------------------
    def _ordered_params(self) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        for group in self.param_groups:
            for p in group["params"]:
                out.append((len(out), p))
        return out

    def _record_states(
        self, *, rank0_only: bool = False, owned_only: bool = False
    ) -> dict[int, dict[str, torch.Tensor]]:
        """Record index -> its optimizer state (CPU tensors, torch's names), for every record on every rank.

        With several ranks each family's state comes from its owner (a broadcast per family, in order);
        ``rank0_only`` streams it to rank 0 alone, ``owned_only`` reads only this rank's families (no
        communication).
        """
        manager = self._manager
        kinds = [k for k in (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ) if self._is_adam or k is ChunkKind.EXP_AVG]
        out: dict[int, dict[str, torch.Tensor]] = {}
        for family in manager.families:
            if not family.trainable or not family.records:
                continue
            owned = manager.owns(family)
            if owned_only and not owned:
                continue
            present = [k for k in kinds if owned and k in family.chunks]
            if manager.comm.distributed and not owned_only:
                # owner packs [states..., steps] so one broadcast carries the family
                width = len(kinds) * family.capacity + len(family.records)
                packed = torch.zeros(width, dtype=torch.float32, device=manager.device)
                if owned:
                    for i, kind in enumerate(present):
                        packed[i * family.capacity : (i + 1) * family.capacity].copy_(family.chunks[kind].data)
                    steps = [self._record_step(r) for r in family.records]
                    packed[len(kinds) * family.capacity :].copy_(torch.tensor(steps, dtype=torch.float32))
                owner = family.family_id % manager.world_size
                if rank0_only:
                    manager.comm.to_rank0_(packed, src=owner)
                    if manager.rank != 0:
                        continue
                else:
                    manager.comm.broadcast_(packed, src=owner)
                packed = packed.cpu()
                chunks = {k: packed[i * family.capacity : (i + 1) * family.capacity] for i, k in enumerate(kinds)}
                steps = packed[len(kinds) * family.capacity :].tolist()
            else:
                chunks = {k: family.chunks[k].data for k in present}
                steps = [self._record_step(r) for r in family.records]
            for record, step in zip(family.records, steps, strict=True):
                if step < 0:
                    continue
                sl = slice(record.slot.offset, record.slot.offset + record.slot.numel)
                if self._is_adam:
                    out[record.index] = {
                        "step": torch.tensor(step, dtype=torch.float32),
                        "exp_avg": chunks[ChunkKind.EXP_AVG][sl].view(record.slot.shape).to("cpu", copy=True),
                        "exp_avg_sq": chunks[ChunkKind.EXP_AVG_SQ][sl].view(record.slot.shape).to("cpu", copy=True),
                    }
                else:
                    buf = chunks[ChunkKind.EXP_AVG][sl].view(record.slot.shape).to("cpu", copy=True)
                    out[record.index] = {"momentum_buffer": buf}
        return out

    def _record_step(self, record: ParamRecord) -> float:
        """The record's step count (Adam), 0 for a started momentum buffer (SGD), -1 without state."""
        if self._is_adam:
            step = self._steps.get(record.index)
            return -1.0 if step is None else float(step)
        return 0.0 if record.index in self._momentum_started else -1.0

    def state_dict(self, *, rank0_only: bool = False) -> dict[str, Any]:
        """torch's layout (``state`` by parameter index, ``param_groups``), consolidated from every rank.

        ``rank0_only`` (what checkpoints use) streams the states to rank 0; other ranks get empty states.
        """
        manager = self._manager
        record_states = self._record_states(rank0_only=rank0_only)
        state: dict[int, dict[str, Any]] = {}
        for index, p in self._ordered_params():
            if id(p) in self._host_group:
                if self._host_state.get(id(p)):
                    state[index] = {k: v.detach().to("cpu", copy=True) for k, v in self._host_state[id(p)].items()}
                continue
            entry = record_states.get(manager.record_of(p).index)
            if entry is not None:
                state[index] = entry
        groups = []
        start = 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def owned_state_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """``<prefix><index>/<field>`` -> tensor for the states this rank owns (a sharded save)."""
        manager = self._manager
        states = self._record_states(owned_only=True)
        out: dict[str, torch.Tensor] = {}
        for index, p in self._ordered_params():
            if id(p) in self._host_group:
                if manager.rank == 0:
                    for field, value in self._host_state.get(id(p), {}).items():
                        out[f"{prefix}{index}/{field}"] = value.detach().to("cpu", copy=True).reshape(-1)
                continue
            entry = states.get(manager.record_of(p).index)
            for field, value in (entry or {}).items():
                out[f"{prefix}{index}/{field}"] = value.reshape(-1) if field == "step" else value
        return out

    def load_owned_state(self, stored: dict[str, torch.Size], prefix: str, read: Any, groups: list[Any]) -> None:
        """Load a sharded checkpoint's optimizer states: the groups' hyper-parameters and this rank's states."""
        manager = self._manager
        wanted: dict[str, torch.Size] = {}
        for index, p in self._ordered_params():
            mine = id(p) in self._host_group or manager.owns(manager.record_of(p).family)
            if not mine:
                continue
            for key, shape in stored.items():
                if key.startswith(f"{prefix}{index}/"):
                    wanted[key] = shape
        values = read(wanted)
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in values.items():
            index, field = key[len(prefix) :].split("/")
            state.setdefault(int(index), {})[field] = value.reshape(()) if field == "step" else value
        self.load_state_dict({"state": state, "param_groups": groups})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or "state" not in state_dict:
            raise ValueError("optimizer state_dict must have 'state' and 'param_groups' (torch's layout)")
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"optimizer state has {len(groups)} param groups, this optimizer has {len(self.param_groups)}."
                " HINT: configure_optimizers must build the same groups as the run that saved it."
            )
        for gi, (saved, mine) in enumerate(zip(groups, self.param_groups, strict=True)):
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(
                    f"param group {gi}: the saved state has {len(saved['params'])} parameters, this optimizer"
                    f" has {len(mine['params'])}."
                )
        ordered = self._ordered_params()
        saved_index = [i for g in groups for i in g["params"]]
        manager = self._manager
        updates: list[tuple[ParamRecord, dict[str, Any]]] = []
        host_updates: list[tuple[torch.Tensor, dict[str, Any]]] = []
        for (_pos, p), key in zip(ordered, saved_index, strict=True):
            entry = state_dict["state"].get(key)
            if entry is None:
                continue
            if id(p) in self._host_group:
                host_updates.append((p, entry))
                continue
            record = manager.record_of(p)
            for name, value in entry.items():
                if name != "step" and tuple(value.shape) != tuple(record.slot.shape):
                    raise ValueError(
                        f"optimizer state '{name}' of parameter '{record.slot.name}' has shape"
                        f" {tuple(value.shape)}, expected {tuple(record.slot.shape)}."
                    )
            updates.append((record, entry))
        # validated: now change state
        for saved, mine in zip(groups, self.param_groups, strict=True):
            for k, v in saved.items():
                if k != "params":
                    mine[k] = v
        for p, entry in host_updates:
            self._host_state[id(p)] = {
                k: torch.as_tensor(v, dtype=torch.float32).to(p.device).clone() for k, v in entry.items()
            }
        with torch.no_grad():
            for record, entry in updates:
                family = record.family
                if not manager.owns(family):
                    continue  # its owner loads it
                if "exp_avg" in entry:
                    family.chunks[ChunkKind.EXP_AVG].slot_view(record.slot).copy_(entry["exp_avg"])
                    family.chunks[ChunkKind.EXP_AVG_SQ].slot_view(record.slot).copy_(entry["exp_avg_sq"])
                    step = entry["step"]
                    device = family.chunks[ChunkKind.EXP_AVG].data.device
                    self._steps[record.index] = torch.as_tensor(step, dtype=torch.float32).to(device).clone()
                if "momentum_buffer" in entry and entry["momentum_buffer"] is not None:
                    family.chunks[ChunkKind.EXP_AVG].slot_view(record.slot).copy_(entry["momentum_buffer"])
                    self._momentum_started.add(record.index)

    @property
    def user_optimizer(self) -> Optimizer:
        """The optimizer ``configure_optimizers`` returned (its param_groups are shared with this one)."""
        return self._user_optimizer

    def __repr__(self) -> str:
        return f"ChunkedOptimizer({type(self._user_optimizer).__name__}, groups={len(self.param_groups)})"
