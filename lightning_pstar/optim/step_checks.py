"""What :class:`~lightning_pstar.optim.optimizer.ChunkedOptimizer` refuses, at setup and at a step, before anything
changes: each function raises with what was wrong and what to do, or returns where nothing is.

At setup: an optimizer class or option the fused chunk kernels cannot run, a tensor that is not the model's. At a
step: options turned on since setup, parameters unfrozen since setup, and the patterns where torch would step with
gradients the engine no longer has ([Note: gradients end with the step]).

[Note: gradients end with the step]
A step's gradients go with it (in mixed precision the parameter's slot that holds them becomes the new weight).
torch keeps them in ``p.grad`` until ``zero_grad``, so two patterns differ from plain PyTorch: a step with no
``zero_grad`` since the last one, which torch runs with the sum of both backwards' gradients (a loop that never
zeroes, an ``optimizer_zero_grad`` override that zeroes every other batch), and a second ``step()`` with neither a
backward nor ``zero_grad`` since, which torch runs with the kept gradients once more. Both are refused before
anything changes (:func:`refuse_sum_across_steps`, :func:`refuse_step_again`), rather than silently stepping with
this backward's gradients alone or not at all.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer

from lightning_pstar.runtime.family import ChunkFamily, ParamRecord
from lightning_pstar.runtime.manager import ChunkManager

__all__ = [
    "check_options",
    "check_supported",
    "refuse_kept_zeros",
    "refuse_momentum_turned_on",
    "refuse_step_again",
    "refuse_sum_across_steps",
    "refuse_unfrozen",
    "refuse_unsupported_flags",
    "unsupported_flags",
]

log = logging.getLogger(__name__)


def check_supported(optimizer: Optimizer, supported: Sequence[type[Optimizer]]) -> None:
    """Refuse an optimizer class the chunk kernels do not implement."""
    if type(optimizer) not in supported:
        names = ", ".join(f"torch.optim.{c.__name__}" for c in supported)
        raise TypeError(
            f"PatrickStar cannot run optimizer {type(optimizer).__module__}.{type(optimizer).__qualname__}."
            f" Supported: {names}. HINT: return one of these from `configure_optimizers` (under Fabric: pass one"
            " to `fabric.setup`)."
        )


def unsupported_flags(group: dict[str, Any]) -> list[str]:
    """The options of ``group`` set to True that the fused chunk kernels cannot honour."""
    return [k for k in ("amsgrad", "capturable", "differentiable") if group.get(k)]


def check_options(optimizer: Optimizer, manager: ChunkManager) -> None:
    """Refuse options the fused chunk kernels cannot honour, and tensors that are not the model's."""
    for gi, group in enumerate(optimizer.param_groups):
        flags = unsupported_flags(group)
        if flags:
            raise ValueError(
                f"{type(optimizer).__name__}({flags[0]}=True) in param group {gi} is not supported by"
                f" PatrickStar. HINT: set {flags[0]}=False."
            )
        if group.get("foreach") or group.get("fused") is False:
            log.warning(
                "PatrickStar always uses torch's fused optimizer kernels; the foreach/fused setting of"
                " param group %d is ignored.",
                gi,
            )
        for p in group["params"]:
            if manager.is_host_param(p):
                continue
            try:
                manager.record_of(p)
            except KeyError:
                raise ValueError(
                    f"Param group {gi} of {type(optimizer).__name__} holds a tensor of shape {tuple(p.shape)}"
                    " that is not a parameter of the LightningModule. HINT: build the optimizer from"
                    " `self.parameters()` inside `configure_optimizers` (under Fabric: from the parameters of the"
                    " model given to `fabric.setup`)."
                ) from None


def refuse_unsupported_flags(param_groups: Sequence[dict[str, Any]]) -> None:
    """An option :func:`check_options` refused at setup, set on a group since then (the step would ignore it)."""
    for gi, group in enumerate(param_groups):
        flags = unsupported_flags(group)
        if flags:
            raise ValueError(
                f"PatrickStar: {flags[0]}=True was set in param group {gi} during the run; PatrickStar's fused"
                f" chunk kernels do not support it, and would step without it. Nothing was stepped. HINT: leave"
                f" {flags[0]}=False."
            )


