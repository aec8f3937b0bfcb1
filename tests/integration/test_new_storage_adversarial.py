"""Adversarial tests: parameters given new storage mid-run ([Note: parameters given new storage] in
runtime/new_storage.py) and a module shared by several reentrant-checkpointed segments (GradStore.carry_over).

Every run is compared with plain Lightning (or plain Fabric) on the same seed, data and user code, or with the
serial ``optimizer_overlap="off"`` run (bitwise), or must raise naming the parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarStrategy
from lightning_pstar.planning.tiers import MemoryBudgetError
from lightning_pstar.precision import PatrickStarPrecision
from lightning_pstar.runtime.new_storage import NewStorageError
from tests.helpers.asserts import assert_runs_bitwise, assert_same_run, assert_states_close, assert_states_equal
from tests.helpers.data import make_loader
from tests.helpers.models import BLOCK, N_EMBD, VOCAB, Block
from tests.helpers.runs import LM, FitResult, fit_steps, tight

E = 16


class Net(nn.Module):
    """Embedding, two hidden linears (``lin2`` optionally frozen), a head optionally tied to the embedding."""

    def __init__(self, tied: bool = False, frozen: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, E)
        self.lin = nn.Linear(E, E)
        self.lin2 = nn.Linear(E, E)
        self.head = nn.Linear(E, VOCAB, bias=False)
        if tied:
            self.head.weight = self.wte.weight
        if frozen:
            self.lin2.requires_grad_(False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin2(torch.tanh(self.lin(self.wte(idx))))))


def _value(shape: tuple[int, ...], seed: int = 5) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.1


HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_validation_start",
    "on_save_checkpoint",
    "on_train_epoch_end",
    "on_before_zero_grad",
    "on_train_start",
    "on_fit_start",
)


class AssignIn(L.Callback):
    """Calls ``fn(net, call)`` in hook ``hook`` on its ``at``-th call (every call from ``at`` on when ``every``)."""

    def __init__(self, hook: str, fn: Callable[[nn.Module, int], None], at: int = 1, every: bool = False) -> None:
        assert hook in HOOKS
        self.hook, self.fn, self.at, self.every = hook, fn, at, every
        self.calls = 0
        self.fired = 0

    def _maybe(self, hook: str, pl_module: L.LightningModule) -> None:
        if hook != self.hook:
            return
        call = self.calls
        self.calls += 1
        if call == self.at or (self.every and call >= self.at):
            self.fired += 1
            self.fn(pl_module.net, call)  # type: ignore[attr-defined]

    def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self._maybe("on_train_batch_start", pl_module)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self._maybe("on_train_batch_end", pl_module)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._maybe("on_validation_start", pl_module)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: Any) -> None:
        self._maybe("on_save_checkpoint", pl_module)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._maybe("on_train_epoch_end", pl_module)

    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._maybe("on_before_zero_grad", pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._maybe("on_train_start", pl_module)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._maybe("on_fit_start", pl_module)


def set_lin_data(net: nn.Module, call: int) -> None:
    net.lin.weight.data = _value((E, E), seed=call)


def _close(got: FitResult, ref: FitResult, what: str, rtol: float = 1e-5) -> None:
    assert len(got.losses) == len(ref.losses) > 0, what
    for i, (a, b) in enumerate(zip(got.losses, ref.losses, strict=True)):
        assert abs(a - b) <= rtol * abs(b), f"{what}: step {i}: patrickstar {a!r} vs plain {b!r}"
    assert_states_close(got.final, ref.final, what=what, rtol=1e-4, atol=1e-5)


def _run(strategy: Any, make_cb: Callable[[], L.Callback], *, build: Callable[[], nn.Module] = Net, **kw: Any) -> Any:
    cb = make_cb()
    kw.setdefault("steps", 4)
    result = fit_steps(LM(build), strategy, callbacks=[cb, *kw.pop("callbacks", [])], **kw)
    return result, cb


def _compare(make_cb: Callable[[], L.Callback], strategy: Any = None, **kw: Any) -> tuple[FitResult, FitResult]:
    ref, ref_cb = _run("auto", make_cb, **kw)
    got, got_cb = _run(strategy if strategy is not None else PatrickStarStrategy(), make_cb, **kw)
    assert ref_cb.fired > 0 and got_cb.fired == ref_cb.fired
    _close(got, ref, f"{kw}")
    return got, ref


# --------------------------------------------------------------------------------------------------
# (1) new storage: hooks, kinds of values, models
# --------------------------------------------------------------------------------------------------


def _changes_something(make_cb: Callable[[], L.Callback], ref: FitResult, **kw: Any) -> None:
    """The assignment reached plain Lightning's weights (so a run that loses it cannot pass)."""
    kw.setdefault("steps", 4)
    plain = fit_steps(LM(kw.pop("build", Net)), "auto", **kw)
    assert not torch.allclose(plain.final["net.lin.weight"], ref.final["net.lin.weight"], atol=1e-4)


@pytest.mark.parametrize("hook", ["on_train_batch_end", "on_before_zero_grad"])
def test_assignment_in_late_training_hooks_matches_plain(hook: str) -> None:
    make = lambda: AssignIn(hook, set_lin_data, at=1)  # noqa: E731
    _, ref = _compare(make)
    _changes_something(make, ref)


class ValLM(LM):
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.training_step(batch, batch_idx)


class ValLoss(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs))


@pytest.mark.parametrize(
    ("hook", "placement"),
    [("on_validation_start", "default"), ("on_validation_start", "tight"), ("on_train_batch_end", "tight")],
)
def test_assignment_around_validation_matches_plain(hook: str, placement: str) -> None:
    """Assigned while the validation loop starts, or at the end of the batch right before it (mid-epoch,
    val_check_interval=2; under a tight budget the chunk moves in between): validation and the steps after it read
    the assigned value in plain Lightning."""
    from tests.helpers.runs import LossRecorder, make_trainer

    def run(strategy: Any) -> tuple[FitResult, Any]:
        cb = AssignIn(hook, set_lin_data, at=0 if hook == "on_validation_start" else 1)
        val = ValLoss()
        recorder = LossRecorder()
        trainer = make_trainer(strategy=strategy, max_steps=4, callbacks=[recorder, cb, val], val_check_interval=2)
        module = ValLM(Net)
        trainer.fit(module, train_dataloaders=make_loader(n_seq=16), val_dataloaders=make_loader(n_seq=8, seed=9))
        return FitResult(module=module, trainer=trainer, recorder=recorder), (cb, val)

    ref, (rc, rv) = run("auto")
    got, (gc, gv) = run(PatrickStarStrategy() if placement == "default" else _tight())
    assert rc.fired == gc.fired == 1
    assert len(gv.losses) == len(rv.losses) > 0
    assert gv.losses == pytest.approx(rv.losses, rel=1e-5)
    _close(got, ref, f"{hook}, {placement}")


def test_assignment_at_epoch_end_matches_plain() -> None:
    make = lambda: AssignIn("on_train_epoch_end", set_lin_data, at=0)  # noqa: E731
    _, ref = _compare(make, loader=make_loader(n_seq=8), steps=5)  # 2 batches an epoch: 3 epochs
    _changes_something(make, ref, loader=make_loader(n_seq=8), steps=5)


