"""Adversarial LightningModule hooks and Trainer loops, round two: overrides of ``optimizer_step``, ``backward`` and
``configure_gradient_clipping``, gradient-editing hooks, unusual ``training_step`` returns, and Trainer flags and
callbacks the earlier rounds did not run (``barebones``, ``ModelSummary``, ``ModelPruning``, ``ThroughputMonitor``).

Every scenario runs the same LightningModule twice or more: ``strategy="auto"`` (the reference nobody here tuned)
and ``strategy="patrickstar"`` with the optimizer on the host, same seed and data. 32-true must give plain
Lightning's losses, logged values and final weights (within 3e-7 relative on losses); ``optimizer_overlap`` modes
must give the serial step's bits; a pattern the engine cannot support must raise naming it.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelPruning, ModelSummary, ThroughputMonitor
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.runtime.grad_guard import GradientsInChunksError
from tests.helpers import assert_states_close, assert_states_equal
from tests.helpers.data import make_loader
from tests.helpers.models import TinyGPT, lm_loss
from tests.helpers.runs import make_trainer

RTOL = 3e-7  # 32-true losses against plain Lightning
WEIGHT_ATOL = 1e-5  # final weights: Adam divides near-zero gradients by their own size
HOST = {"optimizer_placement": "host", "chunk_size": 4096}


def strategy_for(mode: str | None, **options: Any) -> Any:
    """Plain Lightning (``None``) or PatrickStar with the optimizer on the host and ``optimizer_overlap=mode``."""
    if mode is None:
        return "auto"
    return PatrickStarStrategy(optimizer_overlap=mode, **{**HOST, **options})


class MetricsLogger(Logger):
    """Keeps every ``log_metrics`` call in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "mem"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, dict(metrics)))


class Outputs(L.Callback):
    """The ``outputs`` of every training batch (tensors as floats), as Lightning passes them to callbacks."""

    def __init__(self) -> None:
        self.outputs: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.outputs.append({k: float(v) for k, v in (outputs or {}).items()})


class FinalState(L.Callback):
    """The consolidated model state at the end of training (what a checkpoint stores), fp32 on CPU."""

    def __init__(self) -> None:
        self.final_state: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        state = trainer.strategy.lightning_module_state_dict()
        self.final_state = {k: v.detach().float().cpu().clone() for k, v in state.items() if not v.is_meta}


class Run:
    def __init__(self, module: L.LightningModule, trainer: L.Trainer, rec: FinalState, out: Outputs) -> None:
        self.module, self.trainer, self.rec, self.out = module, trainer, rec, out

    @property
    def losses(self) -> list[float]:
        return [o["loss"] for o in self.out.outputs if "loss" in o]

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
    callbacks: tuple[L.Callback, ...] = (),
    n_seq: int = 24,
    strategy_options: dict[str, Any] | None = None,
    **trainer_kwargs: Any,
) -> Run:
    """Fit ``module`` under plain Lightning (``mode=None``) or PatrickStar; 6 steps unless told."""
    rec, out = FinalState(), Outputs()
    trainer_kwargs.setdefault("max_steps", 6)
    trainer = make_trainer(
        strategy=strategy_for(mode, **(strategy_options or {})), callbacks=[rec, out, *callbacks], **trainer_kwargs
    )
    trainer.fit(module, train_dataloaders=make_loader(n_seq=n_seq))
    return Run(module, trainer, rec, out)


def assert_like_plain(got: Run, ref: Run, what: str) -> None:
    """The same outputs keys per batch, losses and other outputs within RTOL, steps and final weights close."""
    assert len(got.out.outputs) == len(ref.out.outputs) > 0, f"{what}: {len(got.out.outputs)} vs {len(ref.out.outputs)}"
    for i, (a, b) in enumerate(zip(got.out.outputs, ref.out.outputs, strict=True)):
        assert sorted(a) == sorted(b), f"{what}: batch {i}: outputs keys {sorted(a)} vs plain {sorted(b)}"
        for k in b:
            assert abs(a[k] - b[k]) <= RTOL * abs(b[k]) + 1e-12, f"{what}: batch {i}: {k} {a[k]!r} vs plain {b[k]!r}"
    assert got.trainer.global_step == ref.trainer.global_step, f"{what}: global_step"
    assert_states_close(got.final, ref.final, what=what, atol=WEIGHT_ATOL)


