"""The CPU-visible parts of the CUDA rules (issue 12): group selection for host tensors, buffers that
allocate nothing until backed, the one-sync norm and finite check, and the module's device bookkeeping."""

from __future__ import annotations

import lightning as L
import torch
import torchmetrics
from torch import nn

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.optim import kernels
from lightning_pstar.runtime.chunk import _backed, _unbacked
from lightning_pstar.runtime.comm import ChunkComm, group_for


def test_host_tensors_take_the_cpu_group_device_tensors_the_main_one() -> None:
    main, cpu = object(), object()
    assert group_for(torch.device("cpu"), main, cpu) is cpu
    assert group_for(torch.device("cuda", 0), main, cpu) is main
    assert group_for(torch.device("meta"), main, cpu) is main
    assert group_for(torch.device("cpu"), main, None) is main  # a gloo world needs no second group
    comm = ChunkComm(rank=0, world_size=1, group=main, cpu_group=cpu)
    assert comm.group_for(torch.zeros(1)) is cpu
    assert comm.group_for(torch.zeros(1, device="meta")) is main


def test_caching_allocator_buffers_start_empty_and_are_backed_in_place() -> None:
    buf = _unbacked(24, torch.float32, torch.device("meta"))  # the CUDA path: nothing allocated, no shape
    assert buf.numel() == 0 and buf.untyped_storage().nbytes() == 0
    storage = buf.untyped_storage()
    assert _backed(buf, 24) is buf
    assert buf.shape == (24,) and buf.untyped_storage().nbytes() == 96
    assert buf.untyped_storage()._cdata == storage._cdata  # same storage: [Note: storage identity]


def test_host_buffers_show_their_shape_and_hold_nothing() -> None:
    buf = _unbacked(24, torch.bfloat16, torch.device("cpu"))
    assert buf.shape == (24,) and buf.untyped_storage().nbytes() == 0
    _backed(buf, 24).fill_(1)
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
