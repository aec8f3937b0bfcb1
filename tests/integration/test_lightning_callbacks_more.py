"""Lightning's own training tools under PatrickStar: each either gives plain Lightning's run (32-true, same seed
and data) or is refused before anything changes, with a message naming the pattern and a ``HINT:``.

- ``StochasticWeightAveraging`` (an averaged copy, SWALR swapped in, weights replaced at the end): matches;
- ``Tuner.lr_find`` (a sweep, then a restore from its checkpoint): matches, and the weights come back;
- ``Tuner.scale_batch_size`` / ``BatchSizeFinder``: refused (Lightning refuses it for every DDPStrategy);
- ``BackboneFinetuning`` (``add_param_group`` mid-training): refused at setup;
- ``weight_norm`` parametrization: matches, also with evictions;
- a frozen teacher updated by EMA in ``on_train_batch_end`` and used in the loss: matches, also with evictions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning, BatchSizeFinder, StochasticWeightAveraging
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from torch.utils.data import DataLoader

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.runtime.outside_writes import OutsideWriteError
from tests.helpers import (
    LM,
    LossRecorder,
    OptimSpec,
    TinyLM,
    assert_evicted,
    assert_losses_close,
    assert_states_close,
    fit,
    make_loader,
    make_trainer,
    tight,
)
from tests.helpers.models import TinyGPT, lm_loss

TOL = 3e-7
"""32-true parity with plain Lightning (bitwise on one machine; this leaves room for another machine's kernels)."""

SGD = OptimSpec(name="sgd", lr=0.05, momentum=0.9)


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def _assert_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert_states_close(got, want, what=what, rtol=TOL, atol=TOL)


def _assert_same_run(got: Any, ref: Any, what: str) -> None:
    assert_losses_close(got.losses, ref.losses, rtol=TOL, what=what)
    _assert_states(got.final, ref.final, what)
    _assert_states(_state(got.module), _state(ref.module), f"{what} (module after fit)")


# --------------------------------------------------------------------------------------------------
# StochasticWeightAveraging
# --------------------------------------------------------------------------------------------------


def test_stochastic_weight_averaging_matches_plain_lightning() -> None:
    def run(strategy: Any) -> Any:
        swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1, annealing_epochs=1)
        return fit(
            TinyLM(optim=SGD),
            strategy=strategy,
            max_epochs=3,
            max_steps=-1,
            loader=make_loader(n_seq=16),
            callbacks=[swa],
        )

    ref = run("auto")
    got = run(PatrickStarStrategy())
    assert got.recorder.lrs == ref.recorder.lrs, "SWALR did not drive the learning rate the same way"
    assert ref.recorder.lrs[-1] == pytest.approx(0.01), "SWALR never took over (the test proves nothing)"
    # the recorder runs before SWA's on_train_end: final is the last SGD state, the module holds the average
    _assert_same_run(got, ref, "swa")
    averaged = _state(ref.module)
    assert any(not torch.equal(averaged[k], v) for k, v in ref.final.items()), "SWA did not replace the weights"
    # what a checkpoint would store after fit is the averaged model too
    stored = {k: v.detach().float().clone() for k, v in got.trainer.strategy.lightning_module_state_dict().items()}
    _assert_states(stored, averaged, "swa (strategy state dict)")


@pytest.mark.parametrize("precision", ["bf16-mixed"])  # 16-mixed runs as bf16-mixed on a CPU
def test_stochastic_weight_averaging_refused_in_mixed_precision(precision: str) -> None:
    """The averaged weights would reach only the compute-dtype copies, not the fp32 masters (a silent loss)."""
    module = TinyLM(optim=SGD)
    before = _state(module)
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    trainer = make_trainer(
        strategy=PatrickStarStrategy(), precision=precision, max_epochs=2, max_steps=-1, callbacks=[swa]
    )
    with pytest.raises(ValueError, match=rf"`StochasticWeightAveraging` .*precision='{precision}'.*HINT: .*'32-true'"):
        trainer.fit(module, make_loader(n_seq=8))
    assert trainer.global_step == 0
    _assert_states(_state(module), before, "after the refusal")


