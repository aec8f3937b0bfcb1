"""Adversarial tests for the disk tier: settings, failures and training features the parity tests of
``test_disk_tier.py`` do not combine with it. References: the same run without a disk tier (a roomy host budget)."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarStrategy
from lightning_pstar.checkpoint import consolidate
from lightning_pstar.planning.requirements import MemoryBudgetError
from lightning_pstar.runtime.outside_writes import OutsideWriteError
from lightning_pstar.runtime.state import Tier
from tests.helpers import TinyLM, assert_runs_bitwise, assert_states_equal
from tests.helpers.data import make_loader
from tests.helpers.fabric_loop import LoopSpec, train
from tests.helpers.runs import OptimSpec, fit_steps

BASE = {"optimizer_placement": "host", "chunk_size": 4096, "device_memory_limit": "64MiB", "optimizer_overlap": "off"}
ROOMY = "64MiB"
TIGHT = "640KiB"
STEPS = 3


def _strategy(disk: Path | None, host: str, **options: Any) -> PatrickStarStrategy:
    extra = {"disk_path": str(disk)} if disk is not None else {}
    return PatrickStarStrategy(**{**BASE, **options}, host_memory_limit=host, **extra)


class OnDisk(L.Callback):
    on_disk = 0

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        manager = trainer.strategy._manager  # type: ignore[attr-defined]
        self.on_disk = sum(1 for f in manager.families if manager.residency.optimizer_tier_of(f) is Tier.DISK)


def test_disk_path_that_is_a_file_refused_at_setup(tmp_path: Path) -> None:
    afile = tmp_path / "not_a_dir"
    afile.write_bytes(b"keep me")
    with pytest.raises((ValueError, NotADirectoryError), match="disk_path"):
        fit_steps(TinyLM(), _strategy(afile, TIGHT), steps=STEPS)
    assert afile.read_bytes() == b"keep me", "the file given as disk_path is left untouched"
    assert sorted(os.listdir(tmp_path)) == ["not_a_dir"]


def test_disk_limit_without_disk_path_warns(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="disk_memory_limit"):
        fit_steps(TinyLM(), _strategy(None, ROOMY, disk_memory_limit="1MiB"), steps=1)


class RaiseAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("user callback failed")


@pytest.mark.parametrize("overlap", ["off", "next_forward"])
def test_exception_mid_run_removes_run_dir_and_next_fit_is_exact(tmp_path: Path, overlap: str) -> None:
    """A callback raising after the second step: the run directory goes; a second fit in the same process (same
    disk_path) is bitwise the run without disk tier."""
    with pytest.raises(RuntimeError, match="user callback failed"):
        fit_steps(TinyLM(), _strategy(tmp_path, TIGHT, optimizer_overlap=overlap), callbacks=[RaiseAt(2)], steps=STEPS)
    assert os.listdir(tmp_path) == [], "no run directory left after an exception"
    peek = OnDisk()
    got = fit_steps(TinyLM(), _strategy(tmp_path, TIGHT, optimizer_overlap=overlap), callbacks=[peek], steps=STEPS)
    want = fit_steps(TinyLM(), _strategy(None, ROOMY), steps=STEPS)
    assert peek.on_disk > 0
    assert_runs_bitwise(got, want, f"after a failed fit ({overlap})")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("overlap", ["off", "pipeline", "next_forward", "auto"])
def test_weight_decay_cosine_schedule_bitwise(tmp_path: Path, overlap: str) -> None:
    """AdamW with weight decay and a per-step cosine LR (the LR read at each disk family's step)."""
    optim = OptimSpec(weight_decay=0.1, cosine_t_max=4, lr=1e-2)
    peek = OnDisk()
    got = fit_steps(
        TinyLM(optim=optim),
        _strategy(tmp_path, TIGHT, optimizer_overlap=overlap),
        precision="bf16-mixed",
        callbacks=[peek],
        steps=4,
    )
    want = fit_steps(TinyLM(optim=optim), _strategy(None, ROOMY), precision="bf16-mixed", steps=4)
    assert peek.on_disk > 0
    assert_runs_bitwise(got, want, f"wd+cosine {overlap}")
    assert os.listdir(tmp_path) == []


class ValLM(TinyLM):
    def val_dataloader(self) -> Any:
        return make_loader(n_seq=4)


def test_validation_every_step_bitwise(tmp_path: Path) -> None:
    """Validation after every training step (forward without optimizer step, between disk steps)."""

    def run(disk: Path | None, host: str) -> Any:
        return fit_steps(
            ValLM(),
            _strategy(disk, host, optimizer_overlap="next_forward"),
            precision="bf16-mixed",
            steps=STEPS,
            val_check_interval=1,
            limit_val_batches=1,
            num_sanity_val_steps=0,
        )

    got, want = run(tmp_path, TIGHT), run(None, ROOMY)
    assert_runs_bitwise(got, want, "validation between steps")
    assert got.trainer.callback_metrics["val_loss"].item() == want.trainer.callback_metrics["val_loss"].item()
    assert os.listdir(tmp_path) == []


class FrozenLM(TinyLM):
    def configure_model(self) -> None:
        super().configure_model()
        assert self.model is not None
        for name, p in self.model.named_parameters():
            if "wpe" in name:
                p.requires_grad_(False)


def test_frozen_params_bitwise(tmp_path: Path) -> None:
    peek = OnDisk()
    got = fit_steps(FrozenLM(), _strategy(tmp_path, TIGHT), precision="bf16-mixed", callbacks=[peek], steps=STEPS)
    want = fit_steps(FrozenLM(), _strategy(None, ROOMY), precision="bf16-mixed", steps=STEPS)
    assert peek.on_disk > 0
    assert_runs_bitwise(got, want, "frozen wpe")
    assert torch.equal(got.final["model.wpe.weight"], want.final["model.wpe.weight"])
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("overlap", ["off", "auto"])
def test_16_mixed_accumulate_clip_by_value_bitwise(tmp_path: Path, overlap: str) -> None:
    """fp16 loss scaling (first steps overflow and are skipped) with accumulation and clipping by value."""
    from lightning_pstar.precision import PatrickStarPrecision

    kw: dict[str, Any] = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}
    peek = OnDisk()
    got = fit_steps(
        TinyLM(),
        _strategy(tmp_path, TIGHT, optimizer_overlap=overlap),
        plugins=[PatrickStarPrecision("16-mixed")],
        callbacks=[peek],
        steps=STEPS,
        **kw,
    )
    want = fit_steps(TinyLM(), _strategy(None, ROOMY), plugins=[PatrickStarPrecision("16-mixed")], steps=STEPS, **kw)
    assert peek.on_disk > 0
    assert_runs_bitwise(got, want, f"16-mixed accumulate clip-by-value {overlap}")
    assert os.listdir(tmp_path) == []


