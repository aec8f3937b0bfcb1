"""Adversarial Fabric tests: loops the team did not write, against plain Fabric (no strategy) or the serial
``optimizer_overlap="off"`` run, or asserting a clear refusal."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from lightning_pstar import PatrickStarFabricStrategy
from lightning_pstar.checkpoint import CheckpointError, full_state_dict
from lightning_pstar.optim.optimizer import NonFiniteStepError
from tests.helpers.asserts import assert_states_close, assert_states_equal, max_rel_diff
from tests.helpers.fabric_loop import LoopSpec, _state, batches, train
from tests.helpers.models import SEED, FlatGPT, lm_loss

LOSS_RTOL = 1e-5


@pytest.mark.parametrize("mode", ["pipeline", "next_forward", "auto"])
def test_overlap_modes_bitwise_vs_off_with_clip_and_accumulate(mode: str) -> None:
    common: dict[str, Any] = {"steps": 3, "accumulate": 2, "clip_norm": 0.5, "two_groups": True}
    off = train(LoopSpec(strategy=PatrickStarFabricStrategy(optimizer_overlap="off"), **common))
    got = train(LoopSpec(strategy=PatrickStarFabricStrategy(optimizer_overlap=mode), **common))
    assert got.losses == off.losses
    assert got.grad_norms == off.grad_norms
    assert_states_equal(got.state, off.state, what=f"overlap {mode} vs off")


def _twice_per_step(strategy: Any, set_to_none: bool) -> list[float]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    stream = batches(1, 0)
    losses = []
    for _ in range(3):
        x1, y1 = next(stream)
        x2, y2 = next(stream)
        loss = lm_loss(model(x1), y1) + 0.5 * lm_loss(model(x2), y2)  # the module called twice in one step
        fabric.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        losses.append(float(loss.detach()))
    with torch.no_grad():
        x, y = next(stream)
        losses.append(float(lm_loss(model(x), y)))
    return losses


@pytest.mark.parametrize("set_to_none", [True, False])
def test_module_called_twice_per_step_matches_plain(set_to_none: bool) -> None:
    ref = _twice_per_step("auto", set_to_none)
    got = _twice_per_step("patrickstar", set_to_none)
    assert max_rel_diff(got, ref) <= LOSS_RTOL, f"{got} vs plain Fabric {ref}"


def _set_up() -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy="patrickstar")
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    return fabric, model, opt


def test_add_param_group_after_setup_refused_before_any_change() -> None:
    fabric, model, opt = _set_up()
    groups_before = len(opt.param_groups)
    with pytest.raises(NotImplementedError, match="parameter groups cannot be added"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))], "lr": 0.1})
    assert len(opt.param_groups) == groups_before
    x, y = next(batches(1, 0))  # the optimizer still trains afterwards
    fabric.backward(lm_loss(model(x), y))
    opt.step()


def test_lbfgs_refused_at_setup() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, strategy="patrickstar")
    fabric.launch()
    net = FlatGPT()
    with pytest.raises(TypeError, match="LBFGS.*HINT"):
        fabric.setup(net, torch.optim.LBFGS(net.parameters(), lr=0.1))


@pytest.mark.parametrize("direction", ["plain_to_pstar", "pstar_to_plain"])
def test_resume_across_plain_fabric_and_patrickstar(direction: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    common: dict[str, Any] = {"steps": 4, "two_groups": True, "scheduler": True}
    pstar = PatrickStarFabricStrategy(checkpoint="consolidated")
    first, second = ("auto", pstar) if direction == "plain_to_pstar" else (pstar, "auto")
    whole = train(LoopSpec(strategy=first, save_at=2, checkpoint=path, **common))
    resumed = train(LoopSpec(strategy=second, resume_from=path, **common))
    assert len(resumed.losses) == 2
    assert max_rel_diff(resumed.losses, whole.losses[2:]) <= LOSS_RTOL, f"{resumed.losses} vs {whole.losses[2:]}"
    assert_states_close(resumed.state, whole.state, what=f"resume {direction}")


def test_extra_user_state_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    fabric, model, opt = _set_up()
    x, y = next(batches(1, 0))
    fabric.backward(lm_loss(model(x), y))
    opt.step()
    extra = {"rng": torch.arange(5), "name": "run-1", "nested": {"best": 0.25, "hist": [1, 2]}}
    fabric.save(path, {"model": model, "optimizer": opt, "step": 7, "extra": extra})
    fabric2, model2, opt2 = _set_up()
    state: dict[str, Any] = {"model": model2, "optimizer": opt2, "step": 0}
    rest = fabric2.load(path, state)
    assert state["step"] == 7
    assert torch.equal(rest["extra"]["rng"], torch.arange(5))
    assert rest["extra"]["name"] == "run-1" and rest["extra"]["nested"] == {"best": 0.25, "hist": [1, 2]}
    # the loaded pair continues exactly as the saved one
    x, y = next(batches(1, 0))
    a = lm_loss(model(x), y)
    b = lm_loss(model2(x), y)
    assert torch.equal(a, b)


class _Tied(torch.nn.Module):
    """A parameter shared by two modules (tied embedding and head), and a submodule called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.mid(h))  # the same Linear twice
        return self.head(h)


