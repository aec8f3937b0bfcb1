"""Pure planner: parameters (meta tensors are fine) -> chunk layout, and the chunk-size search.

Nothing here allocates memory for weights, so the same code serves setup and capacity planning.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

__all__ = [
    "ALIGN",
    "ChunkPlan",
    "Fit",
    "Layout",
    "ParamSpec",
    "group_of",
    "owner_of",
    "plan_layout",
    "search_chunk_size",
]

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


class Fit(Enum):
    """The capacities a chunk group may be fitted to (:func:`plan_layout`), and the sizes the search tries."""

    ALIGNED = "aligned"
    """Any multiple of :data:`ALIGN` elements."""
    POWER_OF_TWO = "power_of_two"
    """Powers of two only (CUDA: pinned host buffers waste nothing, [Note: pinned memory])."""


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

    chunk_size: int  # elements; chunks holding one oversized parameter may be larger, fitted groups smaller
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


def plan_layout(
    params: Sequence[ParamSpec], chunk_size: int, *, world_size: int = 1, fit_groups: Fit | None = None
) -> Layout:
    """Pack ``params`` in order into chunks of ``chunk_size`` elements.

    Trainable and frozen parameters go to separate chunks (frozen families carry no optimizer state).
    Each parameter lies whole inside one chunk; a parameter larger than ``chunk_size`` gets a chunk of its
    own. With ``world_size > 1`` the chunks of each kind are packed into whole communication groups of
    ``world_size`` chunks of one capacity (trainable groups first, then frozen ones; the last group of a kind
    is padded with empty chunks), so a group is gathered and reduced in one call: a group that holds a
    parameter larger than ``chunk_size`` has that parameter's capacity, and its other chunks are filled to it.
    ``fit_groups`` (the search's layouts): every group gets the smallest capacity of that kind (any aligned
    one, or a power of two) that still holds its parameters ([Note: utilisation at several ranks]).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive number of elements, got {chunk_size}")
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    for spec in params:
        if spec.numel <= 0:
            raise ValueError(
                f"parameter '{spec.name}' has no elements; empty parameters cannot be chunked. HINT: leave it out of"
                " the model (a zero-size layer computes nothing: e.g. skip a rank-0 adapter), or make it a buffer"
                " (`register_buffer`) if it only carries a shape."
            )
    if world_size == 1:
        return _layout_of(params, _pack_chunks(params, chunk_size), chunk_size)
    return _layout_of(params, _pack_groups(params, chunk_size, world_size, fit_groups), chunk_size)


def _layout_of(params: Sequence[ParamSpec], chunks: list[ChunkPlan], chunk_size: int) -> Layout:
    param_chunk = [-1] * len(params)
    param_offset = [-1] * len(params)
    for plan in chunks:
        for index, offset in zip(plan.members, plan.offsets, strict=True):
            param_chunk[index], param_offset[index] = plan.chunk_id, offset
    return Layout(
        chunk_size=chunk_size,
        chunks=chunks,
        param_chunk=param_chunk,
        param_offset=param_offset,
        payload_elements=sum(p.numel for p in params),
    )


def _pack_chunks(params: Sequence[ParamSpec], chunk_size: int) -> list[ChunkPlan]:
    """One rank: chunks in the order they are opened, each kind filled in module order."""
    chunks: list[ChunkPlan] = []
    open_chunk: dict[bool, ChunkPlan | None] = {True: None, False: None}
    for index, spec in enumerate(params):
        current = open_chunk[spec.trainable]
        if spec.numel > chunk_size:  # an oversized parameter gets a chunk of its own, sized to it
            plan = ChunkPlan(chunk_id=len(chunks), capacity=_align(spec.numel), trainable=spec.trainable)
            chunks.append(plan)
            open_chunk[spec.trainable] = None
        else:
            offset = _align(current.used) if current is not None else 0
            if current is None or offset + spec.numel > current.capacity:
                current = ChunkPlan(chunk_id=len(chunks), capacity=chunk_size, trainable=spec.trainable)
                chunks.append(current)
                open_chunk[spec.trainable] = current
            plan = current
        offset = _align(plan.used) if plan.members else 0
        plan.members.append(index)
        plan.offsets.append(offset)
        plan.used = offset + spec.numel
    return chunks


