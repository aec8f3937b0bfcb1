"""Shared pytest configuration: the ``gpu`` marker, per-test seeding and quiet Lightning output."""

from __future__ import annotations

import logging
import random

import pytest
import torch

_QUIET_WARNINGS = (
    "ignore:.*does not have many workers.*",
    "ignore:.*GPU available but not used.*",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when torch.cuda is not available")
    for line in _QUIET_WARNINGS:
        config.addinivalue_line("filterwarnings", line)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def seed_everything() -> None:
    """Seed Python's and torch's global RNGs before each test, so no test depends on the order.

    Thread counts stay at their defaults: the CPU kernels used here are deterministic for a fixed
    thread count, which is what the bitwise comparisons inside one test rely on. Tests that build
    models seed again right before construction (``tests.helpers.models.build_model``).
    """
    random.seed(0)
    torch.manual_seed(0)
