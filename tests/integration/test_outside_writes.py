"""Writes to a parameter outside a module's forward in mixed precision ([Note: writes outside a forward] in
``runtime/outside_writes.py``): refused where they would reach only the rounded compute-dtype copy, kept where they
reach the fp32 master, and never seen in 32-true, where the parameter is its fp32 weight."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.runtime.outside_writes import OutsideWriteError
from tests.helpers.models import TinyGPT
from tests.helpers.runs import LM, fit_steps


class WritesAt(L.Callback):
    """Writes ``torch.no_grad()`` in place into ``lm_head.weight`` (trainable) or a frozen weight, at one hook."""

    def __init__(self, hook: str, *, frozen: bool = False, value: float = 0.0) -> None:
        self.hook, self.frozen, self.value = hook, frozen, value
        self.seen: list[torch.Tensor] = []

    def _write(self, pl_module: L.LightningModule) -> None:
        net = pl_module.net  # type: ignore[attr-defined]
        weight = net.blocks[0].attn.qkv.weight if self.frozen else net.lm_head.weight
        with torch.no_grad():
            weight.fill_(self.value)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.hook == "on_train_batch_end" and trainer.global_step == 2:
            self._write(pl_module)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.hook == "on_before_optimizer_step":
            self._write(pl_module)
            self.seen.append(pl_module.net.lm_head.weight.detach().float().clone())  # type: ignore[attr-defined]

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.hook == "on_train_end":
            self._write(pl_module)


def _frozen_block() -> TinyGPT:
    net = TinyGPT()
    net.blocks[0].attn.qkv.weight.requires_grad_(False)
    return net


@pytest.mark.parametrize("frozen", [False, True])
def test_a_write_after_the_step_is_refused_at_the_next_forward(frozen: bool) -> None:
    with pytest.raises(OutsideWriteError, match=r"written in place outside a module's forward.*HINT"):
        fit_steps(LM(_frozen_block), PatrickStarStrategy(), precision="bf16-mixed", steps=5,
                  callbacks=[WritesAt("on_train_batch_end", frozen=frozen)])  # fmt: skip


def test_a_write_at_the_end_is_refused_before_the_weights_are_handed_back() -> None:
    with pytest.raises(OutsideWriteError, match="lm_head.weight"):
        fit_steps(LM(TinyGPT), PatrickStarStrategy(), precision="bf16-mixed", steps=2,
                  callbacks=[WritesAt("on_train_end")])  # fmt: skip


def test_a_write_while_the_slot_holds_the_gradient_reaches_the_master() -> None:
    """In ``on_before_optimizer_step`` a trainable parameter whose slot holds its gradient points at its fp32
    master: the write reaches it, the step starts from it (plain Lightning's order), nothing is refused."""
    writes = WritesAt("on_before_optimizer_step", value=0.0)
    run = fit_steps(LM(TinyGPT), PatrickStarStrategy(), precision="bf16-mixed", steps=4, callbacks=[writes])
    assert all(bool((seen == 0).all()) for seen in writes.seen)  # the write was seen where it was made
    lr = 3e-3  # LM's AdamW: after a zeroed weight one Adam step moves each element by at most ~lr
    assert float(run.final["net.lm_head.weight"].abs().max()) <= 1.5 * lr


@pytest.mark.parametrize("hook", ["on_train_batch_end", "on_train_end"])
def test_32_true_keeps_every_write(hook: str) -> None:
    """In 32-true the parameter is its fp32 weight: the write is the weight, as in plain Lightning."""
    run = fit_steps(LM(TinyGPT), PatrickStarStrategy(), precision="32-true", steps=4,
                    callbacks=[WritesAt(hook, value=0.25)])  # fmt: skip
    if hook == "on_train_end":  # the weights handed back at teardown hold it
        assert bool((run.module.net.lm_head.weight == 0.25).all())
    else:
        ref = fit_steps(LM(TinyGPT), "auto", precision="32-true", steps=4, callbacks=[WritesAt(hook, value=0.25)])
        torch.testing.assert_close(run.final["net.lm_head.weight"], ref.final["net.lm_head.weight"])