def _tied_run(strategy: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(SEED)
    net = _Tied()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    stream = batches(1, 0)
    losses = []
    for _ in range(3):
        x, y = next(stream)
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    sd = fabric.strategy.get_module_state_dict(model._forward_module) if strategy == "auto" else None
    if sd is None:
        sd = full_state_dict(fabric.strategy.chunk_manager)
    return losses, {k: v.detach().float().clone() for k, v in sd.items()}


def test_tied_parameter_and_reused_submodule_match_plain() -> None:
    ref_losses, ref_state = _tied_run("auto")
    got_losses, got_state = _tied_run("patrickstar")
    assert max_rel_diff(got_losses, ref_losses) <= LOSS_RTOL, f"{got_losses} vs plain {ref_losses}"
    assert torch.allclose(got_state["emb.weight"], ref_state["emb.weight"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["pipeline", "next_forward", "auto"])
def test_bf16_overlap_modes_bitwise_vs_off(mode: str) -> None:
    common: dict[str, Any] = {"steps": 3, "precision": "bf16-mixed", "clip_val": 0.01, "eval_between": True}
    off = train(LoopSpec(strategy=PatrickStarFabricStrategy(optimizer_overlap="off"), **common))
    got = train(LoopSpec(strategy=PatrickStarFabricStrategy(optimizer_overlap=mode), **common))
    assert got.losses == off.losses and got.eval_losses == off.eval_losses
    assert_states_equal(got.state, off.state, what=f"bf16 overlap {mode} vs off")


def _autocast_eval_run(strategy: Any, precision: str) -> tuple[list[float], list[float], torch.Tensor]:
    """fabric.autocast() around the forward, an eval()/no_grad pass between steps, reading model.module weights."""
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
    stream = batches(1, 0)
    losses, evals = [], []
    for _ in range(3):
        x, y = next(stream)
        model.train()
        with fabric.autocast():
            loss = lm_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(float(loss.detach()))
        model.eval()
        with torch.no_grad():
            evals.append(float(lm_loss(model(x), y)))
    first = next(p for p in model.module.parameters() if p.requires_grad)
    return losses, evals, first.detach().float().clone()


def test_autocast_eval_mode_and_module_weights_match_plain() -> None:
    ref = _autocast_eval_run("auto", "32-true")
    got = _autocast_eval_run("patrickstar", "32-true")
    assert max_rel_diff(got[0], ref[0]) <= LOSS_RTOL, f"{got[0]} vs plain {ref[0]}"
    assert max_rel_diff(got[1], ref[1]) <= LOSS_RTOL, f"eval {got[1]} vs plain {ref[1]}"
    assert got[2].shape == ref[2].shape and torch.allclose(got[2], ref[2], rtol=1e-5, atol=1e-6)


def test_clip_nonfinite_without_error_matches_plain_skip_semantics() -> None:
    """error_if_nonfinite=False: plain Fabric returns a non-finite norm and the step writes NaN weights; the engine
    must not silently produce finite-but-different weights: it either matches (non-finite) or raises clearly."""
    fabric, model, opt = _set_up()
    x, y = next(batches(1, 0))
    fabric.backward(lm_loss(model(x), y) * float("inf"))
    before = {k: v.clone() for k, v in full_state_dict(fabric.strategy.chunk_manager).items()}
    norm = fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
    assert not torch.isfinite(norm)
    with pytest.raises(NonFiniteStepError, match="not finite.*HINT"):  # the default policy: refuse the step
        opt.step()
    assert_states_equal(full_state_dict(fabric.strategy.chunk_manager), before, what="after refused step")


def test_setup_module_without_optimizer_inference_matches_plain() -> None:
    outs = []
    for strategy in ("auto", "patrickstar"):
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
        fabric.launch()
        torch.manual_seed(SEED)
        model = fabric.setup_module(FlatGPT())
        x, _ = next(batches(1, 0))
        with torch.no_grad():
            outs.append(model(x).float().clone())
    assert torch.allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6), (outs[1] - outs[0]).abs().max()


def test_wrapped_optimizer_state_dict_round_trip_continues_exactly() -> None:
    fabric, model, opt = _set_up()
    stream = batches(1, 0)
    x, y = next(stream)
    fabric.backward(lm_loss(model(x), y))
    opt.step()
    opt.zero_grad()
    sd = opt.state_dict()
    assert len(sd["state"]) > 0 and all("exp_avg" in s for s in sd["state"].values())
    # a plain torch optimizer over a plain copy accepts it
    plain = FlatGPT()
    torch.optim.AdamW(plain.parameters(), lr=1e-2).load_state_dict(sd)
    _, _, opt2 = _set_up()
    opt2.load_state_dict(sd)
    assert opt2.state_dict()["state"].keys() == sd["state"].keys()
    for k in sd["state"]:
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt2.state_dict()["state"][k][name], sd["state"][k][name]), (k, name)


