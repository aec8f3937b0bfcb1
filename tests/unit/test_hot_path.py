"""Unit tests of the engine's per-module hot path (issue 18): cached slot views ([Note: cached views] in
chunk.py), the gradient location's two bools, state moves per module list, the param-chunks-on-host count
that lets a prefetch return at once, and the one-rank fetch that skips resident chunks without a budget."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pstar.config import PStarConfig
from lightning_pstar.runtime.chunk import Chunk, ChunkKind, Slot, TransferStats
from lightning_pstar.runtime.family import move_slots, release_slots
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.state import (
    ALLOWED_TRANSITIONS,
    SOURCES_OF,
    GradLocation,
    InvalidTransitionError,
    TensorState,
    Tier,
)

CPU = torch.device("cpu")
CAP = 80  # one Linear(8, 8) (64 + 8 elements) per chunk
LAYER_BYTES_FP32 = CAP * 4


def _chunk(stats: TransferStats, kind: ChunkKind = ChunkKind.PARAM) -> tuple[Chunk, list[Slot]]:
    slots = [
        Slot(name="w", offset=0, numel=6, shape=torch.Size([2, 3])),
        Slot(name="b", offset=8, numel=4, shape=torch.Size([4])),
    ]
    return Chunk(chunk_id=0, kind=kind, dtype=torch.float32, capacity=16, slots=slots, device=CPU, stats=stats), slots


def _manager(model: nn.Module, *, dtype: torch.dtype = torch.float32, device_limit: int | None = None) -> ChunkManager:
    config = PStarConfig.from_flat(chunk_size=CAP, placement="static", device_memory_limit=device_limit)
    manager = ChunkManager(model, config=config, compute_dtype=dtype, device=CPU, precision=str(dtype))
    manager.materialise()
    return manager


def _mlp(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])


# ---- cached views ----------------------------------------------------------------------------------------
def test_cached_view_reads_the_bytes_of_the_tier_the_chunk_is_on() -> None:
    chunk, (w, _) = _chunk(TransferStats())
    chunk.allocate(Tier.DEVICE)
    on_device = chunk.slot_view(w)
    on_device.copy_(torch.arange(6.0).view(2, 3))
    assert chunk.slot_view(w) is on_device  # taken once per buffer
    chunk.move_to(Tier.HOST)
    on_host = chunk.slot_view(w)
    assert on_host is not on_device and on_host.untyped_storage().data_ptr() != 0
    assert torch.equal(on_host, torch.arange(6.0).view(2, 3))
    on_host.mul_(10)  # written while on the host (a host optimizer step)
    chunk.move_to(Tier.DEVICE)
    again = chunk.slot_view(w)
    # the device view taken before the eviction is handed out again and reads the refilled storage
    assert again is on_device
    assert torch.equal(again, 10 * torch.arange(6.0).view(2, 3))
    assert again.untyped_storage().data_ptr() == chunk.device_buffer.untyped_storage().data_ptr()


def test_cached_views_are_per_slot_even_where_offsets_coincide() -> None:
    empty = Slot(name="e", offset=4, numel=0, shape=torch.Size([0, 3]))
    full = Slot(name="f", offset=4, numel=4, shape=torch.Size([2, 2]))
    chunk = Chunk(chunk_id=0, kind=ChunkKind.PARAM, dtype=torch.float32, capacity=8, slots=[empty, full],
                  device=CPU, stats=TransferStats())  # fmt: skip
    chunk.allocate(Tier.DEVICE)
    assert chunk.slot_view(empty).shape == (0, 3)
    assert chunk.slot_view(full).shape == (2, 2)
    assert chunk.slot_view(empty).shape == (0, 3)


def test_a_new_buffer_tensor_invalidates_the_cached_views() -> None:
    chunk, (w, _) = _chunk(TransferStats())
    chunk.allocate(Tier.DEVICE)
    old = chunk.slot_view(w)
    replacement = torch.full((16,), 7.0)
    chunk._device_buffer = replacement  # what a buffer replaced by a new tensor would look like
    fresh = chunk.slot_view(w)
    assert fresh is not old
    assert fresh.untyped_storage().data_ptr() == replacement.untyped_storage().data_ptr()
    assert torch.equal(fresh, torch.full((2, 3), 7.0))


def test_a_parameter_repointed_after_its_chunk_moved_reads_the_right_bytes() -> None:
    model = _mlp(layers=2)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    manager = _manager(model, device_limit=LAYER_BYTES_FP32)  # one chunk on the device at a time
    records = [manager.table.module_records[model[i]] for i in range(2)]
    for _ in range(2):  # each access evicts the other layer's chunk: the cached views of both tiers are reused
        for i in range(2):
            manager.access(records[i], TensorState.COMPUTE)
            chunk = records[i][0].family.param_chunk
            assert chunk.tier is Tier.DEVICE
            weight = model[i].weight
            assert weight.untyped_storage().data_ptr() == chunk.device_buffer.untyped_storage().data_ptr()
            assert torch.equal(weight.detach(), expected[f"{i}.weight"])
            other = model[1 - i].weight  # evicted: the parameter reads the host copy
            assert records[1 - i][0].family.param_chunk.tier is Tier.HOST
            assert torch.equal(other.detach(), expected[f"{1 - i}.weight"])
            manager.release(records[i], TensorState.HOLD)


def test_mixed_precision_gradient_points_the_parameter_at_its_master_and_back() -> None:
    model = _mlp(layers=1)
    weight = model[0].weight.detach().clone()
    manager = _manager(model, dtype=torch.bfloat16)
    record = manager.record_of(model[0].weight)
    master = record.family.chunks[ChunkKind.MASTER]
    grad = torch.full((8, 8), 0.5, dtype=torch.bfloat16)
    for _ in range(2):  # the second round uses the cached views
        manager.grad_ready(record, grad)
        assert record.grad_in_param_slot and record.grad is GradLocation.PARAM_SLOT
        assert model[0].weight.dtype == torch.float32 and torch.equal(model[0].weight.detach(), weight)
        assert model[0].weight.untyped_storage().data_ptr() == master.device_buffer.untyped_storage().data_ptr()
        assert torch.equal(record.family.param_chunk.slot_view(record.slot), grad)
        manager.discard_grads()  # the weight goes back into the slot, the parameter with it
        assert not record.has_grad and record.grad is GradLocation.NONE
        assert model[0].weight.dtype == torch.bfloat16
        assert torch.equal(model[0].weight.detach(), weight.to(torch.bfloat16))


def test_grad_location_property_round_trips_the_two_bools() -> None:
    model = _mlp(layers=1)
    record = _manager(model).record_of(model[0].weight)
    for location in (GradLocation.NONE, GradLocation.PARAM_SLOT, GradLocation.GRAD_CHUNK,
                     GradLocation.PARAM_SLOT | GradLocation.GRAD_CHUNK):  # fmt: skip
        record.grad = location
        assert record.grad == location
        assert record.grad_in_param_slot == (GradLocation.PARAM_SLOT in location)
        assert record.grad_in_grad_chunk == (GradLocation.GRAD_CHUNK in location)
        assert record.has_grad == bool(location)


# ---- states --------------------------------------------------------------------------------------------
def test_sources_of_is_the_transition_table_by_target() -> None:
    pairs = {(current, new) for new, sources in SOURCES_OF.items() for current in sources}
    assert pairs == set(ALLOWED_TRANSITIONS)


def test_move_slots_raises_on_a_disallowed_pair_naming_the_parameter() -> None:
    model = _mlp(layers=2)
    manager = _manager(model)
    records = manager.table.module_records[model[1]]
    move_slots(records, TensorState.COMPUTE)
    assert all(r.slot.state is TensorState.COMPUTE for r in records)
    records[1].slot.set_state(TensorState.HOLD, chunk_id=1)
    records[1].slot.set_state(TensorState.HOLD_AFTER_BWD, chunk_id=1)
    with pytest.raises(InvalidTransitionError, match=r"hold_after_bwd -> compute for parameter '1.bias' \(chunk 1\)"):
        move_slots(records, TensorState.COMPUTE)
    with pytest.raises(InvalidTransitionError, match=r"compute -> free for parameter '1.weight'"):
        release_slots(records, TensorState.FREE)


def test_release_slots_sends_frozen_parameters_to_their_own_state() -> None:
    model = _mlp(layers=1)
    model[0].bias.requires_grad_(False)
    manager = _manager(model)
    records = manager.table.module_records[model[0]]
    move_slots(records, TensorState.COMPUTE)
    release_slots(records, TensorState.HOLD_AFTER_FWD, frozen=TensorState.HOLD)
    states = {r.names[0]: r.slot.state for r in records}
    assert states == {"0.weight": TensorState.HOLD_AFTER_FWD, "0.bias": TensorState.HOLD}


# ---- residency ------------------------------------------------------------------------------------------
def test_param_chunks_on_host_counts_every_tier_change() -> None:
    stats = TransferStats()
    param, _ = _chunk(stats)
    master, _ = _chunk(stats, ChunkKind.MASTER)
    master.allocate(Tier.HOST)
    assert stats.param_chunks_on_host == 0  # only param chunks count
    param.allocate(Tier.HOST)
    assert stats.param_chunks_on_host == 1
    param.move_to(Tier.DEVICE, keep_host_copy=True)
    assert stats.param_chunks_on_host == 0
    param.move_to(Tier.HOST)  # a clean eviction
    assert stats.clean_moves == 1 and stats.param_chunks_on_host == 1
    param.move_to(Tier.DEVICE)
    param.move_to(Tier.HOST)  # a dirty one
    assert stats.dirty_moves == 1 and stats.param_chunks_on_host == 1
    param.release()
    assert stats.param_chunks_on_host == 0


def test_without_a_budget_a_chunk_on_the_host_is_still_fetched() -> None:
    model = _mlp(layers=2)
    expected = model[0].weight.detach().clone()
    manager = _manager(model)  # no device budget: the fetch of resident chunks is skipped
    family = manager.record_of(model[0].weight).family
    manager.residency.move_param_chunk(family, Tier.HOST)  # as a host optimizer step would
    assert manager.stats.param_chunks_on_host == 1
    manager.access(manager.table.module_records[model[0]], TensorState.COMPUTE)
    assert family.param_chunk.tier is Tier.DEVICE and manager.stats.param_chunks_on_host == 0
    weight = model[0].weight
    assert weight.untyped_storage().data_ptr() == family.param_chunk.device_buffer.untyped_storage().data_ptr()
    assert torch.equal(weight.detach(), expected)


def test_with_a_budget_every_fetch_still_counts_as_a_use() -> None:
    model = _mlp(layers=3)
    manager = _manager(model, device_limit=2 * LAYER_BYTES_FP32)
    records = [manager.table.module_records[model[i]] for i in range(3)]
    for i in (1, 2, 1):  # 1 and 2 resident; 1 used last
        manager.access(records[i], TensorState.COMPUTE)
        manager.release(records[i], TensorState.HOLD)
    manager.access(records[0], TensorState.COMPUTE)  # evicts the least recently used resident chunk: 2
    on_device = [f.family_id for f in manager.families if f.param_chunk.tier is Tier.DEVICE]
    assert on_device == [0, 1]


# ---- backward hooks on autograd nodes ---------------------------------------------------------------------
class _Split(nn.Module):
    """A module whose inputs come from one autograd node (a split) and a leaf the caller made."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, a: torch.Tensor, b: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
        return self.inner(a + b + leaf)


