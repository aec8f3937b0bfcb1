"""Hard cases for the hooks and the state machine, each against plain Lightning on the same seed and data.

- activation checkpointing (``torch.utils.checkpoint``, reentrant and not): recomputation runs module forwards
  again inside backward;
- parameters used several times in one forward (a module in a loop, an RNN cell over time, a module called
  twice, a weight read outside its module);
- conditional parameters (mixture of experts with empty experts, a branch taken on some steps only);
- frozen backbones with LoRA-style adapters (memory and gradient traffic);
- awkward inputs (buffers, integer parameters, a parameter added after setup, weights read from callbacks);
- bad runs (an fp16 overflow storm, a NaN loss, an exception in ``training_step`` and the resume after it).

Most cases run twice under PatrickStar: with the default (unlimited) budget, and under a tight
``device_memory_limit`` with ``placement="static"`` and small chunks, so that chunks are evicted to HOST and
fetched back inside the iteration (checked: ``evictions > 0``). 32-true runs must give plain Lightning's losses
within 1e-5 (they are bitwise equal on one machine) and its final weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from helpers import BLOCK, VOCAB, Block, LossRecorder, make_loader, make_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_pstar import LossScaleConfig, PatrickStarPrecision, PatrickStarStrategy
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.precision import LossScaleUnderflowError
from lightning_pstar.runtime.state import Tier

H = 32  # width of every model here (helpers.Block is built for 32)
SEED = 1234
STEPS = 6
LOSS_RTOL = 1e-5


# --------------------------------------------------------------------------------------------------
# Shared pieces
# --------------------------------------------------------------------------------------------------


class LM(L.LightningModule):
    """Next-token cross entropy around ``build()``, a net mapping token ids (B, T) to logits (B, T, V).

    Args:
        build: returns the net; called right after ``torch.manual_seed(SEED)``.
        optim: "adamw" (fused, weight decay) or "sgd" (fused, momentum: a gradient off by a factor shows).
        all_params: give the optimizer every parameter, frozen ones too (torch skips those without a gradient).
    """

    def __init__(self, build: Callable[[], nn.Module], *, optim: str = "adamw", all_params: bool = False) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.net = build()
        self.optim = optim
        self.all_params = all_params

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad or self.all_params]
        if self.optim == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=True)


@dataclass
class Run:
    """What one ``fit`` produced."""

    module: L.LightningModule
    trainer: L.Trainer
    recorder: LossRecorder

    @property
    def losses(self) -> list[float]:
        return self.recorder.losses

    @property
    def final(self) -> dict[str, torch.Tensor]:
        return self.recorder.final_state


def fit(
    module: L.LightningModule,
    strategy: Any,
    *,
    precision: str = "32-true",
    steps: int = STEPS,
    loader: DataLoader | None = None,
    callbacks: Sequence[Callback] = (),
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> Run:
    recorder = LossRecorder()
    trainer = make_trainer(
        strategy=strategy,
        precision=precision,
        max_steps=steps,
        callbacks=[recorder, *callbacks],
        **trainer_kwargs,
    )
    data = loader if loader is not None else make_loader(n_seq=4 * steps)
    trainer.fit(module, train_dataloaders=data, ckpt_path=ckpt_path)
    return Run(module=module, trainer=trainer, recorder=recorder)


def tight(chunk_size: int, chunks: int, itemsize: int = 4) -> PatrickStarStrategy:
    """Static placement whose device budget holds ``chunks`` param chunks of ``chunk_size`` elements of
    ``itemsize`` bytes (4 in 32-true, 2 in bf16-mixed)."""
    limit = chunks * chunk_size * itemsize
    return PatrickStarStrategy(chunk_size=chunk_size, placement="static", device_memory_limit=limit)


def assert_evicted(strategy: PatrickStarStrategy) -> None:
    report = strategy.memory_report()
    assert report.evictions > 0, f"the budget never forced an eviction:\n{report}"
    assert report.device_memory_limit is not None
    assert report.peak_device_chunk_bytes <= report.device_memory_limit, report


def assert_same_run(got: Run, ref: Run, *, what: str, rtol: float = LOSS_RTOL) -> None:
    """Every loss within ``rtol`` of the reference, and the final weights (and buffers) close to it."""
    assert len(got.losses) == len(ref.losses), f"{what}: {len(got.losses)} losses vs {len(ref.losses)}"
    for i, (a, b) in enumerate(zip(got.losses, ref.losses, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{what}: step {i}: patrickstar {a!r} vs plain Lightning {b!r}"
    assert sorted(got.final) == sorted(ref.final), f"{what}: state_dict keys differ"
    for name, value in ref.final.items():
        torch.testing.assert_close(
            got.final[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{what}: final {n}: {m}"
        )


def lm_data(n_seq: int, seed: int = 4321) -> TensorDataset:
    """Arithmetic token sequences (learnable) with inputs and targets shifted by one."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n_seq, 1), generator=g)
    stride = torch.randint(1, 4, (n_seq, 1), generator=g)
    seq = (start + stride * torch.arange(BLOCK + 1)) % VOCAB  # (N, BLOCK + 1)
    return TensorDataset(seq[:, :-1].contiguous(), seq[:, 1:].contiguous())