# --------------------------------------------------------------------------------------------------
# Tuner: lr_find (matches), scale_batch_size (refused)
# --------------------------------------------------------------------------------------------------


class TunedLM(TinyLM):
    """TinyLM with the ``lr`` and ``batch_size`` attributes the Tuner reads and writes, and its own loaders."""

    def __init__(self) -> None:
        super().__init__(optim=SGD)
        self.lr = SGD.lr
        self.batch_size = 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=self.lr, momentum=SGD.momentum, fused=True)

    def train_dataloader(self) -> DataLoader:
        return make_loader(n_seq=64, batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return make_loader(n_seq=8, batch_size=self.batch_size)


def _lr_find_then_fit(strategy: Any, root: Path) -> tuple[list[float], float, dict[str, torch.Tensor], LossRecorder]:
    module = TunedLM()
    before = _state(module)
    recorder = LossRecorder()
    trainer = make_trainer(strategy=strategy, max_steps=4, callbacks=[recorder], default_root_dir=root)
    found = Tuner(trainer).lr_find(module, num_training=16, min_lr=1e-4, max_lr=1.0, early_stop_threshold=None)
    assert found is not None
    after = _state(module)
    _assert_states(after, before, f"{strategy}: weights after lr_find")  # the sweep was rolled back
    trainer.fit(module)
    return found.results["loss"], module.lr, after, recorder


def test_lr_find_matches_plain_lightning_and_restores(tmp_path: Path) -> None:
    ref_losses, ref_lr, _, ref = _lr_find_then_fit("auto", tmp_path / "auto")
    losses, lr, _, got = _lr_find_then_fit(PatrickStarStrategy(), tmp_path / "pstar")
    assert len(losses) == len(ref_losses) == 16
    assert_losses_close(losses, ref_losses, rtol=TOL, what="lr_find sweep")
    assert lr == ref_lr and lr != SGD.lr, f"suggested lr {lr} vs plain Lightning's {ref_lr}"
    assert_losses_close(got.losses, ref.losses, rtol=TOL, what="fit after lr_find")
    _assert_states(got.final_state, ref.final_state, "fit after lr_find")
    assert not list(tmp_path.rglob("*.ckpt")), "lr_find left its checkpoint behind"


def test_scale_batch_size_refused_before_anything_changes(tmp_path: Path) -> None:
    module = TunedLM()
    before = _state(module)
    trainer = make_trainer(strategy=PatrickStarStrategy(), max_steps=4, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="not supported with distributed strategies"):
        Tuner(trainer).scale_batch_size(module, mode="power", steps_per_trial=1, max_trials=2)
    trainer = make_trainer(
        strategy=PatrickStarStrategy(), max_steps=4, default_root_dir=tmp_path, callbacks=[BatchSizeFinder()]
    )
    with pytest.raises(ValueError, match=r"`BatchSizeFinder` .*Nothing was changed\. HINT: .*strategy='auto'"):
        trainer.fit(module)
    assert trainer.global_step == 0 and module.batch_size == 2
    _assert_states(_state(module), before, "after the refusal")


# --------------------------------------------------------------------------------------------------
# BackboneFinetuning (refused)
# --------------------------------------------------------------------------------------------------


class BackboneLM(LM):
    """LM whose transformer blocks are the ``backbone`` that ``BackboneFinetuning`` freezes and unfreezes."""

    def __init__(self) -> None:
        super().__init__(TinyGPT, optim="sgd")
        self.backbone = self.net.blocks

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05, momentum=0.9, fused=True)


