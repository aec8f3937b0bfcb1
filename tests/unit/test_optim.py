"""Unit tests of lightning_pstar.optim: the chunked optimizer against torch's own (fused) optimizers.

Gradients are handed to the chunk manager directly (``grad_ready``), exactly as the gradient hooks would, and
to a plain copy of the model; after each step the fp32 masters must equal the reference parameters."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_pstar.checkpoint import full_state_dict, load_full_state_dict, master_view
from lightning_pstar.config import PStarConfig
from lightning_pstar.optim import SUPPORTED_OPTIMIZERS, ChunkedOptimizer
from lightning_pstar.runtime.chunk import ChunkKind
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.state import MicroBatch, TensorState

CPU = torch.device("cpu")
CAP = 80

OptFactory = Callable[..., torch.optim.Optimizer]


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))


def _manager(model: nn.Module, dtype: torch.dtype, **config: Any) -> ChunkManager:
    config.setdefault("chunk_size", CAP)
    config.setdefault("placement", "static")
    manager = ChunkManager(model, config=PStarConfig.from_flat(**config), compute_dtype=dtype, device=CPU)
    manager.materialise()
    return manager


class _Pair:
    """An engine (model in chunks + ChunkedOptimizer) and a plain reference with torch's fused optimizer."""

    def __init__(
        self,
        make_opt: Callable[[Any, dict[str, Any]], torch.optim.Optimizer],
        *,
        dtype: torch.dtype = torch.float32,
        model: nn.Module | None = None,
        reference_options: dict[str, Any] | None = None,
        **config: Any,
    ) -> None:
        self.dtype = dtype
        self.model = model if model is not None else _mlp()
        self.reference = copy.deepcopy(self.model)
        self.manager = _manager(self.model, dtype, **config)
        self.user_opt = make_opt(self.model, {})
        self.opt = ChunkedOptimizer(self.user_opt, self.manager)
        self.ref_opt = make_opt(self.reference, reference_options or {"fused": True})
        self.names = [n for n, _ in self.reference.named_parameters()]

    def random_grads(self, skip: tuple[str, ...] = (), scale: float = 1.0) -> dict[str, torch.Tensor]:
        return {
            n: torch.randn(p.shape) * scale
            for n, p in self.reference.named_parameters()
            if n not in skip and p.requires_grad
        }

    def feed(self, grads: dict[str, torch.Tensor]) -> None:
        for record in self.manager.records:
            grad = grads.get(record.names[0])
            if grad is not None:
                self.manager.grad_ready(record, grad.to(self.dtype))
                if record.grad_in_param_slot:  # mixed precision: the slot holds the gradient, the parameter
                    assert torch.equal(record.param.detach(), master_view(record))  # its master
        for name, p in self.reference.named_parameters():
            p.grad = grads[name].to(self.dtype).float() if name in grads else None

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        self.feed(grads)
        self.opt.step()
        self.opt.zero_grad()  # the feed replaces the gradients, as ``p.grad = ...`` does for the reference
        self.ref_opt.step()

    def assert_equal(self, *, atol: float = 0.0) -> None:
        from lightning_pstar.runtime.state import Tier

        ref = dict(self.reference.named_parameters())
        for record in self.manager.records:
            name = record.names[0]
            # the compute copy, read on the chunk's tier (a parameter view is readable only while resident)
            compute = record.family.param_chunk.slot_view(record.slot)
            # after the step the parameter is a view of its param slot again (mixed precision: not the master)
            assert record.param.dtype == self.dtype, name
            assert record.param.untyped_storage().data_ptr() == compute.untyped_storage().data_ptr(), name
            if record.family.param_chunk.tier is Tier.DEVICE:
                assert torch.equal(record.param.detach(), compute), name
            if not record.trainable:
                # frozen parameters keep only their compute-dtype slot (no fp32 master)
                assert torch.equal(compute, ref[name].detach().to(self.dtype)), name
                continue
            master = master_view(record)
            if atol:
                torch.testing.assert_close(master, ref[name].detach(), rtol=0, atol=atol)
            else:
                assert torch.equal(master, ref[name].detach()), name
            assert torch.equal(compute, master.to(self.dtype)), name
            assert record.slot.state is TensorState.HOLD
            assert not record.grad_in_param_slot and not record.grad_in_grad_chunk


def _params(m: Any) -> Any:
    return m.parameters() if isinstance(m, nn.Module) else m


