"""Adversarial tests: gradient zeroing and dropping done other ways than ``optimizer.zero_grad()`` after the step,
and a module computing again before the step ([Note: a module's zero_grad], [Note: gradients set to None],
[Note: a forward after the gradient], [Note: gradients end with the step]).

Each Fabric loop runs once with plain Fabric and once with the strategy, on the same seed and data; the strategy
must match plain (32-true to ~1e-5) or refuse with a clear message. Schedules are compared bitwise with "off".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.pytorch.utilities import grad_norm

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarPrecision, PatrickStarStrategy
from tests.helpers.asserts import (
    assert_evicted,
    assert_runs_bitwise,
    assert_same_run,
    assert_states_close,
    assert_states_equal,
)
from tests.helpers.data import make_loader
from tests.helpers.fabric_loop import _state, batches
from tests.helpers.models import SEED, VOCAB, FlatGPT, TinyGPT, lm_loss
from tests.helpers.runs import LM, fit_steps
from tests.integration.test_accumulation_pipeline_adversarial import Gan, GanLM

STEPS = 4
Hook = Callable[[int, Any, Any, list[float]], None]  # (step, model, optimizer, seen)


def _opt_state(opt: Any) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state, flat, as plain tensors."""
    sd = opt.state_dict()["state"]
    return {f"{i}/{k}": torch.as_tensor(v).detach().float().clone() for i, e in sd.items() for k, v in e.items()}


