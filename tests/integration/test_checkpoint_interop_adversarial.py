"""Checkpoint interop, adversarially: PatrickStar checkpoints against plain Lightning trained straight through.

Every Trainer case has the same reference nobody here tuned: :class:`~tests.helpers.runs.TinyLM` (tied
embedding/head, a frozen Linear) with fused AdamW, weight decay and a per-step cosine schedule, trained by plain
Lightning (``strategy="auto"``) for three epochs of eight batches with a ``ModelCheckpoint`` after every epoch.
A run that saves under one strategy or configuration and resumes under another must give that straight run's
losses, learning rates, global step, final weights and optimizer state (32-true: bit for bit).

1. save under PatrickStar and resume under plain Lightning, and the reverse (at an epoch boundary, mid-epoch, with
   two param groups out of model order, two optimizers, unused and reused parameters, BatchNorm buffers);
2. configuration changes between the save and the resume (chunk size, budgets, the disk tier, ``cpu_embedding``,
   placement, optimizer placement and overlap, checkpoint format, precision and loss-scale state,
   ``accumulate_grad_batches``, optimizer hyperparameters and flags held by the file);
3. checkpoints from ``ModelCheckpoint(every_n_train_steps=1)`` (overlap modes, accumulation, the disk tier), at the
   last batch of an epoch, inside an accumulation window, at every point of an iteration, with
   ``save_weights_only``, after ``fit`` returned, ``ckpt_path="last"``, top-k removal, evaluation from a file;
4. Fabric: a load after training started, in a fresh process, strict=False, ``load_raw`` of plain torch files,
   ``filter``, partial loads of a sharded checkpoint, a save right after ``optimizer.step()``;
5. bad checkpoints (missing, truncated, another model, another optimizer, damaged optimizer state) refused before
   anything changes;
6. ``trainer.save_checkpoint`` from callbacks, and ``on_save_checkpoint``/``on_load_checkpoint`` that add entries,
   rename or edit weights, or leave frozen weights out.

A defect is a strict xfail naming it in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarPrecision, PatrickStarStrategy
from lightning_pstar.checkpoint import full_state_dict
from tests.helpers.asserts import assert_evicted, assert_states_equal, optimizer_state
from tests.helpers.data import make_loader
from tests.helpers.fabric_loop import batches
from tests.helpers.models import SEED, FlatGPT, lm_loss
from tests.helpers.runs import FitResult, LossRecorder, OptimSpec, TinyLM, make_trainer

SPEC = OptimSpec(name="adamw", lr=3e-3, weight_decay=0.1, cosine_t_max=30)
N_SEQ = 32
BATCHES = 8  # per epoch (batches of 4)
EPOCHS = 3


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def _fit(
    strategy: Any,
    *,
    ckpt_dir: Path | None = None,
    every_n_train_steps: int | None = None,
    ckpt_path: Path | None = None,
    seed: int = SEED,
    module: L.LightningModule | None = None,
    callbacks: tuple[L.Callback, ...] = (),
    **kwargs: Any,
) -> FitResult:
    """Fit TinyLM for EPOCHS epochs (or what ``kwargs`` say), checkpointing into ``ckpt_dir``."""
    recorder = LossRecorder()
    cbs: list[L.Callback] = [recorder, *callbacks]
    if ckpt_dir is not None:
        if every_n_train_steps is None:
            cbs.append(ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
        else:
            cbs.append(
                ModelCheckpoint(
                    dirpath=ckpt_dir, filename="{step}", save_top_k=-1, every_n_train_steps=every_n_train_steps
                )
            )
    options: dict[str, Any] = {"max_steps": -1, "max_epochs": EPOCHS, "enable_checkpointing": ckpt_dir is not None}
    options.update(kwargs)
    trainer = make_trainer(strategy=strategy, callbacks=cbs, **options)
    module = module if module is not None else TinyLM(optim=SPEC, seed=seed)
    trainer.fit(module, make_loader(n_seq=N_SEQ), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return FitResult(module=module, trainer=trainer, recorder=recorder)


def _weights(run: FitResult) -> dict[str, torch.Tensor]:
    """The module's weights after fit (PatrickStar hands them back as ordinary fp32 parameters)."""
    return {k: v.detach().cpu().clone() for k, v in run.module.state_dict().items()}


def _assert_exact_tail(resumed: FitResult, straight: FitResult, skip: int, what: str) -> None:
    """The resumed run continues the straight one bit for bit from micro-batch ``skip``."""
    assert resumed.losses == straight.losses[skip:], (
        f"{what}: losses {resumed.losses} vs straight {straight.losses[skip:]}"
    )
    assert resumed.recorder.lrs == straight.recorder.lrs[skip:], f"{what}: learning rates differ"
    assert resumed.trainer.global_step == straight.trainer.global_step, what
    assert_states_equal(_weights(resumed), _weights(straight), what=f"{what}: final weights")
    assert_states_equal(optimizer_state(resumed), optimizer_state(straight), what=f"{what}: optimizer state")


@pytest.fixture(scope="module")
def plain_straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[FitResult, Path]:
    """Plain Lightning, three epochs straight through, a checkpoint after every epoch."""
    folder = tmp_path_factory.mktemp("plain")
    return _fit("auto", ckpt_dir=folder), folder


@pytest.fixture(scope="module")
def pstar_straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[FitResult, Path]:
    """PatrickStar (defaults), the same run."""
    folder = tmp_path_factory.mktemp("pstar")
    return _fit(PatrickStarStrategy(), ckpt_dir=folder), folder


# ---- 1. PatrickStar <-> plain Lightning ----------------------------------------------------------------------------


def test_patrickstar_straight_run_is_plain_lightnings(plain_straight: Any, pstar_straight: Any) -> None:
    (plain, plain_dir), (pstar, pstar_dir) = plain_straight, pstar_straight
    _assert_exact_tail(pstar, plain, 0, "patrickstar straight")
    for epoch in range(EPOCHS):
        got, want = _load(pstar_dir / f"epoch={epoch}.ckpt"), _load(plain_dir / f"epoch={epoch}.ckpt")
        assert_states_equal(got["state_dict"], want["state_dict"], what=f"epoch={epoch}.ckpt weights")
        assert got["lr_schedulers"] == want["lr_schedulers"]
        assert got["global_step"] == want["global_step"] == (epoch + 1) * BATCHES
        assert got["loops"] == want["loops"], f"epoch={epoch}.ckpt: loop state differs"


@pytest.mark.parametrize("direction", ["pstar_to_plain", "plain_to_pstar"])
def test_resume_across_strategies_at_an_epoch_boundary(
    direction: str, plain_straight: Any, pstar_straight: Any, tmp_path: Path
) -> None:
    plain, plain_dir = plain_straight
    _, pstar_dir = pstar_straight
    if direction == "pstar_to_plain":
        ckpt, strategy = pstar_dir / "epoch=0.ckpt", "auto"
    else:
        ckpt, strategy = plain_dir / "epoch=0.ckpt", PatrickStarStrategy()
    resumed = _fit(strategy, ckpt_path=ckpt, seed=999)
    assert_states_equal(
        resumed.recorder.initial_state, _load(ckpt)["state_dict"], what=f"{direction}: weights at resume"
    )
    _assert_exact_tail(resumed, plain, BATCHES, direction)


@pytest.mark.parametrize("direction", ["pstar_to_plain", "plain_to_pstar"])
def test_resume_across_strategies_mid_epoch(direction: str, tmp_path: Path) -> None:
    """A ``ModelCheckpoint(every_n_train_steps=3)`` file (step 3 of 8 in epoch 0) resumed under the other strategy
    runs as plain Lightning resuming its own file (whatever Lightning does with a mid-epoch resume)."""
    plain_dir, pstar_dir = tmp_path / "plain", tmp_path / "pstar"
    _fit("auto", ckpt_dir=plain_dir, every_n_train_steps=3, max_epochs=1)
    _fit(PatrickStarStrategy(), ckpt_dir=pstar_dir, every_n_train_steps=3, max_epochs=1)
    name = "step=3.ckpt"
    got, want = _load(pstar_dir / name), _load(plain_dir / name)
    assert_states_equal(got["state_dict"], want["state_dict"], what="step=3 weights")
    assert got["loops"] == want["loops"]
    ref = _fit("auto", ckpt_path=plain_dir / name, seed=999, max_epochs=2)
    if direction == "pstar_to_plain":
        resumed = _fit("auto", ckpt_path=pstar_dir / name, seed=999, max_epochs=2)
    else:
        resumed = _fit(PatrickStarStrategy(), ckpt_path=plain_dir / name, seed=999, max_epochs=2)
    _assert_exact_tail(resumed, ref, 0, f"{direction} mid-epoch")


# ---- 2. configuration changes between save and resume --------------------------------------------------------------

CONFIG_CHANGES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "chunk_size": ({"chunk_size": 1 << 16}, {"chunk_size": 1024}),
    "tight_device_budget": ({}, {"chunk_size": 2048, "placement": "static", "device_memory_limit": 3 * 2048 * 4}),
    "host_to_auto_placement": ({"optimizer_placement": "host"}, {"optimizer_placement": "auto"}),
    "auto_to_host_placement": ({"optimizer_placement": "auto"}, {"optimizer_placement": "host"}),
    "off_to_next_forward": (
        {"optimizer_placement": "host", "optimizer_overlap": "off"},
        {"optimizer_placement": "host", "optimizer_overlap": "next_forward"},
    ),
    "next_forward_to_off": (
        {"optimizer_placement": "host", "optimizer_overlap": "next_forward"},
        {"optimizer_placement": "host", "optimizer_overlap": "off"},
    ),
    "pipeline_to_auto": (
        {"optimizer_placement": "host", "optimizer_overlap": "pipeline"},
        {"optimizer_placement": "host", "optimizer_overlap": "auto"},
    ),
    "sharded_to_consolidated": ({"checkpoint": "sharded"}, {"checkpoint": "consolidated"}),
    "consolidated_to_sharded": ({"checkpoint": "consolidated"}, {"checkpoint": "sharded"}),
    "host_budget": ({}, {"host_memory_limit": "64MiB"}),
    "cpu_embedding_on": ({}, {"cpu_embedding": True}),
    "cpu_embedding_off": ({"cpu_embedding": True}, {}),
    "static_to_auto_placement": ({"placement": "static"}, {"placement": "auto"}),
    "device_to_host_optimizer": ({"optimizer_placement": "device"}, {"optimizer_placement": "host"}),
    "sharded_chunk_size": (
        {"checkpoint": "sharded", "chunk_size": 1 << 16},
        {"checkpoint": "sharded", "chunk_size": 1024},
    ),
    "sharded_cpu_embedding_on": ({"checkpoint": "sharded"}, {"checkpoint": "sharded", "cpu_embedding": True}),
    "sharded_cpu_embedding_off": ({"checkpoint": "sharded", "cpu_embedding": True}, {"checkpoint": "sharded"}),
    "sharded_host_optimizer_next_forward": (
        {"checkpoint": "sharded"},
        {"checkpoint": "sharded", "optimizer_placement": "host", "optimizer_overlap": "next_forward"},
    ),
}


CHANGE_CASES = sorted(CONFIG_CHANGES)


@pytest.mark.parametrize("change", CHANGE_CASES)
def test_resume_under_another_configuration(change: str, plain_straight: Any, tmp_path: Path) -> None:
    plain, _ = plain_straight
    before, after = CONFIG_CHANGES[change]
    _fit(PatrickStarStrategy(**before), ckpt_dir=tmp_path / "a", max_epochs=1)
    ckpt = tmp_path / "a" / "epoch=0.ckpt"
    strategy = PatrickStarStrategy(**after)
    resumed = _fit(strategy, ckpt_dir=tmp_path / "b", ckpt_path=ckpt, seed=999)
    _assert_exact_tail(resumed, plain, BATCHES, change)
    if change == "tight_device_budget":
        assert_evicted(strategy)