def assert_bitwise(got: Run, ref: Run, what: str) -> None:
    assert got.out.outputs == ref.out.outputs, f"{what}: outputs differ"
    assert_states_equal(got.final, ref.final, what=f"{what}: weights")
    assert_states_equal(got.optim(), ref.optim(), what=f"{what}: optimizer states")


def check(make: Any, *, modes: tuple[str, ...] = ("pipeline",), **kwargs: Any) -> Run:
    """Plain Lightning, then the serial step (like plain) and ``modes`` (bitwise the serial step)."""
    ref = run(make(), None, **kwargs)
    serial = run(make(), "off", **kwargs)
    assert_like_plain(serial, ref, "optimizer_overlap='off' against plain Lightning")
    for mode in modes:
        assert_bitwise(run(make(), mode, **kwargs), serial, f"optimizer_overlap={mode!r} against 'off'")
    return ref


class TinyLM(L.LightningModule):
    """:class:`TinyGPT` under fused AdamW (or fused SGD with momentum, where a gradient's scale shows)."""

    def __init__(self, optim: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.net = TinyGPT()
        self.optim = optim

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return lm_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optim == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=True)


# ---- optimizer_step overrides ------------------------------------------------------------------------------------


class ClosureFirstLM(TinyLM):
    """``optimizer_step`` runs the closure itself, then ``optimizer.step()`` without it (Lightning passes a
    do-nothing closure to the precision plugin then)."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer_closure()
        optimizer.step()


class WarmupInOptimizerStepLM(TinyLM):
    """Lightning's documented learning-rate warm-up in ``optimizer_step``: the lr set before each step."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        scale = min(1.0, (self.trainer.global_step + 1) / 4)
        for group in optimizer.param_groups:
            group["lr"] = scale * 3e-3
        optimizer.step(closure=optimizer_closure)


class ClosureTwiceLM(TinyLM):
    """``optimizer_step`` runs the closure, then steps with it (a second forward and backward, zeroed first)."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer_closure()
        optimizer.step(closure=optimizer_closure)


class ZeroBeforeStepLM(TinyLM):
    """``optimizer_step`` runs the closure, then on batch 2 drops the gradients (``zero_grad()``) before stepping:
    torch steps no parameter then."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer_closure()
        if batch_idx == 2:
            optimizer.zero_grad()
        optimizer.step()


class ClosureFirstSGDLM(ClosureFirstLM):
    """:class:`ClosureFirstLM` under SGD (Lightning clips inside the do-nothing closure of ``optimizer.step()``)."""

    def __init__(self) -> None:
        super().__init__("sgd")


