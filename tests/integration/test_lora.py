"""A frozen backbone with LoRA-style adapters against plain Lightning: gradients, gradient traffic and the memory the
frozen parameters cost (bf16-mixed).

Each case runs under PatrickStar with the default (unlimited) budget and, where it says so, under a tight
``device_memory_limit`` with ``placement="static"`` and small chunks, so that chunks are evicted to HOST and
fetched back inside the iteration (checked: ``evictions > 0``). 32-true runs must give plain Lightning's losses
within 1e-5 (they are bitwise equal on one machine) and its final weights.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.runtime.chunk import ChunkKind
from tests.helpers.asserts import assert_same_run
from tests.helpers.data import make_loader
from tests.helpers.models import N_EMBD, VOCAB
from tests.helpers.runs import LM, STEPS, fit_steps, tight

RANK = 4


class LoRALinear(nn.Module):
    """A frozen Linear plus a trainable low-rank update ``B @ A`` (rank 4)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(n_in, n_out)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(RANK, n_in) / math.sqrt(n_in))
        self.lora_b = nn.Parameter(torch.randn(n_out, RANK) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b)


class LoRANet(nn.Module):
    """Frozen embedding, three frozen layers with adapters, frozen head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, N_EMBD)
        self.layers = nn.ModuleList([LoRALinear(N_EMBD, N_EMBD) for _ in range(3)])
        self.head = nn.Linear(N_EMBD, VOCAB)
        self.emb.requires_grad_(False)
        self.head.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


class GradTrafficProbe(Callback):
    """Before every optimizer step: frozen parameters hold no gradient anywhere (chunk slot or ``.grad``)."""

    def __init__(self) -> None:
        self.checked = 0

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        manager = trainer.strategy.chunk_manager
        for record in manager.records:
            if record.trainable:
                continue
            assert record.param.grad is None, record.names
            assert not (record.grad_in_param_slot or record.grad_in_grad_chunk), f"{record.names}: gradient stored"
            assert record.slot.state.value != "hold_after_bwd", f"{record.names}: marked as holding a gradient"
        self.checked += 1


@pytest.mark.parametrize("all_params", [False, True], ids=["adapters-only", "all-params-to-optimizer"])
def test_lora_adapters_32_true(all_params: bool) -> None:
    """Only the adapters train: losses and weights equal plain Lightning's, frozen weights bitwise unchanged,
    frozen parameters never receive a gradient (even when the optimizer was given them)."""
    ref = fit_steps(LM(LoRANet, all_params=all_params), "auto")
    probe = GradTrafficProbe()
    got = fit_steps(LM(LoRANet, all_params=all_params), tight(1100, 2), callbacks=[probe])
    assert probe.checked == STEPS
    assert_same_run(got, ref, what="LoRA")
    for name, value in got.final.items():
        frozen = "lora_" not in name
        assert torch.equal(value, got.recorder.initial_state[name]) == frozen, f"{name}: frozen={frozen}"


class FamilyProbe(Callback):
    """At the end of training: each chunk family's capacity, whether it trains, and the kinds of chunk it has."""

    def __init__(self) -> None:
        self.families: list[tuple[int, bool, set[ChunkKind]]] = []

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        manager = trainer.strategy.chunk_manager
        self.families = [
            (f.capacity, f.trainable, {k for k, c in f.chunks.items() if c.tier}) for f in manager.families
        ]


@pytest.mark.parametrize("frozen_master", [True, False])
def test_lora_adapters_bf16_memory(frozen_master: bool) -> None:
    """bf16-mixed: trainable elements cost 14 bytes (bf16 param/grad + fp32 master + 2 Adam moments), frozen ones 6
    (the bf16 chunk the forward reads + the exact fp32 weights on the host, ``frozen_master``) or 2 without that
    copy; frozen chunks carry no optimizer state; the loss falls and stays close to plain Lightning's; the
    trained model's frozen weights are the ones it started from, bit for bit, with the copy."""
    data = make_loader(4 * STEPS, noise=0.0)
    ref = fit_steps(LM(LoRANet), "auto", precision="bf16-mixed", loader=data)
    strategy = PatrickStarStrategy(chunk_size=1024, frozen_master=frozen_master)
    probes = [GradTrafficProbe(), FamilyProbe()]
    got = fit_steps(LM(LoRANet), strategy, precision="bf16-mixed", loader=data, callbacks=probes)
    assert probes[0].checked == STEPS
    assert got.losses[-1] < got.losses[0]
    for a, b in zip(got.losses, ref.losses, strict=True):
        assert a == pytest.approx(b, rel=2e-2)

    net = LoRANet()
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in net.parameters() if not p.requires_grad)
    assert trainable < frozen / 5
    report = strategy.memory_report()
    assert report.num_params == trainable + frozen
    frozen_bytes = 6 if frozen_master else 2
    payload = 14 * trainable + frozen_bytes * frozen
    assert report.model_data_bytes_per_param * report.num_params == pytest.approx(payload, abs=1e-6)
    # the rest is chunk padding: at most (capacity - payload) elements, at 14 bytes each
    padding = report.num_chunks * report.chunk_size - report.num_params
    assert payload <= report.model_data_bytes <= payload + 14 * padding, report
    # exactly: 14 bytes per element of capacity in trainable families, 2 in frozen ones, which hold nothing else
    families = probes[1].families
    assert len(families) == report.num_chunks
    assert report.model_data_bytes == sum(cap * (14 if trainable else frozen_bytes) for cap, trainable, _ in families)
    frozen_kinds = {ChunkKind.PARAM, ChunkKind.MASTER} if frozen_master else {ChunkKind.PARAM}
    for cap, trainable_family, kinds in families:
        expected = {ChunkKind.PARAM, ChunkKind.MASTER, ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ}
        assert kinds == (expected if trainable_family else frozen_kinds), (cap, trainable_family, kinds)
    # what a checkpoint saves: the frozen backbone exactly as built (or its bf16 rounding, without the copy)
    saved = strategy.lightning_module_state_dict()
    initial = LM(LoRANet).state_dict()  # the same seed builds the same weights
    frozen_names = [n for n, p in LM(LoRANet).named_parameters() if not p.requires_grad]
    assert frozen_names
    for name in frozen_names:
        want = initial[name] if frozen_master else initial[name].bfloat16().float()
        assert torch.equal(saved[name], want), name
    assert any(not torch.equal(initial[n], initial[n].bfloat16().float()) for n in frozen_names)