def test_assignment_in_on_save_checkpoint_matches_plain(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(strategy: Any, sub: str) -> tuple[FitResult, Any]:
        cb = AssignIn("on_save_checkpoint", set_lin_data, at=0)
        ckpt = ModelCheckpoint(dirpath=tmp_path / sub, every_n_train_steps=2, save_top_k=-1)
        res = fit_steps(LM(Net), strategy, steps=4, callbacks=[cb, ckpt], enable_checkpointing=True)
        return res, cb

    ref, rc = run("auto", "plain")
    got, gc = run(PatrickStarStrategy(), "pstar")
    assert rc.fired == gc.fired == 1
    _close(got, ref, "on_save_checkpoint")
    for name in ("step=2.ckpt", "step=4.ckpt"):
        want = torch.load(tmp_path / "plain" / f"epoch=0-{name}", weights_only=True)["state_dict"]
        have = torch.load(tmp_path / "pstar" / f"epoch=0-{name}", weights_only=True)["state_dict"]
        assert_states_close(have, want, what=name, rtol=1e-4, atol=1e-5)


def test_assignment_then_checkpoint_then_resume_matches_plain(tmp_path: Path) -> None:
    """The callback assigns right before ModelCheckpoint saves (same hook, earlier in the list): the checkpoint must
    hold the assigned value (bitwise: 32-true stores it as given), and a run resumed from it matches plain's."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(strategy: Any, sub: str) -> FitResult:
        cb = AssignIn("on_train_batch_end", set_lin_data, at=1)
        ckpt = ModelCheckpoint(dirpath=tmp_path / sub, every_n_train_steps=2, save_top_k=-1)
        return fit_steps(LM(Net), strategy, steps=2, callbacks=[cb, ckpt], enable_checkpointing=True)

    run("auto", "plain")
    run(PatrickStarStrategy(), "pstar")
    path = {s: tmp_path / s / "epoch=0-step=2.ckpt" for s in ("plain", "pstar")}
    saved = torch.load(path["pstar"], weights_only=True)
    assert torch.equal(saved["state_dict"]["net.lin.weight"], _value((E, E), seed=1))
    assert torch.equal(torch.load(path["plain"], weights_only=True)["state_dict"]["net.lin.weight"], _value((E, E), 1))
    ref = fit_steps(LM(Net), "auto", steps=4, ckpt_path=str(path["plain"]))
    got = fit_steps(LM(Net), PatrickStarStrategy(), steps=4, ckpt_path=str(path["pstar"]))
    _close(got, ref, "resumed")


ASSIGNERS: dict[str, Callable[[nn.Module, int], None]] = {
    "set_": lambda net, c: torch.no_grad()(net.lin.weight.set_)(_value((E, E), c)),
    "view_of_bigger": lambda net, c: setattr(net.lin.weight, "data", _value((3 * E, E), c)[E : 2 * E]),
    "non_contiguous": lambda net, c: setattr(net.lin.weight, "data", _value((E, E), c).t()),
    "own_value_clone": lambda net, c: setattr(net.lin.weight, "data", net.lin.weight.data.clone() * 1.5),
    "strided_view": lambda net, c: setattr(net.lin.weight, "data", _value((E, 2 * E), c)[:, ::2]),
}


CONTIGUOUS_REFERENCE = {"non_contiguous", "strided_view"}
"""Plain Lightning's fused AdamW pairs a non-contiguous parameter's elements with its (contiguous) Adam states by
memory order, not by index, after ``p.data = W.t()`` (torch 2.13, checked in a pure-torch loop: 0.14 off against the
contiguous copy; the non-fused AdamW agrees with the copy to 6e-8). The engine adopts the values; its reference is
plain Lightning given the contiguous copy of the same value."""


@pytest.mark.parametrize("how", list(ASSIGNERS))
def test_kinds_of_assigned_values_match_plain(how: str) -> None:
    def contiguous(net: nn.Module, call: int) -> None:
        ASSIGNERS[how](net, call)
        net.lin.weight.data = net.lin.weight.data.contiguous()

    make = lambda: AssignIn("on_train_batch_start", ASSIGNERS[how], at=2)  # noqa: E731
    make_ref = (lambda: AssignIn("on_train_batch_start", contiguous, at=2)) if how in CONTIGUOUS_REFERENCE else make
    ref, _ = _run("auto", make_ref)
    got, cb = _run(PatrickStarStrategy(), make)
    assert cb.fired == 1
    _close(got, ref, how)
    _changes_something(make_ref, ref)


def test_assignment_every_step_matches_plain() -> None:
    make = lambda: AssignIn("on_train_batch_start", set_lin_data, at=1, every=True)  # noqa: E731
    _compare(make, steps=5)


@pytest.mark.parametrize("via", ["wte", "head"])
def test_tied_weight_assigned_through_either_name_matches_plain(via: str) -> None:
    def fn(net: nn.Module, call: int) -> None:
        getattr(net, via).weight.data = _value((VOCAB, E), call)

    make = lambda: AssignIn("on_train_batch_start", fn, at=2)  # noqa: E731
    got, ref = _compare(make, build=lambda: Net(tied=True))
    assert "net.head.weight" not in ref.final or torch.equal(ref.final["net.head.weight"], ref.final["net.wte.weight"])
    assert torch.equal(got.module.net.head.weight, got.module.net.wte.weight)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_frozen_weight_assigned_matches_plain(precision: str) -> None:
    def fn(net: nn.Module, call: int) -> None:
        net.lin2.weight.data = _value((E, E), call)

    make = lambda: AssignIn("on_train_batch_start", fn, at=2)  # noqa: E731
    ref, _ = _run("auto", make, build=lambda: Net(frozen=True), precision=precision)
    got, _ = _run(PatrickStarStrategy(), make, build=lambda: Net(frozen=True), precision=precision)
    if precision == "32-true":
        _close(got, ref, "frozen")
        assert torch.equal(got.final["net.lin2.weight"], _value((E, E), 2))
    else:
        assert_states_close(got.final, ref.final, what="frozen bf16", rtol=5e-2, atol=5e-3)
        # frozen_master=True: the frozen weight comes back exactly as given
        assert torch.equal(got.final["net.lin2.weight"], _value((E, E), 2))


class LoraLinear(nn.Module):
    def __init__(self, n: int, r: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(n, n)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(r, n) * 0.1)
        self.b = nn.Parameter(torch.zeros(n, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


class LoraNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, E)
        self.lin = LoraLinear(E)
        self.head = nn.Linear(E, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(self.wte(idx))))


def test_lora_frozen_base_assigned_matches_plain() -> None:
    """A merged-weights workflow: the frozen base gets base + B A (a new tensor) mid-run."""

    def merge(net: nn.Module, call: int) -> None:
        lin = net.lin
        lin.base.weight.data = lin.base.weight.detach() + lin.b.detach() @ lin.a.detach() + _value((E, E), call)

    make = lambda: AssignIn("on_train_batch_start", merge, at=2)  # noqa: E731
    got, ref = _compare(make, build=LoraNet)
    plain = fit_steps(LM(LoraNet), "auto", steps=4)
    assert not torch.allclose(plain.final["net.lin.base.weight"], ref.final["net.lin.base.weight"], atol=1e-4)


def test_same_tensor_given_to_two_parameters_matches_plain_or_raises() -> None:
    """``lin.weight.data = W; lin2.weight.data = W``: in plain PyTorch both parameters share W's storage from then
    on (the optimizer updates it twice a step). The engine cannot keep them aliased: it must raise or match."""

    def fn(net: nn.Module, call: int) -> None:
        w = _value((E, E), call)
        net.lin.weight.data = w
        net.lin2.weight.data = w

    make = lambda: AssignIn("on_train_batch_start", fn, at=2)  # noqa: E731
    ref, _ = _run("auto", make)
    assert ref.module.net.lin.weight.data_ptr() == ref.module.net.lin2.weight.data_ptr()
    try:
        got, _ = _run(PatrickStarStrategy(), make)
    except NewStorageError as err:
        assert "net.lin" in str(err)
        return
    _close(got, ref, "same tensor to two params")


def test_another_parameters_data_given_matches_plain_or_raises() -> None:
    """``lin.weight.data = lin2.weight.data``: the new storage is a slot of the same family's chunk; the engine
    takes that for a pointing of its own and keeps the parameter there (reads lin2's slot) while it steps lin's old
    slot. Plain PyTorch aliases the two. Must raise or match."""

    def fn(net: nn.Module, call: int) -> None:
        net.lin.weight.data = net.lin2.weight.data

    make = lambda: AssignIn("on_train_batch_start", fn, at=2)  # noqa: E731
    ref, _ = _run("auto", make)
    try:
        got, _ = _run(PatrickStarStrategy(), make)
    except NewStorageError as err:
        assert "net.lin" in str(err)
        return
    _close(got, ref, "another param's data")


def test_bf16_value_given_to_an_fp32_parameter_matches_plain_or_raises() -> None:
    """32-true: ``p.data = W.bfloat16()`` makes the parameter bf16 in plain PyTorch, whose forward then refuses
    the dtype mix. The engine must not train on silently (converting W to fp32)."""

    def fn(net: nn.Module, call: int) -> None:
        net.lin.weight.data = _value((E, E), call).bfloat16()

    make = lambda: AssignIn("on_train_batch_start", fn, at=2)  # noqa: E731
    try:
        ref, _ = _run("auto", make)
    except RuntimeError as plain_err:
        with pytest.raises((RuntimeError, NewStorageError)):
            _run(PatrickStarStrategy(), make)
        assert "dtype" in str(plain_err) or "same" in str(plain_err)
        return
    got, _ = _run(PatrickStarStrategy(), make)
    _close(got, ref, "bf16 value")


# --------------------------------------------------------------------------------------------------
# (1) new storage: placements, tiers, overlap modes, precisions, Fabric
# --------------------------------------------------------------------------------------------------


def _tight() -> PatrickStarStrategy:
    return PatrickStarStrategy(chunk_size=256, placement="static", device_memory_limit=3 * 256 * 4)


@pytest.mark.parametrize("hook", ["on_train_batch_start", "on_train_batch_end"])
def test_assignment_under_a_tight_budget_matches_plain(hook: str) -> None:
    strategy = _tight()
    make = lambda: AssignIn(hook, set_lin_data, at=1, every=True)  # noqa: E731
    _compare(make, strategy=strategy)
    assert strategy.memory_report().evictions > 0


def test_assignment_with_the_disk_tier_matches_plain(tmp_path: Path) -> None:
    """The ALBERT-like model below with the fp32 masters and Adam states of most families on disk: a weight of a
    disk family given a new value every step is adopted as plain Lightning does."""

    def fn(net: nn.Module, call: int) -> None:
        net.head.weight.data = _value((VOCAB, N_EMBD), call)
        net.proj_in.weight.data = _value((N_EMBD, 8), call + 10)

    strategy = PatrickStarStrategy(
        optimizer_placement="host",
        optimizer_overlap="off",
        chunk_size=2048,
        device_memory_limit="64MiB",
        host_memory_limit="260KiB",
        disk_path=str(tmp_path),
    )
    peek: dict[str, int] = {}

    class Peek(L.Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if isinstance(trainer.strategy, PatrickStarStrategy):
                peek["disk"] = trainer.strategy.memory_report().disk_families

    make = lambda: AssignIn("on_train_batch_start", fn, at=1, every=True)  # noqa: E731
    _compare(make, strategy=strategy, build=Albert, callbacks=[Peek()], steps=3)
    assert peek["disk"] > 0, "nothing went to disk"
    assert list(tmp_path.iterdir()) == []


def _host_overlap(mode: str) -> PatrickStarStrategy:
    return PatrickStarStrategy(optimizer_placement="host", optimizer_overlap=mode, chunk_size=256)


@pytest.mark.parametrize("overlap", ["pipeline", "auto"])
@pytest.mark.parametrize("hook", ["on_train_batch_start", "on_train_batch_end"])
def test_assignment_between_steps_in_overlap_modes_is_bitwise_the_serial_run(overlap: str, hook: str) -> None:
    make = lambda: AssignIn(hook, set_lin_data, at=1, every=True)  # noqa: E731
    serial, _ = _run(_host_overlap("off"), make, steps=5)
    got, _ = _run(_host_overlap(overlap), make, steps=5)
    assert_runs_bitwise(got, serial, f"{overlap}, {hook}")
    ref, _ = _run("auto", make, steps=5)
    _close(serial, ref, "serial vs plain")


@pytest.mark.parametrize("how", ["data", "set_"])
@pytest.mark.parametrize("hook", ["on_train_batch_start", "on_train_batch_end"])
def test_assignment_while_the_step_is_in_flight_next_forward_is_refused_before_anything_changes(
    hook: str, how: str
) -> None:
    """optimizer_overlap="next_forward": after the warm-up the step's tail runs into the next forward, so a
    callback between steps finds the parameter parked; ``p.data = W`` raises there, naming the mode and a HINT, and
    the weights stay those the serial run has at that moment."""
    from lightning_pstar.runtime.parked import ParkedParameterError

    seen: dict[str, Any] = {}

    def fn(net: nn.Module, call: int) -> None:
        seen["call"] = call
        if how == "data":
            net.lin.weight.data = _value((E, E), call)
        else:
            with torch.no_grad():
                net.lin.weight.set_(_value((E, E), call))

    strategy = _host_overlap("next_forward")
    make = lambda: AssignIn(hook, fn, at=1, every=True)  # noqa: E731
    try:
        got, _ = _run(strategy, make, steps=5)
    except ParkedParameterError as err:
        assert "next_forward" in str(err) and "HINT" in str(err), err
        return
    serial, _ = _run(_host_overlap("off"), make, steps=5)
    assert_runs_bitwise(got, serial, f"next_forward, {hook}")


@pytest.mark.parametrize("overlap", ["pipeline", "next_forward", "auto"])
def test_assignment_between_forward_and_backward_overlap_modes_are_bitwise_the_serial_run(overlap: str) -> None:
    make = lambda: AssignIn("on_before_zero_grad", set_lin_data, at=1, every=True)  # noqa: E731
    serial, _ = _run(_host_overlap("off"), make, steps=5)
    ref, _ = _run("auto", make, steps=5)
    _close(serial, ref, "serial vs plain")  # holds: the serial step adopts before it updates
    got, _ = _run(_host_overlap(overlap), make, steps=5)
    assert_runs_bitwise(got, serial, f"{overlap}, on_before_zero_grad")


class AssignAfterForwardLM(LM):
    """The LightningModule's own training_step gives ``lin`` a new weight after the forward, before returning the
    loss (so before the backward): no callback involved."""

    def __init__(self) -> None:
        super().__init__(Net)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx >= 1:
            set_lin_data(self.net, batch_idx)
        return loss


def test_assignment_in_training_step_after_the_forward_pipeline_is_bitwise_the_serial_run() -> None:
    ref = fit_steps(AssignAfterForwardLM(), "auto", steps=5)
    serial = fit_steps(AssignAfterForwardLM(), _host_overlap("off"), steps=5)
    _close(serial, ref, "serial vs plain")
    got = fit_steps(AssignAfterForwardLM(), _host_overlap("pipeline"), steps=5)
    assert_runs_bitwise(got, serial, "pipeline, assigned in training_step")


def test_assignment_with_16_mixed_loss_scaling_matches_serial_and_plain_fp16() -> None:
    make = lambda: AssignIn("on_train_batch_start", set_lin_data, at=1, every=True)  # noqa: E731
    plugins = {"plugins": [PatrickStarPrecision("16-mixed")]}
    serial, _ = _run(PatrickStarStrategy(optimizer_placement="host", optimizer_overlap="off"), make, **plugins)
    plugins = {"plugins": [PatrickStarPrecision("16-mixed")]}
    piped, _ = _run(PatrickStarStrategy(optimizer_placement="host", optimizer_overlap="pipeline"), make, **plugins)
    assert_runs_bitwise(piped, serial, "16-mixed pipeline")
    # the assigned value reached the fp32 master: the final weight is one Adam step (lr 3e-3) away from it
    assert (serial.final["net.lin.weight"] - _value((E, E), 3)).abs().max() < 3e-3 * 1.5


def test_fabric_loop_set_under_a_tight_budget_matches_plain() -> None:
    def run(strategy: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
        return fabric.launch(loop)

    def loop(fabric: L.Fabric) -> tuple[list[float], dict[str, torch.Tensor]]:
        fabric.seed_everything(7)
        model = Net(tied=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        model, optimizer = fabric.setup(model, optimizer)
        gen = torch.Generator().manual_seed(3)
        losses = []
        for step in range(5):
            if step >= 2:
                with torch.no_grad():
                    model.lin.weight.set_(_value((E, E), step))
                model.head.weight.data = _value((VOCAB, E), step)
            x = torch.randint(0, VOCAB, (4, 8), generator=gen)
            loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), x.reshape(-1))
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        return losses, {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}

    ref_losses, ref_state = run("auto")
    fab = PatrickStarFabricStrategy(chunk_size=256, placement="static", device_memory_limit=3 * 256 * 4)
    losses, state = run(fab)
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert_states_close(state, ref_state, what="fabric", rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# (1) parametrize, to_empty, load_state_dict(assign=True)
# --------------------------------------------------------------------------------------------------


class Scale2(nn.Module):
    """A parametrization with a custom right_inverse: weight = 2 * original."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        return w / 2


class ParamNet(Net):
    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind == "orthogonal":
            nn.utils.parametrizations.orthogonal(self.lin)
        else:
            parametrize.register_parametrization(self.lin, "weight", Scale2())


@pytest.mark.parametrize("kind", ["orthogonal", "custom"])
def test_parametrized_weight_assigned_matches_plain(kind: str) -> None:
    def fn(net: nn.Module, call: int) -> None:
        w = _value((E, E), call)
        if kind == "orthogonal":
            w = torch.linalg.qr(w)[0].contiguous()  # QR's Q is column-major: see CONTIGUOUS_REFERENCE
        net.lin.weight = w

    make = lambda: AssignIn("on_train_batch_start", fn, at=2)  # noqa: E731
    _compare(make, build=lambda: ParamNet(kind))


def test_to_empty_and_reinitialised_matches_plain() -> None:
    def fn(net: nn.Module, call: int) -> None:
        net.lin.to_empty(device="cpu")
        torch.manual_seed(99)
        net.lin.reset_parameters()

    make = lambda: AssignIn("on_train_batch_start", fn, at=2)  # noqa: E731
    _compare(make)


def test_load_state_dict_assign_mid_run_matches_plain_or_raises() -> None:
    """``load_state_dict(sd, assign=True)`` swaps the Parameter objects themselves: plain's optimizer still holds
    the old ones (the new ones are never stepped). Either match that or raise; never a third answer."""

    def fn(net: nn.Module, call: int) -> None:
        sd = {"weight": _value((E, E), call), "bias": torch.zeros(E)}
        net.lin.load_state_dict(sd, assign=True)

    make = lambda: AssignIn("on_train_batch_start", fn, at=2)  # noqa: E731
    ref, _ = _run("auto", make)
    try:
        got, _ = _run(PatrickStarStrategy(), make)
    except (NewStorageError, RuntimeError, ValueError) as err:
        assert "'net.lin" in str(err) and "PatrickStar" in str(err) and "HINT" in str(err), err
        return
    _close(got, ref, "load_state_dict(assign=True)")


# --------------------------------------------------------------------------------------------------
# (2) a block shared by reentrant-checkpointed segments (ALBERT-like)
# --------------------------------------------------------------------------------------------------


class Albert(nn.Module):
    """ALBERT-like: a factorised embedding, one transformer block applied ``uses`` times, each use under reentrant
    ``torch.utils.checkpoint``; ``nested`` puts two uses inside one outer reentrant checkpoint; ``frozen`` freezes
    the block's first LayerNorm (frozen and trainable parameters of the shared block in the same family)."""

    def __init__(self, uses: int = 3, nested: bool = False, frozen: bool = False) -> None:
        super().__init__()
        self.uses, self.nested = uses, nested
        self.wte = nn.Embedding(VOCAB, 8)
        self.proj_in = nn.Linear(8, N_EMBD)
        self.wpe = nn.Embedding(BLOCK, N_EMBD)
        self.block = Block()
        self.head = nn.Linear(N_EMBD, VOCAB)
        if frozen:
            self.block.ln1.requires_grad_(False)

    def _twice(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.block, x, use_reentrant=True)
        return checkpoint(self.block, x, use_reentrant=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(self.wte(idx)) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        if self.nested:
            x = checkpoint(self._twice, x, use_reentrant=True)
            x = checkpoint(self.block, x, use_reentrant=True)
        else:
            for _ in range(self.uses):
                x = checkpoint(self.block, x, use_reentrant=True)
        return self.head(x)


def _host(overlap: str = "off", **kw: Any) -> PatrickStarStrategy:
    return PatrickStarStrategy(optimizer_placement="host", optimizer_overlap=overlap, **{"chunk_size": 4096, **kw})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
        {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
        {"accumulate_grad_batches": 3, "gradient_clip_val": 0.003, "gradient_clip_algorithm": "value"},
    ],
    ids=["acc-clipnorm", "clipvalue", "acc-clipvalue"],
)
@pytest.mark.parametrize("overlap", ["off", "pipeline"])
def test_albert_shared_block_with_accumulation_and_clipping_matches_plain(overlap: str, kwargs: dict) -> None:
    ref = fit_steps(LM(Albert), "auto", steps=4, **kwargs)
    got = fit_steps(LM(Albert), _host(overlap), steps=4, **kwargs)
    assert_same_run(got, ref, what=f"albert {overlap} {kwargs}")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
        {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"},
    ],
    ids=["acc-clipnorm", "clipvalue"],
)
def test_albert_shared_block_bf16_overlap_modes_are_bitwise_serial_and_close_to_plain(kwargs: dict) -> None:
    data = make_loader(4 * 4, noise=0.0)
    serial = fit_steps(LM(Albert), _host("off"), steps=4, precision="bf16-mixed", loader=data, **kwargs)
    for mode in ("pipeline", "next_forward"):
        got = fit_steps(LM(Albert), _host(mode), steps=4, precision="bf16-mixed", loader=data, **kwargs)
        assert_runs_bitwise(got, serial, f"bf16 {mode} {kwargs}")
    # plain Lightning refuses clipping with a fused optimizer in bf16-mixed: a tight budget is the other reference
    strategy = PatrickStarStrategy(chunk_size=4096, placement="static", device_memory_limit=3 * 4096 * 2)
    tight_run = fit_steps(LM(Albert), strategy, steps=4, precision="bf16-mixed", loader=data, **kwargs)
    assert strategy.memory_report().evictions > 0
    assert tight_run.losses == serial.losses
    assert_states_equal(tight_run.final, serial.final, what="bf16 tight")
    moved = serial.recorder.initial_state["net.block.mlp.fc.weight"] - serial.final["net.block.mlp.fc.weight"]
    assert moved.abs().max() > 1e-3, "the shared block never stepped"


def test_albert_shared_block_16_mixed_loss_scaling_bitwise_across_modes_and_budgets() -> None:
    """fp16 with loss scaling (initial scale large enough to overflow first): the carried-over gradient must be
    unscaled and checked for overflow like the others; every overlap mode and a tight budget give the same bits."""

    def plugins() -> dict:
        return {"plugins": [PatrickStarPrecision("16-mixed")]}

    data = make_loader(4 * 5, noise=0.0)
    serial = fit_steps(LM(Albert), _host("off"), steps=5, loader=data, accumulate_grad_batches=1, **plugins())
    piped = fit_steps(LM(Albert), _host("pipeline"), steps=5, loader=data, **plugins())
    assert_runs_bitwise(piped, serial, "16-mixed pipeline")
    strategy = PatrickStarStrategy(chunk_size=4096, placement="static", device_memory_limit=3 * 4096 * 2)
    tight_run = fit_steps(LM(Albert), strategy, steps=5, loader=data, **plugins())
    assert tight_run.losses == serial.losses
    assert_states_equal(tight_run.final, serial.final, what="16-mixed tight")
    ref = fit_steps(LM(Albert), "auto", steps=5, loader=data, precision="bf16-mixed")
    assert serial.losses[0] == pytest.approx(ref.losses[0], rel=2e-2)
    assert serial.losses[-1] < serial.losses[0]


@pytest.mark.parametrize("kind", ["tight", "auto-budget", "split-families", "nested", "frozen-in-family", "disk"])
def test_albert_shared_block_placements_and_shapes_match_plain(kind: str, tmp_path: Path) -> None:
    build: Callable[[], nn.Module] = Albert
    if kind == "tight":
        strategy = tight(4096, 3)
    elif kind == "auto-budget":  # placement "auto": the warm-up trace sees the recomputations
        strategy = PatrickStarStrategy(placement="auto", device_memory_limit="90KiB", chunk_size=2048)
    elif kind == "split-families":  # the block's 12.6k elements over several 1024-element families (own chunks)
        strategy = _host("pipeline", chunk_size=1024)
    elif kind == "nested":
        build, strategy = (lambda: Albert(nested=True)), _host("pipeline")
    elif kind == "frozen-in-family":
        build, strategy = (lambda: Albert(frozen=True)), _host("pipeline")
    else:
        strategy = _host(
            "off", chunk_size=2048, device_memory_limit="64MiB", host_memory_limit="260KiB", disk_path=str(tmp_path)
        )
    kwargs = {"accumulate_grad_batches": 2}
    ref = fit_steps(LM(build), "auto", steps=3, **kwargs)
    got = fit_steps(LM(build), strategy, steps=3, **kwargs)
    assert_same_run(got, ref, what=kind)
    report = strategy.memory_report()
    if kind in ("tight", "auto-budget"):
        assert report.evictions > 0
    if kind == "disk":
        assert report.disk_families > 0, report
        assert list(tmp_path.iterdir()) == []


class ManualAlbertLM(LM):
    """Manual optimization: one ``manual_backward`` a batch, a step every second batch (accumulation by hand), clip
    by norm through Lightning."""

    def __init__(self, build: Callable[[], nn.Module] = Albert) -> None:
        super().__init__(build)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx) / 2
        self.manual_backward(loss)
        if batch_idx % 2 == 1:
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        return loss.detach()


