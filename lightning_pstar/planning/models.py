"""The models the capacity planner prices, built on the meta device (no memory for weights).

A target is a demo GPT config YAML (``configs/model/gpt_small.yaml``, or a run's composed Hydra config), an
import path ``pkg.module:factory``, a zero-argument factory, or a module already built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lightning_pstar.demos.gpt import GPTConfig

__all__ = ["ModelTarget", "build_gpt", "build_meta_model", "describe_gpt"]

_GPT_REQUIRED = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd")
_GPT_KEYS = (*_GPT_REQUIRED, "dropout", "bias")

ModelTarget = str | nn.Module | Callable[[], nn.Module]
"""A model config YAML path, an import path ``pkg.module:factory``, a module, or a zero-argument factory."""


def describe_gpt(config: Mapping[str, Any]) -> str:
    """``GPT(vocab_size=..., block_size=..., n_layer=..., n_head=..., n_embd=...)``."""
    return "GPT(" + ", ".join(f"{k}={config[k]}" for k in _GPT_REQUIRED) + ")"


def build_gpt(config: GPTConfig) -> nn.Module:
    """The demo GPT of ``config`` on the meta device."""
    from lightning_pstar.demos.gpt import GPT

    with torch.device("meta"):
        return GPT(config)


def build_meta_model(
    target: ModelTarget, *, overrides: Mapping[str, Any] | None = None
) -> tuple[nn.Module, str, GPTConfig | None]:
    """Build ``target`` on the meta device; return the module, a description, and its GPT config if any.

    A YAML target is a demo GPT config (``overrides`` replace its sizes); a factory (``pkg.module:factory``
    or a callable) is called with ``overrides`` as keyword arguments. A module with a Lightning-style
    ``configure_model()`` hook gets it called, as the strategy would.
    """
    overrides = dict(overrides or {})
    if isinstance(target, nn.Module):
        if overrides:
            raise ValueError("`overrides` need a target the planner builds. HINT: pass a YAML path or a factory.")
        return target, type(target).__name__, None
    if isinstance(target, str) and (target.endswith((".yaml", ".yml")) or Path(target).is_file()):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"Model config {target!r} does not exist. HINT: e.g. configs/model/gpt_small.yaml.")
        gpt_config = _gpt_config_from_yaml(path, overrides)
        return build_gpt(gpt_config), f"{target}: {describe_gpt(asdict(gpt_config))}", gpt_config
    if isinstance(target, str):
        if ":" not in target:
            raise ValueError(
                f"Unknown model target {target!r}: neither a YAML file nor an import path."
                " HINT: pass a model config such as configs/model/gpt_small.yaml or 'pkg.module:factory'."
            )
        factory, description = _import_factory(target), target
    else:
        factory, description = target, getattr(target, "__qualname__", repr(target))
    model = _call_factory(factory, description, overrides)
    return model, f"{description}: {type(model).__name__}", None


def _call_factory(factory: Callable[..., Any], description: str, overrides: Mapping[str, Any]) -> nn.Module:
    with torch.device("meta"):
        try:
            model = factory(**overrides)
        except TypeError as err:
            raise ValueError(
                f"Calling model factory {description!r} with {dict(overrides)} failed: {err}."
                " HINT: --set passes keyword arguments to a factory; check their names."
            ) from err
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"Model factory {description!r} returned {type(model).__name__}, not an nn.Module."
                " HINT: the factory must return the model to train."
            )
        configure = getattr(model, "configure_model", None)
        if callable(configure):
            configure()
    return model


def _gpt_config_from_yaml(path: Path, overrides: Mapping[str, Any]) -> GPTConfig:
    from omegaconf import OmegaConf

    from lightning_pstar.demos.gpt import GPTConfig

    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as err:  # yaml and OmegaConf errors alike: report them with the file
        raise ValueError(f"Cannot read the model config {str(path)!r}: {err} HINT: check the YAML syntax.") from err
    if not isinstance(raw, dict):
        raise ValueError(f"The model config {str(path)!r} is not a mapping. HINT: pass a file such as gpt_small.yaml.")
    if not any(k in raw for k in _GPT_REQUIRED) and isinstance(raw.get("model"), dict):
        raw = raw["model"]  # a composed Hydra config (e.g. a run's .hydra/config.yaml)
    values = {k: raw[k] for k in _GPT_KEYS if k in raw}
    unknown = sorted(set(overrides) - set(_GPT_KEYS))
    if unknown:
        raise ValueError(f"Unknown GPT size(s) {unknown} in --set. HINT: the keys are {list(_GPT_KEYS)}.")
    values.update(overrides)
    missing = [k for k in _GPT_REQUIRED if k not in values]
    if missing:
        raise ValueError(
            f"The model config {str(path)!r} does not describe a demo GPT: missing {missing}. HINT: pass a model"
            " config such as configs/model/gpt_small.yaml, add the keys with --set, or give a factory"
            " 'pkg.module:factory'."
        )
    return GPTConfig(**values)


def _import_factory(target: str) -> Callable[..., Any]:
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"Unknown model target {target!r}: cannot import module {module_name!r} ({err})."
            " HINT: pass 'pkg.module:factory' of an importable module, or a model config YAML path."
        ) from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"Unknown model target {target!r}: module {module_name!r} has no attribute {attr!r}."
                " HINT: name a function or class that returns an nn.Module."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"Model target {target!r} is not callable. HINT: name a factory returning an nn.Module.")
    return obj