class HalveWeightsAt(L.Callback):
    """At the end of a step: read the module's state_dict, halve every float tensor and load it back."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            sd = {k: v * 0.5 if v.is_floating_point() else v for k, v in pl_module.state_dict().items()}
            pl_module.load_state_dict(sd)


@pytest.mark.parametrize(("precision", "overlap"), [("32-true", "off"), ("32-true", "auto")])
def test_load_state_dict_between_steps_reaches_masters_on_disk(tmp_path: Path, precision: str, overlap: str) -> None:
    """load_state_dict mid-run (32-true: the parameter is its fp32 weight) with some optimizer states on disk."""
    peek = OnDisk()
    got = fit_steps(
        TinyLM(),
        _strategy(tmp_path, TIGHT, optimizer_overlap=overlap),
        precision=precision,
        callbacks=[HalveWeightsAt(1), peek],
        steps=STEPS,
    )
    want = fit_steps(TinyLM(), _strategy(None, ROOMY), precision=precision, callbacks=[HalveWeightsAt(1)], steps=STEPS)
    assert peek.on_disk > 0
    assert_runs_bitwise(got, want, f"load_state_dict mid-run {precision}")
    assert os.listdir(tmp_path) == []


def test_predict_after_fit_with_disk_tier(tmp_path: Path) -> None:
    """trainer.predict on the fitted trainer: the predictions of the run without disk tier."""

    def run(disk: Path | None, host: str) -> list[torch.Tensor]:
        result = fit_steps(TinyLM(), _strategy(disk, host), precision="bf16-mixed", steps=STEPS)
        out = result.trainer.predict(result.module, dataloaders=make_loader(n_seq=4))
        assert out is not None
        return [t.float() for t in out]  # type: ignore[union-attr]

    got, want = run(tmp_path, TIGHT), run(None, ROOMY)
    assert len(got) == len(want) > 0
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("overlap", ["off", "auto"])
def test_load_state_dict_between_steps_mixed_refused_and_undone(tmp_path: Path, overlap: str) -> None:
    """bf16-mixed: load_state_dict after setup is refused (documented); the write is undone, so the weights handed
    back after the failed run equal those of the same failed run without disk tier, and the run directory goes."""

    def run(disk: Path | None, host: str) -> dict[str, torch.Tensor]:
        module = TinyLM()
        with pytest.raises(OutsideWriteError, match="load_state_dict.*HINT"):
            fit_steps(
                module,
                _strategy(disk, host, optimizer_overlap=overlap),
                precision="bf16-mixed",
                callbacks=[HalveWeightsAt(1)],
                steps=STEPS,
            )
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    got, want = run(tmp_path, TIGHT), run(None, ROOMY)
    assert_states_equal(got, want, what=f"weights after the refused load_state_dict ({overlap})")
    assert os.listdir(tmp_path) == []


class ChdirAt(L.Callback):
    def __init__(self, step: int, where: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.step, self.where, self.monkeypatch = step, where, monkeypatch

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.monkeypatch.chdir(self.where)


def test_relative_disk_path_survives_chdir_and_keeps_user_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """disk_path given relative to the working directory, which the user changes mid-run: the run still reads its
    files, and leaves the user's own files (one named like a run directory too) untouched."""
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "user.txt").write_text("mine")
    (disk / "pstar-run-0").mkdir()
    (disk / "pstar-run-0" / "data").write_text("also mine")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(tmp_path)
    peek = OnDisk()
    got = fit_steps(
        TinyLM(),
        _strategy(Path("disk"), TIGHT, optimizer_overlap="auto"),
        precision="bf16-mixed",
        callbacks=[ChdirAt(1, elsewhere, monkeypatch), peek],
        steps=STEPS,
    )
    want = fit_steps(TinyLM(), _strategy(None, ROOMY), precision="bf16-mixed", steps=STEPS)
    assert peek.on_disk > 0
    assert_runs_bitwise(got, want, "relative disk_path, chdir mid-run")
    assert sorted(os.listdir(disk)) == ["pstar-run-0", "user.txt"]
    assert (disk / "pstar-run-0" / "data").read_text() == "also mine"
    assert os.listdir(elsewhere) == []