def _nothing(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    pass


def _zero(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    opt.zero_grad()


def _loop(
    strategy: Any,
    *,
    before: Hook = _nothing,
    between: Hook = _nothing,
    after: Hook = _zero,
    precision: str = "32-true",
    steps: int = STEPS,
    retain: bool = False,
    build: Callable[[], torch.nn.Module] = FlatGPT,
) -> dict[str, Any]:
    """One Fabric loop on FlatGPT with AdamW: ``before`` runs before the forward, ``between`` between the backward
    and the step, ``after`` after the step (default: ``optimizer.zero_grad()``)."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)
    fabric.launch()
    torch.manual_seed(SEED)
    net = build()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    data, losses, seen = batches(1, 0), [], []
    for step in range(steps):
        x, y = next(data)
        before(step, model, opt, seen)
        loss = lm_loss(model(x), y)
        if retain:  # a retained graph run backward twice: plain sums the two gradients
            fabric.backward(loss, retain_graph=True)
        fabric.backward(loss)
        between(step, model, opt, seen)
        opt.step()
        after(step, model, opt, seen)
        losses.append(float(loss.detach()))
    return {"losses": losses, "seen": seen, "state": _state(fabric, model), "opt": _opt_state(opt)}


def _run_or_error(strategy: Any, **kw: Any) -> dict[str, Any] | Exception:
    try:
        return _loop(strategy, **kw)
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        return err


def _assert_matches(got: dict[str, Any], ref: dict[str, Any], what: str, rtol: float = 1e-5) -> None:
    assert got["losses"] == pytest.approx(ref["losses"], rel=rtol), what
    assert got["seen"] == pytest.approx(ref["seen"], rel=max(rtol, 1e-4)), what
    assert_states_close(got["state"], ref["state"], what=what, rtol=rtol, atol=10 * rtol)


def _assert_plain(what: str, **kw: Any) -> dict[str, Any]:
    """The strategy's run equals plain Fabric's (no refusal)."""
    ref = _loop("auto", **kw)
    got = _run_or_error(PatrickStarFabricStrategy(), **kw)
    assert not isinstance(got, Exception), f"{what}: refused a valid loop: {got}"
    _assert_matches(got, ref, what)
    return got


# ---- hooks ------------------------------------------------------------------------------------------------------


def _model_zero(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    model.zero_grad()


def _model_zero_keep(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    model.zero_grad(set_to_none=False)


def _inner_zero(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    model.module.zero_grad()


def _opt_zero_keep(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    opt.zero_grad(set_to_none=False)


def _all_none(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    for p in model.parameters():
        p.grad = None


def _drop_block1(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    if step % 2 == 1:
        for p in model.blocks[1].parameters():
            p.grad = None


def _head_zero(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    model.lm_head.zero_grad()
    model.ln_f.zero_grad()


def _head_zero_then_drop(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    model.ln_f.zero_grad()
    for p in model.blocks[1].parameters():
        p.grad = None


def _head_zero_then_read(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    model.ln_f.zero_grad()
    grads = [p.grad for p in model.blocks[1].parameters()]
    assert all(g is not None for g in grads), "p.grad silently None where plain has the gradient"
    seen.append(sum(float(g.norm()) for g in grads))


def _read_grads(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    seen.append(sum(float(p.grad.norm()) for p in model.parameters() if p.grad is not None))
    opt.zero_grad()


def _eval_forward(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    x, y = next(batches(1, 0))
    with torch.no_grad():
        seen.append(float(lm_loss(model(x), y)))


def _grad_forward(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    x, y = next(batches(1, 0))
    seen.append(float(lm_loss(model(x), y).detach()))  # autograd on, the graph thrown away


def _drop_then_forward(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    _drop_block1(step, model, opt, seen)
    _grad_forward(step, model, opt, seen)


def _forward_then_drop(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    _grad_forward(step, model, opt, seen)
    _drop_block1(step, model, opt, seen)


def _drop_everything_every_other(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    if step % 2 == 1:
        model.zero_grad()  # the step then has no gradient at all: plain changes nothing, counts nothing


def _head_zero_then_rest_none(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    model.ln_f.zero_grad()
    for name, p in model.module.named_parameters():
        if not name.startswith("ln_f."):
            p.grad = None  # with ln_f's zero_grad, every gradient gone: plain's zero_grad


def _some_none_after_step(step: int, model: Any, opt: Any, seen: list[float]) -> None:
    for p in model.blocks[1].parameters():
        p.grad = None  # the rest keeps the step's gradients: plain adds them to the next step's


# ---- tests ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (_zero, _nothing),
        (_model_zero, _nothing),
        (_nothing, _model_zero),
        (_nothing, _inner_zero),
        (_nothing, _opt_zero_keep),
        (_nothing, _all_none),
        pytest.param(
            _nothing,
            _model_zero_keep,
        ),
    ],
    ids=[
        "opt_zero_at_start",
        "model_zero_at_start",
        "model_zero",
        "module_zero",
        "opt_zero_keep",
        "p.grad=None_all",
        "model_zero_keep",
    ],
)
def test_ways_of_zeroing_match_plain_fabric(before: Hook, after: Hook) -> None:
    """Every way plain PyTorch clears the gradients between steps gives plain Fabric's run."""
    _assert_plain("zeroing", before=before, after=after)


def test_zeroing_only_the_head_is_refused_before_any_change() -> None:
    """Only ``lm_head``/``ln_f`` zeroed after each step: plain adds the rest's stale gradients to the next step's.
    The strategy refuses at the second step, naming zero_grad, before that step changes a weight."""
    ref = _loop("auto", after=_head_zero)
    assert not torch.equal(
        ref["state"]["blocks.0.fc.weight"], _loop("auto", after=_model_zero)["state"]["blocks.0.fc.weight"]
    )
    fabric = Fabric(accelerator="cpu", devices=1, strategy=PatrickStarFabricStrategy())
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    data = batches(1, 0)
    x, y = next(data)
    fabric.backward(lm_loss(model(x), y))
    opt.step()
    _head_zero(0, model, opt, [])
    before = _state(fabric, model)
    x, y = next(data)
    fabric.backward(lm_loss(model(x), y))
    with pytest.raises(RuntimeError, match=r"zero_grad\(\)"):
        opt.step()
    assert_states_equal(_state(fabric, model), before, what="weights after the refused step")


def test_subset_dropped_before_step_matches_plain_optimizer_state() -> None:
    """``p.grad = None`` for one block every other step: those parameters are not stepped; Adam's state and step
    count for them equal plain's."""
    ref = _loop("auto", between=_drop_block1)
    got = _assert_plain("subset dropped", between=_drop_block1)
    assert sorted(got["opt"]) == sorted(ref["opt"])
    for k, v in ref["opt"].items():
        torch.testing.assert_close(got["opt"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    steps = {v.item() for k, v in ref["opt"].items() if k.endswith("/step")}
    assert steps == {STEPS / 2, float(STEPS)}, steps  # the drop did change step counts: the check could fail


def test_submodule_zero_grad_then_dropping_others_before_step() -> None:
    """Between backward and step: ``model.ln_f.zero_grad()`` then ``p.grad = None`` for block 1. Plain steps neither;
    the strategy stepped block 1 (final blocks.1 weights off by ~3e-2)."""
    _assert_plain("ln_f.zero_grad then block 1 dropped", between=_head_zero_then_drop, steps=2)


def test_submodule_zero_grad_then_reading_others_is_refused_not_none() -> None:
    """After ``model.ln_f.zero_grad()`` block 1's ``p.grad`` must stay a stand-in that refuses use (as before the
    zero_grad), never a silent None a clipping loop would skip."""
    got = _run_or_error(PatrickStarFabricStrategy(), between=_head_zero_then_read, steps=1)
    assert isinstance(got, Exception) and "chunks" in str(got), got


def test_reading_p_grad_after_the_step_is_refused_never_none() -> None:
    """Plain Fabric has the step's gradients in ``p.grad`` until zero_grad; the strategy refuses a read."""
    assert _loop("auto", after=_read_grads)["seen"][0] > 0
    got = _run_or_error(PatrickStarFabricStrategy(), after=_read_grads)
    assert isinstance(got, Exception) and "HINT" in str(got), got


@pytest.mark.parametrize("between", [_eval_forward, _grad_forward], ids=["no_grad", "grad"])
def test_forward_between_backward_and_step_matches_plain(between: Hook) -> None:
    _assert_plain("forward between backward and step", between=between)


@pytest.mark.parametrize(
    ("before", "between"),
    [(_nothing, _eval_forward), (_nothing, _grad_forward), (_model_zero, _nothing)],
    ids=["no_grad_forward", "grad_forward", "model_zero_at_start"],
)
def test_bf16_neutral_patterns_change_nothing(before: Hook, between: Hook) -> None:
    """bf16-mixed: a forward between backward and step (its gradients carried over into fp32 sums, [Note: a forward
    after the gradient]) or zeroing at the loop start leaves the run bit for bit the plain loop's on the strategy
    (the strategy's bf16 differs from plain Fabric's autocast by design: ~2e-2 on weights after 4 steps)."""
    kw: dict[str, Any] = {"precision": "bf16-mixed"}
    control = _loop(PatrickStarFabricStrategy(), **kw)
    got = _loop(
        PatrickStarFabricStrategy(),
        before=before,
        between=between,
        after=_nothing if before is _model_zero else _zero,
        **kw,
    )
    assert got["losses"] == control["losses"]
    assert_states_equal(got["state"], control["state"], what="bf16 neutral pattern")


def test_bf16_dropped_subset_within_bf16_tolerance_of_plain() -> None:
    kw: dict[str, Any] = {"precision": "bf16-mixed"}
    ref = _loop("auto", between=_drop_block1, **kw)
    got = _loop(PatrickStarFabricStrategy(), between=_drop_block1, **kw)
    assert got["losses"] == pytest.approx(ref["losses"], rel=2e-3)
    assert_states_close(got["state"], ref["state"], what="bf16 subset dropped", rtol=3e-2, atol=3e-2)
    # the drop itself is honoured: block 1 moved less than in the run without the drop
    full = _loop(PatrickStarFabricStrategy(), **kw)
    assert not torch.allclose(got["state"]["blocks.1.fc.weight"], full["state"]["blocks.1.fc.weight"], atol=1e-3)


def test_retained_graph_backward_twice_sums_or_refuses_clearly() -> None:
    ref = _loop("auto", retain=True, steps=2)
    got = _run_or_error(PatrickStarFabricStrategy(), retain=True, steps=2)
    if isinstance(got, Exception):
        assert "HINT" in str(got), f"{type(got).__name__}: {got}"
        return
    _assert_matches(got, ref, "backward twice")


@pytest.mark.parametrize("mode", ["pipeline", "next_forward", "auto"])
@pytest.mark.parametrize(
    ("before", "between", "after"),
    [
        (_nothing, _drop_block1, _zero),
        (_model_zero, _nothing, _nothing),
        (_nothing, _grad_forward, _model_zero),
        (_model_zero, _drop_everything_every_other, _nothing),
    ],
    ids=["dropped", "model_zero_at_start", "grad_forward", "all_dropped_every_other"],
)
def test_overlap_modes_bitwise_vs_off(mode: str, before: Hook, between: Hook, after: Hook) -> None:
    kw: dict[str, Any] = {"before": before, "between": between, "after": after, "steps": 3}
    off = _loop(PatrickStarFabricStrategy(optimizer_overlap="off"), **kw)
    got = _loop(PatrickStarFabricStrategy(optimizer_overlap=mode), **kw)
    assert got["losses"] == off["losses"] and got["seen"] == off["seen"]
    assert_states_equal(got["state"], off["state"], what=f"{mode} vs off")
    assert_states_equal(got["opt"], off["opt"], what=f"{mode} vs off: optimizer")


@pytest.mark.parametrize(
    ("before", "between", "after"),
    [(_nothing, _drop_block1, _zero), (_model_zero, _nothing, _nothing), (_nothing, _grad_forward, _model_zero)],
    ids=["dropped", "model_zero_at_start", "grad_forward"],
)
def test_tight_device_budget_matches_plain(before: Hook, between: Hook, after: Hook) -> None:
    kw: dict[str, Any] = {"before": before, "between": between, "after": after, "steps": 3}
    # the brief's 3 chunks of 256 floats cannot hold FlatGPT's largest module (17,408 bytes): 3 of those
    strategy = PatrickStarFabricStrategy(chunk_size=256, placement="static", device_memory_limit=3 * 17_408)
    got = _run_or_error(strategy, **kw)
    assert not isinstance(got, Exception), got
    _assert_matches(got, _loop("auto", **kw), "tight budget")
    assert_evicted(strategy)


def test_disk_tier_with_dropped_gradients_bitwise(tmp_path: Path) -> None:
    opts: dict[str, Any] = {"device_memory_limit": "64MiB", "host_memory_limit": "64KiB"}
    mem = _loop(PatrickStarFabricStrategy(**opts), between=_drop_block1, after=_model_zero, steps=3)
    got = _loop(
        PatrickStarFabricStrategy(disk_path=str(tmp_path), **opts), between=_drop_block1, after=_model_zero, steps=3
    )
    assert got["losses"] == mem["losses"]
    assert_states_equal(got["state"], mem["state"], what="disk tier")
    assert_states_equal(got["opt"], mem["opt"], what="disk tier: optimizer")
    assert list(tmp_path.iterdir()) == []


# ---- Lightning: a critic trained every k-th batch, grad_norm ----------------------------------------------------


class CriticEveryK(GanLM):
    """Manual optimization: the generator steps every batch, the critic every ``k``-th, each zeroed by its own
    module's ``zero_grad()`` (``zero`` "module") or by ``self.zero_grad()`` of the whole LightningModule ("self").
    No toggles: the generator's backward also gives the critic gradients, which plain PyTorch sums into the
    critic's next step (with ``zero="module"``) until ``net.critic.zero_grad()``."""

    def __init__(self, k: int, zero: str) -> None:
        super().__init__(1)
        self.k = k
        self.zero = zero

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt_g, opt_c = self.optimizers()  # type: ignore[misc]
        x, y = batch
        net: Gan = self.net  # type: ignore[assignment]
        logits = net(x)
        g_loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
        g_loss = g_loss - 0.1 * net.critic(logits.float().softmax(-1)).float().mean()
        self.manual_backward(g_loss)
        opt_g.step()
        net.gen.zero_grad()
        if batch_idx % self.k == self.k - 1:
            fake = logits.detach().float().softmax(-1)
            c_loss = net.critic(fake).float().mean() - net.critic(F.one_hot(y, VOCAB).float()).float().mean()
            self.manual_backward(c_loss)
            opt_c.step()
            self.zero_grad() if self.zero == "self" else net.critic.zero_grad()
        return g_loss.detach()


@pytest.mark.parametrize("zero", ["module", "self"])
def test_critic_every_k_batches_matches_plain_lightning(zero: str) -> None:
    ref = fit_steps(CriticEveryK(2, zero), "auto", steps=6)
    got = _fit_or_error(lambda: fit_steps(CriticEveryK(2, zero), PatrickStarStrategy(), steps=6))
    if isinstance(got, Exception):
        assert "HINT" in str(got), f"{type(got).__name__}: {got}"
        return
    assert_same_run(got, ref, what=f"critic every 2 batches, zero={zero}")


def _fit_or_error(fit: Callable[[], Any]) -> Any:
    try:
        return fit()
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        return err


class GradNormLogger(LM):
    """Logs ``lightning.pytorch.utilities.grad_norm`` in ``on_before_optimizer_step``, as Lightning's docs show."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())
        self.norms: list[dict[str, Any]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.norms.append(grad_norm(self, norm_type=2))


def test_grad_norm_in_on_before_optimizer_step_refuses_never_logs_zeros() -> None:
    ref = fit_steps(GradNormLogger(), "auto", steps=1)
    assert ref.module.norms and float(ref.module.norms[0]["grad_2.0_norm_total"]) > 0
    module = GradNormLogger()
    got = _fit_or_error(lambda: fit_steps(module, PatrickStarStrategy(), steps=1))
    assert isinstance(got, Exception), f"grad_norm ran and logged {module.norms[:1]} (plain: {ref.module.norms[0]})"
    assert "HINT" in str(got), got


# ---- Fabric: two optimizers over disjoint parameters; accumulation ----------------------------------------------


class TwoNets(torch.nn.Module):
    """A generator (FlatGPT) and a critic scoring its softmaxed logits."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = FlatGPT()
        self.critic = torch.nn.Sequential(torch.nn.Linear(VOCAB, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gen(idx)


def _two_optimizers(strategy: Any, k: int, steps: int = 4) -> dict[str, Any]:
    """The generator steps every batch, zeroed by ``model.gen.zero_grad()``; the critic every ``k``-th batch,
    zeroed by ``model.critic.zero_grad()``; the generator's backward also gives the critic gradients (summed into
    the critic's next step by plain PyTorch)."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(SEED)
    net = TwoNets()
    opt_g = torch.optim.AdamW(net.gen.parameters(), lr=1e-2)
    opt_c = torch.optim.Adam(net.critic.parameters(), lr=1e-3, betas=(0.5, 0.9))
    model, opt_g, opt_c = fabric.setup(net, opt_g, opt_c)
    data, losses = batches(1, 0), []
    for step in range(steps):
        x, y = next(data)
        logits = model(x)
        g_loss = lm_loss(logits, y) - 0.1 * model.critic(logits.softmax(-1)).mean()
        fabric.backward(g_loss)
        opt_g.step()
        model.gen.zero_grad()
        if step % k == k - 1:
            fake = logits.detach().softmax(-1)
            c_loss = model.critic(fake).mean() - model.critic(F.one_hot(y, VOCAB).float()).mean()
            fabric.backward(c_loss)
            opt_c.step()
            model.critic.zero_grad()
        losses.append(float(g_loss.detach()))
    return {"losses": losses, "seen": [], "state": _state(fabric, model), "opt": _opt_state(opt_c)}


@pytest.mark.parametrize("k", [1, 2])
def test_fabric_two_optimizers_each_zeroed_by_its_module(k: int) -> None:
    ref = _two_optimizers("auto", k)
    got = _two_optimizers(PatrickStarFabricStrategy(), k)
    _assert_matches(got, ref, f"two optimizers, critic every {k}")
    for name, v in ref["opt"].items():
        torch.testing.assert_close(got["opt"][name], v, rtol=1e-5, atol=1e-6)


def _accumulate(
    strategy: Any, precision: str = "32-true", accumulate: int = 2, steps: int = 3, mid: str | None = None
) -> dict[str, Any]:
    """Accumulation with ``fabric.no_backward_sync`` on all but the last micro-batch, ``model.zero_grad()`` after
    each step, block 1's gradients dropped before every second step."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    data, losses = batches(1, 0), []
    for step in range(steps):
        for micro in range(accumulate):
            x, y = next(data)
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = lm_loss(model(x), y)
                fabric.backward(loss / accumulate)
            losses.append(float(loss.detach()))
            if micro == 0 and mid == "block0_zero":  # block 0's sum so far dropped inside the window
                model.blocks[0].zero_grad()
            elif micro == 0 and mid == "block0_none":
                for p in model.blocks[0].parameters():
                    p.grad = None
        _drop_block1(step, model, opt, [])
        opt.step()
        model.zero_grad()
    return {"losses": losses, "seen": [], "state": _state(fabric, model), "opt": _opt_state(opt)}


@pytest.mark.parametrize("mid", [None, "block0_zero", "block0_none"])
def test_fabric_no_backward_sync_accumulation_with_model_zero_grad(mid: str | None) -> None:
    """With ``mid``, block 0's gradients summed so far are dropped after the window's first micro-batch (its
    ``zero_grad()`` or ``p.grad = None``): plain steps block 0 on the last micro-batch's gradient alone."""
    ref = _accumulate("auto", mid=mid)
    if mid is not None:
        assert not torch.equal(ref["state"]["blocks.0.fc.weight"], _accumulate("auto")["state"]["blocks.0.fc.weight"])
    _assert_matches(_accumulate(PatrickStarFabricStrategy(), mid=mid), ref, f"no_backward_sync, mid={mid}")


@pytest.mark.parametrize("mode", ["pipeline", "next_forward", "auto"])
def test_fabric_accumulation_with_model_zero_grad_overlap_bitwise(mode: str) -> None:
    off = _accumulate(PatrickStarFabricStrategy(optimizer_overlap="off"), precision="bf16-mixed")
    got = _accumulate(PatrickStarFabricStrategy(optimizer_overlap=mode), precision="bf16-mixed")
    assert got["losses"] == off["losses"]
    assert_states_equal(got["state"], off["state"], what=f"{mode} vs off")
    assert_states_equal(got["opt"], off["opt"], what=f"{mode} vs off: optimizer")


# ---- more orders of zeroing, dropping and computing -------------------------------------------------------------


@pytest.mark.parametrize(
    ("between", "after"),
    [
        (_drop_then_forward, _zero),
        (_forward_then_drop, _zero),
        (_drop_everything_every_other, _zero),
        pytest.param(
            _nothing,
            _head_zero_then_rest_none,
        ),
    ],
    ids=["drop_then_forward", "forward_then_drop", "model_zero_before_step", "ln_f_zero_then_rest_none_after_step"],
)
def test_more_orders_match_plain_fabric(between: Hook, after: Hook) -> None:
    got = _assert_plain("order", between=between, after=after)
    ref = _loop("auto", between=between, after=after)
    assert sorted(got["opt"]) == sorted(ref["opt"])
    for k, v in ref["opt"].items():
        torch.testing.assert_close(got["opt"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_subset_set_to_none_after_the_step_without_zero_grad_is_refused() -> None:
    """After the step only block 1's ``p.grad`` goes to None: plain adds the others' stale gradients to the next
    step's. Refused at the next step (the sum is gone), naming zero_grad."""
    ref = _loop("auto", after=_some_none_after_step)
    assert not torch.equal(ref["state"]["blocks.0.fc.weight"], _loop("auto")["state"]["blocks.0.fc.weight"])
    got = _run_or_error(PatrickStarFabricStrategy(), after=_some_none_after_step)
    assert isinstance(got, RuntimeError) and "zero_grad()" in str(got) and "HINT" in str(got), got


class ZeroesWithModule(LM):
    """Automatic optimization whose ``optimizer_zero_grad`` zeroes with the module's ``zero_grad`` (``part``:
    the whole LightningModule, or only the head: then plain sums the rest's gradients across steps)."""

    def __init__(self, part: str) -> None:
        super().__init__(lambda: TinyGPT())
        self.part = part

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        (self if self.part == "all" else self.net.lm_head).zero_grad()


def test_optimizer_zero_grad_override_with_module_zero_grad_matches_plain() -> None:
    ref = fit_steps(ZeroesWithModule("all"), "auto", steps=4)
    got = fit_steps(ZeroesWithModule("all"), PatrickStarStrategy(), steps=4)
    assert_same_run(got, ref, what="optimizer_zero_grad -> self.zero_grad()")


def test_optimizer_zero_grad_override_zeroing_only_the_head_is_refused() -> None:
    got = _fit_or_error(lambda: fit_steps(ZeroesWithModule("head"), PatrickStarStrategy(), steps=3))
    assert isinstance(got, RuntimeError) and "zero_grad()" in str(got) and "HINT" in str(got), got


class DropsAndComputes(LM):
    """Automatic optimization: in ``on_before_optimizer_step`` block 1's gradients go to None every other step and
    an evaluation forward with autograd on runs ([Note: a forward after the gradient])."""

    def __init__(self) -> None:
        super().__init__(lambda: TinyGPT())
        self.seen: list[float] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.trainer.global_step % 2 == 1:
            for p in self.net.blocks[1].parameters():
                p.grad = None
        x, y = next(iter(make_loader(n_seq=4)))
        self.seen.append(float(self.training_step((x, y), 0).detach()))


@pytest.mark.parametrize("mode", ["pipeline", "next_forward", "auto"])
def test_16_mixed_drops_and_forward_before_step_bitwise_vs_off(mode: str) -> None:
    plugins = {"plugins": [PatrickStarPrecision("16-mixed")]}
    off = fit_steps(DropsAndComputes(), PatrickStarStrategy(optimizer_overlap="off"), steps=4, **plugins)
    plugins = {"plugins": [PatrickStarPrecision("16-mixed")]}
    got = fit_steps(DropsAndComputes(), PatrickStarStrategy(optimizer_overlap=mode), steps=4, **plugins)
    assert got.module.seen == off.module.seen
    assert_runs_bitwise(got, off, f"16-mixed {mode}")


def test_32_drops_and_forward_before_step_match_plain_lightning() -> None:
    ref = fit_steps(DropsAndComputes(), "auto", steps=4)
    got = fit_steps(DropsAndComputes(), PatrickStarStrategy(), steps=4)
    assert got.module.seen == pytest.approx(ref.module.seen, rel=1e-5)
    assert_same_run(got, ref, what="drops and a forward in on_before_optimizer_step")


def _compiled_blocks() -> torch.nn.Module:
    net = FlatGPT()
    for i, block in enumerate(net.blocks):
        net.blocks[i] = torch.compile(block, backend="aot_eager")
    return net


def test_compiled_blocks_zeroed_by_module_and_dropped_match_plain_fabric() -> None:
    """Blocks compiled (dynamo, aot_eager): ``model.zero_grad()`` at the loop start, block 1 dropped every other
    step, a forward with autograd between backward and step."""
    torch._dynamo.reset()
    kw: dict[str, Any] = {"before": _model_zero, "between": _drop_then_forward, "after": _nothing, "steps": 3}
    _assert_plain("compiled blocks", build=_compiled_blocks, **kw)


def test_module_zero_grad_is_given_back_after_teardown() -> None:
    """The instance ``zero_grad`` each module got goes with the strategy: the user's model zeroes as plain after."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=PatrickStarFabricStrategy())
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    x, y = next(batches(1, 0))
    fabric.backward(lm_loss(model(x), y))
    opt.step()
    model.zero_grad()
    fabric.strategy.teardown()
    assert [n for n, m in net.named_modules() if "zero_grad" in m.__dict__] == []


def _gen_step_then_critic(strategy: Any, action: str) -> dict[str, Any]:
    """One backward gives both the generator and the critic gradients; the generator steps and zeroes; then, on the
    second iteration, ``action`` on the critic's ``p.grad`` ("drop": set to None, so plain does not step the critic;
    "read": plain has its gradient); then the critic steps."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(SEED)
    net = TwoNets()
    opt_g = torch.optim.AdamW(net.gen.parameters(), lr=1e-2)
    opt_c = torch.optim.Adam(net.critic.parameters(), lr=1e-2)
    model, opt_g, opt_c = fabric.setup(net, opt_g, opt_c)
    data, seen = batches(1, 0), []
    for step in range(2):
        x, y = next(data)
        logits = model(x)
        fabric.backward(lm_loss(logits, y) - model.critic(logits.softmax(-1)).mean())
        opt_g.step()
        opt_g.zero_grad()
        if step == 1 and action == "drop":
            for p in model.critic.parameters():
                p.grad = None
        if step == 1 and action == "read":
            grads = [p.grad for p in model.critic.parameters()]
            assert all(g is not None for g in grads), "the critic's p.grad silently None (plain: its gradient)"
            seen.append(sum(float(g.norm()) for g in grads))
        opt_c.step()
        opt_c.zero_grad()
    return {"losses": [], "seen": seen, "state": _state(fabric, model), "opt": _opt_state(opt_c)}


def test_other_optimizers_gradients_dropped_after_one_steps() -> None:
    ref = _gen_step_then_critic("auto", "drop")
    _assert_matches(_gen_step_then_critic(PatrickStarFabricStrategy(), "drop"), ref, "critic dropped after gen step")


def test_other_optimizers_gradients_read_after_one_steps_refused_not_none() -> None:
    got = _run_or_error_call(lambda: _gen_step_then_critic(PatrickStarFabricStrategy(), "read"))
    assert isinstance(got, Exception) and "chunks" in str(got), got


def _run_or_error_call(run: Callable[[], Any]) -> Any:
    try:
        return run()
    except (RuntimeError, ValueError, TypeError, NotImplementedError) as err:
        return err


class DropsCriticAfterGenStep(GanLM):
    """Manual optimization, no toggles: one backward gives the generator and the critic gradients; the generator
    steps and zeroes; every second batch the critic's gradients are then set to None (plain: the critic's step
    changes nothing, counts nothing) before the critic steps."""

    def __init__(self) -> None:
        super().__init__(1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt_g, opt_c = self.optimizers()  # type: ignore[misc]
        x, y = batch
        net: Gan = self.net  # type: ignore[assignment]
        logits = net(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
        loss = loss - 0.1 * net.critic(logits.float().softmax(-1)).float().mean()
        self.manual_backward(loss)
        opt_g.step()
        opt_g.zero_grad()
        if batch_idx % 2 == 1:
            for p in net.critic.parameters():
                p.grad = None
        opt_c.step()
        opt_c.zero_grad()
        return loss.detach()


def test_trainer_other_optimizers_gradients_dropped_after_one_steps() -> None:
    ref = fit_steps(DropsCriticAfterGenStep(), "auto", steps=4)
    got = fit_steps(DropsCriticAfterGenStep(), PatrickStarStrategy(), steps=4)
    assert_same_run(got, ref, what="critic dropped after the generator's step")


def _second_backward_through_a_submodule(strategy: Any, precision: str, autocast: bool) -> dict[str, Any]:
    """After the model's backward, a second backward through ``ln_f`` alone (called directly, on a fresh input)
    before the step: plain sums both into ln_f's gradients ([Note: a forward after the gradient])."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    data, losses, gen = batches(1, 0), [], torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = next(data)
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        h = torch.randn(2, 4, 32, generator=gen)
        if autocast:
            with fabric.autocast():
                aux = model.ln_f(h).float().pow(2).mean()
        else:
            aux = model.ln_f(h).float().pow(2).mean()
        fabric.backward(aux)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "seen": [], "state": _state(fabric, model), "opt": _opt_state(opt)}


def test_second_backward_through_a_submodule_before_step_sums_as_plain() -> None:
    ref = _second_backward_through_a_submodule("auto", "32-true", False)
    got = _second_backward_through_a_submodule(PatrickStarFabricStrategy(), "32-true", False)
    _assert_matches(got, ref, "second backward through ln_f")


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "no_autocast"])
def test_bf16_second_backward_through_a_submodule_within_bf16_tolerance(autocast: bool) -> None:
    """bf16-mixed, ln_f called directly on an fp32 input (with or without autocast): it crashed inside torch ('mixed
    dtype (CPU)') until a LayerNorm fed fp32 computed with fp32 copies of its weights (tests/integration/
    test_norms_mixed.py)."""
    ref = _second_backward_through_a_submodule("auto", "bf16-mixed", autocast)
    got = _second_backward_through_a_submodule(PatrickStarFabricStrategy(), "bf16-mixed", autocast)
    assert got["losses"] == pytest.approx(ref["losses"], rel=2e-3)
    assert_states_close(got["state"], ref["state"], what="bf16 second backward", rtol=3e-2, atol=3e-2)
