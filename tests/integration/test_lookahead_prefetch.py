"""Prefetch by bytes along the warm-up trace ([Note: fetch and prefetch] in runtime/lookahead.py), on the simulated
device under tight budgets.

Each model trains three times at the same budget: prefetch ``"off"``, ``"next"`` (the previous rule: the next
moment's chunks into free room only) and ``"lookahead"`` (the default). Against the run without prefetch:

- losses and final weights are bitwise equal (prefetch changes when bytes move, never which bytes a module reads);
- the chunk bytes moved are the same (an early eviction is one the run makes later anyway);
- the chunks never exceed the room of the moment they are on the device in (checked after every module's access,
  prefetches included, by a guard that raises);
- the demand fetches (a module finding its chunk on the host: a stall) per iteration after the warm-up drop
  against the run without prefetch and are at most those of the previous rule, and fewer on the demo GPT.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import MemoryReport, PatrickStarStrategy
from lightning_pstar.runtime.manager import ChunkManager
from tests.helpers import OptimSpec, TinyLM, fit

STEPS = 6
WARMUP = 1  # the warm-up iteration fetches on demand in every mode
SPEC = OptimSpec(name="adamw", lr=3e-3, weight_decay=0.1)
MODES = ("off", "next", "lookahead")


class PrefetchMode(L.Callback):
    """Sets the residency's prefetch mode, and counts demand fetches from the first iteration after the warm-up."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.demand_at_start: int | None = None
        self.iterations = 0
        self.param_chunk_bytes = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        manager = trainer.strategy.chunk_manager
        manager.residency.prefetcher.mode = self.mode
        self.param_chunk_bytes = sum(f.param_chunk.nbytes for f in manager.families)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == WARMUP:
            self.demand_at_start = trainer.strategy.memory_report().demand_fetches
        if trainer.global_step >= WARMUP:
            self.iterations += 1

    def demand_per_iteration(self, report: MemoryReport) -> float:
        assert self.demand_at_start is not None and self.iterations > 0
        return (report.demand_fetches - self.demand_at_start) / self.iterations


@pytest.fixture(autouse=True)
def room_guard(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Raise when the chunks on the device exceed the room of the moment after a module's access (its fetches,
    the tide and the prefetches it started)."""
    breaches: list[str] = []
    access = ChunkManager.access

    def guarded(self: ChunkManager, *args: Any, **kwargs: Any) -> None:
        access(self, *args, **kwargs)
        room = self.residency.chunk_room()
        if room is not None and self.residency.device_used() > room:
            raise AssertionError(f"chunks hold {self.residency.device_used()} bytes, the room is {room}")

    monkeypatch.setattr(ChunkManager, "access", guarded)
    yield breaches


@dataclass
class Run:
    losses: list[float]
    final: dict[str, torch.Tensor]
    report: MemoryReport
    demand_per_iteration: float
    param_chunk_bytes: int


def tiny_gpt() -> L.LightningModule:
    return TinyLM(optim=SPEC)


class HFLM(L.LightningModule):
    """A tiny Hugging Face causal LM (nothing downloaded) predicting arithmetic sequences."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.model = build()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch  # (B, T)
        logits = self.model(input_ids=ids).logits  # (B, T, V)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01, fused=True)


def hf_loader() -> DataLoader:
    g = torch.Generator().manual_seed(4321)
    start = torch.randint(0, 120, (8, 1), generator=g)
    seq = 2 + (start + torch.arange(32)) % 126  # (8, 32)
    return DataLoader(TensorDataset(seq.repeat(STEPS, 1)), batch_size=4, shuffle=False)


def gpt2() -> L.LightningModule:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
        embd_pdrop=0.0,
    )  # fmt: skip
    return HFLM(lambda: transformers.GPT2LMHeadModel(config))


def llama() -> L.LightningModule:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, attention_dropout=0.0,
    )  # fmt: skip
    return HFLM(lambda: transformers.LlamaForCausalLM(config))


MODELS: dict[str, tuple[Callable[[], L.LightningModule], int]] = {
    "tiny_gpt": (tiny_gpt, 2048),
    "gpt2": (gpt2, 4096),
    "llama": (llama, 4096),
}


def train(model: str, precision: str, mode: str, budget: int | None) -> Run:
    build, chunk_size = MODELS[model]
    strategy = PatrickStarStrategy(chunk_size=chunk_size, device_memory_limit=budget)
    probe = PrefetchMode(mode)
    loader = None if model == "tiny_gpt" else hf_loader()
    result = fit(build(), strategy=strategy, loader=loader, precision=precision, max_steps=STEPS, callbacks=[probe])
    report = strategy.memory_report()
    return Run(result.losses, result.final, report, probe.demand_per_iteration(report), probe.param_chunk_bytes)


def tight_budget(model: str, precision: str, fraction: float) -> int:
    """``P + fraction * W`` from an unconstrained run: the warm-up's peak of non-model memory, and the bytes of the
    param chunks (the optimizer's side then steps on the host, and the param chunks take turns on the device)."""
    free = train(model, precision, "off", None)
    return free.report.peak_non_model_bytes + int(fraction * free.param_chunk_bytes)


def compare(model: str, precision: str, fraction: float) -> dict[str, Run]:
    budget = tight_budget(model, precision, fraction)
    runs = {mode: train(model, precision, mode, budget) for mode in MODES}
    off = runs["off"]
    for mode, got in runs.items():
        what = f"{model} {precision} budget {budget} prefetch {mode}"
        report = got.report
        print(
            f"{what}: demand fetches/iteration {got.demand_per_iteration:.1f}, prefetches {report.prefetches}"
            f" (hits {report.prefetch_hits}, wasted {report.prefetches_wasted}), early evictions"
            f" {report.early_evictions}, lead {report.prefetch_lead_moments / max(1, report.prefetches):.2f} moments,"
            f" moved {report.h2d_bytes + report.d2h_bytes}"
        )
        assert got.losses == off.losses, f"{what}: losses differ"
        assert sorted(got.final) == sorted(off.final), what
        for name, value in off.final.items():
            assert torch.equal(got.final[name], value), f"{what}: final '{name}' differs"
        assert report.peak_device_chunk_bytes <= budget, what
        assert (report.h2d_bytes, report.d2h_bytes) == (off.report.h2d_bytes, off.report.d2h_bytes), what
        assert report.prefetches_wasted == 0, what
    assert off.demand_per_iteration > 0, f"{model}: the budget forces no fetch, the test proves nothing"
    assert runs["lookahead"].demand_per_iteration < off.demand_per_iteration
    assert runs["lookahead"].demand_per_iteration <= runs["next"].demand_per_iteration
    return runs


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_demo_gpt_prefetches_further_at_a_tight_budget(precision: str) -> None:
    runs = compare("tiny_gpt", precision, 0.6)
    assert runs["lookahead"].demand_per_iteration < runs["next"].demand_per_iteration
    assert runs["lookahead"].report.prefetch_hits > runs["next"].report.prefetch_hits
    # and each copy starts further ahead of its moment (more compute to overlap with on a GPU)
    assert lead(runs["lookahead"].report) > lead(runs["next"].report) == 1.0


def lead(report: MemoryReport) -> float:
    return report.prefetch_lead_moments / report.prefetches


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_hf_models_prefetch_within_the_budget(model: str) -> None:
    runs = compare(model, "32-true", 0.6)
    assert lead(runs["lookahead"].report) > lead(runs["next"].report)
