"""Unit tests of lightning_pstar.runtime.placement: the static (LRU) policy and the policy registry."""

from __future__ import annotations

import inspect

import pytest
import torch

from lightning_pstar.runtime.chunk import Chunk, ChunkKind, Slot, TransferStats
from lightning_pstar.runtime.placement import PlacementPolicy, StaticPlacement, make_policy
from lightning_pstar.runtime.state import TensorState, Tier


def _chunk(chunk_id: int, *, kind: ChunkKind = ChunkKind.PARAM, capacity: int = 16, state=TensorState.HOLD) -> Chunk:  # type: ignore[no-untyped-def]
    slots = [Slot(name=f"p{chunk_id}", offset=0, numel=capacity, shape=torch.Size([capacity]), state=state)]
    chunk = Chunk(
        chunk_id=chunk_id,
        kind=kind,
        dtype=torch.float32,
        capacity=capacity,
        slots=slots,
        device=torch.device("cpu"),
        stats=TransferStats(),
    )
    chunk.allocate(Tier.DEVICE)
    return chunk


def _make_policy(name: str) -> PlacementPolicy:
    # the trace-driven "auto" policy (in progress) gives make_policy a tracer argument; accept both signatures
    if "tracer" in inspect.signature(make_policy).parameters:
        from lightning_pstar.runtime.tracer import MemoryTracer  # type: ignore[import-not-found]

        return make_policy(name, MemoryTracer(torch.device("cpu"), lambda: 0))  # type: ignore[call-arg]
    return make_policy(name)


def test_make_policy_static() -> None:
    policy = _make_policy("static")
    assert isinstance(policy, StaticPlacement)
    assert _make_policy("static") is not policy  # a fresh policy (own history) per manager


@pytest.mark.parametrize("name", ["nope", "", "STATIC", "lru"])
def test_make_policy_unknown_name(name: str) -> None:
    with pytest.raises(ValueError, match=rf"unknown placement policy {name!r}; accepted: \[.*'static'.*\]"):
        _make_policy(name)


def test_static_placement_satisfies_protocol() -> None:
    policy: PlacementPolicy = StaticPlacement()
    assert callable(policy.touch) and callable(policy.victims) and callable(policy.optimizer_tier)


@pytest.mark.parametrize(
    ("model_bytes", "budget", "tier"),
    [
        (100, None, Tier.DEVICE),
        (100, 100, Tier.DEVICE),
        (100, 1000, Tier.DEVICE),
        (101, 100, Tier.HOST),
        (10**12, 1, Tier.HOST),
    ],
)
def test_optimizer_tier_rule(model_bytes: int, budget: int | None, tier: Tier) -> None:
    assert StaticPlacement().optimizer_tier(model_data_bytes=model_bytes, device_budget=budget) is tier


def test_victims_in_least_recently_used_order() -> None:
    policy = StaticPlacement()
    chunks = [_chunk(i) for i in range(4)]
    for tick, i in enumerate([2, 0, 3, 1], start=1):
        policy.touch(chunks[i], tick)
    one = chunks[0].nbytes
    assert [c.chunk_id for c in policy.victims(chunks, one)] == [2]
    assert [c.chunk_id for c in policy.victims(chunks, one + 1)] == [2, 0]
    assert [c.chunk_id for c in policy.victims(chunks, 4 * one)] == [2, 0, 3, 1]
    policy.touch(chunks[2], 10)  # used again: now the most recent
    assert [c.chunk_id for c in policy.victims(chunks, 2 * one)] == [0, 3]


def test_victims_zero_bytes_needed() -> None:
    policy = StaticPlacement()
    assert policy.victims([_chunk(0)], 0) == []


def test_victims_ties_are_deterministic_by_chunk_id() -> None:
    policy = StaticPlacement()
    chunks = [_chunk(i) for i in (3, 1, 2, 0)]
    # never used: by chunk id, whatever the candidate order
    assert [c.chunk_id for c in policy.victims(chunks, 2 * chunks[0].nbytes)] == [0, 1]
    assert [c.chunk_id for c in policy.victims(list(reversed(chunks)), 2 * chunks[0].nbytes)] == [0, 1]
    # never-used chunks go before used ones; equal ticks by id
    policy.touch(chunks[0], 5)  # id 3
    policy.touch(chunks[3], 5)  # id 0
    order = [c.chunk_id for c in policy.victims(chunks, 4 * chunks[0].nbytes)]
    assert order == [1, 2, 0, 3]


def test_only_hold_param_chunks_are_victims() -> None:
    policy = StaticPlacement()
    compute = _chunk(0, state=TensorState.COMPUTE)
    master = _chunk(1, kind=ChunkKind.MASTER)
    moment = _chunk(2, kind=ChunkKind.EXP_AVG)
    after_fwd = _chunk(3, state=TensorState.HOLD_AFTER_FWD)
    after_bwd = _chunk(4, state=TensorState.HOLD_AFTER_BWD)
    hold = _chunk(5)
    candidates = [compute, master, moment, after_fwd, after_bwd, hold]
    victims = policy.victims(candidates, 10**9)
    assert [c.chunk_id for c in victims] == [3, 4, 5]
    # fewer bytes than needed when the candidates do not have them: the manager raises
    assert sum(c.nbytes for c in victims) < 10**9


def test_victims_returns_fewer_bytes_when_only_compute_chunks() -> None:
    policy = StaticPlacement()
    assert policy.victims([_chunk(0, state=TensorState.COMPUTE)], 1) == []


def test_victims_do_not_move_anything() -> None:
    policy = StaticPlacement()
    chunks = [_chunk(i) for i in range(3)]
    policy.victims(chunks, 10**9)
    assert all(c.tier is Tier.DEVICE for c in chunks)


def test_histories_are_per_policy() -> None:
    a, b = StaticPlacement(), StaticPlacement()
    chunks = [_chunk(0), _chunk(1)]
    a.touch(chunks[0], 1)
    assert [c.chunk_id for c in a.victims(chunks, 1)] == [1]
    assert [c.chunk_id for c in b.victims(chunks, 1)] == [0]
