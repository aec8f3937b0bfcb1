"""Issue 31: paths that trained on silently (or failed late) are refused where the user can act.

- ``host_memory_limit`` on a CPU run without a device budget barely binds: a warning at setup says so;
- a parameter replaced or added after setup raises at the assignment, naming it (plain Lightning trains on,
  its optimizer never stepping the new tensor);
- a model with no trainable parameter is refused at ``fit`` setup before anything changes (plain Lightning
  fails at the first backward), while ``validate``/``test``/``predict`` still run and match plain Lightning.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.runtime.budgets import UnboundHostLimitWarning
from tests.helpers import make_loader
from tests.helpers.models import SEED, VOCAB
from tests.helpers.runs import make_trainer


def _net() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, VOCAB))


class Module(L.LightningModule):
    """A small LM; ``mutate(self, batch_idx)`` runs inside ``training_step`` before the forward."""

    def __init__(self, mutate: Any = None, frozen: bool = False) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.net = _net()
        if frozen:
            self.net.requires_grad_(False)
        self.mutate = mutate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.mutate is not None:
            self.mutate(self, batch_idx)
        return self._loss(batch)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).float()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


def _fit(module: L.LightningModule, strategy: Any, steps: int = 2) -> L.Trainer:
    trainer = make_trainer(strategy=strategy, max_steps=steps)
    trainer.fit(module, train_dataloaders=make_loader(n_seq=4 * steps))
    return trainer


# ---- host_memory_limit where it cannot bind -------------------------------------------------------------
def test_a_host_limit_without_a_device_budget_on_cpu_warns_and_trains() -> None:
    with pytest.warns(UnboundHostLimitWarning, match=r"host_memory_limit='1KiB'.*HINT: set device_memory_limit"):
        trainer = _fit(Module(), PatrickStarStrategy(host_memory_limit="1KiB"))
    assert trainer.global_step == 2


def test_a_host_limit_with_a_device_budget_binds_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnboundHostLimitWarning)
        _fit(Module(), PatrickStarStrategy(host_memory_limit="64MiB", device_memory_limit="64MiB"))


def test_without_a_device_budget_the_host_limit_still_bounds_frozen_fp32_copies() -> None:
    """What lives on the host whatever the device (fp32 copies of frozen weights in mixed precision) is still
    checked: the limit is not widened, only said to bind little."""
    module = Module()
    module.net[1].requires_grad_(False)
    trainer = make_trainer(strategy=PatrickStarStrategy(host_memory_limit=64), precision="bf16-mixed", max_steps=1)
    with pytest.warns(UnboundHostLimitWarning), pytest.raises(ValueError, match="fp32 frozen weights"):
        trainer.fit(module, train_dataloaders=make_loader(n_seq=4))


# ---- parameters assigned after setup --------------------------------------------------------------------
def _replace(module: Module, batch_idx: int) -> None:
    if batch_idx == 1:
        module.net[1].weight = nn.Parameter(torch.zeros_like(module.net[1].weight))


def _add(module: Module, batch_idx: int) -> None:
    if batch_idx == 1:
        module.net[1].scale = nn.Parameter(torch.ones(()))


def _attach(module: Module, batch_idx: int) -> None:
    if batch_idx == 1:
        module.extra = nn.Linear(4, 4)


def _retie(module: Module, batch_idx: int) -> None:
    if batch_idx == 1:
        module.net[3].bias = module.net[1].bias  # both (32,): tied by assignment


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_replace, r"assigning 'net\.1\.weight' after setup replaces the parameter.*HINT: create .*`configure_model`"),
        (_add, r"assigning 'net\.1\.scale' after setup adds a parameter.*HINT"),
        (_attach, r"assigning the module 'extra' after setup adds parameters \('extra\.weight' and 1 more\).*HINT"),
        (_retie, r"assigning 'net\.3\.bias' after setup re-ties a managed parameter.*HINT"),
    ],
    ids=["replaced", "added", "module", "re-tied"],
)
def test_a_parameter_assigned_after_setup_raises_naming_it(mutate: Any, match: str) -> None:
    module = Module(mutate)
    with pytest.raises(RuntimeError, match=match):
        _fit(module, PatrickStarStrategy(), steps=3)
    assert module.global_step == 1  # the first step ran; the assignment in the second raised


def test_plain_lightning_trains_on_with_a_replaced_parameter() -> None:
    """The reference: plain Lightning raises nothing, and its optimizer never steps the new tensor."""
    module = Module(_replace)
    _fit(module, "auto", steps=3)
    assert torch.count_nonzero(module.net[1].weight) == 0  # still the zeros it was replaced by: never stepped


def test_allowed_after_setup_same_parameter_parameter_free_modules_and_after_fit() -> None:
    def harmless(module: Module, batch_idx: int) -> None:
        module.net[1].weight = module.net[1].weight  # the parameter it holds already
        module.act = nn.ReLU()  # a module without parameters (a torchmetrics Metric is one)
        module.net[2] = nn.GELU()

    module = Module(harmless)
    _fit(module, PatrickStarStrategy())
    module.net[1].weight = nn.Parameter(torch.zeros(32, 16))  # after teardown the model is the user's again
    module.extra = nn.Linear(2, 2)


def test_another_models_parameters_are_not_watched() -> None:
    other = nn.Linear(2, 2)

    def elsewhere(module: Module, batch_idx: int) -> None:
        other.weight = nn.Parameter(torch.zeros(2, 2))

    _fit(Module(elsewhere), PatrickStarStrategy())


# ---- nothing to train -----------------------------------------------------------------------------------
def test_fit_with_every_parameter_frozen_is_refused_at_setup() -> None:
    module = Module(frozen=True)
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in module.named_parameters()}
    with pytest.raises(ValueError, match=r"all 5 of its parameters are frozen.*HINT: freeze less.*trainer\.validate"):
        _fit(module, PatrickStarStrategy())
    for name, param in module.named_parameters():
        ptr, value = before[name]
        assert param.data_ptr() == ptr and torch.equal(param.detach(), value)


def test_plain_lightning_fails_late_with_every_parameter_frozen() -> None:
    with pytest.raises(RuntimeError, match="does not require grad"):
        _fit(Module(frozen=True), "auto")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_evaluation_with_every_parameter_frozen_matches_plain_lightning(precision: str) -> None:
    results = {}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarStrategy())):
        trainer = make_trainer(strategy=strategy, precision=precision)
        module = Module(frozen=True)
        loader = make_loader(n_seq=8)
        val = trainer.validate(module, dataloaders=loader, verbose=False)[0]["val_loss"]
        trainer = make_trainer(strategy=PatrickStarStrategy() if name == "pstar" else "auto", precision=precision)
        test = trainer.test(module, dataloaders=loader, verbose=False)[0]["test_loss"]
        trainer = make_trainer(strategy=PatrickStarStrategy() if name == "pstar" else "auto", precision=precision)
        pred = torch.cat(trainer.predict(module, dataloaders=loader))  # type: ignore[arg-type]
        results[name] = (val, test, pred)
    assert results["pstar"][0] == pytest.approx(results["plain"][0], rel=1e-6)
    assert results["pstar"][1] == pytest.approx(results["plain"][1], rel=1e-6)
    torch.testing.assert_close(results["pstar"][2], results["plain"][2], rtol=1e-6, atol=1e-6)


def test_fabric_setup_with_an_optimizer_over_frozen_parameters_is_refused() -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, strategy="patrickstar")
    fabric.launch()
    model = _net().requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"`fabric\.setup` on a model with nothing to train.*HINT"):
        fabric.setup(model, optimizer)
    other = Fabric(accelerator="cpu", devices=1, strategy="patrickstar")
    other.launch()
    evaluated = other.setup(_net().requires_grad_(False))
    with torch.no_grad():
        assert evaluated(torch.zeros(2, 4, dtype=torch.long)).shape == (2, 4, VOCAB)


def test_memory_shared_between_parameters_or_with_a_buffer_is_refused_only_where_it_overlaps() -> None:
    """``refuse_shared_storage``: parameters cut from one flat buffer side by side stay separate tensors in plain
    PyTorch too (accepted); a parameter viewing another's memory, or a buffer viewing a parameter, is refused naming
    both, wherever the overlapping tensors sort."""
    from lightning_pstar.setup_checks import refuse_shared_storage

    flat = torch.zeros(100)
    side_by_side = nn.Module()
    side_by_side.a = nn.Parameter(flat[:40])
    side_by_side.b = nn.Parameter(flat[40:])
    side_by_side.register_buffer("own", torch.zeros(8))
    refuse_shared_storage(side_by_side)

    alias = nn.Module()
    alias.a = nn.Linear(4, 4)
    alias.row = nn.Parameter(alias.a.weight.data[1])
    with pytest.raises(ValueError, match=r"Parameters 'a.weight' and 'row' share memory.*HINT"):
        refuse_shared_storage(alias)

    wide = torch.zeros(100)
    buffered = nn.Module()
    buffered.register_buffer("wide", wide)  # starts before the parameter and reaches past it
    buffered.register_buffer("short", torch.zeros(3))
    buffered.p = nn.Parameter(wide[60:70])
    with pytest.raises(ValueError, match=r"Buffer 'wide' shares memory with parameter 'p'.*HINT"):
        refuse_shared_storage(buffered)
