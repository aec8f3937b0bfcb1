"""The guard against parameters replaced or added on a managed model after setup.

[Note: parameters fixed at setup]
Every parameter the engine manages is a view of its chunk slot, recorded at setup in the parameter table and
in the per-module record lists the hooks fetch by. A parameter assigned afterwards
(``self.layer.weight = nn.Parameter(...)`` in ``training_step``, a module holding parameters attached to the
model, a weight tied by assignment) is not in any chunk: the module would compute with a tensor no chunk
holds, the optimizer would never step it, and the chunk slot it replaced would go stale. Plain Lightning
trains on silently there too (its optimizer does not step the new tensor either).

The engine refuses it where it happens: torch's global registration hooks
(``register_module_parameter_registration_hook``, ``register_module_module_registration_hook``) run on
every ``nn.Module.__setattr__`` of a parameter or a module, before the assignment takes effect, so the
error names the module and attribute at the user's own line, and the model is left as it was. The hooks cost
nothing per forward (they run only when a parameter or module is assigned, anywhere in the process; one
weak-set lookup tells this model's modules from any other) and are removed with the other hooks at
teardown. Re-assigning the parameter a module already holds, or a submodule whose parameters are all
managed, is allowed. Writing ``module._parameters`` directly bypasses torch's hooks and is not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_api

__all__ = ["ParameterGuard"]


class ParameterGuard:
    """Raises when a parameter or a module holding unmanaged parameters is assigned on a managed model."""

    def __init__(self, root: nn.Module, is_managed: Callable[[torch.Tensor], bool]) -> None:
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet(root.modules())
        self._names = {id(m): name or "<root>" for name, m in root.named_modules(remove_duplicate=False)}
        self._is_managed = is_managed  # the engine's own table says which parameters it holds now
        self._handles: list[Any] = []

    def install(self) -> list[Any]:
        """Register the two hooks; returns their handles (removed with the model's other hooks)."""
        guard = weakref.ref(self)  # the hooks are global: they must not keep the engine alive

        def on_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
            g = guard()
            if g is not None:
                g.check_parameter(module, name, param)

        def on_module(module: nn.Module, name: str, submodule: nn.Module) -> None:
            g = guard()
            if g is not None:
                g.check_module(module, name, submodule)

        self._handles = [
            module_api.register_module_parameter_registration_hook(on_parameter),
            module_api.register_module_module_registration_hook(on_module),
        ]
        return self._handles

    def check_parameter(self, module: nn.Module, name: str, param: nn.Parameter) -> None:
        if module not in self._modules or module._parameters.get(name) is param:
            return
        where = self._qualified(module, name)
        what = "replaces the parameter" if name in module._parameters else "adds a parameter"
        if self._is_managed(param):
            what = "re-ties a managed parameter to a new place"
        raise RuntimeError(
            f"PatrickStar: assigning '{where}' after setup {what}. Every parameter lives in a chunk laid out at"
            " setup, so a parameter assigned later would be in no chunk, never stepped by the optimizer, and the"
            " chunk slot it replaced would go stale ([Note: parameters fixed at setup]). HINT: create (and tie)"
            " parameters in `__init__` or `configure_model`; to change a weight's values during training, write"
            " them in place under `torch.no_grad()` (`self.layer.weight.copy_(...)`)."
        )

    def check_module(self, module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        if submodule is None or module not in self._modules:
            return
        new = [n for n, p in submodule.named_parameters() if not self._is_managed(p)]
        if not new:
            return
        where = self._qualified(module, name)
        raise RuntimeError(
            f"PatrickStar: assigning the module '{where}' after setup adds parameters ('{name}.{new[0]}'"
            f"{f' and {len(new) - 1} more' if len(new) > 1 else ''}) that are in no chunk: the optimizer would"
            " never step them ([Note: parameters fixed at setup]). HINT: create submodules in `__init__` or"
            " `configure_model`."
        )

    def _qualified(self, module: nn.Module, name: str) -> str:
        prefix = self._names.get(id(module), type(module).__name__)
        return name if prefix == "<root>" else f"{prefix}.{name}"
