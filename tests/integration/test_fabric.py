"""``Fabric(strategy="patrickstar")`` against plain Fabric (``strategy="auto"``), step by step, on one process.

Every test trains :class:`~tests.helpers.models.FlatGPT` for a few steps with the same plain Fabric loop
(:mod:`tests.helpers.fabric_loop`) under both strategies and compares every micro-batch loss and the final
weights. 32-true losses must agree within 1e-5 (relative); bf16-mixed ones within plain bf16's own distance
from plain 32-true. A device budget that forces evictions must give the unconstrained run's results bit for bit,
and so must a run resumed from a checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY

import tests.helpers.fabric_loop as loop
from lightning_pstar import (
    LossScaleConfig,
    MemoryBudgetError,
    PatrickStarFabricPrecision,
    PatrickStarFabricStrategy,
    PatrickStarStrategy,
)
from lightning_pstar.checkpoint import CheckpointError, consolidate, full_state_dict
from lightning_pstar.demos import GPT, GPTConfig
from tests.helpers.asserts import assert_states_close, assert_states_equal, max_rel_diff
from tests.helpers.fabric_loop import LoopResult, LoopSpec, batches, build_optimizer, train
from tests.helpers.models import FlatGPT, lm_loss
from tests.helpers.semantics import assert_within_bf16_noise

LOSS_RTOL = 1e-5
CHUNK = 4096


def _parity(**features: object) -> tuple[LoopResult, LoopResult]:
    ref = train(LoopSpec(**features))  # type: ignore[arg-type]
    got = train(LoopSpec(strategy="patrickstar", **features))  # type: ignore[arg-type]
    diff = max_rel_diff(got.losses, ref.losses)
    print(f"fabric parity {features}: max relative loss difference {diff:.3e}")
    assert len(got.losses) == len(ref.losses) > 0
    assert diff <= LOSS_RTOL, f"{features}: losses {got.losses} vs plain Fabric {ref.losses}"
    assert_states_close(got.state, ref.state, what=f"fabric {features}")
    return ref, got


def test_registered_with_fabric() -> None:
    assert STRATEGY_REGISTRY["patrickstar"]["strategy"] is PatrickStarFabricStrategy
    assert STRATEGY_REGISTRY["patrickstar_spawn"]["init_params"] == {"start_method": "spawn"}
    fabric = Fabric(accelerator="cpu", devices=1, strategy="patrickstar", precision="bf16-mixed")
    assert isinstance(fabric.strategy, PatrickStarFabricStrategy)
    assert fabric.strategy.precision.compute_dtype is torch.bfloat16


@pytest.mark.parametrize(
    "features",
    [
        {},
        {"accumulate": 2},
        {"clip_norm": 0.5},
        {"clip_val": 0.005},
        {"two_groups": True, "scheduler": True},
        {"optim": "sgd", "eval_between": True},
    ],
    ids=["plain", "no_backward_sync", "clip_norm", "clip_value", "groups_scheduler", "sgd_eval_between"],
)
def test_parity_32_true(features: dict[str, object]) -> None:
    ref, got = _parity(**features)
    if features.get("clip_norm"):
        clip = float(features["clip_norm"])  # type: ignore[arg-type]
        # what fabric.clip_gradients returned at every step (a tensor, checked by the loop), against plain Fabric's
        assert len(got.grad_norms) == len(ref.grad_norms) == len(got.lrs) > 0
        assert got.grad_norms == pytest.approx(ref.grad_norms, rel=1e-5)
        assert any(n > clip for n in ref.grad_norms), f"clipping never active: {ref.grad_norms}"
    if features.get("scheduler"):
        assert got.lrs == pytest.approx(ref.lrs, rel=1e-12) and len(set(ref.lrs)) > 1
    if features.get("eval_between"):
        assert got.eval_losses == pytest.approx(ref.eval_losses, rel=LOSS_RTOL) and len(got.eval_losses) == 3


def test_parity_bf16_mixed() -> None:
    # SGD with momentum, as the Trainer's bf16 tests: Adam's first steps are sign-like, so they turn the rounding
    # of near-zero gradients into lr-sized moves and the runs' distance would measure that, not the strategy
    common = {"steps": 4, "optim": "sgd", "accumulate": 2}
    plain_32 = train(LoopSpec(**common))  # type: ignore[arg-type]
    plain_bf16 = train(LoopSpec(precision="bf16-mixed", **common))  # type: ignore[arg-type]
    got = train(LoopSpec(precision="bf16-mixed", strategy="patrickstar", **common))  # type: ignore[arg-type]
    ours, noise = assert_within_bf16_noise(got.losses, plain_bf16.losses, plain_32.losses, what="fabric bf16-mixed")
    print(f"fabric bf16-mixed: max relative distance from plain 32-true {ours:.3e} (plain bf16: {noise:.3e})")


def test_device_budget_forces_eviction_bitwise() -> None:
    free = PatrickStarFabricStrategy(chunk_size=CHUNK, placement="static")
    tight = PatrickStarFabricStrategy(chunk_size=CHUNK, placement="static", device_memory_limit=2 * CHUNK * 4)
    a = train(LoopSpec(strategy=free, steps=3, accumulate=2, clip_norm=0.5))
    b = train(LoopSpec(strategy=tight, steps=3, accumulate=2, clip_norm=0.5))
    report = tight.memory_report()
    assert report.evictions > 0, f"the budget never forced an eviction:\n{report}"
    assert report.peak_device_chunk_bytes <= 2 * CHUNK * 4, report
    assert free.memory_report().evictions == 0
    assert b.losses == a.losses
    assert_states_equal(b.state, a.state, what="fabric under a device budget")


def test_meta_device_init() -> None:
    ref = train(LoopSpec())
    got = train(LoopSpec(strategy="patrickstar", empty_init=True, separate_setup=True))
    assert_states_equal(got.initial_state, ref.initial_state, what="materialised from the meta device")
    assert max_rel_diff(got.losses, ref.losses) <= LOSS_RTOL
    assert_states_close(got.state, ref.state, what="fabric meta init")


def test_meta_device_optimizer_refused() -> None:
    with pytest.raises(RuntimeError, match="meta-device parameters.*setup_module"):
        train(LoopSpec(strategy="patrickstar", empty_init=True))


@pytest.mark.parametrize("layout", ["consolidated", "sharded"])
def test_save_load_resume_bitwise(layout: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"

    def strategy() -> PatrickStarFabricStrategy:
        return PatrickStarFabricStrategy(checkpoint=layout)

    common = {"steps": 4, "scheduler": True, "two_groups": True}
    whole = train(LoopSpec(strategy=strategy(), save_at=2, checkpoint=path, **common))  # type: ignore[arg-type]
    resumed = train(LoopSpec(strategy=strategy(), resume_from=path, **common))  # type: ignore[arg-type]
    assert resumed.losses == whole.losses[2:]
    assert_states_equal(resumed.state, whole.state, what=f"fabric resumed ({layout})")
    if layout == "consolidated":
        # what plain Fabric writes: a plain module loads it strictly, and plain Fabric resumes from it
        saved = torch.load(path, weights_only=True)
        assert saved["step"] == 2
        plain = FlatGPT()
        plain.load_state_dict(saved["model"], strict=True)
        build_optimizer(LoopSpec(two_groups=True), plain).load_state_dict(saved["optimizer"])
    else:
        out = tmp_path / "consolidated.pt"
        consolidate(path, out)
        saved = torch.load(out, weights_only=False)
        FlatGPT().load_state_dict(saved["state_dict"], strict=True)
        again = train(LoopSpec(strategy=PatrickStarFabricStrategy(), resume_from=out, **common))  # type: ignore[arg-type]
        assert again.losses == whole.losses[2:]


def test_load_errors_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "bad.ckpt"
    torch.save({"model": {"nope": torch.zeros(1)}, "step": 1}, bad)
    fabric = Fabric(accelerator="cpu", devices=1, strategy="patrickstar")
    fabric.launch()
    model = fabric.setup_module(FlatGPT())
    with pytest.raises(CheckpointError, match="bad.ckpt"):
        fabric.load(bad, {"model": model})
    with pytest.raises(KeyError, match="'optimizer'"):
        fabric.load(bad, {"model": model, "optimizer": torch.zeros(1)})


class _LitFlat(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = FlatGPT()
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.net(batch[0]), batch[1])
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.net.parameters() if p.requires_grad]  # as the Fabric loop's optimizer
        return torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01)


class _LoadFabricCheckpoint(L.Callback):
    """Loads a Fabric checkpoint through the Trainer strategy once its chunks exist (the start of fit)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, PatrickStarStrategy)
        saved = strategy.load_checkpoint(self.path)
        weights = {f"net.{k}": v for k, v in saved["model"].items()}
        strategy.load_model_state_dict({"state_dict": weights}, strict=True)
        strategy.optimizers[0].load_state_dict(saved["optimizer"])