def test_load_raw_and_partial_strict_false(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    fabric, model, opt = _set_up()
    x, y = next(batches(1, 0))
    fabric.backward(lm_loss(model(x), y))
    opt.step()
    fabric.save(path, {"model": model, "optimizer": opt, "step": 1})
    trained = full_state_dict(fabric.strategy.chunk_manager)
    # load_raw of the model weights into a fresh PatrickStar model
    fabric2, model2, _ = _set_up()
    raw = torch.load(path, weights_only=True)["model"]
    raw_path = tmp_path / "raw.pt"
    torch.save(raw, raw_path)
    fabric2.load_raw(raw_path, model2)
    assert_states_equal(full_state_dict(fabric2.strategy.chunk_manager), trained, what="load_raw")
    # strict=False with only the model requested: loads the model, leaves the rest in the returned dict
    fabric3, model3, _ = _set_up()
    rest = fabric3.load(path, {"model": model3}, strict=False)
    assert_states_equal(full_state_dict(fabric3.strategy.chunk_manager), trained, what="strict=False")
    assert "optimizer" in rest and rest["step"] == 1


def _direct_submodule_run(strategy: Any, first: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    stream = batches(1, 0)
    losses = []
    for _ in range(3):
        x, y = next(stream)
        if first:  # a submodule called directly (not through the wrapper) before the wrapper's forward
            extra = 0.1 * model.module.wte(x).pow(2).mean()
            loss = extra + lm_loss(model(x), y)
        else:
            loss = lm_loss(model(x), y) + 0.1 * model.module.wte(x).pow(2).mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    if strategy == "auto":
        sd = fabric.strategy.get_module_state_dict(model._forward_module)
    else:
        sd = full_state_dict(fabric.strategy.chunk_manager)
    return losses, {k: v.detach().float().clone() for k, v in sd.items()}


@pytest.mark.parametrize("first", [True, False], ids=["direct_first", "direct_after"])
@pytest.mark.filterwarnings("ignore")
def test_submodule_called_directly_in_the_step_matches_plain(first: bool) -> None:
    ref_losses, ref_state = _direct_submodule_run("auto", first)
    got_losses, got_state = _direct_submodule_run("patrickstar", first)
    assert max_rel_diff(got_losses, ref_losses) <= LOSS_RTOL, f"{got_losses} vs plain {ref_losses}"
    assert_states_close(got_state, ref_state, what=f"direct submodule first={first}")


def _opt_run(strategy: Any, make: Any) -> list[float]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, make(net.parameters()))
    stream = batches(1, 0)
    losses = []
    for _ in range(2):
        for k in range(3):  # accumulation over 3 micro-batches with a no_grad eval in the middle
            x, y = next(stream)
            with fabric.no_backward_sync(model, enabled=k < 2):
                loss = lm_loss(model(x), y)
                fabric.backward(loss / 3)
            losses.append(float(loss.detach()))
            if k == 1:
                with torch.no_grad():
                    losses.append(float(lm_loss(model(x), y)))
        opt.step()
        opt.zero_grad(set_to_none=False)
    x, y = next(stream)
    with torch.no_grad():
        losses.append(float(lm_loss(model(x), y)))
    return losses


OPTIMIZERS = {
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "sgd_dampening_maximize": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.5, maximize=True),
    "adamw_maximize_betas": lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.5, 0.9), eps=1e-3, maximize=True),
    "adam_tensor_lr": lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-2), weight_decay=0.1),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_variants_with_accumulation_match_plain(name: str) -> None:
    ref = _opt_run("auto", OPTIMIZERS[name])
    got = _opt_run("patrickstar", OPTIMIZERS[name])
    assert max_rel_diff(got, ref) <= LOSS_RTOL, f"{name}: {got} vs plain {ref}"


