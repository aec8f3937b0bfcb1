"""The end of the warm-up: the trace is closed, checked against the device budget, and plans what follows.

After the first optimizer step the warm-up trace (:mod:`~lightning_pstar.runtime.tracer`) knows, per moment,
the chunks it needs and the non-model memory measured then. Three decisions follow from it, all taken once:
- a moment whose chunks and activations exceed the device budget is an error now, naming the moment (the
  iteration could not run without the allocator failing somewhere later);
- with several ranks, whether the next chunk group is gathered ahead of use (two more groups must fit at the
  warm-up's peak on every rank), how many groups stay gathered from forward into backward, and at which sweep
  step each group's gradients are reduced: one collective, see :mod:`~lightning_pstar.runtime.sharding`;
- under ``auto`` placement, which optimizer-state families step on the device (the margin at the step), after
  which the pinned blocks the moved families left idle are given back;
- the yardstick ([Note: the yardstick] in :mod:`~lightning_pstar.runtime.yardstick`): the fewest bytes any
  placement could move per iteration with this trace and budget, bracketed, and the plan auto follows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from lightning_pstar.planning.requirements import MemoryBudgetError
from lightning_pstar.report import format_bytes
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.comm import ChunkComm
from lightning_pstar.runtime.optimizer_side import plan_hybrid_optimizer
from lightning_pstar.runtime.pinned import host_arena
from lightning_pstar.runtime.residency import Residency
from lightning_pstar.runtime.sharding_factory import Sharding
from lightning_pstar.runtime.state import Tier
from lightning_pstar.runtime.tracer import MemoryTracer, MomentKind
from lightning_pstar.runtime.yardstick import PlacementProblem, Point, solve

__all__ = ["check_before_warmup_step", "end_warmup", "placement_problem"]

log = logging.getLogger(__name__)


def end_warmup(tracer: MemoryTracer, residency: Residency, sharding: Sharding) -> None:
    """Close the trace and take the decisions it allows (see the module docstring)."""
    tracer.stop_recording()
    families = residency.families

    def chunk_bytes(fids: Sequence[int]) -> int:
        return sum(families[f].param_chunk.nbytes for f in fids)

    needs = tracer.trace.device_need(chunk_bytes)
    budget = residency.device_budget
    if sharding.distributed:
        _plan_gathers(tracer, needs, budget, residency, sharding)
    if budget is None:
        return
    if residency.policy.name == "auto":
        _check_trace_fits(tracer, needs, budget)
        if residency.hybrid_optimizer:  # placement.optimizer="auto": the families that fit go to the device
            plan_hybrid_optimizer(residency, tracer.trace.peak_non_model)
        # the host blocks the families that came to the device left idle go back to the driver now, not at
        # teardown: held in torch's cache they would count against the host budget for the whole run
        host_arena().release()
    problem = None if sharding.distributed else placement_problem(tracer, residency, budget)
    residency.bounds = solve(problem) if problem is not None else None
    if problem is not None and residency.bounds is not None:
        plan = residency.bounds.keep
        residency.policy.adopt_plan({t: plan[p] for t, p in problem.moment_point.items()})
    if residency.bounds is not None:  # a diagnostic: the report carries the figures (optimal_bytes_*)
        log.debug(
            "PatrickStar: the fewest bytes any placement moves per iteration: %s .. %s",
            format_bytes(residency.bounds.lower),
            format_bytes(residency.bounds.upper),
        )


def _plan_gathers(
    tracer: MemoryTracer, needs: Sequence[int], budget: int | None, residency: Residency, sharding: Sharding
) -> None:
    """Several ranks: whether the next group is gathered ahead of use (two more groups at the warm-up's peak), and
    how many of the forward's last groups stay gathered into the backward; every rank's figures, agreed in one
    collective (``GroupCoordinator.plan``). Kept groups must not cost evictions: they fit, within the room the
    placement policy gives chunks (static: its share of the budget), beside every chunk this rank owns, the
    device-side optimizer chunks, the group being gathered (and the next one when prefetching) and the warm-up's
    peak of non-model memory, so a budget that evicts without keeping keeps nothing."""
    groups = sharding.num_groups()
    fits, keep = True, groups
    if budget is not None:
        moments = tracer.trace.moments
        peak = max((n for n, m in zip(needs, moments, strict=True) if m.kind is not MomentKind.STEP), default=0)
        group = max(sharding.group_bytes(), 1)
        fits = peak + 2 * group <= budget
        non_model = max((m.non_model_bytes for m in moments if m.kind is not MomentKind.STEP), default=0)
        families = residency.families
        own = sum(f.param_chunk.nbytes for f in families if ChunkKind.PARAM in f.chunks and residency.owns(f))
        side = sum(
            c.nbytes
            for f in families
            for k, c in f.chunks.items()
            if k is not ChunkKind.PARAM and c.tier is Tier.DEVICE
        )
        chunk_room = residency.chunk_room()  # what the policy lets chunks hold (static: its fraction of the budget)
        limit = budget - non_model if chunk_room is None else min(budget - non_model, chunk_room)
        # beside the kept groups: the group being gathered, and the next one when prefetching
        room = limit - own - side - (2 if fits else 1) * group
        keep = max(0, room // group)
    enabled = sharding.plan(fits, keep)
    log.debug(
        "PatrickStar: chunk groups are %sgathered ahead of use; %d of %d stay gathered from forward into backward",
        "" if enabled else "not ",
        len(sharding.keep),
        groups,
    )


def check_before_warmup_step(
    tracer: MemoryTracer, residency: Residency, comm: ChunkComm, host_check: Callable[[int], None] | None = None
) -> None:
    """At the warm-up's optimizer step, before it runs: the moments recorded so far (the forwards and backwards,
    closed now) checked against the device budget as :func:`end_warmup` checks them, so a budget that holds the
    chunks but not the activations is refused while the weights and optimizer states are still the initial
    ones. Every rank calls it (the step is collective): with several ranks one collective makes all of them
    raise together, so none waits forever for a rank that stopped. ``host_check`` is given the least room chunks
    get after the warm-up (the budget less the peak of non-model memory) and raises when the host cannot hold
    what that room leaves it."""
    budget = residency.device_budget
    if budget is None or residency.policy.name != "auto":
        return
    families = residency.families

    def chunk_bytes(fids: Sequence[int]) -> int:
        return sum(families[f].param_chunk.nbytes for f in fids)

    error: MemoryBudgetError | None = None
    try:
        _check_trace_fits(tracer, tracer.trace.device_need(chunk_bytes), budget)
        if host_check is not None:
            host_check(budget - tracer.trace.peak_non_model)
    except MemoryBudgetError as err:
        error = err
    if comm.distributed:
        flag = torch.tensor([0.0 if error is None else 1.0])
        comm.all_reduce_max_(flag)
        if error is None and flag.item() > 0:
            error = MemoryBudgetError(
                "device_memory_limit is too small for this model's iteration on another rank (its error names the"
                " moment and the figures); the optimizer step did not run. HINT: raise device_memory_limit, lower"
                " the batch size or chunk_size, or use activation checkpointing."
            )
    if error is not None:
        raise error


def placement_problem(tracer: MemoryTracer, residency: Residency, budget: int) -> PlacementProblem | None:
    """The warm-up's iteration as the yardstick's points ([Note: the yardstick]); None when it cannot say
    (several optimizer steps per iteration, a trace the run stopped following)."""
    moments = tracer.trace.moments
    if sum(m.kind is MomentKind.STEP for m in moments) != 1 or not tracer.matches:
        return None
    families = residency.families
    owned = {f.family_id for f in families if ChunkKind.PARAM in f.chunks and residency.owns(f)}
    side = sum(
        c.nbytes for f in families for k, c in f.chunks.items() if k is not ChunkKind.PARAM and c.tier is Tier.DEVICE
    )
    in_slot, stepped = residency.warmup_grad_in_slot, residency.warmup_stepped
    last_bwd: dict[int, int] = {}
    for t, m in enumerate(moments):
        if m.kind is MomentKind.BACKWARD:
            for fid in m.families:
                last_bwd[fid] = t
    points: list[Point] = []
    moment_point: dict[int, int] = {}  # the step's points are not a moment's: the step falls back to Belady
    for t, m in enumerate(moments):
        room = budget - m.non_model_bytes - side
        if m.kind is not MomentKind.STEP:
            moment_point[t] = len(points)
            need = frozenset(owned.intersection(m.families))
            writes = need & in_slot if m.kind is MomentKind.BACKWARD else frozenset()
            late = frozenset(f for f in writes if last_bwd.get(f) == t)
            points.append(Point(label=f"{m.kind.value}:{m.key}", need=need, room=room, writes=writes, writes_late=late))
            continue
        for fid in sorted(owned & stepped):
            one = frozenset({fid})
            if residency.optimizer_tier_of(families[fid]) is Tier.DEVICE:
                points.append(Point(label=f"step:{fid}", need=one, room=room, writes=one, writes_late=one))
            else:
                points.append(Point(label=f"step:{fid}", need=frozenset(), out=one, room=room))
    sizes = {fid: families[fid].param_chunk.nbytes for fid in owned}
    return PlacementProblem(points=tuple(points), sizes=sizes, moment_point=moment_point)


def _check_trace_fits(tracer: MemoryTracer, needs: Sequence[int], budget: int) -> None:
    """Refuse a budget some moment of the warm-up needs more than, naming the moment that needs the most (a budget
    of that figure fits every moment: raising the budget to a smaller moment's figure would be refused again)."""
    if not needs or max(needs) <= budget:
        return
    index = max(range(len(needs)), key=needs.__getitem__)
    moment, total = tracer.trace.moments[index], needs[index]
    raise MemoryBudgetError(
        f"device_memory_limit is too small for this model's iteration: at moment {index}"
        f" ({moment.kind.value}) the warm-up measured {format_bytes(moment.non_model_bytes, exact=True)}"
        " of non-model memory (activations) and the chunks needed then take"
        f" {format_bytes(total - moment.non_model_bytes, exact=True)}, together"
        f" {format_bytes(total, exact=True)} (the most any moment needs), but the device budget is"
        f" {format_bytes(budget, exact=True)}. HINT: raise device_memory_limit to at least that, lower the batch size"
        " or chunk_size, or use activation checkpointing."
    )
