"""The largest member of a demo GPT family that fits the budgets.

The family grows one size index ``k`` (depth, width or both, :class:`Scale`). The search gallops up from the
given config by doubling ``k``, then narrows the interval between the last member that fits and the first that
does not, by interpolation where model data decides and by bisection otherwise. Each candidate is planned by
the function the caller passes (the capacity planner's), so this module knows plans only by the figures it
reads (:class:`MemberPlan`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from lightning_pstar.demos.gpt import GPTConfig

__all__ = ["LargestModel", "MemberPlan", "Scale", "find_largest"]


class Scale(str, Enum):
    """Which sizes of the demo GPT grow in the largest-model search."""

    BOTH = "both"
    """Depth and width together: ``n_layer = k``, ``n_embd`` grows in proportion (same ``n_embd / n_layer``
    and head size as the given config, so ``n_head`` grows too), as GPT families scale."""
    N_LAYER = "n_layer"
    """Depth only: ``n_layer = k``."""
    N_EMBD = "n_embd"
    """Width only, in steps of ``n_head``: ``n_embd = k * n_head``."""


_SEARCH_LIMIT: dict[Scale, int] = {Scale.BOTH: 1024, Scale.N_LAYER: 1024, Scale.N_EMBD: 1 << 16}
"""Largest ``k`` the search tries; beyond it a meta build and a chunk-size search take too long to be useful."""


@dataclass(kw_only=True)
class LargestModel:
    """Result of the largest-model search over the demo GPT family."""

    scale: str
    """Which sizes grew (see :class:`Scale`)."""
    config: dict[str, Any] | None
    """GPT config of the largest member that fits; None when not even the smallest member fits."""
    num_params: int
    model_data_bytes_per_rank: int
    next_config: dict[str, Any] | None
    """The member one step up, which does not fit; None when the search stopped at its limit."""
    next_num_params: int
    next_reasons: list[str]
    """Why the next member does not fit."""
    at_search_limit: bool
    """The search stopped at its largest candidate, which still fits: the true answer is larger."""
    candidates_planned: int


class MemberPlan(Protocol):
    """What the search reads of a candidate's plan (:class:`~lightning_pstar.planning.capacity_plan.CapacityPlan`)."""

    @property
    def fits(self) -> bool: ...
    @property
    def fits_model_data(self) -> bool: ...
    @property
    def fits_min_device(self) -> bool: ...
    @property
    def reasons(self) -> list[str]: ...
    @property
    def num_params(self) -> int: ...
    @property
    def model_data_bytes_per_rank(self) -> int: ...
    @property
    def device_budget(self) -> int: ...
    @property
    def host_budget(self) -> int: ...


def family_member(base: GPTConfig, scale: Scale, k: int) -> GPTConfig:
    """Member ``k`` of the family of ``base`` growing ``scale``."""
    if scale is Scale.N_LAYER:
        return replace(base, n_layer=k)
    if scale is Scale.N_EMBD:
        return replace(base, n_embd=k * base.n_head)
    head = base.n_embd // base.n_head
    heads = max(1, round(k * base.n_embd / (base.n_layer * head)))
    return replace(base, n_layer=k, n_head=heads, n_embd=heads * head)


def _family_index(base: GPTConfig, scale: Scale) -> int:
    return base.n_embd // base.n_head if scale is Scale.N_EMBD else base.n_layer


def _interpolate(lo: int, lo_plan: MemberPlan, hi: int, hi_plan: MemberPlan) -> int | None:
    """Where model data per rank reaches the budget, between ``lo`` (fits) and ``hi`` (too much model data).

    Model data grows as a power of the family index (1 for depth, 2 for width, 3 for both), so a straight line
    through the two points in log-log space lands within a member or two of the answer. None when ``hi`` fails
    for another reason (the minimum device need), where only bisection is sound.
    """
    if not hi_plan.fits_min_device or hi_plan.fits_model_data:
        return None
    budget = hi_plan.device_budget + hi_plan.host_budget
    b_lo, b_hi = lo_plan.model_data_bytes_per_rank, hi_plan.model_data_bytes_per_rank
    if not 0 < b_lo <= budget < b_hi:
        return None
    t = (math.log(budget) - math.log(b_lo)) / (math.log(b_hi) - math.log(b_lo))
    guess = math.floor(math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo))))
    return min(max(guess, lo + 1), hi - 1)


def find_largest(
    base: GPTConfig, scale: Scale, plan_member: Callable[[GPTConfig], MemberPlan], *, base_plan: MemberPlan
) -> LargestModel:
    """Gallop up from ``base`` by doubling, then narrow down (interpolation, bisection as the safeguard) to the
    member ``k`` that fits while ``k + 1`` does not. ``plan_member`` plans one member (``base_plan`` is its
    plan of ``base``); each member is planned once."""
    plans: dict[int, MemberPlan] = {_family_index(base, scale): base_plan}

    def plan_of(k: int) -> MemberPlan:
        if k not in plans:
            plans[k] = plan_member(family_member(base, scale, k))
        return plans[k]

    limit = _SEARCH_LIMIT[scale]
    k0 = min(_family_index(base, scale), limit)
    if plan_of(k0).fits:
        lo, hi = k0, None
        while hi is None and lo < limit:
            k = min(2 * lo, limit)
            lo, hi = (k, None) if plan_of(k).fits else (lo, k)
    elif k0 == 1 or not plan_of(1).fits:
        smallest = plan_of(1)
        return LargestModel(
            scale=scale.value,
            config=None,
            num_params=0,
            model_data_bytes_per_rank=0,
            next_config=asdict(family_member(base, scale, 1)),
            next_num_params=smallest.num_params,
            next_reasons=smallest.reasons,
            at_search_limit=False,
            candidates_planned=len(plans),
        )
    else:
        lo, hi = 1, k0
    interpolate = True
    while hi is not None and hi - lo > 1:
        width = hi - lo
        guess = _interpolate(lo, plan_of(lo), hi, plan_of(hi)) if interpolate else None
        mid = guess if guess is not None else (lo + hi) // 2
        lo, hi = (mid, hi) if plan_of(mid).fits else (lo, mid)
        # bisect next whenever interpolating did not halve the interval (slow one-sided convergence)
        interpolate = guess is None or 2 * (hi - lo) <= width
    return _found(base, scale, lo, plan_of(lo), hi, plan_of(hi) if hi is not None else None, len(plans))


def _found(
    base: GPTConfig, scale: Scale, lo: int, best: MemberPlan, hi: int | None, nxt: MemberPlan | None, planned: int
) -> LargestModel:
    return LargestModel(
        scale=scale.value,
        config=asdict(family_member(base, scale, lo)),
        num_params=best.num_params,
        model_data_bytes_per_rank=best.model_data_bytes_per_rank,
        next_config=asdict(family_member(base, scale, hi)) if hi is not None else None,
        next_num_params=nxt.num_params if nxt is not None else 0,
        next_reasons=nxt.reasons if nxt is not None else [],
        at_search_limit=hi is None,
        candidates_planned=planned,
    )
