"""The prefetch planner ([Note: fetch and prefetch] in runtime/lookahead.py) on hand-made traces, and the ledger
of evictions in flight (runtime/inflight.py) with fake events."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from lightning_pstar.runtime.inflight import EvictionsInFlight
from lightning_pstar.runtime.lookahead import LookaheadState, plan_prefetch
from lightning_pstar.runtime.prefetch import Prefetcher


def _next_use(families: Sequence[tuple[int, ...]]):  # type: ignore[no-untyped-def]
    n = len(families)

    def next_use(fid: int, after: int) -> int:
        for d in range(1, n + 1):
            if fid in families[(after + d) % n]:
                return d
        return 1 << 30

    return next_use


def _state(
    families: list[tuple[int, ...]],
    rooms: list[int],
    *,
    resident: set[int],
    cursor: int = 0,
    size: int = 10,
    stops: frozenset[int] = frozenset(),
    busy: frozenset[int] = frozenset(),
) -> LookaheadState:
    fids = {f for m in families for f in m} | resident
    return LookaheadState(
        cursor=cursor,
        families=families,
        rooms=rooms,
        stops=stops,
        sizes={f: size for f in fids},
        resident=frozenset(resident),
        busy=busy,
        on_host=frozenset(fids - resident),
        used=size * len(resident),
        room_now=rooms[cursor],
        next_use=_next_use(families),
    )


def test_prefetches_in_order_of_next_use_as_far_as_the_room_allows() -> None:
    # moments 1..4 need 1, 2, 3, 4 in turn; room for three chunks everywhere; 0 is in use now
    families = [(0,), (1,), (2,), (3,), (4,)]
    plan = plan_prefetch(_state(families, [30] * 5, resident={0}, busy=frozenset({0})))
    assert plan.fetch == [(1, 1), (2, 2)]  # three chunks fit: 0, 1 and 2; 3 would need a fourth slot
    assert plan.evict == []


def test_a_moment_with_less_room_limits_what_is_fetched_across_it() -> None:
    families = [(0,), (1,), (2,), (3,)]
    rooms = [40, 20, 40, 40]  # moment 1 has room for two chunks only: 0 and 1
    plan = plan_prefetch(_state(families, rooms, resident={0}))
    assert plan.fetch == [(1, 1)]  # 2 would be on the device at moment 1 too: it does not fit there


def test_evicts_early_a_chunk_that_leaves_later_anyway_and_is_not_needed_before() -> None:
    # 9 is resident and next used at moment 4; at moment 2 the fetch of 2 evicts it (Belady: farthest next use)
    families = [(0,), (1,), (2,), (0, 1), (9,)]
    plan = plan_prefetch(_state(families, [30] * 5, resident={0, 9}, busy=frozenset({0})))
    # without the early eviction only 1 fits (0, 9, 1); with it 1 and 2 do, the same bytes move
    assert plan.evict == [9]
    assert [fid for fid, _ in plan.fetch][:2] == [1, 2]


def test_never_evicts_early_a_chunk_used_before_its_eviction() -> None:
    # 9 is used at moment 1, so it must stay until then: no early eviction, and the plan ends at 2
    families = [(0,), (1, 9), (2,), (3,)]
    plan = plan_prefetch(_state(families, [30] * 4, resident={0, 9}, busy=frozenset({0})))
    assert plan.evict == []
    assert plan.fetch == [(1, 1)]


def test_stops_at_the_optimizer_step() -> None:
    families = [(0,), (1,), (), (2,)]
    plan = plan_prefetch(_state(families, [100] * 4, resident={0}, stops=frozenset({2})))
    assert plan.fetch == [(1, 1)]  # 2 comes after the step: not planned across it


def test_resident_chunks_need_no_prefetch() -> None:
    families = [(0,), (1,), (2,)]
    plan = plan_prefetch(_state(families, [100] * 3, resident={0, 1, 2}))
    assert plan.fetch == [] and plan.evict == []


class FakeEvent:
    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.synchronized = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


def test_evictions_in_flight_count_until_their_copy_ends() -> None:
    ledger = EvictionsInFlight()
    first, second = FakeEvent(), FakeEvent()
    ledger.add(first, 100)
    ledger.add(second, 50)
    assert ledger.held() == 150
    first.done = True
    assert ledger.held() == 50  # the allocator may hand the first block out again
    assert ledger.settle(10) == 50 and second.synchronized == 1 and ledger.waits == 1
    assert ledger.held() == 0 and ledger.settle(10) == 0


def test_settle_waits_for_the_oldest_first_and_only_as_far_as_needed() -> None:
    ledger = EvictionsInFlight()
    events = [FakeEvent() for _ in range(3)]
    for event in events:
        ledger.add(event, 100)
    assert ledger.settle(150) == 200
    assert [e.synchronized for e in events] == [1, 1, 0]
    assert ledger.held() == 100


def test_an_unknown_prefetch_mode_is_refused() -> None:
    prefetcher = Prefetcher(None)  # type: ignore[arg-type]  # the mode needs no residency
    prefetcher.mode = "off"
    with pytest.raises(ValueError, match=r"prefetch mode must be one of \['lookahead', 'next', 'off'\], got 'far'"):
        prefetcher.mode = "far"
    assert prefetcher.mode == "off"