class RawStepLM(TinyLM):
    """``optimizer_step`` runs the closure, then steps the optimizer under Lightning's wrapper
    (``optimizer.optimizer.step()``, bypassing the precision plugin)."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer_closure()
        optimizer.optimizer.step()


class SkipWindowLM(TinyLM):
    """With ``accumulate_grad_batches=2``, ``optimizer_step`` only runs the closure for the second window (its summed
    gradients are dropped by the next window's ``zero_grad``)."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if batch_idx // 2 == 1:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)


class UsersOwnReferenceStepLM(TinyLM):
    """``optimizer_step`` steps the optimizer object ``configure_optimizers`` created, kept in an attribute."""

    def configure_optimizers(self) -> Any:
        self.own = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
        return self.own

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer_closure()
        self.own.step()


def test_stepping_the_users_own_optimizer_reference_is_refused_naming_it() -> None:
    run(UsersOwnReferenceStepLM(), None, max_steps=2)
    with pytest.raises(RuntimeError, match=r"configure_optimizers returned.*HINT"):
        run(UsersOwnReferenceStepLM(), "off", max_steps=2)


class StopMidWindowLM(TinyLM):
    """``on_train_batch_start`` returns -1 at batch 4 of epoch 0, inside an accumulation window of 3 (the window's
    gradient is never stepped; the next epoch's first batch zeroes it)."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        if self.trainer.current_epoch == 0 and batch_idx == 4:
            return -1
        return None


OPTIMIZER_STEPS = {
    "closure-twice": ClosureTwiceLM,
    "raw-optimizer-step": RawStepLM,
    "zero-grad-before-step-on-batch-2": ZeroBeforeStepLM,
    "closure-first": ClosureFirstLM,
    "warmup": WarmupInOptimizerStepLM,
}


@pytest.mark.parametrize("case", list(OPTIMIZER_STEPS))
def test_optimizer_step_overrides(case: str) -> None:
    check(OPTIMIZER_STEPS[case], modes=("pipeline", "next_forward"), max_steps=-1, max_epochs=1)


class StepTwiceLM(TinyLM):
    """``optimizer_step`` steps twice per batch: plain torch applies the same gradients twice."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        optimizer.step(closure=optimizer_closure)
        optimizer.step()


@pytest.mark.parametrize("mode", ["off", "pipeline"])
def test_optimizer_stepped_twice_per_batch(mode: str) -> None:
    """Plain Lightning steps twice with the same gradients; PatrickStar must do the same or refuse the second step
    naming it (gradients end with the step), never step once silently."""
    ref = run(StepTwiceLM(), None, max_steps=3)
    once = run(TinyLM(), None, max_steps=3)
    assert not torch.equal(ref.final["net.lm_head.weight"], once.final["net.lm_head.weight"])
    try:
        got = run(StepTwiceLM(), mode, max_steps=3)
    except RuntimeError as error:
        assert "zero_grad" in str(error), error
        return
    assert_like_plain(got, ref, "stepped twice")


class ManualAccumulationLM(TinyLM):
    """Gradient accumulation written by hand in automatic optimization (``accumulate_grad_batches=1``): zero only at
    the start of a window of 3 batches, step only at its end (the closure alone runs the other batches)."""

    WINDOW = 3

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        if batch_idx % self.WINDOW == 0:
            optimizer.zero_grad()

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if batch_idx % self.WINDOW == self.WINDOW - 1:
            optimizer.step(closure=optimizer_closure)
        else:
            optimizer_closure()


def test_manual_accumulation_through_hook_overrides() -> None:
    """Plain torch sums the window's gradients in ``p.grad`` and steps once per window. PatrickStar (planned for no
    accumulation, free to step inside the backward) must give the same, or refuse naming it."""
    kwargs: dict[str, Any] = {"max_steps": -1, "max_epochs": 1}
    ref = run(ManualAccumulationLM(), None, **kwargs)
    no_accum = run(TinyLM(), None, **kwargs)
    assert abs(ref.losses[-1] - no_accum.losses[-1]) > 1e-3
    for mode in ("off", "pipeline", "next_forward"):
        try:
            got = run(ManualAccumulationLM(), mode, **kwargs)
        except RuntimeError as error:
            assert "zero_grad" in str(error) and "HINT" in str(error), error
            continue
        assert_like_plain(got, ref, f"manual accumulation, {mode}")


# ---- backward and clipping overrides -----------------------------------------------------------------------------


class ScaledBackwardLM(TinyLM):
    """``backward`` scales the loss by 3 (SGD, so the scale shows) and keeps the graph (``retain_graph=True``)."""

    def __init__(self) -> None:
        super().__init__("sgd")

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        (3.0 * loss).backward(retain_graph=True)


class TwoBackwardsLM(TinyLM):
    """``backward`` runs the backward twice on the same graph (``retain_graph=True`` first): gradients doubled; SGD."""

    def __init__(self) -> None:
        super().__init__("sgd")

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(retain_graph=True)
        loss.backward()


class EpochSchedulerLM(TinyLM):
    """A StepLR stepped at every 2nd epoch end (``interval="epoch"``, ``frequency=2``), returned as lists of dicts."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, fused=True)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.3)
        return [opt], [{"scheduler": sched, "interval": "epoch", "frequency": 2}]


class BranchLM(TinyLM):
    """An auxiliary head used on even batches only (no gradient on odd ones: torch skips it, weight decay too)."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = torch.nn.Linear(32, 32)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = lm_loss(self(x), y)
        if batch_idx % 2 == 0:
            loss = loss + 0.1 * self.aux(self.net.wte(x)).pow(2).mean()
        return loss


class ClipLaterLM(TinyLM):
    """``configure_gradient_clipping`` clips by norm only from step 3 on (no clipping before); SGD."""

    def __init__(self) -> None:
        super().__init__("sgd")

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        if self.trainer.global_step >= 3:
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


class ClipEveryOtherStepLM(TinyLM):
    """``configure_gradient_clipping`` passes the Trainer's clipping on only on odd steps (none on even ones); SGD."""

    def __init__(self) -> None:
        super().__init__("sgd")

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        if self.trainer.global_step % 2 == 1:
            self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val, **kwargs)


class SometimesNoBackwardLM(TinyLM):
    """``backward`` does nothing on batch 2 (the step then has no gradient: torch skips every parameter)."""

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.trainer.fit_loop.epoch_loop.batch_idx != 2:
            loss.backward()


