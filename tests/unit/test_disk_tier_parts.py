"""The disk tier's pieces on their own ([Note: disk families] in runtime/disk_tier.py): the choice of families,
the plan's bytes, and the loans of host buffers to chunks whose bytes live in a DiskStore."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_pstar.planning.layout import ChunkPlan, Layout
from lightning_pstar.runtime.chunk import Chunk, ChunkKind, Slot, TransferStats
from lightning_pstar.runtime.disk import DiskStore
from lightning_pstar.runtime.disk_tier import (
    DiskTier,
    choose_disk_families,
    disk_buffer_bytes,
    plan_disk_tier,
)
from lightning_pstar.runtime.family import ChunkFamily
from lightning_pstar.runtime.parked import ParkedParameterError, is_parked, park, unpark
from lightning_pstar.runtime.state import Tier

CAP = 1000  # elements per chunk (not a multiple of the 4096-byte alignment: tails go through staging)


def _layout(trainable: list[bool]) -> Layout:
    chunks = [ChunkPlan(chunk_id=i, capacity=CAP, trainable=t) for i, t in enumerate(trainable)]
    return Layout(chunk_size=CAP, chunks=chunks, param_chunk=[], param_offset=[], payload_elements=0)


def test_choose_disk_families_takes_the_last_trainable_owned_families_first() -> None:
    layout = _layout([True, True, False, True, True])
    per_element = 12
    one = CAP * per_element
    assert choose_disk_families(layout, rank=0, world_size=1, excess=0, per_element=per_element) == []
    assert choose_disk_families(layout, rank=0, world_size=1, excess=1, per_element=per_element) == [4]
    assert choose_disk_families(layout, rank=0, world_size=1, excess=one + 1, per_element=per_element) == [3, 4]
    # frozen family 2 is skipped; more than all: all trainable ones
    assert choose_disk_families(layout, rank=0, world_size=1, excess=10 * one, per_element=per_element) == [0, 1, 3, 4]
    # two ranks: rank 1 owns the odd families
    assert choose_disk_families(layout, rank=1, world_size=2, excess=10 * one, per_element=per_element) == [1, 3]


def test_plan_disk_tier_counts_the_buffers_it_adds_to_the_host() -> None:
    layout = _layout([True] * 20)
    plan = plan_disk_tier(layout, master=4, optimizer=8, rank=0, world_size=1, excess=1)
    assert plan.buffers == disk_buffer_bytes(CAP, mixed=True)
    assert plan.on_disk == len(plan.family_ids) * CAP * 12 >= 1 + plan.buffers
    assert plan.on_disk - CAP * 12 < 1 + plan.buffers, "no more families than the excess and the buffers need"
    assert plan.family_ids == list(range(20 - len(plan.family_ids), 20))
    assert plan.file_bytes == len(plan.family_ids) * 3 * 4096  # 4,000 bytes per chunk, padded to 4,096
    assert plan_disk_tier(layout, master=0, optimizer=8, rank=0, world_size=1, excess=1).buffers == disk_buffer_bytes(
        CAP, mixed=False
    )


def _family(fid: int, stats: TransferStats) -> ChunkFamily:
    slots = [Slot(name=f"w{fid}", offset=0, numel=CAP, shape=torch.Size([CAP]))]
    family = ChunkFamily(family_id=fid, trainable=True, capacity=CAP, slots=slots)
    for kind in (ChunkKind.MASTER, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ):
        family.chunks[kind] = Chunk(
            chunk_id=fid, kind=kind, dtype=torch.float32, capacity=CAP, slots=slots, device=torch.device("cpu"),
            stats=stats,
        )  # fmt: skip
    return family


@pytest.fixture
def tier(tmp_path: Path) -> DiskTier:
    store = DiskStore(tmp_path, threads=2, block_bytes=4096)
    disk = DiskTier(store, [0, 1], capacity=CAP, kinds=3, depth=1)
    yield disk
    disk.close()
    assert os.listdir(tmp_path) == []


def test_loans_read_write_and_free_the_buffer_set(tier: DiskTier) -> None:
    stats = TransferStats()
    a, b = _family(0, stats), _family(1, stats)
    for family in (a, b):
        for chunk in family.chunks.values():
            tier.place(chunk)
    assert stats.per_tier_bytes[Tier.DISK] == 6 * CAP * 4 and stats.per_tier_bytes[Tier.HOST] == 0
    with tier.loaded(a, write=True) as lent:
        assert len(lent) == 3 and all(c.lent for c in lent)
        assert all(bool((c.data == 0).all()) for c in lent), "a file never written reads as zeros"
        for i, chunk in enumerate(lent):
            chunk.data.copy_(torch.arange(CAP, dtype=torch.float32) + i)
        with tier.loaded(a, write=True) as again:
            assert again == [], "re-entrant: the chunks lent stay lent"
    assert tier.free_sets == 1 and not any(c.lent for c in a.chunks.values())
    with pytest.raises(RuntimeError, match="on the disk tier and was read without being loaded"):
        _ = a.chunks[ChunkKind.MASTER].data
    with tier.loaded(b, write=False):  # the one buffer set serves the next family
        pass
    with tier.loaded(a, write=False, kinds=(ChunkKind.EXP_AVG,)) as lent:
        assert [c.kind for c in lent] == [ChunkKind.EXP_AVG]
        assert torch.equal(lent[0].data, torch.arange(CAP, dtype=torch.float32) + 1)
    assert tier.store.stats().bytes_written == 3 * CAP * 4


def test_one_at_a_time_and_setup_holds(tier: DiskTier) -> None:
    stats = TransferStats()
    a, b = _family(0, stats), _family(1, stats)
    for family in (a, b):
        for chunk in family.chunks.values():
            tier.place(chunk)
    tier.hold_for_setup(a)
    a.chunks[ChunkKind.MASTER].data.fill_(3.0)
    tier.hold_for_setup(b)  # writes a back
    assert not a.chunks[ChunkKind.MASTER].lent and b.chunks[ChunkKind.MASTER].lent
    tier.flush_setup()
    assert tier.free_sets == 1
    with tier.one_at_a_time(write=False, kinds=(ChunkKind.MASTER,)) as need:
        need(a)
        assert bool((a.chunks[ChunkKind.MASTER].data == 3.0).all())
        need(b)
        assert not a.chunks[ChunkKind.MASTER].lent and b.chunks[ChunkKind.MASTER].lent
    assert tier.free_sets == 1


def test_begin_and_end_load_for_the_pipeline(tier: DiskTier) -> None:
    stats = TransferStats()
    a = _family(0, stats)
    for chunk in a.chunks.values():
        tier.place(chunk)
    with tier.loaded(a, write=True) as lent:
        lent[0].data.fill_(7.0)
    reads = tier.begin_load(a)
    assert tier.free_sets == 0
    for read in reads:
        read.result()
    assert bool((a.chunks[ChunkKind.MASTER].data == 7.0).all())
    a.chunks[ChunkKind.MASTER].data.add_(1.0)
    writes = tier.begin_write(a)
    tier.end_load(a, writes)
    assert tier.free_sets == 1 and not any(c.lent for c in a.chunks.values())
    with tier.loaded(a, write=False, kinds=(ChunkKind.MASTER,)):
        assert bool((a.chunks[ChunkKind.MASTER].data == 8.0).all())


def test_parked_parameter_refuses_reads_until_unparked() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    park([param])
    assert is_parked(param) and param.shape == (3,)
    with pytest.raises(ParkedParameterError, match="disk tier"):
        _ = param.sum()
    unpark(param)
    assert not is_parked(param) and float(param.sum()) == 3.0


def test_the_planner_s_constants_are_the_engine_s() -> None:
    from lightning_pstar.planning import disk as planning_disk
    from lightning_pstar.runtime import aligned, disk

    assert planning_disk.ALIGNMENT == aligned.ALIGNMENT
    assert planning_disk.DISK_BLOCK_BYTES == disk.DEFAULT_BLOCK_BYTES


def test_the_planner_plans_three_tiers_as_the_engine_does() -> None:
    """A host budget below the optimizer side: refused without a disk budget, fits with one (the engine's choice
    of families and buffers, planning/disk.py), and the largest model found grows with the disk tier."""
    from lightning_pstar.planning.capacity import plan_capacity

    common = {"device_memory": "64MiB", "host_memory": "160MiB", "precision": "bf16-mixed", "device_type": "cpu"}
    common["placement"] = "static"  # the optimizer side starts on the host when model data exceeds the device
    common["chunk_size"] = 1 << 20  # 4 MiB fp32 buffers: the disk tier holds a few per loaded family
    overrides = {"n_layer": 8, "n_embd": 512}
    without = plan_capacity("configs/model/gpt_small.yaml", overrides=overrides, **common)
    with_disk = plan_capacity("configs/model/gpt_small.yaml", overrides=overrides, disk_memory="1GiB", **common)
    assert not without.fits and with_disk.fits, (without.reasons, with_disk.reasons)
    assert with_disk.disk_families > 0 and 0 < with_disk.disk_model_data_bytes <= 1 << 30
    assert with_disk.host_model_data_bytes <= 160 << 20 and with_disk.disk_buffer_bytes > 0
    assert "DISK (per rank)" in str(with_disk) and "DISK" not in str(without)
    assert with_disk.largest is not None and without.largest is not None
    assert with_disk.largest.num_params > without.largest.num_params
    tiny_disk = plan_capacity("configs/model/gpt_small.yaml", overrides=overrides, disk_memory="1MiB", **common)
    assert not tiny_disk.fits and any("disk budget" in r for r in tiny_disk.reasons)