def _fill(numels: Sequence[int], start: int, capacity: int, world_size: int) -> list[list[tuple[int, int]]]:
    """Greedy in module order from ``numels[start]``: up to ``world_size`` chunks of ``capacity``, each a list of
    (position, offset); stops at the first parameter that does not fit."""
    chunks: list[list[tuple[int, int]]] = [[]]
    used = 0
    for pos in range(start, len(numels)):
        numel = numels[pos]
        offset = _align(used) if chunks[-1] else 0
        if offset + numel > capacity:
            if numel > capacity or len(chunks) == world_size:
                break
            chunks.append([])
            offset = 0
        chunks[-1].append((pos, offset))
        used = offset + numel
    return chunks


def _end(chunks: list[list[tuple[int, int]]], start: int) -> int:
    return start + sum(len(c) for c in chunks)


def _group_capacity(numels: Sequence[int], start: int, chunk_size: int, world_size: int) -> int:
    """The capacity of the group that starts at ``numels[start]``: ``chunk_size``, raised to a larger
    parameter's (aligned) size when that parameter then joins the group (its capacity is paid anyway)."""
    capacity = chunk_size
    end = _end(_fill(numels, start, capacity, world_size), start)
    while end < len(numels) and numels[end] > capacity:
        bigger = _align(numels[end])
        bigger_end = _end(_fill(numels, start, bigger, world_size), start)
        if bigger_end <= end:  # the large parameter starts the next group instead
            break
        capacity, end = bigger, bigger_end
    return capacity


def _fitted_capacity(numels: Sequence[int], start: int, end: int, capacity: int, world_size: int, fit: Fit) -> int:
    """The smallest capacity of ``fit``'s kind, at most ``capacity``, whose group from ``numels[start]`` holds
    the parameters up to ``numels[end]`` (``capacity`` itself does; filling is monotone in the capacity)."""
    group = numels[start:end]
    low = max(_align(max(group)), _align(math.ceil(sum(_align(n) for n in group) / world_size)))
    sizes = _Sizes(low, capacity, fit)  # ends with ``capacity``, which holds the group
    lo, hi = 0, len(sizes) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _end(_fill(numels, start, sizes[mid], world_size), start) >= end:
            hi = mid
        else:
            lo = mid + 1
    return sizes[hi]


@dataclass(frozen=True)
class _Sizes:
    """The capacities of ``fit``'s kind from ``low`` (aligned) below ``high``, then ``high``: a sequence for a
    bisection, without listing millions of aligned sizes."""

    low: int
    high: int
    fit: Fit

    def _first(self) -> int:
        return 1 << (self.low - 1).bit_length() if self.fit is Fit.POWER_OF_TWO else self.low

    def __len__(self) -> int:
        first = self._first()
        if first >= self.high:
            return 1
        if self.fit is Fit.POWER_OF_TWO:
            return (self.high - 1).bit_length() - (first - 1).bit_length() + 1
        return (self.high - first + ALIGN - 1) // ALIGN + 1

    def __getitem__(self, k: int) -> int:
        if k == len(self) - 1:
            return self.high
        first = self._first()
        return first << k if self.fit is Fit.POWER_OF_TWO else first + k * ALIGN


