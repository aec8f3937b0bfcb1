"""Parked parameters: a parameter whose bytes are not its weight for a while refuses every read of its values.

Used by the step pipeline (``optimizer_overlap="next_forward"``) and the disk tier ([Note: disk families] in
``runtime/disk_tier.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch

__all__ = ["TENSOR_METADATA", "ParkedParameterError", "is_parked", "park", "unpark"]


# [Note: parked parameters]
# Under optimizer_overlap="next_forward" a family's step may still run after optimizer.step() returned, until
# the first module that needs the family waits for it. Its parameters' bytes are not weights meanwhile (the
# param slot holds the gradient, or the copy back is on its way), and a read the engine does not see (user code in
# a batch-end hook or in training_step, a parent module using a child's weight) cannot wait. So for that window
# each parameter's class is swapped for a subclass of its own class whose ``__torch_function__`` refuses every
# operation that reads values (metadata such as shape, dtype or device stays readable), with an error naming the
# operation and what to do; the job's end restores the class before anything else touches the parameter. torch
# swaps a parameter's class the same way when it materialises an ``UninitializedParameter``.
#
# [Note: a read that waits]
# A parameter parked by the step pipeline has a way out: its family's job. ``park(..., wait=...)`` registers it,
# and a value read on the thread that parked it (the one that runs the training loop: user code in a batch-end
# hook, in ``training_step``, a parent module using a child's weight, Fabric code between steps) first finishes
# that job through the engine, which restores the parameter's class and points it at its updated weight, then
# runs the operation as asked: the read sees the step's result, exactly as after a step that ended before
# ``optimizer.step()`` returned. Only that thread may finish a job: the bookkeeping after it moves the engine's
# residency, which the training loop's thread owns, so a read from any other thread (a user's thread, a host lane)
# is still refused. A parameter parked without a way out (a master on the disk tier) is refused as before.
# what a tensor says about itself without reading a value: also the stand-in gradients' allowed reads
# ([Note: gradients user code cannot see] in runtime/grad_guard.py)
TENSOR_METADATA = frozenset(
    {
        torch.Tensor.shape.__get__,  # type: ignore[attr-defined,union-attr,unused-ignore]
        torch.Tensor.dtype.__get__,  # type: ignore[attr-defined,union-attr,unused-ignore]
        torch.Tensor.device.__get__,  # type: ignore[attr-defined,union-attr,unused-ignore]
        torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined,union-attr,unused-ignore]
        torch.Tensor.is_leaf.__get__,  # type: ignore[attr-defined,union-attr,unused-ignore]
        torch.Tensor.ndim.__get__,  # type: ignore[attr-defined,union-attr,unused-ignore]
        torch.Tensor.layout.__get__,  # type: ignore[attr-defined,union-attr,unused-ignore]
        torch.Tensor.is_sparse.__get__,  # type: ignore[attr-defined,union-attr,unused-ignore]
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.__hash__,
    }
)
_METADATA = TENSOR_METADATA | {
    # freezing or unfreezing reads no value (``toggle_optimizer``, a callback freezing a layer mid-run)
    torch.Tensor.requires_grad.__set__,  # type: ignore[attr-defined,union-attr,unused-ignore]
    torch.Tensor.requires_grad_,
    torch.Tensor.grad.__get__,  # type: ignore[attr-defined,union-attr,unused-ignore]
    torch.Tensor.grad.__set__,  # type: ignore[attr-defined,union-attr,unused-ignore]
    torch.Tensor._version.__get__,  # type: ignore[attr-defined,union-attr,unused-ignore]
    torch.Tensor.stride,
    torch.Tensor.element_size,
    torch.Tensor.is_contiguous,
    torch.Tensor.data_ptr,
}
# [Note: the address of a parked parameter]
# ``data_ptr()`` is metadata to the engine, but a kernel that takes a tensor by its address (a Triton kernel, a C++
# extension) reads the bytes behind it without any operation torch could route here. So on the thread that may wait
# ([Note: a read that waits]) it waits for the parameter's step first, then answers; elsewhere, and for a parameter
# parked without a way out, it answers as metadata. The engine's own address checks (``new_storage.moved``, the
# quick test in ``ChunkManager.pre_forward``) read it with ``__torch_function__`` disabled, so they never wait.
_ADDRESS = torch.Tensor.data_ptr
_PARKED: dict[type, type] = {}
_NAMES: dict[int, str] = {}  # id of a parked parameter -> its name in the model, for the refusal's message
# id of a parked parameter -> (what ends its parking, the thread that may call it): [Note: a read that waits]
_WAITS: dict[int, tuple[Callable[[], None], int]] = {}


class ParkedParameterError(RuntimeError):
    """A parameter whose optimizer step is still in flight was read outside its module's forward."""


