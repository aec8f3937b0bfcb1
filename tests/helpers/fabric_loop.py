"""One plain Fabric training loop, run with any strategy: what the Fabric tests compare step by step.

:func:`train` builds :class:`~tests.helpers.models.FlatGPT` (no key bias, so final weights compare across
strategies) after the same seed, sets it up with the strategy, and trains ``steps`` optimizer steps with the
features a :class:`LoopSpec` turns on (accumulation through ``fabric.no_backward_sync``, clipping by norm or
value, two param groups, an LR scheduler, a no-grad evaluation forward between steps, meta-device init, a save
and a resume). It returns every micro-batch loss and the weights before and after training.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric

from lightning_pstar import PatrickStarFabricStrategy
from lightning_pstar.checkpoint import full_state_dict
from tests.helpers.data import make_loader
from tests.helpers.models import SEED, FlatGPT, lm_loss


@dataclass(kw_only=True)
class LoopSpec:
    """What the loop does (every field off by default)."""

    strategy: Any = "auto"
    precision: str = "32-true"
    devices: int = 1
    num_nodes: int = 1
    steps: int = 3
    accumulate: int = 1
    clip_norm: float | None = None
    clip_val: float | None = None
    optim: str = "adamw"  # or "sgd" (momentum)
    two_groups: bool = False
    scheduler: bool = False
    eval_between: bool = False
    empty_init: bool = False
    separate_setup: bool = False  # setup_module + setup_optimizers instead of setup(model, opt)
    save_at: int | None = None  # save after this many steps to `checkpoint`
    resume_from: Path | None = None  # load before training (the steps then continue from the saved step)
    checkpoint: Path | None = None
    initial_state: dict[str, torch.Tensor] | None = None  # load these weights before setup (plain strategies)
    local_result: bool = True  # False where the result crosses processes (spawn launchers): losses only


@dataclass
class LoopResult:
    losses: list[float] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    initial_state: dict[str, torch.Tensor] = field(default_factory=dict)
    fabric: Fabric | None = None


def build_optimizer(spec: LoopSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    if spec.two_groups:
        decay = [p for p in trainable if p.dim() >= 2]
        rest = [p for p in trainable if p.dim() < 2]
        groups: Any = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}]
    else:
        groups = trainable
    if spec.optim == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01)


def batches(world_size: int, rank: int) -> Any:
    loader = make_loader(n_seq=64, batch_size=4)
    batches = list(loader)
    return itertools.cycle(batches[rank::world_size])


def _state(fabric: Fabric, model: Any) -> dict[str, torch.Tensor]:
    strategy = fabric.strategy
    if isinstance(strategy, PatrickStarFabricStrategy):
        sd = full_state_dict(strategy.chunk_manager)  # on every rank (a checkpoint gathers to rank 0 only)
    else:
        sd = strategy.get_module_state_dict(model._forward_module)
    return {k: v.detach().float().cpu().clone() for k, v in sd.items()}


def train(spec: LoopSpec) -> LoopResult:
    """Run the loop on every rank (in this process, or in the processes a spawn launcher starts: then rank 0's
    result comes back, losses only); see the module docstring."""
    fabric = Fabric(
        accelerator="cpu",
        devices=spec.devices,
        num_nodes=spec.num_nodes,
        strategy=spec.strategy,
        precision=spec.precision,
    )
    return fabric.launch(_loop, spec)


def _loop(fabric: Fabric, spec: LoopSpec) -> LoopResult:
    torch.manual_seed(SEED)
    if spec.empty_init:
        with fabric.init_module(empty_init=True):
            net = FlatGPT()
        assert all(p.is_meta for p in net.parameters())
    else:
        net = FlatGPT()
    if spec.initial_state is not None:
        net.load_state_dict(spec.initial_state)
    if spec.separate_setup:
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(build_optimizer(spec, model))
    else:
        model, optimizer = fabric.setup(net, build_optimizer(spec, net))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7) if spec.scheduler else None
    result = LoopResult(fabric=fabric if spec.local_result else None)
    result.initial_state = _state(fabric, model)
    start = 0
    if spec.resume_from is not None:
        state: dict[str, Any] = {"model": model, "optimizer": optimizer, "step": 0}
        if scheduler is not None:
            state["scheduler"] = scheduler
        fabric.load(spec.resume_from, state)
        start = int(state["step"])
    stream = batches(fabric.world_size, fabric.global_rank)
    for _ in range(start * spec.accumulate):
        next(stream)
    for step in range(start, spec.steps):
        for micro in range(spec.accumulate):
            x, y = next(stream)
            with fabric.no_backward_sync(model, enabled=micro < spec.accumulate - 1):
                loss = lm_loss(model(x), y)
                fabric.backward(loss / spec.accumulate)
            result.losses.append(float(loss.detach()))
        if spec.clip_norm is not None:
            norm = fabric.clip_gradients(model, optimizer, max_norm=spec.clip_norm)
            assert isinstance(norm, torch.Tensor) and norm.ndim == 0, f"clip_gradients returned {norm!r}"
            result.grad_norms.append(float(norm))  # what clip_gradients returned, before the step
        if spec.clip_val is not None:
            fabric.clip_gradients(model, optimizer, clip_val=spec.clip_val)
        result.lrs.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        if spec.clip_norm is not None and isinstance(fabric.strategy, PatrickStarFabricStrategy):
            # the step clipped with the very norm clip_gradients returned
            assert fabric.strategy.last_grad_norm(optimizer) == result.grad_norms[-1]
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        if spec.eval_between:
            with torch.no_grad():
                x, y = next(batches(1, 0))
                result.eval_losses.append(float(lm_loss(model(x), y)))
        if spec.save_at is not None and step + 1 == spec.save_at:
            assert spec.checkpoint is not None
            state = {"model": model, "optimizer": optimizer, "step": step + 1}
            if scheduler is not None:
                state["scheduler"] = scheduler
            fabric.save(spec.checkpoint, state)
    result.state = _state(fabric, model)
    if not spec.local_result:  # tensors through a spawn launcher's queue outlive their worker's shared memory
        result.state, result.initial_state = {}, {}
    return result
