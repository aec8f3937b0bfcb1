"""Adversarial Fabric tests: loops the team did not write, against plain Fabric (no strategy) or the serial
``optimizer_overlap="off"`` run, or asserting a clear refusal."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_pstar import PatrickStarFabricStrategy
from tests.helpers.asserts import assert_states_equal, max_rel_diff
from tests.helpers.fabric_loop import LoopSpec, batches, train
from tests.helpers.models import SEED, FlatGPT, lm_loss

LOSS_RTOL = 1e-5


@pytest.mark.parametrize("mode", ["pipeline", "next_forward", "auto"])
def test_overlap_modes_bitwise_vs_off_with_clip_and_accumulate(mode: str) -> None:
    common: dict[str, Any] = {"steps": 3, "accumulate": 2, "clip_norm": 0.5, "two_groups": True}
    off = train(LoopSpec(strategy=PatrickStarFabricStrategy(optimizer_overlap="off"), **common))
    got = train(LoopSpec(strategy=PatrickStarFabricStrategy(optimizer_overlap=mode), **common))
    assert got.losses == off.losses
    assert got.grad_norms == off.grad_norms
    assert_states_equal(got.state, off.state, what=f"overlap {mode} vs off")


def _twice_per_step(strategy: Any, set_to_none: bool) -> list[float]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    stream = batches(1, 0)
    losses = []
    for _ in range(3):
        x1, y1 = next(stream)
        x2, y2 = next(stream)
        loss = lm_loss(model(x1), y1) + 0.5 * lm_loss(model(x2), y2)  # the module called twice in one step
        fabric.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        losses.append(float(loss.detach()))
    with torch.no_grad():
        x, y = next(stream)
        losses.append(float(lm_loss(model(x), y)))
    return losses


@pytest.mark.parametrize("set_to_none", [True, False])
def test_module_called_twice_per_step_matches_plain(set_to_none: bool) -> None:
    ref = _twice_per_step("auto", set_to_none)
    got = _twice_per_step("patrickstar", set_to_none)
    assert max_rel_diff(got, ref) <= LOSS_RTOL, f"{got} vs plain Fabric {ref}"


def _set_up() -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy="patrickstar")
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    return fabric, model, opt


def test_add_param_group_after_setup_refused_before_any_change() -> None:
    fabric, model, opt = _set_up()
    groups_before = len(opt.param_groups)
    with pytest.raises(NotImplementedError, match="parameter groups cannot be added"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "lr": 0.1})
    assert len(opt.param_groups) == groups_before
    x, y = next(batches(1, 0))  # the optimizer still trains afterwards
    fabric.backward(lm_loss(model(x), y))
    opt.step()


def test_lbfgs_refused_at_setup() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, strategy="patrickstar")
    fabric.launch()
    net = FlatGPT()
    with pytest.raises(TypeError, match="LBFGS.*HINT"):
        fabric.setup(net, torch.optim.LBFGS(net.parameters(), lr=0.1))
