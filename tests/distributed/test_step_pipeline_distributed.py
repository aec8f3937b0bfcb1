"""The pipelined host-side step at 2 ranks: ``optimizer_overlap="auto"`` against the serial step ("off").

Every rank steps the families it owns on the host (``optimizer_placement="host"``); their gradients are final once
the group's reduced share is stored, and under "auto" their steps start there, inside the backward. Same losses on
every rank, bitwise, and the same checkpoint (weights and optimizer states), bitwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import run_ranks
from workloads import RunSpec, fit_in_rank, read_records

pytestmark = pytest.mark.slow  # trains on spawned ranks


@pytest.mark.parametrize("precision", ["bf16-mixed"])
def test_pipelined_step_matches_the_serial_step_at_two_ranks(precision: str, tmp_path: Path) -> None:
    common = {"out_dir": str(tmp_path), "steps": 6, "chunk_size": 4096, "precision": precision, "grad_hook": False}
    host = {"optimizer_placement": "host"}
    serial = RunSpec(tag="off", save_checkpoint=True, options={**host, "optimizer_overlap": "off"}, **common)
    pipelined = RunSpec(tag="auto", save_checkpoint=True, options={**host, "optimizer_overlap": "auto"}, **common)
    run_ranks(fit_in_rank, 2, [serial, pipelined])

    for rank, (a, b) in enumerate(zip(read_records(serial), read_records(pipelined), strict=True)):
        assert b["losses"] == a["losses"], f"rank {rank}"
        report = b["memory_report"]
        assert report["host_step_jobs"] > 0 and report["host_steps_in_backward"] > 0, report
        assert a["memory_report"]["host_step_jobs"] == 0
    want = torch.load(serial.checkpoint_path, weights_only=True)
    got = torch.load(pipelined.checkpoint_path, weights_only=True)
    for name, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], value), name
    for index, state in want["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer_states"][0]["state"][index][key], value), (index, key)
