"""Normalisation layers fed an fp32 tensor in mixed precision (``ModelHooks`` in runtime/hooks.py).

A model's forward can hand a LayerNorm, GroupNorm, InstanceNorm or a BatchNorm without running statistics an fp32
tensor although its weights are compute-dtype copies here: an fp32 tensor made in the forward promotes the residual
stream (Lightning's own demo Transformer adds its fp32 positional encoding to the embedding), or user code calls the
submodule directly. torch's CPU kernels refuse that pair ("mixed dtype (CPU): expect parameter to have scalar type of
Float") and CPU autocast lists none of these ops, so the run crashed where plain Lightning (fp32 weights) trains.
Now such a module computes in fp32 with fp32 copies of its compute-dtype parameters: its output is exactly plain
PyTorch's with the weights rounded to the compute dtype, which is what mixed precision hands every module here.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarStrategy
from lightning_pstar.precision import PatrickStarFabricPrecision
from tests.helpers import make_trainer

NORMS = {
    "layer_norm": lambda: nn.LayerNorm(16),
    "group_norm": lambda: nn.GroupNorm(4, 16),
    "instance_norm": lambda: nn.InstanceNorm1d(16, affine=True),
    "batch_norm_no_stats": lambda: nn.BatchNorm1d(16, track_running_stats=False),
}


class PromotedNorm(nn.Module):
    """An embedding (compute dtype), promoted to fp32 by an fp32 tensor, into the normalisation, then a head."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.norm = norm
        self.head = nn.Linear(16, 32)
        self.register_buffer("offset", torch.linspace(-1.0, 1.0, 16))  # fp32: the promotion

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) + self.offset  # (B, T, 16) fp32
        if isinstance(self.norm, (nn.GroupNorm, nn.modules.batchnorm._NormBase)):
            h = self.norm(h.transpose(1, 2)).transpose(1, 2)  # channels second
        else:
            h = self.norm(h)
        return self.head(h)


def _reference_norm(norm: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Plain PyTorch: the module's own functional on an fp32 input, its weights rounded to ``dtype``."""
    w = norm.weight.detach().to(dtype).float()
    b = norm.bias.detach().to(dtype).float()
    if isinstance(norm, nn.LayerNorm):
        return F.layer_norm(x, norm.normalized_shape, w, b, norm.eps)
    if isinstance(norm, nn.GroupNorm):
        return F.group_norm(x, norm.num_groups, w, b, norm.eps)
    if isinstance(norm, nn.InstanceNorm1d):
        return F.instance_norm(x, weight=w, bias=b, eps=norm.eps)
    return F.batch_norm(x, None, None, w, b, training=True, eps=norm.eps)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("kind", sorted(NORMS))
def test_a_norm_fed_fp32_computes_in_fp32_with_the_rounded_weights(kind: str, precision: str) -> None:
    torch.manual_seed(0)
    net = PromotedNorm(NORMS[kind]())
    with torch.no_grad():  # weights that bf16/fp16 cannot hold exactly, so the rounding shows
        net.norm.weight.copy_(1.0 + 0.01 * torch.randn(16))
        net.norm.bias.copy_(0.01 * torch.randn(16))
    initial = copy.deepcopy(net.norm)
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    plugin = PatrickStarFabricPrecision(precision)  # on a CPU Fabric would rewrite "16-mixed" to bf16
    fabric = Fabric(accelerator="cpu", devices=1, strategy=PatrickStarFabricStrategy(), plugins=[plugin])
    fabric.launch()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    seen: dict[str, torch.Tensor] = {}

    def keep(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        seen["input"], seen["output"] = args[0].detach().clone(), output.detach().clone()

    handle = net.norm.register_forward_hook(keep)
    idx = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the warm-up step, then one after it
        logits = model(idx)
        fabric.backward(logits.float().logsumexp(-1).mean())
        assert seen["input"].dtype == torch.float32 and seen["output"].dtype == torch.float32
        opt.step()
        opt.zero_grad()
        if "first" not in seen:
            seen["first"] = seen["output"]
            want = _reference_norm(initial, seen["input"], dtype)
            assert torch.equal(seen["output"], want), (seen["output"] - want).abs().max()
    handle.remove()
    # the gradient reached the compute-dtype parameters: the step moved them
    moved = model.state_dict()["norm.weight"].float()
    assert not torch.equal(moved, initial.weight.detach()), "the norm's weight did not train"


class DemoTransformer(L.LightningModule):
    """Lightning's own demo Transformer (``lightning.pytorch.demos``), dropout off, on random tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        return F.nll_loss(self.model(inputs, target), target.view(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def _demo(strategy: Any, precision: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 64, (32, 9), generator=torch.Generator().manual_seed(2))
    data = [(row[:-1], row[1:]) for row in tokens]
    module = DemoTransformer()
    losses: list[float] = []

    class Losses(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *_: Any) -> None:
            losses.append(float(outputs["loss"]))

    make_trainer(strategy=strategy, precision=precision, max_steps=4, callbacks=[Losses()]).fit(
        module, DataLoader(data, batch_size=8)
    )
    return losses, {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def test_lightning_demo_transformer_trains_in_bf16_mixed() -> None:
    """Lightning's demo Transformer crashed in bf16-mixed (its encoder's LayerNorm got the fp32 stream); it trains now,
    as close to plain bf16-mixed as plain bf16-mixed is to plain 32-true (or closer)."""
    plain32, w32 = _demo("auto", "32-true")
    plain16, w16 = _demo("auto", "bf16-mixed")
    got, w = _demo(PatrickStarStrategy(), "bf16-mixed")
    assert len(got) == 4 and all(math.isfinite(v) for v in got)

    def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    noise = distance(w32, w16)  # what bf16 alone does to this run
    assert 0 < distance(w, w16) <= 2 * noise, (distance(w, w16), noise)
    assert (
        max(abs(a - b) for a, b in zip(got, plain16, strict=True))
        <= 2 * max(abs(a - b) for a, b in zip(plain32, plain16, strict=True)) + 1e-3
    )
