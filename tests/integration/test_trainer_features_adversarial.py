"""Adversarial runs of Lightning Trainer features and loops the team did not write, against plain Lightning.

Every scenario runs the same LightningModule and Trainer twice or more: with ``strategy="auto"`` (the reference
nobody here tuned) and with ``strategy="patrickstar"`` (the optimizer on the host, so the offloaded step and its
schedules are exercised), same seed and data. 32-true must give plain Lightning's losses and weights (~1e-6), and
every ``optimizer_overlap`` mode the serial step's bits; a pattern the engine cannot support must be refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
)
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.runtime.grad_guard import GradientsInChunksError
from tests.helpers import assert_states_close, assert_states_equal
from tests.helpers.data import make_loader
from tests.helpers.models import TinyGPT, lm_loss
from tests.helpers.runs import LM, LossRecorder, make_trainer

HOST = {"optimizer_placement": "host", "chunk_size": 4096}
MODES = ("off", "pipeline", "next_forward", "auto")
RTOL = 1e-6  # 32-true losses against plain Lightning
WEIGHT_ATOL = 1e-5  # final weights against plain Lightning: Adam divides near-zero gradients by their own size


def strategy_for(mode: str | None, **options: Any) -> Any:
    """Plain Lightning (``None``) or PatrickStar with the optimizer on the host and ``optimizer_overlap=mode``."""
    if mode is None:
        return "auto"
    return PatrickStarStrategy(optimizer_overlap=mode, **{**HOST, **options})


class ValRecorder(L.Callback):
    """The loss of every validation batch (sanity check included) and the epoch/step it ran at."""

    def __init__(self) -> None:
        self.losses: list[tuple[int, int, float]] = []

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append((trainer.current_epoch, trainer.global_step, float(outputs)))


class Run:
    """One fit: the trainer, module, training and validation records, and the user's optimizer state."""

    def __init__(self, module: L.LightningModule, trainer: L.Trainer, rec: LossRecorder, val: ValRecorder) -> None:
        self.module, self.trainer, self.rec, self.val = module, trainer, rec, val

    @property
    def losses(self) -> list[float]:
        return self.rec.losses

    @property
    def final(self) -> dict[str, torch.Tensor]:
        return self.rec.final_state

    def optim(self) -> dict[str, torch.Tensor]:
        state = self.trainer.optimizers[0].state_dict()["state"]
        return {f"{i}/{k}": v for i, entry in state.items() for k, v in entry.items()}


def run(
    module: L.LightningModule,
    mode: str | None,
    *,
    train: DataLoader | None = None,
    val: DataLoader | None = None,
    callbacks: tuple[L.Callback, ...] = (),
    ckpt_path: str | None = None,
    strategy_options: dict[str, Any] | None = None,
    **trainer_kwargs: Any,
) -> Run:
    """Fit ``module`` under plain Lightning (``mode=None``) or PatrickStar; ``max_steps`` 6 unless told."""
    rec, vrec = LossRecorder(), ValRecorder()
    trainer_kwargs.setdefault("max_steps", 6)
    trainer = make_trainer(
        strategy=strategy_for(mode, **(strategy_options or {})), callbacks=[rec, vrec, *callbacks], **trainer_kwargs
    )
    trainer.fit(
        module,
        train_dataloaders=train if train is not None else make_loader(n_seq=24),
        val_dataloaders=val,
        ckpt_path=ckpt_path,
    )
    return Run(module, trainer, rec, vrec)


