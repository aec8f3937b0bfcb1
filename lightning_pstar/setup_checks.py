"""Checks the strategy runs on the user's module and optimizers before anything changes (no Lightning here).

Each refuses a pattern the engine cannot support with an error naming it and what to do, or finds what the
strategy must treat specially (torchmetrics states that follow the root device).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin  # type: ignore[attr-defined]
from torch.nn.utils import parametrize
from torch.optim import Optimizer

__all__ = [
    "explain_optimizer_setup_error",
    "parameter_free_metrics",
    "refuse_no_trainable_parameters",
    "refuse_shared_parameters",
    "refuse_shared_storage",
    "refuse_sparse_gradients",
    "refuse_unhookable_modules",
    "refuse_unsupported_dtypes",
]


def refuse_shared_parameters(optimizers: Sequence[Optimizer], module: nn.Module | None) -> None:
    """Each optimizer steps and zeroes only its own parameters, so one parameter in two optimizers would be
    stepped twice: refused with its name (torch itself only refuses duplicates within one optimizer)."""
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    first: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for p in group["params"]:
                other = first.setdefault(id(p), index)
                if other != index:
                    raise ValueError(
                        f"Parameter '{names.get(id(p), tuple(p.shape))}' is in optimizer {other} and optimizer"
                        f" {index} returned by `configure_optimizers`. HINT: give each parameter to exactly one"
                        " optimizer."
                    )


def refuse_no_trainable_parameters(module: nn.Module, *, entry: str) -> None:
    """Training a model none of whose parameters requires grad fails at the first backward with autograd's
    "element 0 of tensors does not require grad" (plain Lightning too): refused before anything changes.
    ``entry`` names what was called (``trainer.fit``, ``fabric.setup`` with optimizers)."""
    if any(p.requires_grad for p in module.parameters()):
        return
    count = sum(1 for _ in module.parameters())
    what = f"all {count} of its parameters are frozen (requires_grad=False)" if count else "it has no parameters"
    raise ValueError(
        f"`{entry}` on a model with nothing to train: {what}, so the first backward would fail and no optimizer"
        " step could change anything. HINT: freeze less (`requires_grad_(True)` on the layers to train), or, to"
        " only evaluate the model, call `trainer.validate`, `trainer.test` or `trainer.predict` (Fabric: set up"
        " the model without optimizers)."
    )


def parameter_free_metrics(module: nn.Module) -> list[nn.Module]:
    """The outermost submodules with states of their own that ``.to`` moves but no parameters anywhere
    below them (torchmetrics ``Metric``): moving them moves no chunk."""
    found: list[nn.Module] = []
    seen: set[int] = set()
    for mod in module.modules():
        if id(mod) in seen or mod is module or not hasattr(mod, "_defaults"):  # torchmetrics' state table
            continue
        if next(mod.parameters(), None) is None:
            found.append(mod)
            seen.update(id(m) for m in mod.modules())
    return found


_CHUNK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def refuse_sparse_gradients(module: nn.Module) -> None:
    """An ``nn.Embedding`` / ``nn.EmbeddingBag`` with ``sparse=True`` produces sparse gradients, which a dense chunk
    slot cannot take (the first backward would fail inside the engine): refused at setup, naming the module."""
    for name, mod in module.named_modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and getattr(mod, "sparse", False):
            raise ValueError(
                f"Module '{name}' ({type(mod).__name__}) has sparse=True: its sparse gradients cannot go into"
                " PatrickStar's dense chunks. HINT: build it with sparse=False (the optimizer then steps the dense"
                " gradient, as torch's fused Adam/AdamW/SGD require anyway)."
            )


def refuse_shared_storage(module: nn.Module) -> None:
    """A parameter whose memory overlaps another parameter's (``nn.Parameter(a.weight.data[0])``), a buffer's
    (``register_buffer("row", a.weight.detach()[0])``) or a plain tensor attribute's (``self.wt = self.lin.weight.t()``)
    is one tensor in plain PyTorch: the optimizer's update of one is seen through the other. Each parameter gets its
    own chunk slot here, so the alias would silently go on reading the weights before setup: refused at setup, naming
    both (tied weights, one Parameter under two names, are not this; parameters cut from one flat buffer without
    overlapping are not either)."""
    spans = [(*_span(p), name, "parameter") for name, p in module.named_parameters()]
    spans += [(*_span(b), name, "buffer") for name, b in module.named_buffers()]
    spans += [(*_span(t), name, "tensor attribute") for name, t in _tensor_attributes(module)]
    spans = sorted(s for s in spans if s[1] > s[0])
    last_param: tuple[int, str] = (0, "")  # the parameter reaching furthest so far: its end, its name
    last_other: tuple[int, str, str] = (0, "", "")  # the buffer or tensor attribute reaching furthest so far
    for start, end, name, kind in spans:
        if kind == "parameter" and last_param[0] > start:
            raise ValueError(
                f"Parameters '{last_param[1]}' and '{name}' share memory (one is a view of the other, e.g."
                " `nn.Parameter(a.weight.data[0])`): PatrickStar gives each parameter its own chunk slot, so the"
                " view would stop following the other's updates. HINT: tie them as one Parameter (`b.weight ="
                " a.weight`), or compute the view in forward (`a.weight[0]`)."
            )
        if kind == "parameter" and last_other[0] > start or kind != "parameter" and last_param[0] > start:
            other, what, param = (
                (last_other[1], last_other[2], name) if kind == "parameter" else (name, kind, last_param[1])
            )
            raise ValueError(
                f"{what.capitalize()} '{other}' shares memory with parameter '{param}' (it is a view of the weight):"
                f" PatrickStar moves parameters into chunks at setup, so the {what} would go on reading the weight as"
                " it was before training. HINT: compute it from the parameter in forward (e.g. `self.lin.weight.t()`"
                " there), or keep a copy (`.clone()`) if it should not follow training."
            )
        if kind == "parameter":
            last_param = max(last_param, (end, name))
        else:
            last_other = max(last_other, (end, name, kind))


def _tensor_attributes(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Plain tensors a module keeps as attributes (not parameters, not buffers), by qualified name."""
    found = []
    for prefix, sub in module.named_modules():
        # what a forward pre-hook computes again before every forward (torch's legacy `weight_norm` and
        # `spectral_norm` set `weight` from `weight_orig`/`weight_v` so): not a stale copy
        recomputed = {getattr(hook, "name", None) for hook in sub._forward_pre_hooks.values()}
        for key, value in vars(sub).items():
            if key in recomputed or key.startswith("__"):
                continue
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                found.append((f"{prefix}.{key}" if prefix else key, value))
    return found