class _StartState(L.Callback):
    """The weights and the optimizer state as training starts (after a resume restored them)."""

    def __init__(self) -> None:
        self.optimizer: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = trainer.optimizers[0].state_dict()["state"]
        self.optimizer = {f"{i}/{k}": torch.as_tensor(v).clone() for i, e in state.items() for k, v in e.items()}


@pytest.mark.parametrize(("saved_in", "resumed_in"), [("32-true", "bf16-mixed"), ("bf16-mixed", "32-true")])
def test_resume_under_another_precision_converts_exactly(saved_in: str, resumed_in: str, tmp_path: Path) -> None:
    """A 32-true checkpoint resumed in bf16-mixed (and the reverse) starts from the file's fp32 weights and optimizer
    state exactly (the masters), and trains as plain Lightning resuming the same file in the same precision."""
    _fit(PatrickStarStrategy(), ckpt_dir=tmp_path / "a", max_epochs=1, precision=saved_in)
    ckpt = tmp_path / "a" / "epoch=0.ckpt"
    saved = _load(ckpt)
    start = _StartState()
    resumed = _fit(
        PatrickStarStrategy(), ckpt_path=ckpt, seed=999, max_epochs=2, precision=resumed_in, callbacks=(start,)
    )
    assert_states_equal(resumed.recorder.initial_state, saved["state_dict"], what="weights (masters) at resume")
    want = {
        f"{i}/{k}": torch.as_tensor(v) for i, e in saved["optimizer_states"][0]["state"].items() for k, v in e.items()
    }
    assert_states_equal(start.optimizer, want, what="optimizer state at resume")
    ref = _fit("auto", ckpt_path=ckpt, seed=999, max_epochs=2, precision=resumed_in)
    assert resumed.trainer.global_step == ref.trainer.global_step == 2 * BATCHES
    assert resumed.recorder.lrs == ref.recorder.lrs
    if resumed_in == "32-true":
        _assert_exact_tail(resumed, ref, 0, f"{saved_in} -> {resumed_in}")
    else:  # bf16 rounding: plain Lightning's bf16-mixed keeps bf16 nowhere but autocast, the engine in its copies
        for i, (a, b) in enumerate(zip(resumed.losses, ref.losses, strict=True)):
            assert abs(a - b) <= 2e-2 * abs(b), f"{saved_in} -> {resumed_in}: batch {i}: {a} vs plain {b}"


@pytest.mark.parametrize(("saved_acc", "resumed_acc"), [(1, 2), (2, 1), (2, 4)])
def test_resume_with_another_accumulate_grad_batches(saved_acc: int, resumed_acc: int, tmp_path: Path) -> None:
    """Saved with one ``accumulate_grad_batches`` at an epoch boundary, resumed with another: what plain Lightning
    does with the same two settings, bit for bit (loss, lr, step, weights, optimizer state)."""
    runs = {}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarStrategy())):
        folder = tmp_path / name
        _fit(strategy, ckpt_dir=folder, max_epochs=1, accumulate_grad_batches=saved_acc)
        again = "auto" if name == "plain" else PatrickStarStrategy()
        runs[name] = _fit(again, ckpt_path=folder / "epoch=0.ckpt", seed=999, accumulate_grad_batches=resumed_acc)
    assert runs["plain"].trainer.global_step == BATCHES // saved_acc + 2 * BATCHES // resumed_acc
    _assert_exact_tail(runs["pstar"], runs["plain"], 0, f"accumulate {saved_acc} -> {resumed_acc}")


# ---- 3. what a checkpoint holds, wherever it is taken -------------------------------------------------------------


def _assert_same_file(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert_states_equal(got["state_dict"], want["state_dict"], what=f"{what}: weights")
    for key in ("global_step", "epoch", "lr_schedulers", "loops"):
        assert got.get(key) == want.get(key), f"{what}: {key} differs"
    assert ("optimizer_states" in got) == ("optimizer_states" in want), f"{what}: optimizer_states present?"
    if "optimizer_states" in want:
        (g,), (w,) = got["optimizer_states"], want["optimizer_states"]
        flat_g = {f"{i}/{k}": torch.as_tensor(v) for i, e in g["state"].items() for k, v in e.items()}
        flat_w = {f"{i}/{k}": torch.as_tensor(v) for i, e in w["state"].items() for k, v in e.items()}
        assert_states_equal(flat_g, flat_w, what=f"{what}: optimizer state")
        assert g["param_groups"] == w["param_groups"], f"{what}: param groups differ"


# "auto" runs "pipeline" for its first 10 steps, so it stands for both here
EVERY_STEP = [(mode, 1, False) for mode in ("off", "next_forward", "auto")] + [
    ("next_forward", 2, False),
    ("auto", 1, True),
]


@pytest.mark.parametrize(("mode", "accumulate", "disk"), EVERY_STEP)
def test_every_step_checkpoints_equal_plain_lightnings(mode: str, accumulate: int, disk: bool, tmp_path: Path) -> None:
    """``ModelCheckpoint(every_n_train_steps=1)`` with the optimizer on the host in every overlap mode (with
    accumulation; with the masters and Adam states on the disk tier): each file (the last of the epoch too) holds
    plain Lightning's updated weights and optimizer state; with ``"next_forward"`` the step's tail may still be in
    flight when the callback saves."""
    common: dict[str, Any] = {"every_n_train_steps": 1, "max_epochs": 1, "accumulate_grad_batches": accumulate}
    _fit("auto", ckpt_dir=tmp_path / "plain", **common)
    options: dict[str, Any] = {"optimizer_placement": "host", "optimizer_overlap": mode, "chunk_size": 4096}
    if disk:
        (tmp_path / "disk").mkdir()
        options.update(disk_path=str(tmp_path / "disk"), host_memory_limit=512 * 1024, chunk_size=2048)
    strategy = PatrickStarStrategy(**options)
    _fit(strategy, ckpt_dir=tmp_path / mode, **common)
    if disk:
        assert strategy.memory_report().disk_families > 0
    names = sorted(p.name for p in (tmp_path / "plain").glob("*.ckpt"))
    assert names == sorted(p.name for p in (tmp_path / mode).glob("*.ckpt")) and len(names) == BATCHES // accumulate
    for name in names:
        _assert_same_file(_load(tmp_path / mode / name), _load(tmp_path / "plain" / name), f"{mode}: {name}")


@pytest.mark.parametrize("given", ["plugins", "strategy"])
def test_async_checkpoint_io_every_step_equals_plain_lightnings_sync_files(given: str, tmp_path: Path) -> None:
    """``AsyncCheckpointIO`` in the Trainer's ``plugins`` (as with Lightning's own strategies; refused before as
    "set through both strategy class and plugins") or given to the strategy: Lightning writes each file on a thread
    of its own while training goes on (the next step's tail in flight, its copies back into the chunks), through
    the crash-safe SafeCheckpointIO ([Note: the checkpoint IO]); every file holds what plain Lightning's synchronous
    save wrote at that step (the dict the thread writes is the engine's fp32 CPU copies, never a view of a chunk)."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_pstar.checkpointing import SafeCheckpointIO

    common: dict[str, Any] = {"every_n_train_steps": 1, "max_epochs": 1}
    _fit("auto", ckpt_dir=tmp_path / "plain", **common)
    options: dict[str, Any] = {"optimizer_placement": "host", "optimizer_overlap": "next_forward", "chunk_size": 4096}
    io = AsyncCheckpointIO()
    if given == "plugins":
        run = _fit(PatrickStarStrategy(**options), ckpt_dir=tmp_path / "async", plugins=[io], **common)
    else:
        run = _fit(PatrickStarStrategy(checkpoint_io=io, **options), ckpt_dir=tmp_path / "async", **common)
    assert run.trainer.strategy.checkpoint_io is io and type(io.checkpoint_io) is SafeCheckpointIO
    names = sorted(p.name for p in (tmp_path / "plain").glob("*.ckpt"))
    assert names == sorted(p.name for p in (tmp_path / "async").glob("*.ckpt")) and len(names) == BATCHES
    for name in names:
        _assert_same_file(_load(tmp_path / "async" / name), _load(tmp_path / "plain" / name), f"async: {name}")


def test_sharded_checkpoints_refuse_a_checkpoint_io_they_would_bypass(tmp_path: Path) -> None:
    """``checkpoint="sharded"`` writes with ``torch.distributed.checkpoint``, never through a CheckpointIO: a user's
    IO (here Lightning's AsyncCheckpointIO in ``plugins``) is refused when the run starts, naming it and what to do,
    before the model changes (it was silently bypassed: no file went through it)."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    module = TinyLM(optim=SPEC, seed=SEED)
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match=r"checkpoint='sharded'.*AsyncCheckpointIO\(SafeCheckpointIO\).*HINT"):
        _fit(PatrickStarStrategy(checkpoint="sharded"), module=module, plugins=[AsyncCheckpointIO()], max_epochs=1)
    assert_states_equal(module.state_dict(), before, what="weights after the refusal")
    fabric = Fabric(
        accelerator="cpu",
        devices=1,
        strategy=PatrickStarFabricStrategy(checkpoint="sharded"),
        plugins=[TorchCheckpointIO()],
    )
    fabric.launch()
    with pytest.raises(ValueError, match=r"checkpoint='sharded'.*TorchCheckpointIO.*consolidated"):
        fabric.setup(FlatGPT())
    # the default IO with sharded checkpoints, and a user's IO in Fabric's plugins with consolidated ones, set up
    _fit(PatrickStarStrategy(checkpoint="sharded"), max_epochs=1, max_steps=1)
    io = TorchCheckpointIO()
    fabric = Fabric(accelerator="cpu", devices=1, strategy=PatrickStarFabricStrategy(), plugins=[io])
    fabric.launch()
    fabric.setup(FlatGPT())
    assert fabric.strategy.checkpoint_io is io


@pytest.mark.parametrize("mode", ["next_forward"])
def test_weights_only_every_step_equal_plain_lightnings(mode: str, tmp_path: Path) -> None:
    for name, strategy in (
        ("plain", "auto"),
        (mode, PatrickStarStrategy(optimizer_placement="host", optimizer_overlap=mode, chunk_size=4096)),
    ):
        cb = ModelCheckpoint(
            dirpath=tmp_path / name, filename="{step}", save_top_k=-1, every_n_train_steps=1, save_weights_only=True
        )
        _fit(strategy, callbacks=(cb,), max_epochs=1, enable_checkpointing=True)
    for file in sorted((tmp_path / "plain").glob("*.ckpt")):
        _assert_same_file(_load(tmp_path / mode / file.name), _load(file), f"weights only {mode}: {file.name}")


@pytest.mark.parametrize("mode", ["next_forward"])
@pytest.mark.parametrize("resume_in", ["plain", "pstar"])
def test_resume_from_the_last_batch_of_an_epoch(mode: str, resume_in: str, tmp_path: Path) -> None:
    """The ``every_n_train_steps`` file written at the epoch's last batch (step 8 of 8), resumed under either
    strategy, runs as plain Lightning resuming plain Lightning's own file."""
    cb_dir = {"plain": tmp_path / "plain", "pstar": tmp_path / "pstar"}
    _fit("auto", ckpt_dir=cb_dir["plain"], every_n_train_steps=BATCHES, max_epochs=1)
    host = {"optimizer_placement": "host", "optimizer_overlap": mode, "chunk_size": 4096}
    _fit(PatrickStarStrategy(**host), ckpt_dir=cb_dir["pstar"], every_n_train_steps=BATCHES, max_epochs=1)
    name = f"step={BATCHES}.ckpt"
    _assert_same_file(_load(cb_dir["pstar"] / name), _load(cb_dir["plain"] / name), name)
    ref = _fit("auto", ckpt_path=cb_dir["plain"] / name, seed=999)
    strategy = "auto" if resume_in == "plain" else PatrickStarStrategy(**host)
    resumed = _fit(strategy, ckpt_path=cb_dir["pstar"] / name, seed=999)
    _assert_exact_tail(resumed, ref, 0, f"last batch ({mode}) resumed in {resume_in}")


class _SaveAtBatch(L.Callback):
    """``trainer.save_checkpoint`` in ``on_train_batch_end`` of the given batch of epoch 0."""

    def __init__(self, path: Path, batch_idx: int) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.current_epoch == 0 and batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("mode", ["next_forward"])
def test_mid_accumulation_checkpoint_resumed_under_plain(mode: str, tmp_path: Path) -> None:
    """Saved between the two micro-batches of a window (batch 3) under PatrickStar, resumed by plain Lightning: as
    plain Lightning resuming its own file."""
    host = {"optimizer_placement": "host", "optimizer_overlap": mode, "chunk_size": 4096}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarStrategy(**host))):
        _fit(strategy, max_epochs=1, accumulate_grad_batches=2, callbacks=(_SaveAtBatch(tmp_path / name, 2),))
    _assert_same_file(_load(tmp_path / "pstar"), _load(tmp_path / "plain"), "mid-window file")
    ref = _fit("auto", ckpt_path=tmp_path / "plain", seed=999, max_epochs=2, accumulate_grad_batches=2)
    resumed = _fit("auto", ckpt_path=tmp_path / "pstar", seed=999, max_epochs=2, accumulate_grad_batches=2)
    _assert_exact_tail(resumed, ref, 0, f"mid-window ({mode}) resumed in plain")


