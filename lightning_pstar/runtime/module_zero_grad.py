"""``zero_grad`` on a module of the managed model reaches the engine ([Note: a module's zero_grad])."""

from __future__ import annotations

import types
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from lightning_pstar.runtime.manager import ChunkManager

__all__ = ["ModuleZeroGrad"]


class ModuleZeroGrad:
    """[Note: a module's zero_grad]
    ``nn.Module.zero_grad`` sets each parameter's ``p.grad`` to None. A managed parameter's gradient lives in its
    chunks, not in ``p.grad``, so that would forget nothing: a loop calling ``model.zero_grad()`` instead of
    ``optimizer.zero_grad()`` would then be refused at its next step as one that never zeroes, and Lightning's
    ``on_validation_model_zero_grad`` (a validation inside an accumulation window) would keep gradients plain
    Lightning drops. So each module of the model gets an instance ``zero_grad`` that runs the module's own, then has
    the engine forget its parameters' gradients (``ChunkManager.module_zero_grad``, which tells the optimizers whose
    parameters all went). A deep copy of the module (an EMA model) gets its class's plain ``zero_grad`` instead.
    Removed with the other hooks (``handle.remove()``)."""

    def __init__(self, module: nn.Module, manager: ChunkManager) -> None:
        self.module = module
        self._prior = module.__dict__.get("zero_grad")  # an instance zero_grad of the user's, put back at removal
        module.zero_grad = _EngineZeroGrad(module, module.zero_grad, weakref.ref(manager))  # type: ignore[method-assign]

    def remove(self) -> None:
        if self._prior is not None:
            self.module.__dict__["zero_grad"] = self._prior
        else:
            self.module.__dict__.pop("zero_grad", None)


class _EngineZeroGrad:
    """The instance ``zero_grad`` of :class:`_ModuleZeroGrad` (it holds the engine weakly: [Note: hooks that hold the
    engine])."""

    def __init__(self, module: nn.Module, own: Any, manager_ref: weakref.ref[ChunkManager]) -> None:
        self.module, self.own, self.manager_ref = module, own, manager_ref

    def __call__(self, set_to_none: bool = True) -> None:
        engine = self.manager_ref()
        if engine is not None:  # first: the stand-ins go, so the module's own zero_grad finds no p.grad to zero
            engine.module_zero_grad(self.module)
        self.own(set_to_none)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        copy = memo.get(id(self.module))  # the module's copy, made before its attributes are copied
        if copy is None:
            return self
        return types.MethodType(type(copy).zero_grad, copy)  # a plain zero_grad for the copy
