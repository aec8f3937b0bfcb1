"""Adversarial two-rank checks of sharding and scheduling (one launch of two gloo ranks).

- Every ``optimizer_overlap`` mode ("pipeline", "next_forward", "auto") with the host-side step, AdamW with
  weight decay, a cosine schedule and ``accumulate_grad_batches=2`` at 2 ranks: same losses on every rank and the
  same checkpoint (weights and optimizer states) as the serial "off" run, bitwise. The existing pipeline test runs
  bf16-mixed without accumulation and never runs "next_forward"; here "next_forward" also runs in bf16-mixed.
- Placement never changes the arithmetic: SGD with momentum (no scale invariance to hide a wrong factor),
  accumulation and clipping by the global norm at 2 ranks, with the step on the device and on the host, against
  Lightning's DDP (the global norm must be over every rank's shard).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from launch import WorkerFailure, run_ranks
from torch.utils.data import DataLoader
from workloads import RecordingModule, RunSpec, fit_in_rank, read_records

from lightning_pstar import PatrickStarStrategy
from tests.helpers.data import make_dataset
from tests.helpers.models import SEED, VOCAB
from tests.helpers.runs import quiet_trainer_options

pytestmark = pytest.mark.slow  # trains on spawned ranks

LOSS_RTOL = 1e-5
MODES = ("off", "pipeline", "next_forward", "auto")
STEPS = 6


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RunSpec]:
    out = str(tmp_path_factory.mktemp("shard_adv"))
    specs: dict[str, RunSpec] = {}
    common = {"out_dir": out, "steps": STEPS, "accumulate": 2, "chunk_size": 4096, "save_checkpoint": True}
    for mode in MODES:
        options = {"optimizer_placement": "host", "optimizer_overlap": mode}
        specs[mode] = RunSpec(tag=f"mode-{mode}", grad_hook=False, options=options, **common)
    for mode in ("off", "next_forward"):
        options = {"optimizer_placement": "host", "optimizer_overlap": mode}
        specs[f"bf16-{mode}"] = RunSpec(
            tag=f"bf16-{mode}", grad_hook=False, precision="bf16-mixed", options=options, **common
        )
    clip = {**common, "optim": "sgd", "clip": 0.5}
    specs["ddp"] = RunSpec(tag="ddp-sgd", strategy="ddp", **clip)
    for placement in ("device", "host"):
        options = {"optimizer_placement": placement, "optimizer_overlap": "off"}
        specs[placement] = RunSpec(tag=f"sgd-{placement}", options=options, **clip)
    run_ranks(fit_in_rank, 2, list(specs.values()))
    return specs


@pytest.mark.parametrize("mode", [*MODES[1:], "bf16-next_forward"])
def test_overlap_mode_bitwise_equal_to_serial_at_two_ranks(mode: str, runs: dict[str, RunSpec]) -> None:
    serial, spec = runs["bf16-off" if mode.startswith("bf16") else "off"], runs[mode]
    for rank, (a, b) in enumerate(zip(read_records(serial), read_records(spec), strict=True)):
        assert len(a["losses"]) == STEPS * 2
        assert b["losses"] == a["losses"], f"{mode}, rank {rank}"
    want = torch.load(serial.checkpoint_path, weights_only=True)
    got = torch.load(spec.checkpoint_path, weights_only=True)
    assert sorted(got["state_dict"]) == sorted(want["state_dict"])
    for name, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], value), (mode, name)
    want_opt, got_opt = want["optimizer_states"][0]["state"], got["optimizer_states"][0]["state"]
    assert sorted(got_opt) == sorted(want_opt) and want_opt
    for index, state in want_opt.items():
        for key, value in state.items():
            assert torch.equal(got_opt[index][key], value), (mode, index, key)


@pytest.mark.parametrize("placement", ["device", "host"])
def test_sgd_clip_accumulate_parity_with_ddp_per_placement(placement: str, runs: dict[str, RunSpec]) -> None:
    ref, spec = runs["ddp"], runs[placement]
    refs, gots = read_records(ref), read_records(spec)
    norms = refs[0]["grad_norms"]
    assert any(n > 0.5 for n in norms), f"clipping inactive: {norms}"
    for rank, (r, g) in enumerate(zip(refs, gots, strict=True)):
        assert len(g["losses"]) == len(r["losses"]) == STEPS * 2
        for i, (a, b) in enumerate(zip(g["losses"], r["losses"], strict=True)):
            assert abs(a - b) <= LOSS_RTOL * abs(b), f"{placement} rank {rank} micro-batch {i}: {a!r} vs ddp {b!r}"
    want = torch.load(ref.checkpoint_path, weights_only=True)["state_dict"]
    got = torch.load(spec.checkpoint_path, weights_only=True)["state_dict"]
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


# ---- checkpoints saved with one placement, resumed at 2 ranks with another ----------------------------------------

EPOCH_STEPS = 3
"""Optimizer steps per epoch; the full run trains 2 epochs, the first half saves at the end of epoch 0."""


class FixedScheduleModule(RecordingModule):
    """:class:`RecordingModule` whose cosine schedule spans the full 2-epoch run whatever ``max_epochs`` is."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=2 * EPOCH_STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@dataclass(kw_only=True)
