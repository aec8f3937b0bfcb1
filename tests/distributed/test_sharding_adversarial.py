"""Adversarial two-rank checks of sharding and scheduling (one launch of two gloo ranks).

- Every ``optimizer_overlap`` mode ("pipeline", "next_forward", "auto") with the host-side step, AdamW with
  weight decay, a cosine schedule and ``accumulate_grad_batches=2`` at 2 ranks: same losses on every rank and the
  same checkpoint (weights and optimizer states) as the serial "off" run, bitwise. The existing pipeline test runs
  bf16-mixed without accumulation and never runs "next_forward".
- Placement never changes the arithmetic: SGD with momentum (no scale invariance to hide a wrong factor),
  accumulation and clipping by the global norm at 2 ranks, with the step on the device and on the host, against
  Lightning's DDP (the global norm must be over every rank's shard).
"""

from __future__ import annotations

import pytest
import torch
from launch import run_ranks
from workloads import RunSpec, fit_in_rank, read_records

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
    clip = {**common, "optim": "sgd", "clip": 0.5}
    specs["ddp"] = RunSpec(tag="ddp-sgd", strategy="ddp", **clip)
    for placement in ("device", "host"):
        options = {"optimizer_placement": placement, "optimizer_overlap": "off"}
        specs[placement] = RunSpec(tag=f"sgd-{placement}", options=options, **clip)
    run_ranks(fit_in_rank, 2, list(specs.values()))
    return specs


@pytest.mark.parametrize("mode", MODES[1:])
def test_overlap_mode_bitwise_equal_to_serial_at_two_ranks(mode: str, runs: dict[str, RunSpec]) -> None:
    serial, spec = runs["off"], runs[mode]
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
