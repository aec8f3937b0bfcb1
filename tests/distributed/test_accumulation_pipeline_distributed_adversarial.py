"""Mixed precision with accumulation through the pipelined host step at 2 ranks: every reduced gradient is added
to the fp32 sum in the owner's GRAD chunk ([Note: gradient parts] in optim/host_step.py), and the owner's jobs read
it. "pipeline" and "next_forward" against "off", bitwise (losses on every rank, the checkpoint's weights and
optimizer states), with chunk sizes that give the ranks uneven shares of the parameters, accumulation 2 and 3, and
clipping by norm; each checks that the pipeline ran on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_ranks
from workloads import RunSpec, fit_in_rank, read_records

pytestmark = pytest.mark.slow  # trains on spawned ranks


def _same_as_serial(serial_spec: RunSpec, spec: RunSpec) -> list[dict]:
    """Same losses on every rank and the same checkpoint as the serial run, bitwise; each rank's memory report."""
    reports = []
    for rank, (a, b) in enumerate(zip(read_records(serial_spec), read_records(spec), strict=True)):
        assert b["losses"] == a["losses"], f"{spec.tag}, rank {rank}"
        assert a["memory_report"]["host_step_jobs"] == 0
        reports.append(b["memory_report"])
    want = torch.load(serial_spec.checkpoint_path, weights_only=True)
    got = torch.load(spec.checkpoint_path, weights_only=True)
    for name, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], value), (spec.tag, name)
    states = want["optimizer_states"][0]["state"]
    assert states, spec.tag
    for index, state in states.items():
        for key, value in state.items():
            assert torch.equal(got["optimizer_states"][0]["state"][index][key], value), (spec.tag, index, key)
    return reports


@pytest.mark.parametrize(("chunk_size", "accumulate", "clip"), [(3000, 3, None), (5000, 2, 0.05)])
def test_accumulation_at_two_ranks_with_uneven_shares(
    tmp_path: Path, chunk_size: int, accumulate: int, clip: float | None
) -> None:
    common = {
        "out_dir": str(tmp_path),
        "steps": 5,
        "chunk_size": chunk_size,
        "precision": "bf16-mixed",
        "grad_hook": False,
        "accumulate": accumulate,
        "clip": clip,
    }
    specs = [
        RunSpec(
            tag=mode, save_checkpoint=True, options={"optimizer_placement": "host", "optimizer_overlap": mode}, **common
        )
        for mode in ("off", "pipeline", "next_forward")
    ]
    run_ranks(fit_in_rank, 2, specs)
    for spec in specs[1:]:
        reports = _same_as_serial(specs[0], spec)
        jobs = [r["host_step_jobs"] for r in reports]
        assert all(j > 0 for j in jobs), (spec.tag, jobs)
        if clip is None:
            assert all(r["host_steps_in_backward"] > 0 for r in reports), (spec.tag, reports)
    shares = [r["memory_report"]["model_data_bytes"] for r in read_records(specs[1])]
    assert shares[0] != shares[1], shares  # the ranks own uneven shares


# ---- an expert idle on both ranks for whole windows -------------------------------------------------------------

RARE_ON = {0: (0, 0), 2: (1, 1)}  # window -> (the rank that routes tokens to the rare expert, its micro-batch)