@pytest.mark.parametrize("overlap", ["off", "pipeline"])
def test_albert_shared_block_manual_optimization_matches_plain(overlap: str) -> None:
    ref = fit_steps(ManualAlbertLM(), "auto", steps=6)
    got = fit_steps(ManualAlbertLM(), _host(overlap), steps=6)
    assert_same_run(got, ref, what="manual")


class TwoMicroBatchesLM(LM):
    """Manual optimization that splits each batch in two micro-batches inside one ``training_step``: forward,
    ``manual_backward``, forward, ``manual_backward``, step (plain Lightning's accumulation inside a step)."""

    def __init__(self) -> None:
        super().__init__(Net)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        total = torch.zeros(())
        for part in (slice(0, 2), slice(2, None)):
            loss = super().training_step((x[part], y[part]), batch_idx) / 2
            self.manual_backward(loss)
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        return total


def test_two_manual_backwards_inside_one_training_step_match_plain() -> None:
    ref = fit_steps(TwoMicroBatchesLM(), "auto", steps=3)
    got = fit_steps(TwoMicroBatchesLM(), PatrickStarStrategy(), steps=3)
    assert_same_run(got, ref, what="two micro-batches in one training_step")


def test_albert_shared_block_fabric_matches_plain() -> None:
    def run(strategy: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="32-true")
        return fabric.launch(loop)

    def loop(fabric: L.Fabric) -> tuple[list[float], dict[str, torch.Tensor]]:
        fabric.seed_everything(7)
        model = Albert()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        model, optimizer = fabric.setup(model, optimizer)
        losses = []
        for i, (x, y) in enumerate(make_loader(4 * 6)):
            with fabric.no_backward_sync(model, enabled=i % 2 == 0):
                loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)) / 2
                fabric.backward(loss)
            losses.append(float(loss))
            if i % 2 == 1:
                fabric.clip_gradients(model, optimizer, max_norm=0.05)
                optimizer.step()
                optimizer.zero_grad()
        return losses, {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}

    ref_losses, ref_state = run("auto")
    losses, state = run(PatrickStarFabricStrategy(chunk_size=4096, optimizer_placement="host"))
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_states_close(state, ref_state, what="fabric albert", rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# (1) more: accumulation, after-backward, cpu_embedding, a kept handle, a shared checkpointed block
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_assignment_between_accumulating_micro_batches_matches_plain(precision: str) -> None:
    """Assigned before the second micro-batch of a step (accumulate_grad_batches=2): plain keeps the first
    micro-batch's gradient and steps W with the sum."""
    make = lambda: AssignIn("on_train_batch_start", set_lin_data, at=3)  # noqa: E731
    kw = {"accumulate_grad_batches": 2, "precision": precision, "loader": make_loader(4 * 8, noise=0.0)}
    ref, _ = _run("auto", make, **kw)
    got, _ = _run(PatrickStarStrategy(), make, **kw)
    if precision == "32-true":
        _close(got, ref, "accumulating")
    else:
        assert got.losses == pytest.approx(ref.losses, rel=1e-2)
        assert_states_close(got.final, ref.final, what="accumulating bf16", rtol=5e-2, atol=5e-3)
    serial, _ = _run(_host_overlap("off"), make, **kw)
    piped, _ = _run(_host_overlap("pipeline"), make, **kw)
    assert_runs_bitwise(piped, serial, f"accumulating {precision}")


class AfterBackward(L.Callback):
    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_step == 1:
            set_lin_data(pl_module.net, 1)


@pytest.mark.parametrize("overlap", ["off", "pipeline"])
def test_assignment_in_on_after_backward_32_true_matches_plain(overlap: str) -> None:
    """32-true, between the backward and the step: the step updates W with the gradient (plain's answer)."""
    ref = fit_steps(LM(Net), "auto", steps=4, callbacks=[AfterBackward()])
    got = fit_steps(LM(Net), _host_overlap(overlap), steps=4, callbacks=[AfterBackward()])
    _close(got, ref, f"on_after_backward {overlap}")


def test_assigned_embedding_with_cpu_embedding_matches_plain() -> None:
    """cpu_embedding=True keeps ``nn.Embedding`` weights on the host outside the chunks: a value given there must
    still be trained on."""

    def fn(net: nn.Module, call: int) -> None:
        net.wte.weight.data = _value((VOCAB, E), call)

    make = lambda: AssignIn("on_train_batch_start", fn, at=2)  # noqa: E731
    _compare(make, strategy=PatrickStarStrategy(cpu_embedding=True))


@pytest.mark.xfail(
    strict=True,
    reason="BUG: after `p.data = W` plain PyTorch's parameter IS W: a later in-place write to W (a handle the user "
    "kept) changes the weight; the engine copied W into the slot and let it go, so the write is silently lost",
)
def test_in_place_write_to_a_kept_handle_after_assignment_matches_plain_or_raises() -> None:
    handle: dict[str, torch.Tensor] = {}

    def fn(net: nn.Module, call: int) -> None:
        if call == 2:
            handle["w"] = _value((E, E), call)
            net.lin.weight.data = handle["w"]
        elif call == 3:
            with torch.no_grad():
                handle["w"].add_(0.5)  # plain: this is the parameter's storage

    make = lambda: AssignIn("on_train_batch_start", fn, at=2, every=True)  # noqa: E731
    ref, _ = _run("auto", make)
    try:
        got, _ = _run(PatrickStarStrategy(), make)
    except NewStorageError as err:
        assert "net.lin" in str(err)
        return
    _close(got, ref, "kept handle")


@pytest.mark.parametrize("overlap", ["off", "pipeline"])
def test_weight_of_a_block_shared_by_reentrant_checkpoints_assigned_matches_plain(overlap: str) -> None:
    def fn(net: nn.Module, call: int) -> None:
        net.block.mlp.fc.weight.data = _value((4 * N_EMBD, N_EMBD), call)

    make = lambda: AssignIn("on_train_batch_start", fn, at=2)  # noqa: E731
    ref, _ = _run("auto", make, build=Albert, steps=4)
    got, _ = _run(_host(overlap), make, build=Albert, steps=4)
    _close(got, ref, f"shared block assigned, {overlap}")


class MixedUses(Albert):
    """The shared block used both plainly and under reentrant checkpoints in one forward: ``order`` "plain-first"
    (the plain use's gradient lands last, after both recomputations) or "plain-last" (it lands first, before either
    recomputation)."""

    def __init__(self, order: str) -> None:
        super().__init__()
        self.order = order

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(self.wte(idx)) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        if self.order == "plain-first":
            x = self.block(x)
        x = checkpoint(self.block, x, use_reentrant=True)
        x = checkpoint(self.block, x, use_reentrant=True)
        if self.order == "plain-last":
            x = self.block(x)
        return self.head(x)


BF16_PLAIN_LAST = pytest.mark.xfail(
    strict=True,
    raises=RuntimeError,
    reason="KNOWN LIMIT (loud): bf16-mixed with the plain use last, the checkpoint's recomputation saves the block's"
    " weights outside the engine's saved-tensor hooks, and its inner backward lands their gradient in the slot"
    " (chunk reuse) while autograd still holds them: torch's in-place error (plain use first, and 32-true, work)",
)


@pytest.mark.parametrize(
    ("order", "overlap", "precision"),
    [
        *((order, overlap, "32-true") for order in ("plain-first", "plain-last") for overlap in ("off", "pipeline")),
        ("plain-first", "off", "bf16-mixed"),
        pytest.param("plain-last", "off", "bf16-mixed", marks=BF16_PLAIN_LAST),
    ],
)
def test_block_used_plainly_and_under_reentrant_checkpoints_matches_plain(
    order: str, overlap: str, precision: str
) -> None:
    def build() -> nn.Module:
        return MixedUses(order)

    data = make_loader(4 * 4, noise=0.0)
    ref = fit_steps(LM(build), "auto", steps=4, precision=precision, loader=data, accumulate_grad_batches=1)
    got = fit_steps(LM(build), _host(overlap), steps=4, precision=precision, loader=data)
    if precision == "32-true":
        assert_same_run(got, ref, what=f"{order} {overlap}")
        return
    assert got.losses == pytest.approx(ref.losses, rel=2e-2)
    piped = fit_steps(LM(build), _host("pipeline"), steps=4, precision=precision, loader=data)
    assert_runs_bitwise(piped, got, f"{order} bf16 pipeline")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_shared_block_accumulation_tight_budget_is_bitwise_the_unlimited_run(precision: str) -> None:
    itemsize = 4 if precision == "32-true" else 2
    data = make_loader(4 * 6, noise=0.0)
    kw = {"steps": 3, "precision": precision, "loader": data, "accumulate_grad_batches": 2, "gradient_clip_val": 0.05}
    free = fit_steps(LM(lambda: Albert(nested=True)), PatrickStarStrategy(), **kw)
    strategy = tight(4096, 3, itemsize=itemsize)
    got = fit_steps(LM(lambda: Albert(nested=True)), strategy, **kw)
    assert strategy.memory_report().evictions > 0
    assert got.losses == free.losses
    assert_states_equal(got.final, free.final, what=f"nested tight {precision}")
    if precision == "32-true":
        ref = fit_steps(LM(lambda: Albert(nested=True)), "auto", **kw)
        assert_same_run(free, ref, what="nested accumulate clip")


@pytest.mark.parametrize("hook", ["on_fit_start", "on_train_start"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_assignment_before_the_first_forward_matches_plain(hook: str, precision: str) -> None:
    """After the strategy's setup, before the warm-up iteration's first forward."""
    make = lambda: AssignIn(hook, set_lin_data, at=0)  # noqa: E731
    ref, rc = _run("auto", make, precision=precision)
    got, gc = _run(PatrickStarStrategy(), make, precision=precision)
    assert rc.fired == gc.fired == 1
    if precision == "32-true":
        _close(got, ref, hook)
    else:
        assert got.losses[0] == pytest.approx(ref.losses[0], rel=1e-2)
        assert_states_close(got.final, ref.final, what=hook, rtol=5e-2, atol=5e-3)
    assert got.recorder.initial_state["net.lin.weight"].equal(ref.recorder.initial_state["net.lin.weight"])


@pytest.mark.parametrize(("where", "precision"), [("tight", "bf16-mixed"), ("disk", "32-true")])
def test_assignment_every_step_is_bitwise_across_placements_and_modes(
    where: str, precision: str, tmp_path: Path
) -> None:
    """A value given every step before the forward (into the fp32 master in bf16-mixed): a tight budget or the disk
    tier (most families' Adam states on disk), serial or pipelined, give the bits of the unlimited serial run."""

    def fn(net: nn.Module, call: int) -> None:
        net.head.weight.data = _value((VOCAB, N_EMBD), call)

    make = lambda: AssignIn("on_train_batch_start", fn, at=1, every=True)  # noqa: E731
    kw = {"build": Albert, "steps": 4, "precision": precision, "loader": make_loader(16, noise=0.0)}
    base, _ = _run(_host("off"), make, **kw)
    # the disk tier at this host budget: "pipeline" needs more host buffers than 260KiB (refused at setup)
    for mode in ("off", "pipeline") if where == "tight" else ("off",):
        if where == "tight":
            strategy = PatrickStarStrategy(
                chunk_size=4096, placement="static", device_memory_limit=3 * 4096 * 2, optimizer_overlap=mode
            )
        else:
            strategy = _host(
                mode, chunk_size=2048, device_memory_limit="64MiB", host_memory_limit="260KiB", disk_path=str(tmp_path)
            )
        got, _ = _run(strategy, make, **kw)
        assert_runs_bitwise(got, base, f"{where} {mode}")
        report = strategy.memory_report()
        assert report.evictions > 0 if where == "tight" else report.disk_families > 0, report
    ref, _ = _run("auto", make, **kw)
    assert base.losses == pytest.approx(ref.losses, rel=2e-2 if precision == "bf16-mixed" else 1e-5)


def test_shared_block_bf16_under_a_host_budget_fits_or_is_refused_at_setup() -> None:
    data = make_loader(12, noise=0.0)
    kw = {"steps": 3, "precision": "bf16-mixed", "loader": data}
    free = fit_steps(LM(Albert), _host("off", chunk_size=2048, device_memory_limit="64MiB"), **kw)
    strategy = _host("off", chunk_size=2048, device_memory_limit="64MiB", host_memory_limit="300KiB")
    module = LM(Albert)
    try:
        got = fit_steps(module, strategy, **kw)
    except MemoryBudgetError as err:
        assert "host_memory_limit" in str(err) and "bug" not in str(err), err
        return
    assert_runs_bitwise(got, free, "host budget")


REPLACERS: dict[str, Callable[[nn.Module, int], None]] = {
    "new_parameter": lambda net, c: setattr(net.lin, "weight", nn.Parameter(_value((E, E), c))),
    "new_module": lambda net, c: setattr(net, "lin", nn.Linear(E, E)),
}


@pytest.mark.parametrize("how", list(REPLACERS))
def test_parameter_or_module_replaced_mid_run_matches_plain_or_raises(how: str) -> None:
    """``lin.weight = nn.Parameter(W)`` or ``net.lin = nn.Linear(...)`` mid-run: plain's optimizer still holds the
    old parameters, so the new ones train nowhere but the forward reads them, and the state dict saves them."""
    make = lambda: AssignIn("on_train_batch_start", REPLACERS[how], at=2)  # noqa: E731
    torch.manual_seed(0)
    ref, _ = _run("auto", make)
    torch.manual_seed(0)
    try:
        got, _ = _run(PatrickStarStrategy(), make)
    except (NewStorageError, RuntimeError, ValueError) as err:
        assert "'net.lin" in str(err) and "PatrickStar" in str(err) and "HINT" in str(err), err
        return
    _close(got, ref, how)


class ShrinkingNet(Net):
    """The parent's forward gives ``lin`` a new tensor before calling it (a weight decayed by hand each forward)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.lin.weight.data = self.lin.weight.detach() * 0.9
        return super().forward(idx)


@pytest.mark.parametrize("placement", ["default", "tight"])
def test_assignment_inside_the_parents_forward_matches_plain(placement: str) -> None:
    ref = fit_steps(LM(ShrinkingNet), "auto", steps=4)
    strategy = PatrickStarStrategy() if placement == "default" else _tight()
    got = fit_steps(LM(ShrinkingNet), strategy, steps=4)
    _close(got, ref, placement)


class InfAtLM(LM):
    """The loss of batch ``bad`` is infinite (its gradients NaN)."""

    def __init__(self, bad: int) -> None:
        super().__init__(Albert)
        self.bad = bad

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == self.bad else loss


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_shared_block_step_skipped_for_a_nonfinite_loss_drops_the_carried_gradients(precision: str) -> None:
    """nonfinite="skip": the step of batch 2 (NaN gradients, some carried over between the block's recomputations)
    is not applied and its gradients are gone: the run equals one over the same data without batch 2 (32-true:
    plain Lightning; bf16-mixed: the engine's own run without that batch)."""
    from torch.utils.data import DataLoader, Subset

    data = make_loader(4 * 5, noise=0.0)
    without = DataLoader(Subset(data.dataset, [i for i in range(20) if i // 4 != 2]), batch_size=4, shuffle=False)
    strategy = _host("pipeline", nonfinite="skip")
    got = fit_steps(InfAtLM(bad=2), strategy, steps=4, precision=precision, loader=data)
    assert strategy.memory_report().nonfinite_skipped_steps == 1
    ref_strategy: Any = "auto" if precision == "32-true" else _host("off")
    ref = fit_steps(LM(Albert), ref_strategy, steps=3, precision=precision, loader=without)
    assert len(got.losses) == 4 and not torch.isfinite(torch.tensor(got.losses[2]))
    finite = [x for i, x in enumerate(got.losses) if i != 2]
    assert len(finite) == len(ref.losses) == 3
    if precision == "32-true":
        assert finite == pytest.approx(ref.losses, rel=1e-5)
        assert_states_close(got.final, ref.final, what="skip", rtol=1e-5, atol=1e-6)
    else:
        assert finite == ref.losses
        assert_states_equal(got.final, ref.final, what="skip bf16")


@pytest.mark.parametrize("placement", ["default", "tight"])
def test_transposed_view_of_its_own_value_matches_plain_or_raises(placement: str) -> None:
    """``lin.weight.data = lin.weight.data.t()``: a view of the parameter's own slot, at the slot's own address (the
    transposition changes only the strides), so neither the address check nor the storage check sees it. Plain
    PyTorch trains the transposed weight from then on (reference: plain given the contiguous transposed copy, see
    CONTIGUOUS_REFERENCE)."""

    def view(net: nn.Module, call: int) -> None:
        net.lin.weight.data = net.lin.weight.data.t()

    def copy(net: nn.Module, call: int) -> None:
        net.lin.weight.data = net.lin.weight.data.t().contiguous()

    ref, _ = _run("auto", lambda: AssignIn("on_train_batch_start", copy, at=2))
    strategy = PatrickStarStrategy() if placement == "default" else _tight()
    try:
        got, _ = _run(strategy, lambda: AssignIn("on_train_batch_start", view, at=2))
    except NewStorageError as err:
        assert "net.lin.weight" in str(err)
        return
    _close(got, ref, f"transposed view, {placement}")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fabric_assignment_between_backward_and_step(precision: str) -> None:
    """Fabric, ``p.data = W`` after ``fabric.backward`` and before ``optimizer.step()``: 32-true steps W with the
    gradient as plain Fabric does; bf16-mixed (the slot holds the gradient) raises naming the parameter, and the
    weights are those of before the assignment."""

    def run(strategy: Any) -> Any:
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)
        return fabric.launch(loop)

    def loop(fabric: L.Fabric) -> Any:
        fabric.seed_everything(7)
        model = Net()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, optimizer = fabric.setup(model, optimizer)
        gen = torch.Generator().manual_seed(3)
        losses: list[float] = []
        before: dict[str, torch.Tensor] = {}
        try:
            for step in range(4):
                x = torch.randint(0, VOCAB, (4, 8), generator=gen)
                loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB).float(), x.reshape(-1))
                fabric.backward(loss)
                if step == 2:
                    before = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
                    model.lin.weight.data = _value((E, E), step)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss))
        except NewStorageError as err:
            after = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
            return err, before, after
        return losses, {k: v.detach().float().clone() for k, v in model.state_dict().items()}

    got = run(PatrickStarFabricStrategy())
    if precision == "bf16-mixed":
        err, before, after = got
        assert isinstance(err, NewStorageError), got
        assert "'lin.weight'" in str(err) and "between the backward and the optimizer step" in str(err)
        assert_states_equal(after, before, what="after the refusal")
        return
    ref_losses, ref_state = run("auto")
    losses, state = got
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert_states_close(state, ref_state, what="fabric after backward", rtol=1e-5, atol=1e-6)


class BeforeStep(L.Callback):
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == 2:
            self.before = trainer.strategy.lightning_module_state_dict()["net.lin.weight"].float().clone()
            set_lin_data(pl_module.net, 2)


def test_16_mixed_assignment_between_backward_and_step_is_refused_weights_unchanged() -> None:
    """fp16 with loss scaling: the slot holds the (scaled) gradient between backward and step: refused, naming the
    parameter, and the weight handed back is the one of before the assignment."""
    cb = BeforeStep()
    module = LM(Net)
    strategy = PatrickStarStrategy()
    with pytest.raises(NewStorageError, match=r"'net\.lin\.weight'.*between the backward and the optimizer step"):
        fit_steps(module, strategy, steps=4, plugins=[PatrickStarPrecision("16-mixed")], callbacks=[cb])
    assert torch.equal(module.net.lin.weight.detach().float(), cb.before)


def test_shared_block_16_mixed_overflowing_steps_drop_the_carried_gradients() -> None:
    """fp16 with a loss scale so large that the first steps overflow (some of the inf gradients carried over
    between the block's recomputations): those steps are skipped and their sums dropped; the pipelined and the
    serial step agree bit for bit, and training then proceeds with finite weights."""
    data = make_loader(4 * 8, noise=0.0)

    def run(overlap: str) -> tuple[FitResult, PatrickStarPrecision]:
        plugin = PatrickStarPrecision("16-mixed")
        strategy = _host(overlap, loss_scale={"initial_scale": 2.0**21})
        result = fit_steps(LM(Albert), strategy, steps=8, loader=data, plugins=[plugin])
        return result, result.trainer.strategy.precision_plugin  # type: ignore[attr-defined]

    serial, plugin = run("off")
    piped, piped_plugin = run("pipeline")
    assert plugin.skipped_steps == piped_plugin.skipped_steps == 3  # 2**21, 2**20, 2**19 overflow
    assert_runs_bitwise(piped, serial, "16-mixed overflow")
    assert all(torch.isfinite(v).all() for v in serial.final.values())
    # the skipped steps leave no trace: the run equals one that starts at scale 2**18 on the batches after them
    from torch.utils.data import DataLoader, Subset

    rest = DataLoader(Subset(data.dataset, range(12, 32)), batch_size=4, shuffle=False)
    strategy = _host("off", loss_scale={"initial_scale": 2.0**18})
    clean = fit_steps(LM(Albert), strategy, steps=5, loader=rest, plugins=[PatrickStarPrecision("16-mixed")])
    assert serial.losses[3:] == clean.losses
    assert_states_equal(serial.final, clean.final, what="after the skipped steps")
    moved = serial.recorder.initial_state["net.block.mlp.fc.weight"] - serial.final["net.block.mlp.fc.weight"]
    assert moved.abs().max() > 1e-4


class TieLaterNet(Net):
    """The head reads the embedding's weight from the forward of call ``at`` on (a tie made mid-run, by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == 3:
                self.head.weight = self.wte.weight
        return super().forward(idx)


@pytest.mark.parametrize("placement", ["default", "tight"])
def test_weights_tied_mid_run_match_plain_or_raise(placement: str) -> None:
    """``head.weight = wte.weight`` inside the forward of the third batch: plain's head reads the embedding from
    then on (both gradients summed into it) and the old head parameter stays in the optimizer with no gradient."""
    ref = fit_steps(LM(TieLaterNet), "auto", steps=5)
    strategy = PatrickStarStrategy() if placement == "default" else _tight()
    try:
        got = fit_steps(LM(TieLaterNet), strategy, steps=5)
    except (NewStorageError, RuntimeError, ValueError) as err:
        assert "'net.head.weight'" in str(err) and "HINT" in str(err), err
        return
    _close(got, ref, f"tied mid-run, {placement}")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_albert_shared_block_fabric_overlap_and_budget_bitwise_the_serial_run(precision: str) -> None:
    """Fabric, accumulation through no_backward_sync and clipping by value: the pipelined step and a tight budget
    give the serial run's bits."""

    def run(strategy: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)
        return fabric.launch(loop)

    def loop(fabric: L.Fabric) -> tuple[list[float], dict[str, torch.Tensor]]:
        fabric.seed_everything(7)
        model = Albert(nested=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, optimizer = fabric.setup(model, optimizer)
        losses = []
        for i, (x, y) in enumerate(make_loader(4 * 6, noise=0.0)):
            with fabric.no_backward_sync(model, enabled=i % 2 == 0):
                loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1)) / 2
                fabric.backward(loss)
            losses.append(float(loss))
            if i % 2 == 1:
                fabric.clip_gradients(model, optimizer, clip_val=0.01)
                optimizer.step()
                optimizer.zero_grad()
        return losses, {k: v.detach().float().clone().cpu() for k, v in model.state_dict().items()}

    serial = run(PatrickStarFabricStrategy(chunk_size=4096, optimizer_placement="host", optimizer_overlap="off"))
    piped = run(PatrickStarFabricStrategy(chunk_size=4096, optimizer_placement="host", optimizer_overlap="pipeline"))
    itemsize = 4 if precision == "32-true" else 2
    tight_fab = PatrickStarFabricStrategy(chunk_size=4096, placement="static", device_memory_limit=3 * 4096 * itemsize)
    budget = run(tight_fab)
    for other, what in ((piped, "pipeline"), (budget, "tight")):
        assert other[0] == serial[0], what
        assert_states_equal(other[1], serial[1], what=what)
    if precision == "32-true":
        ref = run("auto")
        assert serial[0] == pytest.approx(ref[0], rel=1e-5)
        # the key bias gets a gradient that is zero but for rounding (softmax ignores it), which Adam scales up to
        # lr-sized steps: compared without its key third
        for state in (serial[1], ref[1]):
            bias = state.pop("block.attn.qkv.bias")
            state["qv_bias"] = torch.cat([bias[:N_EMBD], bias[2 * N_EMBD :]])
        assert_states_close(serial[1], ref[1], what="plain fabric", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("where", "precision"), [("tight", "32-true"), ("tight", "bf16-mixed"), ("disk", "32-true")])
def test_refused_shape_with_evicted_or_disk_chunks_leaves_the_weights(
    where: str, precision: str, tmp_path: Path
) -> None:
    """A value of another shape given while the family's chunk is evicted (tight budget) or its master is on disk:
    refused naming it, and every weight is what it was before the assignment."""
    before: dict[str, torch.Tensor] = {}

    class Keep(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
            if idx == 2:
                state = trainer.strategy.lightning_module_state_dict()
                before.update({k: v.detach().float().clone() for k, v in state.items()})

    def fn(net: nn.Module, call: int) -> None:
        net.proj_in.weight.data = torch.zeros(N_EMBD, 4)

    if where == "tight":
        strategy = tight(4096, 3, itemsize=4 if precision == "32-true" else 2)
    else:
        strategy = PatrickStarStrategy(
            optimizer_placement="host",
            optimizer_overlap="off",
            chunk_size=2048,
            device_memory_limit="64MiB",
            host_memory_limit="260KiB",
            disk_path=str(tmp_path),
        )
    module = LM(Albert)
    cbs = [Keep(), AssignIn("on_train_batch_start", fn, at=2)]
    with pytest.raises(NewStorageError, match=r"'net\.proj_in\.weight': shape \(32, 4\), its slot holds \(32, 8\)"):
        fit_steps(module, strategy, steps=4, precision=precision, callbacks=cbs)
    assert module.net.proj_in.weight.shape == (N_EMBD, 8)
    after = {k: v.detach().float() for k, v in module.state_dict().items()}
    assert_states_equal(after, before, what=f"{where} {precision}")
    assert list(tmp_path.iterdir()) == []
    report = strategy.memory_report()
    assert report.evictions > 0 if where == "tight" else report.disk_families > 0, report


class AfterAccumulatingBackward(L.Callback):
    """``p.data = W`` after the backward of the first (accumulating) micro-batch of the second step."""

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if trainer.fit_loop.epoch_loop.batch_idx == 2:
            set_lin_data(pl_module.net, 2)


def test_bf16_assignment_after_an_accumulating_backward_matches_plain_or_is_refused() -> None:
    """bf16-mixed, accumulate_grad_batches=2: after the first micro-batch's backward the gradient is in the fp32
    sum, not the slot, so the value can be taken (plain: the second micro-batch computes with W, the step updates
    W); refusing it is acceptable only with the parameter named and the weights unchanged."""
    kw = {"accumulate_grad_batches": 2, "precision": "bf16-mixed", "loader": make_loader(4 * 8, noise=0.0)}
    ref = fit_steps(LM(Net), "auto", steps=4, callbacks=[AfterAccumulatingBackward()], **kw)
    try:
        got = fit_steps(LM(Net), PatrickStarStrategy(), steps=4, callbacks=[AfterAccumulatingBackward()], **kw)
    except NewStorageError as err:
        assert "'net.lin.weight'" in str(err), err
        return
    assert got.losses == pytest.approx(ref.losses, rel=1e-2)
    assert_states_close(got.final, ref.final, what="after accumulating backward", rtol=5e-2, atol=5e-3)
    plain = fit_steps(LM(Net), "auto", steps=4, **kw)
    assert not torch.allclose(plain.final["net.lin.weight"], ref.final["net.lin.weight"], atol=1e-3)