OPTIMIZERS: dict[str, Callable[[Any, dict[str, Any]], torch.optim.Optimizer]] = {
    "adam": lambda m, e: torch.optim.Adam(_params(m), lr=1e-2, **e),
    "adam-wd-betas-eps": lambda m, e: torch.optim.Adam(
        _params(m), lr=3e-3, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-6, **e
    ),
    "adam-maximize": lambda m, e: torch.optim.Adam(_params(m), lr=1e-2, maximize=True, **e),
    "adamw": lambda m, e: torch.optim.AdamW(_params(m), lr=1e-2, weight_decay=0.1, **e),
    "sgd": lambda m, e: torch.optim.SGD(_params(m), lr=0.1, **e),
    "sgd-wd": lambda m, e: torch.optim.SGD(_params(m), lr=0.1, weight_decay=0.05, **e),
    "sgd-momentum": lambda m, e: torch.optim.SGD(_params(m), lr=0.1, momentum=0.9, **e),
    "sgd-nesterov": lambda m, e: torch.optim.SGD(_params(m), lr=0.1, momentum=0.9, nesterov=True, **e),
    "sgd-dampening": lambda m, e: torch.optim.SGD(_params(m), lr=0.1, momentum=0.9, dampening=0.3, **e),
    "sgd-momentum-wd": lambda m, e: torch.optim.SGD(_params(m), lr=0.1, momentum=0.8, weight_decay=0.01, **e),
}


# ---- rejected optimizers and options -----------------------------------------------------------------------
@pytest.mark.parametrize("cls", [torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adamax])
def test_unsupported_optimizer_lists_the_supported_ones(cls: type[torch.optim.Optimizer]) -> None:
    model = _mlp()
    manager = _manager(model, torch.float32)
    with pytest.raises(
        TypeError,
        match=rf"cannot run optimizer torch\.optim\..*{cls.__name__}.*Supported: torch\.optim\.Adam, "
        r"torch\.optim\.AdamW, torch\.optim\.SGD\. HINT",
    ):
        ChunkedOptimizer(cls(model.parameters(), lr=0.1), manager)
    assert all(set(f.chunks) == {ChunkKind.PARAM} for f in manager.families)  # nothing allocated


def test_subclass_of_a_supported_optimizer_is_rejected() -> None:
    class MyAdam(torch.optim.Adam):
        pass

    model = _mlp()
    with pytest.raises(TypeError, match="MyAdam"):
        ChunkedOptimizer(MyAdam(model.parameters()), _manager(model, torch.float32))


def test_supported_optimizers() -> None:
    assert set(SUPPORTED_OPTIMIZERS) == {torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD}


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_amsgrad_is_rejected(cls: type[torch.optim.Optimizer]) -> None:
    model = _mlp()
    groups = [{"params": model[0].parameters()}, {"params": model[1:].parameters(), "amsgrad": True}]
    with pytest.raises(ValueError, match=rf"{cls.__name__}\(amsgrad=True\) in param group 1 .*HINT: set amsgrad=False"):
        ChunkedOptimizer(cls(groups, lr=0.1), _manager(model, torch.float32))


def test_parameters_not_in_the_model_are_rejected() -> None:
    model = _mlp()
    stranger = nn.Parameter(torch.zeros(3, 5))
    manager = _manager(model, torch.float32)
    with pytest.raises(ValueError, match=r"Param group 0 of Adam holds a tensor of shape \(3, 5\).*not a parameter"):
        ChunkedOptimizer(torch.optim.Adam([*model.parameters(), stranger]), manager)
    assert all(set(f.chunks) == {ChunkKind.PARAM} for f in manager.families)


def test_foreach_setting_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = _mlp()
    with caplog.at_level("WARNING", logger="lightning_pstar.optim"):
        ChunkedOptimizer(torch.optim.Adam(model.parameters(), foreach=True), _manager(model, torch.float32))
    assert "foreach/fused setting of param group 0 is ignored" in caplog.text


# ---- parity with torch -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_steps_match_torch(name: str, dtype: torch.dtype) -> None:
    pair = _Pair(OPTIMIZERS[name], dtype=dtype)
    for _ in range(3):
        pair.step(pair.random_grads())
        pair.assert_equal()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["adamw", "sgd-momentum"])