def test_fabric_checkpoint_loads_in_trainer_strategy(tmp_path: Path) -> None:
    path = tmp_path / "fabric.ckpt"
    whole = train(LoopSpec(strategy="patrickstar", steps=4, save_at=2, checkpoint=path))
    stream = batches(1, 0)
    for _ in range(2):
        next(stream)
    data = [next(stream) for _ in range(2)]
    module = _LitFlat()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="patrickstar",
        max_steps=2,
        callbacks=[_LoadFabricCheckpoint(path)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    assert max_rel_diff(module.losses, whole.losses[2:]) <= LOSS_RTOL
    got = {k.removeprefix("net."): v for k, v in module.state_dict().items()}
    assert_states_close(got, whole.state, what="Trainer resumed from a Fabric checkpoint")


@pytest.mark.slow  # a subprocess that imports Hydra, Lightning and reads the corpus: ~18 s on a busy machine
def test_example_fabric_train_runs(tmp_path: Path) -> None:
    """examples/fabric_train.py with a tiny override: it trains, evaluates, saves a plain checkpoint, reports."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        str(repo / "examples" / "fabric_train.py"),
        f"hydra.run.dir={tmp_path}",
        "steps=3",
        "eval_every=2",
        "eval_batches=1",
        "accumulate=2",
        "fabric.precision=32-true",
        "data.max_chars=20000",
    ]
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300, check=False)
    explain = f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, explain
    assert "PatrickStar memory report" in proc.stdout and "val_loss" in proc.stdout, explain
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["step"] == 3
    config = GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64)
    GPT(config).load_state_dict(saved["model"], strict=True)  # an ordinary state_dict: no strategy needed


def _set_up(strategy: object = "patrickstar") -> tuple[Fabric, object, object]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)  # type: ignore[arg-type]
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(FlatGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(p for p in model.parameters() if p.requires_grad))
    return fabric, model, optimizer


def test_unsupported_uses_raise_before_training() -> None:
    x = torch.randint(0, 32, (2, 8))
    with pytest.raises(ValueError, match="bf16-true"):
        Fabric(accelerator="cpu", devices=1, strategy="patrickstar", precision="bf16-true")
    fabric, model, optimizer = _set_up()
    with pytest.raises(RuntimeError, match="manages one model"):
        fabric.setup_module(FlatGPT())
    with pytest.raises(ValueError, match="is in optimizer 0 and optimizer 1"):
        fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[attr-defined]
    loss = lm_loss(model(x), x)  # type: ignore[operator]
    fabric.backward(loss)
    with pytest.raises(ValueError, match="2-norm only"):
        fabric.clip_gradients(model, optimizer, max_norm=1.0, norm_type=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive clip_val"):
        fabric.clip_gradients(model, optimizer, clip_val=0.0)  # type: ignore[arg-type]
    fabric.clip_gradients(model, optimizer, max_norm=1.0)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="clip_gradients.*before.*optimizer.step"):
        model(x)  # type: ignore[operator]
    with pytest.raises(RuntimeError, match="clip_gradients.*a new backward started before.*optimizer.step"):
        fabric.backward(loss)  # the norm clip_gradients returned would not be the gradients' the step clips
    optimizer.step()  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="fabric.backward"):
        lm_loss(model(x), x).backward()  # type: ignore[operator]


def _two_optimizers(strategy: object) -> list[float]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)  # type: ignore[arg-type]
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(FlatGPT())
    net = model.module  # the user's module (the wrapper's own names carry Fabric's prefixes)
    blocks = [p for p in net.blocks.parameters() if p.requires_grad]
    rest = [p for n, p in net.named_parameters() if p.requires_grad and not n.startswith("blocks.")]
    adam, sgd = fabric.setup_optimizers(torch.optim.AdamW(blocks, lr=1e-2), torch.optim.SGD(rest, lr=0.1, momentum=0.9))
    losses = []
    stream = batches(1, 0)
    for _ in range(3):
        x, y = next(stream)
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        adam.step()
        sgd.step()
        adam.zero_grad()
        sgd.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_two_optimizers_parity() -> None:
    ref, got = _two_optimizers("auto"), _two_optimizers("patrickstar")
    assert max_rel_diff(got, ref) <= LOSS_RTOL, f"{got} vs plain Fabric {ref}"


def _fp16_runs(init: float, common: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """Plain Fabric's GradScaler and PatrickStar's loss scale, both starting at ``init``, in 16-mixed on CPU (through
    plugins: Fabric's `precision="16-mixed"` means bf16 there)."""

    def with_plugin(plugin: object) -> object:
        def build(**kwargs: object) -> Fabric:
            kwargs.pop("precision")
            return Fabric(plugins=[plugin], **kwargs)  # type: ignore[arg-type, list-item]

        return build

    scaler = torch.amp.GradScaler("cpu", init_scale=init)
    monkeypatch.setattr(loop, "Fabric", with_plugin(MixedPrecision("16-mixed", device="cpu", scaler=scaler)))
    plain = train(LoopSpec(**common))  # type: ignore[arg-type]
    ours = PatrickStarFabricPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale=init))
    monkeypatch.setattr(loop, "Fabric", with_plugin(ours))
    got = train(LoopSpec(strategy=PatrickStarFabricStrategy(), **common))  # type: ignore[arg-type]
    monkeypatch.undo()
    return plain, scaler, got, ours


