"""Issue 12, item 2: the host budget is enforced at setup for everything that starts on the host, with the
capacity planner's arithmetic (:func:`~lightning_pstar.planning.requirements.tier_need`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pstar.config import PStarConfig
from lightning_pstar.planning.requirements import MemoryBudgetError
from lightning_pstar.runtime.manager import ChunkManager

CAP = 96  # elements per chunk: every linear layer below fills one chunk
TWICE = 2 * 3 * CAP * (2 + 4 + 8)  # a device budget of twice the model data: its quarter does not hold it


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


def _manager(module: nn.Module, *, host: int, placement: str = "auto", device: int = 10**6) -> ChunkManager:
    config = PStarConfig.from_flat(
        chunk_size=CAP, placement=placement, device_memory_limit=device, host_memory_limit=host
    )
    return ChunkManager(module, config=config, compute_dtype=torch.bfloat16, device=torch.device("cpu"))


def _side_bytes() -> int:
    """fp32 master (4) + Adam's two states (8) per element of every trainable chunk: what starts on the host."""
    return 3 * CAP * (4 + 8)


def _host_need() -> int:
    """The side, plus the bf16 param chunks a host step leaves on the host (2 per element), plus the step's fp32
    gradient copy of one family (4 per element): [Note: the host need] in planning/tiers.py."""
    return _side_bytes() + 3 * CAP * 2 + 4 * CAP


def test_optimizer_states_on_host_are_refused_at_setup_naming_host_memory_limit() -> None:
    """placement='auto' with a device budget whose warm-up share (a quarter) does not hold the model data starts
    the fp32 masters and Adam states on the host, even though the whole model would fit the device, and a step on
    the host leaves the param chunks there: a host budget one byte short of all of it is refused by the
    constructor, which allocates nothing (the model's weights are untouched, no chunk exists)."""
    model = _mlp()
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    side, need = _side_bytes(), _host_need()
    with pytest.raises(MemoryBudgetError, match="host_memory_limit") as info:
        _manager(model, host=need - 1, device=TWICE)
    message = str(info.value)
    assert f"leaves {need:,} bytes" in message
    assert f"optimizer states {side:,} bytes" in message and "starts on the host" in message
    assert f"host_memory_limit is {need - 1:,} bytes" in message and "HINT" in message
    for name, param in model.named_parameters():
        ptr, value = before[name]
        assert param.data_ptr() == ptr and torch.equal(param.detach(), value)
    # exactly the need is accepted, and materialising then holds the side on the host within the budget
    manager = _manager(model, host=need, device=TWICE)
    manager.materialise()
    manager.add_optimizer_chunks(["exp_avg", "exp_avg_sq"])  # type: ignore[list-item]
    assert manager.memory_report().host_chunk_bytes == side
    assert manager.residency.host_scratch_bytes == 4 * CAP


def test_auto_starts_the_optimizer_side_on_the_device_when_the_warm_up_share_holds_all() -> None:
    """Issue 29, item 2: model data within the warm-up's share of the budget starts (and steps) on the device,
    so nothing of the optimizer is pinned or counted on the host: a host budget of one byte is enough."""
    manager = _manager(_mlp(), host=1)  # 4,032 bytes of model data, a quarter of 10**6 for the warm-up
    assert manager.residency.optimizer_tier.value == "device"
    assert _manager(_mlp(), host=10**6, device=TWICE).residency.optimizer_tier.value == "host"


def test_static_placement_keeps_the_optimizer_side_on_the_device_when_all_fits() -> None:
    """The same host budget is enough under 'static' when all model data fits the device: the engine's check
    follows the policy's own choice of tier, not a fixed rule."""
    manager = _manager(_mlp(), host=1, placement="static")
    assert manager.residency.optimizer_tier.value == "device"


def test_a_model_that_fits_neither_tier_names_both() -> None:
    """Device budget of one module's chunks and a small host: the error gives the per-rank need, what the device
    keeps and what is left for the host, with both budgets."""
    with pytest.raises(MemoryBudgetError) as info:
        _manager(_mlp(), host=1000, device=2 * CAP)
    message = str(info.value)
    total = 3 * CAP * (2 + 4 + 8)
    assert f"needs {total:,} bytes" in message
    # every family steps on the host (auto with a device budget), which then holds all of it, and one family's
    # fp32 gradient copy
    assert "device can keep 0 bytes" in message and f"leaves {total + 4 * CAP:,} bytes" in message
    assert "host_memory_limit is 1,000 bytes" in message
