"""Shared pytest configuration: the ``gpu`` marker, per-test seeding, quiet Lightning output, and the small
filesystem of the disk-full tests."""

from __future__ import annotations

import logging
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

_QUIET_WARNINGS = (
    "ignore:.*does not have many workers.*",
    "ignore:.*GPU available but not used.*",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when torch.cuda is not available")
    if "OMP_NUM_THREADS" not in os.environ:
        # one intra-op thread unless the caller names a count: on a machine running other jobs, threads that
        # wait for each other lose their turns (tests/integration/test_mixed_precision.py took 98 s with two
        # threads and 7 s with one at a load average of 5 on 2 cores). The subprocesses the tests start
        # inherit it, and Lightning's launcher leaves the count alone when the variable is set.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    for line in _QUIET_WARNINGS:
        config.addinivalue_line("filterwarnings", line)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: that holds node names too
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def seed_everything() -> None:
    """Seed Python's and torch's global RNGs before each test, so no test depends on the order.

    The thread count is fixed for the session (one, see ``pytest_configure``): the CPU kernels used here are
    deterministic for a fixed thread count, which is what the bitwise comparisons inside one test rely on.
    Tests that build models seed again right before construction (``tests.helpers.models.build_model``).
    """
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (the disk-full tests), skipped with the reason where the machine cannot mount one."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)
