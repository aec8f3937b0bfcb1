"""The yardstick: the fewest bytes any placement could move per iteration, given the warm-up trace.

Pure arithmetic over the trace; nothing here touches a chunk. :func:`placement_problem` turns the warm-up trace
into a :class:`PlacementProblem`, :func:`solve` bounds its optimum from both sides, and the plan it finds is
what :class:`~lightning_pstar.runtime.placement.AutoPlacement` follows.

[Note: the yardstick]
The engine's rules, as the model sees them. The iteration is a cycle of *points*: each forward or backward
moment of the trace is one point needing its param chunks on the device; the optimizer step is one point per
trainable family, in family order, needing that family's param chunk on the device when its step runs there
(it then writes the chunk on the device), or off it when its step runs on the host (it then writes the host
bytes). At point ``t`` the param chunks on the device may take ``room[t] = budget - non_model[t] - optimizer
chunks on the device``. Chunks move whole, and a move costs its bytes, except a *clean* eviction ([Note:
clean evictions] in ``chunk.py``): one whose host copy is current (the chunk was fetched since it was last
written on the device) costs nothing. Gradients are written into the param chunks during backward in mixed
precision.

Between two consecutive events of a chunk (a *gap*) a schedule either keeps the chunk on the device, taking its
bytes at every point the gap spans, or drops it at the gap's start and fetches it at its end (evicting later or
fetching earlier costs the same bytes and only takes more room). A dropped gap costs a fetch (its bytes), plus
one copy back to the host if the chunk was dirty: the first dropped gap after a write pays that, the later
ones of the same *chain* (gaps until the next write) are clean. So a chain of gaps ``g_1..g_k`` costs
``sum(fetch_i * (1 - y_i)) + dirty * [some gap dropped]`` for keep flags ``y``. Choosing the ``y`` with every
point's room respected is a knapsack over intervals (the unsplittable flow problem on a cycle, NP-hard with
chunks of different sizes), so the optimum is bracketed:

- **lower bound**: Lagrangian relaxation of the room constraints (after ruling out the gaps whose chunk alone
  exceeds the room left at a point they span). For prices ``lam[t] >= 0`` every schedule's
  savings are at most ``sum(lam[t] * room_left[t]) + sum over chains of the best savings at those prices``
  (each chain's inner problem is solved exactly), so ``cost_of_dropping_everything - that`` bounds every
  schedule's cost from below, whatever the prices; subgradient steps tighten it. Costs are sums of chunk
  sizes, so the bound rounds up to a multiple of their greatest common divisor. Where the model is unsure it
  errs low: gradients are taken as written at a chunk's last backward use (the latest they can be), host
  copies are assumed kept (the host budget may drop them), extra fetches (weights unpacked for backward,
  evaluation) are not counted;
- **upper bound**: a feasible schedule (greedy drops where the room is short, then re-adding what fits), its
  cost simulated with gradients written at the first backward use (the earliest) and every step writing.

When the two meet, the optimum is exact (``optimal_bytes_per_iteration`` in the memory report).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Bounds", "Gap", "PlacementProblem", "Point", "solve"]

_ITERATIONS = 400  # subgradient steps of the lower bound (each one is linear in the gaps)
_MIN_ITERATIONS = 20
_RULE0_LIMIT = 250_000  # points x gaps above which the upper plan skips its quadratic rule
_WORK = 200_000  # size classes x (points + gaps) x steps: large models get fewer steps (a looser, still valid bound)


@dataclass(frozen=True, kw_only=True)
class Point:
    """One point of the cyclic iteration (see [Note: the yardstick])."""

    label: str
    need: frozenset[int]  # families whose param chunk must be on the device
    out: frozenset[int] = frozenset()  # families whose param chunk must be off it (a host optimizer step)
    room: int  # bytes param chunks may take on the device here
    writes: frozenset[int] = frozenset()  # families whose device bytes are written here (upper bound's model)
    writes_late: frozenset[int] = frozenset()  # ... the lower bound's model (a subset: the latest writes)


@dataclass(frozen=True, kw_only=True)
class PlacementProblem:
    """Points of one iteration and the bytes of each family's param chunk."""

    points: tuple[Point, ...]
    sizes: dict[int, int]
    moment_point: dict[int, int] = field(default_factory=dict)  # trace moment -> its point (forward, backward)


