"""Unit tests of lightning_pstar.precision: supported precisions, plugin conversion, dynamic loss scaling,
clipping configuration, autocast and checkpoint state."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from lightning_pstar.checkpoint import master_view
from lightning_pstar.config import LossScaleConfig, PStarConfig
from lightning_pstar.optim import ChunkedOptimizer
from lightning_pstar.precision import SUPPORTED_PRECISIONS, LossScaleUnderflowError, PatrickStarPrecision
from lightning_pstar.runtime.manager import ChunkManager

CPU = torch.device("cpu")


def _engine(dtype: torch.dtype, lr: float = 0.1) -> tuple[nn.Module, nn.Module, ChunkManager, ChunkedOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference.load_state_dict(model.state_dict())
    manager = ChunkManager(
        model, config=PStarConfig.from_flat(chunk_size=32, placement="static"), compute_dtype=dtype, device=CPU
    )
    manager.materialise()
    return model, reference, manager, ChunkedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), manager)


def _plugin(precision: str, **loss_scale: Any) -> PatrickStarPrecision:
    plugin = PatrickStarPrecision(precision, loss_scale=LossScaleConfig(**loss_scale) if loss_scale else None)
    # the Lightning callback glue after the closure (on_before_optimizer_step hooks, the Trainer's clipping
    # switches) needs a Trainer; these unit tests drive the plugin without one
    plugin._after_closure = lambda model, optimizer: None  # type: ignore[method-assign]
    return plugin


def _step(plugin: PatrickStarPrecision, manager: ChunkManager, opt: ChunkedOptimizer, grad: float) -> None:
    """One optimizer step through the plugin; the closure stores ``grad * scale`` as every gradient."""

    def closure() -> None:
        for record in manager.records:
            manager.grad_ready(record, torch.full(record.slot.shape, grad * plugin.scale, dtype=manager.compute_dtype))

    plugin.optimizer_step(opt, model=None, closure=closure)  # type: ignore[arg-type]
    opt.zero_grad()  # as Lightning's loop does between steps


# ---- construction -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("precision", "dtype", "mixed", "scaling"),
    [
        ("32-true", torch.float32, False, False),
        ("bf16-mixed", torch.bfloat16, True, False),
        ("16-mixed", torch.float16, True, True),
    ],
)
def test_supported_precisions(precision: str, dtype: torch.dtype, mixed: bool, scaling: bool) -> None:
    plugin = PatrickStarPrecision(precision)
    assert plugin.precision == precision
    assert plugin.compute_dtype is dtype
    assert plugin.mixed is mixed
    assert plugin.uses_loss_scaling is scaling
    assert plugin.scale == (2.0**16 if scaling else 1.0)
    assert precision in SUPPORTED_PRECISIONS


def test_default_is_32_true() -> None:
    assert PatrickStarPrecision().precision == "32-true"


@pytest.mark.parametrize("precision", ["64-true", "bf16-true", "16-true", "transformer-engine", "bf16", 16])
def test_unsupported_precision_lists_supported(precision: Any) -> None:
    with pytest.raises(ValueError, match=r"supports precision \['16-mixed', 'bf16-mixed', '32-true'\].*HINT"):
        PatrickStarPrecision(precision)


def test_from_plugin_converts_lightning_plugins() -> None:
    bf16 = PatrickStarPrecision.from_plugin(MixedPrecision("bf16-mixed", "cpu"))
    assert isinstance(bf16, PatrickStarPrecision) and bf16.precision == "bf16-mixed"
    assert bf16.compute_dtype is torch.bfloat16
    fp16 = PatrickStarPrecision.from_plugin(MixedPrecision("16-mixed", "cpu"), LossScaleConfig(initial_scale=8.0))
    assert fp16.precision == "16-mixed" and fp16.scale == 8.0
    plain = PatrickStarPrecision.from_plugin(Precision())
    assert plain.precision == "32-true" and plain.compute_dtype is torch.float32


@pytest.mark.parametrize("plugin", [DoublePrecision(), HalfPrecision("bf16-true"), HalfPrecision("16-true")])
def test_from_plugin_rejects_unsupported(plugin: Precision) -> None:
    with pytest.raises(ValueError, match=r"supports precision"):
        PatrickStarPrecision.from_plugin(plugin)


def test_from_plugin_takes_a_users_grad_scaler_settings() -> None:
    """``MixedPrecision("16-mixed", ..., scaler=GradScaler(init_scale=..., ...))``: the scaler's settings become the
    loss scaling (they were silently dropped for the engine's defaults); they must agree with the strategy's own
    option where that was set; a disabled scaler (fp16 without scaling, which the engine cannot run) is refused."""

    def scaler(**kw: Any) -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", **kw)

    asked = dict(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=10)
    got = PatrickStarPrecision.from_plugin(MixedPrecision("16-mixed", "cpu", scaler=scaler(**asked)), LossScaleConfig())
    config = got.loss_scale_config
    assert got.scale == 1024.0 and (config.growth_factor, config.backoff_factor, config.growth_interval) == (
        4,
        0.25,
        10,
    )
    same = LossScaleConfig(initial_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=10)
    assert (
        PatrickStarPrecision.from_plugin(MixedPrecision("16-mixed", "cpu", scaler=scaler(**asked)), same).scale == 1024
    )
    # torch's default scaler (what `precision="16-mixed"` makes) leaves the strategy's option as it is
    own = LossScaleConfig(initial_scale=8.0)
    assert PatrickStarPrecision.from_plugin(MixedPrecision("16-mixed", "cpu", scaler=scaler()), own).scale == 8.0
    with pytest.raises(ValueError, match=r"asks for .*initial_scale': 1024.*says .*initial_scale': 8.0.*HINT"):
        PatrickStarPrecision.from_plugin(MixedPrecision("16-mixed", "cpu", scaler=scaler(**asked)), own)
    with pytest.raises(ValueError, match=r"disabled.*HINT"):
        PatrickStarPrecision.from_plugin(MixedPrecision("16-mixed", "cpu", scaler=scaler(enabled=False)))


def test_from_plugin_refuses_a_plugin_it_would_replace() -> None:
    """A precision plugin other than those Lightning makes from a precision string (a subclass with hooks of its
    own, another library's) was silently replaced by a PatrickStar plugin of its precision: refused, naming it."""

    class Custom(MixedPrecision):
        def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
            return tensor * 2

    with pytest.raises(TypeError, match=r"Custom.*would be replaced.*HINT: give the precision as a string"):
        PatrickStarPrecision.from_plugin(Custom("bf16-mixed", "cpu"))


def test_from_plugin_keeps_a_patrickstar_plugin() -> None:
    own = PatrickStarPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale=32.0))
    assert PatrickStarPrecision.from_plugin(own, LossScaleConfig(initial_scale=8.0)) is own
    assert own.scale == 32.0  # its own loss-scale options win
    default = PatrickStarPrecision("16-mixed")
    assert PatrickStarPrecision.from_plugin(default, LossScaleConfig(initial_scale=8.0)) is default
    assert default.scale == 8.0  # the strategy's options apply to a plugin without its own


