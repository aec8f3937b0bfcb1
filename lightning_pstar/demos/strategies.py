"""A Hydra/OmegaConf strategy node as the Trainer or Fabric takes it (the examples' configs)."""

from __future__ import annotations

from typing import Any

__all__ = ["build_strategy"]


def build_strategy(node: Any, *, base: type, key: str = "strategy") -> Any:
    """Turn a config node into what ``L.Trainer(strategy=...)`` / ``Fabric(strategy=...)`` accepts.

    A node with ``name`` only (``strategy=auto``) is a registered strategy name. A node with ``_target_`` names
    a class: when the class offers ``from_config`` (both PatrickStar strategies do), that validates every key,
    so a misspelled option fails here with its name instead of being swallowed; other classes are
    instantiated by Hydra, whose constructor call rejects unknown keyword arguments. The result must be a
    ``base`` (Lightning's or Fabric's ``Strategy``); ``key`` names the node in the error.
    """
    import hydra  # the examples' dependency, imported where it is used

    target = node.get("_target_")
    if target is None:
        return str(node.name)
    cls = hydra.utils.get_class(str(target))
    from_config = getattr(cls, "from_config", None)
    strategy = from_config(node) if callable(from_config) else hydra.utils.instantiate(node)
    if not isinstance(strategy, base):
        built = type(strategy).__name__
        raise TypeError(f"`{key}._target_={target}` built a {built}, not a {base.__module__}.{base.__name__}.")
    return strategy
