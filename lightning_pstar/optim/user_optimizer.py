"""The optimizer user code created, while the engine steps a :class:`ChunkedOptimizer` in its place.

[Note: the user's own optimizer]
``configure_optimizers`` returns a torch optimizer, and user code often keeps a reference to it (``self.opt``, a
Fabric script's ``optimizer`` before ``fabric.setup``). The engine steps a ``ChunkedOptimizer`` instead, which shares
the user's ``param_groups`` list (so LR schedulers and hyper-parameter edits reach it) but keeps the states in
chunks. Everything else a user can do through the old reference would silently miss the engine, so for the run:

- its step hooks (``register_step_pre_hook``/``register_step_post_hook``, and the state-dict hooks) are the
  ``ChunkedOptimizer``'s: the hook tables are shared, registered before or after setup, and run at every step;
- ``state_dict``, ``load_state_dict`` and ``zero_grad`` called on it run the ``ChunkedOptimizer``'s (the states in
  the chunks, torch's layout);
- ``step`` and ``add_param_group`` on it raise, naming the optimizer to use (its step would bypass the precision
  plugin and read gradients that live in the chunks; groups are laid out at setup);
- the groups it shares are checked at every step: a parameter moved, added or removed, or a group added to the
  list, since setup is refused before anything changes (the engine laid out chunks and states per group at setup).

The redirects are instance attributes set at setup and removed when the run hands the optimizer back
(:func:`restore_user_optimizer`), before the hand-back loads the trained state into it.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

__all__ = ["GroupLayout", "redirect_user_optimizer", "restore_user_optimizer", "share_hooks"]

_HOOK_TABLES = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
_REDIRECTED = ("state_dict", "load_state_dict", "zero_grad", "step", "add_param_group")
_SAVED = "_pstar_saved_attributes"


def share_hooks(chunked: Optimizer, user: Optimizer) -> None:
    """Make ``user``'s hook tables ``chunked``'s (the same dicts: hooks registered on either run at its step)."""
    for name in _HOOK_TABLES:
        table = getattr(user, name, None)
        if table is not None:
            setattr(chunked, name, table)


def redirect_user_optimizer(user: Optimizer, chunked: Any) -> None:
    """Point ``user``'s methods at ``chunked`` for the run, or refuse them (see the note)."""
    if _SAVED in user.__dict__:
        return  # set up twice (a second fit with the same optimizer): the first redirect stands
    user.__dict__[_SAVED] = {name: user.__dict__[name] for name in _REDIRECTED if name in user.__dict__}
    user.__dict__["state_dict"] = chunked.state_dict
    user.__dict__["load_state_dict"] = chunked.load_state_dict
    user.__dict__["zero_grad"] = chunked.zero_grad
    # bound methods (an LR scheduler created on it later wraps ``step.__func__``)
    user.__dict__["step"] = types.MethodType(_refuse(type(user).__name__, "step()"), user)
    user.__dict__["add_param_group"] = types.MethodType(_refuse(type(user).__name__, "add_param_group()"), user)


def restore_user_optimizer(user: Optimizer) -> None:
    """Undo :func:`redirect_user_optimizer` (the run hands ``user`` back)."""
    saved = user.__dict__.pop(_SAVED, None)
    if saved is None:
        return
    for name in _REDIRECTED:
        user.__dict__.pop(name, None)
    user.__dict__.update(saved)


def _refuse(kind: str, what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"PatrickStar: {what} was called on the {kind} that configure_optimizers returned (or that was passed to"
            " fabric.setup), but the strategy steps its own optimizer in its place, whose states live in chunks. HINT:"
            " use the optimizer Lightning gives you: `self.optimizers()` in a LightningModule (manual optimization),"
            " `trainer.optimizers`, or the one `fabric.setup` returned. Parameter groups are fixed at setup."
        )

    # an LR scheduler on the user's optimizer checks that its step is the one it wrapped (torch warns otherwise); the
    # step that counts is the engine's, which marks the user's optimizer stepped (``_opt_called``) as torch's does
    refuse._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return refuse


class GroupLayout:
    """The parameters of each param group as the engine laid them out at setup, checked before each step."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self._groups = groups
        self._ids = [tuple(map(id, g["params"])) for g in groups]

    def check(self) -> None:
        """Raise where a group's parameters changed since setup (see the note)."""
        groups = self._groups
        if len(groups) == len(self._ids) and all(
            tuple(map(id, g["params"])) == ids for g, ids in zip(groups, self._ids, strict=True)
        ):
            return
        what = (
            f"{len(groups) - len(self._ids)} group(s) were added"
            if len(groups) > len(self._ids)
            else "a group was removed"
            if len(groups) < len(self._ids)
            else "the parameters of group "
            + ", ".join(str(i) for i, g in enumerate(groups) if tuple(map(id, g["params"])) != self._ids[i])
            + " changed (a parameter added, removed or moved between groups)"
        )
        raise RuntimeError(
            f"PatrickStar: the optimizer's param groups changed since setup: {what}. The engine lays out chunks and"
            " optimizer states per group at setup, so such a change would not reach the step. Nothing was stepped."
            " HINT: give every parameter its group before `fit`; a group's hyper-parameters (lr, weight_decay,"
            " betas, momentum ...) may change at any time."
        )
