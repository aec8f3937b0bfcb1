"""Parked parameters ([Note: parked parameters], [Note: a read that waits] and [Note: a subclass made of a parked
parameter] in ``runtime/parked.py``): a read on the thread that parked them finishes what keeps them parked and then
reads the new weight; a read anywhere else, or of a parameter with no way out, raises naming it."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
from torch import nn

from lightning_pstar.runtime.parked import ParkedParameterError, is_parked, park, unpark


class _Step:
    """What a step in flight does to the parked weight: writes its update, then unparks it (the job's end)."""

    def __init__(self, param: torch.Tensor, new: torch.Tensor) -> None:
        self.param, self.new, self.calls = param, new, 0

    def __call__(self) -> None:
        self.calls += 1
        with torch.no_grad():
            _raw(self.param).copy_(self.new)
        unpark(self.param)


def _raw(param: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return param.detach()


READS = {
    "sum": lambda w: w.sum(),
    "detach_clone": lambda w: w.detach().clone(),
    "data": lambda w: w.data.clone(),
    "add": lambda w: w + 0,
    "list_arg": lambda w: torch.cat([w.flatten(), w.flatten()])[: w.numel()].view_as(w),
    "as_subclass": lambda w: w.as_subclass(torch.Tensor).clone(),
    "make_subclass": lambda w: torch.Tensor._make_subclass(torch.Tensor, w).clone(),
    "deepcopy": copy.deepcopy,
    "save_load": lambda w: _save_load(w),
}


def _save_load(value: torch.Tensor) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # type: ignore[no-any-return]


@pytest.mark.parametrize("read", sorted(READS))
def test_a_read_on_the_parking_thread_waits_for_the_new_weight(read: str) -> None:
    layer = nn.Linear(3, 2)
    new = torch.randn_like(layer.weight)
    step = _Step(layer.weight, new)
    park([layer.weight], ["weight"], wait=step)
    assert layer.weight.shape == (2, 3) and step.calls == 0  # metadata reads do not wait
    try:
        got = READS[read](layer.weight)
    finally:
        unpark(layer.weight)
    assert step.calls == 1 and not is_parked(layer.weight) and type(layer.weight) is nn.Parameter
    assert torch.equal(got, new.sum() if read == "sum" else new), read
    assert not is_parked(got) and type(got) in (torch.Tensor, nn.Parameter)  # never a copy of the parked class


def test_a_read_from_another_thread_is_refused() -> None:
    layer = nn.Linear(3, 2)
    step = _Step(layer.weight, torch.zeros_like(layer.weight))
    park([layer.weight], ["encoder.weight"], wait=step)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            layer.weight.sum()
        except BaseException as error:  # noqa: BLE001 - the test reads it
            errors.append(error)

    try:
        thread = threading.Thread(target=read)
        thread.start()
        thread.join()
        assert len(errors) == 1 and isinstance(errors[0], ParkedParameterError)
        assert "'encoder.weight'" in str(errors[0]) and "another thread" in str(errors[0]) and "HINT" in str(errors[0])
        assert step.calls == 0 and is_parked(layer.weight)  # nothing was finished from that thread
    finally:
        unpark(layer.weight)


def test_a_parameter_without_a_way_out_is_refused() -> None:
    """Parked without ``wait`` (a master on the disk tier): every read raises, naming it, and nothing changes."""
    layer = nn.Linear(3, 2)
    before = _raw(layer.weight).clone()
    park([layer.weight], ["head.weight"])
    try:
        for read in ("sum", "make_subclass", "as_subclass", "deepcopy", "save_load"):
            with pytest.raises(ParkedParameterError, match=r"'head\.weight'.*disk tier.*HINT"):
                READS[read](layer.weight)
        assert is_parked(layer.weight)
    finally:
        unpark(layer.weight)
    assert torch.equal(layer.weight.detach(), before)


def test_a_wait_that_leaves_it_parked_is_refused_not_retried() -> None:
    """A way out that does not unpark (a failed job's bookkeeping) must not loop: the read raises."""
    layer = nn.Linear(3, 2)
    calls = []
    park([layer.weight], ["weight"], wait=lambda: calls.append(1))
    try:
        with pytest.raises(ParkedParameterError, match="'weight'"):
            layer.weight.sum()
        assert calls == [1]
    finally:
        unpark(layer.weight)


def test_two_parked_arguments_each_wait() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    new_a, new_b = torch.randn(2, 2), torch.randn(2, 2)
    step_a, step_b = _Step(a.weight, new_a), _Step(b.weight, new_b)
    park([a.weight], ["a.weight"], wait=step_a)
    park([b.weight], ["b.weight"], wait=step_b)
    try:
        got = torch.add(a.weight, b.weight)
    finally:
        unpark(a.weight)
        unpark(b.weight)
    assert step_a.calls == step_b.calls == 1
    assert torch.equal(got, new_a + new_b)


def test_parameters_made_of_unparked_tensors_are_untouched() -> None:
    """The guard on ``_make_subclass`` hands every other call to torch's own method unchanged."""
    park([nn.Linear(1, 1).weight])  # installs the guard
    base = torch.arange(4.0)
    param = nn.Parameter(base, requires_grad=False)
    assert type(param) is nn.Parameter and not param.requires_grad and param.data_ptr() == base.data_ptr()


def test_a_parameter_made_of_a_parked_one_raises() -> None:
    """``nn.Parameter(p)`` of a parked ``p`` takes torch's path for tensor subclasses (``detach``, which waits): the
    type check that follows fails loudly; never a parameter holding the in-flight bytes."""
    layer = nn.Linear(3, 2)
    step = _Step(layer.weight, torch.zeros_like(layer.weight))
    park([layer.weight], ["weight"], wait=step)
    try:
        with pytest.raises(RuntimeError, match=r"Parameter from an instance.*detach\(\) returns"):
            nn.Parameter(layer.weight)
    finally:
        unpark(layer.weight)


def test_the_address_waits_on_the_parking_thread() -> None:
    """``data_ptr()`` is how a Triton kernel or a C++ extension takes a tensor: on the thread that may wait it waits
    for the step first ([Note: the address of a parked parameter]); without a way out it stays metadata."""
    layer = nn.Linear(3, 2)
    step = _Step(layer.weight, torch.ones_like(layer.weight))
    park([layer.weight], ["weight"], wait=step)
    try:
        address = layer.weight.data_ptr()
        assert step.calls == 1 and not is_parked(layer.weight)
        assert address == _raw(layer.weight).data_ptr() and torch.equal(layer.weight.detach(), torch.ones(2, 3))
    finally:
        unpark(layer.weight)
    other = nn.Linear(3, 2)
    park([other.weight], ["other.weight"])  # a master on the disk tier: the address is metadata
    try:
        assert other.weight.data_ptr() == _raw(other.weight).data_ptr() and is_parked(other.weight)
    finally:
        unpark(other.weight)
