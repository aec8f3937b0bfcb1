"""The disk tier at 2 ranks: each rank keeps the optimizer side of some families it owns on disk, and the run is
bitwise the run without a disk tier (losses on every rank, the checkpoint's weights and optimizer states).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from launch import run_ranks
from workloads import RunSpec, fit_in_rank, read_records

pytestmark = pytest.mark.slow  # trains on spawned ranks

OVERLAPS = ("off", "auto")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[RunSpec, RunSpec, Path]]:
    """Per overlap mode, the run without a disk tier, the run with one and its disk directory: all four runs in one
    launch of two ranks (the ranks' start-up paid once)."""
    out = tmp_path_factory.mktemp("disk-tier")
    common = {"out_dir": str(out), "steps": 4, "chunk_size": 4096, "precision": "bf16-mixed", "grad_hook": False}
    runs = {}
    for overlap in OVERLAPS:
        disk = out / f"disk-{overlap}"
        disk.mkdir()
        base = {"optimizer_placement": "host", "optimizer_overlap": overlap, "device_memory_limit": "64MiB"}
        roomy_options = {**base, "host_memory_limit": "64MiB"}
        roomy = RunSpec(tag=f"roomy-{overlap}", save_checkpoint=True, options=roomy_options, **common)
        tight = {**base, "host_memory_limit": "350KiB", "disk_path": str(disk)}
        on_disk = RunSpec(tag=f"disk-{overlap}", save_checkpoint=True, options=tight, **common)
        runs[overlap] = (roomy, on_disk, disk)
    run_ranks(fit_in_rank, 2, [spec for roomy, on_disk, _ in runs.values() for spec in (roomy, on_disk)])
    return runs


@pytest.mark.parametrize("overlap", OVERLAPS)
def test_disk_tier_matches_the_run_without_it_at_two_ranks(
    overlap: str, runs: dict[str, tuple[RunSpec, RunSpec, Path]]
) -> None:
    roomy, on_disk, disk = runs[overlap]
    for rank, (a, b) in enumerate(zip(read_records(roomy), read_records(on_disk), strict=True)):
        assert b["losses"] == a["losses"], f"rank {rank}"
        assert b["memory_report"]["disk_families"] > 0, f"rank {rank}: {b['memory_report']}"
        assert a["memory_report"]["disk_families"] == 0
    want = torch.load(roomy.checkpoint_path, weights_only=True)
    got = torch.load(on_disk.checkpoint_path, weights_only=True)
    for name, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], value), name
    for index, state in want["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer_states"][0]["state"][index][key], value), (index, key)
    assert os.listdir(disk) == []