class BackwardInputsLM(TinyLM):
    """``backward`` with ``inputs=``: only the blocks' parameters get gradients (the embeddings, head and final norm
    none, so torch never steps them)."""

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(inputs=list(self.net.blocks.parameters()))


class NoneWithClippingLM(TinyLM):
    """``training_step`` returns None on batches 1 and 4, under clipping by norm."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 3 == 1 else loss


class ShrinkBeforeStepLM(TinyLM):
    """``on_before_optimizer_step`` writes weights in place (a manual decay of ``wpe``, a clamp of one Linear)."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        with torch.no_grad():
            self.net.wpe.weight.mul_(0.5)
            self.net.blocks[0].mlp.fc.weight.clamp_(-0.05, 0.05)


class OddLossesLM(TinyLM):
    """Losses of unusual form: zero (``loss * 0``, a step with all-zero gradients) on batch 2, float64 on batch 3,
    shape ``[1]`` on batch 4."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 2:
            return loss * 0.0
        if batch_idx == 3:
            return loss.double()
        if batch_idx == 4:
            return loss.reshape(1)
        return loss


class ForwardAfterStepLM(TinyLM):
    """``on_train_batch_end`` runs the model again under ``no_grad`` on the batch (the loss after the step) and keeps
    it: a forward between the step and the next training step."""

    def __init__(self) -> None:
        super().__init__()
        self.after: list[float] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.after.append(float(lm_loss(self(batch[0]), batch[1])))


class GlobalStepLossLM(TinyLM):
    """The loss depends on ``self.global_step`` (a curriculum weight), and logs it; SGD."""

    def __init__(self) -> None:
        super().__init__("sgd")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        weight = 1.0 / (1 + self.global_step)
        self.log("weight", weight)
        return weight * lm_loss(self(x), y)


class ClipGradientsLM(TinyLM):
    """``configure_gradient_clipping`` calls ``self.clip_gradients`` by value on even steps and by norm on odd ones
    (tight values so clipping bites); SGD."""

    def __init__(self) -> None:
        super().__init__("sgd")

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        if self.trainer.global_step % 2 == 0:
            self.clip_gradients(optimizer, gradient_clip_val=0.002, gradient_clip_algorithm="value")
        else:
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


class ClipTwiceLM(TinyLM):
    """``configure_gradient_clipping`` calls ``self.clip_gradients`` twice in one step (``clips``: algorithm and value
    in call order); SGD. Plain torch applies them one after the other, each to what the one before left."""

    clips: tuple[tuple[str, float], ...] = ()

    def __init__(self) -> None:
        super().__init__("sgd")

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
        for algorithm, value in self.clips:
            self.clip_gradients(optimizer, gradient_clip_val=value, gradient_clip_algorithm=algorithm)


CLIP_TWICE = {
    "norm-then-value": (("norm", 0.05), ("value", 0.002)),
    "value-then-norm": (("value", 0.002), ("norm", 0.05)),
    "norm-tight-then-norm-loose": (("norm", 0.01), ("norm", 0.05)),
    "value-twice": (("value", 0.002), ("value", 0.004)),  # clamping twice is one clamp to the tighter bound
}


@pytest.mark.parametrize("case", ["norm-then-value", "value-then-norm", "norm-tight-then-norm-loose", "value-twice"])
def test_clip_gradients_twice_in_one_step(case: str) -> None:
    """Plain Lightning's result, or a refusal naming the second ``clip_gradients`` call."""

    class Clips(ClipTwiceLM):
        clips = CLIP_TWICE[case]

    ref = run(Clips(), None, max_steps=4)
    single = type("Single", (ClipTwiceLM,), {"clips": CLIP_TWICE[case][-1:]})
    assert not torch.equal(run(single(), None, max_steps=4).final["net.wpe.weight"], ref.final["net.wpe.weight"])
    for mode in ("off", "pipeline"):
        try:
            got = run(Clips(), mode, max_steps=4)
        except RuntimeError as error:
            assert "clip_gradients" in str(error), error
            continue
        assert_like_plain(got, ref, f"{case}, {mode}")


class ClipMidWindowLM(TinyLM):
    """Manual optimization accumulating two batches per step, ``self.clip_gradients`` (by norm) called after the first
    batch's backward: plain torch clips that batch's gradients then, and the second batch's are added unclipped."""

    def __init__(self) -> None:
        super().__init__("sgd")
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        loss = lm_loss(self(x), y)
        self.manual_backward(loss)
        if batch_idx % 2 == 0:
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        else:
            opt.step()
            opt.zero_grad()
        return loss.detach()


