"""Unit tests of lightning_pstar.runtime.hooks: module and gradient hooks driving a ChunkManager, without a Trainer.

Gradients read back from the chunks must equal those of the plain model, whatever the budget forces the
manager to evict between forward and backward (the storage-identity note in chunk.py)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pstar.checkpoint import full_state_dict, load_full_state_dict
from lightning_pstar.config import PStarConfig
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.hooks import ModelHooks
from lightning_pstar.runtime.manager import ChunkManager, MemoryBudgetError, ParamRecord
from lightning_pstar.runtime.state import TensorState, Tier

CPU = torch.device("cpu")
LAYER_CAP = 80  # one Linear(8, 8) per chunk


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 8))


class _Twice(nn.Module):
    """One module called twice in a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.shared = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(torch.relu(self.first(x)))
        return self.shared(torch.tanh(h))


class _Tied(nn.Module):
    """Embedding tied to the output projection (nanoGPT's wte / lm_head)."""

    def __init__(self, depth: int = 1) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(depth)])
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(idx)))


class _Functional(nn.Module):
    """An output projection tied by hand: the embedding weight read with ``F.linear`` in the parent's forward after
    the body ran (under a budget its chunk is on HOST then), and the embedding called again afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        tied = F.linear(self.body(self.emb(idx)), self.emb.weight)  # (B, T, 10)
        return tied + self.emb(idx).sum(-1, keepdim=True)


class _TwoWeights(nn.Module):
    """One autograd node (``a.weight * b.weight``) saving two weights of two chunk families outside their modules."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, bias=False)
        self.b = nn.Linear(8, 8, bias=False)
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(x @ (self.a.weight * self.b.weight))


def _setup(
    model: nn.Module,
    *,
    dtype: torch.dtype = torch.float32,
    chunk_size: int = LAYER_CAP,
    device_limit: int | None = None,
) -> tuple[ChunkManager, ModelHooks]:
    config = PStarConfig.from_flat(chunk_size=chunk_size, placement="static", device_memory_limit=device_limit)
    manager = ChunkManager(model, config=config, compute_dtype=dtype, device=CPU)
    manager.materialise()
    hooks = ModelHooks(manager)
    hooks.install()
    return manager, hooks


def _chunk_grad(manager: ChunkManager, record: ParamRecord) -> torch.Tensor:
    """The gradient of ``record`` as stored in the chunks (fp32)."""
    family = record.family
    if record.grad_in_param_slot:
        return family.param_chunk.slot_view(record.slot).float().clone()
    assert record.grad_in_grad_chunk, f"no gradient stored for {record.names}"
    return family.chunks[ChunkKind.GRAD].slot_view(record.slot).clone()


def _autocast(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    return torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out.float() ** 2).mean()


