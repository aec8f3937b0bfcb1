"""Parameters used several times in one forward (a module in a loop, an RNN cell over time, a module called twice)
and weights read outside their module, against plain Lightning and a plain-PyTorch mixed-precision loop.

Each case runs under PatrickStar with the default (unlimited) budget and, where it says so, under a tight
``device_memory_limit`` with ``placement="static"`` and small chunks, so that chunks are evicted to HOST and
fetched back inside the iteration (checked: ``evictions > 0``). 32-true runs must give plain Lightning's losses
within 1e-5 (they are bitwise equal on one machine) and its final weights.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader

from lightning_pstar import PatrickStarPrecision, PatrickStarStrategy
from lightning_pstar.runtime.state import Tier
from tests.helpers.asserts import assert_evicted, assert_same_run
from tests.helpers.data import make_loader
from tests.helpers.models import SEED, MultiUse
from tests.helpers.runs import LM, STEPS, fit_steps, tight


@pytest.mark.parametrize("kind", ["loop", "rnn", "twice", "functional"])
def test_parameters_used_several_times(kind: str) -> None:
    """The gradient of a parameter used several times is the sum over its uses: with SGD with momentum the losses
    and final weights equal plain Lightning's, also when the chunks are evicted between the uses. A weight read
    outside its module (``functional``) is saved by autograd while its chunk is on HOST and fetched back to the
    device before its backward (runtime/saved_weights.py, [Note: saved weights])."""

    def build() -> nn.Module:
        return MultiUse(kind)

    ref = fit_steps(LM(build, optim="sgd"), "auto")
    got = fit_steps(LM(build, optim="sgd"), PatrickStarStrategy())
    assert_same_run(got, ref, what=f"{kind}, unlimited")
    # 1100-element chunks (one Linear each, the RNN cell in two), two of them on the device
    strategy = tight(1100, 2)
    got = fit_steps(LM(build, optim="sgd"), strategy)
    assert_evicted(strategy)
    assert_same_run(got, ref, what=f"{kind}, tight budget")


class EvictionProbe(Callback):
    """Records, at every training forward of ``MultiUse("functional")``, the tier of ``net.emb``'s param chunk when
    the parent reads the embedding weight with ``F.linear`` (right after ``net.mid`` ran)."""

    def __init__(self) -> None:
        self.tiers: list[Tier | None] = []
        self._handle: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, PatrickStarStrategy)
        net = pl_module.net
        family = strategy.chunk_manager.record_of(net.emb.weight).family
        # registered after the engine's hooks: runs after its post-forward hook of ``mid``
        self._handle = net.mid.register_forward_hook(lambda *_: self.tiers.append(family.param_chunk.tier))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._handle.remove()


def reference_functional_mixed(dtype: torch.dtype, loader: DataLoader, steps: int) -> tuple[list[float], dict]:
    """Plain PyTorch with README.md's mixed-precision semantics for ``LM(MultiUse("functional"), optim="sgd")``:
    fp32 masters stepped by fused SGD, the model holding their ``dtype`` copies, forward under autocast, the loss
    scaled by the default initial scale 65536 in fp16 (no step overflows here). Returns losses and masters."""
    torch.manual_seed(SEED)
    model = MultiUse("functional")
    names = [n for n, _ in model.named_parameters()]
    masters = [nn.Parameter(p.detach().clone().float()) for p in model.parameters()]
    model.to(dtype)
    optimizer = torch.optim.SGD(masters, lr=0.1, momentum=0.9, fused=True)
    scale = 65536.0 if dtype == torch.float16 else 1.0
    losses: list[float] = []
    for step, (x, y) in enumerate(loader):
        if step == steps:
            break
        with torch.autocast("cpu", dtype=dtype):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        losses.append(float(loss.detach()))
        (loss * scale).backward()
        for p, m in zip(model.parameters(), masters, strict=True):
            if p.grad is None:  # the RNN cell is unused here: no gradient, no step (as in torch)
                continue
            m.grad = p.grad.float() / scale
            assert bool(torch.isfinite(m.grad).all()), "the reference overflowed"
            p.grad = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters, strict=True):
                p.copy_(m.to(dtype))
    return losses, {f"net.{n}": m.detach().clone() for n, m in zip(names, masters, strict=True)}


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_weight_used_outside_its_module_mixed_precision(precision: str) -> None:
    """``MultiUse("functional")`` in mixed precision under a budget that evicts the embedding's chunk to HOST
    before the parent reads its weight with ``F.linear``: the run equals, loss by loss and in its final fp32
    masters, a plain-PyTorch loop with the README's mixed-precision semantics (the unlimited run too)."""
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    # on CPU Lightning rewrites precision="16-mixed" to "bf16-mixed": pass the plugin instead
    kwargs: dict[str, Any] = (
        {"precision": precision} if dtype == torch.bfloat16 else {"plugins": [PatrickStarPrecision(precision)]}
    )
    data = make_loader(4 * STEPS, noise=0.0)
    ref_losses, ref_masters = reference_functional_mixed(dtype, data, STEPS)
    free = fit_steps(LM(lambda: MultiUse("functional"), optim="sgd"), PatrickStarStrategy(), loader=data, **kwargs)
    probe = EvictionProbe()
    strategy = tight(1100, 2, itemsize=2)
    got = fit_steps(LM(lambda: MultiUse("functional"), optim="sgd"), strategy, loader=data, callbacks=[probe], **kwargs)
    assert_evicted(strategy)
    assert len(probe.tiers) == STEPS and Tier.HOST in probe.tiers, f"never read from an evicted chunk: {probe.tiers}"
    for what, run in (("unlimited", free), ("tight budget", got)):
        assert len(run.losses) == STEPS
        for i, (a, b) in enumerate(zip(run.losses, ref_losses, strict=True)):
            assert abs(a - b) <= 1e-6 * abs(b), f"{what}, step {i}: patrickstar {a!r} vs reference {b!r}"
        for name, value in ref_masters.items():
            torch.testing.assert_close(run.final[name], value, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert got.losses[-1] < got.losses[0]