def assert_like_plain(got: Run, ref: Run, what: str) -> None:
    """Losses (training and validation) within RTOL of plain Lightning's, final weights close."""
    assert len(got.losses) == len(ref.losses) > 0, f"{what}: {len(got.losses)} losses vs {len(ref.losses)}"
    for i, (a, b) in enumerate(zip(got.losses, ref.losses, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"{what}: train batch {i}: patrickstar {a!r} vs plain {b!r}"
    assert [v[:2] for v in got.val.losses] == [v[:2] for v in ref.val.losses], f"{what}: validation ran elsewhere"
    for i, (a, b) in enumerate(zip(got.val.losses, ref.val.losses, strict=True)):
        assert abs(a[2] - b[2]) <= RTOL * abs(b[2]), f"{what}: val batch {i}: patrickstar {a} vs plain {b}"
    assert got.trainer.global_step == ref.trainer.global_step, f"{what}: global_step"
    assert_states_close(got.final, ref.final, what=what, atol=WEIGHT_ATOL)


def assert_bitwise(got: Run, ref: Run, what: str) -> None:
    """The same training and validation losses, weights and optimizer states, bit for bit."""
    assert got.losses == ref.losses, f"{what}: training losses differ"
    assert got.val.losses == ref.val.losses, f"{what}: validation losses differ"
    assert_states_equal(got.final, ref.final, what=f"{what}: weights")
    assert_states_equal(got.optim(), ref.optim(), what=f"{what}: optimizer states")


def check_all_modes(make: Any, *, modes: tuple[str, ...] = MODES[1:], **kwargs: Any) -> Run:
    """Plain Lightning, then the serial step and ``modes``: like plain, and bitwise the serial step. Returns plain's
    run."""
    ref = run(make(), None, **kwargs)
    serial = run(make(), "off", **kwargs)
    assert_like_plain(serial, ref, "optimizer_overlap='off' against plain Lightning")
    for mode in modes:
        assert_bitwise(run(make(), mode, **kwargs), serial, f"optimizer_overlap={mode!r} against 'off'")
    return ref


class TinyLM(LM):
    """:class:`TinyGPT` under fused AdamW with weight decay, with validation and test steps logging their loss and
    no hook between backward and step (so the engine may step inside the backward)."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self(batch[0]), batch[1])
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self(batch[0]), batch[1])
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0])


# ---- the user's own optimizer_step / optimizer_zero_grad ---------------------------------------------------------


class ClosureWithoutStepLM(TinyLM):
    """``optimizer_step`` runs the closure (forward and backward) on every batch but steps only on even ones: the
    gradients of an odd batch are thrown away by the next closure's ``zero_grad`` (plain Lightning)."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if batch_idx % 2 == 0:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()


def test_optimizer_step_override_running_the_closure_without_stepping() -> None:
    """Lightning counts every ``optimizer_step`` call as a step (6 batches, 3 real steps): the gradients of the
    batches without a step must not leak into the next step, in any overlap mode."""
    ref = check_all_modes(ClosureWithoutStepLM, max_steps=6)
    assert ref.trainer.global_step == 6 and len(ref.losses) == 6


class ZeroEveryOtherLM(TinyLM):
    """``optimizer_zero_grad`` zeroes only on even batches: on odd ones the gradients of the batch before (already
    stepped with) are summed into this batch's (plain torch semantics of not zeroing)."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if batch_idx % 2 == 0:
            optimizer.zero_grad()


def test_optimizer_zero_grad_override_keeping_gradients() -> None:
    """An ``optimizer_zero_grad`` override zeroing every other batch: plain torch adds the last step's gradients to
    the next step's. PatrickStar frees gradients at the step, so that step is refused before it changes anything
    ([Note: gradients end with the step]; it silently stepped with one batch's gradients)."""
    run(ZeroEveryOtherLM(), None, max_steps=5)
    for mode in MODES:
        with pytest.raises(RuntimeError, match=r"without `zero_grad\(\)` since the last step.*HINT"):
            run(ZeroEveryOtherLM(), mode, max_steps=5)


class ZeroGradCounter(TinyLM):
    """Counts ``on_before_zero_grad`` calls and records the weights the optimizer holds then."""

    def __init__(self) -> None:
        super().__init__()
        self.zero_grad_calls = 0
        self.first_weight: list[float] = []

    def on_before_zero_grad(self, optimizer: Any) -> None:
        self.zero_grad_calls += 1
        self.first_weight.append(float(self.net.lm_head.weight.detach().float().sum()))


def test_on_before_zero_grad_sees_plain_weights() -> None:
    """``on_before_zero_grad`` runs inside the closure, after the training step and before the backward: it is
    called as often as plain Lightning calls it and reads the same weights."""
    ref = run(ZeroGradCounter(), None, max_steps=4)
    for mode in ("off", "pipeline"):
        got = run(ZeroGradCounter(), mode, max_steps=4)
        assert got.module.zero_grad_calls == ref.module.zero_grad_calls == 4
        torch.testing.assert_close(got.module.first_weight, ref.module.first_weight, rtol=1e-6, atol=1e-6)
        assert_like_plain(got, ref, f"{mode}")


# ---- accumulation that changes by epoch ---------------------------------------------------------------------------


@pytest.mark.parametrize("scheduling", [{0: 1, 1: 2, 2: 3}, {0: 3, 1: 1}], ids=["growing", "shrinking"])
def test_gradient_accumulation_scheduler(scheduling: dict[int, int]) -> None:
    """``GradientAccumulationScheduler`` changes ``accumulate_grad_batches`` at epoch starts (after setup): the
    chunks must accumulate from then on (and stop accumulating), as plain Lightning does."""
    check_all_modes(
        TinyLM,
        max_steps=-1,
        max_epochs=3,
        callbacks=(GradientAccumulationScheduler(scheduling=scheduling),),
    )


@pytest.mark.parametrize("sched", [{0: 1, 1: 3}, {0: 3, 1: 1}], ids=["growing", "shrinking"])
def test_gradient_accumulation_scheduler_bf16_mixed(sched: dict[int, int]) -> None:
    """The same in bf16-mixed, where accumulation needs an fp32 gradient-sum chunk that setup (seeing
    ``accumulate_grad_batches=1``) may not have planned, and the warm-up may fall in an accumulation window: plain
    bf16-mixed's losses within bf16's rounding, overlap modes bitwise."""
    kwargs: dict[str, Any] = {"max_steps": -1, "max_epochs": 2, "precision": "bf16-mixed"}
    ref = run(TinyLM(), None, callbacks=(GradientAccumulationScheduler(scheduling=sched),), **kwargs)
    serial = run(TinyLM(), "off", callbacks=(GradientAccumulationScheduler(scheduling=sched),), **kwargs)
    fixed = run(TinyLM(), "off", accumulate_grad_batches=1, **kwargs)
    assert serial.trainer.global_step == ref.trainer.global_step == 8
    assert len(serial.losses) == len(ref.losses) == 12
    for i, (a, b) in enumerate(zip(serial.losses, ref.losses, strict=True)):
        assert abs(a - b) <= 2e-2 * abs(b), f"batch {i}: patrickstar {a} vs plain bf16-mixed {b}"
    # the last batches differ from a run that never accumulated by far more than bf16's rounding
    assert abs(serial.losses[-1] - fixed.losses[-1]) > 4 * abs(serial.losses[-1] - ref.losses[-1])
    for mode in MODES[1:]:
        piped = run(TinyLM(), mode, callbacks=(GradientAccumulationScheduler(scheduling=sched),), **kwargs)
        assert_bitwise(piped, serial, f"bf16-mixed {mode} against off")


# ---- validation schedules ----------------------------------------------------------------------------------------


def val_loader() -> DataLoader:
    return make_loader(n_seq=16, seed=99)


VALIDATION_SCHEDULES: dict[str, dict[str, Any]] = {
    "float-interval-sanity-all": {
        "val_check_interval": 0.5,
        "limit_val_batches": 2,
        "num_sanity_val_steps": -1,
        "max_epochs": 2,
        "max_steps": -1,
    },
    "int-interval-across-epochs": {
        "val_check_interval": 4,
        "check_val_every_n_epoch": None,
        "limit_val_batches": 0.5,
        "max_steps": 10,
    },
    "every-2nd-epoch-float-train-limit-no-inference-mode": {
        "check_val_every_n_epoch": 2,
        "limit_train_batches": 0.5,
        "inference_mode": False,
        "max_epochs": 4,
        "max_steps": -1,
    },
}


@pytest.mark.parametrize("case", sorted(VALIDATION_SCHEDULES))
def test_validation_schedules(case: str) -> None:
    """Validation mid-epoch (float and int intervals), every n epochs, under ``inference_mode=False`` and a float
    ``limit_train_batches``: the same validation losses at the same steps and the same training."""
    ref = check_all_modes(TinyLM, val=val_loader(), **VALIDATION_SCHEDULES[case])
    assert ref.val.losses, "no validation ran"


# ---- stopping and starting again ---------------------------------------------------------------------------------


class LoggingLM(TinyLM):
    """Logs its training loss as ``train_loss``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def test_early_stopping_then_fit_again_from_last(tmp_path: Path) -> None:
    """EarlyStopping ends the first fit after two epochs (``mode="max"`` on a falling val_loss); a new Trainer
    resumes from ``ckpt_path="last"`` for two more epochs: plain Lightning's run, in both fits."""
    results = {}
    for name, mode in (("plain", None), ("off", "off"), ("pipeline", "pipeline")):
        ckpt_dir = tmp_path / name
        first = run(
            LoggingLM(),
            mode,
            val=val_loader(),
            max_steps=-1,
            max_epochs=10,
            enable_checkpointing=True,
            callbacks=(
                EarlyStopping(monitor="val_loss", mode="max", patience=0),
                ModelCheckpoint(dirpath=ckpt_dir, save_last=True),
            ),
        )
        assert first.trainer.current_epoch == 2, f"{name}: early stopping did not stop after two epochs"
        second = run(
            LoggingLM(),
            mode,
            val=val_loader(),
            max_steps=-1,
            max_epochs=4,
            enable_checkpointing=True,
            callbacks=(ModelCheckpoint(dirpath=ckpt_dir, save_last=True),),
            ckpt_path="last",
        )
        results[name] = (first, second)
    ref_first, ref_second = results["plain"]
    assert len(ref_second.losses) == 12 and ref_second.trainer.global_step == 24
    for name in ("off", "pipeline"):
        first, second = results[name]
        assert_like_plain(first, ref_first, f"{name}: first fit")
        assert_like_plain(second, ref_second, f"{name}: fit resumed from last")
    assert_bitwise(results["pipeline"][1], results["off"][1], "resumed fit: pipeline against off")


def test_resume_from_a_non_last_top_k_checkpoint(tmp_path: Path) -> None:
    """``ModelCheckpoint(every_n_train_steps=2, save_top_k=2, monitor="train_loss")`` keeps two mid-epoch
    checkpoints; a new Trainer resumes from the older one: plain Lightning's resumed run."""
    results = {}
    for name, mode in (("plain", None), ("off", "off"), ("next_forward", "next_forward")):
        ckpt_dir = tmp_path / name
        cb = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=2, monitor="train_loss")
        run(LoggingLM(), mode, max_steps=8, max_epochs=-1, enable_checkpointing=True, callbacks=(cb,))
        kept = sorted(ckpt_dir.glob("*.ckpt"), key=lambda p: torch.load(p, weights_only=False)["global_step"])
        assert len(kept) == 2, f"{name}: {kept}"
        older = kept[0]
        second = run(LoggingLM(), mode, max_steps=10, max_epochs=-1, ckpt_path=str(older))
        results[name] = (older.name, second)
    ref_name, ref = results["plain"]
    for name in ("off", "next_forward"):
        got_name, got = results[name]
        assert got_name == ref_name, f"{name}: kept {got_name}, plain kept {ref_name}"
        assert_like_plain(got, ref, f"{name}: resumed from {got_name}")
    assert_bitwise(results["next_forward"][1], results["off"][1], "resumed: next_forward against off")


def test_fit_twice_with_the_same_module() -> None:
    """A second fit of the same module by a new Trainer continues from the weights the first handed back, with a
    fresh optimizer (plain Lightning); the same Trainer's fit again after ``max_steps`` trains no more."""
    outcomes = {}
    for name, mode in (("plain", None), ("off", "off"), ("auto", "auto")):
        module = TinyLM()
        first = run(module, mode, max_steps=3)
        second = run(module, mode, max_steps=4)
        again = LossRecorder()
        second.trainer.callbacks.append(again)
        second.trainer.fit(module, train_dataloaders=make_loader(n_seq=24))
        weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
        outcomes[name] = (first, second, again, weights)
    ref_first, ref_second, ref_again, ref_weights = outcomes["plain"]
    assert ref_again.losses == []
    for name in ("off", "auto"):
        first, second, again, weights = outcomes[name]
        assert_like_plain(first, ref_first, f"{name}: first fit")
        assert_like_plain(second, ref_second, f"{name}: second fit")
        assert again.losses == [], f"{name}: the same Trainer trained again after max_steps"
        assert_states_close(weights, ref_weights, what=f"{name}: module after fitting three times", atol=WEIGHT_ATOL)


def test_validate_and_test_before_fit_with_the_same_trainer() -> None:
    """``trainer.validate`` and ``trainer.test`` before ``trainer.fit`` on the same Trainer and module: the same
    metrics before training, and then plain Lightning's training."""
    outcomes = {}
    for name, mode in (("plain", None), ("off", "off"), ("pipeline", "pipeline")):
        rec, vrec = LossRecorder(), ValRecorder()
        trainer = make_trainer(strategy=strategy_for(mode), max_steps=5, callbacks=[rec, vrec])
        module = TinyLM()
        val = trainer.validate(module, dataloaders=val_loader(), verbose=False)
        test = trainer.test(module, dataloaders=val_loader(), verbose=False)
        trainer.fit(module, train_dataloaders=make_loader(n_seq=24), val_dataloaders=val_loader())
        after = trainer.validate(module, dataloaders=val_loader(), verbose=False)
        outcomes[name] = (val, test, after, Run(module, trainer, rec, vrec))
    ref_val, ref_test, ref_after, ref = outcomes["plain"]
    for name in ("off", "pipeline"):
        val, test, after, got = outcomes[name]
        for mine, theirs, what in ((val, ref_val, "validate"), (test, ref_test, "test"), (after, ref_after, "after")):
            for key, value in theirs[0].items():
                assert abs(mine[0][key] - value) <= RTOL * abs(value), f"{name}: {what} {key}: {mine} vs {theirs}"
        assert_like_plain(got, ref, f"{name}: fit after validate and test")


# ---- schedulers and what the loggers see --------------------------------------------------------------------------


class MetricsLogger(Logger):
    """Keeps every ``log_metrics`` call: (step, metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "metrics"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, {k: float(v) for k, v in metrics.items()}))


def assert_same_metrics(got: MetricsLogger, ref: MetricsLogger, what: str, rtol: float = RTOL) -> None:
    assert [(s, sorted(m)) for s, m in got.records] == [(s, sorted(m)) for s, m in ref.records], (
        f"{what}: other metrics logged: {got.records} vs {ref.records}"
    )
    for (step, mine), (_, theirs) in zip(got.records, ref.records, strict=True):
        for key, value in theirs.items():
            assert abs(mine[key] - value) <= rtol * abs(value) + 1e-12, f"{what}: step {step} {key}: {mine} vs {theirs}"


class SchedulersLM(TinyLM):
    """Two param groups; a StepLR stepped every 2nd optimizer step (interval "step", frequency 2) and a
    ReduceLROnPlateau on val_loss are not both allowed on one optimizer, so ``plateau`` picks the latter."""

    def __init__(self, plateau: bool) -> None:
        super().__init__()
        self.plateau = plateau

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.ndim >= 2]
        rest = [p for p in self.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 1e-2}],
            lr=3e-3,
            fused=True,
        )
        if self.plateau:
            sched: Any = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=0)
            config = {"scheduler": sched, "monitor": "val_loss", "interval": "epoch"}
        else:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
            config = {"scheduler": sched, "interval": "step", "frequency": 2}
        return {"optimizer": opt, "lr_scheduler": config}


def fit_with_lr_monitor(make: Any, mode: str | None, **kwargs: Any) -> tuple[MetricsLogger, Run]:
    logger = MetricsLogger()
    result = run(
        make(),
        mode,
        val=val_loader(),
        logger=logger,
        log_every_n_steps=1,
        callbacks=(LearningRateMonitor(logging_interval="step"),),
        **kwargs,
    )
    return logger, result


def only(logger: MetricsLogger, prefix: str) -> MetricsLogger:
    """The records' metrics whose names start with ``prefix`` (records left without any dropped)."""
    kept = MetricsLogger()
    for step, metrics in logger.records:
        picked = {k: v for k, v in metrics.items() if k.startswith(prefix)}
        if picked:
            kept.records.append((step, picked))
    return kept


@pytest.mark.parametrize("plateau", [False, True], ids=["step-lr-every-2nd-step", "plateau-on-val-loss"])
def test_lr_schedulers(plateau: bool) -> None:
    """A StepLR stepped every 2nd optimizer step (interval "step", frequency 2) or a ReduceLROnPlateau on
    val_loss, over two param groups: the learning rates LearningRateMonitor logs for the user's AdamW (both groups,
    every step), the validation losses and the training are plain Lightning's."""
    outcomes = {}
    for name, mode in (("plain", None), ("off", "off"), ("pipeline", "pipeline")):
        outcomes[name] = fit_with_lr_monitor(lambda: SchedulersLM(plateau), mode, max_steps=-1, max_epochs=3)
    ref_logger, ref = outcomes["plain"]
    lrs = [m["lr-AdamW/pg1"] for _, m in ref_logger.records if "lr-AdamW/pg1" in m]
    assert len(lrs) == 18 and len(set(lrs)) >= 2, f"the schedule never moved the learning rate: {lrs}"
    for name in ("off", "pipeline"):
        logger, result = outcomes[name]
        assert_like_plain(result, ref, name)
        assert result.rec.lrs == ref.rec.lrs, f"{name}: learning rates at batch ends"
        for prefix in ("lr-AdamW", "val_loss"):
            assert_same_metrics(only(logger, prefix), only(ref_logger, prefix), f"{name}: {prefix}")


@pytest.mark.parametrize("scheduler", [False, True], ids=["no-scheduler", "step-lr"])
def test_learning_rate_monitor_logs_the_users_optimizer(scheduler: bool) -> None:
    """The metric names LearningRateMonitor logs are plain Lightning's (a dashboard keyed by them keeps working)."""

    class Plain(TinyLM):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=3e-3, fused=True)
            if not scheduler:
                return opt
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1)}

    ref_logger, _ = fit_with_lr_monitor(Plain, None, max_steps=3)
    got_logger, _ = fit_with_lr_monitor(Plain, "off", max_steps=3)
    assert any("lr-AdamW" in m for _, m in ref_logger.records)
    assert_same_metrics(got_logger, ref_logger, "LearningRateMonitor")