def test_clip_gradients_inside_a_manual_accumulation_window() -> None:
    """Plain Lightning's result, or a refusal naming ``clip_gradients`` (the engine applies a clip at the next step, to
    every gradient summed by then)."""
    ref = run(ClipMidWindowLM(), None, max_steps=-1, max_epochs=1)
    try:
        got = run(ClipMidWindowLM(), "off", max_steps=-1, max_epochs=1)
    except RuntimeError as error:
        assert "clip_gradients" in str(error), error
        return
    assert_like_plain(got, ref, "clip_gradients inside an accumulation window")


class DictOutputsLM(TinyLM):
    """``training_step`` returns a dict with extra keys (a detached accuracy and a logits statistic)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = self(x)
        acc = (logits.argmax(-1) == y).float().mean()
        return {"loss": lm_loss(logits, y), "acc": acc, "logit_mean": logits.detach().mean()}


HOOK_CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "scaled-backward-retain-graph": (ScaledBackwardLM, {}),
    "loss-weighted-by-global-step": (GlobalStepLossLM, {}),
    "clip-gradients-value-and-norm": (ClipGradientsLM, {}),
    "dict-with-extra-keys": (DictOutputsLM, {}),
    "two-backwards-per-step": (TwoBackwardsLM, {}),
    "epoch-scheduler-every-2nd-epoch": (EpochSchedulerLM, {"max_epochs": 5, "n_seq": 8}),
    "branch-without-gradient-on-odd-batches": (BranchLM, {}),
    "clip-from-step-3-on": (ClipLaterLM, {"n_seq": 48}),
    "trainer-norm-clip-passed-on-every-2nd-step": (ClipEveryOtherStepLM, {"gradient_clip_val": 0.01}),
    "trainer-value-clip-passed-on-every-2nd-step": (
        ClipEveryOtherStepLM,
        {"gradient_clip_val": 0.0005, "gradient_clip_algorithm": "value"},
    ),
    "fast-dev-run-2-accumulate-2": (TinyLM, {"fast_dev_run": 2, "accumulate_grad_batches": 2}),
    "closure-first-trainer-norm-clip-accumulate-2": (
        ClosureFirstSGDLM,
        {"gradient_clip_val": 0.01, "accumulate_grad_batches": 2, "n_seq": 40},
    ),
    "backward-skipped-on-batch-2": (SometimesNoBackwardLM, {}),
    "backward-with-inputs": (BackwardInputsLM, {}),
    "weights-written-in-on_before_optimizer_step": (ShrinkBeforeStepLM, {}),
    "zero-float64-and-shape-1-losses": (OddLossesLM, {}),
    "closure-first-with-accumulation-3": (ClosureFirstLM, {"accumulate_grad_batches": 3, "max_epochs": 2}),
    "closure-only-for-a-whole-window": (SkipWindowLM, {"accumulate_grad_batches": 2, "n_seq": 32}),
    "epoch-ended-by-on_train_batch_start-inside-a-window": (
        StopMidWindowLM,
        {"accumulate_grad_batches": 3, "max_epochs": 2},
    ),
    "none-on-some-batches-with-norm-clipping": (NoneWithClippingLM, {"gradient_clip_val": 0.1}),
    "accumulate-2-over-5-batches": (TinyLM, {"accumulate_grad_batches": 2, "n_seq": 20, "max_epochs": 2}),
}


@pytest.mark.parametrize("case", list(HOOK_CASES))
def test_hook_overrides_match_plain(case: str) -> None:
    make, kwargs = HOOK_CASES[case]
    kwargs = {"max_steps": -1, "max_epochs": 1, **kwargs}
    check(make, modes=("pipeline", "next_forward"), **kwargs)


def test_forward_after_the_step_in_on_train_batch_end() -> None:
    """The losses measured after each step in ``on_train_batch_end`` are plain Lightning's, in every overlap mode
    (``next_forward`` lets the step's tail run into that forward)."""
    ref = run(ForwardAfterStepLM(), None)
    serial = run(ForwardAfterStepLM(), "off")
    assert_like_plain(serial, ref, "off")
    torch.testing.assert_close(serial.module.after, ref.module.after, rtol=RTOL, atol=0)
    for mode in ("pipeline", "next_forward"):
        got = run(ForwardAfterStepLM(), mode)
        assert_bitwise(got, serial, mode)
        assert got.module.after == serial.module.after, mode


BF16_CASES = {
    "closure-first": ClosureFirstLM,
    "scaled-backward": ScaledBackwardLM,
    "clip-gradients": ClipGradientsLM,
    "manual-accumulation": ManualAccumulationLM,
    "backward-with-inputs": BackwardInputsLM,
    "weights-written-before-step": ShrinkBeforeStepLM,
    "zero-grad-before-step": ZeroBeforeStepLM,
    "forward-after-step": ForwardAfterStepLM,
    "raw-optimizer-step": RawStepLM,
}


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_hook_overrides_bf16_mixed_overlap_modes_bitwise(case: str) -> None:
    """bf16-mixed: the serial step and the default overlap give the same bits."""
    make = BF16_CASES[case]
    serial = run(make(), "off", max_steps=6, precision="bf16-mixed")
    auto = run(make(), "auto", max_steps=6, precision="bf16-mixed")
    assert_bitwise(auto, serial, f"bf16-mixed {case}: auto against off")


# ---- gradient-editing hooks --------------------------------------------------------------------------------------


class HalveInAfterBackwardLM(TinyLM):
    """``on_after_backward`` halves every gradient (``p.grad.mul_(0.5)``); SGD so it shows."""

    def __init__(self) -> None:
        super().__init__("sgd")

    def on_after_backward(self) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)


