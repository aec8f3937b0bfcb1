"""Parameters that user code gives new storage mid-run (``p.data = W``): adopted as plain Lightning would, or refused
naming the parameter, never silently lost ([Note: parameters given new storage] in runtime/new_storage.py).

The reference is plain Lightning on the same seed and data with the same callback; the tests in
test_module_zoo_adversarial.py cover torch's parametrize assignment and a tight device budget.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarStrategy
from lightning_pstar.runtime.new_storage import NewStorageError
from tests.helpers.asserts import assert_states_close
from tests.helpers.models import VOCAB
from tests.helpers.runs import LM, FitResult, fit_steps

E = 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, E)
        self.lin = nn.Linear(E, E)
        self.head = nn.Linear(E, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(self.wte(idx))))


def _new_weight(shape: tuple[int, ...] = (E, E)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(5)) * 0.1


class Assign(L.Callback):
    """``net.lin.weight.data = W`` in hook ``where`` of batch 2 (or at the end of training)."""

    def __init__(self, where: str, shape: tuple[int, ...] = (E, E)) -> None:
        self.where, self.shape = where, shape

    def _assign(self, pl_module: L.LightningModule) -> None:
        pl_module.net.lin.weight.data = _new_weight(self.shape)  # type: ignore[attr-defined]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.where == "batch_start" and idx == 2:
            self._assign(pl_module)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.where == "before_step" and trainer.global_step == 2:
            self._assign(pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.where == "train_end":
            self._assign(pl_module)


def _close(got: FitResult, ref: FitResult, what: str) -> None:
    assert len(got.losses) == len(ref.losses) > 0, what
    for i, (a, b) in enumerate(zip(got.losses, ref.losses, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{what}: step {i}: patrickstar {a!r} vs plain {b!r}"
    assert_states_close(got.final, ref.final, what=what, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("where", ["batch_start", "before_step", "train_end"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_assigned_weight_is_adopted_as_plain_lightning_does(precision: str, where: str) -> None:
    """Plain Lightning trains from the assigned value on (the optimizer keeps its states); so does the engine,
    through its slot and fp32 master. Between the backward and the step in mixed precision the slot holds the
    gradient: refused there, naming the parameter, with the weights of before the assignment."""
    ref = fit_steps(LM(Net), "auto", steps=4, precision=precision, callbacks=[Assign(where)])
    if precision == "bf16-mixed" and where == "before_step":
        with pytest.raises(NewStorageError, match=r"'net\.lin\.weight'.*between the backward and the optimizer step"):
            fit_steps(LM(Net), PatrickStarStrategy(), steps=4, precision=precision, callbacks=[Assign(where)])
        return
    got = fit_steps(LM(Net), PatrickStarStrategy(), steps=4, precision=precision, callbacks=[Assign(where)])
    if where == "train_end":  # the model handed back holds the assigned value, as plain Lightning's does
        handed = got.module.net.lin.weight.detach()
        assert torch.equal(handed, ref.module.net.lin.weight.detach()) and torch.equal(handed, _new_weight())
        return
    if precision == "32-true":
        _close(got, ref, f"{precision}, {where}")
    else:  # bf16 compute: plain Lightning's autocast and the engine's bf16 slots round alike, not bitwise
        assert got.losses[:2] == pytest.approx(ref.losses[:2], rel=1e-2)
        assert_states_close(got.final, ref.final, what=where, rtol=5e-2, atol=5e-3)
    # the adopted value reached the weights: without it the run ends elsewhere
    plain = fit_steps(LM(Net), "auto", steps=4, precision=precision)
    assert not torch.allclose(plain.final["net.lin.weight"], ref.final["net.lin.weight"], atol=1e-3)


def test_assigned_weight_of_another_shape_is_refused_before_anything_changes() -> None:
    module = LM(Net)
    before: dict[str, torch.Tensor] = {}

    class Keep(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
            if idx == 2:
                before.update({k: v.detach().clone() for k, v in pl_module.state_dict().items()})

    strategy = PatrickStarStrategy()
    with pytest.raises(NewStorageError, match=r"'net\.lin\.weight': shape \(8, 16\), its slot holds \(16, 16\)"):
        fit_steps(module, strategy, steps=4, callbacks=[Keep(), Assign("batch_start", shape=(8, E))])
    assert module.net.lin.weight.shape == (E, E)  # pointed back at its slot: the weights of before
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)


def test_fabric_loop_assigning_a_weight_between_steps_matches_plain() -> None:
    def run(strategy: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
        return fabric.launch(loop)

    def loop(fabric: L.Fabric) -> tuple[list[float], dict[str, torch.Tensor]]:
        fabric.seed_everything(7)
        model = Net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        model, optimizer = fabric.setup(model, optimizer)
        gen = torch.Generator().manual_seed(3)
        losses = []
        for step in range(4):
            if step == 2:
                model.lin.weight.data = _new_weight()
            x = torch.randint(0, VOCAB, (4, 8), generator=gen)
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x.reshape(-1))
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        state = {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
        return losses, state

    ref_losses, ref_state = run("auto")
    losses, state = run(PatrickStarFabricStrategy())
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert_states_close(state, ref_state, what="fabric", rtol=1e-5, atol=1e-6)