@pytest.mark.parametrize("limit", [-1, 0, "lots", 1.5])
def test_bad_disk_memory_limit_refused_naming_option(tmp_path: Path, limit: Any) -> None:
    module = TinyLM()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises((ValueError, TypeError), match="disk_memory_limit|disk_limit"):
        fit_steps(module, _strategy(tmp_path, TIGHT, disk_memory_limit=limit), steps=STEPS)
    assert_states_equal(module.state_dict(), before, what="weights after a refused setting")
    assert os.listdir(tmp_path) == []


class TwoGroupsLM(TinyLM):
    """The usual decay / no-decay param groups, with different learning rates."""

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-2}], lr=3e-3
        )


@pytest.mark.parametrize("overlap", ["off", "pipeline", "next_forward"])
def test_two_param_groups_bitwise(tmp_path: Path, overlap: str) -> None:
    peek = OnDisk()
    got = fit_steps(
        TwoGroupsLM(),
        _strategy(tmp_path, TIGHT, optimizer_overlap=overlap),
        precision="bf16-mixed",
        callbacks=[peek],
        steps=STEPS,
    )
    want = fit_steps(TwoGroupsLM(), _strategy(None, ROOMY), precision="bf16-mixed", steps=STEPS)
    assert peek.on_disk > 0
    assert_runs_bitwise(got, want, f"two param groups {overlap}")
    assert os.listdir(tmp_path) == []


class SaveAt(L.Callback):
    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _load(path: Path, tmp: Path) -> dict[str, Any]:
    if path.is_dir():
        out = tmp / f"{path.name}.consolidated"
        consolidate(path, out)
        path = out
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
@pytest.mark.parametrize("overlap", ["pipeline", "next_forward", "auto"])
def test_mid_run_save_with_step_in_flight(tmp_path: Path, overlap: str, fmt: str) -> None:
    """trainer.save_checkpoint right after optimizer.step() returned (the step of disk families may still be in
    flight): the checkpoint equals that of the serial run without disk tier, and the run continues bitwise."""
    disk = tmp_path / "disk"
    disk.mkdir()
    got = fit_steps(
        TinyLM(),
        _strategy(disk, TIGHT, optimizer_overlap=overlap, checkpoint=fmt),
        precision="bf16-mixed",
        callbacks=[SaveAt(2, tmp_path / "a.ckpt")],
        steps=STEPS,
    )
    want = fit_steps(
        TinyLM(),
        _strategy(None, ROOMY, checkpoint=fmt),
        precision="bf16-mixed",
        callbacks=[SaveAt(2, tmp_path / "b.ckpt")],
        steps=STEPS,
    )
    assert_runs_bitwise(got, want, f"save mid-run {overlap} {fmt}")
    a, b = _load(tmp_path / "a.ckpt", tmp_path), _load(tmp_path / "b.ckpt", tmp_path)
    assert_states_equal(a["state_dict"], b["state_dict"], what="saved weights")
    sa, sb = a["optimizer_states"][0]["state"], b["optimizer_states"][0]["state"]
    assert_states_equal(
        {f"{i}/{k}": v for i, e in sa.items() for k, v in e.items() if torch.is_tensor(v)},
        {f"{i}/{k}": v for i, e in sb.items() for k, v in e.items() if torch.is_tensor(v)},
        what="saved optimizer state",
    )
    assert os.listdir(disk) == []


