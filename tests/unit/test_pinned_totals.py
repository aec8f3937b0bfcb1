"""Issue 18: the pinned ledger keeps running totals ([Note: running totals] in runtime/pinned.py), so the host
budget's ``extra_bytes`` is O(1) per eviction; the totals equal a full recount after any sequence of takes,
give-backs, collections and releases, also when a chunk moves its host buffer through the arena."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_pstar.runtime import pinned
from lightning_pstar.runtime.chunk import Chunk, ChunkKind, TransferStats
from lightning_pstar.runtime.pinned import PinnedArena, block_bytes
from lightning_pstar.runtime.state import Tier

GIB = 1 << 30


def _independent_extra(arena: PinnedArena, bufs: list[torch.Tensor]) -> int:
    """What the allocator holds beyond the live buffers' bytes, from the test's own list of buffers."""
    live = sum(b.numel() * b.element_size() for b in bufs if b.untyped_storage().nbytes() > 0)
    return arena.held_bytes - live


def _step(op: str, arena: PinnedArena, bufs: list[torch.Tensor], rng: random.Random) -> None:
    """One operation on the ledger (a function of its own, so that no local name keeps a dropped buffer alive)."""
    if op == "new":
        capacity = rng.choice([1000, 1024, 1500, 2048, 3000])
        bufs.append(arena.unbacked(capacity, rng.choice([torch.float32, torch.bfloat16])))
        _CAPACITY[id(bufs[-1])] = capacity
    elif op == "back" and bufs:
        buf = rng.choice(bufs)
        arena.back(buf, _CAPACITY[id(buf)])
    elif op == "free" and bufs:
        arena.free(rng.choice(bufs))
    elif op == "drop" and bufs:
        bufs.pop(rng.randrange(len(bufs)))  # its chunk dropped (collected at once): the block stays cached, idle
    elif op == "release":
        arena.release()
    elif op == "raw" and bufs:
        # freed behind the arena's back, then backed again: back() sees the empty storage and corrects the totals
        buf = rng.choice(bufs)
        buf.untyped_storage().resize_(0)
        arena.back(buf, _CAPACITY[id(buf)])


_CAPACITY: dict[int, int] = {}  # id(buffer) -> its chunk's capacity (the tests keep the buffers alive)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_running_totals_equal_a_recount_after_random_operations(seed: int) -> None:
    rng = random.Random(seed)
    arena = PinnedArena(pin=False, mem_total=GIB)
    bufs: list[torch.Tensor] = []  # the ledger's buffers still referenced by the test
    ever_live: dict[int, int] = {}  # block -> most buffers of it backed at once (the allocator's high-water mark)
    most_held = 0
    for _ in range(200):
        op = rng.choice(["new", "back", "back", "free", "free", "drop", "release", "raw"])
        _step(op, arena, bufs, rng)
        if op == "release":
            ever_live.clear()
        live_now: dict[int, int] = {}
        for block in [block_bytes(b.numel() * b.element_size()) for b in bufs if b.untyped_storage().nbytes() > 0]:
            live_now[block] = live_now.get(block, 0) + 1
        for block, count in live_now.items():
            ever_live[block] = max(ever_live.get(block, 0), count)
        assert arena.extra_bytes() == arena.recount_extra_bytes() == _independent_extra(arena, bufs)
        assert arena.live_bytes() == sum(block * n for block, n in live_now.items())
        assert arena.held_bytes == sum(block * n for block, n in ever_live.items())
        assert arena.idle_bytes() == arena.held_bytes - arena.live_bytes() >= 0
        most_held = max(most_held, arena.held_bytes)
    assert most_held > 4 * 4096  # the sequence exercised the ledger


def test_extra_bytes_walks_no_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """O(1): the answer comes from the totals, not from the buffers' storages."""
    arena = PinnedArena(pin=False, mem_total=GIB)
    bufs = [arena.back(arena.unbacked(1000, torch.float32), 1000) for _ in range(50)]
    for buf in bufs[::2]:
        arena.free(buf)
    expected = arena.recount_extra_bytes()

    def no_walk(self: torch.Tensor) -> None:
        raise AssertionError("extra_bytes looked at a buffer")

    monkeypatch.setattr(torch.Tensor, "untyped_storage", no_walk)
    monkeypatch.setattr(torch.Tensor, "numel", no_walk)
    assert arena.extra_bytes() == expected == 25 * 4096 + 25 * 96  # idle blocks and the live ones' rounding


def _pinned_chunk(stats: TransferStats) -> Chunk:
    chunk = Chunk(
        chunk_id=0, kind=ChunkKind.PARAM, dtype=torch.float32, capacity=1000, slots=[], device=torch.device("cpu"),
        stats=stats,
    )  # fmt: skip
    chunk._pin_host = True  # a CUDA chunk's host buffer: in the ledger (pinned where CUDA is available)
    return chunk


def test_a_chunks_host_moves_keep_the_totals(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every place chunk.py frees its host buffer goes through the arena: moves, host copies, release."""
    arena = PinnedArena(pin=False, mem_total=GIB)
    monkeypatch.setattr(pinned, "_ARENA", [arena])
    stats = TransferStats()
    chunk = _pinned_chunk(stats)
    chunk.allocate(Tier.HOST)
    assert arena.live_bytes() == 4096 and arena.extra_bytes() == arena.recount_extra_bytes() == 96
    chunk.move_to(Tier.DEVICE)  # the host source is freed: its block idle
    assert arena.extra_bytes() == arena.recount_extra_bytes() == 4096
    chunk.move_to(Tier.HOST)
    assert arena.extra_bytes() == arena.recount_extra_bytes() == 96
    chunk.move_to(Tier.DEVICE, keep_host_copy=True)  # the host copy stays live
    assert arena.extra_bytes() == arena.recount_extra_bytes() == 96
    chunk.drop_host_copy()
    assert arena.extra_bytes() == arena.recount_extra_bytes() == 4096
    chunk.move_to(Tier.HOST)
    chunk.release()
    assert arena.extra_bytes() == arena.recount_extra_bytes() == 4096 and arena.live_bytes() == 0
    arena.release()
    assert arena.held_bytes == arena.extra_bytes() == arena.recount_extra_bytes() == 0
