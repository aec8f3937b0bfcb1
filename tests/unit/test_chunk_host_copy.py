"""Unit tests of clean evictions ([Note: clean evictions] in runtime/chunk.py): the chunk keeps the host bytes
of a fetch, an unchanged chunk leaves the device without a copy, and every write makes the next eviction copy."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pstar.config import PStarConfig
from lightning_pstar.runtime.chunk import Chunk, ChunkKind, Slot, TransferStats
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.state import Tier

CAP = 64


def _chunk(stats: TransferStats) -> Chunk:
    slots = [Slot(name="w", offset=0, numel=CAP, shape=torch.Size([CAP]))]
    chunk = Chunk(
        chunk_id=0,
        kind=ChunkKind.PARAM,
        dtype=torch.float32,
        capacity=CAP,
        slots=slots,
        device=torch.device("cpu"),
        stats=stats,
    )
    chunk.allocate(Tier.HOST)
    chunk.data.copy_(torch.arange(CAP, dtype=torch.float32))
    return chunk


def test_an_unchanged_chunk_leaves_without_a_copy_and_keeps_its_storage() -> None:
    stats = TransferStats()
    chunk = _chunk(stats)
    chunk.move_to(Tier.DEVICE, keep_host_copy=True)
    saved = chunk.device_buffer[:8].view(2, 4)  # what autograd would hold (storage identity)
    assert chunk.has_host_copy and chunk.host_copy_current
    assert stats.host_copy_bytes == chunk.nbytes and stats.per_tier_bytes[Tier.HOST] == 0
    chunk.move_to(Tier.HOST)
    assert stats.d2h_bytes == 0 and stats.clean_moves == 1 and stats.clean_bytes == chunk.nbytes
    assert stats.dirty_moves == 0 and stats.moves_off_device == 1 and stats.host_copy_bytes == 0
    assert torch.equal(chunk.data, torch.arange(CAP, dtype=torch.float32))
    assert chunk.device_buffer.untyped_storage().nbytes() == 0
    chunk.move_to(Tier.DEVICE, keep_host_copy=True)
    assert torch.equal(saved, torch.arange(8, dtype=torch.float32).view(2, 4))  # same storage, refilled
    assert stats.h2d_bytes == 2 * chunk.nbytes and stats.moved_bytes == 2 * chunk.nbytes


def test_a_write_through_a_view_makes_the_eviction_copy() -> None:
    stats = TransferStats()
    chunk = _chunk(stats)
    chunk.move_to(Tier.DEVICE, keep_host_copy=True)
    chunk.slot_view(chunk.slots[0])[3] = -1.0  # a gradient stored in the slot, a load
    assert chunk.has_host_copy and not chunk.host_copy_current
    chunk.move_to(Tier.HOST)
    assert stats.d2h_bytes == chunk.nbytes and stats.dirty_moves == 1 and stats.clean_moves == 0
    assert float(chunk.data[3]) == -1.0
    assert stats.host_copy_bytes == 0 and stats.per_tier_bytes[Tier.HOST] == chunk.nbytes


def test_a_fetch_without_keeping_frees_the_host_bytes_and_release_drops_the_copy() -> None:
    stats = TransferStats()
    chunk = _chunk(stats)
    chunk.move_to(Tier.DEVICE)
    assert not chunk.has_host_copy and stats.host_copy_bytes == 0
    assert chunk.host_buffer is not None and chunk.host_buffer.untyped_storage().nbytes() == 0
    chunk.move_to(Tier.HOST)
    chunk.move_to(Tier.DEVICE, keep_host_copy=True)
    chunk.release()
    assert stats.host_copy_bytes == 0 and stats.per_tier_bytes == {Tier.DEVICE: 0, Tier.HOST: 0}


def _manager(host_limit: int | None = None) -> tuple[ChunkManager, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    config = PStarConfig.from_flat(chunk_size=CAP, placement="static", host_memory_limit=host_limit)
    manager = ChunkManager(model, config=config, compute_dtype=torch.float32, device=torch.device("cpu"))
    manager.materialise()
    return manager, model


def test_a_step_on_the_device_drops_the_host_copy() -> None:
    """The optimizer writes device-resident chunks with fused kernels that leave version counters alone: the
    step must drop their host copies, or evicting them afterwards would bring back the old weights."""
    manager, _ = _manager()
    residency = manager.residency
    family = residency.families[0]
    chunk = family.param_chunk
    residency.move_param_chunk(family, Tier.HOST)
    residency.move_param_chunk(family, Tier.DEVICE)
    assert chunk.has_host_copy and chunk.host_copy_current
    assert residency.optimizer_tier_of(family) is Tier.DEVICE  # no budget: the optimizer steps there
    manager.step_moment()
    assert not chunk.has_host_copy and residency.step_open
    residency.move_param_chunk(family, Tier.HOST)
    residency.move_param_chunk(family, Tier.DEVICE)  # a fetch inside the step keeps nothing
    assert not chunk.has_host_copy
    chunk.data.data.mul_(0.5)  # a write no version counter sees, like the fused kernels'
    expected = chunk.data.clone()
    residency.move_param_chunk(family, Tier.HOST)
    assert torch.equal(chunk.data, expected)


def test_a_weight_written_through_its_parameter_makes_the_eviction_copy() -> None:
    manager, model = _manager()
    residency = manager.residency
    record = manager.record_of(model[0].weight)
    family = record.family
    residency.move_param_chunk(family, Tier.HOST)
    residency.move_param_chunk(family, Tier.DEVICE)
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # bumps the parameter's counter, not the chunk buffer's
    expected = model[0].weight.detach().clone()
    before = residency.stats.d2h_bytes
    residency.move_param_chunk(family, Tier.HOST)
    assert residency.stats.d2h_bytes == before + family.param_chunk.nbytes
    assert torch.equal(model[0].weight.detach(), expected)


def test_host_copies_give_way_to_the_host_budget() -> None:
    manager, _ = _manager()
    residency = manager.residency
    family = residency.families[0]
    residency.move_param_chunk(family, Tier.HOST)
    residency.move_param_chunk(family, Tier.DEVICE)
    assert family.param_chunk.has_host_copy
    used = residency.stats.per_tier_bytes[Tier.HOST] + residency.stats.host_copy_bytes
    residency.host_budget = used  # full: the next host allocation needs the copy's bytes
    residency.check_host_room(family.param_chunk.nbytes)
    assert not family.param_chunk.has_host_copy and residency.stats.host_copy_bytes == 0


def test_a_load_drops_every_host_copy() -> None:
    manager, model = _manager()
    residency = manager.residency
    for family in residency.families:
        residency.move_param_chunk(family, Tier.HOST)
        residency.move_param_chunk(family, Tier.DEVICE)
    assert all(f.param_chunk.has_host_copy for f in residency.families)
    manager.fill_slot(manager.record_of(model[1].bias), torch.ones(8))
    assert not any(f.param_chunk.has_host_copy for f in residency.families)