class GradNormLM(TinyLM):
    """Logs ``lightning.pytorch.utilities.grad_norm`` in ``on_before_optimizer_step`` (Lightning's documented
    recipe for monitoring gradient norms)."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict(grad_norm(self, norm_type=2))


def test_grad_norm_logged_in_on_before_optimizer_step() -> None:
    """Lightning's documented recipe logs every gradient norm in plain Lightning. PatrickStar keeps gradients in
    its chunks: reading ``p.grad`` there is refused, naming the parameter (it was silently None: nothing logged)."""
    logger = MetricsLogger()
    run(GradNormLM(), None, max_steps=3, logger=logger, log_every_n_steps=1)
    assert any("grad_2.0_norm_total" in m for _, m in logger.records)
    for mode in MODES:
        with pytest.raises(GradientsInChunksError, match=r"net\..*HINT"):
            run(GradNormLM(), mode, max_steps=3, logger=MetricsLogger(), log_every_n_steps=1)


# ---- skipped and gradient-free batches ---------------------------------------------------------------------------


class ReturnsNoneLM(TinyLM):
    """``training_step`` returns None on batches 1 and 4 (no backward, no step for them)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 3 == 1 else loss


class SkippedLosses(L.Callback):
    """The loss of each batch that returned one (Lightning passes an empty dict for a skipped batch)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
        if outputs:
            self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_training_step_returning_none_without_clipping(accumulate: int) -> None:
    """No clipping, no gradient-reading hook: the engine may step inside the backward. A batch returning None runs
    no backward and no step (inside an accumulation window too), in every overlap mode."""
    outcomes = {}
    for name, mode in (("plain", None), *((m, m) for m in MODES)):
        seen = SkippedLosses()
        module = ReturnsNoneLM()
        trainer = make_trainer(
            strategy=strategy_for(mode),
            max_steps=-1,
            max_epochs=2,
            accumulate_grad_batches=accumulate,
            callbacks=[seen],
        )
        trainer.fit(module, train_dataloaders=make_loader(n_seq=24))
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        outcomes[name] = (seen.losses, state, trainer.global_step)
    ref_losses, ref_state, ref_steps = outcomes["plain"]
    assert len(ref_losses) == 8
    for name in MODES:
        losses, state, steps = outcomes[name]
        assert steps == ref_steps, f"{name}: {steps} steps vs {ref_steps}"
        assert len(losses) == len(ref_losses)
        for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(a - b) <= RTOL * abs(b), f"{name}: batch {i}: {a} vs plain {b}"
        assert_states_close(state, ref_state, what=name, atol=WEIGHT_ATOL)
        if name != "off":
            assert losses == outcomes["off"][0], f"{name}: losses differ from off"
            assert_states_equal(state, outcomes["off"][1], what=f"{name} against off")


class NoGradLossLM(TinyLM):
    """Computes the loss of batch 2 under ``torch.no_grad()``: the backward of a loss without a graph."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 2:
            with torch.no_grad():
                return super().training_step(batch, batch_idx)
        return super().training_step(batch, batch_idx)


