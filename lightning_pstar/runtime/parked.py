"""Parked parameters: a parameter whose bytes are not its weight for a while refuses every read of its values.

Used by the step pipeline (``optimizer_overlap="next_forward"``) and the disk tier ([Note: disk families] in
``runtime/disk_tier.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
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
_PARKED: dict[type, type] = {}
_NAMES: dict[int, str] = {}  # id of a parked parameter -> its name in the model, for the refusal's message


class ParkedParameterError(RuntimeError):
    """A parameter whose optimizer step is still in flight was read outside its module's forward."""


def _parked_class(cls: type) -> type:
    parked = _PARKED.get(cls)
    if parked is None:

        def __torch_function__(klass: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func in _METADATA:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **(kwargs or {}))
            _refuse(getattr(func, "__qualname__", getattr(func, "__name__", repr(func))), _parked_in(args, kwargs))

        def as_subclass(self: torch.Tensor, cls: type) -> Any:  # torch does not route it through the above
            _refuse("Tensor.as_subclass", _NAMES.get(id(self)))

        parked = type(
            f"Parked{cls.__name__}",
            (cls,),
            {"__torch_function__": classmethod(__torch_function__), "as_subclass": as_subclass},
        )
        _PARKED[cls] = parked
        _PARKED_CLASSES.add(parked)
    return parked


def _parked_in(args: Any, kwargs: Any) -> str | None:
    """The name of the first parked parameter among an operation's arguments (one level into lists and tuples)."""
    for value in (*args, *(kwargs or {}).values()):
        for item in value if isinstance(value, list | tuple) else (value,):
            if type(item) in _PARKED_CLASSES and id(item) in _NAMES:
                return _NAMES[id(item)]
    return None


def _refuse(name: str, param: str | None) -> NoReturn:
    what = f"parameter '{param}'" if param is not None else "a parameter"
    raise ParkedParameterError(
        f"PatrickStar: {what} was read ({name}) while its weight is not in memory: its optimizer step"
        " was still running after optimizer.step() returned (optimizer_overlap='next_forward'), outside its"
        " own module's forward, which is where the engine waits for it; or its gradient holds its slot and"
        " its fp32 master is on the disk tier until the step (memory.disk_path). HINT: read weights inside"
        " their module's forward or after the optimizer step, or set optimizer_overlap='auto' (the step then"
        " ends before optimizer.step() returns)."
    )


def park(params: Sequence[torch.Tensor], names: Sequence[str] | None = None) -> None:
    """Make every value-reading operation on ``params`` raise until :func:`unpark` ([Note: parked parameters]);
    ``names``: theirs in the model, for the refusal's message."""
    for i, param in enumerate(params):
        param.__class__ = _parked_class(type(param))
        if names is not None:
            _NAMES[id(param)] = names[i]


def unpark(param: torch.Tensor) -> None:
    """Give a parked parameter its own class back."""
    cls = type(param)
    if cls in _PARKED.values():
        param.__class__ = cls.__bases__[0]
        _NAMES.pop(id(param), None)


def is_parked(param: torch.Tensor) -> bool:
    """Whether ``param`` is parked."""
    return type(param) in _PARKED_CLASSES


_PARKED_CLASSES: set[type] = set()