FP16_FACTOR = 8.0
"""16-mixed keeps the weights themselves in fp16 (plain autocast keeps fp32 weights, so its embeddings, LayerNorms
and residual stream compute in fp32): the extra rounding puts PatrickStar's fp16 losses farther from plain 32-true
than plain fp16's (measured here: 2.6e-5 against 5.7e-6, 4.5x). The engine's fp16 arithmetic itself is checked
bitwise against a plain-PyTorch reference of those semantics in test_mixed_precision.py (the same
ChunkPrecision); here a loss-scale error (a wrong unscale, a missed skip) would move the losses by 1e-3 or more."""


def test_16_mixed_loss_scaling_matches_plain_grad_scaler(monkeypatch: pytest.MonkeyPatch) -> None:
    """16-mixed: without overflow, within FP16_FACTOR times plain fp16's distance from plain 32-true; with a loss
    scale that overflows the first steps, the same steps are skipped as by plain Fabric's GradScaler, the scale
    ends the same, and the losses stay within that noise of plain fp16's."""
    common: dict[str, object] = {"optim": "sgd", "steps": 4}
    plain_32 = train(LoopSpec(**common))  # type: ignore[arg-type]
    plain, _, got, ours = _fp16_runs(2.0**17, common, monkeypatch)  # 2**17: no overflow in this run
    assert ours.skipped_steps == 0
    mine, noise = max_rel_diff(got.losses, plain_32.losses), max_rel_diff(plain.losses, plain_32.losses)
    assert 0 < noise and mine <= FP16_FACTOR * noise, f"{got.losses} vs 32-true {plain_32.losses} ({noise:.3e})"
    plain, scaler, got, ours = _fp16_runs(2.0**22, common, monkeypatch)  # 2**22 .. 2**20 overflow here
    assert 0 < ours.skipped_steps < 4, f"{ours.skipped_steps} steps skipped"
    assert ours.scale == scaler.get_scale() == 2.0**22 * 0.5**ours.skipped_steps
    skipped = max_rel_diff(got.losses, plain.losses)
    # ours within FP16_FACTOR * noise of the (unscaled) truth, plain fp16 within noise: so within the sum of each other
    assert skipped <= (FP16_FACTOR + 1) * noise, f"with skipped steps: {got.losses} vs plain fp16 {plain.losses}"
    print(f"fabric 16-mixed: {mine:.3e} from 32-true (plain fp16: {noise:.3e});", end=" ")
    print(f"{ours.skipped_steps} steps skipped, {skipped:.3e} from plain fp16")