def test_loss_computed_under_no_grad_raises_like_plain() -> None:
    """Plain Lightning raises torch's "does not require grad" error at that batch; PatrickStar must raise too
    (not train on, not hang), with the weights of the two steps before."""
    with pytest.raises(RuntimeError, match="does not require grad") as plain_error:
        run(NoGradLossLM(), None, max_steps=6)
    assert plain_error.value is not None
    for mode in ("off", "pipeline", "next_forward"):
        rec = LossRecorder()
        module = NoGradLossLM()
        trainer = make_trainer(strategy=strategy_for(mode), max_steps=6, callbacks=[rec])
        with pytest.raises(RuntimeError, match="does not require grad"):
            trainer.fit(module, train_dataloaders=make_loader(n_seq=24))
        assert len(rec.losses) == 2, f"{mode}: {rec.losses}"


# ---- anomaly detection, value clipping, dataloaders reloaded, a time limit ---------------------------------------


def test_detect_anomaly_with_value_clipping() -> None:
    """``detect_anomaly=True`` (autograd's anomaly mode around the backward) and clipping by value."""
    check_all_modes(TinyLM, detect_anomaly=True, gradient_clip_val=0.01, gradient_clip_algorithm="value")


class ReloadingLM(TinyLM):
    """Its own ``train_dataloader``: other data every epoch (seeded by the epoch), a shorter loader in epoch 1."""

    def train_dataloader(self) -> DataLoader:
        epoch = self.trainer.current_epoch
        return make_loader(n_seq=16 if epoch == 1 else 24, seed=100 + epoch)