def test_backbone_finetuning_refused_before_anything_changes() -> None:
    # plain Lightning: the callback really adds a group at epoch 1 (the pattern the strategy cannot follow)
    ref = fit(
        BackboneLM(),
        strategy="auto",
        max_epochs=2,
        max_steps=-1,
        loader=make_loader(n_seq=8),
        callbacks=[BackboneFinetuning(1)],
    )
    assert len(ref.trainer.optimizers[0].param_groups) == 2

    module = BackboneLM()
    before = _state(module)
    trainable = {n: p.requires_grad for n, p in module.named_parameters()}
    trainer = make_trainer(
        strategy=PatrickStarStrategy(), max_epochs=2, max_steps=-1, callbacks=[BackboneFinetuning(1)]
    )
    with pytest.raises(
        ValueError, match=r"`BackboneFinetuning` \(a `BaseFinetuning` callback\).*add_param_group.*HINT:"
    ):
        trainer.fit(module, make_loader(n_seq=8))
    assert trainer.global_step == 0
    now = {n: p.requires_grad for n, p in module.named_parameters()}
    assert now == trainable, "the callback froze the backbone before the refusal"
    _assert_states(_state(module), before, "after the refusal")


# --------------------------------------------------------------------------------------------------
# weight_norm parametrization; EMA teacher
# --------------------------------------------------------------------------------------------------


def _weight_normed() -> nn.Module:
    net = TinyGPT()
    weight_norm(net.blocks[0].mlp.fc)  # parameters under blocks.0.mlp.fc.parametrizations.weight.original0/1
    weight_norm(net.blocks[1].attn.qkv)
    return net


@pytest.mark.parametrize("budget", ["unlimited", "evicting"])
def test_weight_norm_matches_plain_lightning(budget: str) -> None:
    strategy = PatrickStarStrategy() if budget == "unlimited" else tight(2048, 4)
    ref = fit(LM(_weight_normed, optim="sgd"), strategy="auto", max_steps=6)
    got = fit(LM(_weight_normed, optim="sgd"), strategy=strategy, max_steps=6)
    assert "net.blocks.0.mlp.fc.parametrizations.weight.original1" in got.final
    _assert_same_run(got, ref, f"weight_norm ({budget})")
    if budget == "evicting":
        assert_evicted(strategy)


class TeacherLM(LM):
    """A student trained on the targets and on a frozen teacher's logits; the teacher follows the student by
    EMA in ``on_train_batch_end`` (``t = d * t + (1 - d) * s``), the way self-distillation methods do."""

    decay = 0.9

    def __init__(self) -> None:
        super().__init__(TinyGPT, optim="sgd")
        torch.manual_seed(99)
        self.teacher = TinyGPT()
        self.teacher.requires_grad_(False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)  # (B, T, V)
        with torch.no_grad():
            target = self.teacher(x)  # (B, T, V)
        return lm_loss(logits, y) + 0.5 * F.mse_loss(logits, target)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.net.parameters(), strict=True):
                t.mul_(self.decay).add_(s, alpha=1 - self.decay)


@pytest.mark.parametrize("budget", ["unlimited", "evicting"])
def test_ema_teacher_matches_plain_lightning(budget: str) -> None:
    strategy = PatrickStarStrategy() if budget == "unlimited" else tight(2048, 4)
    ref = fit(TeacherLM(), strategy="auto", max_steps=6)
    got = fit(TeacherLM(), strategy=strategy, max_steps=6)
    moved = ref.final["teacher.lm_head.weight"] - ref.recorder.initial_state["teacher.lm_head.weight"]
    assert moved.abs().max() > 0, "the EMA never moved the teacher (the test proves nothing)"
    _assert_same_run(got, ref, f"ema teacher ({budget})")
    if budget == "evicting":
        assert_evicted(strategy)


@pytest.mark.parametrize("budget", ["unlimited", "evicting"])
def test_ema_teacher_in_bf16_mixed_is_refused_naming_it(budget: str) -> None:
    """In bf16-mixed the teacher's parameters are rounded copies of fp32 masters that the EMA's in-place write would
    not reach (the teacher would be saved unmoved, or its EMA would stall in bf16): refused at the next forward,
    naming the teacher's parameters ([Note: writes outside a forward] in runtime/outside_writes.py)."""
    strategy = PatrickStarStrategy() if budget == "unlimited" else tight(2048, 4)
    with pytest.raises(OutsideWriteError, match=r"'teacher\..*written in place outside.*HINT: train in"):
        fit(TeacherLM(), strategy=strategy, precision="bf16-mixed", max_steps=6)