def test_backward_hooks_fire_once_per_module_for_node_outputs_and_leaves() -> None:
    from lightning_pstar.runtime.hooks import ModelHooks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16))
    tail = _Split()
    manager = _manager(nn.ModuleDict({"head": model, "tail": tail}))
    hooks = ModelHooks(manager)
    hooks.install()
    calls: list[str] = []
    for name in ("pre_backward", "post_backward"):
        verb = getattr(manager, name)
        setattr(manager, name, lambda *a, _v=verb, _n=name: (calls.append(_n), _v(*a))[1])
    leaf = torch.randn(4, 8, requires_grad=True)
    with hooks.saved_tensors():
        a, b = model(torch.randn(4, 8)).split(8, dim=1)  # two inputs of `tail` from one SplitBackward node
        out = tail(a, b, leaf)
    out.sum().backward()
    # tail: one pre-backward (its output) and one post-backward (a, b and the leaf: the first gradient wins)
    assert calls.count("pre_backward") == 2 and calls.count("post_backward") == 1, calls
    assert leaf.grad is not None
    torch.testing.assert_close(leaf.grad, tail.inner.weight.detach().sum(0).expand(4, 8))
    hooks.remove()


def _hooked(model: nn.Module, dtype: torch.dtype = torch.float32) -> tuple[ChunkManager, Any]:
    from lightning_pstar.runtime.hooks import ModelHooks

    manager = _manager(model, dtype=dtype)
    hooks = ModelHooks(manager)
    hooks.install()
    manager.begin_training_batch()
    return manager, hooks