def test_reload_dataloaders_every_epoch() -> None:
    outcomes = {}
    for name, mode in (("plain", None), ("off", "off"), ("next_forward", "next_forward")):
        rec = LossRecorder()
        module = ReloadingLM()
        trainer = make_trainer(
            strategy=strategy_for(mode),
            max_steps=-1,
            max_epochs=3,
            reload_dataloaders_every_n_epochs=1,
            callbacks=[rec],
        )
        trainer.fit(module)
        outcomes[name] = Run(module, trainer, rec, ValRecorder())
    assert len(outcomes["plain"].losses) == 6 + 4 + 6
    assert_like_plain(outcomes["off"], outcomes["plain"], "off")
    assert_bitwise(outcomes["next_forward"], outcomes["off"], "next_forward against off")


class StopAt(L.Callback):
    """Sets ``trainer.should_stop`` at the end of batch ``batch`` of epoch 1 (what EarlyStopping and Timer do)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 1 and batch_idx == 2:
            trainer.should_stop = True


def test_should_stop_mid_epoch() -> None:
    """A callback stops the run mid-epoch (after batch 2 of epoch 1): the run ends there, and the weights handed
    back are those of the last step, whatever step was still in flight, in every overlap mode."""
    outcomes = {}
    for name, mode in (("plain", None), *((m, m) for m in MODES)):
        module = TinyLM()
        result = run(module, mode, max_steps=-1, max_epochs=3, callbacks=(StopAt(),))
        outcomes[name] = (result, {k: v.detach().clone() for k, v in module.state_dict().items()})
    ref, ref_state = outcomes["plain"]
    assert ref.trainer.global_step == 9
    for name in MODES:
        got, state = outcomes[name]
        assert_like_plain(got, ref, name)
        assert_states_close(state, ref_state, what=f"{name}: module handed back", atol=WEIGHT_ATOL)
        assert_states_equal(state, outcomes["off"][1], what=f"{name}: module handed back against off")


def test_max_time_zero_trains_nothing() -> None:
    """``max_time`` already spent at the start: no step, and the module comes back with its initial weights."""
    module = TinyLM()
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    result = run(module, "pipeline", max_steps=-1, max_epochs=3, max_time={"seconds": 0})
    assert result.trainer.global_step == 0
    assert_states_equal({k: v.detach() for k, v in module.state_dict().items()}, before, what="untouched module")


# ---- the same Trainer fitted again, manual loops that keep gradients, a device budget ------------------------------


def test_same_trainer_fitted_again_for_more_epochs() -> None:
    """One epoch, then the same Trainer (and strategy object) fits the same module again with ``max_epochs``
    raised: Lightning reconfigures the optimizer and trains one more epoch from the handed-back weights."""
    outcomes = {}
    for name, mode in (("plain", None), ("off", "off"), ("pipeline", "pipeline")):
        rec = LossRecorder()
        module = TinyLM()
        trainer = make_trainer(strategy=strategy_for(mode), max_steps=-1, max_epochs=1, callbacks=[rec])
        trainer.fit(module, train_dataloaders=make_loader(n_seq=24))
        trainer.fit_loop.max_epochs = 2
        trainer.fit(module, train_dataloaders=make_loader(n_seq=24))
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
        outcomes[name] = (rec.losses, state, trainer.global_step)
    ref_losses, ref_state, ref_steps = outcomes["plain"]
    assert ref_steps == 12 and len(ref_losses) == 12
    for name in ("off", "pipeline"):
        losses, state, steps = outcomes[name]
        assert steps == ref_steps
        for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(a - b) <= RTOL * abs(b), f"{name}: batch {i}: {a} vs plain {b}"
        assert_states_close(state, ref_state, what=name, atol=WEIGHT_ATOL)
    assert outcomes["pipeline"][0] == outcomes["off"][0]


class ManualNoZeroLM(TinyLM):
    """Manual optimization that zeroes gradients only every ``zero_every`` steps: plain torch sums the gradients
    of the steps in between (the documented torch semantics of not calling ``zero_grad``)."""

    def __init__(self, zero_every: int) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.zero_every = zero_every

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        if batch_idx % self.zero_every == 0:
            opt.zero_grad()
        loss = lm_loss(self(batch[0]), batch[1])
        self.manual_backward(loss)
        opt.step()
        return loss.detach()


def test_manual_zero_grad_before_backward() -> None:
    """The common manual idiom ``zero_grad(); manual_backward(loss); step()``: plain Lightning's run."""
    check_all_modes(lambda: ManualNoZeroLM(1), max_steps=5)


def test_manual_step_without_zero_grad_keeps_gradients() -> None:
    """A manual loop that steps without ``zero_grad`` in between: refused at the second step, naming the fix."""
    run(ManualNoZeroLM(2), None, max_steps=5)
    for mode in MODES:
        with pytest.raises(RuntimeError, match=r"without `zero_grad\(\)` since the last step.*HINT"):
            run(ManualNoZeroLM(2), mode, max_steps=5)


BUDGET = {"placement": "auto", "device_memory_limit": "600KiB", "chunk_size": 2048}


def test_accumulation_scheduler_and_mid_epoch_validation_under_a_device_budget() -> None:
    """Chunks evicted and prefetched (auto placement under a device budget) while the accumulation changes by
    epoch and validation runs mid-epoch (sanity check over every batch first)."""
    peek = ReportPeek()
    check_all_modes(
        TinyLM,
        val=val_loader(),
        max_steps=-1,
        max_epochs=2,
        val_check_interval=0.5,
        limit_val_batches=2,
        num_sanity_val_steps=-1,
        callbacks=(GradientAccumulationScheduler(scheduling={0: 1, 1: 2}), peek),
        strategy_options=BUDGET,
    )
    assert peek.report is not None and peek.report.evictions > 0, peek.report


class ReportPeek(L.Callback):
    """The last PatrickStar run's memory report at train end."""

    report: Any = None

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if isinstance(trainer.strategy, PatrickStarStrategy):
            self.report = trainer.strategy.memory_report()


# ---- accumulation windows cut by the epoch's end or by validation -------------------------------------------------