def test_convert_module_is_identity() -> None:
    module = nn.Linear(2, 2)
    assert PatrickStarPrecision("bf16-mixed").convert_module(module) is module
    assert module.weight.dtype == torch.float32


# ---- autocast ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("precision", "dtype"), [("32-true", None), ("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)]
)
def test_forward_context_autocasts_in_mixed_modes_only(precision: str, dtype: torch.dtype | None) -> None:
    plugin = PatrickStarPrecision(precision)
    with plugin.forward_context():
        enabled = torch.is_autocast_enabled("cpu")
        got = torch.get_autocast_dtype("cpu")
        out = nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3))
    assert enabled is (dtype is not None)
    if dtype is not None:
        assert got is dtype
        assert out.dtype is dtype
    else:
        assert out.dtype is torch.float32
    assert not torch.is_autocast_enabled("cpu")


# ---- loss scaling -----------------------------------------------------------------------------------------
def test_fp16_step_unscales_gradients() -> None:
    model, reference, manager, opt = _engine(torch.float16)
    plugin = _plugin("16-mixed", initial_scale=1024.0)
    _step(plugin, manager, opt, grad=0.25)
    assert opt.gradient_policy.inv_scale == 1 / 1024
    assert opt.gradient_policy.check_finite
    assert not opt.last_step.skipped
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * 0.25
    for record, ref in zip(manager.records, reference.parameters(), strict=True):
        assert torch.equal(master_view(record), ref.detach())
    assert plugin.scale == 1024.0 and plugin.skipped_steps == 0


def test_overflow_backs_off_and_skips() -> None:
    model, _, manager, opt = _engine(torch.float16)
    masters = [master_view(r).clone() for r in manager.records]
    plugin = _plugin("16-mixed", initial_scale=1024.0, backoff_factor=0.25)
    _step(plugin, manager, opt, grad=float("inf"))
    assert opt.last_step.skipped
    assert plugin.scale == 256.0
    assert plugin.skipped_steps == 1
    for record, master in zip(manager.records, masters, strict=True):
        assert torch.equal(master_view(record), master)
        assert torch.equal(record.param.detach(), master.half())