def _pack_groups(params: Sequence[ParamSpec], chunk_size: int, world_size: int, fit: Fit | None) -> list[ChunkPlan]:
    """Several ranks: whole groups of ``world_size`` chunks of one capacity, trainable groups first."""
    out: list[ChunkPlan] = []
    for trainable in (True, False):
        kind = [i for i, p in enumerate(params) if p.trainable is trainable]
        numels = [params[i].numel for i in kind]
        start = 0
        while start < len(kind):
            capacity = _group_capacity(numels, start, chunk_size, world_size)
            chunks = _fill(numels, start, capacity, world_size)
            end = _end(chunks, start)
            if fit is not None and end == len(kind):  # the last group: its parameters spread over its chunks
                capacity = _fitted_capacity(numels, start, end, capacity, world_size, fit)
                chunks = _fill(numels, start, capacity, world_size)
                assert _end(chunks, start) == end, "a fitted group holds the same parameters"
            elif fit is not None:  # a full group: its fullest chunk (a cheap bound; the search plans many)
                fullest = max(offset + numels[pos] for members in chunks for pos, offset in members[-1:])
                capacity = min(capacity, _Sizes(_align(fullest), capacity, fit)[0])
            chunks += [[] for _ in range(world_size - len(chunks))]
            for members in chunks:
                plan = ChunkPlan(chunk_id=len(out), capacity=capacity, trainable=trainable)
                for pos, offset in members:
                    plan.members.append(kind[pos])
                    plan.offsets.append(offset)
                    plan.used = offset + numels[pos]
                out.append(plan)
            start = end
    return out


def search_chunk_size(
    params: Sequence[ParamSpec],
    *,
    device_budget_bytes: int | None,
    compute_itemsize: int,
    world_size: int = 1,
    fit: Fit = Fit.ALIGNED,
    reference: float | None = None,
) -> Layout:
    """The layout for the chunk size that wastes the fewest elements.

    Candidates run from the largest parameter up to the smallest of: the size at which two chunk groups
    (``2 * world_size`` param chunks) would no longer fit ``device_budget_bytes``, and the size that still
    leaves ``_MIN_GROUPS`` chunk groups. Ties go to the larger chunk (fewer, larger copies). ``fit``: the
    sizes tried (every aligned one, or powers of two only, the capacities of the groups included).

    [Note: utilisation at several ranks]
    With ``world_size > 1`` the chunks come in whole groups of ``world_size`` equal chunks, so a group holds
    ``world_size`` times its largest chunk and the last group of a kind is mostly padding when it holds little.
    The search's layouts therefore fit every group: its capacity is the smallest (of ``fit``'s kind) that
    still holds the same parameters, so a short last group gets short chunks and a group filled below its size
    gives the difference back; a group that holds a parameter larger than the chunk size fills its other
    chunks to that size (:func:`plan_layout`). A small model still cannot have ``_MIN_GROUPS`` groups of
    ``world_size`` chunks that each hold its largest parameter: when the best layout's utilisation falls more
    than ``_MAX_UTILISATION_LOSS`` below ``reference`` (default: the one-rank layout's), fewer groups are
    allowed (sizes up to one group holding everything, within the budget), and the most groups that come
    within those points are taken: a layout that wastes half the memory on padding is worse than one with
    fewer units to place. Where none comes within them, the least wasteful layout is taken.
    """
    if not params:
        raise ValueError("the model has no parameters to place in chunks")
    largest = _align(max(p.numel for p in params))
    total = sum(_align(p.numel) for p in params)
    budget = device_budget_bytes
    upper = _upper(total, largest, world_size, budget, compute_itemsize)
    best = _best_layout(params, _sizes(largest, upper, fit), world_size, fit)
    if world_size > 1:
        if reference is None:
            reference = search_chunk_size(
                params, device_budget_bytes=budget, compute_itemsize=compute_itemsize, fit=fit
            ).utilisation
        floor = reference - _MAX_UTILISATION_LOSS
        if best.utilisation < floor:
            upper = _upper(total, largest, 1, budget, compute_itemsize, min_groups=1, budget_world_size=world_size)
            best = _fewer_groups(params, best, floor, _sizes(largest, upper, fit), upper, world_size, fit)
    if budget is not None and _module_need(best, params, world_size, compute_itemsize) > budget:
        # [Note: a budget below two groups]
        free = search_chunk_size(
            params, device_budget_bytes=None, compute_itemsize=compute_itemsize, world_size=world_size, fit=fit,
            reference=reference,
        )  # fmt: skip
        if _module_need(free, params, world_size, compute_itemsize) <= budget:
            best = free
    return best


