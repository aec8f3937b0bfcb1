"""The CPU-visible parts of the CUDA rules (issue 12): group selection for host tensors, buffers that
allocate nothing until backed, the one-sync norm and finite check, and the module's device bookkeeping."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torchmetrics
from torch import nn

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.optim import kernels
from lightning_pstar.runtime.buffers import backed, unbacked
from lightning_pstar.runtime.comm import ChunkComm, staging_device


def test_every_tensor_takes_the_runs_group_whatever_its_device() -> None:
    """Issue 29: the group comes from the run (its device and backend), the same on every rank, never from one
    tensor's device: a chunk on the host on one rank and on the device on another must meet in one collective."""
    main, cpu = object(), object()
    comm = ChunkComm(rank=0, world_size=1, group=main, cpu_group=cpu)
    assert comm.group_for(torch.zeros(1)) is main
    assert comm.group_for(torch.zeros(1, device="meta")) is main
    cuda = torch.device("cuda", 0)
    assert staging_device(cuda, "nccl") == cuda  # NCCL takes CUDA tensors only: a host tensor travels through it
    assert staging_device(cuda, "gloo") is None
    assert staging_device(torch.device("cpu"), "gloo") is None and staging_device(None, "nccl") is None


def test_a_tensor_off_the_groups_device_is_staged_or_refused() -> None:
    """A blocking collective runs on a copy where the group needs one (here none: a CPU run); an asynchronous one
    refuses a tensor that is not where the run's collectives run, naming the rank and the devices."""
    comm = ChunkComm(rank=0, world_size=1, device=torch.device("cpu"))
    seen: list[torch.device] = []
    value = torch.ones(2)
    comm._in_place(value, lambda t: seen.append(t.device) or t.mul_(3))
    assert seen == [torch.device("cpu")] and value.tolist() == [3.0, 3.0]
    comm._staging[:] = [torch.device("cuda", 0)]  # as an NCCL run finds it
    with pytest.raises(RuntimeError, match=r"rank 0 started a reduce-scatter on a tensor on cpu.*HINT"):
        comm._check_placed(torch.zeros(1), "a reduce-scatter")


def test_caching_allocator_buffers_start_empty_and_are_backed_in_place() -> None:
    buf = unbacked(24, torch.float32, torch.device("meta"))  # the CUDA path: nothing allocated, no shape
    assert buf.numel() == 0 and buf.untyped_storage().nbytes() == 0
    storage = buf.untyped_storage()
    assert backed(buf, 24) is buf
    assert buf.shape == (24,) and buf.untyped_storage().nbytes() == 96
    assert buf.untyped_storage()._cdata == storage._cdata  # same storage: [Note: storage identity]


def test_host_buffers_show_their_shape_and_hold_nothing() -> None:
    buf = unbacked(24, torch.bfloat16, torch.device("cpu"))
    assert buf.shape == (24,) and buf.untyped_storage().nbytes() == 0
    backed(buf, 24).fill_(1)
    assert buf.untyped_storage().nbytes() == 48 and float(buf.sum()) == 24


def test_norm_and_finite_check_match_the_reference_in_one_read() -> None:
    grads = [torch.randn(7), torch.randn(3, 3), torch.randn(5)]
    norms, nonfinite = kernels.local_norms([grads[:2], grads[2:]], check_finite=True, device=torch.device("cpu"))
    finite, total = kernels.read_norm_and_finite(kernels.total_norm(norms), nonfinite)
    reference = torch.nn.utils.get_total_norm(grads, 2.0)
    assert finite and total is not None and torch.equal(total, reference)


def test_finite_check_sees_inf_and_nan_but_not_overflowing_finite_values() -> None:
    device = torch.device("cpu")
    big = [torch.full((4,), 3e38)]  # finite, but its 2-norm overflows fp32
    _, nonfinite = kernels.local_norms([big], check_finite=True, device=device)
    assert kernels.read_norm_and_finite(None, nonfinite)[0]
    for bad in (float("inf"), float("nan")):
        _, nonfinite = kernels.local_norms([[torch.tensor([1.0, bad])]], check_finite=True, device=device)
        assert not kernels.read_norm_and_finite(None, nonfinite)[0]


class _WithMetric(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)
        self.metric = torchmetrics.MeanMetric()


class _OnMeta(PatrickStarStrategy):
    @property
    def root_device(self) -> torch.device:
        return torch.device("meta")  # stands for the accelerator: distinct from the CPU the module starts on


def test_module_device_bookkeeping_follows_the_root_device_and_weights_stay() -> None:
    module = _WithMetric()
    strategy = _OnMeta()
    strategy._move_buffers(module)
    assert module.device == torch.device("meta")
    assert module.metric.device == torch.device("meta")
    assert module.metric.mean_value.device == torch.device("meta")  # torchmetrics states moved
    assert module.layer.weight.device == torch.device("cpu")  # parameters are the chunks' business
    assert module.dtype == torch.float32
