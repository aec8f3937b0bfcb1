"""The end of the warm-up: the trace is closed, checked against the device budget, and plans what follows.

After the first optimizer step the warm-up trace (:mod:`~lightning_pstar.runtime.tracer`) knows, per moment,
the chunks it needs and the non-model memory measured then. Three decisions follow from it, all taken once:
- a moment whose chunks and activations exceed the device budget is an error now, naming the moment (the
  iteration could not run without the allocator failing somewhere later);
- with several ranks, whether the next chunk group is gathered ahead of use (two more groups must fit at the
  warm-up's peak on every rank: one collective, see :mod:`~lightning_pstar.runtime.sharding`);
- under ``auto`` placement, which optimizer-state families step on the device (the margin at the step).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from lightning_pstar.planning.requirements import MemoryBudgetError
from lightning_pstar.report import format_bytes
from lightning_pstar.runtime.residency import Residency
from lightning_pstar.runtime.sharding import Sharding
from lightning_pstar.runtime.tracer import MemoryTracer, MomentKind

__all__ = ["end_warmup"]

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
        fits = True
        if budget is not None:
            moments = tracer.trace.moments
            peak = max((n for n, m in zip(needs, moments, strict=True) if m.kind is not MomentKind.STEP), default=0)
            fits = peak + 2 * sharding.group_bytes() <= budget
        enabled = sharding.plan_prefetch(fits)
        log.info("PatrickStar: chunk groups are %sgathered ahead of use", "" if enabled else "not ")
    if budget is None or residency.policy.name != "auto":
        return
    _check_trace_fits(tracer, needs, budget)
    residency.plan_hybrid_optimizer(tracer.trace.peak_non_model)


def _check_trace_fits(tracer: MemoryTracer, needs: Sequence[int], budget: int) -> None:
    for index, (moment, total) in enumerate(zip(tracer.trace.moments, needs, strict=True)):
        if total > budget:
            raise MemoryBudgetError(
                f"device_memory_limit is too small for this model's iteration: at moment {index}"
                f" ({moment.kind.value}) the warm-up measured {format_bytes(moment.non_model_bytes, exact=True)}"
                " of non-model memory (activations) and the chunks needed then take"
                f" {format_bytes(total - moment.non_model_bytes, exact=True)}, together"
                f" {format_bytes(total, exact=True)}, but the device budget is {format_bytes(budget, exact=True)}."
                " HINT: raise device_memory_limit, lower the batch size or chunk_size, or use activation"
                " checkpointing."
            )