def _module_need(layout: Layout, params: Sequence[ParamSpec], world_size: int, itemsize: int) -> int:
    """Bytes of the groups the most demanding module uses at once, modules told apart by the parameters' names
    (a module uses its own parameters' groups and its ancestors'): the estimate the search has of what
    :func:`~lightning_pstar.planning.requirements.min_device_bytes` finds on the module tree.

    [Note: a budget below two groups]
    The search keeps two groups of its chunk size within the device budget; where the budget is smaller than
    that for every size, or the layout it leaves needs more than the budget for one module, a layout the budget
    does not shape may still fit (a chunk size that keeps a module's parameters in one group): the unshaped
    search's layout is taken when this estimate says it fits. So the planner's minimum device need of a
    layout, given back as the budget, plans a layout that fits it.
    """
    capacity = {group_of(c.chunk_id, world_size): c.capacity for c in layout.chunks}
    own: dict[str, set[int]] = {}
    for index, spec in enumerate(params):
        own.setdefault(spec.name.rpartition(".")[0], set()).add(group_of(layout.param_chunk[index], world_size))
    worst = 0
    for module in own:
        groups: set[int] = set()
        prefix = module
        while True:  # the module and its ancestors that have parameters of their own
            groups |= own.get(prefix, set())
            if not prefix:
                break
            prefix = prefix.rpartition(".")[0]
        worst = max(worst, sum(capacity[g] for g in groups))
    return worst * world_size * itemsize


def _fewer_groups(
    params: Sequence[ParamSpec], best: Layout, floor: float, sizes: list[int], upper: int, world_size: int, fit: Fit
) -> Layout:
    """[Note: utilisation at several ranks]: the most groups within ``floor``, in module order (``sizes``) or else
    largest first (:func:`_balanced_layout`); the least wasteful layout where none comes within it."""
    good: Layout | None = None  # the most groups (the smallest chunks) among those that waste little
    for layout in _layouts(params, sizes, world_size, fit):
        if layout.utilisation >= floor and (good is None or layout.chunk_size < good.chunk_size):
            good = layout
        if good is None and layout.capacity_elements < best.capacity_elements:
            best = layout  # none does so far: the least waste
    for groups in range(_MIN_GROUPS, 0, -1):
        if good is not None:
            break
        balanced = _balanced_layout(params, world_size, groups, fit, upper)
        if balanced is not None and balanced.utilisation >= floor:
            good = balanced
        elif balanced is not None and balanced.capacity_elements < best.capacity_elements:
            best = balanced
    return good if good is not None else best


