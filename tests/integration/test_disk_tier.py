"""The disk tier wired to the chunks: families whose optimizer side the host budget cannot hold keep it in files under
``disk_path`` ([Note: disk families] in ``runtime/disk_tier.py``), and placement never changes the arithmetic.

Each parity test trains the same seed and data twice with the optimizer side on the host
(``optimizer_placement="host"``): once with a host budget that holds it all, once with a host budget that forces
some families to disk. Losses, weights and optimizer states must be bitwise equal (``torch.equal``).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pstar import PatrickStarFabricStrategy, PatrickStarStrategy
from lightning_pstar.checkpoint import consolidate
from lightning_pstar.planning.requirements import MemoryBudgetError
from lightning_pstar.precision import PatrickStarPrecision
from lightning_pstar.report import MemoryReport
from lightning_pstar.runtime.disk import DiskIOError
from lightning_pstar.runtime.state import Tier
from tests.helpers import TinyLM, assert_runs_bitwise, assert_states_equal, optimizer_state
from tests.helpers.data import make_loader
from tests.helpers.fabric_loop import LoopSpec, train
from tests.helpers.models import SEED
from tests.helpers.runs import FitResult, OptimSpec, fit, fit_steps

BASE = {"optimizer_placement": "host", "chunk_size": 4096, "device_memory_limit": "64MiB", "optimizer_overlap": "off"}
ROOMY = "64MiB"  # holds every family's optimizer side
TIGHT = "640KiB"  # TinyLM (13 families of 4096 elements): some families go to disk, some stay on the host
ALL_ON_DISK = "290KiB"  # bf16-mixed: every family's optimizer side on disk
STEPS = 3


class Peek(L.Callback):
    """The memory report and the families on disk at the end of training (while the engine still runs)."""

    report: MemoryReport | None = None
    on_disk: int = 0
    families: int = 0
    jobs: int = 0  # host steps run by the step pipeline

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        self.report = strategy.memory_report()  # type: ignore[attr-defined]
        manager = strategy._manager  # type: ignore[attr-defined]
        self.families = sum(1 for f in manager.families if f.trainable)
        self.on_disk = sum(1 for f in manager.families if manager.residency.optimizer_tier_of(f) is Tier.DISK)
        self.jobs = manager.pipeline.times.jobs


def _strategy(disk: Path | None, host: str, **options: Any) -> PatrickStarStrategy:
    extra = {"disk_path": str(disk)} if disk is not None else {}
    return PatrickStarStrategy(**{**BASE, **options}, host_memory_limit=host, **extra)


def _fit(disk: Path | None, host: str, precision: str, optim: OptimSpec | None = None, **kw: Any) -> FitResult:
    options = kw.pop("options", {})
    return fit_steps(TinyLM(optim=optim), _strategy(disk, host, **options), precision=precision, steps=STEPS, **kw)


@pytest.mark.parametrize(
    ("precision", "trainer_kwargs"),
    [
        ("32-true", {}),
        ("bf16-mixed", {}),
        ("bf16-mixed", {"gradient_clip_val": 0.5}),
        ("32-true", {"accumulate_grad_batches": 2}),
        ("bf16-mixed", {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}),
    ],
    ids=["32-true", "bf16", "bf16-clip", "32-true-accumulate", "bf16-accumulate-clip"],
)
def test_trainer_bitwise_with_disk_tier(tmp_path: Path, precision: str, trainer_kwargs: dict[str, Any]) -> None:
    peek = Peek()
    got = _fit(tmp_path, TIGHT, precision, callbacks=[peek], **trainer_kwargs)
    want = _fit(None, ROOMY, precision, **trainer_kwargs)
    assert 0 < peek.on_disk < peek.families, "the tight host budget must put some families, not all, on disk"
    report = peek.report
    assert report is not None and "disk" in report.optimizer_tier
    assert report.disk_families == peek.on_disk and report.disk_chunk_bytes > 0
    if "accumulate_grad_batches" not in trainer_kwargs:  # each disk family read and written once per iteration
        assert report.disk_read_bytes_per_iteration == report.disk_chunk_bytes
        assert report.disk_written_bytes_per_iteration == report.disk_chunk_bytes
    assert report.disk_read_gbps > 0 and report.disk_write_gbps > 0
    assert "chunks on disk" in str(report)
    assert_runs_bitwise(got, want, f"{precision} {trainer_kwargs}")
    assert os.listdir(tmp_path) == [], "the run directory is removed at the end of the run"


def test_16_mixed_bitwise_with_disk_tier(tmp_path: Path) -> None:
    """fp16 loss scaling (its overflow check reads every gradient first, skipped steps included) with the fp32
    masters and optimizer states of some families on disk: the run without a disk tier, bit for bit."""
    peek = Peek()
    got = _fit(tmp_path, TIGHT, "16-mixed", callbacks=[peek], plugins=[PatrickStarPrecision("16-mixed")])
    want = _fit(None, ROOMY, "16-mixed", plugins=[PatrickStarPrecision("16-mixed")])
    assert 0 < peek.on_disk < peek.families
    assert_runs_bitwise(got, want, "16-mixed")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("overlap", ["pipeline", "next_forward"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_pipelined_disk_step_bitwise_serial(tmp_path: Path, precision: str, overlap: str) -> None:
    """The pipelined step (read k+1 while Adam runs on k and k-1 is written back) against the serial disk step."""
    peek = Peek()
    got = _fit(tmp_path, TIGHT, precision, callbacks=[peek], options={"optimizer_overlap": overlap})
    want = _fit(tmp_path, TIGHT, precision, options={"optimizer_overlap": "off"})
    assert peek.on_disk > 3 and peek.jobs > 0, "more disk families than buffer sets, stepped by the pipeline"
    assert_runs_bitwise(got, want, f"pipelined {precision} {overlap}")
    assert os.listdir(tmp_path) == []


def test_sgd_momentum_bitwise_with_disk_tier(tmp_path: Path) -> None:
    """SGD with momentum (its buffer is the one optimizer state on disk; a wrong scale would show)."""
    sgd = OptimSpec(name="sgd", lr=0.05, momentum=0.9)
    got = _fit(tmp_path, TIGHT, "bf16-mixed", optim=sgd)
    want = _fit(None, ROOMY, "bf16-mixed", optim=sgd)
    assert_runs_bitwise(got, want, "sgd momentum")


@pytest.mark.parametrize(("precision", "clip", "accumulate"), [("32-true", None, 2), ("bf16-mixed", 0.5, 1)])
def test_fabric_bitwise_with_disk_tier(tmp_path: Path, precision: str, clip: float | None, accumulate: int) -> None:
    """(Fabric declares no accumulation at setup: in mixed precision its fp32 gradient sums come later, outside the
    setup's host figures, so the bf16 case does not accumulate under the tight budget.)"""

    def run(disk: Path | None, host: str) -> Any:
        extra = {"disk_path": str(disk)} if disk is not None else {}
        strategy = PatrickStarFabricStrategy(**BASE, host_memory_limit=host, **extra)
        spec = LoopSpec(strategy=strategy, precision=precision, steps=STEPS, accumulate=accumulate, clip_norm=clip)
        result = train(spec)
        tiers.append(strategy.memory_report().optimizer_tier)
        return result

    tiers: list[str] = []
    got, want = run(tmp_path, TIGHT), run(None, ROOMY)
    assert "disk" in tiers[0] and "disk" not in tiers[1], tiers
    assert got.losses == want.losses
    assert_states_equal(got.state, want.state, what=f"fabric {precision}")


def test_roomy_host_budget_uses_no_disk(tmp_path: Path) -> None:
    """disk_path set, but the host budget holds the optimizer side: nothing goes to disk (no run directory)."""
    peek = Peek()
    _fit(tmp_path, ROOMY, "32-true", callbacks=[peek])
    assert peek.on_disk == 0
    assert os.listdir(tmp_path) == []


def test_missing_disk_path_refused_at_setup(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="does not exist"):
        _fit(missing, TIGHT, "32-true")
    assert not missing.exists()


def test_disk_budget_too_small_refused_at_setup(tmp_path: Path) -> None:
    with pytest.raises(MemoryBudgetError, match="disk budget"):
        _fit(tmp_path, TIGHT, "32-true", options={"disk_memory_limit": "4KiB"})
    assert os.listdir(tmp_path) == [], "refused before the run directory was created"


def test_host_budget_too_small_even_with_disk(tmp_path: Path) -> None:
    """Every family on disk still leaves more than the host budget: refused with the disk-tier figures."""
    with pytest.raises(MemoryBudgetError, match="disk-tier buffers"):
        _fit(tmp_path, "200KiB", "32-true")
    assert os.listdir(tmp_path) == []


def test_hand_back_larger_than_ram_refused_at_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With families on disk, the end-of-run hand-back would bring every fp32 weight and optimizer state into host
    memory: where that exceeds the machine's RAM (here a machine of 64 KiB) the run is refused at setup, naming
    hand_back_weights=False; with it, the same run trains."""
    monkeypatch.setattr("lightning_pstar.runtime.budgets.host_ram_bytes", lambda: 64 << 10)
    with pytest.raises(MemoryBudgetError, match="hand_back_weights=False"):
        _fit(tmp_path, TIGHT, "32-true")
    assert os.listdir(tmp_path) == [], "refused before the run directory was created"
    result = _fit(tmp_path, TIGHT, "32-true", options={"hand_back_weights": False})
    assert len(result.losses) == STEPS
    assert os.listdir(tmp_path) == []


# ---- checkpoints and resume ------------------------------------------------------------------------------------


def _checkpointed(
    disk: Path | None, host: str, fmt: str, ckpt_dir: Path, ckpt_path: Path | None = None, peek: Peek | None = None
) -> FitResult:
    """Two epochs of two steps, a checkpoint at the end of each epoch (``epoch=<n>.ckpt``); resumed from
    ``ckpt_path`` when given (plain Lightning resumes bitwise from an epoch boundary)."""
    save = ModelCheckpoint(dirpath=ckpt_dir, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    return fit(
        TinyLM(seed=999 if ckpt_path is not None else SEED),
        strategy=_strategy(disk, host, checkpoint=fmt),
        loader=make_loader(n_seq=8),
        precision="bf16-mixed",
        max_steps=-1,
        max_epochs=2,
        enable_checkpointing=True,
        callbacks=[save] if peek is None else [save, peek],
        ckpt_path=str(ckpt_path) if ckpt_path is not None else None,
    )


def _saved(path: Path, tmp: Path) -> dict[str, Any]:
    if path.is_dir():
        out = tmp / f"{path.name}.consolidated"
        consolidate(path, out)
        path = out
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.parametrize("fmt", ["consolidated", "sharded"])
def test_checkpoint_and_resume_across_disk_tier(fmt: str, tmp_path: Path) -> None:
    """Saves read the disk families (the checkpoints equal those of the run without disk tier); a resume with the
    disk tier from a checkpoint of a run without it, the other way round, and with every family on disk from a
    checkpoint of a run with some there, continue bitwise."""
    disk = tmp_path / "disk"
    disk.mkdir()
    peek = Peek()
    with_disk = _checkpointed(disk, TIGHT, fmt, tmp_path / "a", peek=peek)
    assert 0 < peek.on_disk < peek.families
    without = _checkpointed(None, ROOMY, fmt, tmp_path / "b")
    assert_runs_bitwise(with_disk, without, "uninterrupted")
    for name in ("epoch=0.ckpt", "epoch=1.ckpt"):
        got, want = _saved(tmp_path / "a" / name, tmp_path), _saved(tmp_path / "b" / name, tmp_path)
        assert_states_equal(got["state_dict"], want["state_dict"], what=f"{name} weights")
        got_opt, want_opt = got["optimizer_states"][0]["state"], want["optimizer_states"][0]["state"]
        assert_states_equal(
            {f"{i}/{k}": v for i, e in got_opt.items() for k, v in e.items()},
            {f"{i}/{k}": v for i, e in want_opt.items() for k, v in e.items()},
            what=f"{name} optimizer state",
        )
    peek = Peek()
    onto_disk = _checkpointed(disk, TIGHT, fmt, tmp_path / "c", ckpt_path=tmp_path / "b" / "epoch=0.ckpt", peek=peek)
    assert peek.on_disk > 0
    off_disk = _checkpointed(None, ROOMY, fmt, tmp_path / "d", ckpt_path=tmp_path / "a" / "epoch=0.ckpt")
    split = Peek()
    other_split = _checkpointed(
        disk, ALL_ON_DISK, fmt, tmp_path / "e", ckpt_path=tmp_path / "a" / "epoch=0.ckpt", peek=split
    )
    assert split.on_disk == split.families > peek.on_disk, "every family on disk: a different split"
    resumed_runs = (
        (onto_disk, "resumed onto the disk tier"),
        (off_disk, "resumed without it"),
        (other_split, "resumed with another split"),
    )
    for resumed, what in resumed_runs:
        assert resumed.losses == without.losses[2:], what
        assert_states_equal(resumed.final, without.final, what=f"{what}: weights")
        assert_states_equal(optimizer_state(resumed), optimizer_state(without), what=f"{what}: optimizer state")
    assert os.listdir(disk) == []


# ---- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlap", ["off", "auto"])
def test_io_error_mid_step_names_the_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap: str) -> None:
    """A read that fails during an optimizer step raises naming the file; the run directory still goes."""

    def failing(fd: int, buffers: Any, offset: int) -> int:
        raise OSError(errno.EIO, "Input/output error")

    class Arm(L.Callback):
        """From the second step on, every read of the disk tier fails (only the disk tier reads with preadv)."""

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            if trainer.global_step == 1:
                monkeypatch.setattr(os, "preadv", failing)

    with pytest.raises(
        DiskIOError, match=r"read of .* bytes at offset 0 of .*pstar-run-.*/f\d+\.\w+\.pstar failed.*HINT"
    ):
        _fit(tmp_path, TIGHT, "bf16-mixed", callbacks=[Arm()], options={"optimizer_overlap": overlap})
    assert os.listdir(tmp_path) == []


def test_forward_writes_reach_a_master_on_disk(tmp_path: Path) -> None:
    """``nn.Embedding(max_norm=...)`` renormalises rows in place during forward: in mixed precision the write must
    reach the fp32 master, here on disk (every family is, under this budget)."""

    def renorm_lm() -> TinyLM:
        module = TinyLM()
        assert module.model is not None
        module.model.wpe.max_norm = 0.3
        return module

    peek = Peek()
    got = fit_steps(
        renorm_lm(), _strategy(tmp_path, ALL_ON_DISK), precision="bf16-mixed", steps=STEPS, callbacks=[peek]
    )
    want = fit_steps(renorm_lm(), _strategy(None, ROOMY), precision="bf16-mixed", steps=STEPS)
    assert peek.on_disk == peek.families
    assert_runs_bitwise(got, want, "forward writes")
