"""Pure planner: parameters (meta tensors are fine) -> chunk layout, and the chunk-size search.

Nothing here allocates memory for weights, so the same code serves setup and capacity planning.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

__all__ = ["ALIGN", "ChunkPlan", "Layout", "ParamSpec", "group_of", "owner_of", "plan_layout", "search_chunk_size"]

ALIGN = 8
"""Slot offsets are multiples of 8 elements (16 bytes in half precision, 32 in fp32) so every parameter
view is aligned for vectorised kernels."""

_MAX_CANDIDATES = 512
"""How many chunk sizes the "auto" search evaluates."""
_MIN_GROUPS = 4
"""The "auto" search keeps at least this many chunk groups, so placement has units to move."""
_MAX_UTILISATION_LOSS = 0.10
"""How far below the one-rank layout's utilisation a several-rank layout may fall ([Note: utilisation at
several ranks])."""


def owner_of(chunk_id: int, world_size: int) -> int:
    """The rank that owns chunk ``chunk_id``."""
    return chunk_id % world_size


def group_of(chunk_id: int, world_size: int) -> int:
    """The communication group of chunk ``chunk_id``."""
    return chunk_id // world_size


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, kw_only=True)
class ParamSpec:
    """What the planner needs to know about one unique parameter."""

    name: str
    numel: int
    trainable: bool


@dataclass(kw_only=True)
class ChunkPlan:
    """One planned chunk family: its capacity and the parameters it holds (indices into the spec list)."""

    chunk_id: int
    capacity: int  # elements
    trainable: bool  # a frozen family has only a param chunk
    members: list[int] = field(default_factory=list)  # parameter indices
    offsets: list[int] = field(default_factory=list)  # first element of each member
    used: int = 0  # elements up to the end of the last slot (alignment padding included)


@dataclass(kw_only=True)
class Layout:
    """The result of planning: chunk families in module order."""

    chunk_size: int  # elements; chunks holding one oversized parameter may be larger
    chunks: list[ChunkPlan]
    param_chunk: list[int]  # parameter index -> chunk id
    param_offset: list[int]  # parameter index -> offset in its chunk
    payload_elements: int  # elements of all parameters

    @property
    def capacity_elements(self) -> int:
        return sum(c.capacity for c in self.chunks)

    @property
    def utilisation(self) -> float:
        """Parameter elements / chunk capacity (1.0 means no byte wasted)."""
        cap = self.capacity_elements
        return self.payload_elements / cap if cap else 1.0

    def family_bytes(self, *, trainable_bytes_per_elem: int, frozen_bytes_per_elem: int) -> int:
        """Bytes of all chunk families for the given bytes per element of each kind of family."""
        return sum(
            c.capacity * (trainable_bytes_per_elem if c.trainable else frozen_bytes_per_elem) for c in self.chunks
        )


def plan_layout(params: Sequence[ParamSpec], chunk_size: int, *, world_size: int = 1) -> Layout:
    """Pack ``params`` in order into chunks of ``chunk_size`` elements.

    Trainable and frozen parameters go to separate chunks (frozen families carry no optimizer state).
    Each parameter lies whole inside one chunk; a parameter larger than ``chunk_size`` gets a chunk of its
    own. With ``world_size > 1`` the chunks of each kind are padded with empty chunks to whole
    communication groups of ``world_size`` chunks (trainable groups first, then frozen ones), and every
    chunk of a group gets the group's largest capacity, so a group is gathered and reduced in one call.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of elements, got {chunk_size}")
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    chunks: list[ChunkPlan] = []
    open_chunk: dict[bool, ChunkPlan | None] = {True: None, False: None}
    param_chunk = [-1] * len(params)
    param_offset = [-1] * len(params)

    def new_chunk(trainable: bool, capacity: int) -> ChunkPlan:
        plan = ChunkPlan(chunk_id=len(chunks), capacity=capacity, trainable=trainable)
        chunks.append(plan)
        return plan

    for index, spec in enumerate(params):
        if spec.numel <= 0:
            raise ValueError(f"parameter '{spec.name}' has no elements; empty parameters cannot be chunked")
        current = open_chunk[spec.trainable]
        if spec.numel > chunk_size:
            # an oversized parameter gets a chunk of its own, sized to it
            plan = new_chunk(spec.trainable, _align(spec.numel))
            open_chunk[spec.trainable] = None
        else:
            offset = _align(current.used) if current is not None else 0
            if current is None or offset + spec.numel > current.capacity:
                current = new_chunk(spec.trainable, chunk_size)
                open_chunk[spec.trainable] = current
            plan = current
        offset = _align(plan.used) if plan.members else 0
        plan.members.append(index)
        plan.offsets.append(offset)
        plan.used = offset + spec.numel
        param_chunk[index] = plan.chunk_id
        param_offset[index] = offset
    if world_size > 1:
        chunks = _group_chunks(chunks, chunk_size, world_size)
        for plan in chunks:
            for index, offset in zip(plan.members, plan.offsets, strict=True):
                param_chunk[index] = plan.chunk_id
                param_offset[index] = offset
    return Layout(
        chunk_size=chunk_size,
        chunks=chunks,
        param_chunk=param_chunk,
        param_offset=param_offset,
        payload_elements=sum(p.numel for p in params),
    )