def _routed_in_rank(rank: int, world_size: int, out_dir: str, mode: str) -> None:
    """bf16-mixed, accumulation 2, 4 windows, each rank its own data: a tiny mixture of experts whose ``rare``
    expert runs on one rank in windows 0 and 2 (on a different rank and micro-batch each time) and on none in
    windows 1 and 3. Writes this rank's losses and report; rank 0 the checkpoint."""
    import json

    import lightning as L
    import torch.distributed as dist
    from torch import nn

    from lightning_pstar import PatrickStarStrategy
    from tests.helpers.data import make_loader
    from tests.helpers.models import N_EMBD, VOCAB
    from tests.helpers.runs import LM, quiet_trainer_options

    class Routed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(VOCAB, N_EMBD)
            self.experts = nn.ModuleList([nn.Linear(N_EMBD, N_EMBD) for _ in range(2)])
            self.rare = nn.Linear(N_EMBD, N_EMBD)
            self.head = nn.Linear(N_EMBD, VOCAB)
            self.calls = 0

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            window, micro = divmod(self.calls, 2)
            if torch.is_grad_enabled():
                self.calls += 1
            x = self.wte(idx)
            out = x
            for e, expert in enumerate(self.experts):
                out = out + torch.where((idx % 2 == e).unsqueeze(-1), expert(x), torch.zeros_like(x))
            if torch.is_grad_enabled() and RARE_ON.get(window) == (dist.get_rank(), micro):
                out = out + self.rare(x)
            return self.head(torch.tanh(out))

    losses: list[float] = []

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *a: Any) -> None:
            losses.append(float(outputs["loss"]))

    strategy = PatrickStarStrategy(
        start_method="popen", optimizer_overlap=mode, optimizer_placement="host", chunk_size=1056
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        precision="bf16-mixed",
        max_epochs=1,
        accumulate_grad_batches=2,
        use_distributed_sampler=False,
        callbacks=[Rec()],
        **quiet_trainer_options(),
    )
    trainer.fit(LM(Routed), train_dataloaders=make_loader(n_seq=32, seed=100 + rank))
    report = strategy.memory_report().as_dict()
    trainer.save_checkpoint(f"{out_dir}/{mode}.ckpt")
    Path(f"{out_dir}/{mode}-rank{rank}.json").write_text(json.dumps({"losses": losses, "report": report}))


def test_an_expert_idle_on_every_rank_for_whole_windows(tmp_path: Path) -> None:
    """The rare expert steps in the 2 windows some rank used it in, never in the other 2, under every schedule,
    bitwise "off"'s (losses on each rank, weights, optimizer states)."""
    import json

    modes = ("off", "pipeline", "next_forward")
    for mode in modes:
        run_ranks(_routed_in_rank, 2, str(tmp_path), mode)
    want = torch.load(tmp_path / "off.ckpt", weights_only=True)
    names = list(want["state_dict"])  # the optimizer's indices follow the parameters' order (no tied weights here)
    rare_index = [names.index("net.rare.weight"), names.index("net.rare.bias")]
    state = want["optimizer_states"][0]["state"]
    assert {float(state[i]["step"]) for i in rare_index} == {2.0}, {i: state[i]["step"] for i in rare_index}
    assert max(float(s["step"]) for s in state.values()) == 4.0
    for mode in modes[1:]:
        for rank in range(2):
            a = json.loads((tmp_path / f"off-rank{rank}.json").read_text())
            b = json.loads((tmp_path / f"{mode}-rank{rank}.json").read_text())
            assert b["losses"] == a["losses"] and len(a["losses"]) == 8, (mode, rank)
            assert b["report"]["host_step_jobs"] > 0 and a["report"]["host_step_jobs"] == 0, (mode, rank)
        got = torch.load(tmp_path / f"{mode}.ckpt", weights_only=True)
        for name, value in want["state_dict"].items():
            assert torch.equal(got["state_dict"][name], value), (mode, name)
        for index, entry in state.items():
            for key, value in entry.items():
                assert torch.equal(got["optimizer_states"][0]["state"][index][key], value), (mode, index, key)