# ---- 4./5. Fabric: loads after training started, and bad checkpoints ---------------------------------------------


def _fabric(strategy: Any) -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(SEED)
    net = FlatGPT()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01))
    return fabric, model, opt


def _steps(fabric: Fabric, model: Any, opt: Any, stream: Any, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        x, y = next(stream)
        loss = lm_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _fabric_weights(fabric: Fabric, model: Any) -> dict[str, torch.Tensor]:
    if isinstance(fabric.strategy, PatrickStarFabricStrategy):
        sd = full_state_dict(fabric.strategy.chunk_manager)
    else:
        sd = model.state_dict()
    return {k: v.detach().float().cpu().clone() for k, v in sd.items()}


def _flat_optimizer(opt: Any) -> dict[str, torch.Tensor]:
    state = opt.state_dict()["state"]
    return {f"{i}/{k}": torch.as_tensor(v).clone() for i, e in state.items() for k, v in e.items()}


@pytest.fixture(scope="module")
def fabric_saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A PatrickStar Fabric checkpoint after 2 steps (consolidated file and sharded directory) and the plain Fabric
    losses of steps 3-4 continuing from it."""
    out = tmp_path_factory.mktemp("fabric")
    saved: dict[str, Any] = {}
    for fmt in ("consolidated", "sharded"):
        fabric, model, opt = _fabric(PatrickStarFabricStrategy(checkpoint=fmt))
        stream = batches(1, 0)
        _steps(fabric, model, opt, stream, 2)
        fabric.save(out / fmt, {"model": model, "optimizer": opt, "step": 2, "extra": {"note": fmt}})
        saved[fmt] = out / fmt
        saved[f"{fmt}/tail"] = _steps(fabric, model, opt, stream, 2)
    fabric, model, opt = _fabric(PatrickStarFabricStrategy())
    saved["straight"] = _steps(fabric, model, opt, batches(1, 0), 5)
    plain, model, opt = _fabric("auto")
    stream = batches(1, 0)
    _steps(plain, model, opt, stream, 2)
    saved["plain"] = out / "plain.ckpt"
    plain.save(saved["plain"], {"model": model, "optimizer": opt, "step": 2})
    saved["plain/tail"] = _steps(plain, model, opt, stream, 2)
    return saved


@pytest.mark.parametrize("fmt", ["consolidated", "sharded", "plain"])
def test_fabric_load_after_training_started_continues_exactly(fmt: str, fabric_saved: dict[str, Any]) -> None:
    """A model and optimizer that already took 3 other steps load the step-2 checkpoint and continue as plain
    Fabric continues from it (the optimizer state is replaced, not merged; steps counts come from the file)."""
    fabric, model, opt = _fabric(PatrickStarFabricStrategy())
    stream = batches(1, 0)
    for _ in range(5):  # move the stream and the model somewhere else first
        next(stream)
    _steps(fabric, model, opt, stream, 3)
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(fabric_saved[fmt], state)
    assert state["step"] == 2
    steps = {float(e["step"]) for e in opt.state_dict()["state"].values()}
    assert steps == {2.0}, steps
    stream = batches(1, 0)
    for _ in range(2):
        next(stream)
    got = _steps(fabric, model, opt, stream, 2)
    want = fabric_saved["plain/tail"]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) <= 1e-5, f"{got} vs plain {want}"


def _edit(src: Path, dst: Path, change: str) -> Path:
    """A copy of a consolidated Fabric checkpoint, damaged as ``change`` says."""
    if change == "truncated":
        data = src.read_bytes()
        dst.write_bytes(data[: len(data) * 2 // 3])
        return dst
    ckpt = torch.load(src, weights_only=False)
    model, optim = ckpt["model"], ckpt["optimizer"]
    if change == "missing_key":
        del model["blocks.1.fc.bias"]
    elif change == "extra_key":
        model["blocks.1.extra.weight"] = torch.zeros(3, 3)
    elif change == "wrong_shape":
        model["blocks.1.fc.bias"] = torch.zeros(7)
    elif change == "wrong_optimizer":
        optim["state"] = {i: {"momentum_buffer": e["exp_avg"]} for i, e in optim["state"].items()}
        for g in optim["param_groups"]:
            for key in ("betas", "eps", "amsgrad", "capturable", "decoupled_weight_decay"):
                g.pop(key, None)
            g["momentum"], g["dampening"], g["nesterov"] = 0.9, 0, False
    elif change == "optimizer_field_missing":
        del optim["state"][3]["exp_avg_sq"]
    elif change == "optimizer_state_shape":
        optim["state"][3]["exp_avg"] = torch.zeros(5)
    elif change == "optimizer_fewer_params":
        last = max(optim["state"])
        del optim["state"][last]
        optim["param_groups"][0]["params"].remove(last)
    else:
        raise ValueError(change)
    torch.save(ckpt, dst)
    return dst


BAD_FABRIC = [
    "missing_path",
    "truncated",
    "missing_key",
    "extra_key",
    "wrong_shape",
    "wrong_optimizer",
    pytest.param("optimizer_field_missing"),
    pytest.param("optimizer_state_shape"),
    "optimizer_fewer_params",
]


@pytest.mark.parametrize("change", BAD_FABRIC)
def test_fabric_bad_checkpoint_refused_before_any_change(
    change: str, fabric_saved: dict[str, Any], tmp_path: Path
) -> None:
    """A bad checkpoint loaded into a model that trained 3 steps raises an error naming the file, and the weights
    and optimizer state are those before the load; training then continues as if nothing had happened."""
    bad = (
        tmp_path / "missing.ckpt"
        if change == "missing_path"
        else _edit(fabric_saved["consolidated"], tmp_path / "bad.ckpt", change)
    )
    fabric, model, opt = _fabric(PatrickStarFabricStrategy())
    stream = batches(1, 0)
    _steps(fabric, model, opt, stream, 3)  # one step past the checkpoint: a load would change everything
    weights, optim = _fabric_weights(fabric, model), _flat_optimizer(opt)
    with pytest.raises(Exception) as info:  # noqa: PT011 - the type varies; the message is checked
        fabric.load(bad, {"model": model, "optimizer": opt, "step": 0})
    message = f"{type(info.value).__name__}: {info.value}"
    print(message)
    assert bad.name in message, f"the error does not name the file: {message}"
    assert_states_equal(_fabric_weights(fabric, model), weights, what=f"{change}: weights after the failed load")
    assert_states_equal(_flat_optimizer(opt), optim, what=f"{change}: optimizer after the failed load")
    got = _steps(fabric, model, opt, stream, 2)
    assert got == fabric_saved["straight"][3:], f"{change}: {got} vs straight {fabric_saved['straight'][3:]}"


def _edit_trainer_checkpoint(src: Path, dst: Path, change: str) -> Path:
    ckpt = torch.load(src, weights_only=False)
    (optim,) = ckpt["optimizer_states"]
    if change == "wrong_optimizer":
        optim["state"] = {i: {"momentum_buffer": e["exp_avg"]} for i, e in optim["state"].items()}
        for g in optim["param_groups"]:
            for key in ("betas", "eps", "amsgrad", "capturable", "decoupled_weight_decay"):
                g.pop(key, None)
            g["momentum"], g["dampening"], g["nesterov"] = 0.9, 0, False
    elif change == "optimizer_field_missing":
        del optim["state"][3]["exp_avg_sq"]
    elif change == "optimizer_state_shape":
        optim["state"][3]["exp_avg"] = torch.zeros(5)
    elif change == "no_optimizer_states":
        del ckpt["optimizer_states"]
    elif change == "two_optimizer_states":
        ckpt["optimizer_states"].append(optim)
    else:
        raise ValueError(change)
    torch.save(ckpt, dst)
    return dst


_LATE = "is refused only after the weights were overwritten"
BAD_TRAINER = [
    "missing_path",
    "wrong_optimizer",
    pytest.param("optimizer_field_missing"),
    pytest.param("optimizer_state_shape"),
    pytest.param(
        "no_optimizer_states",
        marks=pytest.mark.xfail(
            strict=True,
            reason="a full-resume ckpt_path without optimizer_states (a weights-only file) raises only after the"
            " weights were overwritten, as plain Lightning does, with plain Lightning's KeyError naming no file",
        ),
    ),
]


@pytest.mark.parametrize("change", BAD_TRAINER)
def test_trainer_bad_checkpoint_refused_before_any_change(change: str, pstar_straight: Any, tmp_path: Path) -> None:
    """``fit(ckpt_path=bad)`` raises an error naming the file; no step ran and the module keeps its weights."""
    _, pstar_dir = pstar_straight
    src = pstar_dir / "epoch=0.ckpt"
    bad = (
        tmp_path / "missing.ckpt"
        if change == "missing_path"
        else _edit_trainer_checkpoint(src, tmp_path / "bad.ckpt", change)
    )
    module = TinyLM(optim=SPEC, seed=999)
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    recorder = LossRecorder()
    trainer = make_trainer(strategy=PatrickStarStrategy(), callbacks=[recorder], max_steps=-1, max_epochs=2)
    with pytest.raises(Exception) as info:  # noqa: PT011 - the type varies; the message is checked
        trainer.fit(module, make_loader(n_seq=N_SEQ), ckpt_path=str(bad))
    message = f"{type(info.value).__name__}: {info.value}"
    print(message)
    assert recorder.losses == [] and module.training_steps_run == 0, f"{change}: trained before refusing"
    after = {k: v.detach().clone() for k, v in module.state_dict().items()}
    assert_states_equal(after, before, what=f"{change}: module weights after the failed load")
    if change != "no_optimizer_states":  # that one is plain Lightning's own KeyError, which names no file
        assert bad.name in message, f"the error does not name the file: {message}"


# ---- 6. saves from callbacks; the LightningModule's checkpoint hooks ------------------------------------------------


class HookLM(TinyLM):
    """Adds an entry in ``on_save_checkpoint`` (the step count, a weight read from the module, a tensor) and, with
    ``rename``, stores its weights under ``net.`` instead of ``model.`` (an old layout kept for compatibility);
    ``on_load_checkpoint`` records the entry, renames back and, with ``edit``, changes a weight (a user's fix-up)."""

    def __init__(self, *, rename: bool = False, edit: bool = False, **kwargs: Any) -> None:
        super().__init__(optim=SPEC, **kwargs)
        self.rename, self.edit = rename, edit
        self.loaded: dict[str, Any] | None = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        assert self.model is not None
        checkpoint["extra"] = {
            "steps_run": self.training_steps_run,
            "head": self.model.lm_head.weight.detach().float().cpu().clone(),
            "tensor": torch.arange(4),
        }
        if self.rename:
            sd = checkpoint["state_dict"]
            checkpoint["state_dict"] = {("net." + k[len("model.") :]): v for k, v in sd.items()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded = checkpoint["extra"]
        if self.rename:
            sd = checkpoint["state_dict"]
            checkpoint["state_dict"] = {("model." + k[len("net.") :]): v for k, v in sd.items()}
        if self.edit:
            checkpoint["state_dict"]["model.ln_f.weight"] = torch.full((32,), 0.5)


class _SaveOnValidationEnd(L.Callback):
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            trainer.save_checkpoint(self.folder / f"val-{trainer.global_step}.ckpt")


@pytest.mark.parametrize("mode", ["next_forward", "off"])
@pytest.mark.parametrize("hook", ["on_train_batch_end", "on_validation_end"])
def test_save_checkpoint_from_a_callback_equals_plain_lightnings(hook: str, mode: str, tmp_path: Path) -> None:
    """``trainer.save_checkpoint`` from ``on_train_batch_end`` (every batch) or ``on_validation_end`` (validation
    every 3 batches), with ``on_save_checkpoint`` adding an entry that reads a weight from the module: every file
    equals plain Lightning's, and the weight the hook read is the one in the file."""
    host = {"optimizer_placement": "host", "optimizer_overlap": mode, "chunk_size": 4096}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarStrategy(**host))):
        folder = tmp_path / name
        folder.mkdir()
        if hook == "on_validation_end":
            cb: L.Callback = _SaveOnValidationEnd(folder)
        else:
            cb = _EveryBatch(folder)
        recorder = LossRecorder()
        trainer = make_trainer(
            strategy=strategy,
            callbacks=[recorder, cb],
            max_steps=-1,
            max_epochs=1,
            val_check_interval=3,
            limit_val_batches=2,
        )
        trainer.fit(HookLM(), make_loader(n_seq=N_SEQ), make_loader(n_seq=8))
    files = sorted(p.name for p in (tmp_path / "plain").glob("*.ckpt"))
    assert files == sorted(p.name for p in (tmp_path / "pstar").glob("*.ckpt")) and files
    for file in files:
        got, want = _load(tmp_path / "pstar" / file), _load(tmp_path / "plain" / file)
        _assert_same_file(got, want, f"{hook}/{mode}: {file}")
        assert got["extra"]["steps_run"] == want["extra"]["steps_run"]
        assert torch.equal(got["extra"]["head"], got["state_dict"]["model.lm_head.weight"]), (
            f"{hook}/{mode}: {file}: the weight on_save_checkpoint read is not the one saved"
        )


class _EveryBatch(L.Callback):
    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer.save_checkpoint(self.folder / f"batch-{trainer.global_step}.ckpt")


@pytest.mark.parametrize(
    ("change", "fmt"),
    [
        ("rename", "consolidated"),
        ("rename", "sharded"),
        ("edit", "consolidated"),
        pytest.param("edit", "sharded"),
    ],
)
def test_checkpoint_hooks_round_trip_like_plain_lightning(change: str, fmt: str, tmp_path: Path) -> None:
    """``on_save_checkpoint``/``on_load_checkpoint`` that add an entry and rename (or edit on load) the weights:
    the resumed PatrickStar run reads the entry and continues as plain Lightning's resume of plain's file."""
    flags = {change: True}
    _fit("auto", ckpt_dir=tmp_path / "plain", max_epochs=1, module=HookLM(**flags))
    _fit(PatrickStarStrategy(checkpoint=fmt), ckpt_dir=tmp_path / "pstar", max_epochs=1, module=HookLM(**flags))
    ref = _fit("auto", ckpt_path=tmp_path / "plain" / "epoch=0.ckpt", max_epochs=2, module=HookLM(seed=999, **flags))
    got = _fit(
        PatrickStarStrategy(checkpoint=fmt),
        ckpt_path=tmp_path / "pstar" / "epoch=0.ckpt",
        max_epochs=2,
        module=HookLM(seed=999, **flags),
    )
    assert got.module.loaded is not None and ref.module.loaded is not None
    assert got.module.loaded["steps_run"] == ref.module.loaded["steps_run"] == BATCHES
    assert torch.equal(got.module.loaded["head"], ref.module.loaded["head"])
    assert torch.equal(got.module.loaded["tensor"], torch.arange(4))
    _assert_exact_tail(got, ref, 0, f"{change} ({fmt})")


# ---- more entry points: after fit, ckpt_path="last", evaluation from a checkpoint ----------------------------------


@pytest.mark.parametrize(
    "hand_back",
    [
        True,
        pytest.param(False),
    ],
)
def test_save_checkpoint_after_fit_returned(hand_back: bool, tmp_path: Path) -> None:
    """``trainer.save_checkpoint`` once ``fit`` has returned writes plain Lightning's weights, optimizer state and
    loops (``hand_back_weights=False`` freed the chunks: then it must still be right, or refuse naming why)."""
    plain = _fit("auto", max_epochs=1)
    plain.trainer.save_checkpoint(tmp_path / "plain.ckpt")
    pstar = _fit(PatrickStarStrategy(hand_back_weights=hand_back), max_epochs=1)
    try:
        pstar.trainer.save_checkpoint(tmp_path / "pstar.ckpt")
    except Exception as err:  # a refusal is fine if it says why
        assert "hand_back_weights" in str(err), f"refused without naming hand_back_weights: {err}"
        assert not (tmp_path / "pstar.ckpt").exists()
        return
    got, want = _load(tmp_path / "pstar.ckpt"), _load(tmp_path / "plain.ckpt")
    shapes = {k: tuple(v.shape) for k, v in got["state_dict"].items()}
    assert shapes == {k: tuple(v.shape) for k, v in want["state_dict"].items()}, f"saved shapes {shapes}"
    _assert_same_file(got, want, "after fit")


@pytest.mark.parametrize(("save_last", "fmt"), [(True, "consolidated"), ("link", "sharded")])
def test_resume_from_last(save_last: Any, fmt: str, plain_straight: Any, tmp_path: Path) -> None:
    """``ModelCheckpoint(save_last=...)`` and ``fit(ckpt_path="last")`` with a new Trainer on the same folder: the
    rest of plain Lightning's straight run."""
    plain, _ = plain_straight

    def last_cb() -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1, save_last=save_last
        )

    _fit(PatrickStarStrategy(checkpoint=fmt), callbacks=(last_cb(),), max_epochs=1, enable_checkpointing=True)
    assert (tmp_path / "last.ckpt").exists(), sorted(p.name for p in tmp_path.iterdir())
    recorder = LossRecorder()
    trainer = make_trainer(
        strategy=PatrickStarStrategy(checkpoint=fmt),
        callbacks=[recorder, last_cb()],
        max_steps=-1,
        max_epochs=EPOCHS,
        enable_checkpointing=True,
    )
    module = TinyLM(optim=SPEC, seed=999)
    trainer.fit(module, make_loader(n_seq=N_SEQ), ckpt_path="last")
    _assert_exact_tail(FitResult(module=module, trainer=trainer, recorder=recorder), plain, BATCHES, f"last ({fmt})")


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
@pytest.mark.parametrize("stage", ["validate", "predict"])
def test_evaluate_from_a_checkpoint_equals_plain(stage: str, fmt: str, tmp_path: Path) -> None:
    """``trainer.validate/test/predict(model, ckpt_path=...)`` on a fresh PatrickStar Trainer (no fit before) uses the
    file's weights: plain Lightning's metrics and predictions from plain's file."""
    _fit("auto", ckpt_dir=tmp_path / "plain", max_epochs=1)
    _fit(PatrickStarStrategy(checkpoint=fmt), ckpt_dir=tmp_path / "pstar", max_epochs=1)
    loader = make_loader(n_seq=8)
    outs = {}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarStrategy(checkpoint=fmt))):
        trainer = make_trainer(strategy=strategy)
        call = getattr(trainer, stage)
        outs[name] = call(TinyLM(optim=SPEC, seed=999), loader, ckpt_path=str(tmp_path / name / "epoch=0.ckpt"))
    if stage == "predict":
        for a, b in zip(outs["pstar"], outs["plain"], strict=True):
            assert torch.equal(a, b), f"{stage} ({fmt}): predictions differ by {(a - b).abs().max():.3e}"
    else:
        assert outs["pstar"] == outs["plain"], f"{stage} ({fmt}): {outs['pstar']} vs plain {outs['plain']}"