class NoiseInBeforeStepLM(TinyLM):
    """``on_before_optimizer_step`` adds seeded Gaussian noise to every gradient."""

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        gen = torch.Generator().manual_seed(self.trainer.global_step)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.add_(1e-3 * torch.randn(p.grad.shape, generator=gen))


class LogGradInAfterBackwardLM(TinyLM):
    """``on_after_backward`` logs the gradient norm of the head (reads ``p.grad``); SGD."""

    def __init__(self) -> None:
        super().__init__("sgd")

    def on_after_backward(self) -> None:
        self.log("head_grad", self.net.lm_head.weight.grad.norm())


@pytest.mark.parametrize(
    "make",
    [HalveInAfterBackwardLM, NoiseInBeforeStepLM, LogGradInAfterBackwardLM],
    ids=["halve", "noise", "read-and-log"],
)
def test_gradient_edits_in_hooks_are_refused(make: Any) -> None:
    """Plain Lightning edits the gradients; PatrickStar keeps them in chunks and must refuse the edit naming the
    parameter (a silently ignored edit would be a silent wrong result)."""
    plain = run(make(), None, max_steps=3)
    untouched = run(TinyLM(make().optim), None, max_steps=3)
    if make is not LogGradInAfterBackwardLM:
        assert not torch.equal(plain.final["net.lm_head.weight"], untouched.final["net.lm_head.weight"])
    with pytest.raises(GradientsInChunksError, match=r"net\."):
        run(make(), "off", max_steps=3)


