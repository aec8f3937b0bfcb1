"""Hunting false alarms and misses of the mixed-precision outside-write check ([Note: writes outside a forward] in
``runtime/outside_writes.py``): legitimate bf16-mixed / 16-mixed runs must train without ``OutsideWriteError``,
and writes outside a forward that the fp32 masters would lose must raise."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.tuner import Tuner
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarStrategy
from lightning_pstar.config_sections import LossScaleConfig
from lightning_pstar.precision import PatrickStarPrecision
from lightning_pstar.runtime.outside_writes import OutsideWriteError
from tests.helpers.data import make_loader
from tests.helpers.models import VOCAB, FlatGPT, TinyGPT, lm_loss
from tests.helpers.runs import LM, TinyLM, fit_steps, make_trainer

HOST = {"optimizer_placement": "host", "chunk_size": 4096}


def _finite(losses: list[float]) -> bool:
    return bool(losses) and all(math.isfinite(x) for x in losses)


# ---- legitimate runs: no false alarm --------------------------------------------------------------------


def test_16_mixed_overflow_skips_train_without_refusal() -> None:
    """A huge initial loss scale: the first steps overflow and are skipped (the slots held inf gradients)."""
    plugin = PatrickStarPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale=2.0**40))
    run = fit_steps(TinyLM(), PatrickStarStrategy(), steps=6, plugins=[plugin])
    assert len(run.losses) == 6


def test_next_forward_overlap_parked_parameters_no_refusal() -> None:
    run = fit_steps(TinyLM(), PatrickStarStrategy(optimizer_overlap="next_forward", **HOST), precision="bf16-mixed")
    assert _finite(run.losses)


def test_evicting_budget_with_accumulation_and_clipping_no_refusal() -> None:
    strategy = PatrickStarStrategy(chunk_size=4096, placement="static", device_memory_limit=3 * 4096 * 2)
    run = fit_steps(TinyLM(), strategy, precision="bf16-mixed", steps=4, accumulate_grad_batches=2,
                    gradient_clip_val=0.5)  # fmt: skip
    assert _finite(run.losses)


def test_disk_tier_no_refusal(tmp_path: Path) -> None:
    strategy = PatrickStarStrategy(chunk_size=4096, host_memory_limit="640KiB", disk_path=str(tmp_path / "d"))
    run = fit_steps(TinyLM(), strategy, precision="bf16-mixed", steps=3)
    assert _finite(run.losses)


class _FreezeAt(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 2:
            pl_module.model.blocks[0].requires_grad_(False)  # type: ignore[union-attr]


def test_freezing_mid_run_and_validation_no_refusal() -> None:
    run = fit_steps(TinyLM(), PatrickStarStrategy(), precision="bf16-mixed", steps=4, callbacks=[_FreezeAt()],
                    val_check_interval=2, limit_val_batches=2)  # fmt: skip
    assert _finite(run.losses)
    run.trainer.predict(run.module, dataloaders=run.trainer.train_dataloader)


class _MaxNormGPT(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.wpe = nn.Embedding(self.wpe.num_embeddings, self.wpe.embedding_dim, max_norm=0.5)


class _CheckpointedGPT(TinyGPT):
    def __init__(self, *, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.lm_head(self.ln_f(x))


@pytest.mark.parametrize("build", ["max_norm", "ckpt", "ckpt_reentrant"])
def test_forward_writes_and_recomputes_no_refusal(build: str) -> None:
    nets = {"max_norm": _MaxNormGPT, "ckpt": lambda: _CheckpointedGPT(reentrant=False),
            "ckpt_reentrant": lambda: _CheckpointedGPT(reentrant=True)}  # fmt: skip
    run = fit_steps(LM(nets[build]), PatrickStarStrategy(), precision="bf16-mixed", steps=4)
    assert _finite(run.losses)


def test_resume_from_checkpoint_no_refusal(tmp_path: Path) -> None:
    first = fit_steps(TinyLM(), PatrickStarStrategy(), precision="bf16-mixed", steps=2)
    path = str(tmp_path / "c.ckpt")
    first.trainer.save_checkpoint(path)
    run = fit_steps(TinyLM(), PatrickStarStrategy(), precision="bf16-mixed", steps=4, ckpt_path=path)
    assert _finite(run.losses)


class _Manual(L.LightningModule):
    """Manual optimization: two optimizers over disjoint halves (a GAN's shape), a step skipped now and then."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = TinyGPT()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt_a, opt_b = self.optimizers()  # type: ignore[misc]
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        self.manual_backward(loss)
        opt_a.step()
        opt_a.zero_grad()
        if batch_idx % 2 == 0:
            opt_b.step()
        opt_b.zero_grad()
        return loss

    def configure_optimizers(self) -> Any:
        blocks = list(self.net.blocks.parameters())
        rest = [p for p in self.net.parameters() if p.requires_grad and all(p is not b for b in blocks)]
        return torch.optim.AdamW(blocks, lr=1e-3), torch.optim.AdamW(rest, lr=1e-3)


def test_manual_two_optimizers_no_refusal() -> None:
    fit_steps(_Manual(), PatrickStarStrategy(), precision="bf16-mixed", steps=4)


# ---- misses: writes the masters lose must raise ------------------------------------------------------------


class _Writes(L.Callback):
    def __init__(self, hook: str) -> None:
        self.hook = hook

    def _write(self, pl_module: L.LightningModule) -> None:
        with torch.no_grad():
            pl_module.model.lm_head.weight.mul_(0.5)  # type: ignore[union-attr]

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.hook == "before_step":
            self._write(pl_module)

        if self.hook == "frozen_before_step":
            with torch.no_grad():
                pl_module.model.frozen.weight.mul_(0.5)  # type: ignore[union-attr]

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.hook == "val_end":
            self._write(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.hook == "foreach" and trainer.global_step == 1:
            with torch.no_grad():
                torch._foreach_mul_([p for p in pl_module.parameters() if p.requires_grad], 0.5)


def test_write_at_validation_epoch_end_raises() -> None:
    """``trainer.validate`` after ``fit`` with a callback writing at ``on_validation_epoch_end``: the next read of
    the fp32 weights (the hand-back at the end of ``validate``) refuses it."""
    run = fit_steps(TinyLM(), PatrickStarStrategy(), precision="bf16-mixed", steps=2)
    run.trainer.callbacks.append(_Writes("val_end"))
    with pytest.raises(OutsideWriteError, match="lm_head.weight"):
        run.trainer.validate(run.module, dataloaders=make_loader(n_seq=4), verbose=False)


class _WritesAfterStep(TinyLM):
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        with torch.no_grad():
            self.model.lm_head.weight.mul_(0.5)  # type: ignore[union-attr]


def test_optimizer_step_override_writing_weights_raises() -> None:
    with pytest.raises(OutsideWriteError, match="lm_head.weight"):
        fit_steps(_WritesAfterStep(), PatrickStarStrategy(), precision="bf16-mixed", steps=3)


def test_lr_find_in_bf16_no_refusal() -> None:
    trainer = make_trainer(strategy=PatrickStarStrategy(), precision="bf16-mixed", max_steps=20)
    Tuner(trainer).lr_find(TinyLM(), train_dataloaders=make_loader(n_seq=40), num_training=5, update_attr=False)


def test_write_to_a_frozen_weight_before_the_step_raises() -> None:
    """A frozen weight's slot never holds a gradient: a write in ``on_before_optimizer_step`` reaches only it."""
    with pytest.raises(OutsideWriteError, match="frozen.weight"):
        fit_steps(TinyLM(), PatrickStarStrategy(frozen_master=True), precision="bf16-mixed", steps=3,
                  callbacks=[_Writes("frozen_before_step")])  # fmt: skip


def test_16_mixed_overflow_with_next_forward_and_accumulation_no_refusal() -> None:
    plugin = PatrickStarPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale=2.0**40))
    strategy = PatrickStarStrategy(optimizer_overlap="next_forward", **HOST)
    run = fit_steps(TinyLM(), strategy, steps=5, plugins=[plugin], accumulate_grad_batches=2)
    assert _finite(run.losses)