@pytest.mark.parametrize("change", ["missing_key", "extra_key"])
def test_fabric_strict_false_loads_what_plain_fabric_loads(
    change: str, fabric_saved: dict[str, Any], tmp_path: Path
) -> None:
    """``fabric.load(..., strict=False)`` of a checkpoint with a key missing or one too many: the weights plain
    Fabric ends up with (the missing parameter keeps its current value), and the same losses afterwards."""
    bad = _edit(fabric_saved["consolidated"], tmp_path / "partial.ckpt", change)
    results = {}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarFabricStrategy())):
        fabric, model, opt = _fabric(strategy)
        stream = batches(1, 0)
        _steps(fabric, model, opt, stream, 3)
        rest = fabric.load(bad, {"model": model, "optimizer": opt}, strict=False)
        results[name] = (
            _fabric_weights(fabric, model),
            _flat_optimizer(opt),
            _steps(fabric, model, opt, stream, 2),
            rest,
        )
    (gw, go, gl, grest), (pw, po, pl, prest) = results["pstar"], results["plain"]
    assert sorted(grest) == sorted(prest), f"left over: {sorted(grest)} vs plain {sorted(prest)}"
    for name in pw:
        torch.testing.assert_close(gw[name], pw[name], rtol=0, atol=3e-7, msg=lambda m, n=name: f"{change}: {n}: {m}")
    assert sorted(go) == sorted(po)
    assert max(abs(a - b) / abs(b) for a, b in zip(gl, pl, strict=True)) <= 1e-5, f"{change}: {gl} vs plain {pl}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_fabric_load_raw_of_another_dtype_casts_like_plain(
    dtype: torch.dtype, fabric_saved: dict[str, Any], tmp_path: Path
) -> None:
    """``fabric.load_raw`` of a plain ``state_dict`` saved in another dtype into a 32-true model: torch casts on
    ``load_state_dict``; the PatrickStar model gets the same fp32 values."""
    raw = {k: v.to(dtype) for k, v in torch.load(fabric_saved["consolidated"], weights_only=True)["model"].items()}
    path = tmp_path / "raw.pt"
    torch.save(raw, path)
    weights = {}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarFabricStrategy())):
        fabric, model, _ = _fabric(strategy)
        fabric.load_raw(path, model)
        weights[name] = _fabric_weights(fabric, model)
    assert_states_equal(weights["pstar"], weights["plain"], what=f"load_raw of {dtype}")


def test_fabric_load_without_state_returns_plain_fabrics_dict(fabric_saved: dict[str, Any]) -> None:
    """``fabric.load(path)`` with no state returns the whole checkpoint, in the layout plain Fabric's file has."""
    fabric, model, opt = _fabric(PatrickStarFabricStrategy())
    got = fabric.load(fabric_saved["consolidated"])
    plain = torch.load(fabric_saved["plain"], weights_only=False)
    assert {"model", "optimizer", "step"} <= set(got), sorted(got)
    assert sorted(got["model"]) == sorted(plain["model"])
    assert got["step"] == plain["step"] == 2
    assert sorted(got["optimizer"]["state"]) == sorted(plain["optimizer"]["state"])
    for name, value in plain["model"].items():
        torch.testing.assert_close(got["model"][name], value, rtol=0, atol=3e-7)


