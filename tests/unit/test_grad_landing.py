"""Final gradients land per chunk family on one rank ([Note: gradients land per family] in runtime/grads.py): kept
by the hook, written into the chunks once the family is complete or the backward returns, before anything reads
them, and never more than one chunk's worth at a time. Reference: the same model's own autograd gradients."""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pstar.config import PStarConfig
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.grads import GradStore
from lightning_pstar.runtime.hooks import ModelHooks
from lightning_pstar.runtime.manager import ChunkManager, ParamRecord
from lightning_pstar.runtime.state import TensorState

CPU = torch.device("cpu")
CAP = 160  # two Linear(8, 8) per chunk family


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(6)])


def _setup(model: nn.Module, dtype: torch.dtype) -> tuple[ChunkManager, ModelHooks]:
    config = PStarConfig.from_flat(chunk_size=CAP, placement="static")
    manager = ChunkManager(model, config=config, compute_dtype=dtype, device=CPU)
    manager.materialise()
    hooks = ModelHooks(manager)
    hooks.install()
    return manager, hooks


def _stored(record: ParamRecord) -> torch.Tensor:
    family = record.family
    if record.grad_in_param_slot:
        return family.param_chunk.slot_view(record.slot).float()
    return family.chunks[ChunkKind.GRAD].slot_view(record.slot)