@dataclass(kw_only=True)
class Gap:
    """The span between two consecutive events of one family (exclusive of both)."""

    family: int
    start: int  # point index of the event before
    end: int  # point index of the event after (cyclic: may be <= start)
    span: tuple[int, ...]  # points strictly between
    size: int
    fetch: int  # bytes a drop costs to fetch back (0 when the gap ends off the device)
    choosable: bool  # False: the chunk cannot stay (it ends at a host step, or starts off the device)


@dataclass(kw_only=True)
class Chain:
    """Gaps of one family from a write to the next: one copy back pays for all of them ([Note: the yardstick])."""

    gaps: list[int]  # indices into the gap list
    dirty: int  # bytes the first drop copies back (0: the host copy is current from the start)


@dataclass(kw_only=True)
class Bounds:
    """The optimum's bracket, in bytes per iteration, and the feasible plan behind the upper bound."""

    lower: int
    upper: int
    keep: dict[int, frozenset[int]] = field(default_factory=dict)  # point -> families kept (the upper plan)

    @property
    def exact(self) -> int | None:
        return self.lower if self.lower == self.upper else None


def _gaps(problem: PlacementProblem) -> list[Gap]:
    points = problem.points
    n = len(points)
    gaps: list[Gap] = []
    for fid, size in sorted(problem.sizes.items()):
        events = [i for i, p in enumerate(points) if fid in p.need or fid in p.out]
        for k, start in enumerate(events):
            end = events[(k + 1) % len(events)]
            span = tuple((start + d) % n for d in range(1, (end - start) % n or n))
            starts_off = fid in points[start].out
            ends_off = fid in points[end].out
            gaps.append(
                Gap(
                    family=fid,
                    start=start,
                    end=end,
                    span=span,
                    size=size,
                    fetch=0 if ends_off else size,
                    choosable=not starts_off and not ends_off,
                )
            )
    return gaps


def _chains(problem: PlacementProblem, gaps: Sequence[Gap]) -> list[Chain]:
    """The lower bound's chains: a chain starts after a (late) write or after a host step."""
    points = problem.points
    by_family: dict[int, list[int]] = {}
    for index, gap in enumerate(gaps):
        by_family.setdefault(gap.family, []).append(index)
    chains: list[Chain] = []
    for fid, indices in by_family.items():

        def starts_chain(i: int, fid: int = fid) -> bool:
            start = points[gaps[i].start]
            return fid in start.writes_late or fid in start.out

        heads = [k for k, i in enumerate(indices) if starts_chain(i)]
        if not heads:  # never written: clean all around
            chains.append(Chain(gaps=list(indices), dirty=0))
            continue
        for h, head in enumerate(heads):
            nxt = heads[(h + 1) % len(heads)]
            count = (nxt - head) % len(indices) or len(indices)
            members = [indices[(head + d) % len(indices)] for d in range(count)]
            after_host_step = fid in points[gaps[members[0]].start].out
            dirty = 0 if after_host_step else gaps[members[0]].size
            if after_host_step:
                members = members[1:]  # the fetch after a host step is forced and leaves the host copy current
                if not members:
                    continue
                # the fetch that ends the forced gap makes the rest of the chain clean
            chains.append(Chain(gaps=members, dirty=dirty))
    return chains


def _forced(gaps: Sequence[Gap], points: Sequence[Point]) -> int:
    """Bytes every schedule moves: fetches after a host step (the host wrote the chunk)."""
    return sum(g.fetch for g in gaps if g.family in points[g.start].out)


