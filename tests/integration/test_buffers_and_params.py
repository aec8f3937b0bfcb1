"""Awkward inputs against plain Lightning: buffers, integer parameters, a parameter added after setup, and weights
read directly from callbacks and hooks outside forward and backward.

Each case runs under PatrickStar with the default (unlimited) budget and, where it says so, under a tight
``device_memory_limit`` with ``placement="static"`` and small chunks, so that chunks are evicted to HOST and
fetched back inside the iteration (checked: ``evictions > 0``). 32-true runs must give plain Lightning's losses
within 1e-5 (they are bitwise equal on one machine) and its final weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.config import OptimizerOverlap
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.state import Tier
from tests.helpers.asserts import assert_evicted, assert_same_run
from tests.helpers.models import BLOCK, N_EMBD, VOCAB, MultiUse
from tests.helpers.runs import LM, STEPS, FitResult, fit_steps, tight


class BufferNet(nn.Module):
    """Position ids as an integer buffer, and a BatchNorm whose running statistics update in training."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("position_ids", torch.arange(BLOCK))
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(BLOCK, N_EMBD)
        self.lin = nn.Linear(N_EMBD, N_EMBD)
        self.bn = nn.BatchNorm1d(N_EMBD)
        self.head = nn.Linear(N_EMBD, VOCAB)

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
    ref = fit_steps(BufferLM(), "auto", precision=precision)
    strategy = tight(1100, 2, itemsize=4 if precision == "32-true" else 2)
    # the serial step leaves host-stepped param chunks on the host: the reads below then hit evicted chunks (the
    # pipelined step keeps them on the device; tests/integration/test_step_pipeline.py covers its reads)
    strategy.config.placement.optimizer_overlap = OptimizerOverlap.OFF
    got = fit_steps(BufferLM(), strategy, precision=precision)
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
        self.lin = nn.Linear(N_EMBD, N_EMBD)
        self.table = nn.Parameter(torch.arange(N_EMBD), requires_grad=False)  # an integer parameter

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lin(F.one_hot(idx, N_EMBD).float())


def test_integer_parameter_is_refused_at_setup() -> None:
    module = LM(IntParamNet)
    with pytest.raises(ValueError, match=r"Parameter 'net\.table' has dtype torch\.int64.*HINT: register"):
        fit_steps(module, PatrickStarStrategy())


class LateParamLM(LM):
    """Adds ``late`` (a new trainable Parameter that scales the logits) at the start of batch 2."""

    def __init__(self, *, register_in_optimizer: bool = False) -> None:
        super().__init__(lambda: MultiUse("loop"))
        self.register_in_optimizer = register_in_optimizer

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 2:
            late = nn.Parameter(torch.full((VOCAB,), 0.5, device=self.device))
            if self.register_in_optimizer:
                self.trainer.optimizers[0].add_param_group({"params": [late]})
            self.late = late

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.net(idx)
        late = getattr(self, "late", None)
        return logits if late is None else logits * late


def test_parameter_added_after_setup() -> None:
    """A parameter created during training is in no chunk and in no optimizer: plain Lightning uses it as an
    ordinary tensor and silently never trains it; PatrickStar refuses it where it is assigned, naming it (issue
    31: [Note: parameters fixed at setup]). Adding one to the optimizer fails clearly instead of being ignored."""
    ref = fit_steps(LateParamLM(), "auto")
    assert torch.equal(ref.final["late"], torch.full((VOCAB,), 0.5))  # plain Lightning: never stepped
    with pytest.raises(RuntimeError, match=r"assigning 'late' after setup adds a parameter.*HINT: create"):
        fit_steps(LateParamLM(), PatrickStarStrategy())
    with pytest.raises(NotImplementedError, match="parameter groups cannot be added.*HINT"):
        fit_steps(LateParamLM(register_in_optimizer=True), PatrickStarStrategy())


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


def _fit_readers(precision: str) -> tuple[WeightReader, WeightReader, FitResult]:
    """Plain Lightning and PatrickStar (tight budget: the chunk of ``net.lin`` is evicted to HOST) with readers."""
    ref_reader = WeightReader()
    fit_steps(ReadingLM(), "auto", precision=precision, callbacks=[ref_reader])
    reader = WeightReader()
    strategy = tight(1100, 2, itemsize=4 if precision == "32-true" else 2)
    # the serial step leaves host-stepped param chunks on the host: the reads below then hit evicted chunks (the
    # pipelined step keeps them on the device; tests/integration/test_step_pipeline.py covers its reads)
    strategy.config.placement.optimizer_overlap = OptimizerOverlap.OFF
    got = fit_steps(ReadingLM(), strategy, precision=precision, callbacks=[reader])
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