def test_budget_that_fits_the_chunks_but_not_the_activations_is_refused_before_the_step() -> None:
    """Issue 14 under Fabric: the warm-up's step refuses the budget before it changes weights or optimizer states."""
    budget = 32 * 1024  # the chunks of any module fit; FlatGPT's activations do not
    strategy = PatrickStarFabricStrategy(chunk_size=1024, device_memory_limit=budget)
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(FlatGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    before = {k: v.clone() for k, v in full_state_dict(strategy.chunk_manager).items()}
    stepped: list[int] = []
    optimizer.register_step_post_hook(lambda *args: stepped.append(1))
    x, y = next(batches(1, 0))
    fabric.backward(lm_loss(model(x), y))
    with pytest.raises(MemoryBudgetError, match=r"device_memory_limit.*non-model memory \(activations\).*HINT"):
        optimizer.step()
    assert stepped == [], "raised after the optimizer step"
    assert optimizer.state_dict()["state"] == {}, "the optimizer states changed"
    assert_states_equal(full_state_dict(strategy.chunk_manager), before, what="weights after the refused step")


@pytest.mark.parametrize("strategy", ["auto", "patrickstar"])
def test_non_finite_norm_raises_in_clip_gradients_and_changes_nothing(strategy: str) -> None:
    """As plain Fabric: with ``error_if_nonfinite`` (the default) a non-finite norm raises inside
    ``clip_gradients``, before any step; under PatrickStar a step called anyway is skipped (weights kept)."""
    fabric, model, optimizer = _set_up(strategy)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    x = torch.randint(0, 32, (2, 8))
    fabric.backward(lm_loss(model(x), x) * float("inf"))  # type: ignore[operator]
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric.clip_gradients(model, optimizer, max_norm=1.0)  # type: ignore[arg-type]
    after = {n: p.detach().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    assert_states_equal(after, before, what=f"{strategy}: weights after the refused clip")
    if strategy == "patrickstar":
        optimizer.step()  # type: ignore[attr-defined]
        stepped = {n: p.detach().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
        assert_states_equal(stepped, before, what="patrickstar: a step after the refused clip is skipped")
        assert all(torch.isfinite(p).all() for p in stepped.values())


@pytest.mark.parametrize("layout", ["consolidated", "sharded"])
def test_load_with_other_param_groups_is_refused_before_the_weights_change(layout: str, tmp_path: Path) -> None:
    """A checkpoint of an optimizer with two param groups loaded into one with a single group: refused naming
    the groups, and the model's weights are still the ones before the load (nothing half loaded)."""
    path = tmp_path / "two_groups"
    train(LoopSpec(strategy=PatrickStarFabricStrategy(checkpoint=layout), two_groups=True, save_at=1, checkpoint=path))
    fabric = Fabric(accelerator="cpu", devices=1, strategy=PatrickStarFabricStrategy(checkpoint=layout))
    fabric.launch()
    torch.manual_seed(1)
    model = fabric.setup_module(FlatGPT())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(p for p in model.parameters() if p.requires_grad))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointError, match="param groups"):
        fabric.load(path, {"model": model, "optimizer": optimizer})
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert_states_equal(after, before, what=f"{layout}: weights after a refused load")


def test_get_module_state_dict_of_the_wrapped_model_ends_the_steps_in_flight() -> None:
    """``fabric.strategy.get_module_state_dict(model)`` with the model ``fabric.setup`` returned (Fabric's wrapper) is
    the engine's state dict, as with the unwrapped module: under "next_forward", right after ``optimizer.step()``, it
    ends the tail in flight and gives the updated weights (it fell back to ``model.state_dict()``, which refused the
    parked parameters)."""
    from torch import nn

    def run(overlap: str) -> dict[str, torch.Tensor]:
        fabric = Fabric(accelerator="cpu", devices=1, strategy=PatrickStarFabricStrategy(
            optimizer_placement="host", optimizer_overlap=overlap))  # fmt: skip
        fabric.launch()
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        data = torch.Generator().manual_seed(1)
        for _ in range(4):
            fabric.backward(model(torch.randn(4, 8, generator=data)).pow(2).mean())
            opt.step()
            opt.zero_grad()
        return {k: v.clone() for k, v in fabric.strategy.get_module_state_dict(model).items()}

    serial, tail = run("off"), run("next_forward")
    assert serial.keys() == tail.keys()
    for key in serial:
        assert torch.equal(serial[key], tail[key]), key