# --------------------------------------------------------------------------------------------------
# 1. Activation checkpointing
# --------------------------------------------------------------------------------------------------


class CountingBlock(Block):
    """helpers.Block that counts its forward calls (recomputation included)."""

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
        self.wte = nn.Embedding(VOCAB, H)
        self.wpe = nn.Embedding(BLOCK, H)
        self.blocks = nn.ModuleList([CountingBlock() for _ in range(3)])
        self.head = nn.Linear(H, VOCAB)

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

    ref = fit(LM(build), "auto")
    calls = [b.calls for b in ref.module.net.blocks]
    assert calls == [2 * STEPS] * 3, f"checkpointing did not recompute: {calls}"
    got = fit(LM(build), PatrickStarStrategy())
    assert_same_run(got, ref, what="unlimited")
    assert [b.calls for b in got.module.net.blocks] == calls
    # 4096-element chunks; 4 of them: a block's backward pins the chunks of the module it is in while the
    # recomputation of the same block (non-reentrant) fetches the chunks of the modules before it
    strategy = tight(4096, 4)
    got = fit(LM(build), strategy)
    assert_evicted(strategy)
    assert_same_run(got, ref, what="tight budget")
    assert [b.calls for b in got.module.net.blocks] == calls


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_bf16(use_reentrant: bool) -> None:
    """bf16-mixed, where a final gradient overwrites its parameter's slot: a recomputation must still read weights.
    Evictions change nothing (bitwise), and the run stays close to plain Lightning's bf16-mixed."""

    def build() -> nn.Module:
        return CheckpointedGPT(use_reentrant)

    data = DataLoader(lm_data(4 * STEPS), batch_size=4, shuffle=False)
    ref = fit(LM(build), "auto", precision="bf16-mixed", loader=data)
    free = fit(LM(build), PatrickStarStrategy(), precision="bf16-mixed", loader=data)
    strategy = tight(4096, 4, itemsize=2)
    got = fit(LM(build), strategy, precision="bf16-mixed", loader=data)
    assert_evicted(strategy)
    assert got.losses == free.losses, "evictions changed the arithmetic"
    for name, value in free.final.items():
        assert torch.equal(got.final[name], value), name
    assert got.losses[-1] < got.losses[0]
    for a, b in zip(got.losses, ref.losses, strict=True):
        assert a == pytest.approx(b, rel=2e-2)


# --------------------------------------------------------------------------------------------------
# 2. Parameters used several times in one forward
# --------------------------------------------------------------------------------------------------