def test_growth_after_growth_interval_finite_steps() -> None:
    _, _, manager, opt = _engine(torch.float16, lr=1e-3)
    plugin = _plugin("16-mixed", initial_scale=16.0, growth_interval=3, growth_factor=4.0)
    scales = []
    for grad in (0.01, 0.01, 0.01, 0.01, float("nan"), 0.01, 0.01, 0.01):
        _step(plugin, manager, opt, grad=grad)
        scales.append(plugin.scale)
    # three good steps -> x4; an overflow halves and restarts the count
    assert scales == [16.0, 16.0, 64.0, 64.0, 32.0, 32.0, 32.0, 128.0]
    assert plugin.skipped_steps == 1


def test_underflow_error_at_min_scale() -> None:
    _, _, manager, opt = _engine(torch.float16)
    plugin = _plugin("16-mixed", initial_scale=4.0, min_scale=1.0)
    _step(plugin, manager, opt, grad=float("inf"))
    assert plugin.scale == 2.0
    _step(plugin, manager, opt, grad=float("inf"))
    assert plugin.scale == 1.0
    with pytest.raises(LossScaleUnderflowError, match=r"minimum loss scale 1\.0 \(3 steps skipped.*HINT"):
        _step(plugin, manager, opt, grad=float("inf"))


def test_backoff_never_goes_below_min_scale() -> None:
    _, _, manager, opt = _engine(torch.float16)
    plugin = _plugin("16-mixed", initial_scale=6.0, min_scale=4.0)
    _step(plugin, manager, opt, grad=float("inf"))
    assert plugin.scale == 4.0


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_no_loss_scaling_outside_fp16(precision: str) -> None:
    dtype = {"bf16-mixed": torch.bfloat16, "32-true": torch.float32}[precision]
    _, _, manager, opt = _engine(dtype)
    plugin = _plugin(precision)
    _step(plugin, manager, opt, grad=0.5)
    assert plugin.scale == 1.0
    assert opt.gradient_policy.inv_scale == 1.0
    assert not opt.gradient_policy.check_finite
    assert plugin.state_dict()["good_steps"] == 0


def test_state_dict_round_trip() -> None:
    _, _, manager, opt = _engine(torch.float16, lr=1e-3)
    plugin = _plugin("16-mixed", initial_scale=64.0, growth_interval=10)
    for grad in (0.01, float("inf"), 0.01, 0.01):
        _step(plugin, manager, opt, grad=grad)
    state = plugin.state_dict()
    assert state == {"scale": 32.0, "good_steps": 2, "skipped_steps": 1, "loss_scaling": True}
    fresh = PatrickStarPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale=64.0, growth_interval=10))
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert fresh.scale == 32.0
    old = PatrickStarPrecision("16-mixed")
    old.load_state_dict({"scale": 8, "good_steps": 1})  # written before skipped_steps existed
    assert old.state_dict() == {"scale": 8.0, "good_steps": 1, "skipped_steps": 0, "loss_scaling": True}
    bf16 = PatrickStarPrecision("bf16-mixed")
    bf16.load_state_dict(state)  # a 16-mixed file: its loss scale does not reach a run without loss scaling
    assert bf16.scale == 1.0 and bf16.skipped_steps == 1
    fresh = PatrickStarPrecision("16-mixed", loss_scale=LossScaleConfig(initial_scale=64.0))
    fresh.load_state_dict(bf16.state_dict())  # a bf16 file: the 16-mixed run starts at its initial scale
    assert fresh.scale == 64.0


# ---- clipping ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("wrap", [False, True])
def test_clip_gradients_configures_the_optimizer(wrap: bool) -> None:
    _, _, _, opt = _engine(torch.float32)
    plugin = PatrickStarPrecision("32-true")
    target: Any = LightningOptimizer(opt) if wrap else opt
    plugin.clip_gradients(target, 0.0, GradClipAlgorithmType.NORM)
    assert opt.gradient_policy.clip_norm is None and opt.gradient_policy.clip_value is None
    plugin.clip_gradients(target, 1.5, GradClipAlgorithmType.NORM)
    assert opt.gradient_policy.clip_norm == 1.5 and opt.gradient_policy.clip_value is None
    plugin.clip_gradients(target, 2, GradClipAlgorithmType.VALUE)
    assert opt.gradient_policy.clip_value == 2.0


def test_optimizer_step_resets_clipping_of_the_previous_step() -> None:
    _, _, manager, opt = _engine(torch.float32)
    plugin = _plugin("32-true")
    opt.gradient_policy.clip_norm = 0.5
    opt.gradient_policy.clip_value = 0.5
    _step(plugin, manager, opt, grad=1.0)
    assert opt.gradient_policy.clip_norm is None and opt.gradient_policy.clip_value is None


def test_clip_gradients_needs_the_chunked_optimizer() -> None:
    plugin = PatrickStarPrecision("32-true")
    plain = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"needs the strategy's chunked optimizer, got SGD.*HINT"):
        plugin.clip_gradients(plain, 1.0, GradClipAlgorithmType.NORM)
