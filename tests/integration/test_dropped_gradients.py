"""Gradients user code drops or zeroes another way than ``optimizer.zero_grad()``: ``model.zero_grad()``,
``p.grad = None`` between the backward and the step, Lightning's ``on_validation_model_zero_grad``
([Note: gradients set to None] in runtime/grad_guard.py, [Note: a module's zero_grad] in runtime/module_zero_grad.py).

Each against plain Fabric / plain Lightning on the same seed and data, in 32-true (the engine's arithmetic is the
plain step's there, to rounding). Validation's ``zero_grad`` inside a manual accumulation window is tested in
test_accumulation_pipeline_adversarial.py, more zeroing orders in test_zeroing_adversarial.py.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarStrategy
from tests.helpers.asserts import assert_same_run, assert_states_close
from tests.helpers.data import make_loader
from tests.helpers.fabric_loop import _state, batches
from tests.helpers.models import SEED, FlatGPT, TinyGPT, lm_loss
from tests.helpers.runs import LM, fit_steps


def _fabric_run(strategy: Any, zero: str, drop: str | None = None, steps: int = 4) -> tuple[list[float], dict]:
    """A Fabric loop zeroing with ``zero`` ("model" or "optimizer"); ``drop``: a parameter-name prefix whose
    gradients are set to None between the backward and every second step."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True))
    data, losses = batches(1, 0), []
    for step in range(steps):
        x, y = next(data)
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        if drop is not None and step % 2 == 1:
            for name, p in model.module.named_parameters():
                if name.startswith(drop):
                    p.grad = None
        opt.step()
        (model if zero == "model" else opt).zero_grad()
        losses.append(float(loss))
    return losses, _state(fabric, model)


@pytest.mark.parametrize("drop", [None, "blocks.0"])
def test_fabric_model_zero_grad_and_dropped_gradients_match_plain(drop: str | None) -> None:
    """``model.zero_grad()`` after each step (was refused at the second step as a loop that never zeroes) and, with
    ``drop``, one block's gradients set to None before every second step: that block is not stepped then (plain
    Adam skips a parameter without a gradient, its step count too)."""
    ref_losses, ref_state = _fabric_run("auto", "model", drop)
    losses, state = _fabric_run(PatrickStarFabricStrategy(), "model", drop)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_states_close(state, ref_state, what=f"model.zero_grad(), drop={drop}", rtol=1e-5, atol=1e-6)
    if drop is not None:  # the drop changed the run: the check above could not pass by ignoring it
        _, kept = _fabric_run("auto", "model", None)
        name = next(k for k in ref_state if k.startswith(drop))
        assert not torch.allclose(kept[name], ref_state[name])


def test_fabric_a_loop_that_never_zeroes_is_still_refused() -> None:
    """Without any ``zero_grad`` plain PyTorch would add the last step's gradients to the next: still refused."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=PatrickStarFabricStrategy())
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    data = batches(1, 0)
    with pytest.raises(RuntimeError, match="without `zero_grad\\(\\)` since the last step"):
        for _ in range(2):
            x, y = next(data)
            fabric.backward(lm_loss(model(x), y))
            opt.step()


class DropsInHook(LM):
    """Sets ``p.grad = None`` for one block's parameters in ``on_before_optimizer_step`` of every second step."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.trainer.global_step % 2 == 1:
            for name, p in self.net.named_parameters():
                if name.startswith("blocks.1"):
                    p.grad = None


class ModuleZeroGrad(LM):
    """Manual optimization zeroing with the LightningModule's own ``zero_grad()``."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        self.zero_grad()
        return loss.detach()


@pytest.mark.parametrize(
    "make", [lambda: DropsInHook(lambda: TinyGPT()), ModuleZeroGrad], ids=["p.grad=None", "self.zero_grad"]
)
def test_trainer_dropped_gradients_match_plain(make: Any) -> None:
    ref = fit_steps(make(), "auto", steps=5)
    got = fit_steps(make(), PatrickStarStrategy(), steps=5)
    assert_same_run(got, ref, what="gradients dropped by user code")


class ValEveryBatch(LM):
    def val_dataloader(self) -> Any:
        return make_loader(n_seq=4)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("val_loss", loss)
        return loss


def test_validation_inside_an_accumulation_window_matches_plain_lightning() -> None:
    """``val_check_interval=1`` with ``accumulate_grad_batches=3``: Lightning validates inside the window without
    ``on_validation_model_zero_grad`` (it zeroes only where no accumulation is under way): the sums so far stay for the
    window's step, its evaluation forwards computing with the weights."""
    kwargs: dict[str, Any] = {"accumulate_grad_batches": 3, "val_check_interval": 1, "limit_val_batches": 1}
    ref = fit_steps(ValEveryBatch(lambda: TinyGPT()), "auto", steps=3, **kwargs)
    got = fit_steps(ValEveryBatch(lambda: TinyGPT()), PatrickStarStrategy(), steps=3, **kwargs)
    assert_same_run(got, ref, what="validation inside an accumulation window")


class EmaCopyZeroes(L.Callback):
    """Deep-copies the net at each batch start (an EMA model kept outside the LightningModule, as timm's ModelEmaV2
    is) and calls the copy's ``zero_grad()`` between the backward and the step: the copy's own, not the trained
    model's (the instance ``zero_grad`` the engine gives the model's modules is not carried into copies)."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.ema = copy.deepcopy(pl_module.net)  # type: ignore[attr-defined]

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.ema.zero_grad()


def test_a_deep_copy_of_the_model_zeroes_only_itself() -> None:
    ref = fit_steps(LM(lambda: TinyGPT()), "auto", steps=4, callbacks=[EmaCopyZeroes()])
    got = fit_steps(LM(lambda: TinyGPT()), PatrickStarStrategy(), steps=4, callbacks=[EmaCopyZeroes()])
    assert_same_run(got, ref, what="zero_grad on a deep copy")