def test_steps_match_torch_with_the_optimizer_offloaded(name: str, dtype: torch.dtype) -> None:
    """A device budget of one chunk family: optimizer states live on HOST and the step runs there."""
    from lightning_pstar.runtime.state import Tier

    pair = _Pair(OPTIMIZERS[name], dtype=dtype, device_memory_limit=CAP * dtype.itemsize)
    assert pair.manager.residency.optimizer_tier is Tier.HOST
    for _ in range(3):
        pair.step(pair.random_grads())
        pair.assert_equal()
    assert all(
        c.tier is Tier.HOST for f in pair.manager.families for k, c in f.chunks.items() if k is not ChunkKind.PARAM
    )
    assert pair.manager.stats.per_tier_bytes[Tier.DEVICE] <= CAP * dtype.itemsize


@pytest.mark.parametrize(
    ("name", "kinds", "per_param"),
    [
        ("adam", {ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ}, 16.0),
        ("sgd-momentum", {ChunkKind.EXP_AVG}, 12.0),
        ("sgd", set(), 8.0),
    ],
)
def test_optimizer_allocates_its_state_chunks(name: str, kinds: set[ChunkKind], per_param: float) -> None:
    pair = _Pair(OPTIMIZERS[name])
    for family in pair.manager.families:
        assert set(family.chunks) == {ChunkKind.PARAM, ChunkKind.GRAD} | kinds
    assert pair.manager.memory_report().model_data_bytes_per_param == per_param


def test_param_groups_with_different_lr() -> None:
    def make(m: nn.Module, extra: dict[str, Any]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            [
                {"params": m[0].parameters(), "lr": 0.1},
                {"params": [m[1].weight, m[2].weight], "weight_decay": 0.0},
                {"params": [m[1].bias, m[2].bias], "lr": 1e-4, "betas": (0.5, 0.6)},
            ],
            lr=1e-2,
            **extra,
        )

    pair = _Pair(make)
    assert pair.opt.param_groups is pair.user_opt.param_groups
    for _ in range(2):
        pair.step(pair.random_grads())
        pair.assert_equal()


def test_sgd_groups_with_and_without_momentum() -> None:
    def make(m: nn.Module, extra: dict[str, Any]) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            [{"params": m[0].parameters(), "momentum": 0.0}, {"params": m[1:].parameters()}],
            lr=0.1,
            momentum=0.9,
            **extra,
        )

    pair = _Pair(make, dtype=torch.bfloat16)
    for _ in range(3):
        pair.step(pair.random_grads())
        pair.assert_equal()


@pytest.mark.parametrize("name", ["adam", "sgd-momentum"])
def test_lr_changes_in_the_user_optimizer_take_effect(name: str) -> None:
    pair = _Pair(OPTIMIZERS[name])
    pair.step(pair.random_grads())
    for group in (*pair.user_opt.param_groups, *pair.ref_opt.param_groups):
        group["lr"] = 0.5
    pair.step(pair.random_grads())
    pair.assert_equal()
    assert pair.opt.param_groups[0]["lr"] == 0.5


