"""benchmarks/disk_tier.py end to end, in a subprocess as a user runs it: ``--tiny`` into a temp directory, its JSON
checked for the published keys and types, and nothing left in the measured directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
HANG_S = 900
"""A guard against a hung run, not a speed check (the tiny run takes seconds; importing Lightning on a loaded
2-core machine takes most of them)."""

CEILING_KEYS = {"write_gbps": float, "read_gbps": float, "threads": int, "block_bytes": int, "direct": bool}
GRID_KEYS = {"threads": int, "block_bytes": int, "direct": bool, "write_gbps": float, "read_gbps": float}
STORE_KEYS = {
    "threads": int,
    "block_bytes": int,
    "write_gbps": float,
    "read_gbps": float,
    "staged_write_gbps": float,
    "staged_read_gbps": float,
    "write_ratio": float,
    "read_ratio": float,
    "stats_write_gbps": float,
    "stats_read_gbps": float,
    "bytes_written": int,
    "bytes_read": int,
    "page_cache_growth_bytes": int,
    "direct": bool,
}


def _check(record: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    for key, kind in expected.items():
        assert key in record, f"{where}: missing {key!r} in {record}"
        value = record[key]
        assert isinstance(value, kind) and not (kind is int and isinstance(value, bool)), f"{where}: {key}={value!r}"


@pytest.mark.slow
def test_disk_tier_benchmark_tiny_writes_complete_json_and_leaves_nothing(tmp_path: Path) -> None:
    measured, out = tmp_path / "disk", tmp_path / "disk_tier.json"
    measured.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    args = [sys.executable, "benchmarks/disk_tier.py", "--tiny", "--dir", str(measured), "--json", str(out)]
    done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, f"{args!r} exited with {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    for line in ("ceiling", "DiskStore, aligned", "DiskStore / ceiling", "load average before", "page cache growth"):
        assert line in done.stdout, done.stdout
    result = json.loads(out.read_text())
    _check(result, {"dir": str, "size_bytes": int, "repeat": int, "cpu_count": int}, "top")
    assert result["size_bytes"] == 16 << 20 and len(result["load_average_before"]) == 3
    _check(result["ceiling"], CEILING_KEYS, "ceiling")
    for row in result["ceiling"]["grid"]:
        _check(row, GRID_KEYS, "grid")
    _check(result["store"], STORE_KEYS, "store")
    store = result["store"]
    assert store["bytes_written"] == store["bytes_read"] == 2 * result["size_bytes"]  # aligned + staged, once each
    assert all(store[k] > 0 for k in ("write_gbps", "read_gbps", "write_ratio", "read_ratio"))
    assert list(measured.iterdir()) == [], "the benchmark removes its files"


TRAIN_RUN_KEYS = {
    "disk_families": int,
    "disk_chunk_bytes": int,
    "read_bytes_per_iteration": int,
    "written_bytes_per_iteration": int,
    "read_gbps": float,
    "write_gbps": float,
    "step_ms": float,
    "disk_ms": float,
    "adam_ms": float,
    "step_over_bound": float,
    "page_cache_growth_bytes": int,
    "peak_rss_bytes": int,
}


@pytest.mark.slow
def test_disk_tier_benchmark_quick_trains_with_the_disk_tier_only(tmp_path: Path) -> None:
    """Part 2 (``--quick``): the tiny GPT completes its steps with the disk tier; without it setup refuses."""
    measured, out = tmp_path / "disk", tmp_path / "disk_tier.json"
    measured.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    args = [sys.executable, "benchmarks/disk_tier.py", "--quick", "--dir", str(measured), "--json", str(out)]
    done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, f"{args!r} exited with {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert "with disk tier:" in done.stdout and "without disk tier: refused at setup" in done.stdout, done.stdout
    training = json.loads(out.read_text())["training"]
    assert training["host_budget_bytes"] < training["optimizer_state_bytes"]
    with_disk, without = training["runs"]
    assert with_disk["completed"] and not without["completed"]
    _check(with_disk, TRAIN_RUN_KEYS, "with disk tier")
    assert with_disk["read_bytes_per_iteration"] == with_disk["written_bytes_per_iteration"] > 0
    assert list(measured.iterdir()) == []
