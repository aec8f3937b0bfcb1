"""Unit tests of lightning_pstar.runtime.yardstick: the bracket of the fewest bytes any placement moves.

The bounds are checked against brute force: every keep/drop choice of every gap of small random problems,
each feasible one costed by the same simulation of the engine's rules. The lower bound must never exceed any
feasible schedule's cost (a bound above a real schedule is a wrong yardstick), and the upper bound is the cost
of one feasible schedule.
"""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_pstar.runtime.yardstick import PlacementProblem, Point, _gaps, _simulate, solve


def _iteration(
    sizes: list[int], rooms: list[int], *, device_step: set[int], mixed: bool, rng: random.Random
) -> PlacementProblem:
    """A forward over the families in a shuffled order (one or two per module), the backward in reverse,
    then one step point per family; ``rooms`` per forward/backward point, the last one for the step."""
    order = list(range(len(sizes)))
    rng.shuffle(order)
    modules = [frozenset(order[i : i + rng.choice((1, 2))]) for i in range(0, len(order), 2)]
    forward = [Point(label=f"fwd{i}", need=m, room=0) for i, m in enumerate(modules)]
    backward = [
        Point(
            label=f"bwd{i}", need=m, room=0, writes=m if mixed else frozenset(), writes_late=m if mixed else frozenset()
        )
        for i, m in reversed(list(enumerate(modules)))
    ]
    points = []
    for i, p in enumerate(forward + backward):
        points.append(
            Point(
                label=p.label, need=p.need, room=rooms[i % (len(rooms) - 1)], writes=p.writes, writes_late=p.writes_late
            )
        )
    for fid in range(len(sizes)):
        one = frozenset({fid})
        if fid in device_step:
            points.append(Point(label=f"step{fid}", need=one, room=rooms[-1], writes=one, writes_late=one))
        else:
            points.append(Point(label=f"step{fid}", need=frozenset(), out=one, room=rooms[-1]))
    return PlacementProblem(points=tuple(points), sizes=dict(enumerate(sizes)))


def _brute_force(problem: PlacementProblem) -> int | None:
    gaps = _gaps(problem)
    free = [i for i, g in enumerate(gaps) if g.choosable]
    best = None
    for bits in itertools.product((False, True), repeat=len(free)):
        keep = [False] * len(gaps)
        for i, b in zip(free, bits, strict=True):
            keep[i] = b
        load = [sum(problem.sizes[f] for f in p.need) for p in problem.points]
        for i, g in enumerate(gaps):
            if keep[i]:
                for t in g.span:
                    load[t] += g.size
        if any(load[t] > p.room for t, p in enumerate(problem.points)):
            continue
        cost = _simulate(problem, gaps, keep)
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_bounds_bracket_the_brute_force_optimum(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(2, 4)
    sizes = [rng.choice((16, 16, 32, 48)) for _ in range(n)]
    total = sum(sizes)
    rooms = [rng.randint(max(sizes) * 2, total + max(sizes)) for _ in range(5)]
    device_step = {f for f in range(n) if rng.random() < 0.5}
    problem = _iteration(sizes, rooms, device_step=device_step, mixed=rng.random() < 0.5, rng=rng)
    bounds = solve(problem)
    best = _brute_force(problem)
    if best is None:  # no feasible schedule at all
        return
    assert bounds is not None
    assert bounds.lower <= best <= bounds.upper, (bounds, best)
    # the upper bound is what its own plan moves: the plan keeps every point within its room
    for t, point in enumerate(problem.points):
        assert sum(problem.sizes[f] for f in bounds.keep[t]) <= point.room, (t, bounds.keep[t])
        assert point.need <= bounds.keep[t]


def test_everything_fits_then_only_the_host_steps_move() -> None:
    # two families, room for both everywhere: family 0 steps on the host (its gradient goes down, its new
    # weights come back: 2 x 16 bytes in mixed precision), family 1 on the device (never moves)
    problem = _iteration([16, 32], [1000] * 3, device_step={1}, mixed=True, rng=random.Random(0))
    bounds = solve(problem)
    assert bounds is not None
    assert bounds.lower == bounds.upper == bounds.exact == 2 * 16


def test_clean_chunks_cost_only_their_fetch() -> None:
    # 32-true, everything on the host step: the param chunk is never written on the device, so its eviction for
    # the host step is clean (free) and only the fetch after the step (the host wrote the weights) is paid
    problem = _iteration([16, 16], [1000] * 3, device_step=set(), mixed=False, rng=random.Random(0))
    bounds = solve(problem)
    assert bounds is not None and bounds.exact == 2 * 16


def test_a_point_whose_own_chunks_exceed_its_room_has_no_schedule() -> None:
    problem = PlacementProblem(points=(Point(label="fwd", need=frozenset({0}), room=8),), sizes={0: 16})
    assert solve(problem) is None


def test_a_deep_model_short_of_room_at_the_peak_is_solved_exactly() -> None:
    # 20 one-chunk modules, 32-true (backward writes nothing), every step on the host. Activations peak between
    # forward and backward, where the room holds 12 chunks beside the one computing: 7 fwd->bwd gaps must be
    # dropped, each a clean eviction plus a fetch (16 bytes); the host steps add one fetch per family
    n, size = 20, 16
    forward = [
        Point(label=f"fwd{i}", need=frozenset({i}), room=(i + 1) * size if i < 13 else 13 * size) for i in range(n)
    ]
    backward = [
        Point(label=f"bwd{i}", need=frozenset({i}), room=(i + 1) * size if i < 13 else 13 * size)
        for i in reversed(range(n))
    ]
    steps = [Point(label=f"step{i}", need=frozenset(), out=frozenset({i}), room=n * size) for i in range(n)]
    problem = PlacementProblem(points=tuple(forward + backward + steps), sizes=dict.fromkeys(range(n), size))
    bounds = solve(problem)
    assert bounds is not None
    assert bounds.lower == bounds.upper == n * size + 7 * size, bounds