def test_post_backward_fires_for_an_input_whose_gradient_is_only_captured() -> None:
    model = _mlp(layers=2)
    manager, hooks = _hooked(model)
    fired: list[str] = []
    verb = manager.post_backward
    manager.post_backward = lambda records: (fired.append(records[0].names[0]), verb(records))[1]  # type: ignore[method-assign]
    h = torch.randn(4, 8, requires_grad=True) * 2  # a non-leaf input of layer 0: autograd.grad captures it
    with hooks.saved_tensors():
        out = model(h)
    (grad,) = torch.autograd.grad(out.pow(2).sum(), h)
    assert sorted(fired) == ["0.weight", "1.weight"]
    assert all(r.slot.state is not TensorState.COMPUTE for r in manager.records)  # nothing stays pinned


def test_hooks_on_a_leaf_input_do_not_pile_up() -> None:
    class Child(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return self.lin(x + pos)

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(8))
            self.child = Child()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.child(x, self.pos)

    model = Parent()
    manager, hooks = _hooked(model)
    for _ in range(4):
        manager.begin_training_batch()
        with hooks.saved_tensors():
            out = model(torch.randn(4, 8))
        out.sum().backward()
        manager.finish_backward()
        manager.discard_grads()
    assert len(model.pos._backward_hooks or {}) <= 1  # the last forward's only