@pytest.mark.parametrize("what", ["model_only", "optimizer_only"])
def test_fabric_sharded_partial_load_strict_false(what: str, fabric_saved: dict[str, Any]) -> None:
    """A sharded Fabric checkpoint loaded with only the model (or only the optimizer) and ``strict=False``: that
    object is restored exactly, the other is left as it was, the rest comes back."""
    ref_fabric, ref_model, ref_opt = _fabric(PatrickStarFabricStrategy())
    ref_fabric.load(fabric_saved["consolidated"], {"model": ref_model, "optimizer": ref_opt})
    fabric, model, opt = _fabric(PatrickStarFabricStrategy())
    stream = batches(1, 0)
    _steps(fabric, model, opt, stream, 3)
    weights, optim = _fabric_weights(fabric, model), _flat_optimizer(opt)
    state = {"model": model} if what == "model_only" else {"optimizer": opt}
    rest = fabric.load(fabric_saved["sharded"], state, strict=False)
    assert rest.get("step") == 2 and rest.get("extra") == {"note": "sharded"}, sorted(rest)
    if what == "model_only":
        assert_states_equal(_fabric_weights(fabric, model), _fabric_weights(ref_fabric, ref_model), what="model")
        assert_states_equal(_flat_optimizer(opt), optim, what="optimizer untouched")
    else:
        assert_states_equal(_flat_optimizer(opt), _flat_optimizer(ref_opt), what="optimizer")
        assert_states_equal(_fabric_weights(fabric, model), weights, what="model untouched")


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
@pytest.mark.parametrize("mode", ["next_forward", "pipeline"])
def test_fabric_save_right_after_the_step_equals_the_serial_steps_file(mode: str, fmt: str, tmp_path: Path) -> None:
    """``fabric.save`` right after ``optimizer.step()`` (the step's tail may still run) holds the updated weights
    and optimizer state: the file of ``optimizer_overlap="off"`` bit for bit, and it resumes the same."""
    files = {}
    for name in ("off", mode):
        strategy = PatrickStarFabricStrategy(
            optimizer_placement="host", optimizer_overlap=name, chunk_size=4096, checkpoint=fmt
        )
        fabric, model, opt = _fabric(strategy)
        stream = batches(1, 0)
        for step in range(3):
            x, y = next(stream)
            fabric.backward(lm_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            fabric.save(tmp_path / f"{name}-{step}", {"model": model, "optimizer": opt, "step": step})
        files[name] = [tmp_path / f"{name}-{step}" for step in range(3)]
    for off_file, mode_file in zip(files["off"], files[mode], strict=True):
        states = {}
        for name, path in (("off", off_file), (mode, mode_file)):
            fabric, model, opt = _fabric(PatrickStarFabricStrategy())
            fabric.load(path, {"model": model, "optimizer": opt})
            states[name] = (_fabric_weights(fabric, model), _flat_optimizer(opt))
        assert_states_equal(states[mode][0], states["off"][0], what=f"{mode_file.name}: weights")
        assert_states_equal(states[mode][1], states["off"][1], what=f"{mode_file.name}: optimizer")


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
def test_resume_with_the_disk_tier(fmt: str, plain_straight: Any, tmp_path: Path) -> None:
    """Saved without a disk tier, resumed with the fp32 masters and Adam states of most families on disk (a host
    budget too small for them): plain Lightning's straight run, bit for bit; and the reverse."""
    plain, _ = plain_straight
    disk = {"disk_path": str(tmp_path / "disk"), "host_memory_limit": 512 * 1024, "chunk_size": 2048}
    disk["optimizer_placement"] = "host"
    (tmp_path / "disk").mkdir()
    _fit(PatrickStarStrategy(**disk, checkpoint=fmt), ckpt_dir=tmp_path / "a", max_epochs=1)
    resumed = _fit(PatrickStarStrategy(checkpoint=fmt), ckpt_path=tmp_path / "a" / "epoch=0.ckpt", seed=999)
    _assert_exact_tail(resumed, plain, BATCHES, "disk -> no disk")
    _fit(PatrickStarStrategy(checkpoint=fmt), ckpt_dir=tmp_path / "b", max_epochs=1)
    strategy = PatrickStarStrategy(**disk, checkpoint=fmt)
    resumed = _fit(strategy, ckpt_path=tmp_path / "b" / "epoch=0.ckpt", seed=999)
    _assert_exact_tail(resumed, plain, BATCHES, "no disk -> disk")
    report = strategy.memory_report()
    assert report.disk_families > 0, f"nothing went to the disk tier:\n{report}"


class PeftLM(TinyLM):
    """Saves only what trains (a fine-tuning pattern): ``on_save_checkpoint`` drops the frozen weights from
    ``checkpoint["state_dict"]``, and ``strict_loading = False`` lets a resume load the file without them."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(optim=SPEC, **kwargs)
        self.strict_loading = False

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        for key in [k for k in checkpoint["state_dict"] if k.startswith("model.frozen.")]:
            del checkpoint["state_dict"][key]


@pytest.mark.parametrize(
    "fmt",
    [
        "consolidated",
        pytest.param("sharded"),
    ],
)
def test_trainable_only_checkpoint_with_strict_loading_false(fmt: str, tmp_path: Path) -> None:
    """The frozen weights are left out of the file and a fresh module (another seed: other frozen weights) resumes:
    the frozen weights stay the fresh module's, the rest comes from the file, as under plain Lightning."""
    _fit("auto", ckpt_dir=tmp_path / "plain", max_epochs=1, module=PeftLM())
    _fit(PatrickStarStrategy(checkpoint=fmt), ckpt_dir=tmp_path / "pstar", max_epochs=1, module=PeftLM())
    if fmt == "consolidated":
        saved = _load(tmp_path / "pstar" / "epoch=0.ckpt")["state_dict"]
        assert not [k for k in saved if k.startswith("model.frozen.")], "frozen weights saved anyway"
    ref = _fit("auto", ckpt_path=tmp_path / "plain" / "epoch=0.ckpt", max_epochs=2, module=PeftLM(seed=999))
    got = _fit(
        PatrickStarStrategy(checkpoint=fmt),
        ckpt_path=tmp_path / "pstar" / "epoch=0.ckpt",
        max_epochs=2,
        module=PeftLM(seed=999),
    )
    _assert_exact_tail(got, ref, 0, f"trainable-only file ({fmt})")


def test_tied_weight_saved_with_two_values_loads_as_plain(pstar_straight: Any, tmp_path: Path) -> None:
    """A file in which the two names of the tied weight hold different values (edited by hand, or saved from an
    untied model): plain ``load_state_dict`` copies both into the one parameter, the later module's last; a
    PatrickStar resume must end with the same weight (or refuse, naming the tie)."""
    _, pstar_dir = pstar_straight
    ckpt = _load(pstar_dir / "epoch=0.ckpt")
    ckpt["state_dict"]["model.wte.weight"] = ckpt["state_dict"]["model.wte.weight"] + 1.0
    path = tmp_path / "untied.ckpt"
    torch.save(ckpt, path)
    starts = {}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarStrategy())):
        try:
            run = _fit(strategy, ckpt_path=path, seed=999, max_epochs=2)
        except Exception as err:
            assert name == "pstar" and "wte" in str(err) and "lm_head" in str(err), f"{name}: {err}"
            return
        starts[name] = run.recorder.initial_state
    assert_states_equal(starts["pstar"], starts["plain"], what="weights at resume")


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
def test_bf16_resume_under_another_overlap_is_the_straight_run(fmt: str, tmp_path: Path) -> None:
    """bf16-mixed, saved mid-window (accumulation 2, batch 3) with ``optimizer_overlap="next_forward"`` and resumed
    with ``"off"``: the ``"off"`` run saved and resumed at the same batch, bit for bit (the bits do not depend on
    the overlap mode)."""
    host = {"optimizer_placement": "host", "chunk_size": 4096, "checkpoint": fmt}
    common: dict[str, Any] = {"precision": "bf16-mixed", "accumulate_grad_batches": 2, "max_epochs": 2}
    path = tmp_path / "mid.ckpt"
    _fit(PatrickStarStrategy(optimizer_overlap="next_forward", **host), callbacks=(_SaveAtBatch(path, 2),), **common)
    resumed = _fit(PatrickStarStrategy(optimizer_overlap="off", **host), ckpt_path=path, seed=999, **common)
    own = tmp_path / "own.ckpt"
    _fit(PatrickStarStrategy(optimizer_overlap="off", **host), callbacks=(_SaveAtBatch(own, 2),), **common)
    ref = _fit(PatrickStarStrategy(optimizer_overlap="off", **host), ckpt_path=own, seed=999, **common)
    _assert_exact_tail(resumed, ref, 0, f"bf16 next_forward -> off ({fmt})")
    if fmt == "consolidated":
        assert _load(path)["global_step"] == 1, "not saved inside the second window"


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
def test_top_k_removes_old_checkpoints_and_keeps_loadable_ones(fmt: str, plain_straight: Any, tmp_path: Path) -> None:
    """``ModelCheckpoint(monitor="step", mode="max", save_top_k=2, every_n_train_steps=4)``: the older files (or
    directories) are removed as plain Lightning removes them, and the kept ones resume exactly."""
    plain, _ = plain_straight
    names = {}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarStrategy(checkpoint=fmt))):
        cb = ModelCheckpoint(
            dirpath=tmp_path / name, filename="{step}", monitor="step", mode="max", save_top_k=2, every_n_train_steps=4
        )
        _fit(strategy, callbacks=(cb,), enable_checkpointing=True)
        entries = list((tmp_path / name).iterdir())
        names[name] = sorted(p.name for p in entries if not p.name.startswith("."))
        # a sharded directory is published as a link to a hidden directory beside it: only those may remain
        targets = {p.resolve() for p in entries if p.is_symlink()}
        stray = [p.name for p in entries if p.name.startswith(".") and p.resolve() not in targets]
        assert not stray, f"{name}: left behind {stray}"
    assert names["pstar"] == names["plain"] == ["step=20.ckpt", "step=24.ckpt"], names
    resumed = _fit(PatrickStarStrategy(checkpoint=fmt), ckpt_path=tmp_path / "pstar" / "step=24.ckpt", seed=999)
    assert resumed.trainer.global_step == plain.trainer.global_step and resumed.losses == []


class _SaveIn(L.Callback):
    """``trainer.save_checkpoint`` from a callback hook at batches 1 and 4 of epoch 0."""

    def __init__(self, hook: str, folder: Path) -> None:
        self.hook, self.folder = hook, folder

    def _save(self, trainer: L.Trainer, where: str) -> None:
        if where == self.hook and trainer.current_epoch == 0 and trainer.fit_loop.batch_idx in (1, 4):
            trainer.save_checkpoint(self.folder / f"{where}-{trainer.fit_loop.batch_idx}.ckpt")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._save(trainer, "on_train_batch_start")

    def on_after_backward(self, trainer: L.Trainer, *args: Any) -> None:
        self._save(trainer, "on_after_backward")

    def on_before_optimizer_step(self, trainer: L.Trainer, *args: Any) -> None:
        self._save(trainer, "on_before_optimizer_step")

    def on_before_zero_grad(self, trainer: L.Trainer, *args: Any) -> None:
        self._save(trainer, "on_before_zero_grad")