def _chain_best(chain: Chain, gaps: Sequence[Gap], price: Sequence[float]) -> tuple[float, list[int]]:
    """Best savings (against dropping every gap) of one chain at ``price`` per gap, and the gaps it keeps."""
    values = [(i, gaps[i].fetch - price[i]) for i in chain.gaps if gaps[i].choosable]
    all_choosable = len(values) == len(chain.gaps)
    positive = [i for i, v in values if v > 0]
    partial = sum(v for _, v in values if v > 0)
    if all_choosable and values and len(positive) == len(values):
        return partial + chain.dirty, positive  # everything kept: the copy back is saved too
    best, kept = partial, positive
    if all_choosable and values:
        whole = sum(v for _, v in values) + chain.dirty
        if whole > best:
            best, kept = whole, [i for i, _ in values]
    return best, kept


def _range_sums(values: Sequence[float], gaps: Sequence[Gap]) -> list[float]:
    """Per gap, the sum of ``values`` over the points it spans (a cyclic range: prefix sums)."""
    n = len(values)
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    sums = []
    for g in gaps:
        first, count = (g.start + 1) % n, len(g.span)
        last = first + count
        sums.append(prefix[last] - prefix[first] if last <= n else prefix[n] - prefix[first] + prefix[last - n])
    return sums


def _cardinality(gaps: Sequence[Gap], left: Sequence[int], sizes: Sequence[int]) -> dict[int, list[int]]:
    """Per size ``z`` and point: how many of the choosable gaps of at least ``z`` bytes spanning the point can
    stay there at once (smallest first); the integer rounding the byte constraint alone loses."""
    n = len(left)
    spanning: list[list[int]] = [[] for _ in range(n)]
    for g in gaps:
        if g.choosable:
            for t in g.span:
                spanning[t].append(g.size)
    limits: dict[int, list[int]] = {}
    for z in sizes:
        row = []
        for t in range(n):
            fit, used = 0, 0
            for size in sorted(x for x in spanning[t] if x >= z):
                if used + size > left[t]:
                    break
                used += size
                fit += 1
            row.append(fit)
        limits[z] = row
    return limits


