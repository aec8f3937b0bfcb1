"""The sweep over chunk groups: where a pass is, and the forward's order ([Note: one collective sequence on every
rank] in :mod:`lightning_pstar.runtime.sharding`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from enum import Enum

__all__ = ["Sweep", "sweep_plan"]


class Sweep(str, Enum):
    """Where the sweep over chunk groups is ([Note: one collective sequence on every rank])."""

    IDLE = "idle"
    """No pass is under way: every remote chunk is released."""
    FORWARD = "forward"
    """A forward pass sweeps the groups in ascending order."""
    BACKWARD = "backward"
    """The backward sweeps them in the reverse order of the forward's gathers and reduces gradients."""


def sweep_plan(module_groups: Sequence[Iterable[int]], num_groups: int) -> tuple[list[int], list[int]]:
    """The forward sweep's order and each module's place in it, from the module tree.

    ``module_groups[i]``: the chunk groups module ``i`` (in module-tree order) computes with. Groups are swept
    in the order modules first use them (a frozen embedding whose chunks the layout puts last is still swept
    first); groups no module uses come last. Module ``i``'s place is the last group any module up to ``i``
    uses first, so that reaching module ``i`` means the same sweep position on every rank."""
    order: list[int] = []
    seen: set[int] = set()
    positions: list[int] = []
    for groups in module_groups:
        for group in sorted(groups):
            if group not in seen:
                seen.add(group)
                order.append(group)
        positions.append(len(order) - 1)
    order += [g for g in range(num_groups) if g not in seen]
    return order, positions