class GradNormAfterStep(L.Callback):
    """Records the global gradient norm (over the parameters whose ``p.grad`` is not None, as monitoring code
    guards it) in ``on_train_batch_end`` or ``on_train_epoch_end``: after the step, before the next ``zero_grad``,
    where plain torch still holds the step's gradients."""

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self.norms: list[float | None] = []

    def _read(self, pl_module: Any) -> None:
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.stack([g.norm() for g in grads]).norm()) if grads else None)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if self.hook == "on_train_batch_end":
            self._read(pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.hook == "on_train_epoch_end":
            self._read(pl_module)

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        if self.hook == "on_before_zero_grad" and trainer.global_step > 0:  # the last step's gradients, in torch
            self._read(pl_module)


@pytest.mark.parametrize("hook", ["on_train_batch_end", "on_before_zero_grad", "on_train_epoch_end"])
def test_gradients_read_after_the_step(hook: str) -> None:
    """Plain torch keeps the step's gradients in ``p.grad`` until the next ``zero_grad``: a callback logging their norm
    after the step gets numbers. PatrickStar must give the same numbers or refuse naming the parameter, never None."""
    plain = GradNormAfterStep(hook)
    run(TinyLM(), None, max_steps=-1, max_epochs=1, callbacks=(plain,))
    assert plain.norms and None not in plain.norms
    got = GradNormAfterStep(hook)
    try:
        run(TinyLM(), "off", max_steps=-1, max_epochs=1, callbacks=(got,))
    except GradientsInChunksError as error:
        assert "net." in str(error)
        return
    torch.testing.assert_close(got.norms, plain.norms, rtol=1e-5, atol=0)


# ---- Trainer flags and callbacks ---------------------------------------------------------------------------------


def test_barebones() -> None:
    check(TinyLM, max_steps=5, barebones=True, enable_progress_bar=False, logger=False, enable_checkpointing=False)


class SummaryRecorder(L.Callback):
    """The model summary taken at fit start, by depth 2, as ModelSummary(max_depth=2) prints it."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int]] = []
        self.totals: tuple[int, int] = (0, 0)

    def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        summary = Summary(pl_module, max_depth=2)
        self.rows = list(zip(summary.layer_names, summary.param_nums, strict=True))
        self.totals = (summary.total_parameters, summary.trainable_parameters)


def test_model_summary_counts_like_plain() -> None:
    """``ModelSummary(max_depth=2)`` (and the summary it prints at fit start): the same parameter counts."""
    ref_rec, got_rec = SummaryRecorder(), SummaryRecorder()
    run(TinyLM(), None, max_steps=1, callbacks=(ModelSummary(max_depth=2), ref_rec), enable_model_summary=True)
    run(TinyLM(), "off", max_steps=1, callbacks=(ModelSummary(max_depth=2), got_rec), enable_model_summary=True)
    assert ref_rec.totals[0] > 0
    assert got_rec.totals == ref_rec.totals, f"totals {got_rec.totals} vs plain {ref_rec.totals}"
    assert got_rec.rows == ref_rec.rows


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_model_summary_counts_with_meta_init(precision: str) -> None:
    """The model built in ``configure_model`` (on the meta device under PatrickStar, materialised into chunks): the
    summary at fit start counts plain Lightning's parameters."""
    from tests.helpers.runs import TinyLM as MetaLM

    recs = {}
    for name, mode in (("plain", None), ("off", "off")):
        recs[name] = SummaryRecorder()
        run(
            MetaLM(meta_init=True),
            mode,
            max_steps=1,
            precision=precision,
            callbacks=(ModelSummary(max_depth=2), recs[name]),
            enable_model_summary=True,
        )
    assert recs["plain"].totals[0] > 0
    assert recs["off"].totals == recs["plain"].totals
    assert recs["off"].rows == recs["plain"].rows


class GroupsOneCycleLM(TinyLM):
    """Two param groups (weight decay 0.2 and torch's default), OneCycleLR cycling beta1."""

    def configure_optimizers(self) -> Any:
        blocks = list(self.net.blocks.parameters())
        rest = [p for n, p in self.net.named_parameters() if "blocks" not in n and p.requires_grad]
        opt = torch.optim.AdamW(
            [{"params": blocks, "weight_decay": 0.2}, {"params": rest}], lr=3e-3, betas=(0.85, 0.99), fused=True
        )
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_learning_rate_monitor_momentum_and_weight_decay() -> None:
    """``LearningRateMonitor(log_momentum=True, log_weight_decay=True)`` logs plain Lightning's values per group."""
    logs = {}
    for name, mode in (("plain", None), ("off", "off")):
        logger = MetricsLogger()
        monitor = LearningRateMonitor(logging_interval="step", log_momentum=True, log_weight_decay=True)
        run(GroupsOneCycleLM(), mode, max_steps=4, logger=logger, log_every_n_steps=1, callbacks=(monitor,))
        logs[name] = logger.records
    assert any("lr-AdamW/pg2-momentum" in m for _, m in logs["plain"])
    assert logs["off"] == logs["plain"]


def test_throughput_monitor_logs_like_plain() -> None:
    """``ThroughputMonitor``: the same metric names and sample/batch counts (times differ)."""
    logs = {}
    for name, mode in (("plain", None), ("off", "off")):
        logger = MetricsLogger()
        run(
            TinyLM(),
            mode,
            max_steps=4,
            logger=logger,
            log_every_n_steps=1,
            callbacks=(ThroughputMonitor(batch_size_fn=lambda b: b[0].shape[0], window_size=2),),
        )
        logs[name] = logger.records
    counts = {
        name: [(s, {k: v for k, v in m.items() if k.endswith(("samples", "batches"))}) for s, m in recs]
        for name, recs in logs.items()
    }
    keys = {name: [sorted(m) for _, m in recs] for name, recs in logs.items()}
    assert counts["plain"] and keys["off"] == keys["plain"]
    assert counts["off"] == counts["plain"]


def test_model_pruning_supported_or_refused() -> None:
    """``ModelPruning`` re-parametrises weights (``weight_orig`` and a mask buffer, a forward pre-hook) at the end of
    each epoch: plain Lightning's result or a clear refusal naming pruning."""
    kwargs: dict[str, Any] = {"max_steps": -1, "max_epochs": 2}

    def pruning() -> ModelPruning:
        return ModelPruning("l1_unstructured", amount=0.3, use_global_unstructured=False, verbose=0)

    ref = run(TinyLM(), None, callbacks=(pruning(),), **kwargs)
    assert any(k.endswith("weight_mask") for k in ref.final), "plain Lightning pruned nothing"
    assert float((ref.module.net.lm_head.weight == 0).float().mean()) > 0.2
    try:
        got = run(TinyLM(), "off", callbacks=(pruning(),), **kwargs)
    except Exception as error:  # a refusal must name it
        assert "prun" in str(error).lower() or "weight_orig" in str(error), repr(error)
        return
    assert_like_plain(got, ref, "ModelPruning")  # pragma: no cover
    got_state = dict(got.module.state_dict())
    ref_state = dict(ref.module.state_dict())
    assert sorted(got_state) == sorted(ref_state)
    for k, v in ref_state.items():
        torch.testing.assert_close(got_state[k].float(), v.float(), atol=WEIGHT_ATOL, rtol=1e-5, msg=k)


class CollectivesLM(TinyLM):
    """``training_step`` uses the strategy's collectives at one rank (``all_gather``, ``broadcast``, ``reduce``,
    ``barrier``) and logs with ``sync_dist=True`` on step and epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[Any, ...]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        gathered = self.all_gather(loss.detach())
        sent = self.trainer.strategy.broadcast({"batch": batch_idx})
        reduced = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        self.trainer.strategy.barrier("hooks2")
        self.seen.append((tuple(gathered.shape), float(gathered), sent, float(reduced)))
        self.log("synced", loss, sync_dist=True, on_step=True, on_epoch=True)
        return loss


def test_collectives_and_sync_dist_logging_at_one_rank() -> None:
    results = {}
    for name, mode in (("plain", None), ("off", "off")):
        logger = MetricsLogger()
        got = run(CollectivesLM(), mode, max_steps=3, logger=logger, log_every_n_steps=1)
        results[name] = (got.module.seen, logger.records)
    assert results["plain"][1]
    assert results["off"] == results["plain"]


def test_advanced_profiler(tmp_path: Any) -> None:
    """Lightning's AdvancedProfiler (cProfile around every hook and step), its report written under ``tmp_path``."""
    from lightning.pytorch.profilers import AdvancedProfiler

    check(TinyLM, max_steps=4, profiler=AdvancedProfiler(dirpath=tmp_path, filename="prof"))


EVICTING = {"placement": "static", "device_memory_limit": 3 * 4096 * 4}  # 3 chunks of 4096 fp32 elements


class AutocastIn32TrueLM(TinyLM):
    """32-true with the forward under the user's own ``torch.autocast(bfloat16)`` (autocast caches cast weights)."""

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = self(x)
        return lm_loss(logits.float(), y)


@pytest.mark.parametrize(
    "make",
    [TwoBackwardsLM, ClosureTwiceLM, ManualAccumulationLM, ForwardAfterStepLM, ShrinkBeforeStepLM, AutocastIn32TrueLM],
    ids=lambda m: m.__name__,
)
def test_hook_overrides_under_evictions(make: Any) -> None:
    """The same overrides with a device budget of three chunks (static placement, chunks evicted every iteration)."""
    ref = run(make(), None)
    serial = run(make(), "off", strategy_options=EVICTING)
    assert serial.trainer.strategy.memory_report().evictions > 0
    assert_like_plain(serial, ref, "evicting, off")
    assert_bitwise(run(make(), "pipeline", strategy_options=EVICTING), serial, "evicting, pipeline against off")


class ConvertAfterStep(L.Callback):
    """Casts and moves the module between its step and the next ``zero_grad`` (``nn.Module._apply`` converts each
    ``p.grad`` too: the stand-ins for the step's consumed gradients convert as well), then reads nothing."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        pl_module.to(torch.device("cpu"))
        pl_module.float()


def test_module_converted_between_the_step_and_zero_grad_matches_plain() -> None:
    """[Note: gradients user code cannot see]: after the step ``p.grad`` holds stand-ins; ``module.to(...)`` and
    ``module.float()`` there work (as in plain Lightning) and the run matches plain."""
    check(TinyLM, callbacks=(ConvertAfterStep(),))