class MultiUse(nn.Module):
    """Embedding, a body that uses parameters several times, and a head. ``kind``:

    - ``loop``: one Linear applied four times in a row;
    - ``rnn``: an ``nn.RNNCell`` stepped over the sequence (its module called T times);
    - ``twice``: one Linear called, then another, then the first again;
    - ``functional``: the embedding weight read with ``F.linear`` outside the embedding's forward (an output
      projection tied by hand), after other modules ran, and the embedding module called again afterwards.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, H)
        self.lin = nn.Linear(H, H)
        self.mid = nn.Linear(H, H)
        self.cell = nn.RNNCell(H, H)
        self.head = nn.Linear(H, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, C)
        if self.kind == "loop":
            for _ in range(4):
                x = torch.tanh(self.lin(x))
        elif self.kind == "rnn":
            h = torch.zeros(x.shape[0], H, device=x.device, dtype=x.dtype)
            steps = []
            for t in range(x.shape[1]):
                h = self.cell(x[:, t], h)  # (B, C)
                steps.append(h)
            x = torch.stack(steps, dim=1)
        elif self.kind == "twice":
            x = torch.tanh(self.lin(torch.tanh(self.mid(torch.tanh(self.lin(x))))))
        elif self.kind == "functional":
            x = torch.tanh(self.mid(torch.tanh(self.lin(x))))
            tied = F.linear(x, self.emb.weight)  # (B, T, V): the embedding weight, outside its module
            return tied + self.head(torch.tanh(self.emb(idx)))
        else:
            raise ValueError(self.kind)
        return self.head(x)


@pytest.mark.parametrize("kind", ["loop", "rnn", "twice", "functional"])
def test_parameters_used_several_times(kind: str) -> None:
    """The gradient of a parameter used several times is the sum over its uses: with SGD with momentum the losses
    and final weights equal plain Lightning's, also when the chunks are evicted between the uses. A weight read
    outside its module (``functional``) is saved by autograd while its chunk is on HOST and fetched back to the
    device before its backward (hooks.py, [Note: saved weights])."""

    def build() -> nn.Module:
        return MultiUse(kind)

    ref = fit(LM(build, optim="sgd"), "auto")
    got = fit(LM(build, optim="sgd"), PatrickStarStrategy())
    assert_same_run(got, ref, what=f"{kind}, unlimited")
    # 1100-element chunks (one Linear each, the RNN cell in two), two of them on the device
    strategy = tight(1100, 2)
    got = fit(LM(build, optim="sgd"), strategy)
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
    data = DataLoader(lm_data(4 * STEPS), batch_size=4, shuffle=False)
    ref_losses, ref_masters = reference_functional_mixed(dtype, data, STEPS)
    free = fit(LM(lambda: MultiUse("functional"), optim="sgd"), PatrickStarStrategy(), loader=data, **kwargs)
    probe = EvictionProbe()
    strategy = tight(1100, 2, itemsize=2)
    got = fit(LM(lambda: MultiUse("functional"), optim="sgd"), strategy, loader=data, callbacks=[probe], **kwargs)
    assert_evicted(strategy)
    assert len(probe.tiers) == STEPS and Tier.HOST in probe.tiers, f"never read from an evicted chunk: {probe.tiers}"
    for what, run in (("unlimited", free), ("tight budget", got)):
        assert len(run.losses) == STEPS
        for i, (a, b) in enumerate(zip(run.losses, ref_losses, strict=True)):
            assert abs(a - b) <= 1e-6 * abs(b), f"{what}, step {i}: patrickstar {a!r} vs reference {b!r}"
        for name, value in ref_masters.items():
            torch.testing.assert_close(run.final[name], value, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert got.losses[-1] < got.losses[0]


# --------------------------------------------------------------------------------------------------
# 3. Conditional parameters: mixture of experts and a branch taken on some steps
# --------------------------------------------------------------------------------------------------

N_EXPERTS = 4
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


class MoE(nn.Module):
    """Top-1 mixture of experts routed deterministically by token id (expert = token % N_EXPERTS); an expert
    that receives no token is not called. Plus ``extra``, a Linear run only when ``use_extra`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H)) for _ in range(N_EXPERTS)
        )
        self.extra = nn.Linear(H, H)
        self.head = nn.Linear(H, VOCAB)
        self.use_extra = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, C)
        flat = x.reshape(-1, H)  # (B*T, C)
        route = (idx % N_EXPERTS).reshape(-1)  # (B*T,)
        mixed = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().squeeze(1)
            if rows.numel():
                mixed = mixed.index_add(0, rows, expert(flat[rows]))
        x = x + mixed.view_as(x)
        if self.use_extra:
            x = x + torch.tanh(self.extra(x))
        return self.head(x)


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
    ref = fit(MoELM(), "auto", loader=loader, callbacks=[ref_probe])
    assert_conditional_updates(ref_probe, what="plain Lightning")  # the test's own premise
    for label, strategy in (("unlimited", PatrickStarStrategy()), ("tight budget", tight(2200, 2))):
        probe = StepProbe()
        got = fit(MoELM(), strategy, loader=loader, callbacks=[probe])
        if label == "tight budget":
            assert_evicted(strategy)
        assert_same_run(got, ref, what=label)
        assert_conditional_updates(probe, what=label)
        assert probe.counts == ref_probe.counts, f"{label}: optimizer step counts differ from plain Lightning"


# --------------------------------------------------------------------------------------------------
# 4. Frozen backbone with LoRA-style adapters
# --------------------------------------------------------------------------------------------------

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
        self.emb = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList([LoRALinear(H, H) for _ in range(3)])
        self.head = nn.Linear(H, VOCAB)
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
            assert not (record.slot_holds_grad or record.grad_chunk_has_data), f"{record.names}: gradient stored"
            assert record.slot.state.value != "hold_after_bwd", f"{record.names}: marked as holding a gradient"
        self.checked += 1


@pytest.mark.parametrize("all_params", [False, True], ids=["adapters-only", "all-params-to-optimizer"])
def test_lora_adapters_32_true(all_params: bool) -> None:
    """Only the adapters train: losses and weights equal plain Lightning's, frozen weights bitwise unchanged,
    frozen parameters never receive a gradient (even when the optimizer was given them)."""
    ref = fit(LM(LoRANet, all_params=all_params), "auto")
    probe = GradTrafficProbe()
    got = fit(LM(LoRANet, all_params=all_params), tight(1100, 2), callbacks=[probe])
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
    data = DataLoader(lm_data(4 * STEPS), batch_size=4, shuffle=False)
    ref = fit(LM(LoRANet), "auto", precision="bf16-mixed", loader=data)
    strategy = PatrickStarStrategy(chunk_size=1024, frozen_master=frozen_master)
    probes = [GradTrafficProbe(), FamilyProbe()]
    got = fit(LM(LoRANet), strategy, precision="bf16-mixed", loader=data, callbacks=probes)
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


# --------------------------------------------------------------------------------------------------
# 5. Awkward inputs: buffers, integer parameters, late parameters, weights read from callbacks
# --------------------------------------------------------------------------------------------------


class BufferNet(nn.Module):
    """Position ids as an integer buffer, and a BatchNorm whose running statistics update in training."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("position_ids", torch.arange(BLOCK))
        self.wte = nn.Embedding(VOCAB, H)
        self.wpe = nn.Embedding(BLOCK, H)
        self.lin = nn.Linear(H, H)
        self.bn = nn.BatchNorm1d(H)
        self.head = nn.Linear(H, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(self.position_ids[: idx.shape[1]])  # (B, T, C)
        x = self.bn(self.lin(x).transpose(1, 2)).transpose(1, 2)  # BatchNorm1d over channels: (B, C, T)
        return self.head(torch.tanh(x))


class BufferLM(LM):
    def __init__(self) -> None:
        super().__init__(BufferNet)
        self.buffers_seen: list[list[tuple[torch.device, torch.dtype]]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.buffers_seen.append([(b.device, b.dtype) for b in self.net.buffers()])
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_buffers_stay_with_their_modules(precision: str) -> None:
    """Buffers are not chunked: they sit on the compute device in their own dtype, BatchNorm's running statistics
    and batch counter update as in plain Lightning, and checkpoints keep them."""
    ref = fit(BufferLM(), "auto", precision=precision)
    strategy = tight(1100, 2, itemsize=4 if precision == "32-true" else 2)
    got = fit(BufferLM(), strategy, precision=precision)
    assert_evicted(strategy)
    # in every step: on the strategy's compute device (the simulated device of a CPU machine), own dtypes
    device = got.trainer.strategy.root_device
    assert device == torch.device("cpu")
    want = [(device, torch.int64), (device, torch.float32), (device, torch.float32), (device, torch.int64)]
    assert got.module.buffers_seen == [want] * STEPS
    assert [(b.dtype) for b in got.module.net.buffers()] == [b.dtype for b in ref.module.net.buffers()]
    assert sorted(got.final) == sorted(ref.final)  # the checkpoint's state has the buffers
    assert torch.equal(got.final["net.position_ids"], torch.arange(BLOCK).float())
    assert int(got.final["net.bn.num_batches_tracked"]) == STEPS
    if precision == "32-true":
        assert_same_run(got, ref, what="buffers")
        return
    # bf16: the strategy computes in bf16 with fp32 masters, plain Lightning keeps fp32 weights under autocast
    for a, b in zip(got.losses, ref.losses, strict=True):
        assert a == pytest.approx(b, rel=2e-2)
    for name in ("net.bn.running_mean", "net.bn.running_var"):
        torch.testing.assert_close(got.final[name], ref.final[name], rtol=5e-2, atol=2e-2, msg=name)
        assert not torch.equal(got.final[name], got.recorder.initial_state[name]), f"{name} never updated"


class IntParamNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.table = nn.Parameter(torch.arange(H), requires_grad=False)  # an integer parameter

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(F.one_hot(idx, H).float())


def test_integer_parameter_is_refused_at_setup() -> None:
    module = LM(IntParamNet)
    with pytest.raises(ValueError, match=r"Parameter 'net\.table' has dtype torch\.int64.*HINT: register"):
        fit(module, PatrickStarStrategy())


class LateParamLM(LM):
    """Adds ``late`` (a new trainable Parameter that scales the logits) at the start of batch 2."""

    def __init__(self, *, register_in_optimizer: bool = False) -> None:
        super().__init__(lambda: MultiUse("loop"))
        self.register_in_optimizer = register_in_optimizer

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 2:
            self.late = nn.Parameter(torch.full((VOCAB,), 0.5, device=self.device))
            if self.register_in_optimizer:
                self.trainer.optimizers[0].add_param_group({"params": [self.late]})

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.net(idx)
        late = getattr(self, "late", None)
        return logits if late is None else logits * late


def test_parameter_added_after_setup() -> None:
    """A parameter created during training is not in the chunks: it is used as an ordinary tensor and, not being
    in the optimizer, is not trained -- exactly what plain Lightning does. Adding it to the optimizer fails
    clearly instead of being ignored."""
    ref = fit(LateParamLM(), "auto")
    got = fit(LateParamLM(), PatrickStarStrategy())
    assert_same_run(got, ref, what="late parameter")
    assert torch.equal(got.final["late"], torch.full((VOCAB,), 0.5))
    with pytest.raises(NotImplementedError, match="parameter groups cannot be added.*HINT"):
        fit(LateParamLM(register_in_optimizer=True), PatrickStarStrategy())


class WeightReader(Callback):
    """Reads ``net.lin.weight`` directly (``.detach().float()``) at several points outside forward/backward, and,
    under PatrickStar, the fp32 master of the same parameter and the tier its chunk is on."""

    HOOKS = ("on_train_batch_start", "on_after_backward", "on_before_optimizer_step", "on_train_batch_end")

    def __init__(self) -> None:
        self.reads: dict[str, list[torch.Tensor]] = {h: [] for h in self.HOOKS}
        self.masters: dict[str, list[torch.Tensor]] = {h: [] for h in self.HOOKS}
        self.tiers: dict[str, list[Tier | None]] = {h: [] for h in self.HOOKS}

    def _read(self, hook: str, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        param = pl_module.net.lin.weight
        self.reads[hook].append(param.detach().float().clone())
        if isinstance(trainer.strategy, PatrickStarStrategy):
            manager = trainer.strategy.chunk_manager
            record = manager.record_of(param)
            family = record.family
            master = family.chunks.get(ChunkKind.MASTER, family.param_chunk)
            self.masters[hook].append(master.slot_view(record.slot).detach().float().clone())
            self.tiers[hook].append(family.param_chunk.tier)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._read("on_train_batch_start", trainer, pl_module)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._read("on_after_backward", trainer, pl_module)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._read("on_before_optimizer_step", trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._read("on_train_batch_end", trainer, pl_module)


class ReadingLM(LM):
    """Reads ``net.lin.weight`` in its own ``on_train_batch_end`` as well."""

    def __init__(self) -> None:
        super().__init__(lambda: MultiUse("twice"))
        self.reads: list[torch.Tensor] = []

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.reads.append(self.net.lin.weight.detach().float().clone())


def _fit_readers(precision: str) -> tuple[WeightReader, WeightReader, Run]:
    """Plain Lightning and PatrickStar (tight budget: the chunk of ``net.lin`` is evicted to HOST) with readers."""
    ref_reader = WeightReader()
    fit(ReadingLM(), "auto", precision=precision, callbacks=[ref_reader])
    reader = WeightReader()
    strategy = tight(1100, 2, itemsize=4 if precision == "32-true" else 2)
    got = fit(ReadingLM(), strategy, precision=precision, callbacks=[reader])
    assert_evicted(strategy)
    return ref_reader, reader, got


def _assert_reads_weights(
    ref: WeightReader, got: WeightReader, hooks: Sequence[str], precision: str, *, read_dtype: torch.dtype | None = None
) -> None:
    """Each read equals the fp32 master cast to ``read_dtype`` (default: the compute dtype), and plain Lightning's
    read at the same point."""
    compute_dtype = torch.float32 if precision == "32-true" else torch.bfloat16
    read_dtype = read_dtype or compute_dtype
    rtol, atol = (1e-5, 1e-6) if precision == "32-true" else (2e-2, 1e-2)
    for hook in hooks:
        assert len(got.reads[hook]) == len(ref.reads[hook]) == STEPS, hook
        for step, (read, master) in enumerate(zip(got.reads[hook], got.masters[hook], strict=True)):
            want = master.to(read_dtype).float()
            assert torch.equal(read, want), f"{hook}, step {step}: the parameter does not read as its weight"
            torch.testing.assert_close(
                read, ref.reads[hook][step], rtol=rtol, atol=atol, msg=lambda m, h=hook, s=step: f"{h} {s}: {m}"
            )


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_direct_weight_access_outside_forward(precision: str) -> None:
    """Reading a parameter in the LightningModule's or a callback's ``on_train_batch_start/end`` gives the current
    weight -- the fp32 master (32-true) or its compute-dtype copy (bf16) -- also when its chunk was evicted to
    HOST, and the same value plain Lightning has."""
    ref, reader, got = _fit_readers(precision)
    assert Tier.HOST in reader.tiers["on_train_batch_end"], "the read never hit an evicted chunk"
    _assert_reads_weights(ref, reader, ("on_train_batch_start", "on_train_batch_end"), precision)
    for a, b in zip(got.module.reads, reader.reads["on_train_batch_end"], strict=True):
        assert torch.equal(a, b)  # the module's own hook reads what the callback reads


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_weight_access_between_backward_and_step(precision: str) -> None:
    """``on_after_backward`` and ``on_before_optimizer_step`` run after the gradients are final and before the
    update: a parameter read there must still give the weight before the step (users log weight norms there),
    never the gradient that mixed precision stores in the parameter's slot. In that window a mixed-precision
    parameter reads as exactly its fp32 master (README.md, Precision); afterwards it is the compute-dtype copy
    again (checked in ``on_train_batch_end`` by ``test_direct_weight_access_outside_forward``)."""
    ref, reader, _ = _fit_readers(precision)
    hooks = ("on_after_backward", "on_before_optimizer_step")
    _assert_reads_weights(ref, reader, hooks, precision, read_dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# 6. Bad runs
# --------------------------------------------------------------------------------------------------


class InfLossLM(LM):
    """A loss that is always +inf: every fp16 step overflows."""

    def __init__(self) -> None:
        super().__init__(lambda: MultiUse("loop"))
        self.calls = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.calls += 1
        return super().training_step(batch, batch_idx) * float("inf")


def test_fp16_overflow_storm_stops_with_a_clear_error() -> None:
    """Scale 8 -> 4 -> 2 -> 1 (skipping each step), then the 4th overflow at min_scale=1 raises instead of
    skipping forever; no step ever touched the weights."""
    module = InfLossLM()
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    plugin = PatrickStarPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale=8.0, min_scale=1.0))
    with pytest.raises(LossScaleUnderflowError, match=r"minimum loss scale 1\.0 \(4 steps skipped.*HINT"):
        fit(module, PatrickStarStrategy(), plugins=[plugin], steps=50)
    assert module.calls == 4
    assert plugin.scale == 1.0 and plugin.skipped_steps == 4
    for name, value in module.state_dict().items():
        assert torch.equal(value.float(), initial[name].float()), f"{name} changed although every step was skipped"


class NaNLossLM(LM):
    """The loss of batch 2 is NaN."""

    def __init__(self) -> None:
        super().__init__(lambda: MultiUse("loop"))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if batch_idx == 2 else loss


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_nan_loss_behaves_as_plain_lightning(precision: str) -> None:
    """Plain Lightning does not stop on a NaN loss: the NaN gradient reaches AdamW, every weight becomes NaN and so
    does every later loss. PatrickStar must do the same (no silent skip, no crash)."""
    ref = fit(NaNLossLM(), "auto", precision=precision)
    got = fit(NaNLossLM(), PatrickStarStrategy(), precision=precision)
    assert ref.trainer.global_step == got.trainer.global_step == STEPS
    assert [math.isnan(v) for v in got.losses] == [math.isnan(v) for v in ref.losses] == [i >= 2 for i in range(STEPS)]
    rtol = LOSS_RTOL if precision == "32-true" else 2e-2
    for a, b in zip(got.losses[:2], ref.losses[:2], strict=True):
        assert a == pytest.approx(b, rel=rtol)
    for name, value in ref.final.items():
        assert torch.equal(got.final[name].isnan(), value.isnan()), f"{name}: NaN pattern differs"


class CrashingLM(LM):
    """Raises in ``training_step`` when ``global_step == crash_at``."""

    def __init__(self, crash_at: int | None = None) -> None:
        super().__init__(lambda: MultiUse("twice"))
        self.crash_at = crash_at

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.crash_at:
            raise RuntimeError(f"injected failure at step {self.crash_at}")
        return super().training_step(batch, batch_idx)


def _crash_and_resume(strategy: Callable[[], Any], tmp_path: Path, loader: DataLoader) -> tuple[dict[str, Any], Run]:
    """Train until the injected failure at step 7 with a checkpoint at every epoch end, then resume from
    ``last.ckpt`` in a new Trainer to step 9. Returns the checkpoint's contents and the resumed run."""
    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=-1)
    with pytest.raises(RuntimeError, match="injected failure at step 7"):
        fit(CrashingLM(crash_at=7), strategy(), steps=9, loader=loader, callbacks=[saver], enable_checkpointing=True)
    last = tmp_path / "last.ckpt"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"], f"left behind: {names}"
    contents = torch.load(last, map_location="cpu", weights_only=False)
    resumed = fit(CrashingLM(), strategy(), steps=9, loader=loader, ckpt_path=str(last))
    assert resumed.trainer.global_step == 9
    return contents, resumed


def test_exception_in_training_step_keeps_last_checkpoint_and_resume_works(tmp_path: Path) -> None:
    """3 batches per epoch, a checkpoint at every epoch end; a crash at step 7 (inside epoch 2) leaves the
    step-6 checkpoint intact (the weights and optimizer state plain Lightning has there), and a new Trainer
    resumes from it as plain Lightning resumes from its own. (Lightning replays one batch when it resumes from a
    checkpoint written in ``on_train_epoch_end``, so the reference is plain Lightning's own crash and resume.)"""
    loader = DataLoader(lm_data(12), batch_size=4, shuffle=False)  # 3 batches per epoch
    ref_ckpt, ref = _crash_and_resume(lambda: "auto", tmp_path / "plain", loader)
    got_ckpt, got = _crash_and_resume(PatrickStarStrategy, tmp_path / "pstar", loader)
    assert got_ckpt["global_step"] == ref_ckpt["global_step"] == 6 and got_ckpt["epoch"] == 1
    for name, value in ref_ckpt["state_dict"].items():
        torch.testing.assert_close(got_ckpt["state_dict"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    want_opt, got_opt = ref_ckpt["optimizer_states"][0]["state"], got_ckpt["optimizer_states"][0]["state"]
    assert sorted(got_opt) == sorted(want_opt)
    for index, state in want_opt.items():
        for key, value in state.items():
            torch.testing.assert_close(got_opt[index][key].float(), value.float(), rtol=1e-5, atol=1e-7)
    assert_same_run(got, ref, what="resumed")