def test_lr_scheduler_on_the_user_optimizer_drives_the_engine() -> None:
    pair = _Pair(OPTIMIZERS["sgd-momentum"])
    sched = torch.optim.lr_scheduler.StepLR(pair.user_opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(pair.ref_opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "Detected call of lr_scheduler.step() before optimizer.step()"
        for _ in range(3):
            pair.step(pair.random_grads())
            sched.step()
            ref_sched.step()
            pair.assert_equal()
    assert pair.opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


@pytest.mark.parametrize("name", ["adam", "sgd-momentum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameters_without_grad_are_not_updated_and_get_no_state(name: str, dtype: torch.dtype) -> None:
    # torch's fused SGD cannot start one momentum buffer while others run: the for-loop SGD is the reference
    options = {"fused": True} if name == "adam" else {"foreach": False}
    atol = 0.0 if name == "adam" else 1e-6
    pair = _Pair(OPTIMIZERS[name], dtype=dtype, reference_options=options)
    before = master_view(pair.manager.record_of(pair.model[1].weight)).clone()
    pair.step(pair.random_grads(skip=("1.weight",)))
    pair.assert_equal(atol=atol)
    assert torch.equal(master_view(pair.manager.record_of(pair.model[1].weight)), before)
    state = pair.opt.state_dict()["state"]
    ref_state = pair.ref_opt.state_dict()["state"]
    assert sorted(state) == sorted(ref_state) == [0, 1, 3, 4, 5]
    # it joins in later with a fresh state, as in torch
    pair.step(pair.random_grads())
    pair.assert_equal(atol=atol)


def test_frozen_parameters_in_the_optimizer_are_left_alone() -> None:
    model = _mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    pair = _Pair(OPTIMIZERS["adamw"], dtype=torch.bfloat16, model=model)
    frozen = [pair.manager.record_of(p) for p in model[0].parameters()]
    pair.step(pair.random_grads())
    pair.assert_equal()
    # no optimizer state for them: the param chunk and (mixed precision, frozen_master) the fp32 copy of the weights
    assert all(set(r.family.chunks) == {ChunkKind.PARAM, ChunkKind.MASTER} for r in frozen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulated_gradients_are_summed_in_fp32(dtype: torch.dtype) -> None:
    pair = _Pair(OPTIMIZERS["sgd-momentum"], dtype=dtype)
    micro = [pair.random_grads() for _ in range(3)]
    pair.manager.micro_batch = MicroBatch.ACCUMULATING
    for grads in micro[:-1]:
        pair.feed(grads)
    pair.manager.micro_batch = MicroBatch.FINAL
    pair.feed(micro[-1])
    for name, p in pair.reference.named_parameters():
        p.grad = sum(g[name].to(dtype).float() for g in micro)  # type: ignore[assignment]
    pair.opt.step()
    pair.ref_opt.step()
    pair.assert_equal()


# ---- gradient policy: clipping, unscaling, overflow ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_by_norm_matches_torch(dtype: torch.dtype) -> None:
    pair = _Pair(OPTIMIZERS["sgd-momentum"], dtype=dtype)
    for scale in (10.0, 1e-3):  # clipped, then below the threshold
        grads = pair.random_grads(scale=scale)
        pair.feed(grads)
        pair.opt.gradient_policy.clip_norm = 1.0
        pair.opt.step()
        pair.opt.zero_grad()
        total = torch.nn.utils.clip_grad_norm_(pair.reference.parameters(), 1.0)
        pair.ref_opt.step()
        assert pair.opt.last_step.total_norm == float(total)
        pair.assert_equal()


def test_clip_by_value_matches_torch() -> None:
    pair = _Pair(OPTIMIZERS["adam"])
    pair.feed(pair.random_grads(scale=3.0))
    pair.opt.gradient_policy.clip_value = 0.5
    pair.opt.step()
    torch.nn.utils.clip_grad_value_(pair.reference.parameters(), 0.5)
    pair.ref_opt.step()
    pair.assert_equal()


def test_inv_scale_unscales_fp16_gradients() -> None:
    pair = _Pair(OPTIMIZERS["sgd"], dtype=torch.float16)
    grads = pair.random_grads()
    scale = 1024.0
    for record in pair.manager.records:
        pair.manager.grad_ready(record, (grads[record.names[0]] * scale).half())
    for name, p in pair.reference.named_parameters():
        p.grad = (grads[name] * scale).half().float() / scale
    pair.opt.gradient_policy.inv_scale = 1.0 / scale
    pair.opt.gradient_policy.check_finite = True
    pair.opt.step()
    pair.ref_opt.step()
    assert not pair.opt.last_step.skipped
    pair.assert_equal()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_gradient_skips_the_step(bad: float) -> None:
    pair = _Pair(OPTIMIZERS["adam"], dtype=torch.float16)
    weights = {n: p.detach().clone() for n, p in pair.model.named_parameters()}
    masters = [master_view(r).clone() for r in pair.manager.records]
    grads = pair.random_grads()
    grads["2.bias"][3] = bad
    pair.feed(grads)
    pair.opt.gradient_policy.check_finite = True
    pair.opt.step()
    assert pair.opt.last_step.skipped
    for record, master in zip(pair.manager.records, masters, strict=True):
        assert torch.equal(master_view(record), master)
        assert record.slot.state is TensorState.HOLD and not record.grad_in_param_slot
    for name, p in pair.model.named_parameters():
        assert torch.equal(p.detach(), weights[name]), name  # gradients in the slots were replaced by weights
    assert pair.opt.state_dict()["state"] == {}  # no Adam step counted


def test_zero_grad_discards_gradients() -> None:
    pair = _Pair(OPTIMIZERS["adam"], dtype=torch.bfloat16)
    weights = {n: p.detach().clone() for n, p in pair.model.named_parameters()}
    pair.feed(pair.random_grads())
    pair.opt.zero_grad()
    for name, p in pair.model.named_parameters():
        assert torch.equal(p.detach(), weights[name])
    pair.opt.step()  # nothing to do
    for name, p in pair.model.named_parameters():
        assert torch.equal(p.detach(), weights[name])


def test_step_runs_the_closure_with_grad_enabled() -> None:
    pair = _Pair(OPTIMIZERS["sgd"])
    grads = pair.random_grads()
    seen: list[bool] = []

    def closure() -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        pair.feed(grads)
        return torch.tensor(1.5)

    assert pair.opt.step(closure).item() == 1.5
    pair.ref_opt.step()
    assert seen == [True]
    pair.assert_equal()


# ---- state dict ------------------------------------------------------------------------------------------
def _assert_state_dicts_equal(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours["state"].keys() == theirs["state"].keys()
    for index, entry in theirs["state"].items():
        assert ours["state"][index].keys() == entry.keys(), index
        for key, value in entry.items():
            mine = ours["state"][index][key]
            assert isinstance(mine, torch.Tensor) and mine.dtype == value.dtype and mine.shape == value.shape, key
            assert torch.equal(mine, value), (index, key)
    ignore = {"fused", "foreach"}
    assert len(ours["param_groups"]) == len(theirs["param_groups"])
    for g_ours, g_theirs in zip(ours["param_groups"], theirs["param_groups"], strict=True):
        assert {k: v for k, v in g_ours.items() if k not in ignore} == {
            k: v for k, v in g_theirs.items() if k not in ignore
        }


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd-momentum", "sgd"])
def test_state_dict_has_torch_layout(name: str) -> None:
    pair = _Pair(OPTIMIZERS[name])
    for _ in range(2):
        pair.step(pair.random_grads())
    _assert_state_dicts_equal(pair.opt.state_dict(), pair.ref_opt.state_dict())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov"])
def test_state_dict_round_trip_into_a_fresh_engine(name: str, dtype: torch.dtype) -> None:
    pair = _Pair(OPTIMIZERS[name], dtype=dtype)
    for _ in range(2):
        pair.step(pair.random_grads())
    saved = copy.deepcopy(pair.opt.state_dict())
    weights = full_state_dict(pair.manager)

    fresh_model = _mlp(seed=123)
    fresh_manager = _manager(fresh_model, dtype)
    load_full_state_dict(fresh_manager, weights)
    fresh_user = OPTIMIZERS[name](fresh_model, {})
    for group in fresh_user.param_groups:
        group["lr"] = 123.0  # restored from the saved groups
    fresh = ChunkedOptimizer(fresh_user, fresh_manager)
    fresh.load_state_dict(saved)
    assert fresh_user.param_groups[0]["lr"] == pair.user_opt.param_groups[0]["lr"]
    _assert_state_dicts_equal(fresh.state_dict(), saved)

    grads = pair.random_grads()
    pair.step(grads)
    for record in fresh_manager.records:
        fresh_manager.grad_ready(record, grads[record.names[0]].to(dtype))
    fresh.step()
    for a, b in zip(pair.manager.records, fresh_manager.records, strict=True):
        assert torch.equal(master_view(a), master_view(b)), a.names
        assert torch.equal(a.param.detach(), b.param.detach())


def test_load_torch_optimizer_state_dict() -> None:
    """A state saved by torch's own optimizer continues in the engine (and the engine's in torch)."""
    pair = _Pair(OPTIMIZERS["adam"])
    pair.step(pair.random_grads())
    # bring the engine into the reference's state and weights, then step both
    load_full_state_dict(pair.manager, pair.reference.state_dict())
    pair.opt.load_state_dict(copy.deepcopy(pair.ref_opt.state_dict()))
    pair.step(pair.random_grads())
    pair.assert_equal()
    plain = copy.deepcopy(pair.reference)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2, fused=True)
    plain_opt.load_state_dict(pair.opt.state_dict())
    _assert_state_dicts_equal(plain_opt.state_dict(), pair.ref_opt.state_dict())


def test_load_state_dict_wrong_group_count_changes_nothing() -> None:
    pair = _Pair(OPTIMIZERS["adam"])
    pair.step(pair.random_grads())
    before = copy.deepcopy(pair.opt.state_dict())
    bad = copy.deepcopy(before)
    bad["param_groups"].append({**bad["param_groups"][0], "params": [], "lr": 9.0})
    bad["param_groups"][0]["lr"] = 9.0
    bad["state"][0]["exp_avg"].fill_(7.0)
    with pytest.raises(ValueError, match=r"optimizer state has 2 param groups, this optimizer has 1.*HINT"):
        pair.opt.load_state_dict(bad)
    _assert_state_dicts_equal(pair.opt.state_dict(), before)


def test_load_state_dict_wrong_group_size_or_shape_changes_nothing() -> None:
    pair = _Pair(OPTIMIZERS["adam"])
    pair.step(pair.random_grads())
    before = copy.deepcopy(pair.opt.state_dict())
    short = copy.deepcopy(before)
    short["param_groups"][0]["params"] = short["param_groups"][0]["params"][:-1]
    short["param_groups"][0]["lr"] = 9.0
    with pytest.raises(ValueError, match=r"param group 0: the saved state has 5 parameters, this optimizer has 6"):
        pair.opt.load_state_dict(short)
    wrong = copy.deepcopy(before)
    wrong["param_groups"][0]["lr"] = 9.0
    wrong["state"][0]["exp_avg"].fill_(7.0)
    wrong["state"][5]["exp_avg"] = torch.zeros(3)
    with pytest.raises(
        ValueError, match=r"optimizer state 'exp_avg' of parameter '2.bias' has shape \(3,\), expected \(8,\)"
    ):
        pair.opt.load_state_dict(wrong)
    _assert_state_dicts_equal(pair.opt.state_dict(), before)


def test_load_state_dict_rejects_other_layouts() -> None:
    pair = _Pair(OPTIMIZERS["adam"])
    with pytest.raises(ValueError, match="'state' and 'param_groups'"):
        pair.opt.load_state_dict({"exp_avg": {}})


def test_repr() -> None:
    pair = _Pair(OPTIMIZERS["adamw"])
    assert repr(pair.opt) == "ChunkedOptimizer(AdamW, groups=1)"


def test_add_param_group_is_trained_or_refused() -> None:
    """``add_param_group`` (used by Lightning's BaseFinetuning callbacks) must not be silently ignored: either the
    new group is stepped like torch steps it, or the call is refused with a clear error."""

    def make(m: nn.Module, extra: dict[str, Any]) -> torch.optim.Optimizer:
        return torch.optim.SGD(m[0].parameters(), lr=0.1, **extra)

    pair = _Pair(make)
    try:
        pair.opt.add_param_group({"params": list(pair.model[1].parameters()), "lr": 0.05})
    except (ValueError, TypeError, NotImplementedError) as err:
        assert "HINT" in str(err)
        return
    pair.ref_opt.add_param_group({"params": list(pair.reference[1].parameters()), "lr": 0.05})
    pair.step(pair.random_grads())
    pair.assert_equal()


def test_torch_optimizer_hooks_registered_on_the_engine_run() -> None:
    """Hooks go through torch's own tables (built by ``Optimizer.__init__``), so they run as on torch's optimizers."""
    pair = _Pair(OPTIMIZERS["adam"])
    calls: list[str] = []
    handles = [
        pair.opt.register_step_pre_hook(lambda opt, args, kwargs: calls.append("step_pre")),
        pair.opt.register_step_post_hook(lambda opt, args, kwargs: calls.append("step_post")),
        pair.opt.register_state_dict_pre_hook(lambda opt: calls.append("state_dict_pre")),
        pair.opt.register_state_dict_post_hook(lambda opt, sd: {**sd, "extra": 1}),
        pair.opt.register_load_state_dict_pre_hook(lambda opt, sd: calls.append("load_pre")),
        pair.opt.register_load_state_dict_post_hook(lambda opt: calls.append("load_post")),
    ]
    global_pre = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: calls.append("global_pre") if opt is pair.opt else None
    )
    try:
        pair.step(pair.random_grads())
        assert calls == ["global_pre", "step_pre", "step_post"]
        pair.assert_equal()  # the hooks wrap the real step
        saved = pair.opt.state_dict()
        assert calls[-1] == "state_dict_pre" and saved["extra"] == 1
        pair.opt.load_state_dict(saved)
        assert calls[-2:] == ["load_pre", "load_post"]
    finally:
        global_pre.remove()
        for handle in handles:
            handle.remove()
    calls.clear()
    pair.step(pair.random_grads())
    pair.opt.state_dict()
    assert calls == []
    pair.assert_equal()