def refuse_momentum_turned_on(param_groups: Sequence[dict[str, Any]]) -> None:
    """SGD momentum set where the optimizer had none in every group at setup: no momentum buffers were laid out."""
    if any(g["momentum"] != 0 for g in param_groups):
        raise RuntimeError(
            "PatrickStar: SGD momentum was turned on during the run, but the optimizer had momentum=0 in every"
            " param group at setup, so no momentum buffers were laid out. Nothing was stepped. HINT: create the"
            " SGD with the momentum it will use (a scheduler may change it, and set it to 0 where it is off)."
        )


def refuse_kept_zeros(missing: Sequence[ParamRecord]) -> None:
    """Parameters whose gradient ``zero_grad(set_to_none=False)`` kept as zeros and that got none since: torch steps
    them with a zero gradient (momentum and weight decay move them); the engine would not."""
    if missing:
        names = ", ".join(f"'{r.names[0]}'" for r in missing[:5])
        raise RuntimeError(
            f"PatrickStar: parameter(s) {names} got no gradient since `zero_grad(set_to_none=False)` kept"
            " theirs as zeros; torch would step them with a zero gradient (momentum and weight decay move"
            " them), which PatrickStar does not. Nothing was stepped. HINT: use `zero_grad()` (torch's"
            " default set_to_none=True), with which torch skips them too."
        )


def refuse_unfrozen(records: Sequence[ParamRecord]) -> None:
    """A parameter of the optimizer's groups frozen at setup was unfrozen since: plain PyTorch would step it, but
    the engine laid out gradients, fp32 masters and optimizer states for the trainable parameters only, so its
    gradient reaches no chunk; refused, before the step changes anything, rather than never trained."""
    names = ", ".join(f"'{r.names[0]}'" for r in records[:5]) + (" ..." if len(records) > 5 else "")
    raise RuntimeError(
        f"PatrickStar: parameter(s) {names} had requires_grad=False when the strategy set up and are trainable"
        " now; PatrickStar lays out gradients, fp32 masters and optimizer states for the parameters trainable at"
        " setup, so the optimizer would never step them (plain PyTorch would). HINT: set requires_grad before"
        " `fit` / `fabric.setup` (freeze with `requires_grad_(False)` later instead, which works), or train in"
        " two runs, resuming from a checkpoint with the new parameters trainable."
    )


def refuse_sum_across_steps(families: Sequence[ChunkFamily]) -> None:
    """A step with no ``zero_grad`` since the last one ([Note: gradients end with the step])."""
    name = families[0].records[0].names[0]
    raise RuntimeError(
        f"PatrickStar: optimizer.step() was called without `zero_grad()` since the last step, so plain PyTorch"
        f" would add the last step's gradients to these (parameters such as '{name}'). PatrickStar frees"
        " gradients at each step and cannot add them. HINT: call `optimizer.zero_grad()` between steps (do not"
        " override `optimizer_zero_grad` to keep gradients); accumulate gradients over several backward calls"
        " before one step instead (`accumulate_grad_batches`, or several `manual_backward` calls)."
    )


def refuse_step_again(records: Sequence[ParamRecord]) -> None:
    """A second ``step()`` with neither a backward nor ``zero_grad`` since the last one ([Note: gradients end with
    the step])."""
    name = records[0].names[0] if records else "?"
    raise RuntimeError(
        "PatrickStar: optimizer.step() was called again with neither a backward nor `zero_grad()` since the last"
        f" step, so plain PyTorch would step once more with the last step's gradients (parameters such as"
        f" '{name}'). PatrickStar frees gradients at each step and cannot step with them again. Nothing was"
        " stepped. HINT: step once per backward (an `optimizer_step` override must not call `optimizer.step()`"
        " twice); to repeat an update, run the backward again first."
    )
