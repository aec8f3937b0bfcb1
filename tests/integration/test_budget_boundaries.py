"""Issue 31: the setup's figures are the run's figures. A host budget one byte below what setup computes is
refused at setup, naming the figure; the figure itself trains (with accumulation and clipping, in both
precisions), so no budget passes setup and then fails mid-training. The same for the device budget under
``static`` placement (one module's chunks). The capacity planner gives the same host figure.

The model is the one of the report: ~70k parameters, ``host_memory_limit=1280KiB`` with a 1 MiB device budget,
which setup once accepted (estimating the optimizer side only) and which then failed after the first step.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.planning import plan_capacity
from lightning_pstar.planning.requirements import MemoryBudgetError
from tests.helpers import fit
from tests.helpers.data import make_loader
from tests.helpers.models import VOCAB
from tests.helpers.runs import LM

STEPS = 2
ACCUM = 2


def _net(frozen: bool = False) -> nn.Module:
    """~70k parameters; ``frozen``: the embedding and first projection do not train (their param chunks are the
    ones a device budget may evict)."""
    net = nn.Sequential(
        nn.Embedding(VOCAB, 64),
        nn.Linear(64, 256),
        nn.GELU(),
        nn.Linear(256, 64),
        nn.Linear(64, 256),
        nn.GELU(),
        nn.Linear(256, 64),
        nn.Linear(64, VOCAB),
    )
    if frozen:
        net[0].requires_grad_(False)
        net[1].requires_grad_(False)
    return net


def _run(precision: str, frozen: bool, **options: Any) -> None:
    module = LM(lambda: _net(frozen))
    strategy = PatrickStarStrategy(**options)
    fit(
        module,
        strategy=strategy,
        loader=make_loader(n_seq=4 * ACCUM * STEPS),
        precision=precision,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=0.5,
    )
    assert module.trainer.global_step == STEPS


def _host_need(precision: str, frozen: bool, **options: Any) -> int:
    """The host figure setup names when refusing a one-byte host budget."""
    with pytest.raises(MemoryBudgetError, match="host_memory_limit is 1 byte") as info:
        _run(precision, frozen, host_memory_limit=1, **options)
    found = re.search(r"leaves ([\d,]+) bytes", str(info.value))
    assert found is not None, str(info.value)
    return int(found.group(1).replace(",", ""))


CASES = [
    # the report's case: auto placement with a device budget, every family steps on the host
    pytest.param({"device_memory_limit": "1MiB"}, False, id="auto"),
    # static placement with a share too small for the model data: frozen chunks are evicted, the others step
    # on the host
    pytest.param(
        {"device_memory_limit": 160 * 1024, "placement": "static", "chunk_size": 8192}, True, id="static-frozen"
    ),
]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize(("options", "frozen"), CASES)
def test_a_host_budget_is_refused_at_setup_or_trains(precision: str, options: dict[str, Any], frozen: bool) -> None:
    need = _host_need(precision, frozen, **options)
    with pytest.raises(MemoryBudgetError, match=f"leaves {need:,} bytes .* host_memory_limit is {need - 1:,} bytes"):
        _run(precision, frozen, host_memory_limit=need - 1, **options)
    _run(precision, frozen, host_memory_limit=need, **options)


def test_the_report_case_is_refused_at_setup_with_the_figures() -> None:
    """``host_memory_limit=1280KiB, device_memory_limit=1MiB`` on the ~70k-parameter model: refused before
    anything changes, with the parts of the host need named."""
    module = LM(_net)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.raises(MemoryBudgetError) as info:
        fit(
            module,
            strategy=PatrickStarStrategy(host_memory_limit="1280KiB", device_memory_limit="1MiB"),
            loader=make_loader(n_seq=8),
            max_steps=1,
        )
    message = str(info.value)
    assert "host_memory_limit is 1,310,720 bytes" in message
    assert "param chunks" in message and "optimizer states" in message and "HINT" in message
    for name, param in module.named_parameters():
        assert torch.equal(param.detach(), before[name])


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_planner_gives_the_setup_figure(precision: str) -> None:
    """The capacity planner prices the run with the same function (``planning/tiers.py``): same host need."""
    options = {"device_memory_limit": 160 * 1024, "placement": "static", "chunk_size": 8192}
    need = _host_need(precision, True, **options)
    plan = plan_capacity(
        lambda: _net(frozen=True),
        device_memory=160 * 1024,
        host_memory=need,
        precision=precision,
        chunk_size=8192,
        optimizer="adamw",
        accumulate_grad_batches=ACCUM,
        placement="static",
        device_type="cpu",
        search_largest=False,
    )
    assert plan.host_model_data_bytes == need and plan.fits
    short = plan_capacity(
        lambda: _net(frozen=True),
        device_memory=160 * 1024,
        host_memory=need - 1,
        precision=precision,
        chunk_size=8192,
        optimizer="adamw",
        accumulate_grad_batches=ACCUM,
        placement="static",
        device_type="cpu",
        search_largest=False,
    )
    assert not short.fits


def test_the_device_budget_of_one_module_trains_under_static_and_one_byte_less_is_refused() -> None:
    """The device boundary: the bytes one module's chunks need trains; one byte less is refused at setup."""
    options: dict[str, Any] = {"placement": "static", "chunk_size": 8192, "host_memory_limit": "64MiB"}
    with pytest.raises(MemoryBudgetError, match="device_memory_limit is too small") as info:
        _run("32-true", False, device_memory_limit=1000, **options)
    found = re.search(r"needs parameter chunks of ([\d,]+) bytes", str(info.value))
    assert found is not None
    need = int(found.group(1).replace(",", ""))
    with pytest.raises(MemoryBudgetError, match=f"needs parameter chunks of {need:,} bytes"):
        _run("32-true", False, device_memory_limit=need - 1, **options)
    _run("32-true", False, device_memory_limit=need, **options)