def test_disk_tier_with_accumulation_at_two_ranks(tmp_path: Path) -> None:
    """Each rank's last owned families keep their masters and Adam states on disk (host budget 440KiB), bf16-mixed,
    accumulation 3: "pipeline" and "next_forward" give "off"'s bits, and the disk directories are empty after."""
    import os

    common = {
        "out_dir": str(tmp_path),
        "steps": 4,
        "chunk_size": 4096,
        "precision": "bf16-mixed",
        "grad_hook": False,
        "accumulate": 3,
    }
    specs, disks = [], []
    for mode in ("off", "pipeline", "next_forward"):
        disk = tmp_path / f"disk-{mode}"
        disk.mkdir()
        disks.append(disk)
        options = {
            "optimizer_placement": "host",
            "optimizer_overlap": mode,
            "device_memory_limit": "64MiB",
            "host_memory_limit": "440KiB",
            "disk_path": str(disk),
        }
        specs.append(RunSpec(tag=mode, save_checkpoint=True, options=options, **common))
    run_ranks(fit_in_rank, 2, specs)
    for spec in specs[1:]:
        for report in _same_as_serial(specs[0], spec):
            assert report["disk_families"] > 0 and report["host_step_jobs"] > 0, (spec.tag, report)
    for disk in disks:
        assert os.listdir(disk) == []


def test_auto_times_schedules_through_windows_at_two_ranks(tmp_path: Path) -> None:
    """ "auto" with accumulation 2 at two ranks: it alternates the serial and pipelined steps while timing them, the
    ranks agree on one, and every step is "off"'s bits (uneven shares: chunk size 3000)."""
    from lightning_pstar.optim.overlap import SETTLE_STEPS, TRIALS

    steps = 1 + 1 + SETTLE_STEPS + 4 * TRIALS + 2
    common = {
        "out_dir": str(tmp_path),
        "steps": steps,
        "chunk_size": 3000,
        "precision": "bf16-mixed",
        "grad_hook": False,
        "accumulate": 2,
    }
    specs = [
        RunSpec(
            tag=mode, save_checkpoint=True, options={"optimizer_placement": "host", "optimizer_overlap": mode}, **common
        )
        for mode in ("off", "auto")
    ]
    run_ranks(fit_in_rank, 2, specs)
    reports = _same_as_serial(*specs)
    assert all(r["host_step_jobs"] > 0 for r in reports), reports
    chosen = [r["optimizer_schedule"] for r in reports]
    assert chosen[0] in ("pipeline", "serial") and chosen == [chosen[0]] * 2, chosen
    assert all(set(r["schedule_trial_ms"]) == {"pipeline", "serial"} for r in reports), reports


def _fabric_rank(rank: int, world_size: int) -> dict[str, Any]:
    """The shared Fabric loop at two ranks, bf16-mixed, accumulation 3 through ``no_backward_sync``, clipping by norm
    between the last backward and the step, two groups, a schedule and an evaluation between steps: under "off"
    and under "pipeline" (uneven shares: chunk size 3000)."""
    from lightning_pstar import PatrickStarFabricStrategy
    from tests.helpers.fabric_loop import LoopSpec, train

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for mode in ("off", "pipeline"):
        strategy = PatrickStarFabricStrategy(optimizer_overlap=mode, optimizer_placement="host", chunk_size=3000)
        result = train(
            LoopSpec(
                strategy=strategy,
                devices=world_size,
                precision="bf16-mixed",
                steps=3,
                accumulate=3,
                clip_norm=0.5,
                two_groups=True,
                scheduler=True,
                eval_between=True,
            )
        )
        out[mode] = {
            "losses": result.losses,
            "eval": result.eval_losses,
            "norms": result.grad_norms,
            "state": result.state,
            "jobs": strategy.memory_report().host_step_jobs,
        }
    return out


def test_fabric_accumulation_at_two_ranks() -> None:
    for rank, result in enumerate(run_ranks(_fabric_rank, 2)):
        off, piped = result["off"], result["pipeline"]
        assert off["jobs"] == 0 and piped["jobs"] > 0, rank
        assert piped["losses"] == off["losses"] and len(off["losses"]) == 9, rank
        assert piped["eval"] == off["eval"] and piped["norms"] == off["norms"], rank
        for name, value in off["state"].items():
            assert torch.equal(piped["state"][name], value), (rank, name)
