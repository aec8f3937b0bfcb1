"""Conditional parameters against plain Lightning: a mixture of experts whose experts receive no token on some steps,
and a branch taken on some steps only.

Each case runs under PatrickStar with the default (unlimited) budget and, where it says so, under a tight
``device_memory_limit`` with ``placement="static"`` and small chunks, so that chunks are evicted to HOST and
fetched back inside the iteration (checked: ``evictions > 0``). 32-true runs must give plain Lightning's losses
within 1e-5 (they are bitwise equal on one machine) and its final weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import PatrickStarStrategy
from tests.helpers.asserts import assert_evicted, assert_same_run
from tests.helpers.models import BLOCK, N_EXPERTS, VOCAB, MoE
from tests.helpers.runs import LM, STEPS, fit_steps, tight

# the expert every token of sequence j is routed to; steps take sequences 4k..4k+3
MOE_PATTERN = [0, 1, 0, 1, 2, 2, 0, 3, 1, 3, 1, 3, 0, 2, 1, 3, 3, 3, 3, 3, 0, 1, 2, 2]
BRANCH_EVERY = 3  # the extra branch runs when batch_idx % 3 == 1


def moe_data(pattern: Sequence[int] = MOE_PATTERN, seed: int = 99) -> TensorDataset:
    """Sequence j holds only tokens t with ``t % N_EXPERTS == pattern[j]`` (so routing empties some experts);
    targets are random."""
    g = torch.Generator().manual_seed(seed)
    n = len(pattern)
    expert = torch.tensor(pattern).view(n, 1)
    tokens = torch.randint(0, VOCAB // N_EXPERTS, (n, BLOCK), generator=g) * N_EXPERTS + expert
    targets = torch.randint(0, VOCAB, (n, BLOCK), generator=g)
    return TensorDataset(tokens, targets)


def experts_used(pattern: Sequence[int], step: int, per_step: int = 4) -> set[int]:
    return set(pattern[step * per_step : (step + 1) * per_step])


class MoELM(LM):
    def __init__(self) -> None:
        super().__init__(MoE)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.net.use_extra = batch_idx % BRANCH_EVERY == 1
        return super().training_step(batch, batch_idx)


class StepProbe(Callback):
    """After every optimizer step: the consolidated weights and each parameter's optimizer step count."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.counts: list[dict[str, int]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._record(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._record(trainer, pl_module)

    def _record(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = trainer.strategy.lightning_module_state_dict()
        self.weights.append({k: v.detach().float().cpu().clone() for k, v in state.items()})
        names = [n for n, p in pl_module.named_parameters() if p.requires_grad]  # configure_optimizers' order
        opt_state = trainer.optimizers[0].state_dict()["state"]
        self.counts.append({n: int(opt_state[i]["step"]) if i in opt_state else 0 for i, n in enumerate(names)})


def _params_of(prefix: str, names: Sequence[str]) -> list[str]:
    return [n for n in names if n.startswith(prefix)]


def assert_conditional_updates(probe: StepProbe, *, what: str) -> None:
    """A parameter without a gradient this step keeps its weights and its AdamW step count; one with a gradient
    is updated and counted."""
    names = list(probe.counts[0])
    for step in range(STEPS):
        used = experts_used(MOE_PATTERN, step)
        groups = {f"net.experts.{e}.": e in used for e in range(N_EXPERTS)}
        groups["net.extra."] = step % BRANCH_EVERY == 1
        for prefix, active in groups.items():
            for name in _params_of(prefix, names):
                before, after = probe.weights[step][name], probe.weights[step + 1][name]
                n0, n1 = probe.counts[step][name], probe.counts[step + 1][name]
                if active:
                    assert not torch.equal(before, after), f"{what}: step {step}: {name} was used but not updated"
                    assert n1 == n0 + 1, f"{what}: step {step}: {name} step count {n0} -> {n1}"
                else:
                    assert torch.equal(before, after), f"{what}: step {step}: {name} had no gradient but changed"
                    assert n1 == n0, f"{what}: step {step}: {name} had no gradient but its step count went {n0}->{n1}"


def test_conditional_experts_and_branch() -> None:
    """Experts that receive no token and a branch skipped on most steps: no stale gradient, no update of a
    parameter without a gradient (weights and AdamW step count unchanged), losses as plain Lightning."""
    # every expert is empty on some step and used on another; the branch runs on steps 1 and 4
    for e in range(N_EXPERTS):
        flags = [e in experts_used(MOE_PATTERN, s) for s in range(STEPS)]
        assert any(flags) and not all(flags), (e, flags)
    loader = DataLoader(moe_data(), batch_size=4, shuffle=False)
    ref_probe = StepProbe()
    ref = fit_steps(MoELM(), "auto", loader=loader, callbacks=[ref_probe])
    assert_conditional_updates(ref_probe, what="plain Lightning")  # the test's own premise
    for label, strategy in (("unlimited", PatrickStarStrategy()), ("tight budget", tight(2200, 2))):
        probe = StepProbe()
        got = fit_steps(MoELM(), strategy, loader=loader, callbacks=[probe])
        if label == "tight budget":
            assert_evicted(strategy)
        assert_same_run(got, ref, what=label)
        assert_conditional_updates(probe, what=label)
        assert probe.counts == ref_probe.counts, f"{label}: optimizer step counts differ from plain Lightning"