def test_foreach_write_raises() -> None:
    with pytest.raises(OutsideWriteError):
        fit_steps(TinyLM(), PatrickStarStrategy(), precision="bf16-mixed", steps=3, callbacks=[_Writes("foreach")])


def test_write_before_step_with_accumulation_is_kept_like_plain_lightning() -> None:
    """With accumulation the gradient lives in its own chunk; a write in ``on_before_optimizer_step`` is still
    kept (the step starts from it), as in plain Lightning: no refusal, same weights within bf16 tolerance."""
    kwargs: dict[str, Any] = {"precision": "bf16-mixed", "steps": 3, "accumulate_grad_batches": 2}
    got = fit_steps(TinyLM(), PatrickStarStrategy(), callbacks=[_Writes("before_step")], **kwargs)
    want = fit_steps(TinyLM(), "auto", callbacks=[_Writes("before_step")], **kwargs)
    key = "model.lm_head.weight"
    torch.testing.assert_close(got.final[key].norm(), want.final[key].norm(), rtol=1e-2, atol=0)


# ---- Hugging Face, torch.compile, weight_norm, Fabric ------------------------------------------------------


@pytest.mark.parametrize(("kind", "checkpointing"), [("gpt2", {"use_reentrant": False}), ("t5", None)])
def test_hf_models_in_bf16_no_refusal(kind: str, checkpointing: dict[str, Any] | None) -> None:
    from tests.integration.test_transformers import HFLM
    from tests.integration.test_transformers import fit as hf_fit

    recorder = hf_fit(HFLM(kind, checkpointing), PatrickStarStrategy(), precision="bf16-mixed", steps=4)
    assert _finite(recorder.losses)