def test_amsgrad_refused_at_setup_with_hint() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, strategy="patrickstar")
    fabric.launch()
    net = FlatGPT()
    with pytest.raises(ValueError, match="amsgrad.*HINT"):
        fabric.setup(net, torch.optim.Adam(net.parameters(), lr=1e-2, amsgrad=True))


def _midrun_changes(strategy: Any, change: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    stream = batches(1, 0)
    losses = []
    for i in range(4):
        if i == 2 and change == "hyperparams":  # edited by hand in param_groups, as a user schedule would
            for group in opt.param_groups:
                group["lr"], group["weight_decay"], group["betas"] = 3e-2, 0.5, (0.8, 0.99)
        if i == 2 and change == "freeze":  # frozen mid-run: plain AdamW then skips it (no decay either)
            model.module.wte.weight.requires_grad_(False)
        x, y = next(stream)
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    if strategy == "auto":
        sd = fabric.strategy.get_module_state_dict(model._forward_module)
    else:
        sd = full_state_dict(fabric.strategy.chunk_manager)
    return losses, {k: v.detach().float().clone() for k, v in sd.items()}


@pytest.mark.parametrize("change", ["hyperparams", "freeze"])
def test_mid_run_param_group_edits_and_freezing_match_plain(change: str) -> None:
    ref_losses, ref_state = _midrun_changes("auto", change)
    got_losses, got_state = _midrun_changes("patrickstar", change)
    assert max_rel_diff(got_losses, ref_losses) <= LOSS_RTOL, f"{change}: {got_losses} vs plain {ref_losses}"
    assert_states_close(got_state, ref_state, what=f"mid-run {change}")


def test_plain_fabric_checkpoint_with_other_optimizer_class_refused_before_change(tmp_path: Path) -> None:
    path = tmp_path / "plain.ckpt"
    plain = Fabric(accelerator="cpu", devices=1)
    plain.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = plain.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    x, y = next(batches(1, 0))
    plain.backward(lm_loss(model(x), y))
    opt.step()
    plain.save(path, {"model": model, "optimizer": opt})
    fabric, model2, opt2 = _set_up()
    before = {k: v.clone() for k, v in full_state_dict(fabric.strategy.chunk_manager).items()}
    with pytest.raises(CheckpointError, match="plain.ckpt.*SGD.*AdamW.*HINT"):
        fabric.load(path, {"model": model2, "optimizer": opt2})
    assert_states_equal(full_state_dict(fabric.strategy.chunk_manager), before, what="after refused load")


def _save_mid_accumulation(strategy: Any, path: Path) -> list[float]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    stream = batches(1, 0)
    losses = []
    for step in range(3):
        for k in range(2):
            x, y = next(stream)
            with fabric.no_backward_sync(model, enabled=k < 1):
                loss = lm_loss(model(x), y)
                fabric.backward(loss / 2)
            losses.append(float(loss.detach()))
            if k == 0 and step == 1:  # gradients pending: the save must neither disturb them nor include them
                fabric.save(path, {"model": model, "optimizer": opt, "step": step})
        opt.step()
        opt.zero_grad()
    return losses


def test_save_between_micro_batches_matches_plain(tmp_path: Path) -> None:
    ref = _save_mid_accumulation("auto", tmp_path / "plain.ckpt")
    got = _save_mid_accumulation(PatrickStarFabricStrategy(checkpoint="consolidated"), tmp_path / "pstar.ckpt")
    assert max_rel_diff(got, ref) <= LOSS_RTOL, f"{got} vs plain {ref}"
    ref_saved = torch.load(tmp_path / "plain.ckpt", weights_only=True)
    got_saved = torch.load(tmp_path / "pstar.ckpt", weights_only=True)
    assert_states_close(got_saved["model"], ref_saved["model"], what="model saved mid-accumulation")
    for k, s in ref_saved["optimizer"]["state"].items():
        assert torch.allclose(got_saved["optimizer"]["state"][k]["exp_avg"], s["exp_avg"], rtol=1e-4, atol=1e-7), k


@pytest.mark.parametrize("mode", ["off", "pipeline", "next_forward"])
def test_dropped_run_frees_the_engine_and_the_model(mode: str) -> None:
    """Fabric never tears its strategy down: once the user drops the run (Fabric, model, optimizer) the next
    collection must free the engine and the model, as it frees a plain Fabric run's (a notebook or a sweep runs
    many in one process). The parameters' gradient hooks are held from C++, out of the collector's sight, and
    once kept the whole engine alive ([Note: hooks that hold the engine] in runtime/hooks.py)."""
    from lightning_pstar.runtime.manager import ChunkManager

    def live_managers() -> int:
        return sum(isinstance(o, ChunkManager) for o in gc.get_objects())

    gc.collect()
    before = live_managers()
    strategy = PatrickStarFabricStrategy(
        optimizer_placement="host", optimizer_overlap=mode, chunk_size=4096, device_memory_limit="64MiB"
    )
    run = train(LoopSpec(strategy=strategy, steps=3))
    model = weakref.ref(run.fabric.strategy._manager.module)  # type: ignore[union-attr]
    assert live_managers() == before + 1
    del run, strategy
    gc.collect()
    assert model() is None, "the model outlived its dropped Fabric run"
    assert live_managers() == before, "the engine outlived its dropped Fabric run"


def test_p_grad_between_backward_and_step_is_refused_not_silently_none() -> None:
    """Fabric user code between ``fabric.backward`` and ``optimizer.step``: plain Fabric has ``p.grad``; here the
    gradients live in chunks, so ``p.grad`` is a stand-in that refuses any use, naming the parameter
    ([Note: gradients user code cannot see] in runtime/grad_guard.py) where ``p.grad is None`` made
    ``clip_grad_norm_`` clip nothing. Metadata reads work; after ``zero_grad`` ``p.grad`` is None again; the weights
    after the refusals equal a run that never tried (nothing changed)."""
    from lightning_pstar.runtime.grad_guard import GradientsInChunksError

    fabric, model, opt = _set_up()
    x, y = next(batches(1, 0))
    fabric.backward(lm_loss(model(x), y))
    weight = model.module.wte.weight
    assert weight.grad is not None and weight.grad.shape == weight.shape and weight.grad.dtype == weight.dtype
    with pytest.raises(GradientsInChunksError, match=r"'wte\.weight'.*HINT"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(GradientsInChunksError, match=r"wte\.weight"):
        weight.grad.mul_(0.5)
    with pytest.raises(GradientsInChunksError):
        float(weight.grad.norm())
    opt.step()
    # as plain PyTorch keeps the step's gradients until zero_grad: stand-ins ([Note: gradients set to None])
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    after = _state(fabric, model)

    fabric2, model2, opt2 = _set_up()  # the same step, nothing tried in between
    fabric2.backward(lm_loss(model2(x), y))
    opt2.step()
    opt2.zero_grad()
    assert_states_equal(after, _state(fabric2, model2), what="weights after the refused reads")


def test_p_grad_assigned_before_step_is_refused() -> None:
    """``p.grad = tensor`` between backward and step (a hand-made gradient) would be ignored by the step: refused."""
    from lightning_pstar.runtime.grad_guard import GradientsInChunksError

    fabric, model, opt = _set_up()
    x, y = next(batches(1, 0))
    fabric.backward(lm_loss(model(x), y))
    weight = model.module.wte.weight
    weight.grad = torch.zeros_like(weight)
    with pytest.raises(GradientsInChunksError, match=r"wte\.weight'\] was assigned"):
        opt.step()


def test_step_without_zero_grad_is_refused_under_fabric() -> None:
    """A Fabric loop with no ``zero_grad``: plain torch adds the last step's gradients; refused at the second step,
    before it changes anything ([Note: gradients end with the step] in optim/step_checks.py)."""
    fabric, model, opt = _set_up()
    data = batches(1, 0)
    x, y = next(data)
    fabric.backward(lm_loss(model(x), y))
    opt.step()
    x, y = next(data)
    fabric.backward(lm_loss(model(x), y))
    before = _state(fabric, model)
    with pytest.raises(RuntimeError, match=r"without `zero_grad\(\)` since the last step"):
        opt.step()
    assert_states_equal(_state(fabric, model), before, what="weights after the refused step")