def _group_chunks(chunks: list[ChunkPlan], chunk_size: int, world_size: int) -> list[ChunkPlan]:
    """Renumber ``chunks`` into whole groups of ``world_size`` of one kind with equal capacities."""
    out: list[ChunkPlan] = []
    for trainable in (True, False):
        kind = [c for c in chunks if c.trainable is trainable]
        if not kind:
            continue
        while len(kind) % world_size:
            kind.append(ChunkPlan(chunk_id=-1, capacity=chunk_size, trainable=trainable))
        for start in range(0, len(kind), world_size):
            group = kind[start : start + world_size]
            capacity = max(c.capacity for c in group)
            for plan in group:
                plan.capacity = capacity
                plan.chunk_id = len(out)
                out.append(plan)
    return out


def search_chunk_size(
    params: Sequence[ParamSpec],
    *,
    device_budget_bytes: int | None,
    compute_itemsize: int,
    world_size: int = 1,
) -> Layout:
    """The layout for the chunk size that wastes the fewest elements.

    Candidates run from the largest parameter up to the smallest of: the size at which two chunk groups
    (``2 * world_size`` param chunks) would no longer fit ``device_budget_bytes``, and the size that still
    leaves ``_MIN_GROUPS`` chunk groups. Ties go to the larger chunk (fewer, larger copies).

    [Note: utilisation at several ranks]
    With ``world_size > 1`` the groups are padded to whole groups of equal chunks, and a small model cannot
    have ``_MIN_GROUPS`` groups of ``world_size`` chunks that each hold its largest parameter: the range
    collapses to one size and padding can halve the utilisation. When the best layout's utilisation falls more
    than ``_MAX_UTILISATION_LOSS`` below the one-rank layout's, fewer groups are allowed (sizes up to the
    one-rank range's end): a layout that wastes half the memory on padding is worse than one with fewer units
    to place. (Where no layout with two groups or more comes within those points -- a model of a few chunks,
    each holding one of its largest parameters -- the least wasteful one is taken.)
    """
    if not params:
        raise ValueError("the model has no parameters to place in chunks")
    largest = _align(max(p.numel for p in params))
    total = sum(_align(p.numel) for p in params)
    best = _best_layout(
        params, largest, _upper(total, largest, world_size, device_budget_bytes, compute_itemsize), world_size
    )
    if world_size > 1:
        one_rank = search_chunk_size(params, device_budget_bytes=device_budget_bytes, compute_itemsize=compute_itemsize)
        floor = one_rank.utilisation - _MAX_UTILISATION_LOSS
        if best.utilisation < floor:
            upper = _upper(total, largest, world_size, device_budget_bytes, compute_itemsize, min_groups=1)
            good: Layout | None = None  # the most groups (the smallest chunks) among those that waste little
            for layout in _layouts(params, largest, upper, world_size):
                if layout.utilisation >= floor and (good is None or layout.chunk_size < good.chunk_size):
                    good = layout
                if good is None and layout.capacity_elements < best.capacity_elements:
                    best = layout  # none does: the least waste
            if good is not None:
                best = good
    return best


def _upper(
    total: int, largest: int, world_size: int, budget: int | None, itemsize: int, *, min_groups: int = _MIN_GROUPS
) -> int:
    """The largest candidate: ``min_groups`` groups of ``world_size`` chunks, two groups within the budget."""
    upper = max(largest, _align(math.ceil(total / (min_groups * world_size))))
    if budget is not None:
        fit = budget // (2 * world_size * itemsize) // ALIGN * ALIGN
        upper = min(upper, fit)
    return max(upper, largest)  # the caller's budget check reports that even one group does not fit


def _layouts(params: Sequence[ParamSpec], largest: int, upper: int, world_size: int) -> Iterator[Layout]:
    """The layouts of at most ``_MAX_CANDIDATES`` chunk sizes from ``largest`` to ``upper``, ascending."""
    step = max(ALIGN, _align(math.ceil((upper - largest) / _MAX_CANDIDATES)))
    candidates = list(range(largest, upper + 1, step))
    if candidates[-1] != upper:
        candidates.append(upper)
    for size in candidates:
        yield plan_layout(params, size, world_size=world_size)


def _best_layout(params: Sequence[ParamSpec], largest: int, upper: int, world_size: int) -> Layout:
    best: Layout | None = None
    for layout in _layouts(params, largest, upper, world_size):
        if best is None or layout.capacity_elements <= best.capacity_elements:
            best = layout
    assert best is not None
    return best
