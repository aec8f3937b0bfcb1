"""Models built on the meta device (``fabric.init_module(empty_init=True)``, ``configure_model``) refuse a load.

[Note: loading into a meta model]
A model the strategy has built on the meta device holds no values until setup materialises it into chunks, each
module by its own ``reset_parameters()``. torch's ``load_state_dict`` into a meta parameter copies nothing (it only
warns), so weights loaded before setup (a pretrained file, ``load_from_checkpoint`` inside ``configure_model``)
were silently replaced by a fresh initialisation at setup, where plain Lightning (whose ``empty_init`` makes real,
uninitialised tensors) trains the loaded weights. So every module that gets a meta parameter or buffer while the
context is open has a ``load_state_dict`` pre-hook that refuses, before anything is copied, a non-meta value for a
tensor that is still on the meta device (after setup the module's tensors are real, and the hook lets loads pass).
"""

from __future__ import annotations

import weakref
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["MetaModelLoadError", "meta_device"]


class MetaModelLoadError(RuntimeError):
    """Weights were loaded into a model that is still on the meta device (before the strategy set it up)."""


@contextmanager
def meta_device(where: str) -> Generator[None, None, None]:
    """Build tensors on the meta device; modules given a meta tensor meanwhile refuse a load until set up.
    ``where``: how the user opened the context, for the refusal's message."""
    built: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def registered(module: nn.Module, name: str, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            built.add(module)

    handles = [
        nn.modules.module.register_module_parameter_registration_hook(registered),
        nn.modules.module.register_module_buffer_registration_hook(registered),
    ]
    try:
        with torch.device("meta"):
            yield
    finally:
        for handle in handles:
            handle.remove()
        for module in built:
            module._register_load_state_dict_pre_hook(_RefuseMetaLoad(where), with_module=True)


class _RefuseMetaLoad:
    def __init__(self, where: str) -> None:
        self.where = where

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        own = {**module._parameters, **module._buffers}
        for name, tensor in own.items():
            value = state_dict.get(prefix + name)
            if tensor is None or not tensor.is_meta or not isinstance(value, torch.Tensor) or value.is_meta:
                continue
            raise MetaModelLoadError(
                f"PatrickStar: weights were loaded into '{prefix}{name}' of a model built under {self.where}, which"
                " is on the meta device until the strategy sets it up (it is then initialised by each module's"
                " `reset_parameters()`), so the load would copy nothing and the loaded weights would be lost."
                " HINT: load after setup (Fabric: `fabric.load_raw(path, model)` or `fabric.load`; Trainer:"
                " `ckpt_path=` or in `on_fit_start`), or build the model without the meta device (Fabric:"
                " `fabric.init_module(empty_init=False)`; Trainer: build it in `__init__` instead of"
                " `configure_model`)."
            )
