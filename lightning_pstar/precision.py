"""PatrickStarPrecision: compute dtype, autocast, dynamic loss scaling, unscale, inf check, clipping.

In ``16-mixed`` and ``bf16-mixed`` the model's parameters are compute-dtype copies of fp32 master weights
that live in chunks; the forward runs under ``torch.autocast``. ``32-true`` trains in fp32 throughout.
The gradient arithmetic itself (unscale, clip, update) runs inside the chunked optimizer's step, which
this plugin configures through :class:`~lightning_pstar.optim.GradientPolicy`.

:class:`ChunkPrecision` holds what the Trainer's plugin (:class:`PatrickStarPrecision`, here) and Fabric's
(:class:`PatrickStarFabricPrecision`, here too) share: the compute dtype, autocast, the loss
scale and its update, clipping set for the next step, and their state; each glue adds only its own hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import Self, override

from lightning_pstar.config import SUPPORTED_PRECISIONS, LossScaleConfig
from lightning_pstar.optim import ChunkedOptimizer

__all__ = ["ChunkPrecision", "PatrickStarFabricPrecision", "PatrickStarPrecision", "SUPPORTED_PRECISIONS"]

_DTYPES = dict(zip(SUPPORTED_PRECISIONS, (torch.float16, torch.bfloat16, torch.float32), strict=True))


def _lightning_precisions() -> tuple[type, ...]:
    """The plugins Lightning and Fabric make from a precision string: each becomes a PatrickStar plugin of the same
    precision (the unsupported ones are refused by its constructor, naming the precision)."""
    from lightning.fabric.plugins import precision as fabric
    from lightning.pytorch.plugins import precision as trainer

    return (
        Precision,
        FabricPrecision,
        trainer.MixedPrecision,
        fabric.MixedPrecision,
        trainer.HalfPrecision,
        fabric.HalfPrecision,
        trainer.DoublePrecision,
        fabric.DoublePrecision,
    )


def _loss_scale_of(scaler: Any, loss_scale: LossScaleConfig | None) -> LossScaleConfig | None:
    """The loss scaling a ``MixedPrecision(..., scaler=GradScaler(...))`` asks for, as the strategy's option: a
    scaler with torch's defaults leaves ``loss_scale`` as it is; one of the user's own sets it, unless the strategy's
    option says otherwise (refused, naming both); a disabled one (fp16 without scaling) is refused."""
    if not scaler.is_enabled():
        raise ValueError(
            "PatrickStar's 16-mixed always scales the loss, but the GradScaler given to the precision plugin is"
            " disabled (enabled=False). HINT: use precision='bf16-mixed' (no loss scaling needed), or keep the scaler"
            " enabled."
        )
    wanted: dict[str, float] = {
        "initial_scale": float(scaler._init_scale),
        "growth_factor": float(scaler._growth_factor),
        "backoff_factor": float(scaler._backoff_factor),
        "growth_interval": int(scaler._growth_interval),
    }
    default = LossScaleConfig()
    if all(getattr(default, k) == v for k, v in wanted.items()):
        return loss_scale  # torch's defaults are the engine's: nothing was asked
    if loss_scale is None or loss_scale == default:
        return LossScaleConfig(
            initial_scale=wanted["initial_scale"],
            growth_factor=wanted["growth_factor"],
            backoff_factor=wanted["backoff_factor"],
            growth_interval=int(wanted["growth_interval"]),
            min_scale=min(default.min_scale, wanted["initial_scale"]),
        )
    ours = {k: getattr(loss_scale, k) for k in wanted}
    if ours == wanted:
        return loss_scale
    raise ValueError(
        f"The GradScaler given to the precision plugin asks for {wanted}, but the strategy's"
        f" `mixed_precision.loss_scale` says {ours}. HINT: set the loss scaling in one place (the strategy's"
        " option, or the scaler)."
    )


class LossScaleUnderflowError(RuntimeError):
    """fp16 gradients kept overflowing until the loss scale reached its minimum."""


class ChunkPrecision(FabricPrecision):
    """What both precision plugins share: compute dtype, autocast, loss scale, clipping for the next step.

    Args:
        precision: "16-mixed", "bf16-mixed" or "32-true".
        loss_scale: dynamic loss scaling options for "16-mixed".
    """

    def __init__(self, precision: str = "32-true", loss_scale: LossScaleConfig | None = None) -> None:
        precision = str(precision)
        if precision not in _DTYPES:
            raise ValueError(
                f"PatrickStar supports precision {list(SUPPORTED_PRECISIONS)}, got {precision!r}."
                " HINT: use '32-true', 'bf16-mixed' or '16-mixed' (true half precision keeps no fp32 master)."
            )
        self.precision = precision  # type: ignore[assignment]
        self.compute_dtype = _DTYPES[precision]
        self.loss_scale_config = loss_scale if loss_scale is not None else LossScaleConfig()
        self._loss_scale_explicit = loss_scale is not None
        self.device_type = "cpu"  # set by the strategy to its root device's type
        self.scale = self.loss_scale_config.initial_scale if self.uses_loss_scaling else 1.0
        self._good_steps = 0
        self.skipped_steps = 0

    @property
    def uses_loss_scaling(self) -> bool:
        return self.compute_dtype is torch.float16

    @property
    def mixed(self) -> bool:
        return self.compute_dtype is not torch.float32

    @classmethod
    def from_plugin(cls, plugin: Any, loss_scale: LossScaleConfig | None = None) -> Self:
        """Convert the plugin Lightning chose from ``Trainer(precision=...)`` (or ``Fabric(precision=...)``).

        ``loss_scale`` (the strategy's option) applies unless the plugin was given its own.
        """
        if isinstance(plugin, cls):
            if loss_scale is not None and not plugin._loss_scale_explicit:
                plugin.loss_scale_config = loss_scale
                if plugin.uses_loss_scaling:
                    plugin.scale = loss_scale.initial_scale
            return plugin
        if type(plugin) not in _lightning_precisions():
            raise TypeError(
                f"PatrickStar runs its own precision plugin (the compute dtype, fp32 masters in chunks, loss scaling),"
                f" so the {type(plugin).__module__}.{type(plugin).__qualname__} given to the run would be replaced and"
                " what it does lost. HINT: give the precision as a string (Trainer or Fabric `precision='bf16-mixed'`,"
                " '16-mixed' or '32-true'), with fp16 loss scaling set by the strategy's `mixed_precision.loss_scale`."
            )
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None:
            loss_scale = _loss_scale_of(scaler, loss_scale)
        return cls(str(getattr(plugin, "precision", "32-true")), loss_scale=loss_scale)

    # ---- forward ------------------------------------------------------------------------------------------
    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if not self.mixed:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.compute_dtype):
            yield

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module  # the chunk manager casts parameters into their chunks

    def scaled(self, tensor: Tensor) -> Tensor:
        """The loss to run backward from (multiplied by the loss scale in fp16)."""
        return tensor * self.scale if self.uses_loss_scaling else tensor

    # ---- step ---------------------------------------------------------------------------------------------
    def begin_step(self, optimizer: Any) -> ChunkedOptimizer:
        """Configure the chunked optimizer's gradient policy for the coming step (unscale, inf check)."""
        chunked = self._chunked(optimizer)
        policy = chunked.gradient_policy
        policy.inv_scale = 1.0 / self.scale
        policy.check_finite = self.uses_loss_scaling
        return chunked

    def end_step(self, chunked: ChunkedOptimizer, *, stepped: bool) -> None:
        """After a step (``stepped``) or a failed one: clipping applied to that step only; the loss scale moves."""
        policy = chunked.gradient_policy
        policy.clip_norm = None
        policy.clip_value = None
        if stepped and self.uses_loss_scaling:
            self._update_scale(chunked.last_step.skipped)

    def _update_scale(self, skipped: bool) -> None:
        cfg = self.loss_scale_config
        if skipped:
            self.skipped_steps += 1
            self._good_steps = 0
            if self.scale <= cfg.min_scale:
                raise LossScaleUnderflowError(
                    f"fp16 gradients overflowed at the minimum loss scale {cfg.min_scale} ({self.skipped_steps}"
                    " steps skipped so far): training cannot make progress. HINT: lower the learning rate, check"
                    " the data for inf/nan, or train with precision='bf16-mixed'."
                )
            self.scale = max(cfg.min_scale, self.scale * cfg.backoff_factor)
            return
        self._good_steps += 1
        if self._good_steps >= cfg.growth_interval:
            self.scale *= cfg.growth_factor
            self._good_steps = 0

    def clip_next_step(self, optimizer: Any, clip_val: float, *, by_norm: bool) -> None:
        """Clip the gradients of the coming step by global norm (``by_norm``) or by value (no-op for <= 0)."""
        if clip_val <= 0:
            return
        policy = self._chunked(optimizer).gradient_policy
        # the step clips once by norm, then clamps by value; torch applies each call to the gradients as they are then
        # (a norm after a clamp measures the clamped gradients; two norm clips scale twice, each with its epsilon)
        if by_norm and (policy.clip_norm is not None or policy.clip_value is not None):
            earlier = "by norm" if policy.clip_norm is not None else "by value"
            raise RuntimeError(
                f"PatrickStar: `clip_gradients` by norm was called after a clip {earlier} for the same optimizer"
                " step. PatrickStar clips inside the step, once by norm and then by value, so it cannot apply a norm"
                " clip to gradients already clipped; plain PyTorch would. HINT: clip by norm at most once per step,"
                " and before any clipping by value."
            )
        if by_norm:
            policy.clip_norm = float(clip_val)
        else:  # clamping twice is clamping once to the tighter bound, exactly
            bound = float(clip_val)
            policy.clip_value = bound if policy.clip_value is None else min(policy.clip_value, bound)

    def refuse_backward_after_clipping(self, optimizers: Any) -> None:
        """A backward starts while a clip requested for the coming step waits for it: torch clipped the gradients
        present at the call, and this backward adds unclipped ones; the engine would clip their sum."""
        for optimizer in optimizers:
            inner = getattr(optimizer, "_optimizer", optimizer)
            if not isinstance(inner, ChunkedOptimizer):
                continue
            policy = inner.gradient_policy
            if policy.clip_norm is not None or policy.clip_value is not None:
                raise RuntimeError(
                    "PatrickStar: a backward started after `clip_gradients` and before the optimizer step it was"
                    " called for. PatrickStar clips inside the step, so it would clip the sum of both backwards'"
                    " gradients, where plain PyTorch clipped only the earlier ones. HINT: call `clip_gradients` right"
                    " before `optimizer.step()`, after the last backward of the step."
                )

    @staticmethod
    def _chunked(optimizer: Any) -> ChunkedOptimizer:
        inner = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer / _FabricOptimizer
        if not isinstance(inner, ChunkedOptimizer):
            raise TypeError(
                f"PatrickStar's precision plugin needs the strategy's chunked optimizer, got"
                f" {type(optimizer).__name__}. HINT: use it together with strategy='patrickstar'."
            )
        return inner

    # ---- checkpoint ---------------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "good_steps": self._good_steps,
            "skipped_steps": self.skipped_steps,
            "loss_scaling": self.uses_loss_scaling,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The loss scale of a run with loss scaling (16-mixed) resumes only in such a run, as plain Lightning's
        GradScaler state does: a bf16/32-true file leaves a 16-mixed run at its initial scale, and a 16-mixed
        file's scale does not reach a run without loss scaling (files from before this key: taken as they are)."""
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))
        if state_dict.get("loss_scaling", self.uses_loss_scaling) != self.uses_loss_scaling:
            return
        self.scale = float(state_dict["scale"])
        self._good_steps = int(state_dict["good_steps"])