def _reference_grads(model: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(model).to(dtype)
    reference(x.to(dtype)).float().pow(2).mean().backward()
    return {n: p.grad.float() for n, p in reference.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_have_landed_when_backward_returns(dtype: torch.dtype) -> None:
    model = _mlp()
    x = torch.randn(4, 8)
    expected = _reference_grads(model, x, dtype)
    manager, hooks = _setup(model, dtype)
    landed: list[int] = []
    land = manager.grads._land
    manager.grads._land = lambda fid: (landed.append(fid), land(fid))[1]  # type: ignore[method-assign]
    with hooks.saved_tensors():
        out = model(x.to(dtype))
    out.float().pow(2).mean().backward()
    # no finish_backward: the callback queued on autograd's backward landed everything
    assert not manager.grads._waiting
    assert sorted(landed) == sorted({r.family.family_id for r in manager.records})  # once per family
    for record in manager.records:
        assert record.slot.state is TensorState.HOLD_AFTER_BWD and not record.waiting, record.names
        assert torch.equal(_stored(record), expected[record.names[0]]), record.names
        assert record.param.grad is None


def test_a_gradient_stored_outside_a_backward_lands_at_once() -> None:
    manager, _ = _setup(_mlp(), torch.float32)
    record = manager.records[0]
    grad = torch.full(record.slot.shape, 3.0)
    manager.grad_ready(record, grad)
    assert not manager.grads._waiting and not record.waiting
    assert record.slot.state is TensorState.HOLD_AFTER_BWD
    assert torch.equal(_stored(record), grad)


class _Boom(nn.Module):
    """Raises in the backward once the last layers' gradients have arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[:3](x)
        return self.net[3:](_RaiseInBackward.apply(h))


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def test_a_backward_that_raises_lands_what_arrived() -> None:
    model = _Boom()
    manager, hooks = _setup(model, torch.bfloat16)
    with hooks.saved_tensors():
        out = model(torch.randn(4, 8).bfloat16())
    with pytest.raises(RuntimeError, match="boom"):
        out.float().pow(2).mean().backward()
    waiting = [r for r in manager.records if r.waiting]
    assert waiting, "a family whose gradients had not all arrived should be waiting"
    arrived = {r.names[0] for r in manager.records if r.waiting or r.slot.state is TensorState.HOLD_AFTER_BWD}
    weights = {r.names[0]: r.param.detach().clone() for r in waiting}
    manager.grads.settle()  # what the strategy's and Fabric's backward do when it raised (a `finally`)
    assert not manager.grads._waiting
    manager.finish_backward()  # the next micro-batch starts with it
    for record in manager.records:
        if record.names[0] in arrived:
            assert record.slot.state is TensorState.HOLD_AFTER_BWD and record.grad_in_param_slot, record.names
        else:
            assert record.slot.state is TensorState.HOLD and not record.has_grad, record.names
        if record.names[0] in weights:  # while the slot holds the gradient, the parameter reads the weight it had
            assert torch.equal(record.param.detach().bfloat16(), weights[record.names[0]])


def test_what_waits_stays_within_one_chunk_when_families_never_complete() -> None:
    model = _mlp()
    manager, hooks = _setup(model, torch.bfloat16)
    for layer in model:  # every family loses a parameter's gradient: none completes before the backward ends
        layer.bias.requires_grad_(False)
    store = manager.grads
    most = []
    store_local = store.store_local

    def watched(record: ParamRecord, grad: torch.Tensor) -> None:
        store_local(record, grad)
        most.append(store._waiting_numel)

    store.store_local = watched  # type: ignore[method-assign]
    with hooks.saved_tensors():
        out = model(torch.randn(4, 8).bfloat16())
    out.float().pow(2).mean().backward()
    assert len(most) == len(model)
    assert max(most) <= CAP and store._waiting_bound == CAP
    assert not store._waiting
    assert all(manager.record_of(layer.weight).grad_in_param_slot for layer in model)  # landed by chunk reuse
    assert all(manager.record_of(layer.weight).slot.state is TensorState.HOLD_AFTER_BWD for layer in model)


def test_a_second_gradient_in_one_backward_is_summed_with_the_first() -> None:
    """A parameter handed a second gradient in one backward (a reentrant checkpoint's inner backward, a retained
    graph's second backward) gets their sum, as ``p.grad`` does in plain PyTorch: the first lands, is kept as a sum,
    and the second adds to it ([Note: a forward after the gradient] in runtime/late_gradients.py)."""
    model = _mlp()
    config = PStarConfig.from_flat(chunk_size=1024, placement="static")  # one family holds every layer
    manager = ChunkManager(model, config=config, compute_dtype=torch.float32, device=CPU)
    manager.materialise()
    hooks = ModelHooks(manager)
    hooks.install()
    model[0].bias.requires_grad_(False)  # the family never completes: its gradients wait for the backward's end
    record = manager.record_of(model[5].weight)
    expected = _reference_grads(model, torch.ones(4, 8), torch.float32)["5.weight"]
    x = torch.ones(4, 8, requires_grad=True)
    with hooks.saved_tensors():
        out = model(x)

    def again(_: Any) -> None:  # the last node of the backward hands the engine layer 5's gradient a second time
        assert record.waiting
        manager.grad_ready(record, torch.ones(record.slot.shape))

    x.register_hook(again)
    out.pow(2).mean().backward()
    manager.finish_backward()
    assert not record.waiting and record.slot.state is TensorState.HOLD_AFTER_BWD
    torch.testing.assert_close(_stored(record), expected + 1, rtol=0, atol=0)


class _BoomLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _Boom()

    def training_step(self, batch: Any, i: int) -> torch.Tensor:
        self.manager = self.trainer.strategy._manager  # type: ignore[attr-defined]  # gone after a failed fit
        return self.model(batch[0]).float().pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


def test_the_strategy_lands_the_gradients_of_a_backward_that_raised() -> None:
    from lightning_pstar import PatrickStarStrategy

    strategy = PatrickStarStrategy(chunk_size=CAP, placement="static")
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4)
    module = _BoomLM()
    landed: list[int] = []
    real_land = GradStore._land

    def land(self: GradStore, fid: int) -> None:
        landed.append(fid)
        real_land(self, fid)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GradStore, "_land", land)
        with pytest.raises(RuntimeError, match="boom"):
            trainer.fit(module, data)
    manager = module.manager
    assert not manager.grads._waiting and not any(r.waiting for r in manager.records)
    # the last three layers' gradients arrived before the error: all of their families landed
    arrived = {manager.record_of(p).family.family_id for p in module.model.net[3:].parameters()}
    assert arrived <= set(landed)


class _OutsideUse(nn.Module):
    """``a.weight`` used again outside its module (saved by reference: runtime/saved_weights.py)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.h = torch.empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.h = self.a(x)
        return self.b(F.linear(self.h, self.a.weight))


def test_a_weight_saved_by_reference_reads_its_master_after_its_gradient_landed() -> None:
    x = torch.randn(4, 8)
    reference = _OutsideUse().bfloat16()
    loss = reference(x.bfloat16()).float().pow(2).sum()
    loss.backward(inputs=[reference.a.weight], retain_graph=True)
    (expected,) = torch.autograd.grad(loss, reference.h)
    model = _OutsideUse()
    manager, hooks = _setup(model, torch.bfloat16)
    with hooks.saved_tensors():
        out = model(x.bfloat16())
    loss = out.float().pow(2).sum()
    loss.backward(inputs=[model.a.weight], retain_graph=True)
    assert manager.record_of(model.a.weight).grad_in_param_slot  # its gradient replaced the weight in the slot
    # a second backward reads the saved a.weight (no second gradient for it): the weight, from the fp32 master
    (got,) = torch.autograd.grad(loss, model.h)
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_a_landing_that_runs_out_of_memory_raises_that_error_and_leaves_nothing_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_pstar.runtime.chunk import Chunk

    model = _mlp()
    manager, hooks = _setup(model, torch.float32)
    real = Chunk.allocate

    def allocate(self: Chunk, tier: Any, **kwargs: Any) -> None:
        if self.kind is ChunkKind.GRAD:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        real(self, tier, **kwargs)

    for family in manager.families:  # no GRAD chunk yet: the landing allocates one
        family.chunks.pop(ChunkKind.GRAD, None)
    monkeypatch.setattr(Chunk, "allocate", allocate)
    with hooks.saved_tensors():
        out = model(torch.randn(4, 8))
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        try:
            out.pow(2).mean().backward()
        except BaseException:
            manager.grads.settle()  # as the strategy's backward does; it must not mask the error
            raise
    assert not manager.grads._waiting and not any(r.waiting for r in manager.records)
    assert all(ChunkKind.GRAD not in f.chunks for f in manager.families)  # none left without storage
    monkeypatch.setattr(Chunk, "allocate", real)
    manager.finish_backward()
    manager.discard_grads()  # a caller that caught the error carries on
    assert all(r.slot.state is TensorState.HOLD and not r.has_grad for r in manager.records)


def test_a_mixed_precision_landing_that_fails_midway_gives_the_slots_their_weights_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _mlp()
    manager, hooks = _setup(model, torch.bfloat16)
    weights = {r.names[0]: r.family.param_chunk.slot_view(r.slot).clone() for r in manager.records}

    def half_then_fail(self: GradStore, chunk: Any, pairs: Any, *, add: bool) -> None:
        record, grad = pairs[0]
        chunk.slot_view(record.slot).copy_(grad)  # one gradient over its weight, then the interrupt
        raise KeyboardInterrupt

    monkeypatch.setattr(GradStore, "_write", half_then_fail)
    with hooks.saved_tensors():
        out = model(torch.randn(4, 8).bfloat16())
    with pytest.raises(KeyboardInterrupt):
        out.float().pow(2).mean().backward()
    assert not manager.grads._waiting and not any(r.waiting for r in manager.records)
    for record in manager.records:  # every weight intact, and the parameter reads it from its slot
        assert not record.grad_in_param_slot, record.names
        assert torch.equal(record.family.param_chunk.slot_view(record.slot), weights[record.names[0]]), record.names
        assert torch.equal(record.param.detach(), weights[record.names[0]])
