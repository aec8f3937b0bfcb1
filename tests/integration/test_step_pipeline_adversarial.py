"""Adversarial cross-feature runs of the offloaded step's newest paths, from outside, as a demanding user's loop
would drive them: gradient norms computed inside the backward ([Note: gradient norms inside the backward] in
``optim/overlap.py``) and the lanes a waiting caller lends with one intra-op thread ([Note: host lanes] in
``runtime/pipeline.py``).

Every scenario compares the pipelined schedule against the serial step (``optimizer_overlap="off"``, same seed and
data): losses, final weights and the user's optimizer states bit for bit; where the arithmetic allows, against plain
Lightning (32-true) too. The report's ``host_norms_in_backward`` says whether the norms path ran, so each test also
checks that it did (or, where something else may touch gradients, that it did not).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.config import LossScaleConfig
from lightning_pstar.precision import PatrickStarPrecision
from lightning_pstar.report import MemoryReport
from tests.helpers import assert_runs_bitwise, assert_states_close, assert_states_equal, optimizer_state
from tests.helpers.data import make_loader
from tests.helpers.models import TinyGPT
from tests.helpers.runs import LM, FitResult, fit, make_trainer
from tests.integration.test_activation_checkpointing import CheckpointedGPT

HOST = {"optimizer_placement": "host", "chunk_size": 4096}
STEPS = 5
RTOL = 3e-7  # 32-true losses against plain Lightning: the same fused kernels, summed in another order at most
WEIGHT_ATOL = 1e-5  # final weights against plain Lightning: Adam divides near-zero gradients by their own size


class Peek(L.Callback):
    """The memory report and the user's optimizer state at the end of training (while the engine still runs)."""

    report: MemoryReport | None = None
    families: int = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, PatrickStarStrategy):
            self.report = strategy.memory_report()
            manager = strategy._manager
            assert manager is not None
            self.families = sum(1 for f in manager.families if f.trainable)


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` for the block (None: as it is), restored in any case."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run(
    make: Callable[[], L.LightningModule],
    overlap: str | None,
    *,
    steps: int = STEPS,
    loader: DataLoader | None = None,
    options: dict[str, Any] | None = None,
    precision: str = "32-true",
    loss_scale: LossScaleConfig | None = None,
    **kwargs: Any,
) -> tuple[FitResult, Peek]:
    """One fit of ``make()``: PatrickStar with ``optimizer_overlap=overlap``, or plain Lightning (``None``)."""
    peek = Peek()
    strategy: Any = "auto"
    if overlap is not None:
        strategy = PatrickStarStrategy(optimizer_overlap=overlap, **{**HOST, **(options or {})})
    if precision == "16-mixed":  # on a CPU Lightning rewrites precision="16-mixed": pass the plugin
        kwargs["plugins"] = [PatrickStarPrecision("16-mixed", loss_scale=loss_scale)]
    callbacks = [peek, *kwargs.pop("callbacks", [])]
    result = fit(
        make(),
        strategy=strategy,
        loader=loader if loader is not None else make_loader(n_seq=4 * steps),
        precision=precision,
        max_steps=steps,
        callbacks=callbacks,
        **kwargs,
    )
    return result, peek


def _pair(
    make: Callable[[], L.LightningModule], mode: str = "pipeline", *, threads: int | None = None, **kwargs: Any
) -> tuple[FitResult, FitResult, MemoryReport, int]:
    """The serial step's run and ``mode``'s (with ``threads`` intra-op threads), bitwise equal. Returns both runs,
    the pipelined run's report and its trainable families."""
    with intra_op_threads(threads):
        serial, _ = _run(make, "off", **kwargs)
        piped, peek = _run(make, mode, **kwargs)
    assert_runs_bitwise(piped, serial, f"optimizer_overlap={mode!r} against 'off'")
    assert peek.report is not None
    return serial, piped, peek.report, peek.families


def _gpt() -> LM:
    return LM(lambda: TinyGPT())


# ---- clipping by norm with schedules, groups, accumulation ------------------------------------------------------


class TwoGroupLM(LM):
    """Two param groups (no decay on biases and norms, another lr) and a per-step cosine schedule."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())

    def configure_optimizers(self) -> Any:
        decay = [p for p in self.parameters() if p.requires_grad and p.ndim >= 2]
        rest = [p for p in self.parameters() if p.requires_grad and p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 1e-3}]
        optimizer = torch.optim.AdamW(groups, lr=3e-3, fused=True)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
def test_clip_schedule_groups_accumulation(mode: str) -> None:
    """Clipping by norm, a cosine schedule, two groups and ``accumulate_grad_batches=3``: the norms of the last
    micro-batch's backward only are taken inside it; the serial step's bits, plain Lightning's values."""
    loader = make_loader(n_seq=4 * 3 * STEPS)
    kwargs: dict[str, Any] = {"loader": loader, "gradient_clip_val": 0.05, "accumulate_grad_batches": 3}
    serial, _, report, families = _pair(TwoGroupLM, mode, **kwargs)
    assert len(set(serial.recorder.lrs)) > 2
    assert report.host_norms_in_backward == (STEPS - 1) * families > 0
    plain, _ = _run(TwoGroupLM, None, **kwargs)
    assert plain.recorder.lrs == serial.recorder.lrs
    for i, (a, b) in enumerate(zip(serial.losses, plain.losses, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"micro-batch {i}: patrickstar {a!r} vs plain Lightning {b!r}"
    assert_states_close(serial.final, plain.final, what="clip+schedule+groups+accumulation", atol=WEIGHT_ATOL)


class EpochClipLM(LM):
    """Clipping by norm chosen per epoch in ``configure_gradient_clipping`` (code the engine cannot see through)."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        value = 0.05 if self.current_epoch == 0 else 0.01
        self.clip_gradients(optimizer, gradient_clip_val=value, gradient_clip_algorithm="norm")


def test_clip_value_changed_per_epoch_does_not_arm() -> None:
    """A user's ``configure_gradient_clipping`` may do anything with the gradients: no norm inside the backward,
    the serial step's bits across epochs with different clip values."""
    loader = make_loader(n_seq=8)  # 2 batches an epoch: 3 epochs
    _, _, report, _ = _pair(EpochClipLM, loader=loader)
    assert report.host_norms_in_backward == 0


# ---- checkpoints and resumption ----------------------------------------------------------------------------------


def test_resume_mid_run_from_every_step_checkpoint(tmp_path: Path) -> None:
    """Clipping by norm in 32-true, host optimizer, a checkpoint after every step: the run resumed from a step's
    checkpoint ends where the uninterrupted run ends, bit for bit, for both schedules; and both schedules'
    checkpoints match."""
    steps, loader = 6, make_loader(n_seq=8)  # 2 batches an epoch: checkpoints at epoch ends and inside epochs
    finals: dict[str, FitResult] = {}
    for overlap in ("off", "pipeline"):
        ckpt = ModelCheckpoint(dirpath=tmp_path / overlap, every_n_train_steps=1, save_top_k=-1)
        whole, _ = _run(
            _gpt, overlap, steps=steps, loader=loader, gradient_clip_val=0.05, callbacks=[ckpt],
            enable_checkpointing=True,
        )  # fmt: skip
        finals[overlap] = whole
        middle = tmp_path / overlap / "epoch=1-step=4.ckpt"
        assert middle.exists(), sorted(p.name for p in (tmp_path / overlap).iterdir())
        resumed, peek = _run(_gpt, overlap, steps=steps, loader=loader, gradient_clip_val=0.05, ckpt_path=str(middle))
        assert resumed.losses == whole.losses[4:], f"{overlap}: resumed losses"
        assert_states_equal(resumed.final, whole.final, what=f"{overlap}: resumed weights")
        assert_states_equal(optimizer_state(resumed), optimizer_state(whole), what=f"{overlap}: resumed states")
        if overlap == "pipeline":
            assert peek.report is not None and peek.report.host_norms_in_backward > 0
    assert_runs_bitwise(finals["pipeline"], finals["off"], "checkpointed pipeline against off")
    for name in sorted(p.name for p in (tmp_path / "off").glob("*.ckpt")):
        a = torch.load(tmp_path / "off" / name, weights_only=True)
        b = torch.load(tmp_path / "pipeline" / name, weights_only=True)
        assert_states_equal(b["state_dict"], a["state_dict"], what=f"{name} weights")
        for index, state in a["optimizer_states"][0]["state"].items():
            for key, value in state.items():
                assert torch.equal(b["optimizer_states"][0]["state"][index][key], value), (name, index, key)


# ---- validation between steps -------------------------------------------------------------------------------------


class ValLM(LM):
    """:class:`LM` with a validation loss recorded per validation batch."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())
        self.val_losses: list[float] = []

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.training_step(batch, batch_idx)
        self.val_losses.append(float(loss))
        return loss


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
def test_validation_every_two_steps_with_clipping(mode: str) -> None:
    """``val_check_interval=2`` between steps, clipping by norm: validation reads the weights of a step whose
    norms came from the backward; the serial step's validation losses and bits."""
    steps, runs = 6, []
    for overlap in ("off", mode):
        peek = Peek()
        strategy = PatrickStarStrategy(optimizer_overlap=overlap, **HOST)
        module = ValLM()
        trainer = make_trainer(
            strategy=strategy, max_steps=steps, callbacks=[peek], gradient_clip_val=0.05, val_check_interval=2,
            limit_val_batches=2,
        )  # fmt: skip
        trainer.fit(module, make_loader(n_seq=4 * steps), make_loader(n_seq=8, seed=7))
        runs.append((module, trainer, peek))
    (off, off_trainer, _), (piped, piped_trainer, peek) = runs
    assert len(off.val_losses) == 2 * (steps // 2) and piped.val_losses == off.val_losses
    got = {k: v.float() for k, v in piped_trainer.strategy.lightning_module_state_dict().items()}
    want = {k: v.float() for k, v in off_trainer.strategy.lightning_module_state_dict().items()}
    assert_states_equal(got, want, what=f"{mode} with validation")
    assert peek.report is not None and peek.report.host_norms_in_backward == (steps - 1) * peek.families


# ---- a device budget that evicts inside the backward, one and two intra-op threads --------------------------------


@pytest.mark.parametrize("threads", [1, 2])
def test_tight_budget_evicts_while_norms_run(threads: int) -> None:
    """A device budget small enough that param chunks are evicted during the backward while family norms run on a
    worker: the serial step's bits with one intra-op thread (lent lanes) and two."""
    _, _, report, families = _pair(
        _gpt, threads=threads, gradient_clip_val=0.05, options={"device_memory_limit": "700KiB"}
    )
    assert report.evictions > 0
    assert report.host_norms_in_backward == (STEPS - 1) * families > 0


# ---- batches skipped by the user ----------------------------------------------------------------------------------


class SkipsSomeLM(LM):
    """``training_step`` returns None on every third batch: Lightning runs no backward and no step for it."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx % 3 == 1 else loss


class LossesOfSteps(L.Callback):
    """The loss of every batch that returned one."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        if outputs:  # Lightning passes an empty dict for a skipped batch
            self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_training_step_returning_none_with_clipping(accumulate: int) -> None:
    """Some batches skipped by the user (no backward, no step; inside an accumulation too): norms are taken only
    for backwards that ran; the serial step's bits and plain Lightning's values."""
    results = []
    for overlap in ("off", "pipeline", None):
        seen = LossesOfSteps()
        peek = Peek()
        module = SkipsSomeLM()
        strategy: Any = "auto" if overlap is None else PatrickStarStrategy(optimizer_overlap=overlap, **HOST)
        trainer = make_trainer(
            strategy=strategy, max_steps=STEPS, max_epochs=-1, callbacks=[seen, peek], gradient_clip_val=0.05,
            accumulate_grad_batches=accumulate,
        )  # fmt: skip
        trainer.fit(module, make_loader(n_seq=4 * 3 * STEPS))
        state = {k: v.detach().float().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}
        results.append((seen.losses, state, peek))
    (off_l, off_s, _), (pipe_l, pipe_s, peek), (plain_l, plain_s, _) = results
    assert pipe_l == off_l and len(off_l) >= 3
    assert_states_equal(pipe_s, off_s, what="skipping batches: pipeline against off")
    for i, (a, b) in enumerate(zip(off_l, plain_l, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"batch {i}: patrickstar {a!r} vs plain Lightning {b!r}"
    assert_states_close(off_s, plain_s, what="skipping batches against plain Lightning", atol=WEIGHT_ATOL)
    assert peek.report is not None and peek.report.host_norms_in_backward > 0


# ---- runs that end or fail while norms are pending ----------------------------------------------------------------


class Boom(RuntimeError):
    pass


class FailsAtStep(LM):
    """Raises in ``training_step`` (``where="step"``) or inside the backward (``where="backward"``, from an
    autograd node halfway through the graph, after the later families' norms started) at global step ``at``."""

    def __init__(self, at: int, where: str) -> None:
        super().__init__(lambda: TinyGPT())
        self.at, self.where = at, where

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.global_step == self.at and self.where == "step":
            raise Boom(f"training_step at step {self.at}")
        if self.global_step != self.at:
            return super().training_step(batch, batch_idx)
        x, y = batch
        net = self.net
        h = net.wte(x) + net.wpe(torch.arange(x.shape[1]))
        h = net.blocks[0](h)
        h = _RaiseInBackward.apply(h)
        for block in net.blocks[1:]:
            h = block(h)
        h = net.ln_f(h)
        if net.frozen is not None:
            h = h + net.frozen(h)
        logits = net.lm_head(h)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise Boom("inside the backward")


def _pipeline_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("pstar-")}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("where", ["step", "backward"])
def test_error_at_step_k_raises_and_stops_threads(where: str, threads: int) -> None:
    """An error raised at step 3 (in ``training_step``, or inside the backward after some families' norms were
    submitted) reaches the caller; nothing hangs; the pipeline's threads end with the run."""
    before = _pipeline_threads()
    with intra_op_threads(threads), pytest.raises(Boom):
        _run(lambda: FailsAtStep(3, where), "pipeline", gradient_clip_val=0.05)
    for thread in _pipeline_threads() - before:
        thread.join(timeout=10)
    assert not {t for t in _pipeline_threads() - before if t.is_alive()}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_max_steps_ends_the_run_after_a_clipped_step(accumulate: int) -> None:
    """``max_steps`` reached right after a step whose norms came from the backward, with more batches in the epoch
    (and an epoch whose length is not a multiple of the accumulation): the run ends, threads stop, serial bits."""
    before = _pipeline_threads()
    loader = make_loader(n_seq=4 * 7)  # 7 batches an epoch
    _, _, report, _ = _pair(
        _gpt, threads=1, steps=4, loader=loader, gradient_clip_val=0.05, accumulate_grad_batches=accumulate
    )
    assert report.host_norms_in_backward > 0
    for thread in _pipeline_threads() - before:
        thread.join(timeout=10)
    assert not {t for t in _pipeline_threads() - before if t.is_alive()}


# ---- the disk tier ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_disk_tier_with_clipping(tmp_path: Path, threads: int) -> None:
    """Some families' optimizer side on disk, the rest on the host, clipping by norm: the host families' norms come
    from the backward, the disk families' from the step; the serial step's bits."""
    options = {"device_memory_limit": "64MiB", "host_memory_limit": "640KiB", "disk_path": str(tmp_path)}
    _, _, report, families = _pair(_gpt, threads=threads, steps=3, gradient_clip_val=0.05, options=options)
    assert 0 < report.disk_families < families
    assert 0 < report.host_norms_in_backward <= 2 * (families - report.disk_families)


# ---- 16-mixed with overflow skips ---------------------------------------------------------------------------------


class ScaleSeen(L.Callback):
    """The loss scale and the skipped steps of the precision plugin at the end of training."""

    skipped = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.skipped = trainer.precision_plugin.skipped_steps  # type: ignore[attr-defined]


@pytest.mark.parametrize("clip", [None, 0.05])
def test_16_mixed_one_thread_overflow_skips(clip: float | None) -> None:
    """16-mixed with one intra-op thread and a loss scale that overflows at first and grows back every second step
    (so overflows recur): lent lanes and the skipped steps keep the serial step's bits; no norm inside the backward
    (mixed precision keeps gradients on the device)."""
    scale = LossScaleConfig(initial_scale=2.0**24, growth_interval=2)
    seen = ScaleSeen()
    _, _, report, _ = _pair(
        _gpt, threads=1, precision="16-mixed", steps=10, gradient_clip_val=clip, loss_scale=scale, callbacks=[seen]
    )
    assert seen.skipped > 1
    assert report.host_norms_in_backward == 0
    assert report.host_step_jobs > 0


# ---- models whose gradients land unevenly -------------------------------------------------------------------------


class SkipsABlock(nn.Module):
    """:class:`TinyGPT` whose second block runs only on even calls: on odd ones its families get no gradient (and,
    under ``"next_forward"``, no forward waits for their job before the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = TinyGPT()
        self.calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        gpt, skip = self.gpt, self.calls % 2 == 1
        self.calls += 1
        x = gpt.wte(idx) + gpt.wpe(torch.arange(idx.shape[1]))
        for i, block in enumerate(gpt.blocks):
            if not (skip and i == 1):
                x = block(x)
        x = gpt.ln_f(x)
        if gpt.frozen is not None:
            x = x + gpt.frozen(x)
        return gpt.lm_head(x)


class SubsetLM(LM):
    """Every parameter trainable, but the optimizer holds only the blocks' (the embeddings and head get gradients
    that nothing steps or clips)."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.net.blocks.parameters(), lr=3e-3, weight_decay=0.1, fused=True)


MODELS: dict[str, Callable[[], L.LightningModule]] = {
    "skips-a-block": lambda: LM(SkipsABlock),
    "reused-and-unused": lambda: LM(lambda: TinyGPT(reuse_block=True, unused=True)),
    "checkpointed": lambda: LM(lambda: CheckpointedGPT(use_reentrant=False)),
    "checkpointed-reentrant": lambda: LM(lambda: CheckpointedGPT(use_reentrant=True)),
    "optimizer-subset": SubsetLM,
}


@pytest.mark.parametrize(
    ("model", "mode"),
    [(model, mode) for model in sorted(MODELS) for mode in ("pipeline", "next_forward")],
)
def test_uneven_gradients_with_clipping_one_thread(model: str, mode: str) -> None:
    """Clipping by norm with one intra-op thread on models whose families' gradients land unevenly (a block skipped
    every other step, a block used twice and a Linear never used, activation checkpointing recomputing inside the
    backward, an optimizer holding only some trainable parameters): the serial step's bits; norms inside the
    backward ran."""
    _, _, report, _ = _pair(MODELS[model], mode, threads=1, gradient_clip_val=0.05)
    assert report.host_norms_in_backward > 0


def test_optimizer_subset_with_clipping_is_plain_lightning() -> None:
    """Lightning clips only the optimizer's parameters: the norm taken inside the backward must leave out the
    gradients of trainable parameters the optimizer does not hold."""
    serial, _, report, _ = _pair(SubsetLM, gradient_clip_val=0.05)
    assert report.host_norms_in_backward > 0
    plain, _ = _run(SubsetLM, None, gradient_clip_val=0.05)
    for i, (a, b) in enumerate(zip(serial.losses, plain.losses, strict=True)):
        assert abs(a - b) <= RTOL * abs(b), f"step {i}: patrickstar {a!r} vs plain Lightning {b!r}"
    assert_states_close(serial.final, plain.final, what="optimizer subset against plain Lightning", atol=WEIGHT_ATOL)


class FlipsThreads(L.Callback):
    """Switches between one and two intra-op threads at every batch (lent lanes on, off, on, ...)."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        torch.set_num_threads(1 if trainer.global_step % 2 == 0 else 2)


@pytest.mark.parametrize("mode", ["pipeline", "next_forward"])
def test_intra_op_threads_changed_mid_run(mode: str) -> None:
    """The user's loop changes ``torch.set_num_threads`` between steps (the pipeline's lanes were counted at its
    start): clipping by norm, the serial step's bits."""
    _, _, report, _ = _pair(_gpt, mode, threads=2, gradient_clip_val=0.05, callbacks=[FlipsThreads()])
    assert report.host_norms_in_backward > 0


@pytest.mark.parametrize("threads", [1, 2])
def test_device_budget_splits_the_optimizer(threads: int) -> None:
    """``optimizer_placement="auto"`` under a device budget that keeps some families' optimizer side on the device
    and puts the rest on the host: norms inside the backward for the host ones only; the serial step's bits."""
    options = {"optimizer_placement": "auto", "device_memory_limit": "1MiB"}
    _, _, report, families = _pair(_gpt, threads=threads, gradient_clip_val=0.05, options=options)
    assert 0 < report.host_norms_in_backward < (STEPS - 1) * families, report


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_next_forward_tail_left_by_a_skipped_module(precision: str) -> None:
    """``"next_forward"`` with clipping by norm and a module that does not run at every step: the job its family
    left in flight at the last step is not waited for by any forward, and the next step's global norm must not see
    that family's old gradients (mixed precision too: this is not the norms-inside-the-backward path). It did before
    the step finished such jobs first (the losses differed from the serial step's at micro-batch 2)."""
    _pair(lambda: LM(SkipsABlock), "next_forward", precision=precision, gradient_clip_val=0.05)
