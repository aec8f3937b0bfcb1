"""benchmarks/compare.py and benchmarks/gpu_check.py end to end, in subprocesses, as a user runs them.

Both scripts start with the smallest sizes they accept, concurrently (each mostly waits on its own training
subprocesses), and every run of their JSON is checked for the published keys and types.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPARE_RUN_KEYS = {
    "strategy": str,
    "world_size": int,
    "precision": str,
    "device_memory_limit": (int, type(None)),
    "step_time_s": float,
    "tokens_per_s": float,
    "peak_rss_bytes": int,
    "model_data_bytes_per_param": (float, type(None)),
    "h2d_bytes_per_step": (int, type(None)),
    "d2h_bytes_per_step": (int, type(None)),
}
GPU_CHECK_RUN_KEYS = {
    "strategy": str,
    "params": int,
    "trained": bool,
    "step_time_s": float,
    "tokens_per_s": float,
    "tflops": float,
    "peak_rss_bytes": int,
    "tokens_per_step": int,
    "optimizer_placement": str,
    "breakdown": dict,
    "result_after_s": float,
    "run_s": float,
}
BREAKDOWN_PHASES = ("forward_s", "backward_s", "optimizer_s")


def _start(args: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, *args], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


HANG_S = 900
"""A guard against a hung run, not a speed check: the runs take 5 to 35 s on an idle 2-core machine, and a loaded
one can be several times slower (speed targets are the benchmarks' own business)."""


def _finish(proc: subprocess.Popen[str], timeout: float = HANG_S) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{proc.args!r} did not finish in {timeout} s\n{out[-4000:]}")
    assert proc.returncode == 0, f"{proc.args!r} exited with {proc.returncode}\n{out[-6000:]}"
    return out


def _check_types(record: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    for key, kind in expected.items():
        assert key in record, f"{where}: missing {key!r} in {record}"
        assert isinstance(record[key], kind) and not (kind is int and isinstance(record[key], bool)), (
            f"{where}: {key!r} = {record[key]!r} is not {kind}"
        )


@pytest.mark.slow
def test_compare_and_gpu_check_write_complete_json(tmp_path: Path) -> None:
    compare_json, gpu_json, plot = tmp_path / "compare.json", tmp_path / "gpu_check.json", tmp_path / "compare.png"
    compare = _start(
        [
            "benchmarks/compare.py", "--quick", "--strategies", "auto,patrickstar-1", "--steps", "1",
            "--warmup", "1", "--batch-size", "2", "--block-size", "16", "--n-embd", "32",
            "--scale-device-memory", "2GiB", "--scale-host-memory", "8GiB", "--scale-ranks", "2",
            "--json", str(compare_json), "--plot", str(plot),
        ]
    )  # fmt: skip
    budget = ["--time-budget", "1e9"]  # no run skipped for a slow machine: the test checks every run's record
    gpu_check = _start(["benchmarks/gpu_check.py", "--tiny", "--steps", "1", *budget, "--json", str(gpu_json)])
    gpu_out = _finish(gpu_check)
    compare_out = _finish(compare)

    document = json.loads(compare_json.read_text())
    assert set(document) >= {"model", "runs"}
    assert isinstance(document["model"]["params"], int) and document["model"]["params"] > 0
    assert [r["strategy"] for r in document["runs"]] == ["auto", "patrickstar"], compare_out
    for run in document["runs"]:
        assert list(run) == list(COMPARE_RUN_KEYS), run  # exactly the published keys, in order
        _check_types(run, COMPARE_RUN_KEYS, "compare.py")
        assert run["world_size"] == 1 and run["step_time_s"] > 0 and run["peak_rss_bytes"] > 0
    auto, pstar = document["runs"]
    assert auto["model_data_bytes_per_param"] == pytest.approx(16.0)  # fp32 AdamW: 4 + 4 + 8
    assert 14.0 <= pstar["model_data_bytes_per_param"] < 16.0  # 14 in mixed precision, plus chunk padding
    assert auto["h2d_bytes_per_step"] is None and isinstance(pstar["h2d_bytes_per_step"], int)
    scale = {(r["strategy"], r["world_size"]): r for r in document["scale"]["rows"]}
    assert scale[("patrickstar", 2)]["params"] > scale[("ddp", 2)]["params"] > 0, compare_out
    assert "target: >= 2.5x ddp/auto" in compare_out and plot.stat().st_size > 0

    report = json.loads(gpu_json.read_text())
    runnable = {"patrickstar-host", "patrickstar", "fsdp-offload", "fsdp"}
    assert {r["strategy"] for r in report["runs"]} == runnable | {"deepspeed-offload"}, gpu_out
    for run in report["runs"]:
        if run["strategy"] == "deepspeed-offload" and report["deepspeed"] != "available":
            assert not run["trained"] and run["error"].startswith("not run: deepspeed is"), gpu_out
            continue
        _check_types(run, GPU_CHECK_RUN_KEYS, "gpu_check.py")
        assert run["trained"] and run["teardown"] == "exited", gpu_out
        assert run["result_after_s"] <= run["run_s"]  # the result came before the worker's teardown ended
        assert all(run["breakdown"][k] > 0 for k in BREAKDOWN_PHASES), run["breakdown"]
    assert all(report["largest"][s] is not None for s in runnable), gpu_out
    runs = {r["strategy"]: r for r in report["runs"]}
    assert runs["patrickstar-host"]["optimizer_ran_on"] == "host", gpu_out  # forced, by the option or the fallback
    # accumulation (2 micro-batches in --tiny): the host steps pipelined, the first micro-batch's gradients summed
    # aside (what the first GPU run's offloaded row did serially)
    host = runs["patrickstar-host"]
    assert host["host_step_jobs"] > 0 and host["host_sums_in_backward"] > 0, host
    forced = "optimizer_placement='host'" if report["optimizer_placement_option"] else "placement='static'"
    assert runs["patrickstar-host"]["optimizer_placement"].startswith(forced)
    assert runs["patrickstar"]["optimizer_ran_on"] == "device"  # the simulated device has no budget
    pairs = {(r["patrickstar"], r["peer"]): r for r in report["ratios"]}
    assert len(pairs) == 6 and pairs[("patrickstar", "fsdp")]["largest_model"] == 1.0
    assert all(pairs[(p, "fsdp-offload")]["tokens_per_s"] for p in ("patrickstar-host", "patrickstar"))
    # each row is printed as its run reports, before the summary
    assert gpu_out.index("patrickstar-host ") < gpu_out.index("all rows:"), gpu_out


@pytest.mark.slow  # a benchmark end to end in subprocesses
def test_scaling_quick_writes_its_table_and_json(tmp_path: Path) -> None:
    """benchmarks/scaling.py --quick (issue 18): PatrickStar's engine CPU per module, collectives per step and
    bytes/param per rank at 1 and 2 ranks, in seconds."""
    out_json = tmp_path / "scaling.json"
    command = ["benchmarks/scaling.py", "--quick", "--strategies", "patrickstar", "--host-malloc", "cached"]
    out = _finish(_start([*command, "--json", str(out_json)]))
    report = json.loads(out_json.read_text())
    assert report["args"]["host_malloc"] == "cached"  # [Note: --host-malloc cached] in benchmarks/_launch.py
    rows = {r["world_size"]: r for r in report["rows"]}
    assert set(rows) == {1, 2} and "engine/module" in out, out
    for world, row in rows.items():
        assert row["strategy"] == "patrickstar" and row["n_layer"] == 2 and row["host_malloc"] == "cached"
        assert row["engine_us_per_module"] > 0 and row["modules"] > 0 and row["groups"] > 0
        assert 0 < row["chunk_utilisation"] <= 1 and row["bytes_per_param"] > 0
        assert (row["collectives_per_step"] > 0) == (world == 2)
        calls = row["engine_calls_per_step"]
        assert calls["grad_ready"] > calls["pre_forward"] > 0 and set(calls) == set(row["engine_us_per_call"])
    assert rows[2]["bytes_per_param"] < rows[1]["bytes_per_param"]  # ZeRO: each rank keeps its own families
    for row in rows.values():  # the phases split the step between Lightning's hooks: together about the step
        phases = row["phase_ms"]
        assert list(phases) == ["forward", "backward", "after_backward", "optimizer"], phases
        assert all(ms >= 0 for ms in phases.values()) and phases["forward"] > 0 and phases["backward"] > 0, phases
        assert 0.5 * row["step_ms"] < sum(phases.values()) < 1.5 * row["step_ms"], (phases, row["step_ms"])
        assert isinstance(row["page_faults_per_step"], (int, float)) and row["page_faults_per_step"] >= 0, row
    assert "minor page faults per step" in out, out


@pytest.mark.slow  # a benchmark end to end in subprocesses
def test_scaling_runs_in_the_precision_it_is_given(tmp_path: Path) -> None:
    """``benchmarks/scaling.py --precision 32-true`` (a CPU without bf16 units): the runs train in fp32, so
    PatrickStar keeps 16 bytes of model data per parameter over the ranks (no fp32 master beside a bf16 copy),
    at least 8 on each of two ranks, where bf16-mixed keeps 7 and a little padding."""
    out_json = tmp_path / "scaling.json"
    command = ["benchmarks/scaling.py", "--quick", "--strategies", "patrickstar", "--ranks", "2"]
    command += ["--host-malloc", "system"]  # PatrickStar told to leave glibc as it is (_launch.pstar_host_malloc)
    out = _finish(_start([*command, "--precision", "32-true", "--json", str(out_json)]))
    report = json.loads(out_json.read_text())
    assert report["args"]["precision"] == "32-true" and "precision 32-true" in out, out
    (row,) = report["rows"]
    assert report["args"]["host_malloc"] == "system" and row["host_malloc"] == "system", row
    assert row["world_size"] == 2 and 8.0 <= row["bytes_per_param"] < 9.0, row


@pytest.mark.slow  # a benchmark end to end in subprocesses
def test_collectives_times_every_collective_at_every_size(tmp_path: Path) -> None:
    """benchmarks/collectives.py (the README's and comm.py's gloo figures): one positive time per collective and
    size, from two real ranks."""
    out_json = tmp_path / "collectives.json"
    command = ["benchmarks/collectives.py", "--numel", "1000,4000", "--repeats", "3", "--json", str(out_json)]
    out = _finish(_start(command))
    report = json.loads(out_json.read_text())
    assert sorted(report["ms"]) == ["1000", "4000"], out
    for row in report["ms"].values():
        names = {"reduce_scatter(list)", "reduce_scatter_single", "all_reduce", "exchange (ChunkComm)"}
        assert set(row) == names | {"all_gather(bf16 half)"}
        assert all(ms > 0 for ms in row.values()), row


def test_pinned_waste_counts_the_rounding_the_cuda_layout_avoids() -> None:
    """``benchmarks/pinned_waste.py`` (the README's pinned-memory figures): on CUDA's power-of-two chunks the
    host allocator rounds nothing, and the searched layout's rounding is what the table adds."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import pinned_waste
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    row = pinned_waste.measure(2, 256)
    searched, cuda = row["searched"], row["cuda"]
    assert cuda["rounding_bytes"] == 0
    assert cuda["pinned_bytes"] == cuda["chunk_bytes"]
    assert cuda["chunk_size"] & (cuda["chunk_size"] - 1) == 0
    assert searched["pinned_bytes"] == searched["chunk_bytes"] + searched["rounding_bytes"]
    for size in pinned_waste.KIND_ITEMSIZES:  # the rounding is the next power of two of each buffer
        nbytes = searched["chunk_size"] * size
        assert pinned_waste.rounding_waste(nbytes) == (1 << (nbytes - 1).bit_length()) - nbytes


def test_gpu_check_breakdown_reads_copies_host_adam_and_waits_from_a_trace() -> None:
    """benchmarks/_gpu_measure.py's profile figures on a synthetic chrome trace (the CUDA categories a CPU run
    never records): copies without device-to-device ones, torch's fused Adam on the host, the host's waits but
    not the boundary synchronisations (cudaDeviceSynchronize)."""
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        from _gpu_measure import trace_figures
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    events = [
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "dur": 2000, "args": {"bytes": 4096}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "dur": 1000, "args": {"bytes": 1024}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "dur": 9000, "args": {"bytes": 1 << 20}},
        {"cat": "cpu_op", "name": "aten::_fused_adamw_", "dur": 500_000},
        {"cat": "cpu_op", "name": "aten::mm", "dur": 7000},
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "dur": 250_000},
        {"cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "dur": 900_000},
    ]
    figures = trace_figures(events)
    assert figures == {"moved_bytes_per_step": 5120, "transfers_s": 0.003, "host_adam_s": 0.5, "waits_s": 0.25}
    assert trace_figures([]) == {"moved_bytes_per_step": None, "transfers_s": None, "host_adam_s": None, "waits_s": 0}


@pytest.mark.slow  # a benchmark end to end in a subprocess (about 10 s; 20 s with accumulation)
@pytest.mark.parametrize("accumulate", [2])  # 1: the same table without sums (unit and pipeline tests cover it)
def test_offload_quick_measures_every_schedule_against_its_bounds(tmp_path: Path, accumulate: int) -> None:
    """benchmarks/offload.py --quick: every schedule with and without clipping, the stages alone, and a target row
    per overlapped run whose ratio is its step over its bound; with ``--accumulate`` per optimizer step (a window of
    micro-batches), the accumulating micro-batches' gradients summed aside where the schedule overlaps."""
    out = tmp_path / "offload.json"
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "offload.py"), "--quick", "--json", str(out)]
    cmd += ["--accumulate", str(accumulate)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = {(r["overlap"], r["clip"]): r for r in result["runs"]}
    assert set(runs) == {(o, c) for o in ("off", "pipeline", "auto", "next_forward") for c in (False, True)}
    assert all(r["step_ms"] > 0 and r["optimizer_tier"] == "host" for r in runs.values())
    assert runs[("off", False)]["host_step_jobs"] == 0
    piped = runs[("pipeline", False)]
    assert 0 < piped["host_copies_back_in_backward"] <= piped["host_steps_in_backward"] <= piped["host_step_jobs"]
    assert runs[("pipeline", True)]["host_steps_in_backward"] == 0  # clipping needs every gradient first
    assert set(result["stages_alone"]) == {"d2h_ms", "adam_ms", "h2d_ms", "sums_ms"}
    assert (result["stages_alone"]["sums_ms"] > 0) == (accumulate > 1) and result["model"]["accumulate"] == accumulate
    assert runs[("off", False)]["host_sums_in_backward"] == 0
    assert (piped["host_sums_in_backward"] > 0) == (accumulate > 1)
    assert len(result["targets"]) == 6
    bandwidth = result["copy_bandwidth"]
    assert bandwidth["one_thread_gbps"] > 0 and bandwidth["two_threads_gbps"] > 0
    headroom = bandwidth["two_threads_gbps"] / bandwidth["one_thread_gbps"]
    for target in result["targets"]:
        assert target["ratio"] == pytest.approx(target["step_ms"] / target["bound_ms"])
        assert target["met"] == (target["step_ms"] <= 1.15 * target["bound_ms"])
        run = runs[(target["overlap"], target["clip"])]
        assert target["backward_over_alone"] == pytest.approx(run["backward_ms"] / result["compute"]["backward_ms"])
        serial = runs[("off", target["clip"])]["step_ms"]
        assert target["bandwidth_floor_ms"] == pytest.approx(serial / headroom)
        side = result["beside"]["clip" if target["clip"] else "anywhere"]
        assert target["beside_ratio"] == pytest.approx(target["step_ms"] / side["bound_ms"])
        assert target["beside_met"] == (target["step_ms"] <= 1.15 * side["bound_ms"])
    # the stages beside each other: a run with the optimizer on the device and the host work on a thread beside it
    assert set(result["beside"]) == {"anywhere", "backward", "clip"}
    for mode, side in result["beside"].items():
        assert side["mode"] == mode and side["host_ms"] > 0
        # the step ends when both the compute and the host work have
        assert side["bound_ms"] >= side["compute_ms"] > 0
        assert side["compute_ms"] >= 0.9 * (side["forward_ms"] + side["backward_ms"])
    assert "target <= 1.15x" in proc.stdout and "the host work beside the compute" in proc.stdout


def test_offload_only_runs_one_schedule_alone(tmp_path: Path) -> None:
    """benchmarks/offload.py --only OVERLAP[:clip]: that run alone, its step and phases as one JSON line."""
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "offload.py"), "--quick", "--only", "next_forward:clip"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout.strip().splitlines()[-1])
    assert run["overlap"] == "next_forward" and run["clip"] is True
    assert run["step_ms"] > 0 and run["forward_ms"] > 0 and run["backward_ms"] > 0
    # every optimizer step of the run (--quick: 45), the warm-up's included
    assert len(run["every_step_ms"]) == 45 and all(ms > 0 for ms in run["every_step_ms"])
