"""Issue 12, item 3: pinned host memory accounted as held (runtime/pinned.py), on CPU with pinning disabled:
the ledger of torch's caching host allocator (power-of-two blocks, freed blocks kept), the fallback to pageable
memory past a share of RAM, the release at teardown, and power-of-two chunk capacities on CUDA layouts."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from lightning_pstar.config import PStarConfig
from lightning_pstar.planning.layout import ParamSpec
from lightning_pstar.planning.requirements import (
    MemoryBudgetError,
    chunk_layout,
    collect_parameters,
    friendly_chunk_elements,
)
from lightning_pstar.runtime import pinned
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.pinned import PinnedArena, block_bytes, pin_decision, rounding_waste

GIB = 1 << 30


def test_block_bytes_are_the_host_allocators_power_of_two() -> None:
    chunk = int(1.0009 * GIB) // 4 * 4  # the 1.0009 GiB fp32 chunk pins 2 GiB
    assert block_bytes(chunk) == 2 * GIB and rounding_waste(chunk) == 2 * GIB - chunk
    assert block_bytes(4096) == 4096 and rounding_waste(4096) == 0
    assert block_bytes(4097) == 8192 and block_bytes(1) == 1 and block_bytes(0) == 0


def test_pin_decision_keeps_pinned_blocks_under_the_share_of_ram() -> None:
    total = 100 * GIB
    assert pin_decision(reserved=0, nbytes=GIB, mem_total=total)
    assert pin_decision(reserved=49 * GIB, nbytes=GIB, mem_total=total)  # exactly 50%
    assert not pin_decision(reserved=49 * GIB, nbytes=GIB + 1, mem_total=total)  # its block is 2 GiB
    assert pin_decision(reserved=49 * GIB, nbytes=GIB + 1, mem_total=total, share=0.6)


def _backed(arena: PinnedArena, capacity: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return arena.back(arena.unbacked(capacity, dtype), capacity)


def test_ledger_holds_the_high_water_mark_of_live_blocks_per_size_class() -> None:
    """Freed blocks stay held (the allocator caches them) and the next buffer of the same class reuses one;
    the held bytes are the most blocks ever live at once, per class, and the host budget adds the idle ones."""
    arena = PinnedArena(pin=False, mem_total=GIB)
    a, b = _backed(arena, 1024), _backed(arena, 1024)  # 4 KiB each, a power of two: no rounding
    a.fill_(1.0)
    assert a.shape == (1024,) and torch.all(a == 1.0)
    assert arena.held_bytes == 2 * 4096 and arena.live_bytes() == 2 * 4096 and arena.extra_bytes() == 0
    arena.free(b)  # a fetch frees its host source in place, through the arena (chunk.py)
    assert arena.held_bytes == 2 * 4096 and arena.live_bytes() == 4096 and arena.idle_bytes() == 4096
    assert arena.extra_bytes() == 4096 and arena.reusable(4096) and not arena.reusable(8192)
    assert arena.added_bytes(4096) == 0 and arena.added_bytes(8192) == 8192
    c = _backed(arena, 1024)  # takes the idle block: nothing more held
    assert arena.held_bytes == 2 * 4096 and arena.idle_bytes() == 0
    arena.back(b, 1024)  # b back on the host: three live blocks now
    assert arena.held_bytes == 3 * 4096 and arena.reserved_bytes() == 3 * 4096
    assert b.data_ptr() != 0 and c.shape == (1024,)


def test_a_chunk_of_odd_bytes_is_backed_and_accounted_with_its_whole_block(caplog: pytest.LogCaptureFixture) -> None:
    arena = PinnedArena(pin=False, mem_total=GIB)
    with caplog.at_level(logging.WARNING, logger="lightning_pstar.runtime.pinned"):
        buf = _backed(arena, 1000)  # 4000 bytes -> a 4096-byte block
        other = _backed(arena, 1000)
    assert buf.shape == (1000,) and buf.untyped_storage().nbytes() == 4096
    assert arena.held_bytes == 2 * 4096 and arena.extra_bytes() == 2 * 96
    assert [r.message.count("pins 4,096 bytes") for r in caplog.records] == [1]  # one warning, not one per chunk
    del other  # a buffer gone (its chunk dropped) leaves its block held in the cache: idle, still counted
    assert arena.held_bytes == 2 * 4096 and arena.extra_bytes() == 4096 + 96


def test_past_the_share_of_ram_buffers_are_pageable_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    arena = PinnedArena(pin=False, mem_total=4 * 4096, share=0.5)  # room for two 4 KiB blocks
    with caplog.at_level(logging.WARNING, logger="lightning_pstar.runtime.pinned"):
        kept = [_backed(arena, 1024) for _ in range(4)]
    assert arena.fallbacks == 2 and arena.reserved_bytes() == 2 * 4096 and arena.held_bytes == 2 * 4096
    assert len([r for r in caplog.records if "pageable memory" in r.message]) == 1
    assert all(t.shape == (1024,) for t in kept)
    assert arena.added_bytes(4096) == 4096  # pageable from now on: every byte counts as it is
    # a buffer pinned before the fallback keeps its block when it is backed again; a pageable one counts its bytes
    arena.free(kept[0])
    assert arena.added_bytes(4096, kept[0]) == 0  # its idle block takes it back
    arena.free(kept[1])
    arena.back(kept[0], 1024)
    assert arena.added_bytes(4000, kept[1]) == 0 and arena.added_bytes(4096, kept[3]) == 4096
    odd = PinnedArena(pin=False, mem_total=8192, share=0.5)  # room for one 4 KiB block
    first, _ = _backed(odd, 1000), _backed(odd, 1000)  # the second falls back
    odd.free(first)
    odd.release()  # the idle block goes back: backing it again takes a whole new 4 KiB block
    assert odd.fallbacks == 1 and odd.added_bytes(4000, first) == 4096


def test_release_gives_back_idle_blocks_and_keeps_live_ones() -> None:
    arena = PinnedArena(pin=False, mem_total=GIB)
    bufs = [_backed(arena, 2048) for _ in range(3)]
    for buf in bufs[1:]:
        arena.free(buf)
    arena.release()
    assert arena.held_bytes == 8192 and arena.idle_bytes() == 0
    arena.free(bufs[0])
    arena.release()
    assert arena.held_bytes == 0 and arena.reserved_bytes() == 3 * 8192  # the buffers may be backed again


def test_the_host_budget_counts_idle_pinned_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Residency's host check adds what the allocator holds beyond the chunks' bytes and the block a new buffer
    takes (none when an idle block is reused)."""
    arena = PinnedArena(pin=False, mem_total=GIB)
    monkeypatch.setattr(pinned, "_ARENA", [arena])
    idle = _backed(arena, 1024)
    arena.free(idle)  # one idle 4 KiB block held
    model = nn.Linear(4, 4)
    config = PStarConfig.from_flat(chunk_size=32, placement="static", host_memory_limit=4096 + 1000)
    manager = ChunkManager(model, config=config, compute_dtype=torch.float32, device=torch.device("cpu"))
    manager.residency.check_host_room(4096)  # reuses the idle block: the budget holds 4096 + 0
    assert arena.idle_bytes() == 4096
    # a new 1 KiB block beside the idle 4 KiB one would pass the budget: the idle block goes back first (issue 29)
    manager.residency.check_host_room(1024)
    assert arena.idle_bytes() == 0 and arena.held_bytes == 0
    with pytest.raises(MemoryBudgetError, match="host budget exceeded"):
        manager.residency.check_host_room(8192)  # beyond the budget with nothing idle left