def refuse_unhookable_modules(module: nn.Module) -> None:
    """Modules the engine cannot lay out or hook, refused naming the first: a lazy module not run yet (its
    parameters have no shape, so no chunk slot), a TorchScript module (it takes no forward hooks, and the engine
    fetches each module's chunks in one)."""
    for name, sub in module.named_modules():
        if isinstance(sub, torch.jit.ScriptModule):
            raise ValueError(
                f"Module '{name}' is a TorchScript module ({type(sub).__name__}: `torch.jit.script`/`trace`), which"
                " takes no forward hooks; PatrickStar fetches each module's chunks in one. HINT: keep the eager"
                " module (`torch.compile` works with PatrickStar), or script it after training."
            )
        for kind, tensors in (("parameter", sub._parameters), ("buffer", sub._buffers)):
            for pname, tensor in tensors.items():
                if isinstance(tensor, UninitializedTensorMixin):
                    where = f"{name}.{pname}" if name else pname
                    raise ValueError(
                        f"The {kind} '{where}' of lazy module {type(sub).__name__} is not initialised yet (it gets its"
                        " shape at the first forward): PatrickStar lays out every parameter in chunks at setup, so it"
                        " needs their shapes then. HINT: run one forward on a sample batch before `fit` /"
                        " `fabric.setup` (e.g. at the end of `__init__`), or give the module its input size."
                    )


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The byte addresses ``tensor``'s elements reach, [start, end); empty where it has none (meta, no elements)."""
    if tensor.is_meta or tensor.numel() == 0:
        return 0, 0
    start = tensor.data_ptr()
    reach = sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + (reach + 1) * tensor.element_size()