class _SaveInTrainingStep(TinyLM):
    """Saves from inside ``training_step``, after the forward and before the loss is returned (batches 1 and 4)."""

    def __init__(self, folder: Path) -> None:
        super().__init__(optim=SPEC)
        self.folder = folder

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.current_epoch == 0 and batch_idx in (1, 4):
            self.trainer.save_checkpoint(self.folder / f"training_step-{batch_idx}.ckpt")
        return loss


SAVE_POINTS = [
    "on_train_batch_start",
    "training_step",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
]


@pytest.mark.parametrize("mode", ["next_forward"])
@pytest.mark.parametrize("where", SAVE_POINTS)
def test_save_checkpoint_at_every_point_of_the_step(where: str, mode: str, tmp_path: Path) -> None:
    """A save from any point of an iteration (before the forward, inside the training step, between backward
    and step, before zero_grad) with the optimizer on the host: plain Lightning's file at that point (weights
    before or after the step exactly as plain has them), and training goes on as plain Lightning's."""
    host = {"optimizer_placement": "host", "optimizer_overlap": mode, "chunk_size": 4096}
    runs = {}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarStrategy(**host))):
        folder = tmp_path / name
        folder.mkdir()
        if where == "training_step":
            runs[name] = _fit(strategy, module=_SaveInTrainingStep(folder), max_epochs=1)
        else:
            runs[name] = _fit(strategy, callbacks=(_SaveIn(where, folder),), max_epochs=1)
    files = sorted(p.name for p in (tmp_path / "plain").glob("*.ckpt"))
    assert len(files) == 2 and files == sorted(p.name for p in (tmp_path / "pstar").glob("*.ckpt"))
    for file in files:
        _assert_same_file(_load(tmp_path / "pstar" / file), _load(tmp_path / "plain" / file), f"{where}/{mode}: {file}")
    _assert_exact_tail(runs["pstar"], runs["plain"], 0, f"{where}/{mode}: the run around the saves")


class GroupsLM(TinyLM):
    """AdamW over two param groups whose order is not the model's: no-decay parameters (biases, norms, embeddings)
    first with their own lr, then the decayed matrices; ``frozen_too`` also hands the frozen Linear to the optimizer
    (torch keeps no state for a parameter that never gets a gradient)."""

    def __init__(self, *, frozen_too: bool = False, **kwargs: Any) -> None:
        super().__init__(optim=SPEC, **kwargs)
        self.frozen_too = frozen_too

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad or self.frozen_too]
        no_decay = [p for p in params if p.dim() < 2]
        decay = [p for p in params if p.dim() >= 2]
        opt = torch.optim.AdamW(
            [{"params": no_decay, "weight_decay": 0.0, "lr": 1e-3}, {"params": decay, "weight_decay": 0.1}],
            lr=3e-3,
            fused=True,
        )
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("frozen_too", [False, True])
@pytest.mark.parametrize("direction", ["pstar_to_plain", "plain_to_pstar"])
def test_param_groups_out_of_model_order_resume_across_strategies(
    direction: str, frozen_too: bool, tmp_path: Path
) -> None:
    """The optimizer state is numbered as torch numbers it (group by group), so a file crosses strategies."""
    plain = _fit("auto", ckpt_dir=tmp_path / "plain", module=GroupsLM(frozen_too=frozen_too))
    pstar_dir = tmp_path / "pstar"
    _fit(PatrickStarStrategy(), ckpt_dir=pstar_dir, max_epochs=1, module=GroupsLM(frozen_too=frozen_too))
    got, want = _load(pstar_dir / "epoch=0.ckpt"), _load(tmp_path / "plain" / "epoch=0.ckpt")
    _assert_same_file(got, want, "epoch=0.ckpt with two param groups")
    if direction == "pstar_to_plain":
        ckpt, strategy = pstar_dir / "epoch=0.ckpt", "auto"
    else:
        ckpt, strategy = tmp_path / "plain" / "epoch=0.ckpt", PatrickStarStrategy()
    resumed = _fit(strategy, ckpt_path=ckpt, module=GroupsLM(frozen_too=frozen_too, seed=999))
    _assert_exact_tail(resumed, plain, BATCHES, direction)


class TwoOptLM(TinyLM):
    """Manual optimization with two optimizers over disjoint parameters (the blocks; everything else), the second
    stepped every other batch, each with its own schedule stepped by hand."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(optim=SPEC, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt_a, opt_b = self.optimizers()
        sched_a, sched_b = self.lr_schedulers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt_a.step()
        opt_a.zero_grad()
        sched_a.step()
        if batch_idx % 2:
            opt_b.step()
            sched_b.step()
        opt_b.zero_grad()
        return loss.detach()

    def configure_optimizers(self) -> Any:
        assert self.model is not None
        blocks = [p for p in self.model.blocks.parameters()]
        ids = {id(p) for p in blocks}
        rest = [p for p in self.parameters() if p.requires_grad and id(p) not in ids]
        opt_a = torch.optim.AdamW(blocks, lr=3e-3, weight_decay=0.1, fused=True)
        opt_b = torch.optim.SGD(rest, lr=0.05, momentum=0.9, fused=True)
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (opt_a, opt_b)]
        return [opt_a, opt_b], scheds


@pytest.mark.parametrize("direction", ["pstar_to_plain", "plain_to_pstar", "sharded"])
def test_two_optimizers_resume_across_strategies(direction: str, tmp_path: Path) -> None:
    """Two optimizers (AdamW, SGD with momentum) and two schedules: the file crosses strategies both ways, and a
    sharded one resumes under PatrickStar: plain Lightning's straight run, bit for bit."""
    fmt = "sharded" if direction == "sharded" else "consolidated"
    plain = _fit("auto", ckpt_dir=tmp_path / "plain", module=TwoOptLM())
    _fit(PatrickStarStrategy(checkpoint=fmt), ckpt_dir=tmp_path / "pstar", max_epochs=1, module=TwoOptLM())
    if fmt == "consolidated":
        got, want = _load(tmp_path / "pstar" / "epoch=0.ckpt"), _load(tmp_path / "plain" / "epoch=0.ckpt")
        assert len(got["optimizer_states"]) == len(want["optimizer_states"]) == 2
        for k in range(2):
            one = {**got, "optimizer_states": [got["optimizer_states"][k]]}
            other = {**want, "optimizer_states": [want["optimizer_states"][k]]}
            _assert_same_file(one, other, f"epoch=0.ckpt optimizer {k}")
    ckpt = tmp_path / ("plain" if direction == "plain_to_pstar" else "pstar") / "epoch=0.ckpt"
    strategy = "auto" if direction == "pstar_to_plain" else PatrickStarStrategy(checkpoint=fmt)
    resumed = _fit(strategy, ckpt_path=ckpt, module=TwoOptLM(seed=999))
    assert resumed.losses == plain.losses[BATCHES:], direction
    assert_states_equal(_weights(resumed), _weights(plain), what=f"{direction}: final weights")
    for k in range(2):
        a, b = resumed.trainer.optimizers[k].state_dict(), plain.trainer.optimizers[k].state_dict()
        flat_a = {f"{i}/{f}": torch.as_tensor(v) for i, e in a["state"].items() for f, v in e.items()}
        flat_b = {f"{i}/{f}": torch.as_tensor(v) for i, e in b["state"].items() for f, v in e.items()}
        assert_states_equal(flat_a, flat_b, what=f"{direction}: optimizer {k}")


_FRESH_PROCESS = """
import json, sys
import torch
from tests.integration.test_checkpoint_interop_adversarial import _fabric, _steps
from tests.helpers.fabric_loop import batches
from lightning_pstar import PatrickStarFabricStrategy
out = {}
for fmt, path in zip(("consolidated", "sharded"), sys.argv[1:3]):
    fabric, model, opt = _fabric(PatrickStarFabricStrategy(checkpoint=fmt))
    state = {"model": model, "optimizer": opt, "step": 0}
    rest = fabric.load(path, state)
    stream = batches(1, 0)
    for _ in range(state["step"]):
        next(stream)
    out[fmt] = {"step": state["step"], "extra": rest.get("extra"), "losses": _steps(fabric, model, opt, stream, 2)}
print("RESULT " + json.dumps(out))
"""


def test_fabric_load_in_a_fresh_process(fabric_saved: dict[str, Any]) -> None:
    """A new Python process sets up the model and optimizer again and loads both checkpoints: it continues with
    the saving run's own losses, bit for bit."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, "-W", "ignore", "-c", _FRESH_PROCESS]
    argv += [str(fabric_saved["consolidated"]), str(fabric_saved["sharded"])]
    done = subprocess.run(argv, env=env, cwd=repo, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    out = json.loads(line[len("RESULT ") :])
    for fmt in ("consolidated", "sharded"):
        assert out[fmt]["step"] == 2 and out[fmt]["extra"] == {"note": fmt}, out[fmt]
        assert out[fmt]["losses"] == fabric_saved[f"{fmt}/tail"], f"{fmt}: {out[fmt]['losses']}"


def _precision_options(precision: str) -> dict[str, Any]:
    if precision == "16-mixed":  # on CPU Lightning turns precision="16-mixed" into bf16: pass the plugin
        return {"plugins": [PatrickStarPrecision("16-mixed")], "precision": None}
    return {"precision": precision}


@pytest.mark.parametrize(
    ("saved_in", "resumed_in"),
    [
        ("bf16-mixed", "bf16-mixed"),  # the control: a bf16 file's own state is the default one
        pytest.param("16-mixed", "bf16-mixed"),
        pytest.param("bf16-mixed", "16-mixed"),
    ],
)
def test_loss_scale_state_of_another_precision_is_not_taken(saved_in: str, resumed_in: str, tmp_path: Path) -> None:
    """A checkpoint of one mixed precision resumed in the other: the precision state of the saving run does not
    carry over (plain Lightning keeps loss-scale state only for 16-mixed's GradScaler), so the resume equals the
    resume of the same file with that state taken out, bit for bit."""
    _fit(PatrickStarStrategy(), ckpt_dir=tmp_path / "a", max_epochs=1, **_precision_options(saved_in))
    ckpt = _load(tmp_path / "a" / "epoch=0.ckpt")
    assert "PatrickStarPrecision" in ckpt, sorted(ckpt)
    del ckpt["PatrickStarPrecision"]
    torch.save(ckpt, tmp_path / "without.ckpt")
    runs = {}
    for name, path in (("with", tmp_path / "a" / "epoch=0.ckpt"), ("without", tmp_path / "without.ckpt")):
        runs[name] = _fit(
            PatrickStarStrategy(), ckpt_path=path, seed=999, max_epochs=2, **_precision_options(resumed_in)
        )
    scales = {n: r.trainer.strategy.precision_plugin.state_dict() for n, r in runs.items()}
    assert scales["with"] == scales["without"], f"{saved_in} -> {resumed_in}: precision state {scales}"
    _assert_exact_tail(runs["with"], runs["without"], 0, f"{saved_in} -> {resumed_in}")


def test_fabric_save_with_a_filter_equals_plain_fabrics(tmp_path: Path) -> None:
    """``fabric.save(..., filter={"model": ...})`` (consolidated) keeps only the entries plain Fabric keeps, with
    plain Fabric's values; a filtered file loads back with ``strict=False`` into both as plain loads it."""
    keep = {"model": lambda key, value: "blocks.1." in key or key == "lm_head.weight"}
    saved = {}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarFabricStrategy(checkpoint="consolidated"))):
        fabric, model, opt = _fabric(strategy)
        _steps(fabric, model, opt, batches(1, 0), 2)
        fabric.save(tmp_path / name, {"model": model, "optimizer": opt, "step": 2}, filter=keep)
        saved[name] = torch.load(tmp_path / name, weights_only=False)
    assert sorted(saved["pstar"]["model"]) == sorted(saved["plain"]["model"])
    for key, value in saved["plain"]["model"].items():
        torch.testing.assert_close(saved["pstar"]["model"][key], value, rtol=0, atol=3e-7)
    loaded = {}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarFabricStrategy())):
        fabric, model, opt = _fabric(strategy)
        fabric.load(tmp_path / "pstar", {"model": model}, strict=False)
        loaded[name] = _fabric_weights(fabric, model)
    assert_states_equal(loaded["pstar"], loaded["plain"], what="filtered file loaded with strict=False")