def test_pinning_resumes_once_blocks_are_given_back() -> None:
    """Issue 29: a fallback to pageable memory is decided per buffer, not for the rest of the process: once the
    pinned buffers are gone and their blocks given back, a new buffer takes a block of the ledger again."""
    arena = PinnedArena(pin=False, mem_total=8192, share=0.5)  # room for one 4 KiB block
    first = _backed(arena, 1024)
    second = _backed(arena, 1024)
    assert arena.fallbacks == 1 and arena._entry(first) is not None and arena._entry(second) is None
    assert arena.added_bytes(4096) == 4096  # a new buffer would be pageable now
    arena.free(first)
    del first
    arena.release()
    assert arena.reserved_bytes() == 0 and arena.added_bytes(4096) == 4096  # pinned again: a whole new block
    third = _backed(arena, 1024)
    assert arena._entry(third) is not None and arena.held_bytes == 4096 and arena.fallbacks == 1


def test_cuda_layouts_use_power_of_two_chunks() -> None:
    specs = [ParamSpec(name=f"p{i}", numel=n, trainable=True) for i, n in enumerate([300, 1000, 20])]
    assert friendly_chunk_elements(1500, specs) == 1024  # the largest (1000) still fits whole
    assert friendly_chunk_elements(1024, specs) == 1024
    assert friendly_chunk_elements(1000, specs) == 1024
    assert friendly_chunk_elements(600, [ParamSpec(name="w", numel=600, trainable=True)]) == 1024
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 30), nn.Linear(30, 7), nn.Linear(7, 90))
    named = collect_parameters(model, exclude=set())
    layout = chunk_layout(
        named, chunk_elements=None, device_budget=None, compute_itemsize=2, world_size=1, allocator_friendly=True
    )
    assert all(c.capacity & (c.capacity - 1) == 0 for c in layout.chunks)
    assert all(rounding_waste(c.capacity * size) == 0 for c in layout.chunks for size in (2, 4))
    plain = chunk_layout(named, chunk_elements=None, device_budget=None, compute_itemsize=2, world_size=1)
    assert layout.payload_elements == plain.payload_elements
    explicit = chunk_layout(
        named, chunk_elements=1000, device_budget=None, compute_itemsize=2, world_size=1, allocator_friendly=True
    )
    assert explicit.chunk_size == 1000  # a chunk size the user names is kept (its rounding is accounted)