def _compare_grads(
    make: Callable[[], nn.Module],
    inputs: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    chunk_size: int = LAYER_CAP,
    device_limit: int | None = None,
    on_setup: Callable[[ChunkManager], None] | None = None,
) -> ChunkManager:
    model = make()
    # the reference of mixed precision (README.md, Precision): parameters are compute-dtype copies of the masters,
    # the forward runs under autocast
    reference = copy.deepcopy(model).to(dtype)
    with _autocast(dtype):
        ref_out = reference(inputs)
    _loss(ref_out).backward()

    manager, hooks = _setup(model, dtype=dtype, chunk_size=chunk_size, device_limit=device_limit)
    if on_setup is not None:
        on_setup(manager)
    with hooks.saved_tensors(), _autocast(dtype):  # as the strategy runs a training forward
        out = model(inputs)
    assert torch.equal(out, ref_out)
    _loss(out).backward()
    manager.finish_backward()

    ref_params = dict(reference.named_parameters())
    for record in manager.records:
        if not record.trainable:
            continue
        expected = ref_params[record.names[0]].grad
        assert expected is not None
        assert record.slot.state is TensorState.HOLD_AFTER_BWD, record.names
        assert torch.equal(_chunk_grad(manager, record), expected.float()), record.names
        assert record.param.grad is None  # the chunk holds it; autograd's copy is freed
    return manager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_equal_plain_model(dtype: torch.dtype) -> None:
    _compare_grads(_mlp, torch.randn(5, 8), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_equal_plain_model_under_eviction(dtype: torch.dtype) -> None:
    """A two-chunk budget for four chunk families: every chunk is evicted between forward and backward."""
    budget = 2 * LAYER_CAP * dtype.itemsize
    manager = _compare_grads(_mlp, torch.randn(5, 8), dtype=dtype, device_limit=budget)
    assert manager.stats.evictions >= 6
    assert manager.stats.peak_device_bytes <= budget


def test_module_called_twice() -> None:
    manager = _compare_grads(_Twice, torch.randn(3, 8), chunk_size=LAYER_CAP)
    assert len(manager.families) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_weights(dtype: torch.dtype) -> None:
    idx = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    manager = _compare_grads(_Tied, idx, dtype=dtype, chunk_size=96, device_limit=None)
    tied = [r for r in manager.records if len(r.names) == 2]
    assert len(tied) == 1


def test_tied_weights_under_eviction() -> None:
    # chunks: emb/head weight | body.0 | body.1; the budget holds two of them
    idx = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    manager = _compare_grads(lambda: _Tied(depth=2), idx, chunk_size=80, device_limit=2 * 80 * 4)
    assert len(manager.families) == 3
    assert manager.stats.evictions > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weight_used_outside_its_module_under_eviction(dtype: torch.dtype) -> None:
    """Chunks: emb | body.0 | body.2, two of them on the device: the embedding's chunk is on HOST when the parent
    reads its weight with F.linear, and moves again before that backward; the gradients equal the plain model's."""
    idx = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    seen: list[Tier | None] = []

    def probe(manager: ChunkManager) -> None:
        model = manager.module
        assert isinstance(model, _Functional)
        family = manager.record_of(model.emb.weight).family
        # runs right before F.linear(..., emb.weight), after the engine's post-forward hook of the body
        model.body.register_forward_hook(lambda *_: seen.append(family.param_chunk.tier))

    budget = 2 * 80 * dtype.itemsize
    manager = _compare_grads(_Functional, idx, dtype=dtype, chunk_size=80, device_limit=budget, on_setup=probe)
    assert seen == [Tier.HOST], "the weight was not read from an evicted chunk"
    assert manager.stats.evictions > 0


def test_weights_one_node_saved_stay_resident_while_it_runs() -> None:
    """Unpacking the second weight of a node must not evict the chunk of the first, whose view the node is about to
    read (that would read freed memory): with room for both the gradients are exact; without, a clear error."""
    manager = _compare_grads(_TwoWeights, torch.randn(3, 8), chunk_size=80, device_limit=2 * 80 * 4)
    assert manager.stats.evictions > 0
    model = _TwoWeights()
    manager, hooks = _setup(model, chunk_size=80, device_limit=80 * 4)  # one chunk: what one module needs
    with hooks.saved_tensors():
        out = model(torch.randn(3, 8))
    assert manager.record_of(model.a.weight).family.param_chunk.tier is Tier.HOST
    with pytest.raises(MemoryBudgetError, match="cannot make room.*HINT"):
        _loss(out).backward()


def test_weight_saved_outside_its_module_with_several_ranks_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """With several ranks a chunk is gathered only while one of its modules runs: a weight autograd saves outside
    its module is refused with an error naming it (every rank raises at the same point)."""
    model = _Functional()
    manager, hooks = _setup(model, chunk_size=80)
    monkeypatch.setattr(
        manager.sharding, "distributed", True
    )  # as with world_size > 1 (no module runs, nothing gathers)
    x = torch.randn(2, 8, requires_grad=True)
    with hooks.saved_tensors(), pytest.raises(RuntimeError, match=r"Parameter 'emb\.weight' is used outside.*HINT"):
        F.linear(x, model.emb.weight)


def test_weight_saved_outside_its_module_then_changed_raises() -> None:
    """A weight saved by reference that changes before its backward (here a load between forward and backward) is
    an error, as plain PyTorch raises for a saved parameter modified in place -- never a silently wrong gradient."""
    model = _Functional()
    manager, hooks = _setup(model, chunk_size=80)
    state = full_state_dict(manager)
    with hooks.saved_tensors():
        out = model(torch.tensor([[1, 2, 3]]))
    load_full_state_dict(manager, state)
    with pytest.raises(RuntimeError, match=r"Parameter 'emb\.weight' was saved for backward and has changed.*HINT"):
        _loss(out).backward()


def test_saved_tensor_hooks_keep_autograd_checks_and_free_dropped_graphs() -> None:
    """The saved-tensor hooks of a training forward must not change what plain autograd does with everything else:
    an activation or a weight modified in place before backward still raises autograd's error, and a graph dropped
    without backward (a training_step that returns None) is freed, not kept alive by a reference cycle."""
    import gc
    import weakref

    model = _Functional()
    _, hooks = _setup(model, chunk_size=80)
    idx = torch.tensor([[1, 2, 3]])
    with hooks.saved_tensors():
        act = torch.tanh(model.body(model.emb(idx)))  # tanh saves its output
        out = F.linear(act, model.emb.weight)
    with torch.no_grad():
        act.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    with hooks.saved_tensors():
        out = F.linear(torch.tanh(model.body(model.emb(idx))), model.emb.weight)
    with torch.no_grad():
        model.emb.weight.mul_(2)  # the weight saved by reference
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    with hooks.saved_tensors():
        dropped = torch.tanh(model.body(model.emb(idx)))
    ref = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert ref() is None, "a graph dropped without backward stayed alive"


def test_budget_accepted_by_the_planner_suffices_with_tied_weights() -> None:
    """The planner accepts a budget of one chunk because no single module needs more. But the tied weight stays
    in COMPUTE from the head's backward until the embedding's backward, so the body's chunk must fit next to
    it. A budget the planner accepts must carry the iteration (or be rejected at setup with the numbers)."""
    idx = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    model = _Tied(depth=1)
    reference = copy.deepcopy(model)
    _loss(reference(idx)).backward()
    manager, _ = _setup(model, chunk_size=80, device_limit=80 * 4)  # accepted: no MemoryBudgetError here
    _loss(model(idx)).backward()  # must not fail half-way through backward
    manager.finish_backward()
    for record in manager.records:
        assert torch.equal(_chunk_grad(manager, record), dict(reference.named_parameters())[record.names[0]].grad)


def test_frozen_layers_get_no_gradient_and_end_in_hold() -> None:
    def make() -> nn.Module:
        model = _mlp()
        for i in (0, 2):  # first layer (input without grad) and a middle layer
            for p in model[i].parameters():
                p.requires_grad_(False)
        return model

    manager = _compare_grads(make, torch.randn(4, 8))
    frozen = [r for r in manager.records if not r.trainable]
    assert len(frozen) == 4
    assert all(r.slot.state is TensorState.HOLD for r in frozen)
    assert not any(r.grad_in_grad_chunk or r.grad_in_param_slot for r in frozen)
    assert all(not f.trainable for f in {id(r.family): r.family for r in frozen}.values())


def test_states_after_forward_and_backward() -> None:
    model = _mlp()
    for p in model[2].parameters():
        p.requires_grad_(False)
    manager, _ = _setup(model)
    out = model(torch.randn(2, 8))
    trainable = [r for r in manager.records if r.trainable]
    frozen = [r for r in manager.records if not r.trainable]
    assert all(r.slot.state is TensorState.HOLD_AFTER_FWD for r in manager.records)
    # after forward no chunk is pinned: all may be evicted
    assert all(f.param_chunk.state.value == "hold" for f in manager.families)
    _loss(out).backward()
    assert all(r.slot.state is TensorState.HOLD_AFTER_BWD for r in trainable)
    assert all(r.slot.state is TensorState.HOLD for r in frozen)  # released after its module's backward
    manager.finish_backward()
    assert all(r.slot.state is TensorState.HOLD_AFTER_BWD for r in trainable)


def test_slots_are_compute_inside_forward() -> None:
    model = _mlp()
    manager, _ = _setup(model, device_limit=2 * LAYER_CAP * 4)
    seen: list[tuple[TensorState, ...]] = []

    def spy(module: nn.Module, args: object) -> None:
        seen.append(tuple(r.slot.state for r in manager.table.module_records[module]))
        assert all(r.family.param_chunk.tier is Tier.DEVICE for r in manager.table.module_records[module])

    # registered after install: runs after the engine's pre-forward hook
    handles = [model[i].register_forward_pre_hook(spy) for i in (0, 2, 4, 5)]
    model(torch.randn(2, 8))
    for h in handles:
        h.remove()
    assert seen == [(TensorState.COMPUTE, TensorState.COMPUTE)] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eval_forward_leaves_slots_hold(dtype: torch.dtype) -> None:
    model = _mlp()
    reference = copy.deepcopy(model).to(dtype)
    manager, _ = _setup(model, dtype=dtype, device_limit=2 * LAYER_CAP * dtype.itemsize)
    x = torch.randn(3, 8)
    with torch.no_grad(), _autocast(dtype):
        out = model(x)
        expected = reference(x)
    assert torch.equal(out, expected)
    assert all(r.slot.state is TensorState.HOLD for r in manager.records)
    assert not any(r.grad_in_grad_chunk or r.grad_in_param_slot for r in manager.records)


def test_a_forward_between_backward_and_step_reads_weights_and_keeps_the_gradients() -> None:
    """Running the model between backward and the optimizer step (an evaluation, a GAN's critic) computes with the
    weights, never the gradients the slots hold, and keeps those gradients for the step, summed in fp32 ([Note: a
    forward after the gradient] in runtime/manager.py)."""
    model = _mlp()
    reference = copy.deepcopy(model).bfloat16()
    manager, _ = _setup(model, dtype=torch.bfloat16)
    x = torch.randn(2, 8)
    with _autocast(torch.bfloat16):
        _loss(model(x)).backward()
    manager.finish_backward()
    before = {r.names[0]: _chunk_grad(manager, r) for r in manager.records}
    assert any(r.grad_in_param_slot for r in manager.records)  # chunk reuse: gradients in the slots
    with torch.no_grad():
        got = model(x.bfloat16())
        want = reference(x.bfloat16())
    assert torch.equal(got, want)
    for record in manager.records:
        assert not record.grad_in_param_slot and record.grad_in_grad_chunk
        assert torch.equal(_chunk_grad(manager, record), before[record.names[0]]), record.names


def test_second_iteration_after_discard() -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    manager, _ = _setup(model)
    for _ in range(2):
        x = torch.randn(2, 8)
        reference.zero_grad()
        _loss(reference(x)).backward()
        manager.finish_backward()
        _loss(model(x)).backward()
        manager.finish_backward()
        for record in manager.records:
            assert torch.equal(_chunk_grad(manager, record), dict(reference.named_parameters())[record.names[0]].grad)
        manager.discard_grads()


def test_remove_hooks_cleanly() -> None:
    model = _mlp()
    manager, hooks = _setup(model)
    assert all(len(m._forward_pre_hooks) == 1 and len(m._forward_hooks) == 1 for m in manager.table.module_records)
    hooks.remove()
    for module in model.modules():
        assert len(module._forward_pre_hooks) == 0
        assert len(module._forward_hooks) == 0
    for p in model.parameters():
        assert not getattr(p, "_post_accumulate_grad_hooks", None)
    hooks.remove()  # idempotent
    _loss(model(torch.randn(2, 8))).backward()
    # the engine saw nothing: states untouched, gradients stay where autograd puts them
    assert all(r.slot.state is TensorState.HOLD for r in manager.records)
    assert not any(r.grad_in_grad_chunk or r.grad_in_param_slot for r in manager.records)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("compiled", [False, True])
def test_hooks_run_eagerly_under_compile_only_when_the_model_holds_compiled_code(compiled: bool) -> None:
    """[Note: hooks under torch.compile]: a model holding a compiled submodule gets hooks dynamo does not trace
    (``torch.compiler.disable``); an eager model gets the plain hooks (the wrapper costs time on every call)."""
    model = _mlp()
    holder = nn.ModuleDict({"net": torch.compile(model) if compiled else model})
    config = PStarConfig.from_flat(chunk_size=LAYER_CAP, placement="static")
    manager = ChunkManager(holder, config=config, compute_dtype=torch.float32, device=CPU)
    manager.materialise()
    hooks = ModelHooks(manager)
    hooks.install()
    engine_hooks = [
        h for m in manager.table.module_records for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
    ]
    assert len(engine_hooks) == 2 * len(manager.table.module_records)
    disabled = [bool(getattr(h, "_torchdynamo_disable", False)) for h in engine_hooks]
    assert disabled == [compiled] * len(engine_hooks)
    hooks.remove()