class FailingStepLM(TinyLM):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise RuntimeError("bad batch")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("overlap", ["off", "next_forward"])
def test_exception_in_training_step_hands_back_exact_weights(tmp_path: Path, overlap: str) -> None:
    """training_step raises on the third batch (under next_forward the second step of the disk families is still in
    flight then): the weights handed back are those of the same failed run without disk tier, serial."""

    def run(disk: Path | None, host: str, mode: str) -> dict[str, torch.Tensor]:
        module = FailingStepLM()
        with pytest.raises(RuntimeError, match="bad batch"):
            fit_steps(module, _strategy(disk, host, optimizer_overlap=mode), precision="bf16-mixed", steps=STEPS)
        return {k: v.detach().clone() for k, v in module.state_dict().items()}

    got, want = run(tmp_path, TIGHT, overlap), run(None, ROOMY, "off")
    untouched = TinyLM().state_dict()
    assert not torch.equal(want["model.wpe.weight"], untouched["model.wpe.weight"]), "two steps were taken"
    assert_states_equal(got, want, what=f"weights after a failed training_step ({overlap})")
    assert os.listdir(tmp_path) == []


def test_disk_budget_boundary(tmp_path: Path) -> None:
    """The disk budget the run reports it uses is enough; one byte less is refused at setup, naming the option."""

    class Report(L.Callback):
        used = 0

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.used = trainer.strategy.memory_report().disk_chunk_bytes  # type: ignore[attr-defined]

    report = Report()
    fit_steps(TinyLM(), _strategy(tmp_path, TIGHT), callbacks=[report], steps=1)
    assert report.used > 0
    fit_steps(TinyLM(), _strategy(tmp_path, TIGHT, disk_memory_limit=report.used), steps=1)
    with pytest.raises(MemoryBudgetError, match="disk"):
        fit_steps(TinyLM(), _strategy(tmp_path, TIGHT, disk_memory_limit=report.used - 1), steps=1)
    assert os.listdir(tmp_path) == []


def _fabric_run(disk: Path | None, host: str, **spec: Any) -> Any:
    extra = {"disk_path": str(disk)} if disk is not None else {}
    strategy = PatrickStarFabricStrategy(
        **{**BASE, "optimizer_overlap": spec.pop("overlap", "off")}, host_memory_limit=host, **extra
    )
    result = train(LoopSpec(strategy=strategy, **spec))
    return result, strategy.memory_report().optimizer_tier


@pytest.mark.parametrize("overlap", ["off", "next_forward"])
def test_fabric_groups_scheduler_eval_clip_value_bitwise(tmp_path: Path, overlap: str) -> None:
    spec = {"precision": "bf16-mixed", "steps": STEPS, "two_groups": True, "scheduler": True, "eval_between": True}
    (got, tier), (want, _) = (
        _fabric_run(tmp_path, TIGHT, overlap=overlap, clip_val=0.01, **spec),
        _fabric_run(None, ROOMY, clip_val=0.01, **spec),
    )
    assert "disk" in tier
    assert got.losses == want.losses and got.eval_losses == want.eval_losses and got.lrs == want.lrs
    assert_states_equal(got.state, want.state, what=f"fabric disk {overlap}")


def test_fabric_save_on_disk_tier_resume_without(tmp_path: Path) -> None:
    """A Fabric checkpoint saved by a run with families on disk, loaded by a run without disk tier: it continues
    exactly as the uninterrupted run."""
    disk = tmp_path / "disk"
    disk.mkdir()
    ckpt = tmp_path / "ckpt"
    spec = {"precision": "bf16-mixed", "steps": 4}
    full, _ = _fabric_run(None, ROOMY, **spec)
    saver, tier = _fabric_run(disk, TIGHT, save_at=2, checkpoint=ckpt, **spec)
    assert "disk" in tier
    assert len(os.listdir(disk)) == 1, "Fabric never tears a strategy down: the run directory lives on with it"
    saver.fabric.strategy.teardown()
    assert os.listdir(disk) == [], "teardown removes the run directory"
    resumed, _ = _fabric_run(None, ROOMY, resume_from=ckpt, **spec)
    assert resumed.losses == full.losses[2:]
    assert_states_equal(resumed.state, full.state, what="resumed off the disk tier")


def test_fabric_run_directory_goes_with_the_run(tmp_path: Path) -> None:
    """Fabric never tears a strategy down (docs/fabric.md); the run directory's weakref finalizer
    (runtime/run_directory.py) is what removes it once the run is dropped. Two Fabric runs in one process must not
    leave the first one's files behind."""
    run, tier = _fabric_run(tmp_path, TIGHT, precision="bf16-mixed", steps=2)
    assert "disk" in tier and len(os.listdir(tmp_path)) == 1
    del run
    gc.collect()
    assert os.listdir(tmp_path) == [], "the run directory goes with the last reference to the Fabric run"
