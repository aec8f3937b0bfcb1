"""The CPU-visible bookkeeping of asynchronous fetches and evictions ([Note: fetch and prefetch] in
runtime/lookahead.py, issue 29 item 5): on the simulated device every copy is synchronous, so these tests stand in
for the copy stream with a fake event (the copy itself runs at once) and a fake compute stream that records what it
was told to wait on. The same paths run for real in tests/gpu/test_fetch_events_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_pstar.config import PStarConfig
from lightning_pstar.runtime.chunk import Chunk
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.state import Tier

CAP = 64


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.synchronized = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


class FakeStream:
    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


@pytest.fixture
def in_flight(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeStream, list[FakeEvent]]:
    """Every asynchronous chunk move (a prefetch, a demand fetch, an eviction) leaves a fake event in flight, and
    the compute stream is a fake one."""
    stream = FakeStream()
    events: list[FakeEvent] = []
    move_to = Chunk.move_to

    def moving(self: Chunk, tier: Tier, *, stream: Any = None, keep_host_copy: bool = False) -> None:
        before = self.tier
        move_to(self, tier, stream=None, keep_host_copy=keep_host_copy)
        if stream is not None and before is not tier:
            events.append(FakeEvent())
            self._pending = events[-1]  # type: ignore[assignment]

    monkeypatch.setattr(Chunk, "move_to", moving)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    return stream, events


def _manager(device_limit: int | None = None) -> ChunkManager:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # 72 + 72 elements: two families of 100
    config = PStarConfig.from_flat(chunk_size=100, placement="static", device_memory_limit=device_limit)
    manager = ChunkManager(model, config=config, compute_dtype=torch.float32, device=torch.device("cpu"))
    manager.materialise()
    residency = manager.residency
    residency.copy_stream = lambda: object()  # type: ignore[method-assign, assignment]
    return manager


def _points_into(param: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    assert buffer is not None
    return param.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() != 0


def test_parameters_point_at_the_device_only_once_the_compute_stream_waited(
    in_flight: tuple[FakeStream, list[FakeEvent]],
) -> None:
    stream, events = in_flight
    manager = _manager()
    residency, family = manager.residency, manager.families[0]
    residency.move_param_chunk(family, Tier.HOST)
    chunk = family.param_chunk
    for record in family.records:
        assert _points_into(record.param, chunk.host_buffer)
    events[-1].done = True
    expected = [r.param.detach().clone() for r in family.records]

    residency.move_param_chunk(family, Tier.DEVICE, asynchronous=True)  # a prefetch: its copy is in flight
    assert chunk.pending and stream.waited == []
    for record in family.records:  # a read the engine does not see gets the host bytes, never the device's
        residency.point_at_chunk(record)  # any path that re-points a parameter waits for the copy too
        assert _points_into(record.param, chunk.host_buffer)

    residency.fetch(family, protect=set())  # the module that needs it
    assert stream.waited == [events[-1]] and not chunk.pending
    for record, want in zip(family.records, expected, strict=True):
        assert _points_into(record.param, chunk.device_buffer)
        assert torch.equal(record.param, want)
    assert residency.stats.prefetch_hits == 0  # moved by hand, not by the prefetch: not counted as a hit


def test_a_demand_fetch_copies_on_the_copy_stream_and_waits_on_its_event(
    in_flight: tuple[FakeStream, list[FakeEvent]],
) -> None:
    stream, events = in_flight
    manager = _manager()
    residency, family = manager.residency, manager.families[1]
    residency.move_param_chunk(family, Tier.HOST)
    events[-1].synchronize()
    residency.fetch(family, protect=set())
    assert residency.stats.demand_fetches == 1
    assert stream.waited == [events[-1]]  # the compute stream waits; the CPU did not
    assert events[-1].synchronized == 0
    assert all(_points_into(r.param, family.param_chunk.device_buffer) for r in family.records)


def test_an_eviction_in_flight_counts_against_the_budget_until_its_copy_ends(
    in_flight: tuple[FakeStream, list[FakeEvent]],
) -> None:
    _, events = in_flight
    manager = _manager()
    residency = manager.residency
    first, second = manager.families
    nbytes = first.param_chunk.nbytes
    residency.device_budget = 2 * nbytes
    residency.chunk_room = lambda: 2 * nbytes  # type: ignore[method-assign]
    residency.move_param_chunk(first, Tier.HOST)
    eviction = events[-1]
    assert residency.device_used() == nbytes  # the chunk left the device ...
    residency.ensure_device_room(nbytes, protect={first.family_id, second.family_id})
    # ... and its block is reusable only once the copy ends: room for a second chunk means waiting for it
    assert eviction.synchronized == 1 and residency.eviction_waits == 1
    residency.ensure_device_room(nbytes, protect={first.family_id, second.family_id})
    assert residency.eviction_waits == 1  # nothing in flight any more


def test_a_finished_eviction_needs_no_wait(in_flight: tuple[FakeStream, list[FakeEvent]]) -> None:
    _, events = in_flight
    manager = _manager()
    residency = manager.residency
    first, second = manager.families
    nbytes = first.param_chunk.nbytes
    residency.device_budget = 2 * nbytes
    residency.chunk_room = lambda: 2 * nbytes  # type: ignore[method-assign]
    residency.move_param_chunk(first, Tier.HOST)
    events[-1].done = True
    residency.ensure_device_room(nbytes, protect={first.family_id, second.family_id})
    assert events[-1].synchronized == 0 and residency.eviction_waits == 0


def test_on_landed_runs_at_once_without_a_copy_in_flight() -> None:
    manager = _manager()
    chunk = manager.families[0].param_chunk
    called: list[int] = []
    chunk.on_landed(lambda: called.append(1))
    assert called == [1]