def _balanced_layout(params: Sequence[ParamSpec], world_size: int, groups: int, fit: Fit, upper: int) -> Layout | None:
    """Each kind's parameters packed largest first (first fit) into ``groups`` groups (fewer for a kind with
    fewer parameters) of ``world_size`` chunks of the smallest capacity that holds them all; members keep module
    order inside a chunk and chunks are ordered by their first member. None where that capacity passes ``upper``
    (the budget's) without being the largest parameter's."""
    chunks: list[ChunkPlan] = []
    for trainable in (True, False):
        kind = [i for i, p in enumerate(params) if p.trainable is trainable]
        if not kind:
            continue
        sizes = {i: _align(params[i].numel) for i in kind}
        order = sorted(kind, key=lambda i: (-sizes[i], i))
        n_bins = min(groups, -(-len(kind) // world_size)) * world_size
        capacity, bins = _balanced_bins(order, sizes, n_bins, fit)
        if capacity > upper and capacity > sizes[order[0]]:
            return None
        bins.sort(key=lambda members: min(members) if members else len(params))
        for members in bins:
            plan = ChunkPlan(chunk_id=len(chunks), capacity=capacity, trainable=trainable)
            for index in sorted(members):
                offset = _align(plan.used) if plan.members else 0
                plan.members.append(index)
                plan.offsets.append(offset)
                plan.used = offset + params[index].numel
            chunks.append(plan)
    return _layout_of(params, chunks, max(c.capacity for c in chunks))


def _balanced_bins(order: list[int], sizes: dict[int, int], n_bins: int, fit: Fit) -> tuple[int, list[list[int]]]:
    """The smallest capacity (of ``fit``'s kind) at which first fit puts ``order`` into ``n_bins`` bins, and the
    bins. First fit always succeeds at the mean load plus the largest item (a bin it cannot use is fuller than
    the mean), so the search has a feasible end."""
    low = max(sizes[order[0]], _align(math.ceil(sum(sizes.values()) / n_bins)))
    high = low + sizes[order[0]]
    if fit is Fit.POWER_OF_TWO:
        high = 1 << (high - 1).bit_length()
    candidates = _Sizes(low, high, fit)
    lo, hi = 0, len(candidates) - 1  # hi: feasible; first fit is near enough monotone for a bisection
    found = _first_fit(order, sizes, n_bins, candidates[hi])
    assert found is not None
    while lo < hi:
        mid = (lo + hi) // 2
        bins = _first_fit(order, sizes, n_bins, candidates[mid])
        if bins is None:
            lo = mid + 1
        else:
            hi, found = mid, bins
    return candidates[hi], found


def _first_fit(order: list[int], sizes: dict[int, int], n_bins: int, capacity: int) -> list[list[int]] | None:
    loads = [0] * n_bins
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for index in order:
        size = sizes[index]
        target = next((b for b in range(n_bins) if loads[b] + size <= capacity), None)
        if target is None:
            return None
        loads[target] += size
        bins[target].append(index)
    return bins


def _upper(
    total: int,
    largest: int,
    world_size: int,
    budget: int | None,
    itemsize: int,
    *,
    min_groups: int = _MIN_GROUPS,
    budget_world_size: int | None = None,
) -> int:
    """The largest candidate: ``min_groups`` groups of ``world_size`` chunks, two groups (of
    ``budget_world_size`` chunks, default ``world_size``) within the budget."""
    upper = max(largest, _align(math.ceil(total / (min_groups * world_size))))
    if budget is not None:
        fit = budget // (2 * (budget_world_size or world_size) * itemsize) // ALIGN * ALIGN
        upper = min(upper, fit)
    return max(upper, largest)  # the caller's budget check reports that even one group does not fit


def _sizes(largest: int, upper: int, fit: Fit) -> list[int]:
    """At most ``_MAX_CANDIDATES`` chunk sizes from ``largest`` to ``upper``, ascending; with powers of two, those
    from the smallest that holds ``largest`` up to ``upper`` (at least that one)."""
    if fit is Fit.POWER_OF_TWO:
        sizes = [1 << (largest - 1).bit_length()]
        while sizes[-1] * 2 <= upper:
            sizes.append(sizes[-1] * 2)
        return sizes
    step = max(ALIGN, _align(math.ceil((upper - largest) / _MAX_CANDIDATES)))
    sizes = list(range(largest, upper + 1, step))
    if sizes[-1] != upper:
        sizes.append(upper)
    return sizes


def _layouts(params: Sequence[ParamSpec], sizes: list[int], world_size: int, fit: Fit) -> Iterator[Layout]:
    """The layouts of ``sizes``, groups fitted ([Note: utilisation at several ranks])."""
    for size in sizes:
        yield plan_layout(params, size, world_size=world_size, fit_groups=fit if world_size > 1 else None)


def _best_layout(params: Sequence[ParamSpec], sizes: list[int], world_size: int, fit: Fit) -> Layout:
    best: Layout | None = None
    for layout in _layouts(params, sizes, world_size, fit):
        if best is None or layout.capacity_elements <= best.capacity_elements:
            best = layout
    assert best is not None
    return best