def test_fabric_load_under_a_key_the_file_lacks_changes_nothing(fabric_saved: dict[str, Any]) -> None:
    """The file has ``optimizer``; the state asks for ``opt``: strict loading refuses before the model changes."""
    fabric, model, opt = _fabric(PatrickStarFabricStrategy())
    _steps(fabric, model, opt, batches(1, 0), 3)
    weights, optim = _fabric_weights(fabric, model), _flat_optimizer(opt)
    with pytest.raises(KeyError, match="opt"):
        fabric.load(fabric_saved["consolidated"], {"model": model, "opt": opt})
    assert_states_equal(_fabric_weights(fabric, model), weights, what="weights after the refused load")
    assert_states_equal(_flat_optimizer(opt), optim, what="optimizer after the refused load")


@pytest.mark.parametrize("meta_init", [False, True])
def test_load_from_checkpoint_then_fit(meta_init: bool, pstar_straight: Any, tmp_path: Path) -> None:
    """``TinyLM.load_from_checkpoint`` of a PatrickStar file (the model built in ``configure_model`` or in
    ``__init__``), then a new fit under PatrickStar: plain Lightning's fit from the same loaded module, bit for bit."""
    _, pstar_dir = pstar_straight
    ckpt = pstar_dir / "epoch=0.ckpt"
    runs = {}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarStrategy())):
        module = TinyLM.load_from_checkpoint(ckpt, optim=SPEC, seed=999, meta_init=meta_init)
        assert module.model is not None, "load_from_checkpoint left the model unbuilt"
        runs[name] = _fit(strategy, module=module, max_epochs=1)
        saved = _load(ckpt)["state_dict"]
        assert_states_equal(runs[name].recorder.initial_state, saved, what=f"{name}: weights at the start")
    _assert_exact_tail(runs["pstar"], runs["plain"], 0, f"load_from_checkpoint (meta_init={meta_init})")


@pytest.fixture
def weights_only_dirs(tmp_path: Path) -> Path:
    """``ModelCheckpoint(save_weights_only=True)`` after epoch 0: plain Lightning's file and PatrickStar's sharded
    directory."""
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarStrategy(checkpoint="sharded"))):
        cb = ModelCheckpoint(dirpath=tmp_path / name, filename="{epoch}", save_weights_only=True, every_n_epochs=1)
        _fit(strategy, callbacks=(cb,), max_epochs=1, enable_checkpointing=True)
    return tmp_path


def test_full_resume_from_a_sharded_weights_only_checkpoint_is_refused_like_plain(weights_only_dirs: Path) -> None:
    recorder = LossRecorder()
    trainer = make_trainer(strategy=PatrickStarStrategy(checkpoint="sharded"), callbacks=[recorder], max_epochs=2)
    with pytest.raises(KeyError, match="contains only the model"):
        trainer.fit(
            TinyLM(optim=SPEC, seed=999),
            make_loader(n_seq=N_SEQ),
            ckpt_path=str(weights_only_dirs / "pstar" / "epoch=0.ckpt"),
        )
    assert recorder.losses == []


def test_consolidated_sharded_weights_only_checkpoint_is_plain_lightnings(weights_only_dirs: Path) -> None:
    from lightning_pstar.checkpoint import consolidate

    consolidate(weights_only_dirs / "pstar" / "epoch=0.ckpt", weights_only_dirs / "out.ckpt")
    got, want = _load(weights_only_dirs / "out.ckpt"), _load(weights_only_dirs / "plain" / "epoch=0.ckpt")
    assert sorted(got) == sorted(want), f"keys {sorted(got)} vs plain {sorted(want)}"
    _assert_same_file(got, want, "sharded weights-only, consolidated")


class BatchNormNet(torch.nn.Module):
    """Embedding, BatchNorm over the channels (running statistics and an int64 ``num_batches_tracked``), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 32)
        self.bn = torch.nn.BatchNorm1d(32)
        self.fc = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.emb(idx).transpose(1, 2)).transpose(1, 2)  # (B, T, C)
        return self.head(torch.tanh(self.fc(x)))


@pytest.mark.parametrize("direction", ["pstar_to_plain", "plain_to_pstar"])
def test_buffers_cross_strategies(direction: str, tmp_path: Path) -> None:
    """BatchNorm's running statistics and step counter travel in the file both ways: plain Lightning's straight
    run, bit for bit (losses, weights, buffers, optimizer state)."""
    from tests.helpers.runs import LM

    plain = _fit("auto", ckpt_dir=tmp_path / "plain", module=LM(BatchNormNet))
    _fit(PatrickStarStrategy(), ckpt_dir=tmp_path / "pstar", max_epochs=1, module=LM(BatchNormNet))
    got, want = _load(tmp_path / "pstar" / "epoch=0.ckpt"), _load(tmp_path / "plain" / "epoch=0.ckpt")
    _assert_same_file(got, want, "epoch=0.ckpt with BatchNorm")
    assert int(got["state_dict"]["net.bn.num_batches_tracked"]) == BATCHES
    ckpt = tmp_path / ("pstar" if direction == "pstar_to_plain" else "plain") / "epoch=0.ckpt"
    strategy = "auto" if direction == "pstar_to_plain" else PatrickStarStrategy()
    fresh = LM(BatchNormNet)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # the file must overwrite every weight
    resumed = _fit(strategy, ckpt_path=ckpt, module=fresh)
    _assert_exact_tail(resumed, plain, BATCHES, direction)


def test_fabric_load_raw_of_plain_torch_files(tmp_path: Path) -> None:
    """Plain PyTorch files (no Fabric): ``model.state_dict()`` minus a few keys loaded with ``load_raw(...,
    strict=False)``, and ``optimizer.state_dict()`` loaded with ``load_raw`` into the set-up optimizer: the weights
    and optimizer state plain Fabric ends with, and the same next losses."""
    torch.manual_seed(SEED)
    net = FlatGPT()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01)
    stream = batches(1, 0)
    for _ in range(2):
        x, y = next(stream)
        lm_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    partial = {k: v for k, v in net.state_dict().items() if not k.startswith("blocks.0.")}
    torch.save(partial, tmp_path / "weights.pt")
    torch.save(opt.state_dict(), tmp_path / "optim.pt")
    results = {}
    for name, strategy in (("plain", "auto"), ("pstar", PatrickStarFabricStrategy())):
        fabric, model, fopt = _fabric(strategy)
        fabric.load_raw(tmp_path / "weights.pt", model, strict=False)
        fabric.load_raw(tmp_path / "optim.pt", fopt)
        weights, optim = _fabric_weights(fabric, model), _flat_optimizer(fopt)
        results[name] = (weights, optim, _steps(fabric, model, fopt, _stream_after(2), 2))
    (gw, go, gl), (pw, po, pl) = results["pstar"], results["plain"]
    assert_states_equal(gw, pw, what="weights after load_raw")
    assert_states_equal(go, po, what="optimizer after load_raw")
    assert max(abs(a - b) / abs(b) for a, b in zip(gl, pl, strict=True)) <= 1e-5, f"{gl} vs plain {pl}"


def _stream_after(n: int) -> Any:
    stream = batches(1, 0)
    for _ in range(n):
        next(stream)
    return stream


def _edit_groups(src: Path, dst: Path, change: str) -> Path:
    ckpt = torch.load(src, weights_only=False)
    (optim,) = ckpt["optimizer_states"]
    for group in optim["param_groups"]:
        if change == "hyperparameters":
            group.update(lr=group["lr"] * 0.5, initial_lr=group["initial_lr"] * 0.5, betas=(0.8, 0.95))
            group.update(weight_decay=0.3, eps=1e-6)
        elif change == "amsgrad":
            group["amsgrad"] = True
    if change == "amsgrad":
        for entry in optim["state"].values():
            entry["max_exp_avg_sq"] = entry["exp_avg_sq"].clone()
    torch.save(ckpt, dst)
    return dst


def test_optimizer_hyperparameters_come_from_the_file(pstar_straight: Any, tmp_path: Path) -> None:
    """A file whose param groups hold other hyperparameters (lr, betas, eps, weight decay) than
    ``configure_optimizers``: torch takes the file's, so the resume equals plain Lightning's from the same file."""
    _, pstar_dir = pstar_straight
    path = _edit_groups(pstar_dir / "epoch=0.ckpt", tmp_path / "groups.ckpt", "hyperparameters")
    ref = _fit("auto", ckpt_path=path, seed=999)
    got = _fit(PatrickStarStrategy(), ckpt_path=path, seed=999)
    group = got.trainer.optimizers[0].param_groups[0]
    assert group["betas"] == (0.8, 0.95) and group["weight_decay"] == 0.3, group
    _assert_exact_tail(got, ref, 0, "hyperparameters from the file")


def test_amsgrad_state_in_the_file_is_refused_before_any_change(pstar_straight: Any, tmp_path: Path) -> None:
    """A file of AdamW with ``amsgrad=True`` (which the engine refuses at setup) resumed into an AdamW without it:
    torch would switch to amsgrad; the engine must refuse naming amsgrad before the weights change, not drop it."""
    _, pstar_dir = pstar_straight
    path = _edit_groups(pstar_dir / "epoch=0.ckpt", tmp_path / "amsgrad.ckpt", "amsgrad")
    module = TinyLM(optim=SPEC, seed=999)
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    recorder = LossRecorder()
    trainer = make_trainer(strategy=PatrickStarStrategy(), callbacks=[recorder], max_steps=-1, max_epochs=2)
    with pytest.raises(Exception, match="amsgrad") as info:
        trainer.fit(module, make_loader(n_seq=N_SEQ), ckpt_path=str(path))
    print(f"{type(info.value).__name__}: {info.value}")
    assert recorder.losses == []
    assert_states_equal({k: v.detach().clone() for k, v in module.state_dict().items()}, before, what="weights")


@pytest.mark.parametrize(
    ("saved_momentum", "resumed_momentum"),
    [
        pytest.param(0.9, 0.0),
        (0.0, 0.9),
    ],
)
def test_sgd_momentum_from_the_file(saved_momentum: float, resumed_momentum: float, tmp_path: Path) -> None:
    """SGD saved with one momentum and resumed by a module that configures another: torch's ``load_state_dict``
    puts the file's param groups (its momentum) in place, so plain Lightning continues with the file's momentum;
    PatrickStar must do the same (or refuse before any change, naming momentum)."""
    _fit(
        "auto",
        ckpt_dir=tmp_path,
        max_epochs=1,
        module=TinyLM(optim=OptimSpec(name="sgd", lr=0.1, momentum=saved_momentum)),
    )
    path = tmp_path / "epoch=0.ckpt"
    resumed_spec = OptimSpec(name="sgd", lr=0.1, momentum=resumed_momentum)
    ref = _fit("auto", ckpt_path=path, module=TinyLM(optim=resumed_spec, seed=999))
    try:
        got = _fit(PatrickStarStrategy(), ckpt_path=path, module=TinyLM(optim=resumed_spec, seed=999))
    except Exception as err:
        assert "momentum" in str(err), f"refused without naming momentum: {err}"
        return
    _assert_exact_tail(got, ref, 0, f"SGD momentum {saved_momentum} -> {resumed_momentum}")


@pytest.mark.parametrize(
    "case",
    [
        "sgd_nesterov",
        pytest.param("adam_file_into_adamw"),
        "adamw_file_into_adam",
    ],
)
def test_optimizer_flags_from_the_file(case: str, tmp_path: Path) -> None:
    """The file's param groups carry flags the resuming optimizer was not built with (SGD ``nesterov``; Adam's
    ``decoupled_weight_decay``, which tells torch's Adam and AdamW apart): torch's ``load_state_dict`` takes them, so
    plain Lightning continues with the file's; PatrickStar must match it (or refuse before any change)."""
    saved, resumed = {
        "sgd_nesterov": (
            OptimSpec(name="sgd", lr=0.1, momentum=0.9, nesterov=True),
            OptimSpec(name="sgd", lr=0.1, momentum=0.9),
        ),
        "adam_file_into_adamw": (OptimSpec(name="adam", weight_decay=0.1), OptimSpec(name="adamw", weight_decay=0.1)),
        "adamw_file_into_adam": (OptimSpec(name="adamw", weight_decay=0.1), OptimSpec(name="adam", weight_decay=0.1)),
    }[case]
    _fit("auto", ckpt_dir=tmp_path, max_epochs=1, module=TinyLM(optim=saved))
    path = tmp_path / "epoch=0.ckpt"
    ref = _fit("auto", ckpt_path=path, module=TinyLM(optim=resumed, seed=999))
    try:
        got = _fit(PatrickStarStrategy(), ckpt_path=path, module=TinyLM(optim=resumed, seed=999))
    except Exception as err:  # a clear refusal is acceptable
        print(f"{type(err).__name__}: {err}")
        assert str(path) in str(err) or path.name in str(err), f"refused without naming the file: {err}"
        return
    _assert_exact_tail(got, ref, 0, case)