class PatrickStarPrecision(ChunkPrecision, Precision):
    """Precision plugin of the PatrickStar Trainer strategy (see :class:`ChunkPrecision` for the arguments)."""

    # ---- backward -----------------------------------------------------------------------------------------
    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        return self.scaled(super().pre_backward(tensor, module))

    @override
    def post_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.uses_loss_scaling:
            tensor = tensor / self.scale
        guard = getattr(module.trainer.strategy, "guard_user_grads", None)
        if guard is not None:  # before the hooks below run ([Note: gradients user code cannot see])
            guard()
        return super().post_backward(tensor, module)

    # ---- step ---------------------------------------------------------------------------------------------
    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        chunked = self.begin_step(optimizer)
        # clipping is set by `clip_gradients`: inside the closure under automatic optimization, before
        # `opt.step()` under manual optimization; it applies to this step only
        stepped = False
        try:
            result = super().optimizer_step(chunked, model=model, closure=closure, **kwargs)
            stepped = True
        finally:
            self.end_step(chunked, stepped=stepped)
        return result

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if gradient_clip_algorithm not in (GradClipAlgorithmType.VALUE, GradClipAlgorithmType.NORM):
            raise ValueError(f"unknown gradient clipping algorithm {gradient_clip_algorithm!r}")  # pragma: no cover
        self.clip_next_step(optimizer, clip_val, by_norm=gradient_clip_algorithm == GradClipAlgorithmType.NORM)


def _convert_fp(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor


class PatrickStarFabricPrecision(ChunkPrecision):
    """Fabric's precision plugin of the PatrickStar strategy (see :class:`~lightning_pstar.precision.ChunkPrecision`).

    In mixed precision, inputs and outputs of the set-up model are converted as Fabric's own ``MixedPrecision``
    converts them (floating inputs to the compute dtype, floating outputs to the default dtype).
    """

    @override
    def convert_input(self, data: Any) -> Any:
        if not self.mixed:
            return data
        return apply_to_collection(data, Tensor, _convert_fp, self.compute_dtype)

    @override
    def convert_output(self, data: Any) -> Any:
        if not self.mixed:
            return data
        return apply_to_collection(data, Tensor, _convert_fp, torch.get_default_dtype())

    @override
    def backward(self, tensor: Tensor, model: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        self.scaled(tensor).backward(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        chunked = self.begin_step(optimizer)
        stepped = False
        try:
            result = chunked.step(**kwargs)
            stepped = True
        finally:
            self.end_step(chunked, stepped=stepped)
        return result

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        pass  # the chunked optimizer's step unscales (fp16), family by family