def _lower_bound(problem: PlacementProblem, gaps: Sequence[Gap], target: float) -> int:
    """The Lagrangian bound of [Note: the yardstick]; ``target`` is the savings of a known plan (Polyak steps).

    Dualised per point: the bytes the kept gaps take (``lam``), and for each gap size ``z`` the count of kept
    gaps of at least ``z`` bytes (``mu[z]``, see :func:`_cardinality`). Bytes are scaled to the largest chunk so
    the two kinds of price are steered by one step."""
    points = problem.points
    n = len(points)
    chains = _chains(problem, gaps)
    scale = max(problem.sizes.values())
    left_bytes = [p.room - sum(problem.sizes[f] for f in p.need) for p in points]
    left = [x / scale for x in left_bytes]
    zs = sorted({g.size for g in gaps if g.choosable})
    limits = _cardinality(gaps, left_bytes, zs)
    drop_all = _forced(gaps, points) + sum(sum(gaps[i].fetch for i in c.gaps) + c.dirty for c in chains)
    lam = [0.0] * n
    mu = {z: [0.0] * n for z in zs}
    best_dual = math.inf
    # the end of the warm-up waits for this: cap the steps by the problem's size (any multipliers give a valid
    # bound, fewer steps only a looser one); a small model keeps all of them
    per_step = (len(zs) + 1) * (n + len(gaps))
    iterations = max(_MIN_ITERATIONS, min(_ITERATIONS, _WORK // max(1, per_step)))
    for it in range(iterations):
        lam_sums = _range_sums(lam, gaps)
        mu_sums = {z: _range_sums(mu[z], gaps) for z in zs}
        price = [
            scale * (g.size / scale * lam_sums[i] + sum(mu_sums[z][i] for z in zs if z <= g.size))
            for i, g in enumerate(gaps)
        ]
        dual = scale * (
            sum(lam[t] * left[t] for t in range(n)) + sum(mu[z][t] * limits[z][t] for z in zs for t in range(n))
        )
        kept_all: list[int] = []
        for chain in chains:
            value, kept = _chain_best(chain, gaps, price)
            dual += value
            kept_all.extend(kept)
        best_dual = min(best_dual, dual)
        if best_dual - target < 0.5:
            break
        load = _per_point(n, [(gaps[i], gaps[i].size / scale) for i in kept_all])
        # projected: a price at 0 that would fall further stays there and does not steer the step
        grad_lam = [0.0 if lam[t] == 0 and left[t] > load[t] else left[t] - load[t] for t in range(n)]
        grad_mu = {}
        for z in zs:
            count = _per_point(n, [(gaps[i], 1.0) for i in kept_all if gaps[i].size >= z])
            grad_mu[z] = [
                0.0 if mu[z][t] == 0 and limits[z][t] > count[t] else limits[z][t] - count[t] for t in range(n)
            ]
        norm = sum(x * x for x in grad_lam) + sum(x * x for row in grad_mu.values() for x in row)
        if norm == 0:
            break
        step = 1.5 * (dual - target) / scale / norm / (1 + it / 50)  # Polyak step towards the known savings
        lam = [max(0.0, lam[t] - step * grad_lam[t]) for t in range(n)]
        mu = {z: [max(0.0, mu[z][t] - step * grad_mu[z][t]) for t in range(n)] for z in zs}
    unit = 0
    for size in problem.sizes.values():
        unit = math.gcd(unit, size)
    bound = drop_all - best_dual - 1e-6 * max(1.0, drop_all)  # float slack, never in the bound's favour
    return max(0, math.ceil(bound / unit) * unit) if unit else 0


def _per_point(n: int, weighted: Sequence[tuple[Gap, float]]) -> list[float]:
    """Per point, the sum of the weights of the gaps spanning it (a difference array over cyclic ranges)."""
    delta = [0.0] * (n + 1)
    for g, w in weighted:
        first = (g.start + 1) % n
        last = first + len(g.span)
        delta[first] += w
        if last <= n:
            delta[last] -= w
        else:
            delta[n] -= w
            delta[0] += w
            delta[last - n] -= w
    out, running = [], 0.0
    for t in range(n):
        running += delta[t]
        out.append(running)
    return out


def _simulate(problem: PlacementProblem, gaps: Sequence[Gap], keep: Sequence[bool]) -> int:
    """Bytes one steady-state iteration of the plan moves, with the upper bound's (earliest) writes."""
    points = problem.points
    by_end = {(g.family, g.end): i for i, g in enumerate(gaps)}
    total = 0
    for fid in problem.sizes:
        events = [i for i, p in enumerate(points) if fid in p.need or fid in p.out]
        on_device, host_current = True, False
        for lap in range(2):  # the first lap settles the state the cycle starts with
            cost = 0
            for e in events:
                index = by_end[(fid, e)]
                if not keep[index] and on_device:  # dropped: it left at the gap's start
                    cost += 0 if host_current else gaps[index].size
                    on_device, host_current = False, True
                point = points[e]
                if fid in point.out:
                    on_device, host_current = False, True  # the host step writes the host bytes
                    continue
                if not on_device:
                    cost += gaps[index].size
                    on_device = True
                if fid in point.writes:
                    host_current = False
            if lap == 1:
                total += cost
    return total


def _drop_cost(gap: Gap, points: Sequence[Point]) -> int:
    """What dropping ``gap`` costs if it is the first drop after a write (a guess for the greedy plan)."""
    return gap.fetch + (gap.size if gap.family in points[gap.start].writes else 0)


def _repair(problem: PlacementProblem, gaps: Sequence[Gap], keep: list[bool], rule: int) -> list[bool]:
    """Drop kept gaps over the fullest point until every point fits, then put back what still fits.

    ``rule`` picks the victim over the fullest point: 0, the most overflow relieved per byte the drop costs;
    1, the cheapest drop; 2, the largest chunk (the three greedy plans the upper bound tries)."""
    points = problem.points
    keep = [k and g.choosable for k, g in zip(keep, gaps, strict=True)]
    over = [sum(problem.sizes[f] for f in p.need) - p.room for p in points]
    covering: list[list[int]] = [[] for _ in points]  # the gaps over each point, in gap order
    for i, g in enumerate(gaps):
        for t in g.span:
            covering[t].append(i)
            if keep[i]:
                over[t] += g.size

    def merit(i: int) -> tuple[float, int]:
        g = gaps[i]
        cost = max(1, _drop_cost(g, points))
        if rule == 1:
            return (-cost, -i)
        if rule == 2:
            return (g.size, -i)
        relief = sum(min(g.size, over[t]) for t in g.span if over[t] > 0)
        return (relief / cost, -i)

    while True:
        worst = max(range(len(points)), key=lambda t: over[t])
        if over[worst] <= 0:
            break
        options = [i for i in covering[worst] if keep[i]]
        assert options, "a point over its room with nothing to drop: the trace does not fit"
        victim = max(options, key=merit)
        keep[victim] = False
        for t in gaps[victim].span:
            over[t] -= gaps[victim].size
    for i in sorted(range(len(gaps)), key=lambda i: -_drop_cost(gaps[i], points)):
        g = gaps[i]
        if g.choosable and not keep[i] and all(over[t] + g.size <= 0 for t in g.span):
            keep[i] = True
            for t in g.span:
                over[t] += g.size
    return keep


def _upper_plan(problem: PlacementProblem, gaps: Sequence[Gap]) -> tuple[list[bool], int]:
    """The cheapest of the greedy plans (see :func:`_repair`) and what it moves."""
    best: tuple[list[bool], int] | None = None
    # rule 0 weighs every option's relief over its whole span: quadratic in the trace; large traces (the end of
    # the warm-up waits for this) try the two constant-time rules only, a possibly looser but still feasible plan
    rules = (0, 1, 2) if len(problem.points) * len(gaps) <= _RULE0_LIMIT else (1, 2)
    for rule in rules:
        keep = _repair(problem, gaps, [True] * len(gaps), rule)
        cost = _simulate(problem, gaps, keep)
        if best is None or cost < best[1]:
            best = (keep, cost)
    assert best is not None
    return best


def solve(problem: PlacementProblem) -> Bounds | None:
    """Bracket the optimum of ``problem`` (None when even the chunks each point needs exceed its room)."""
    points = problem.points
    if not points or not problem.sizes:
        return Bounds(lower=0, upper=0)
    if any(sum(problem.sizes[f] for f in p.need) > p.room for p in points):
        return None
    gaps = _gaps(problem)
    left = [p.room - sum(problem.sizes[f] for f in p.need) for p in points]
    for gap in gaps:  # a chunk larger than the room some point of its gap leaves can never stay
        if gap.choosable and any(gap.size > left[t] for t in gap.span):
            gap.choosable = False
    keep, upper = _upper_plan(problem, gaps)
    chains = _chains(problem, gaps)
    drop_all = _forced(gaps, points) + sum(sum(gaps[i].fetch for i in c.gaps) + c.dirty for c in chains)
    lower = min(upper, _lower_bound(problem, gaps, max(0.0, drop_all - upper)))
    kept: dict[int, set[int]] = {t: set(p.need) for t, p in enumerate(points)}
    for i, g in enumerate(gaps):
        if keep[i]:
            for t in g.span:
                kept[t].add(g.family)
    return Bounds(lower=lower, upper=upper, keep={t: frozenset(f) for t, f in kept.items()})