def test_a_second_backward_through_a_weight_its_gradient_replaced_reads_the_weight() -> None:
    """A second backward through a retained graph runs through layer 1, whose gradient replaced its weight in the
    slot: its backward hook puts the weight back (the gradient kept as an fp32 sum, [Note: a forward after the
    gradient] in runtime/manager.py) and autograd reads the weight, so layer 0 gets plain PyTorch's gradient."""
    model = _mlp(layers=2)
    reference = copy.deepcopy(model).bfloat16()
    x = torch.randn(4, 8).bfloat16()
    ref_loss = reference(x).float().pow(2).sum()
    ref_loss.backward(inputs=list(reference[1].parameters()), retain_graph=True)
    ref_loss.backward(inputs=list(reference[0].parameters()))
    manager, hooks = _hooked(model, dtype=torch.bfloat16)
    with hooks.saved_tensors():
        out = model(x)
    loss = out.float().pow(2).sum()
    loss.backward(inputs=list(model[1].parameters()), retain_graph=True)  # layer 1's gradients replace its weights
    assert manager.record_of(model[1].weight).grad_in_param_slot
    loss.backward(inputs=list(model[0].parameters()))  # through layer 1 again: its weight, not its gradient
    manager.finish_backward()
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        record = manager.record_of(mine)
        chunks = record.family.chunks
        got = chunks[ChunkKind.GRAD].slot_view(record.slot).clone() if record.grad_in_grad_chunk else None
        if record.grad_in_param_slot:
            slot = record.family.param_chunk.slot_view(record.slot).float()
            got = slot if got is None else got + slot
        assert got is not None, record.names
        torch.testing.assert_close(got, theirs.grad.float(), rtol=0, atol=0, msg=record.names[0])


def test_a_second_backward_through_a_replaced_weight_raises_when_stationary() -> None:
    """Without backward hooks (the stationary engine after the warm-up) nothing puts the weight back: autograd's
    in-place check refuses to read the gradient as the weight."""
    model = _mlp(layers=2)
    manager, hooks = _hooked(model, dtype=torch.bfloat16)
    manager.stationary = True
    with hooks.saved_tensors():
        out = model(torch.randn(4, 8).bfloat16())
    loss = out.float().pow(2).sum()
    loss.backward(inputs=list(model[1].parameters()), retain_graph=True)
    assert manager.record_of(model[1].weight).grad_in_param_slot
    with pytest.raises(
        RuntimeError,
        match="hold_after_bwd -> compute|modified by an inplace operation|read again after its backward ran",
    ):
        loss.backward(inputs=list(model[0].parameters()))
