"""Issue 29, items 2 and 4 on the simulated device: where the warm-up's optimizer steps, the hybrid plan in both
directions, and the end of a run that does not hand the weights back (``hand_back_weights=False``).

Compared against an unconstrained run on the same seed and data, bit for bit (placement never changes the
arithmetic)."""

from __future__ import annotations

import re
from typing import Any

import lightning as L
import pytest
import torch

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.runtime.pinned import host_arena
from lightning_pstar.runtime.state import Tier
from tests.helpers import OptimSpec, TinyLM, fit

STEPS = 4
CHUNK = 2048
SPEC = OptimSpec(name="adamw", lr=3e-3, weight_decay=0.1)


class StartProbe(L.Callback):
    """Where the optimizer side starts, and the bytes of the param chunks."""

    def __init__(self) -> None:
        self.start: Tier | None = None
        self.param_chunk_bytes = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        manager = trainer.strategy.chunk_manager
        self.start = manager.residency.optimizer_tier
        self.param_chunk_bytes = sum(f.param_chunk.nbytes for f in manager.families)


def _fit(precision: str, **options: Any) -> tuple[Any, PatrickStarStrategy, StartProbe]:
    strategy = PatrickStarStrategy(chunk_size=CHUNK, **options)
    probe = StartProbe()
    result = fit(TinyLM(optim=SPEC), strategy=strategy, precision=precision, max_steps=STEPS, callbacks=[probe])
    return result, strategy, probe


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_warm_up_steps_on_the_device_and_the_plan_moves_what_does_not_fit(precision: str) -> None:
    """Model data within the warm-up's share of the budget starts its optimizer side on the device (nothing of it
    on the host during the warm-up); after the warm-up the families the margin at the step does not hold go to
    the host, the others stay, and training is the unconstrained run's, bit for bit."""
    free, free_strategy, _ = _fit(precision)
    report = free_strategy.memory_report()
    P, M = report.peak_non_model_bytes, report.model_data_bytes
    _, _, probe = _fit(precision, device_memory_limit=1 << 40)
    params = probe.param_chunk_bytes
    assert probe.start is Tier.DEVICE  # a budget whose quarter holds everything: no host start
    budget = max(M, P + params + (M - params) // 2)
    got, strategy, probe = _fit(precision, device_memory_limit=budget, warmup_chunk_fraction=1.0)
    assert probe.start is Tier.DEVICE, "the warm-up share holds all model data: the optimizer starts there"
    placed = strategy.memory_report().optimizer_tier
    match = re.fullmatch(r"device for (\d+) of (\d+) families, host for the rest", placed)
    assert match is not None and 0 < int(match.group(1)) < int(match.group(2)), (placed, P, M, params, budget)
    assert got.recorder.losses == free.recorder.losses
    for (name, value), (_, ref) in zip(got.module.state_dict().items(), free.module.state_dict().items(), strict=True):
        assert torch.equal(value, ref), name


def test_without_the_hand_back_the_weights_are_dropped_and_the_chunks_freed() -> None:
    """``hand_back_weights=False``: the run ends with empty parameters (no bytes, any use fails on its shape), no
    optimizer state, no chunk and no idle pinned block; the report of the run stays readable."""
    result, strategy, _ = _fit("bf16-mixed", hand_back_weights=False)
    params = list(result.module.parameters())
    assert params and all(p.numel() == 0 and p.device.type == "cpu" for p in params)
    assert all(p.dtype == torch.float32 for p in params)  # the original dtype
    assert all(not opt.state for opt in result.trainer.optimizers)
    assert strategy.memory_report().model_data_bytes > 0
    assert host_arena().idle_bytes() == 0
    with pytest.raises(RuntimeError):
        result.module.model(torch.zeros(1, 4, dtype=torch.long))


def test_the_hand_back_option_is_a_validated_flag() -> None:
    with pytest.raises(ValueError, match=r"`hand_back_weights` must be true or false, got 'no'"):
        PatrickStarStrategy(hand_back_weights="no")  # type: ignore[arg-type]
    assert PatrickStarStrategy(hand_back_weights=False).config.hand_back_weights is False


def test_teardown_gives_the_pinned_blocks_back_family_by_family(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29, item 4: the hand-back gives the idle pinned blocks back after each family's chunks are freed, so
    the host never holds the whole pinned cache beside the copies made so far."""
    from torch import nn

    from lightning_pstar.checkpoint import model_state
    from lightning_pstar.config import PStarConfig
    from lightning_pstar.runtime.manager import ChunkManager

    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    config = PStarConfig.from_flat(chunk_size=72)  # one layer (64 + 8 elements) per family
    manager = ChunkManager(model, config=config, compute_dtype=torch.float32, device=torch.device("cpu"))
    manager.materialise()
    arena = host_arena()
    held: list[int] = []  # at each release: families whose chunks still hold storage

    def spy() -> Any:
        held.append(sum(any(c.tier is not None for c in f.chunks.values()) for f in manager.families))
        return arena

    monkeypatch.setattr(model_state, "host_arena", spy)
    model_state.restore_module(manager, torch.device("cpu"))
    assert held == [2, 1, 0]


def test_fabric_teardown_without_the_hand_back() -> None:
    """The Fabric strategy takes the same flag: its teardown frees the chunks and leaves empty parameters."""
    from lightning.fabric import Fabric

    from lightning_pstar import PatrickStarFabricStrategy
    from tests.helpers.models import BLOCK, VOCAB, FlatGPT

    fabric = Fabric(accelerator="cpu", devices=1, strategy=PatrickStarFabricStrategy(hand_back_weights=False))
    fabric.launch()
    model = fabric.setup_module(FlatGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(p for p in model.parameters() if p.requires_grad))
    tokens = torch.randint(0, VOCAB, (2, BLOCK))
    fabric.backward(model(tokens).float().square().mean())
    optimizer.step()
    fabric.strategy.teardown()
    params = list(model.parameters())
    assert params and all(p.numel() == 0 for p in params)
    assert fabric.strategy.memory_report().model_data_bytes > 0  # type: ignore[attr-defined]
