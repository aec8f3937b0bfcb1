"""The host need of ``planning/tiers.py`` ([Note: the host need]): each part on its own, against the engine's
own placement policies and the pinned allocator's block arithmetic (the CPU-visible parts of the CUDA rule)."""

from __future__ import annotations

import pytest
import torch

from lightning_pstar.planning.layout import ParamSpec, plan_layout
from lightning_pstar.planning.requirements import BytesPerElement
from lightning_pstar.planning.tiers import (
    block_bytes,
    optimizer_starts_on_host,
    setup_chunk_room,
    step_temporary_bytes,
    tier_need,
)
from lightning_pstar.runtime.pinned import block_bytes as pinned_block_bytes
from lightning_pstar.runtime.placement import AutoPlacement, StaticPlacement
from lightning_pstar.runtime.state import Tier
from lightning_pstar.runtime.tracer import MemoryTracer

CAP = 1000  # elements per chunk: fp32 chunks of 4,000 bytes, not a power of two


def _layout(trainable: int, frozen: int = 0):  # type: ignore[no-untyped-def]
    specs = [ParamSpec(name=f"t{i}", numel=CAP, trainable=True) for i in range(trainable)]
    specs += [ParamSpec(name=f"f{i}", numel=CAP, trainable=False) for i in range(frozen)]
    return plan_layout(specs, CAP, world_size=1)


BPE_32 = BytesPerElement.of_run(compute_itemsize=4, optimizer=8)
BPE_BF16 = BytesPerElement.of_run(compute_itemsize=2, optimizer=8)


def test_a_host_step_leaves_every_trainable_param_chunk_on_the_host() -> None:
    need = tier_need(_layout(3), BPE_32, world_size=1, optimizer_on_host=True, chunk_room=10**9)
    assert need.param_on_host == 3 * CAP * 4 and need.host == need.per_rank == 3 * CAP * 16
    assert need.device == 0 and need.scratch == 0  # 32-true steps on views of the grad chunk


def test_mixed_precision_holds_back_one_familys_fp32_gradient_copy() -> None:
    need = tier_need(_layout(3), BPE_BF16, world_size=1, optimizer_on_host=True, chunk_room=None)
    assert need.scratch == step_temporary_bytes(CAP, mixed=True) == 4 * CAP
    assert need.host == 3 * CAP * 14 + 4 * CAP


def test_optimizer_on_the_device_and_everything_fitting_leaves_the_host_empty() -> None:
    need = tier_need(_layout(2, 2), BPE_32, world_size=1, optimizer_on_host=False, chunk_room=10**9)
    assert need.host == 0 and need.device == need.per_rank


@pytest.mark.parametrize("room_chunks", [0, 2, 3, 4, 6])
def test_evicted_chunks_are_bounded_by_the_room_less_two_chunks(room_chunks: int) -> None:
    """Frozen chunks beyond the room go to the host; the device is credited the room less two chunks (the chunk
    being fetched and the last victim's overshoot) and less the chunks that are not this rank's evictable ones."""
    chunk = CAP * 4
    need = tier_need(_layout(1, 4), BPE_32, world_size=1, optimizer_on_host=True, chunk_room=room_chunks * chunk)
    kept = min(max(room_chunks * chunk - 2 * chunk - chunk, 0), 4 * chunk)  # the trainable chunk is not evictable
    if room_chunks * chunk >= 5 * chunk:
        kept = 4 * chunk  # every param chunk fits the room: nothing is ever evicted
    assert need.param_on_host == chunk + 4 * chunk - kept


def test_pinned_rounding_counts_each_host_chunk_as_its_allocator_block() -> None:
    assert block_bytes is pinned_block_bytes  # one function for the arena and the need
    plain = tier_need(_layout(2), BPE_32, world_size=1, optimizer_on_host=True, chunk_room=None)
    pinned = tier_need(_layout(2), BPE_32, world_size=1, optimizer_on_host=True, chunk_room=None, pinned=True)
    per_chunk = block_bytes(CAP * 4) - CAP * 4  # 4,000 -> 4,096
    assert pinned.rounding == 2 * 4 * per_chunk  # param, grad, exp_avg, exp_avg_sq chunks of both families
    assert pinned.host == plain.host + pinned.rounding


def test_the_policies_make_the_same_choices_as_the_pure_functions() -> None:
    tracer = MemoryTracer(torch.device("cpu"), lambda: 0, lambda: set())
    for budget in (None, 10_000, 10**6):
        for model_data in (5_000, 50_000):
            static = StaticPlacement(0.5).optimizer_tier(model_data_bytes=model_data, device_budget=budget)
            auto = AutoPlacement(tracer, 0.25).optimizer_tier(model_data_bytes=model_data, device_budget=budget)
            kw = {"model_data_bytes": model_data, "device_budget": budget}
            assert (static is Tier.HOST) == optimizer_starts_on_host("static", static_fraction=0.5, **kw)  # type: ignore[arg-type]
            assert (auto is Tier.HOST) == optimizer_starts_on_host(
                "auto",
                static_fraction=1.0,
                warmup_fraction=0.25,
                **kw,  # type: ignore[arg-type]
            )
        for min_bytes in (0, 9_000):
            assert StaticPlacement(0.5).chunk_room(budget, min_bytes) == setup_chunk_room(
                "static", device_budget=budget, min_bytes=min_bytes, static_fraction=0.5, warmup_fraction=1.0
            )
            assert AutoPlacement(tracer, 0.25).chunk_room(budget, min_bytes) == setup_chunk_room(
                "auto", device_budget=budget, min_bytes=min_bytes, static_fraction=1.0, warmup_fraction=0.25
            )
