"""The pipelined host-side step at 2 ranks: ``optimizer_overlap="pipeline"`` and "auto" against "off" (serial).

Every rank steps the families it owns on the host (``optimizer_placement="host"``); their gradients are final once
the group's reduced share is stored, and under "pipeline" their steps start there, inside the backward. "auto"
times both schedules and the ranks agree on one ([Note: choosing the schedule] in optim/overlap.py). Same losses
on every rank, bitwise, and the same checkpoint (weights and optimizer states), bitwise.
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
    from lightning_pstar.optim.overlap import SETTLE_STEPS, TRIALS

    steps = 1 + 1 + SETTLE_STEPS + 4 * TRIALS + 1  # "auto" decides at two ranks (two candidates: no tail there)
    common = {"out_dir": str(tmp_path), "steps": steps, "chunk_size": 4096, "precision": precision, "grad_hook": False}
    host = {"optimizer_placement": "host"}
    specs = [
        RunSpec(tag=mode, save_checkpoint=True, options={**host, "optimizer_overlap": mode}, **common)
        for mode in ("off", "pipeline", "auto")
    ]
    # 32-true with clipping by norm: no step inside the backward, but each owned family's gradient norms are
    # computed there, on the host ([Note: gradient norms inside the backward] in optim/overlap.py)
    clipped = {**common, "precision": "32-true", "clip": 0.05, "steps": 6}
    clip_specs = [
        RunSpec(tag=f"clip-{mode}", save_checkpoint=True, options={**host, "optimizer_overlap": mode}, **clipped)
        for mode in ("off", "pipeline")
    ]
    # bf16-mixed with accumulation: every reduced gradient is added to the fp32 sum in the GRAD chunk, which the jobs
    # read ([Note: gradient parts] in optim/host_step.py)
    summed = {**common, "accumulate": 2, "steps": 6}
    sum_specs = [
        RunSpec(tag=f"acc-{mode}", save_checkpoint=True, options={**host, "optimizer_overlap": mode}, **summed)
        for mode in ("off", "pipeline")
    ]
    run_ranks(fit_in_rank, 2, [*specs, *clip_specs, *sum_specs])

    for spec in specs[1:]:
        reports = _same_as_serial(specs[0], spec)
        for report in reports:
            assert report["host_step_jobs"] > 0 and report["host_steps_in_backward"] > 0, report
    chosen = [r["memory_report"]["optimizer_schedule"] for r in read_records(specs[2])]
    assert chosen[0] in ("pipeline", "serial") and chosen == [chosen[0]] * 2, chosen  # the ranks agree
    for report in _same_as_serial(*clip_specs):
        assert report["host_steps_in_backward"] == 0 and report["host_norms_in_backward"] > 0, report
    for report in _same_as_serial(*sum_specs):
        assert report["host_step_jobs"] > 0 and report["host_steps_in_backward"] > 0, report


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
    for index, state in want["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer_states"][0]["state"][index][key], value), (spec.tag, index, key)
    return reports