def test_accumulation_window_cut_by_the_epoch_end() -> None:
    """6 batches an epoch (4 with ``limit_train_batches=4``... here 5 of 6) and ``accumulate_grad_batches=3``: the
    last window of every epoch is short and Lightning steps at its end anyway."""
    check_all_modes(TinyLM, max_steps=-1, max_epochs=2, accumulate_grad_batches=3, limit_train_batches=5)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_validation_inside_an_accumulation_window(precision: str) -> None:
    """``val_check_interval=3`` with ``accumulate_grad_batches=2``: validation runs after batch 3, between the two
    micro-batches of a window, while the first one's gradients wait in the chunks. Validation must read the
    weights (not gradients), and the window's step must still sum both micro-batches."""
    kwargs: dict[str, Any] = {
        "val": val_loader(),
        "max_steps": -1,
        "max_epochs": 2,
        "accumulate_grad_batches": 2,
        "val_check_interval": 3,
        "limit_val_batches": 2,
        "precision": precision,
    }
    if precision == "32-true":
        ref = check_all_modes(TinyLM, **kwargs)
        assert len(ref.val.losses) == 8
        return
    ref = run(TinyLM(), None, **kwargs)
    serial = run(TinyLM(), "off", **kwargs)
    assert [v[:2] for v in serial.val.losses] == [v[:2] for v in ref.val.losses]
    for i, (a, b) in enumerate(zip(serial.val.losses, ref.val.losses, strict=True)):
        assert abs(a[2] - b[2]) <= 2e-2 * abs(b[2]), f"val batch {i}: patrickstar {a} vs plain bf16-mixed {b}"
    for i, (a, b) in enumerate(zip(serial.losses, ref.losses, strict=True)):
        assert abs(a - b) <= 2e-2 * abs(b), f"batch {i}: patrickstar {a} vs plain bf16-mixed {b}"
    for mode in MODES[1:]:
        assert_bitwise(run(TinyLM(), mode, **kwargs), serial, f"bf16-mixed {mode} against off")


