"""benchmarks/disk_tier.py end to end, in a subprocess as a user runs it: ``--tiny`` into a temp directory, its JSON
checked for the published keys and types, and nothing left in the measured directory; ``--quick`` trains with the
disk tier. The two runs start together from the module's fixture (each measures and trains in a directory of its
own; no assertion is on a speed): [Note: one-process runs started together] in tests/helpers/together.py."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.together import Command, Started, selected_tests

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


MODES = {
    "test_disk_tier_benchmark_tiny_writes_complete_json_and_leaves_nothing": "--tiny",
    "test_disk_tier_benchmark_quick_trains_with_the_disk_tier_only": "--quick",
}


@pytest.fixture(scope="module")
def started(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Started, Path]]:
    """The benchmark runs of the selected tests, started together; ``<root>/<test name>/{disk,disk_tier.json}``."""
    root = tmp_path_factory.mktemp("disk-benchmark")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    commands = {}
    for name in selected_tests(request) & set(MODES):
        measured, out = root / name / "disk", root / name / "disk_tier.json"
        measured.mkdir(parents=True)
        args = [sys.executable, "benchmarks/disk_tier.py", MODES[name], "--dir", str(measured), "--json", str(out)]
        commands[name] = Command(args=args, env=env, cwd=REPO_ROOT)
    runs = Started(commands)
    yield runs, root
    runs.close()


def _finished(started: tuple[Started, Path], name: str) -> tuple[Any, Path, Path]:
    """The run of test ``name`` (exit code 0 asserted), its measured directory and its JSON file."""
    runs, root = started
    done = runs.wait(name, timeout=HANG_S)
    args = done.args
    assert done.returncode == 0, f"{args!r} exited with {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done, root / name / "disk", root / name / "disk_tier.json"


@pytest.mark.slow
def test_disk_tier_benchmark_tiny_writes_complete_json_and_leaves_nothing(started: tuple[Started, Path]) -> None:
    done, measured, out = _finished(started, "test_disk_tier_benchmark_tiny_writes_complete_json_and_leaves_nothing")
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
def test_disk_tier_benchmark_quick_trains_with_the_disk_tier_only(started: tuple[Started, Path]) -> None:
    """Part 2 (``--quick``): the tiny GPT completes its steps with the disk tier; without it setup refuses."""
    done, measured, out = _finished(started, "test_disk_tier_benchmark_quick_trains_with_the_disk_tier_only")
    assert "with disk tier:" in done.stdout and "without disk tier: refused at setup" in done.stdout, done.stdout
    training = json.loads(out.read_text())["training"]
    assert training["host_budget_bytes"] < training["optimizer_state_bytes"]
    with_disk, without = training["runs"]
    assert with_disk["completed"] and not without["completed"]
    _check(with_disk, TRAIN_RUN_KEYS, "with disk tier")
    assert with_disk["read_bytes_per_iteration"] == with_disk["written_bytes_per_iteration"] > 0
    assert list(measured.iterdir()) == []
