"""Gradients user code cannot see: ``p.grad`` between a backward and the optimizer step refuses to be used.

[Note: gradients user code cannot see]
The engine moves each parameter's gradient into its family's chunks as it lands and sets ``p.grad`` back to
None ([Note: gradients land per family]); the step reads the chunks. Plain Lightning and plain Fabric leave the
gradient in ``p.grad``, where user code between the backward and the step reads or edits it: an
``on_after_backward`` / ``on_before_optimizer_step`` hook logging ``grad_norm(self, 2)``, a
``configure_gradient_clipping`` calling ``torch.nn.utils.clip_grad_norm_``, a Fabric loop clipping or zeroing a
gradient by hand. Against ``p.grad is None`` such code did nothing, silently: no norm logged, nothing clipped.
So where such code can run (the Trainer: a gradient-reading hook is overridden in the LightningModule or a
callback, manual optimization, several optimizers; Fabric: always, after ``fabric.backward``), each trainable
parameter's ``p.grad`` holds a stand-in of its shape, dtype and device from the backward's end until the step
(or ``zero_grad``, the next backward, an evaluation, the end of training) takes it away. ``p.grad is not None``
holds as in plain PyTorch; any operation on the stand-in (a norm, an in-place edit, a copy) raises
:class:`GradientsInChunksError` naming the parameter and the engine's own ways (Lightning's and Fabric's clipping,
which the engine applies inside the step). Assigning ``p.grad`` a tensor of one's own is refused at the step the
same way. The stand-in owns no memory (a zero-dimensional tensor expanded to the parameter's shape). The stand-ins
also go back after every step (Trainer and Fabric), standing for the gradients the step consumed, which torch keeps in
``p.grad`` until ``zero_grad``: a batch-end hook logging their norm got None before, and logged nothing, silently.

[Note: gradients set to None]
User code may also drop a gradient: ``model.zero_grad()`` or ``p.grad = None`` (to freeze a parameter for one
step). Torch then steps only the parameters that still hold one, and a later backward starts their gradient anew.
The stand-ins show it: a stand-in found None when the engine takes them away was dropped, and the engine forgets
that parameter's gradient in its chunks before anything reads it (``ChunkManager.remove_grad_guard``). After
``optimizer.step()`` the stand-ins stand for the gradients the step consumed: Fabric's model wrapper runs
``nn.Module.zero_grad`` on itself, which sets those to None, and that is how the engine knows a loop zeroes with
``model.zero_grad()`` ([Note: gradients end with the step] in ``optim/step_checks.py``; the modules of the model
itself have their ``zero_grad`` seen directly: [Note: a module's zero_grad] in ``module_zero_grad.py``).
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Any

import torch

from lightning_pstar.runtime.parked import TENSOR_METADATA

__all__ = ["GradientsInChunksError", "GradGuard"]


class GradientsInChunksError(RuntimeError):
    """User code used ``p.grad`` of a parameter whose gradient lives in PatrickStar's chunks."""


_HINT = (
    " HINT: clip with `Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)`, `self.clip_gradients(...)` in"
    " `configure_gradient_clipping` or `fabric.clip_gradients(...)` (the engine clips inside the step;"
    " `fabric.clip_gradients` returns the global norm), and read or change gradients only through them; otherwise"
    " use another strategy for this model."
)


# what ``nn.Module.zero_grad(set_to_none=False)`` does to each ``p.grad``: reads its grad_fn, turns off its
# requires_grad, zeroes it (one foreach call per device and dtype)
_ZEROING_READS = frozenset(
    {
        torch.Tensor.grad_fn.__get__,  # type: ignore[attr-defined,union-attr,unused-ignore]
        torch.Tensor.requires_grad_,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
    }
)
_ZEROING = frozenset({torch._foreach_zero_, torch.Tensor.zero_})
# what ``nn.Module._apply`` (``module.to(...)``, ``.to_empty``, ``.float()``, ``.cpu()``) does to each ``p.grad``:
# converts it and puts the result back. A stand-in for a consumed step's gradients converts to another such stand-in
# (of the new dtype and device), so a module moved or cast between a step and ``zero_grad`` still can be.
_CONVERSIONS = frozenset(
    {
        torch.empty_like,
        torch.Tensor.to,
        torch.Tensor.cpu,
        torch.Tensor.cuda,
        torch.Tensor.float,
        torch.Tensor.half,
        torch.Tensor.bfloat16,
        torch.Tensor.double,
        torch.Tensor.type,
    }
)
_APPLY_READS = frozenset(
    {
        torch._has_compatible_shallow_copy_type,
        torch.Tensor.data.__set__,  # type: ignore[attr-defined,union-attr,unused-ignore]
        torch.Tensor.requires_grad_,
    }
)