_FP32_ONLY = {
    "_Orthogonal": "parametrizations.orthogonal with its matrix_exp map",
    "_SpectralNorm": "parametrizations.spectral_norm (power iteration with fp32 buffers)",
    "SpectralNorm": "nn.utils.spectral_norm (power iteration with fp32 buffers)",
}


def _cayley_or_householder(parametrization: nn.Module) -> bool:
    """An orthogonal parametrization whose map is not matrix_exp: Cayley's runs in bf16 within bf16-mixed's
    tolerance of plain Lightning (the zoo's ``parametrized`` model checks it); Householder's is not refused either,
    unmeasured."""
    orth_map = getattr(parametrization, "orthogonal_map", None)
    return orth_map is not None and getattr(orth_map, "name", "") != "matrix_exp"


def refuse_fp32_parametrizations(module: nn.Module, compute_dtype: torch.dtype) -> None:
    """In mixed precision a module computes with compute-dtype copies of its weights, where plain Lightning keeps
    them fp32 and autocast casts only the ops it lists. A parametrization that computes the weight itself with ops
    outside those lists (orthogonal's matrix_exp, spectral_norm's ``mv`` against its fp32 buffers) would run in
    bf16/fp16 (NaN, far from plain Lightning) or fail inside torch with a dtype mismatch: refused at setup, naming
    the module."""
    if compute_dtype == torch.float32:
        return
    for name, mod in module.named_modules():
        kinds = [type(h).__name__ for h in mod._forward_pre_hooks.values()]
        if parametrize.is_parametrized(mod):
            plists = mod.parametrizations.values()
            kinds += [type(p).__name__ for plist in plists for p in plist if not _cayley_or_householder(p)]
        for kind in kinds:
            if kind in _FP32_ONLY:
                raise ValueError(
                    f"Module '{name}' ({type(mod).__name__}) uses {_FP32_ONLY[kind]}, which computes its weight with"
                    f" ops autocast keeps in fp32; PatrickStar's mixed precision hands modules {compute_dtype}"
                    " weights, so it would run in that dtype, far from plain Lightning's result (or fail inside"
                    " torch). HINT: train this model in precision='32-true'."
                )


def refuse_unsupported_dtypes(module: nn.Module, compute_dtype: torch.dtype = torch.float32) -> None:
    """Chunks hold fp32 masters and fp32/fp16/bf16 compute copies: another floating dtype (float64) would be cast
    silently, so it is refused before anything changes (integer and complex parameters are refused by the
    planner, with a hint to make them buffers). In 32-true (``compute_dtype`` float32) a float16 or bfloat16
    parameter would be computed in fp32 where plain Lightning computes it in its own dtype: refused too."""
    for name, p in module.named_parameters():
        if not p.is_floating_point():
            continue
        if p.dtype not in _CHUNK_DTYPES:
            raise ValueError(
                f"Parameter '{name}' has dtype {p.dtype}; PatrickStar keeps parameters in float32, float16 or"
                f" bfloat16 chunks and would silently cast it. HINT: build it as float32 (`.float()`) or keep it"
                " out of the parameters (a buffer: `register_buffer`)."
            )
        if compute_dtype == torch.float32 and p.dtype != torch.float32:
            raise ValueError(
                f"Parameter '{name}' has dtype {p.dtype} in a 32-true run; PatrickStar's 32-true chunks are float32"
                f" and would silently compute it in float32 (plain Lightning computes it in {p.dtype}). HINT: build"
                " it as float32 (`.float()`), or train in mixed precision (`precision='bf16-mixed'`)."
            )


def explain_optimizer_setup_error(err: Exception, world_size: int) -> Exception | None:
    """A clearer error for optimizers PatrickStar cannot take, raised while ``configure_optimizers`` runs."""
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    if any(f.endswith("zero_redundancy_optimizer.py") for f in frames):
        return ValueError(
            f"`configure_optimizers` built a ZeroRedundancyOptimizer, which failed at world size {world_size}"
            f" ({type(err).__name__}: {err}). PatrickStar already shards the optimizer state over the ranks."
            " HINT: return the plain optimizer (torch.optim.AdamW(self.parameters(), ...))."
        )
    return None