def _mostly_frozen() -> nn.Module:
    """The same net with only its output layer trainable: most param chunks are frozen ones, which stay on the
    device as far as the room chunks get allows."""
    net = _net()
    for layer in list(net)[:-1]:
        layer.requires_grad_(False)
    return net


def _run_frozen(device: int, host: int, batch_size: int = 64) -> LM:
    module = LM(_mostly_frozen)
    strategy = PatrickStarStrategy(device_memory_limit=device, host_memory_limit=host, chunk_size=8192)
    fit(module, strategy=strategy, loader=make_loader(n_seq=2 * batch_size, batch_size=batch_size), max_steps=2)
    return module


def _named_need(err: BaseException, pattern: str) -> int:
    found = re.search(pattern, str(err))
    assert found is not None, str(err)
    return int(found.group(1).replace(",", ""))


@pytest.mark.parametrize("device", [620_000, 700_000, 1_000_000])
def test_activations_that_squeeze_the_chunks_are_refused_before_the_first_step(device: int) -> None:
    """Under 'auto' the activations (batch 64: ~0.5 MB here) leave chunks less of the device after the warm-up
    than the warm-up's share setup counted on: at a host budget of the setup's figure the run either trains or is
    refused at the warm-up's optimizer step, before it changes anything, naming the figure that trains; it never
    fails mid-training (the runtime's own "host budget exceeded")."""
    with pytest.raises(MemoryBudgetError) as info:
        _run_frozen(device, 1)
    need = _named_need(info.value, r"leaves ([\d,]+) bytes")
    try:
        _run_frozen(device, need)
        return
    except MemoryBudgetError as err:
        message = str(err)
    assert "too small for this model's iteration" in message and "optimizer step did not run" in message, message
    module = LM(_mostly_frozen)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    with pytest.raises(MemoryBudgetError, match="optimizer step did not run"):
        fit(
            module,
            strategy=PatrickStarStrategy(device_memory_limit=device, host_memory_limit=need, chunk_size=8192),
            loader=make_loader(n_seq=128, batch_size=64),
            max_steps=2,
        )
    for name, param in module.named_parameters():
        assert torch.equal(param.detach().cpu(), before[name]), name
    _run_frozen(device, _named_need(message, r"the host must hold ([\d,]+) bytes"))