class WeightsAfterBackward(L.Callback):
    """Sums every parameter the LightningModule exposes in ``on_after_backward`` (a callback reading weights
    between the backward and the step: the engine must not have stepped inside the backward)."""

    def __init__(self) -> None:
        self.sums: list[float] = []

    def on_after_backward(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.sums.append(sum(float(p.detach().double().sum()) for p in pl_module.parameters()))


def test_callback_reading_weights_after_backward() -> None:
    outcomes = {}
    for name, mode in (("plain", None), *((m, m) for m in MODES)):
        cb = WeightsAfterBackward()
        outcomes[name] = (run(TinyLM(), mode, max_steps=5, accumulate_grad_batches=2, callbacks=(cb,)), cb.sums)
    ref, ref_sums = outcomes["plain"]
    assert len(ref_sums) == 10
    for name in MODES:
        got, sums = outcomes[name]
        assert_like_plain(got, ref, name)
        torch.testing.assert_close(sums, ref_sums, rtol=1e-6, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        assert_bitwise(got, outcomes["off"][0], f"{name} against off")


class SaveMidWindow(L.Callback):
    """``trainer.save_checkpoint`` after batch 3 (inside an accumulation window of 2)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 0 and batch_idx == 2:
            trainer.save_checkpoint(self.path)


def test_checkpoint_saved_inside_an_accumulation_window_and_resumed(tmp_path: Path) -> None:
    """A checkpoint saved between two micro-batches of a window (gradients waiting in the chunks) holds the weights
    and optimizer state of the last step, as plain Lightning's does, and resuming from it runs as plain resumes."""
    outcomes = {}
    for name, mode in (("plain", None), ("off", "off"), ("pipeline", "pipeline")):
        path = tmp_path / f"{name}.ckpt"
        run(TinyLM(), mode, max_steps=6, accumulate_grad_batches=2, callbacks=(SaveMidWindow(path),))
        saved = torch.load(path, weights_only=False)
        resumed = run(TinyLM(), mode, max_steps=6, accumulate_grad_batches=2, ckpt_path=str(path))
        outcomes[name] = (saved, resumed)
    ref_saved, ref = outcomes["plain"]
    assert ref_saved["global_step"] == 1
    for name in ("off", "pipeline"):
        saved, resumed = outcomes[name]
        assert saved["global_step"] == ref_saved["global_step"]
        assert_states_close(saved["state_dict"], ref_saved["state_dict"], what=f"{name}: saved weights", atol=1e-6)
        mine = saved["optimizer_states"][0]["state"]
        theirs = ref_saved["optimizer_states"][0]["state"]
        assert sorted(mine) == sorted(theirs)
        for i in theirs:
            for k in theirs[i]:
                torch.testing.assert_close(mine[i][k], theirs[i][k], rtol=1e-5, atol=1e-7)
        assert_like_plain(resumed, ref, f"{name}: resumed")


# ---- user code that reads or changes p.grad between backward and step ---------------------------------------------


class OwnClippingLM(TinyLM):
    """``configure_gradient_clipping`` overridden with torch's own ``clip_grad_norm_`` over the module's parameters
    (a common way to clip a subset, or with a norm type Lightning does not offer). SGD, so clipping shows."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9, fused=True)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm=0.01)


def test_configure_gradient_clipping_override_with_torch_clip() -> None:
    """``torch.nn.utils.clip_grad_norm_`` in ``configure_gradient_clipping`` clips in plain Lightning; under
    PatrickStar (gradients in chunks) it is refused, naming the parameter, before any step (it clipped nothing)."""
    run(OwnClippingLM(), None, max_steps=4)
    module = OwnClippingLM()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(GradientsInChunksError, match="HINT"):
        run(module, "off", max_steps=4)
    assert_states_equal(dict(module.state_dict()), before, what="weights after the refusal")


class FreezeByGradLM(TinyLM):
    """Zeroes the gradient of the position embedding in ``on_before_optimizer_step`` (guarded by ``is not None``,
    as Lightning's own utilities are): only weight decay moves it then."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        grad = self.net.wpe.weight.grad
        if grad is not None:
            grad.zero_()


def test_gradient_edited_in_on_before_optimizer_step() -> None:
    """Zeroing a gradient in ``on_before_optimizer_step``: plain Lightning's gradient is zeroed; PatrickStar's
    stand-in ``p.grad`` refuses the edit, naming the parameter (the edit was silently a no-op)."""
    run(FreezeByGradLM(), None, max_steps=4)
    module = FreezeByGradLM()
    with pytest.raises(GradientsInChunksError, match=r"wpe\.weight"):
        run(module, "off", max_steps=4)
    assert all(p.grad is None for p in module.parameters())  # no stand-in leaves with the model handed back


# ---- loops the user writes ----------------------------------------------------------------------------------------


class CriticLM(TinyLM):
    """Manual optimization, two optimizers WGAN-style: the transformer blocks ("critic") step on every batch, the
    embeddings and head ("generator", tied weights) every 2nd batch on another loss, each toggled while it runs;
    the generator's StepLR is stepped by hand every 3rd batch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        critic = [p for n, p in self.named_parameters() if ".blocks." in n]
        generator = [p for n, p in self.named_parameters() if ".blocks." not in n]
        c_opt = torch.optim.AdamW(critic, lr=3e-3, weight_decay=0.1, fused=True)
        g_opt = torch.optim.AdamW(generator, lr=1e-2, fused=True)
        g_sched = torch.optim.lr_scheduler.StepLR(g_opt, step_size=1, gamma=0.5)
        return [c_opt, g_opt], [g_sched]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        c_opt, g_opt = self.optimizers()
        self.toggle_optimizer(c_opt)
        c_loss = lm_loss(self(x), y)
        self.manual_backward(c_loss)
        c_opt.step()
        c_opt.zero_grad()
        self.untoggle_optimizer(c_opt)
        if batch_idx % 2 == 0:
            self.toggle_optimizer(g_opt)
            g_loss = lm_loss(self(y), x.flip(1))
            self.manual_backward(g_loss)
            g_opt.step()
            g_opt.zero_grad()
            self.untoggle_optimizer(g_opt)
        if batch_idx % 3 == 2:
            self.lr_schedulers().step()
        return c_loss.detach()


def test_two_optimizers_critic_steps_more_often() -> None:
    check_all_modes(CriticLM, modes=("pipeline", "auto"), max_steps=-1, max_epochs=1)


def test_two_optimizers_critic_steps_more_often_next_forward() -> None:
    check_all_modes(CriticLM, modes=("next_forward",), max_steps=-1, max_epochs=1)


class EndsEpochEarlyLM(TinyLM):
    """``on_train_batch_start`` returns -1 at batch 3 of epoch 0: Lightning ends that epoch there."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        if self.trainer.current_epoch == 0 and batch_idx == 3:
            return -1
        return None


def test_on_train_batch_start_ending_the_epoch() -> None:
    ref = check_all_modes(EndsEpochEarlyLM, val=val_loader(), limit_val_batches=2, max_steps=-1, max_epochs=2)
    assert len(ref.losses) == 3 + 6


def test_predict_before_fit_with_the_same_trainer() -> None:
    """``trainer.predict`` (under inference mode) before ``fit`` on the same Trainer: the same predictions, then
    plain Lightning's training and the same predictions after it."""
    outcomes = {}
    for name, mode in (("plain", None), ("off", "off"), ("next_forward", "next_forward")):
        rec = LossRecorder()
        trainer = make_trainer(strategy=strategy_for(mode), max_steps=4, callbacks=[rec])
        module = TinyLM()
        before = trainer.predict(module, dataloaders=make_loader(n_seq=8))
        trainer.fit(module, train_dataloaders=make_loader(n_seq=24))
        after = trainer.predict(module, dataloaders=make_loader(n_seq=8))
        outcomes[name] = (torch.cat(before), torch.cat(after), rec.losses)
    ref_before, ref_after, ref_losses = outcomes["plain"]
    for name in ("off", "next_forward"):
        before, after, losses = outcomes[name]
        torch.testing.assert_close(before, ref_before, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(after, ref_after, rtol=1e-5, atol=1e-5)
        for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(a - b) <= RTOL * abs(b), f"{name}: batch {i}: {a} vs plain {b}"


@pytest.mark.parametrize("plateau", [False, True], ids=["step-lr-every-2nd-step", "plateau-on-val-loss"])
def test_resume_at_an_epoch_boundary(plateau: bool, tmp_path: Path) -> None:
    """Resume from a checkpoint saved at an epoch's end, with an accumulation that changes by epoch and an LR
    schedule in the checkpoint, under pipeline and next_forward: plain Lightning's resumed run; and with the
    StepLR, where plain Lightning keeps its promise, bitwise one longer fit. (With ReduceLROnPlateau plain
    Lightning's own resume differs from its longer fit: the epoch-end checkpoint is written before the plateau
    scheduler steps.)"""

    def callbacks(*extra: L.Callback) -> tuple[L.Callback, ...]:
        return (GradientAccumulationScheduler(scheduling={0: 1, 1: 2, 2: 3}), *extra)

    def both(mode: str | None) -> tuple[Run, Run]:
        longer = run(SchedulersLM(plateau), mode, max_epochs=3, callbacks=callbacks(), **kwargs)
        folder = tmp_path / str(mode)
        ckpt = ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_epochs=1)
        run(SchedulersLM(plateau), mode, max_epochs=2, enable_checkpointing=True, callbacks=callbacks(ckpt), **kwargs)
        path = folder / "epoch=1-step=9.ckpt"
        assert path.exists(), sorted(p.name for p in folder.iterdir())
        resumed = run(SchedulersLM(plateau), mode, max_epochs=3, callbacks=callbacks(), ckpt_path=str(path), **kwargs)
        return longer, resumed

    kwargs: dict[str, Any] = {"val": val_loader(), "limit_val_batches": 2, "max_steps": -1}
    plain_longer, plain_resumed = both(None)
    assert len(plain_resumed.losses) == 6
    promise = plain_resumed.losses == plain_longer.losses[-6:]
    assert promise == (not plateau), "plain Lightning's own resume changed behaviour"
    for mode in ("pipeline", "next_forward"):
        longer, resumed = both(mode)
        assert_like_plain(longer, plain_longer, f"{mode}: three epochs")
        assert_like_plain(resumed, plain_resumed, f"{mode}: resumed")
        assert resumed.rec.lrs == plain_resumed.rec.lrs, f"{mode}: learning rates after the resume"
        if promise:
            assert resumed.losses == longer.losses[-6:], f"{mode}: resumed losses against one longer fit"
            assert resumed.val.losses == longer.val.losses[-len(resumed.val.losses) :]
            assert_states_equal(resumed.final, longer.final, what=f"{mode}: resumed against one longer fit")
            assert_states_equal(resumed.optim(), longer.optim(), what=f"{mode}: optimizer states")


# ---- hyperparameters changed while training ------------------------------------------------------------------------


class OneCycleLM(TinyLM):
    """OneCycleLR stepped every step with ``cycle_momentum=True``: it changes AdamW's ``betas[0]`` every step."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=8, cycle_momentum=True)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_one_cycle_schedule_cycling_betas() -> None:
    ref = check_all_modes(OneCycleLM, max_steps=8)
    assert len(set(ref.rec.lrs)) > 4


class ChangeHyperparameters(L.Callback):
    """At epoch 1: weight decay and betas of the user's optimizer changed by hand, and the position embedding
    frozen (``requires_grad=False``: no gradient, so AdamW leaves it alone from then on)."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            for group in trainer.optimizers[0].param_groups:
                group["weight_decay"] = 0.5
                group["betas"] = (0.8, 0.99)
            pl_module.net.wpe.weight.requires_grad_(False)


def test_hyperparameters_and_freezing_changed_by_a_callback() -> None:
    ref = check_all_modes(
        TinyLM, modes=("pipeline", "auto"), max_steps=-1, max_epochs=2, callbacks=(ChangeHyperparameters(),)
    )
    assert len(ref.losses) == 12


class FreezeAtEpoch1(L.Callback):
    """``requires_grad_(False)`` on the position embedding at the start of epoch 1 (a mid-run freeze)."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            pl_module.net.wpe.weight.requires_grad_(False)


def test_freezing_in_a_callback_next_forward() -> None:
    check_all_modes(TinyLM, modes=("next_forward",), max_steps=-1, max_epochs=2, callbacks=(FreezeAtEpoch1(),))


class ClampAfterStepLM(TinyLM):
    """WGAN-style weight clipping: ``optimizer_step`` steps, then clamps every weight in place (32-true)."""

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        with torch.no_grad():
            for p in self.parameters():
                p.clamp_(-0.05, 0.05)


def test_weights_clamped_after_the_step_32_true() -> None:
    """The clamp is part of the arithmetic: the next step must start from the clamped weights, on the host
    optimizer's side too."""
    ref = check_all_modes(ClampAfterStepLM, modes=("pipeline", "auto"), max_steps=5)
    assert all(float(p.detach().abs().max()) <= float(torch.tensor(0.05)) for p in ref.module.parameters())


def test_weights_clamped_after_the_step_next_forward() -> None:
    """Under ``next_forward`` the step's tail still runs when ``optimizer.step()`` returns, so the clamp (a write
    outside any module's forward) waits for each family's step first ([Note: a read that waits] in
    runtime/parked.py): the serial step's bits."""
    check_all_modes(ClampAfterStepLM, modes=("next_forward",), max_steps=5)


# ---- a no-grad forward of the same net inside the training step; Trainer switches around the loop ----------------


class SelfDistillLM(TinyLM):
    """Each training step first runs the net under ``torch.no_grad()`` on the shifted batch (a target), then with
    grad: loss = next-token cross entropy + 0.5 * MSE to the no-grad logits."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            target = self(y)
        logits = self(x)
        return lm_loss(logits, y) + 0.5 * torch.nn.functional.mse_loss(logits, target)


@pytest.mark.parametrize("budget", ["unlimited", "evicting"])
def test_no_grad_forward_inside_the_training_step(budget: str) -> None:
    peek = ReportPeek()
    check_all_modes(
        SelfDistillLM,
        max_steps=5,
        accumulate_grad_batches=2,
        callbacks=(peek,),
        strategy_options=BUDGET if budget == "evicting" else None,
    )
    if budget == "evicting":
        assert peek.report is not None and peek.report.evictions > 0


@pytest.mark.parametrize("switch", ["deterministic", "simple-profiler"])
def test_trainer_switches_around_the_loop(switch: str) -> None:
    """``deterministic=True`` (torch's deterministic algorithms) and Lightning's SimpleProfiler around every hook."""
    kwargs: dict[str, Any] = {"deterministic": True} if switch == "deterministic" else {"profiler": "simple"}
    check_all_modes(TinyLM, val=val_loader(), limit_val_batches=2, max_steps=-1, max_epochs=1, **kwargs)


@pytest.mark.parametrize(
    "debug",
    [{"fast_dev_run": 3}, {"overfit_batches": 2, "max_epochs": 3}, {"limit_train_batches": 0.34, "max_epochs": 3}],
    ids=["fast-dev-run-3", "overfit-2-batches", "a-third-of-the-batches"],
)
def test_debugging_switches(debug: dict[str, Any]) -> None:
    """Lightning's debugging runs: ``fast_dev_run`` (a few batches of training and validation, no limits asked),
    ``overfit_batches`` (the same first batches every epoch, validated on too) and a float batch limit."""
    ref = check_all_modes(TinyLM, val=val_loader(), max_steps=-1, **debug)
    assert ref.val.losses and ref.losses


class AdamStateReader(L.Callback):
    """Reads the Adam moment of one parameter through ``optimizer.state[param]`` at every batch end (as a monitor of
    optimizer states would), and the same through ``optimizer.state_dict()``."""

    def __init__(self) -> None:
        self.by_param: list[float | None] = []
        self.by_state_dict: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        opt = pl_module.optimizers().optimizer
        entry = opt.state[pl_module.net.wpe.weight]
        self.by_param.append(float(entry["exp_avg"].norm()) if "exp_avg" in entry else None)
        self.by_state_dict.append(float(opt.state_dict()["state"][1]["exp_avg"].norm()))


def test_adam_state_read_through_optimizer_state_during_training() -> None:
    """A monitor reading Adam moments: ``optimizer.state_dict()`` gives plain Lightning's values; ``optimizer.state[p]``
    (torch's mapping, empty here: the states live in chunks) is refused with a HINT to ``state_dict()`` (it was
    silently an empty dict)."""
    plain = AdamStateReader()
    run(TinyLM(), None, max_steps=3, callbacks=(plain,))
    assert None not in plain.by_param
    with pytest.raises(RuntimeError, match=r"optimizer.state_dict\(\)"):
        run(TinyLM(), "off", max_steps=3, callbacks=(AdamStateReader(),))
    by_state_dict = StateDictReader()
    run(TinyLM(), "off", max_steps=3, callbacks=(by_state_dict,))
    torch.testing.assert_close(by_state_dict.values, plain.by_state_dict, rtol=1e-5, atol=0)


class StateDictReader(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        opt = pl_module.optimizers().optimizer
        self.values.append(float(opt.state_dict()["state"][1]["exp_avg"].norm()))


def test_weights_only_checkpoints(tmp_path: Path) -> None:
    """``ModelCheckpoint(save_weights_only=True)``: the file holds plain Lightning's weights (loadable by
    ``load_from_checkpoint``), and resuming a fit from it is refused as plain Lightning refuses it, before training."""
    saved = {}
    for name, mode in (("plain", None), ("pipeline", "pipeline")):
        folder = tmp_path / name
        cb = ModelCheckpoint(dirpath=folder, save_weights_only=True, every_n_train_steps=2, save_top_k=-1)
        run(TinyLM(), mode, max_steps=4, enable_checkpointing=True, callbacks=(cb,))
        saved[name] = sorted(p.name for p in folder.glob("*.ckpt"))
        assert saved[name] == saved["plain"]
        for file in saved[name]:
            ckpt = torch.load(folder / file, weights_only=False)
            assert "optimizer_states" not in ckpt
            loaded = TinyLM.load_from_checkpoint(folder / file)
            plain = TinyLM.load_from_checkpoint(tmp_path / "plain" / file)
            assert_states_close(loaded.state_dict(), plain.state_dict(), what=f"{name}: {file}", atol=WEIGHT_ATOL)
    last = tmp_path / "plain" / saved["plain"][-1]
    errors = {}
    for name, mode in (("plain", None), ("pipeline", "pipeline")):
        rec = LossRecorder()
        trainer = make_trainer(strategy=strategy_for(mode), max_steps=6, callbacks=[rec])
        with pytest.raises(KeyError, match="contains only the model") as err:
            trainer.fit(TinyLM(), train_dataloaders=make_loader(n_seq=24), ckpt_path=str(last))
        errors[name] = err.value
        assert rec.losses == [], f"{name}: trained before refusing"
    assert type(errors["pipeline"]) is type(errors["plain"]), errors