def _parked_class(cls: type) -> type:
    parked = _PARKED.get(cls)
    if parked is None:

        def __torch_function__(klass: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func in _METADATA:
                if func is _ADDRESS:  # [Note: the address of a parked parameter]
                    param = _parked_in(args, kwargs)
                    if param is not None:
                        _wait_for(param)
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **(kwargs or {}))
            name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
            param = _parked_in(args, kwargs)
            if param is not None and _wait_for(param):  # [Note: a read that waits]
                return func(*args, **(kwargs or {}))  # dispatched again: another parked argument waits in turn
            _refuse(name, _NAMES.get(id(param)) if param is not None else None, other_thread=id(param) in _WAITS)

        def waiting(name: str) -> Any:
            """``name`` of the parameter's own class once its parking ended: methods torch does not route through
            ``__torch_function__`` (``as_subclass``) or that would copy the parked class itself (``__deepcopy__``
            and ``__reduce_ex__`` build ``type(self)(...)``: a copy that refuses every read forever)."""

            def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if _wait_for(self):
                    return getattr(self, name)(*args, **kwargs)
                _refuse(f"Tensor.{name}", _NAMES.get(id(self)), other_thread=id(self) in _WAITS)

            return method

        waits = {name: waiting(name) for name in ("as_subclass", "__deepcopy__", "__reduce_ex__")}
        parked = type(f"Parked{cls.__name__}", (cls,), {"__torch_function__": classmethod(__torch_function__), **waits})
        _PARKED[cls] = parked
        _PARKED_CLASSES.add(parked)
    return parked


def _parked_in(args: Any, kwargs: Any) -> torch.Tensor | None:
    """The first parked parameter among an operation's arguments (one level into lists and tuples)."""
    for value in (*args, *(kwargs or {}).values()):
        for item in value if isinstance(value, list | tuple) else (value,):
            if type(item) in _PARKED_CLASSES and id(item) in _NAMES:
                return item
    return None


def _wait_for(param: torch.Tensor) -> bool:
    """End ``param``'s parking by finishing what keeps it parked, where this thread may ([Note: a read that
    waits]); whether it is unparked now."""
    wait = _WAITS.get(id(param))
    if wait is None or wait[1] != threading.get_ident():
        return False
    wait[0]()
    return type(param) not in _PARKED_CLASSES


def _refuse(name: str, param: str | None, *, other_thread: bool = False) -> NoReturn:
    what = f"parameter '{param}'" if param is not None else "a parameter"
    if other_thread:
        raise ParkedParameterError(
            f"PatrickStar: {what} was read ({name}) from another thread than the training loop's while its"
            " optimizer step was still running after optimizer.step() returned (optimizer_overlap"
            " 'next_forward', or 'auto' keeping that schedule): only the training loop's thread may wait for"
            " the step. HINT: read weights from other threads only while the training loop waits for them, or"
            " set optimizer_overlap='pipeline' (the step then ends before optimizer.step() returns)."
        )
    raise ParkedParameterError(
        f"PatrickStar: {what} was read ({name}) while its weight is not in memory: its gradient holds its"
        " slot and its fp32 master is on the disk tier until the step (memory.disk_path), or an operation"
        " read it where the engine cannot tell which parameter it is (nested deeper than a list argument)"
        " while its optimizer step was still running after optimizer.step() returned (optimizer_overlap"
        " 'next_forward'). HINT: read weights after the optimizer step, or set optimizer_overlap='pipeline'"
        " (the step then ends before optimizer.step() returns)."
    )


# [Note: a subclass made of a parked parameter]
# ``torch.Tensor._make_subclass(cls, data)`` (what ``nn.Parameter(p)`` calls) is a static method of the C base
# class that reads ``data``'s storage without ``__torch_function__``: made of a parked parameter, the new tensor
# would hold its gradient or half-copied bytes, silently. The first ``park`` therefore puts a checking wrapper on
# ``torch.Tensor`` (shadowing the base's method): it waits for, or refuses, a parked ``data`` as any read does and
# hands every other call to torch's own method unchanged.
_MAKE_SUBCLASS = torch._C.TensorBase._make_subclass


def _make_subclass(cls: type, data: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if type(data) in _PARKED_CLASSES and not _wait_for(data):
        _refuse("Tensor._make_subclass", _NAMES.get(id(data)), other_thread=id(data) in _WAITS)
    return _MAKE_SUBCLASS(cls, data, *args, **kwargs)


def _guard_make_subclass() -> None:
    if torch.Tensor.__dict__.get("_make_subclass") is None:
        torch.Tensor._make_subclass = staticmethod(_make_subclass)  # type: ignore[method-assign]


def park(
    params: Sequence[torch.Tensor], names: Sequence[str] | None = None, *, wait: Callable[[], None] | None = None
) -> None:
    """Make every value-reading operation on ``params`` raise until :func:`unpark` ([Note: parked parameters]);
    ``names``: theirs in the model, for the refusal's message; ``wait``: what unparks them, which a read on this
    thread calls first instead of raising ([Note: a read that waits])."""
    _guard_make_subclass()
    for i, param in enumerate(params):
        param.__class__ = _parked_class(type(param))
        if names is not None:
            _NAMES[id(param)] = names[i]
        if wait is not None:
            _WAITS[id(param)] = (wait, threading.get_ident())


def unpark(param: torch.Tensor) -> None:
    """Give a parked parameter its own class back."""
    cls = type(param)
    if cls in _PARKED.values():
        param.__class__ = cls.__bases__[0]
        _NAMES.pop(id(param), None)
        _WAITS.pop(id(param), None)


def is_parked(param: torch.Tensor) -> bool:
    """Whether ``param`` is parked."""
    return type(param) in _PARKED_CLASSES


_PARKED_CLASSES: set[type] = set()