class _WeightNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.hidden = nn.utils.parametrizations.weight_norm(nn.Linear(32, 32))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.emb(idx))))


def _compiled_gpt() -> nn.Module:
    net = TinyGPT()
    for block in net.blocks:
        block.compile()
    return net


@pytest.mark.parametrize("build", ["weight_norm", pytest.param("compile", marks=pytest.mark.slow)])
def test_parametrized_and_compiled_modules_no_refusal(build: str) -> None:
    nets = {"weight_norm": _WeightNormNet, "compile": _compiled_gpt}
    run = fit_steps(LM(nets[build]), PatrickStarStrategy(), precision="bf16-mixed", steps=3)
    assert _finite(run.losses)


def _fabric_loop(write_between: bool) -> list[float]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=PatrickStarFabricStrategy(), precision="bf16-mixed")
    return fabric.launch(_fabric_body, write_between)  # type: ignore[no-any-return]


def _fabric_body(fabric: Fabric, write_between: bool) -> list[float]:
    torch.manual_seed(0)
    net = FlatGPT()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    losses = []
    for x, y in list(make_loader(n_seq=12))[:3]:
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        if write_between:  # user code between steps: lost in the masters, so refused at the next forward
            with torch.no_grad():
                next(p for p in model.parameters() if p.ndim == 2).mul_(0.5)
    return losses


def test_fabric_loop_no_refusal() -> None:
    assert _finite(_fabric_loop(write_between=False))


def test_fabric_write_between_steps_raises() -> None:
    with pytest.raises(OutsideWriteError):
        _fabric_loop(write_between=True)


class _ClampsChildInForward(TinyGPT):
    """Clamps ``lm_head.weight`` (tied to ``wte``) under ``torch.no_grad()`` in the ROOT module's forward, before
    the children run: a write inside a forward, but outside the forward of the module owning the weight."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lm_head.weight.clamp_(-0.05, 0.05)
        return super().forward(idx)


@pytest.mark.xfail(
    strict=True,
    raises=OutsideWriteError,
    reason="a write to a child's weight inside the parent's forward is refused as 'outside a module's forward'"
    " (ChunkManager.pre_forward of the owning module sees the moved version; post_forward only copies writes made"
    " between the owner's own pre/post hooks), while plain Lightning keeps it",
)
def test_write_to_a_child_weight_in_the_parents_forward_is_kept() -> None:
    got = fit_steps(LM(_ClampsChildInForward), PatrickStarStrategy(), precision="bf16-mixed", steps=3)
    want = fit_steps(LM(_ClampsChildInForward), "auto", precision="bf16-mixed", steps=3)
    key = "net.lm_head.weight"
    torch.testing.assert_close(got.final[key], want.final[key], rtol=0, atol=2e-2)
