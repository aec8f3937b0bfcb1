"""Module and gradient hooks that turn the model's execution into chunk-manager calls.

- pre-forward of module M: M's chunks become resident, its slots go to ``COMPUTE``;
- post-forward of M: slots go to ``HOLD_AFTER_FWD`` (``HOLD`` without autograd), chunks may be evicted;
  a multi-grad hook on M's outputs marks the start of M's backward;
- pre-backward of M: chunks resident again (same storage: see the note in ``chunk.py``);
- post-backward of M (a grad hook on M's inputs): slots still in ``COMPUTE`` leave it, so the chunks of a
  tied weight whose gradient is not final yet are not pinned for the rest of the backward;
- gradient of p final (``register_post_accumulate_grad_hook``): the chunk manager stores it in the slot;
- BatchNorm in mixed precision: running statistics in the compute dtype during its forward (see below).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_pstar.chunk_manager import ChunkManager, ParamRecord
from lightning_pstar.memory_tracer import MomentKind
from lightning_pstar.state import TensorState

__all__ = ["ModelHooks"]


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors that require grad anywhere inside a (nested) output or input structure."""
    found: list[torch.Tensor] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                found.append(x)
        elif isinstance(x, (list, tuple)):
            for item in x:
                visit(item)
        elif isinstance(x, dict):
            for item in x.values():
                visit(item)
        elif hasattr(x, "__dataclass_fields__"):
            for name in x.__dataclass_fields__:
                visit(getattr(x, name))

    visit(obj)
    return found


class ModelHooks:
    """Installs and removes every hook the engine needs on one model."""

    def __init__(self, manager: ChunkManager) -> None:
        self.manager = manager
        self._handles: list[Any] = []
        self._stats_stash: dict[nn.Module, dict[str, torch.Tensor]] = {}  # fp32 running stats during a forward

    def install(self) -> None:
        for index, (module, records) in enumerate(self.manager.module_records.items()):
            self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(index, records)))
            self._handles.append(module.register_forward_hook(self._make_post_forward(index, records)))
        for record in self.manager.records:
            if record.trainable:
                self._handles.append(record.param.register_post_accumulate_grad_hook(self._make_grad_hook(record)))
        if self.manager.mixed:
            for module in self.manager.module_records:
                if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
                    self._handles.append(module.register_forward_pre_hook(self._stats_in_compute_dtype))
                    self._handles.append(module.register_forward_hook(self._stats_back_to_buffers))
        host = {id(p) for p in self.manager.host_params.values()}
        for module in self.manager.module.modules():
            if isinstance(module, nn.Embedding) and id(module.weight) in host:
                self._handles.append(module.register_forward_pre_hook(self._host_lookup_input))
                self._handles.append(module.register_forward_hook(self._host_lookup_output))

    # ---- cpu_embedding: the lookup runs on the host, only its output moves ------------------------------
    @staticmethod
    def _host_lookup_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.to("cpu") if isinstance(a, torch.Tensor) else a for a in args)

    def _host_lookup_output(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        manager = self.manager
        return output.to(device=manager.device, dtype=manager.compute_dtype)

    # ---- running statistics of BatchNorm in mixed precision ---------------------------------------------
    # A BatchNorm's weight and bias live in the chunks in the compute dtype while its running statistics stay
    # fp32 buffers (as in plain Lightning's mixed precision, and in checkpoints). torch's CPU kernel refuses a
    # bf16 weight next to fp32 running statistics ("expected scalar type BFloat16 but found Float"), so during
    # the module's forward it sees compute-dtype copies of its statistics; in training the updated values are
    # copied back into the fp32 buffers (in eval they are only read).
    def _stats_in_compute_dtype(self, module: nn.Module, args: Any) -> None:
        self._stats_back_to_buffers(module)  # a forward interrupted before its post-hook (checkpoint early stop)
        dtype = self.manager.compute_dtype
        stash: dict[str, torch.Tensor] = {}
        for name in ("running_mean", "running_var"):
            buf = module._buffers.get(name)
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                stash[name] = buf
                module._buffers[name] = buf.to(dtype)
        if stash:
            self._stats_stash[module] = stash

    def _stats_back_to_buffers(self, module: nn.Module, *_: Any) -> None:
        for name, buf in self._stats_stash.pop(module, {}).items():
            current = module._buffers[name]
            if module.training and current is not None:
                with torch.no_grad():
                    buf.copy_(current)
            module._buffers[name] = buf

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in list(self._stats_stash):  # a forward that raised: hand back the fp32 statistics
            self._stats_back_to_buffers(module)

    # ---- factories (closures keep the per-module record list; nothing is stored on the module) --------
    def _make_pre_forward(self, index: int, records: Sequence[ParamRecord]) -> Any:
        manager = self.manager
        moment = (MomentKind.FORWARD, index)

        def pre_forward(module: nn.Module, args: Any) -> None:
            with torch.profiler.record_function("pstar::pre_forward"):
                manager.access(records, TensorState.COMPUTE, moment if torch.is_grad_enabled() else None)
            if torch.is_grad_enabled():
                inputs = _grad_tensors(args)
                if inputs:
                    # fires once the module's backward has produced the gradient of its inputs: its
                    # chunks may move again (a tied weight waits for its gradient elsewhere, unpinned)
                    self._register(inputs, lambda: manager.post_backward(records))

        return pre_forward

    def _make_post_forward(self, index: int, records: Sequence[ParamRecord]) -> Any:
        manager = self.manager
        moment = (MomentKind.BACKWARD, index)

        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            outputs = _grad_tensors(output) if torch.is_grad_enabled() else []
            if outputs:
                manager.release(records, TensorState.HOLD_AFTER_FWD)

                def pre_backward() -> None:
                    with torch.profiler.record_function("pstar::pre_backward"):
                        manager.access(records, TensorState.COMPUTE, moment)

                self._register(outputs, pre_backward)
            else:
                manager.release(records, TensorState.HOLD)

        return post_forward

    def _make_grad_hook(self, record: ParamRecord) -> Any:
        manager = self.manager

        def grad_hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is None:  # pragma: no cover - autograd calls the hook only after accumulating a gradient
                return
            with torch.profiler.record_function("pstar::grad_ready"):
                manager.grad_ready(record, grad)
            param.grad = None  # the chunk holds it now; free autograd's copy

        return grad_hook

    @staticmethod
    def _register(tensors: list[torch.Tensor], fn: Any) -> RemovableHandle:
        fired = False

        def once(_grads: Any) -> None:
            nonlocal fired
            if not fired:
                fired = True
                fn()

        return torch.autograd.graph.register_multi_grad_hook(tensors, once, mode="any")