class _RetuneAt(L.Callback):
    """At global step 4, set another weight decay, betas and eps in the optimizer's param groups (a user's mid-run
    retuning); they are part of the optimizer state a checkpoint saves."""

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 4:
            for group in trainer.optimizers[0].param_groups:
                group.update(weight_decay=0.3, betas=(0.8, 0.95), eps=1e-6)


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
def test_retuned_hyperparameters_survive_the_checkpoint(fmt: str, tmp_path: Path) -> None:
    """Hyperparameters changed mid-run travel in the checkpoint's param groups: resuming (without the callback)
    continues with them, as plain Lightning does from its own file."""
    _fit("auto", ckpt_dir=tmp_path / "plain", max_epochs=1, callbacks=(_RetuneAt(),))
    _fit(PatrickStarStrategy(checkpoint=fmt), ckpt_dir=tmp_path / "pstar", max_epochs=1, callbacks=(_RetuneAt(),))
    if fmt == "consolidated":
        got_file, want_file = _load(tmp_path / "pstar" / "epoch=0.ckpt"), _load(tmp_path / "plain" / "epoch=0.ckpt")
        _assert_same_file(got_file, want_file, "retuned epoch=0.ckpt")
    ref = _fit("auto", ckpt_path=tmp_path / "plain" / "epoch=0.ckpt", seed=999, max_epochs=2)
    got = _fit(
        PatrickStarStrategy(checkpoint=fmt), ckpt_path=tmp_path / "pstar" / "epoch=0.ckpt", seed=999, max_epochs=2
    )
    group = got.trainer.optimizers[0].param_groups[0]
    assert (group["weight_decay"], group["betas"], group["eps"]) == (0.3, (0.8, 0.95), 1e-6), group
    _assert_exact_tail(got, ref, 0, f"retuned ({fmt})")


_CPU_EMBEDDING_LOST = (
    "checkpoint='sharded' with cpu_embedding=True writes the host-resident embedding (model.wpe.weight) nowhere:"
    " not in the store, not in meta.pt's state_dict"
)


def test_sharded_checkpoint_with_cpu_embedding_resumes_exactly(plain_straight: Any, tmp_path: Path) -> None:
    """``cpu_embedding=True`` (the untied position embedding lives on the host, outside the chunks), saved and
    resumed sharded in the same configuration: plain Lightning's straight run, bit for bit."""
    plain, _ = plain_straight
    options = {"checkpoint": "sharded", "cpu_embedding": True}
    _fit(PatrickStarStrategy(**options), ckpt_dir=tmp_path, max_epochs=1)
    resumed = _fit(PatrickStarStrategy(**options), ckpt_path=tmp_path / "epoch=0.ckpt", seed=999)
    _assert_exact_tail(resumed, plain, BATCHES, "sharded with cpu_embedding")


def test_sharded_checkpoint_with_cpu_embedding_consolidates(plain_straight: Any, tmp_path: Path) -> None:
    from lightning_pstar.checkpoint import consolidate

    _, plain_dir = plain_straight
    _fit(PatrickStarStrategy(checkpoint="sharded", cpu_embedding=True), ckpt_dir=tmp_path, max_epochs=1)
    consolidate(tmp_path / "epoch=0.ckpt", tmp_path / "out.ckpt")
    _assert_same_file(_load(tmp_path / "out.ckpt"), _load(plain_dir / "epoch=0.ckpt"), "consolidated")


def test_fabric_sharded_checkpoint_with_cpu_embedding_round_trips(tmp_path: Path) -> None:
    options = {"checkpoint": "sharded", "cpu_embedding": True}
    fabric, model, opt = _fabric(PatrickStarFabricStrategy(**options))
    _steps(fabric, model, opt, batches(1, 0), 2)
    fabric.save(tmp_path / "ckpt", {"model": model, "optimizer": opt})
    saved = _fabric_weights(fabric, model)
    fabric2, model2, opt2 = _fabric(PatrickStarFabricStrategy(**options))
    _steps(fabric2, model2, opt2, batches(1, 0), 5)  # somewhere else first
    fabric2.load(tmp_path / "ckpt", {"model": model2, "optimizer": opt2})
    assert_states_equal(_fabric_weights(fabric2, model2), saved, what="weights after the load")


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
def test_bf16_checkpoint_keeps_frozen_weights_exact(fmt: str, tmp_path: Path) -> None:
    """bf16-mixed with ``frozen_master=True`` (the default): the frozen Linear, never trained, is in the file
    (consolidated, or the sharded directory consolidated) with its exact fp32 initial values, as plain Lightning's."""
    from lightning_pstar.checkpoint import consolidate

    _fit(PatrickStarStrategy(checkpoint=fmt), ckpt_dir=tmp_path, max_epochs=1, precision="bf16-mixed")
    path = tmp_path / "epoch=0.ckpt"
    if fmt == "sharded":
        consolidate(path, tmp_path / "out.ckpt")
        path = tmp_path / "out.ckpt"
    saved = _load(path)["state_dict"]
    initial = TinyLM(optim=SPEC).state_dict()
    for key in ("model.frozen.weight", "model.frozen.bias"):
        assert saved[key].dtype == torch.float32 and torch.equal(saved[key], initial[key]), f"{fmt}: {key} changed"


@pytest.mark.parametrize("direction", ["pstar_to_plain", "plain_to_pstar"])
def test_unused_parameters_cross_strategies(direction: str, tmp_path: Path) -> None:
    """A trainable Linear that forward never calls gets no gradient, so torch keeps no optimizer state for it (and
    reused blocks get summed gradients): the files match and cross strategies both ways, bit for bit."""
    kwargs = {"unused": True, "reuse_block": True}
    plain = _fit("auto", ckpt_dir=tmp_path / "plain", module=TinyLM(optim=SPEC, **kwargs))
    _fit(PatrickStarStrategy(), ckpt_dir=tmp_path / "pstar", max_epochs=1, module=TinyLM(optim=SPEC, **kwargs))
    _assert_same_file(_load(tmp_path / "pstar" / "epoch=0.ckpt"), _load(tmp_path / "plain" / "epoch=0.ckpt"), "file")
    ckpt = tmp_path / ("pstar" if direction == "pstar_to_plain" else "plain") / "epoch=0.ckpt"
    strategy = "auto" if direction == "pstar_to_plain" else PatrickStarStrategy()
    resumed = _fit(strategy, ckpt_path=ckpt, module=TinyLM(optim=SPEC, seed=999, **kwargs))
    _assert_exact_tail(resumed, plain, BATCHES, direction)


class _SaveAtTheEnd(L.Callback):
    def __init__(self, hook: str, path: Path) -> None:
        self.hook, self.path = hook, path

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.hook == "on_train_end":
            trainer.save_checkpoint(self.path)

    def on_fit_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if self.hook == "on_fit_end":
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize(
    ("hook", "hand_back"),
    [
        ("on_train_end", True),
        ("on_train_end", False),
        ("on_fit_end", True),
        pytest.param("on_fit_end", False),
    ],
)
def test_save_checkpoint_at_the_end_of_fit(hook: str, hand_back: bool, tmp_path: Path) -> None:
    """A save from ``on_train_end`` or ``on_fit_end`` (the last step's tail possibly in flight with
    ``"next_forward"``): plain Lightning's file; with ``hand_back_weights=False`` right, or refused naming why."""
    _fit("auto", max_epochs=1, callbacks=(_SaveAtTheEnd(hook, tmp_path / "plain.ckpt"),))
    strategy = PatrickStarStrategy(
        optimizer_placement="host", optimizer_overlap="next_forward", chunk_size=4096, hand_back_weights=hand_back
    )
    try:
        _fit(strategy, max_epochs=1, callbacks=(_SaveAtTheEnd(hook, tmp_path / "pstar.ckpt"),))
    except Exception as err:
        assert "hand_back_weights" in str(err), f"refused without naming hand_back_weights: {err}"
        return
    got, want = _load(tmp_path / "pstar.ckpt"), _load(tmp_path / "plain.ckpt")
    shapes = {k: tuple(v.shape) for k, v in got["state_dict"].items()}
    assert shapes == {k: tuple(v.shape) for k, v in want["state_dict"].items()}, f"saved shapes {shapes}"
    _assert_same_file(got, want, f"{hook} (hand_back_weights={hand_back})")


@pytest.mark.parametrize("resumed", ["sgd", "adam", "sgd_no_momentum"])
def test_sharded_checkpoint_of_another_optimizer_refused_before_any_change(resumed: str, tmp_path: Path) -> None:
    """A sharded AdamW checkpoint resumed by a module with SGD, Adam (coupled weight decay), or SGD without
    momentum: refused naming the file before the weights change, or (where torch would accept the state) resumed
    as plain Lightning resumes the consolidated file."""
    _fit(PatrickStarStrategy(checkpoint="sharded"), ckpt_dir=tmp_path / "s", max_epochs=1)
    _fit(PatrickStarStrategy(), ckpt_dir=tmp_path / "c", max_epochs=1)
    spec = {
        "sgd": OptimSpec(name="sgd", lr=0.1, momentum=0.9),
        "adam": OptimSpec(name="adam", weight_decay=0.1),
        "sgd_no_momentum": OptimSpec(name="sgd", lr=0.1),
    }[resumed]
    module = TinyLM(optim=spec, seed=999)
    before = {k: v.detach().clone() for k, v in module.state_dict().items()}
    path = tmp_path / "s" / "epoch=0.ckpt"
    try:
        got = _fit(PatrickStarStrategy(checkpoint="sharded"), ckpt_path=path, max_epochs=2, module=module)
    except Exception as err:
        message = f"{type(err).__name__}: {err}"
        print(message)
        assert module.training_steps_run == 0
        assert_states_equal({k: v.detach().clone() for k, v in module.state_dict().items()}, before, what="weights")
        assert path.name in message, f"the error does not name the file: {message}"
        return
    ref = _fit("auto", ckpt_path=tmp_path / "c" / "epoch=0.ckpt", max_epochs=2, module=TinyLM(optim=spec, seed=999))
    _assert_exact_tail(got, ref, 0, f"sharded AdamW file resumed by {resumed}")