class ResumeJob:
    tag: str
    out_dir: str
    epochs: int
    fmt: str
    options: dict[str, Any] = field(default_factory=dict)
    ckpt_in: str | None = None
    ckpt_out: str | None = None

    def weights(self, rank: int) -> dict[str, torch.Tensor]:
        return torch.load(Path(self.out_dir) / f"{self.tag}-w{rank}.pt", weights_only=True)


def resume_in_rank(rank: int, world_size: int, jobs: list[ResumeJob]) -> None:
    for job in jobs:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=PatrickStarStrategy(checkpoint=job.fmt, **{"chunk_size": 4096, **job.options}),
            max_epochs=job.epochs,
            limit_val_batches=0,
            **quiet_trainer_options(),
        )
        data = make_dataset(EPOCH_STEPS * 4 * world_size)
        loader = DataLoader(data, batch_size=4, shuffle=False)
        module = FixedScheduleModule(RunSpec(tag=job.tag, out_dir=job.out_dir, grad_hook=False))
        trainer.fit(module, loader, ckpt_path=job.ckpt_in)
        if job.ckpt_out is not None:
            trainer.save_checkpoint(job.ckpt_out)
        torch.save(module.state_dict(), Path(job.out_dir) / f"{job.tag}-w{trainer.global_rank}.pt")


RESUME_PLACEMENTS: dict[str, dict[str, Any]] = {
    "host-pipeline": {"optimizer_placement": "host", "optimizer_overlap": "pipeline"},
    "host-next_forward": {"optimizer_placement": "host", "optimizer_overlap": "next_forward"},
    "tight-device": {"device_memory_limit": "640KiB", "warmup_chunk_fraction": 0.5, "optimizer_placement": "auto"},
}


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ResumeJob]:
    out = tmp_path_factory.mktemp("resume_adv")
    device = {"optimizer_placement": "device", "optimizer_overlap": "off"}
    jobs: dict[str, ResumeJob] = {}
    for fmt in ("sharded", "consolidated"):
        ckpt = str(out / f"half-{fmt}.ckpt")
        jobs[f"full-{fmt}"] = ResumeJob(tag=f"full-{fmt}", out_dir=str(out), epochs=2, fmt=fmt, options=device)
        jobs[f"half-{fmt}"] = ResumeJob(
            tag=f"half-{fmt}", out_dir=str(out), epochs=1, fmt=fmt, options=device, ckpt_out=ckpt
        )
        for name, options in RESUME_PLACEMENTS.items():
            tag = f"resumed-{fmt}-{name}"
            jobs[tag] = ResumeJob(tag=tag, out_dir=str(out), epochs=2, fmt=fmt, options=options, ckpt_in=ckpt)
    run_ranks(resume_in_rank, 2, list(jobs.values()))
    return jobs