class _ChunkGrad(torch.Tensor):
    """The stand-in ``p.grad``: metadata reads work, every other operation raises."""

    _pstar_name: str = "?"
    _pstar_after_step = False  # stands for a gradient a step consumed (Fabric, until zero_grad)
    _pstar_zeroed = False  # zeroed in place since (``zero_grad(set_to_none=False)`` after the step)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in TENSOR_METADATA or func in _ZEROING_READS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        flat = [b for a in args for b in (a if isinstance(a, (list, tuple)) else (a,))]
        after_step = bool(flat) and isinstance(flat[0], _ChunkGrad) and flat[0]._pstar_after_step
        if after_step and func in _APPLY_READS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        if after_step and func in _CONVERSIONS:  # the same conversion of a zero-dimensional tensor: its dtype, device
            this = flat[0]
            with torch._C.DisableTorchFunctionSubclass():
                probe = func(torch.zeros((), dtype=this.dtype, device=this.device), *args[1:], **(kwargs or {}))
                if not isinstance(probe, torch.Tensor):  # ``Tensor.type()`` with no argument: the type's name
                    return probe
                converted = torch.zeros((), dtype=probe.dtype, device=probe.device).expand(this.shape)
            out = converted.as_subclass(_ChunkGrad)
            out._pstar_name, out._pstar_after_step = this._pstar_name, True
            return out
        if func in _ZEROING and flat and all(isinstance(a, _ChunkGrad) and a._pstar_after_step for a in flat):
            for stand_in in flat:  # a step's consumed gradients zeroed in place: as if set to None
                stand_in._pstar_zeroed = True
            return args[0]
        names = [a._pstar_name for a in flat if isinstance(a, _ChunkGrad)] or ["?"]
        what = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
        raise GradientsInChunksError(
            f"PatrickStar keeps gradients in its chunks, not in `p.grad`: the gradient of '{names[0]}' was used"
            f" ({what}) between the backward and the optimizer step (a hook such as `on_after_backward`,"
            " `on_before_optimizer_step` or `configure_gradient_clipping`, or code between `backward` and"
            " `optimizer.step()`), or after the step and before `zero_grad` (a batch-end hook, `on_before_zero_grad`;"
            " plain PyTorch keeps the step's gradients there), where it would have read or changed nothing." + _HINT
        )


class GradGuard:
    """Puts stand-ins into ``p.grad`` of the given parameters and takes them away again."""

    def __init__(self) -> None:
        self._stand_ins: dict[int, _ChunkGrad] = {}  # id(param) -> its stand-in (reused while it fits)
        # (parameter, its stand-in, whether it stands for gradients a step consumed: Fabric, until zero_grad)
        self._guarded: list[tuple[torch.Tensor, _ChunkGrad, bool]] = []

    @property
    def active(self) -> bool:
        return bool(self._guarded)

    def install(self, params: Iterable[tuple[str, torch.Tensor]], *, after_step: bool = False) -> None:
        """Give every parameter in ``params`` (name, parameter) that needs a gradient and holds none a stand-in.
        ``after_step``: for the gradients a step just consumed, which plain PyTorch keeps in ``p.grad`` until
        ``zero_grad`` ([Note: gradients set to None])."""
        for name, param in params:
            if not param.requires_grad or param.grad is not None:
                continue
            stand_in = self._stand_ins.get(id(param))
            if stand_in is None or stand_in.dtype != param.dtype or stand_in.device != param.device:
                base = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
                stand_in = base.as_subclass(_ChunkGrad)
                stand_in._pstar_name = name
                self._stand_ins[id(param)] = stand_in
            stand_in._pstar_after_step, stand_in._pstar_zeroed = after_step, False
            param.grad = stand_in
            self._guarded.append((param, stand_in, after_step))

    def remove(self, params: Container[int] | None = None, *, check: bool = True) -> list[tuple[torch.Tensor, bool]]:
        """Take the stand-ins of ``params`` (ids; default: all) away (the step of their optimizer, ``zero_grad``, the
        next backward ...) and return the parameters whose stand-in user code set to None meanwhile, each with
        whether it stood for a consumed step's gradient (``model.zero_grad()``, ``p.grad = None``: [Note: gradients
        set to None]). ``check``: refuse a ``p.grad`` the user assigned meanwhile (the step would not read it)."""
        if params is None:
            guarded, self._guarded = self._guarded, []
        else:
            guarded = [g for g in self._guarded if id(g[0]) in params]
            self._guarded = [g for g in self._guarded if id(g[0]) not in params]
        assigned, dropped = [], []
        for param, stand_in, after_step in guarded:
            grad = param.grad
            if grad is stand_in and stand_in._pstar_zeroed:  # zeroed in place after the step: as if set to None
                param.grad = None
                dropped.append((param, after_step))
            elif grad is stand_in or after_step and isinstance(grad, _ChunkGrad) and grad._pstar_after_step:
                param.grad = None  # (or its conversion by ``module.to(...)``: ``_CONVERSIONS``)
            elif grad is not None:
                assigned.append(stand_in._pstar_name)
                param.grad = None
            else:
                dropped.append((param, after_step))
        if assigned and check:
            raise GradientsInChunksError(
                f"PatrickStar keeps gradients in its chunks, not in `p.grad`: `p.grad` of {assigned[:3]} was assigned"
                " between the backward and the optimizer step, and the step would not read it." + _HINT
            )
        return dropped
