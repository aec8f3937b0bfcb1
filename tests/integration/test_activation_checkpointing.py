"""Activation checkpointing (``torch.utils.checkpoint``, reentrant and not) against plain Lightning on the same seed
and data: recomputation runs module forwards again inside backward.

Each case runs under PatrickStar with the default (unlimited) budget and, where it says so, under a tight
``device_memory_limit`` with ``placement="static"`` and small chunks, so that chunks are evicted to HOST and
fetched back inside the iteration (checked: ``evictions > 0``). 32-true runs must give plain Lightning's losses
within 1e-5 (they are bitwise equal on one machine) and its final weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_pstar import PatrickStarStrategy
from tests.helpers.asserts import assert_evicted, assert_same_run, assert_states_equal
from tests.helpers.data import make_loader
from tests.helpers.models import BLOCK, N_EMBD, VOCAB, Block
from tests.helpers.runs import LM, STEPS, fit_steps, tight


class CountingBlock(Block):
    """tests.helpers.models.Block that counts its forward calls (recomputation included)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x)


class CheckpointedGPT(nn.Module):
    """Embeddings, three transformer blocks each run under ``torch.utils.checkpoint``, and a head."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(BLOCK, N_EMBD)
        self.blocks = nn.ModuleList([CountingBlock() for _ in range(3)])
        self.head = nn.Linear(N_EMBD, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))  # (B, T, C)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.use_reentrant)
        return self.head(x)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing(use_reentrant: bool) -> None:
    """Recomputation inside backward runs each block's forward hooks a second time: the losses, the final weights
    and the number of block calls must equal plain Lightning's, with and without evictions."""

    def build() -> nn.Module:
        return CheckpointedGPT(use_reentrant)

    ref = fit_steps(LM(build), "auto")
    calls = [b.calls for b in ref.module.net.blocks]
    assert calls == [2 * STEPS] * 3, f"checkpointing did not recompute: {calls}"
    got = fit_steps(LM(build), PatrickStarStrategy())
    assert_same_run(got, ref, what="unlimited")
    assert [b.calls for b in got.module.net.blocks] == calls
    # 4096-element chunks; 4 of them: a block's backward pins the chunks of the module it is in while the
    # recomputation of the same block (non-reentrant) fetches the chunks of the modules before it
    strategy = tight(4096, 4)
    got = fit_steps(LM(build), strategy)
    assert_evicted(strategy)
    assert_same_run(got, ref, what="tight budget")
    assert [b.calls for b in got.module.net.blocks] == calls


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_bf16(use_reentrant: bool) -> None:
    """bf16-mixed, where a final gradient overwrites its parameter's slot: a recomputation must still read weights.
    Evictions change nothing (bitwise), and the run stays close to plain Lightning's bf16-mixed."""

    def build() -> nn.Module:
        return CheckpointedGPT(use_reentrant)

    data = make_loader(4 * STEPS, noise=0.0)
    ref = fit_steps(LM(build), "auto", precision="bf16-mixed", loader=data)
    free = fit_steps(LM(build), PatrickStarStrategy(), precision="bf16-mixed", loader=data)
    strategy = tight(4096, 4, itemsize=2)
    got = fit_steps(LM(build), strategy, precision="bf16-mixed", loader=data)
    assert_evicted(strategy)
    assert got.losses == free.losses, "evictions changed the arithmetic"
    assert_states_equal(got.final, free.final, what="tight budget vs unlimited")
    assert got.losses[-1] < got.losses[0]
    for a, b in zip(got.losses, ref.losses, strict=True):
        assert a == pytest.approx(b, rel=2e-2)


class SharedBlockGPT(nn.Module):
    """One block applied ``uses`` times, each use under ``torch.utils.checkpoint`` (weights shared across layers, as
    ALBERT does), from ``from_call`` on (the earlier forwards use it once): reentrant checkpointing runs each use's
    backward as a backward of its own, so the block computes again after its gradient of a later use has landed
    ([Note: a forward after the gradient] in runtime/late_gradients.py)."""

    def __init__(self, use_reentrant: bool = True, uses: int = 3, from_call: int = 0) -> None:
        super().__init__()
        self.use_reentrant, self.uses, self.from_call = use_reentrant, uses, from_call
        self.calls = 0
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(BLOCK, N_EMBD)
        self.block = Block()
        self.head = nn.Linear(N_EMBD, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        uses = self.uses if self.calls >= self.from_call else 1
        self.calls += 1
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for _ in range(uses):
            x = checkpoint(self.block, x, use_reentrant=self.use_reentrant)
        return self.head(x)


@pytest.mark.parametrize(
    ("overlap", "kwargs"),
    [
        ("off", {}),
        ("auto", {}),  # the default: pipelined after the warm-up
        ("pipeline", {"accumulate_grad_batches": 2}),
        ("pipeline", {"gradient_clip_val": 0.05}),  # 32-true: norms computed inside the backward elsewhere
    ],
)
def test_a_block_shared_by_reentrant_checkpointed_layers_matches_plain(overlap: str, kwargs: dict) -> None:
    """Plain Lightning sums the block's gradients of its three uses; so does the engine, with the optimizer on the
    device or on the host, every overlap mode (was: an invalid state transition at the second use's recomputation)."""
    ref = fit_steps(LM(lambda: SharedBlockGPT()), "auto", **kwargs)
    strategy = PatrickStarStrategy(optimizer_placement="host", optimizer_overlap=overlap, chunk_size=4096)
    got = fit_steps(LM(lambda: SharedBlockGPT()), strategy, **kwargs)
    assert_same_run(got, ref, what=f"shared checkpointed block, {overlap}, {kwargs}")
    report = strategy.memory_report()
    if overlap != "off":
        assert report.host_step_jobs > 0, report


def test_a_block_shared_by_reentrant_checkpointed_layers_bf16() -> None:
    """bf16-mixed: the first use's gradient in the param slot moves into the fp32 sums and the slot gets its weight
    back before the block computes again; close to plain Lightning's bf16-mixed, and the default placement gives the
    same bits as a tight budget."""
    data = make_loader(4 * STEPS, noise=0.0)
    ref = fit_steps(LM(lambda: SharedBlockGPT()), "auto", precision="bf16-mixed", loader=data)
    free = fit_steps(LM(lambda: SharedBlockGPT()), PatrickStarStrategy(), precision="bf16-mixed", loader=data)
    for a, b in zip(free.losses, ref.losses, strict=True):
        assert a == pytest.approx(b, rel=2e-2)
    strategy = tight(4096, 4, itemsize=2)
    got = fit_steps(LM(lambda: SharedBlockGPT()), strategy, precision="bf16-mixed", loader=data)
    assert got.losses == free.losses, "evictions changed the arithmetic"
    assert_states_equal(got.final, free.final, what="tight budget vs unlimited")


def test_a_family_stepping_inside_the_backward_that_computes_again_raises() -> None:
    """A block shared only from the third batch on: its family started its step inside the backward of that batch
    (nothing in the warm-up said it could compute again) when its second use's recomputation needs it. That raises,
    naming the parameter, before anything changes."""
    strategy = PatrickStarStrategy(optimizer_placement="host", optimizer_overlap="pipeline", chunk_size=4096)
    with pytest.raises(RuntimeError, match=r"'net\.block\..*' .*another gradient in the same backward"):
        fit_steps(LM(lambda: SharedBlockGPT(from_call=2)), strategy)