@pytest.mark.parametrize("placement", list(RESUME_PLACEMENTS))
@pytest.mark.parametrize("fmt", ["sharded", "consolidated"])
def test_resume_with_another_placement_continues_exactly(
    fmt: str, placement: str, resume_runs: dict[str, ResumeJob]
) -> None:
    """Saved at 2 ranks with every optimizer step on the device, resumed at 2 ranks with the step on the host
    (pipelined, next_forward) or under a device budget that keeps chunks on the host:
    the second epoch's losses and the final weights equal the uninterrupted device run's."""
    full, resumed = resume_runs[f"full-{fmt}"], resume_runs[f"resumed-{fmt}-{placement}"]
    for rank in range(2):
        want = json.loads(Path(full.out_dir, f"{full.tag}-rank{rank}.json").read_text())
        got = json.loads(Path(resumed.out_dir, f"{resumed.tag}-rank{rank}.json").read_text())
        assert want["global_step"] == got["global_step"] == 2 * EPOCH_STEPS
        tail = want["losses"][EPOCH_STEPS:]
        assert len(got["losses"]) == len(tail) == EPOCH_STEPS, got["losses"]
        if placement == "tight-device":
            report = got["memory_report"]
            assert report["host_chunk_bytes"] > 0 and report["device_memory_limit"] == 640 * 1024, report
        for i, (a, b) in enumerate(zip(got["losses"], tail, strict=True)):
            assert abs(a - b) <= 1e-6 * abs(b), f"rank {rank} step {EPOCH_STEPS + i}: resumed {a!r} vs full {b!r}"
        want_w, got_w = full.weights(rank), resumed.weights(rank)
        assert sorted(got_w) == sorted(want_w)
        for name, value in want_w.items():
            torch.testing.assert_close(got_w[name], value, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


# ---- uneven shards, a parameter smaller than the world size, frozen params; validate/predict after fit ----------


class UnevenNet(torch.nn.Module):
    """One wide embedding (most of the elements, so one rank owns far more than the other), tiny layers, a
    1-element gain (smaller than the world size), a 1-element bias and a frozen Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, 384)
        self.down = torch.nn.Linear(384, 8)
        self.gain = torch.nn.Parameter(torch.ones(1))
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(8, VOCAB)
        self.one = torch.nn.Linear(VOCAB, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.down(self.wte(idx))) * self.gain
        x = x + self.frozen(x)
        logits = self.head(x)
        return logits + self.one(logits)


class UnevenLM(L.LightningModule):
    def __init__(self, tag: str, out_dir: str) -> None:
        super().__init__()
        self.tag, self.out_dir = tag, out_dir
        torch.manual_seed(SEED)
        self.net = UnevenNet()
        self.losses: list[float] = []
        self.norms: list[float] = []

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x).reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.losses.append(float(loss.detach()))
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.tag == "ddp":  # the global norm Lightning clips by (PatrickStar keeps gradients in its chunks)
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).sum(dim=-1)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)


def uneven_in_rank(rank: int, world_size: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    for tag in ("ddp", "pstar"):
        strategy: Any = "ddp" if tag == "ddp" else PatrickStarStrategy(chunk_size=4096)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=strategy,
            max_steps=5,
            accumulate_grad_batches=2,
            gradient_clip_val=0.3,
            **quiet_trainer_options(),
        )
        module = UnevenLM(tag, out_dir)
        loader = DataLoader(make_dataset(5 * 2 * 4 * world_size), batch_size=4, shuffle=False)
        trainer.fit(module, loader)
        val_loader = DataLoader(make_dataset(4 * world_size * 2, seed=77), batch_size=4, shuffle=False)
        metrics = trainer.validate(module, val_loader, verbose=False)
        preds = trainer.predict(module, val_loader)
        record = {
            "losses": module.losses,
            "norms": module.norms,
            "val": metrics[0]["val_loss"],
            "preds": [p.tolist() for p in preds],
            "gain": float(module.net.gain.detach()),
        }
        Path(out_dir, f"uneven-{tag}-rank{rank}.json").write_text(json.dumps(record))
        torch.save(module.state_dict(), Path(out_dir, f"uneven-{tag}-w{rank}.pt"))


def test_uneven_shards_tiny_and_frozen_params_match_ddp_then_validate_and_predict(tmp_path: Path) -> None:
    run_ranks(uneven_in_rank, 2, str(tmp_path))
    for rank in range(2):
        ref = json.loads(Path(tmp_path, f"uneven-ddp-rank{rank}.json").read_text())
        got = json.loads(Path(tmp_path, f"uneven-pstar-rank{rank}.json").read_text())
        assert len(got["losses"]) == len(ref["losses"]) == 10
        assert any(n > 0.3 for n in ref["norms"]), f"clipping inactive: {ref['norms']}"
        for i, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
            assert abs(a - b) <= LOSS_RTOL * abs(b), f"rank {rank} micro-batch {i}: {a!r} vs ddp {b!r}"
        assert got["val"] == pytest.approx(ref["val"], rel=1e-5)
        assert len(got["preds"]) == len(ref["preds"]) > 0
        for a, b in zip(got["preds"], ref["preds"], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
        want = torch.load(Path(tmp_path, f"uneven-ddp-w{rank}.pt"), weights_only=True)
        have = torch.load(Path(tmp_path, f"uneven-pstar-w{rank}.pt"), weights_only=True)
        assert sorted(have) == sorted(want)
        for name, value in want.items():
            torch.testing.assert_close(have[name], value, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        assert not torch.equal(want["net.gain"], torch.ones(1)), "the 1-element gain never trained"


# ---- a rank-dependent failure while the other rank's host step runs into the next forward ----------------------


def test_failure_on_one_rank_under_next_forward_ends_both_ranks(tmp_path: Path) -> None:
    """Rank 1 raises in ``training_step`` at step 2 while rank 0 may still be finishing step 1's host-side step
    in the background ("next_forward"): both ranks end by themselves with an error, nobody hangs, and no disk or
    record files are left as if the run succeeded."""
    options = {"optimizer_placement": "host", "optimizer_overlap": "next_forward"}
    spec = RunSpec(
        tag="fail-nf",
        out_dir=str(tmp_path),
        steps=6,
        chunk_size=4096,
        grad_hook=False,
        options=options,
        fail_rank=1,
        fail_step=2,
    )
    with pytest.raises(WorkerFailure, match="injected failure on rank 1 at step 2") as info:
        run_ranks(fit_in_rank, 2, [spec], grace=60.0)
    failed_at = float(spec.failure_time_path.read_text())
    for outcome in info.value.outcomes:
        assert not outcome.killed, f"rank {outcome.rank} did not end by itself:\n{info.value}"
        assert outcome.exitcode != 0, f"rank {outcome.rank} reported success"
        assert outcome.ended_at - failed_at < 60.0, outcome.describe()
    assert not spec.record_path(0).exists() and not spec.record_path(1).exists()
