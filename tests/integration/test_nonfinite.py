"""A non-finite loss or gradient in every precision (``mixed_precision.nonfinite``), against runs that stop before it.

"raise" (the default) leaves the weights and optimizer states of the step before and names the step and the
parameters; "skip" leaves them too and trains on, counting the step; "ignore" applies it as plain Lightning does.
The engine reads the loss of each backward and the global norm it computes anyway: a step that starts inside the
backward (``optimizer_overlap="pipeline"``, or "auto" while it times it) is never started from a non-finite loss.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarStrategy
from lightning_pstar.optim import NonFiniteStepError
from tests.helpers import assert_states_equal
from tests.helpers.data import make_loader
from tests.helpers.models import FlatGPT, TinyGPT, lm_loss
from tests.helpers.runs import LM, fit_steps

BAD_BATCH = 2


class BadLossLM(LM):
    """:class:`LM` whose loss is ``value`` (nan or inf) at batch ``BAD_BATCH``."""

    def __init__(self, value: float = float("nan"), *, bad_batch: int | None = BAD_BATCH) -> None:
        super().__init__(lambda: TinyGPT())
        self.value = value
        self.bad_batch = bad_batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * self.value if batch_idx == self.bad_batch else loss


class GradInf(torch.autograd.Function):
    """Identity forward; an inf gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


class InfGradLM(LM):
    """A finite loss whose backward turns every gradient inf or nan at batch ``BAD_BATCH``."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.net(idx)
        return GradInf.apply(logits) if self.trainer.global_step == BAD_BATCH else logits


def _strategy(**options: Any) -> PatrickStarStrategy:
    return PatrickStarStrategy(chunk_size=4096, optimizer_placement="host", **options)


def _state(module: L.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_raise_leaves_the_step_before(precision: str, value: float) -> None:
    loader = make_loader(n_seq=20)
    before = fit_steps(BadLossLM(bad_batch=None), _strategy(), precision=precision, steps=BAD_BATCH, loader=loader)
    bad = BadLossLM(value)
    with pytest.raises(NonFiniteStepError, match=f"the loss was not finite at optimizer step {BAD_BATCH} "):
        fit_steps(bad, _strategy(), precision=precision, steps=5, loader=loader)
    assert_states_equal(_state(bad), before.final, what="weights after the refused step")


def test_skip_trains_on_and_counts(tmp_path: Any) -> None:
    run = fit_steps(BadLossLM(), _strategy(nonfinite="skip"), precision="bf16-mixed", steps=5, snapshot_state=True)
    states = run.recorder.states  # after each batch (Lightning counts the skipped step as a step too)
    assert len(states) == 5
    assert_states_equal(states[BAD_BATCH], states[BAD_BATCH - 1], what="weights after the skipped step")
    assert not torch.equal(states[BAD_BATCH + 1]["net.lm_head.weight"], states[BAD_BATCH]["net.lm_head.weight"])
    assert run.trainer.strategy.memory_report().nonfinite_skipped_steps == 1  # type: ignore[attr-defined]
    assert all(torch.isfinite(v).all() for v in run.final.values())


def test_ignore_applies_it_as_plain_lightning() -> None:
    ours = fit_steps(BadLossLM(), _strategy(nonfinite="ignore"), precision="32-true", steps=4)
    plain = fit_steps(BadLossLM(), "auto", precision="32-true", steps=4)
    assert ours.losses[:BAD_BATCH] == pytest.approx(plain.losses[:BAD_BATCH], rel=1e-6)
    assert not all(torch.isfinite(v).all() for v in plain.module.state_dict().values())
    assert not all(torch.isfinite(v).all() for v in ours.final.values())


def test_an_inf_gradient_under_clipping_names_the_parameter() -> None:
    with pytest.raises(NonFiniteStepError, match=r"global gradient norm \((inf|nan)\).*Non-finite gradients: 'net\."):
        fit_steps(InfGradLM(), _strategy(), precision="32-true", steps=5, gradient_clip_val=1.0)


def test_fabric_raises() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=PatrickStarFabricStrategy(chunk_size=4096))
    fabric.launch()
    torch.manual_seed(0)
    net = FlatGPT()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True))
    x, y = next(iter(make_loader()))
    for step in range(3):
        loss = lm_loss(model(x), y) * (float("nan") if step == 1 else 1.0)
        fabric.backward(loss)
        if step == 1:
            with pytest.raises(NonFiniteStepError, match="the loss was not finite at optimizer step 1 "):
                optimizer.step()
            return
        optimizer.step()
        optimizer.zero_grad()
