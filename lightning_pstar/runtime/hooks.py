"""Module and gradient hooks that turn the model's execution into chunk-manager calls.

- pre-forward of module M: M's chunks become resident, its slots go to ``COMPUTE``;
- post-forward of M: slots go to ``HOLD_AFTER_FWD`` (``HOLD`` without autograd), chunks may be evicted;
  a multi-grad hook on M's outputs marks the start of M's backward;
- pre-backward of M: chunks resident again (same storage: see the note in ``chunk.py``);
- post-backward of M (a grad hook on M's inputs): slots still in ``COMPUTE`` leave it, so the chunks of a
  tied weight whose gradient is not final yet are not pinned for the rest of the backward;
- gradient of p final (``register_post_accumulate_grad_hook``): the chunk manager stores it in the slot;
- BatchNorm in mixed precision: fp32 copies of its weight and bias during its forward (see below);
- training forward: weights autograd saves for backward outside their modules are saved by reference
  (:meth:`ModelHooks.saved_tensors`, [Note: saved weights] in :mod:`lightning_pstar.runtime.saved_weights`).

[Note: hooks under torch.compile]
A compiled model (``torch.compile(lightning_module)`` or a compiled submodule) calls the module hooks from
inside the code dynamo traces. Traced, they would break the graph wherever they touch engine state (the
profiler check, storage resizes, the manager's dicts), several times per module, and every break leaves a
resume function to trace and guard. So every forward hook is registered through ``torch.compiler.disable``:
dynamo does not trace into it and ends the graph once at the call, the hook runs eagerly on the real tensors
(its chunk moves and state transitions happen exactly as without compile), and the next graph starts after
it. The saved-tensor hooks, which autograd calls from inside a compiled forward (dynamo would trace each call
as a new frame and break at the tracer's storage probe), are disabled the same way. A compiled forward is
then one graph per stretch of computation between two chunk-backed modules' boundaries, the floor for
per-module hooks that move memory; the arithmetic inside each graph is the model's own. Gradient hooks run
in the backward, which Lightning calls outside compiled code. The wrapper costs about a microsecond per
call, so hooks are wrapped only when the model holds compiled code at setup (a compiled LightningModule or
submodule); a function compiled some other way still trains correctly, with more graph breaks.

[Note: hooks that hold the engine]
A tensor's hooks (``register_post_accumulate_grad_hook``, ``Tensor.register_hook``) and an autograd node's are
held from C++, where Python's garbage collector cannot follow them, and a parameter with a hook is not traversed
by the collector at all. A hook whose closure reached the engine (the manager holds the records, the records
hold the parameters) was therefore a cycle the collector can never free: a Fabric run, which nothing tears down,
kept its engine, its chunks, the model and its disk-tier run directory until the interpreter exited, after the
user had dropped every reference. So those hooks hold the engine weakly (the manager, the record, the module's
own backward callback, which the module's forward hook, a plain Python dict, keeps alive), and a dropped run is
freed by the next collection, its run directory with it (``tests/integration/test_disk_tier_adversarial.py``).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from lightning_pstar.runtime.family import ParamRecord
from lightning_pstar.runtime.manager import ChunkManager
from lightning_pstar.runtime.module_zero_grad import ModuleZeroGrad
from lightning_pstar.runtime.param_guard import ParameterGuard
from lightning_pstar.runtime.saved_weights import SavedWeights

__all__ = ["ModelHooks", "holds_compiled_code"]

_profiling = torch._C._autograd._profiler_enabled
_graph_task = torch._C._current_graph_task_id  # each backward's own id (-1 outside one)


def _fn(method: Any) -> Any:
    """A bound method as a plain function for a module hook: ``copy.deepcopy`` of the module copies a hook that is
    a bound method together with its object (this engine, thread-locals included: it fails), a function as it is."""
    return lambda *args, **kwargs: method(*args, **kwargs)


# normalisations whose CPU kernels refuse an fp32 input next to compute-dtype parameters (``ModelHooks``)
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)


def _traced(name: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` inside a ``pstar::`` profiler range. Callers check ``_profiling()`` first and call ``fn``
    directly when no profiler records (a range costs two dispatcher calls even without one, and these run for
    every module and parameter of every step)."""
    with torch.profiler.record_function(name):
        return fn(*args)


def _as_is(fn: Any) -> Any:
    return fn


def holds_compiled_code(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled code: ``torch.compile`` of the LightningModule (Lightning keeps the
    compile context on it) or of a submodule (an ``OptimizedModule`` in the tree)."""
    if getattr(module, "_compiler_ctx", None) is not None:
        return True
    return any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in module.modules())


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors that require grad anywhere inside a (nested) output or input structure, in order.

    Iterative on purpose: a recursive closure that refers to itself is a reference cycle, and it would keep
    the module's inputs and outputs (activations) alive until Python's garbage collector happens to run.
    """
    if type(obj) is tuple and all(type(x) is torch.Tensor for x in obj):  # the common case: tensors only
        return [x for x in obj if x.requires_grad]
    if type(obj) is torch.Tensor:
        return [obj] if obj.requires_grad else []
    found: list[torch.Tensor] = []
    stack: list[Any] = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                found.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
        elif hasattr(x, "__dataclass_fields__"):
            stack.extend(getattr(x, name) for name in reversed(list(x.__dataclass_fields__)))
    return found


# [Note: a forward that raises]
# A module's forward may raise and its caller go on (``try: x = self.fast(x) except ...: x = self.slow(x)``). Its
# chunks were fetched by the pre-hook and stay in use until the forward hook releases them, so that hook is registered
# with ``always_call=True``: torch then calls it with no output, and the chunks are released as after a forward no
# backward follows (before, they stayed pinned, and a budget that fits the model refused to make room later). The
# exception torch's non-reentrant activation checkpointing raises to stop a recomputation early is not an error of the
# module: its forward hooks see nothing then, as before (the recomputation's own bookkeeping handles it).
def _even_after_an_error(post: Any) -> Any:
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if output is None:
            error = sys.exc_info()[1]
            if error is not None and type(error).__name__ == "_StopRecomputationError":
                return None
        return post(module, args, output)

    return hook


class ModelHooks:
    """Installs and removes every hook the engine needs on one model."""

    def __init__(self, manager: ChunkManager) -> None:
        self.manager = manager
        self._handles: list[Any] = []
        # [Note: hooks under torch.compile]: eager hooks when the model holds compiled code, else plain ones
        self._eager: Any = torch.compiler.disable if holds_compiled_code(manager.module) else _as_is
        self._saved = SavedWeights(manager, self._eager)  # [Note: saved weights] in saved_weights.py
        self._stats_stash: dict[nn.Module, dict[str, torch.Tensor]] = {}  # BatchNorm parameters during its forward
        self._leaf_handles: list[Any] = []  # hooks on leaf inputs of modules (removed at the next training forward)
        self._guard: ParameterGuard | None = None
        self._grad_hooks: list[tuple[ParamRecord, int]] = []  # the engine's post-accumulate-grad hook per parameter

    def install(self) -> None:
        add = self._add_module_hooks
        for index, (module, records) in enumerate(self.manager.table.module_records.items()):
            add(module, self._make_pre_forward(index, records), self._make_post_forward(index, records), first=True)
        for record in self.manager.records:
            if record.trainable:
                handle = record.param.register_post_accumulate_grad_hook(self._make_grad_hook(record))
                self._handles.append(handle)
                self._grad_hooks.append((record, handle.id))
        self.manager.before_backward.append(self._order_grad_hooks)
        if self.manager.mixed:
            for module in self.manager.table.module_records:
                if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
                    add(module, _fn(self._batchnorm_params_in_fp32), _fn(self._batchnorm_params_back))
                elif isinstance(module, _NORMS):
                    add(module, _fn(self._norm_params_in_fp32_for_fp32_input), _fn(self._batchnorm_params_back))
        if self.manager.mixed:
            for module in self.manager.table.module_records:
                if isinstance(module, nn.EmbeddingBag):
                    hook = self._eager(self._per_sample_weights_in_compute_dtype)
                    self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        host = {id(p) for p in self.manager.host_params.values()}
        for module in self.manager.module.modules():
            if isinstance(module, nn.Embedding) and id(module.weight) in host:
                add(module, self._host_lookup_input, _fn(self._host_lookup_output))
        # a parameter assigned after setup is refused where it is assigned: [Note: parameters fixed at setup]
        self._guard = ParameterGuard(self.manager.module, self._is_managed)
        self._handles.extend(self._guard.install())
        for module in self.manager.module.modules():
            self._handles.append(ModuleZeroGrad(module, self.manager))

    def _order_grad_hooks(self) -> None:
        """[Note: the user's post-accumulate-grad hooks]
        A hook user code registers with ``p.register_post_accumulate_grad_hook`` runs with ``p.grad`` holding the
        gradient, and then the engine's own hook takes it into the chunks (``p.grad`` is None after it). A user's
        hook registered after setup would run after the engine's and see None (an optimizer step fused into the
        backward would silently do nothing), so at each backward's start the engine's hook moves to the end of
        each parameter's hooks. Under gradient accumulation torch hands such a hook the sum of the micro-batches so
        far, where ``p.grad`` here holds this micro-batch's gradient alone: refused, naming the parameter."""
        accumulating = self.manager.grads.accumulating
        with torch._C.DisableTorchFunctionSubclass():  # a parameter parked by a step in flight is read unguarded
            tables = [(record, key, record.param._post_accumulate_grad_hooks) for record, key in self._grad_hooks]
        for record, key, hooks in tables:
            if hooks is None or len(hooks) < 2:
                continue
            if accumulating:
                raise RuntimeError(
                    f"PatrickStar: parameter '{record.names[0]}' has a post-accumulate-grad hook"
                    " (`register_post_accumulate_grad_hook`) and the gradients accumulate over micro-batches: torch"
                    " hands the hook the sum of the micro-batches so far, while PatrickStar's `p.grad` there holds"
                    " this micro-batch's gradient alone. HINT: set accumulate_grad_batches=1 (or accumulate in the"
                    " hook yourself), or remove the hook."
                )
            if next(reversed(hooks)) != key:  # autograd walks the dict's own order (PyDict_Next), which
                hooks[key] = hooks.pop(key)  # an OrderedDict's move_to_end leaves alone: re-insert it last

    def _is_managed(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one the engine manages now (in a chunk slot, or a host-resident embedding)."""
        record = self.manager.table.by_id.get(id(param))
        return (record is not None and record.param is param) or self.manager.is_host_param(param)

    def _add_module_hooks(self, module: nn.Module, pre: Any, post: Any, *, first: bool = False) -> None:
        """Register a forward pre-hook and a forward hook that ``torch.compile`` runs eagerly ([Note: hooks
        under torch.compile]). ``first``: the pre-hook runs before the module's pre-hooks registered earlier (the
        chunks' own: a user's pre-hook such as ``nn.utils.weight_norm``, ``spectral_norm`` or ``prune`` computes
        the weight from parameters that must be resident, and under ``optimizer_overlap="next_forward"``
        stepped, first); the forward hook runs after the module's own."""
        self._handles.append(module.register_forward_pre_hook(self._eager(pre), prepend=first))
        self._handles.append(module.register_forward_hook(self._eager(_even_after_an_error(post)), always_call=True))

    # ---- cpu_embedding: the lookup runs on the host, only its output moves ------------------------------
    @staticmethod
    def _host_lookup_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.to("cpu") if isinstance(a, torch.Tensor) else a for a in args)

    def _host_lookup_output(self, module: nn.Module, args: Any, output: torch.Tensor | None) -> torch.Tensor | None:
        if output is None:  # the lookup raised ([Note: a forward that raises])
            return None
        manager = self.manager
        return output.to(device=manager.device, dtype=manager.compute_dtype)

    # ---- BatchNorm in mixed precision ---------------------------------------------------------------------
    # A BatchNorm's weight and bias live in the chunks in the compute dtype while its running statistics stay
    # fp32 buffers (as in plain Lightning's mixed precision, and in checkpoints). torch's CPU kernel refuses a
    # bf16 weight next to fp32 running statistics ("expected scalar type BFloat16 but found Float"), but takes
    # fp32 weights with a bf16 input, which is what plain Lightning's bf16-mixed runs: so during the module's
    # forward its weight and bias are fp32 copies of the compute-dtype parameters (differentiable: the gradient
    # reaches the parameters), and the running statistics are updated in fp32, as plain Lightning updates them.
    def _batchnorm_params_in_fp32(self, module: nn.Module, args: Any) -> None:
        self._batchnorm_params_back(module)  # a forward interrupted before its post-hook (checkpoint early stop)
        stash: dict[str, torch.Tensor] = {}
        for name in ("weight", "bias"):
            param = module._parameters.get(name)
            if param is not None and param.dtype != torch.float32:
                stash[name] = param
                module._parameters[name] = param.float()  # type: ignore[assignment]
        if stash:
            self._stats_stash[module] = stash

    # The other normalisations (LayerNorm, GroupNorm, InstanceNorm, BatchNorm without running statistics) meet the
    # same refusal on a CPU for an fp32 input next to compute-dtype parameters ("mixed dtype (CPU): expect parameter
    # to have scalar type of Float"; autocast lists none of them there): a residual stream that an fp32 tensor made
    # in the forward promoted to fp32 (Lightning's demo Transformer adds its fp32 positional encoding), or a
    # submodule called directly on an fp32 tensor. Plain Lightning computes those in fp32 with fp32 weights; so do
    # they here, with fp32 copies of the compute-dtype parameters, for such an input only (a compute-dtype input
    # keeps the compute-dtype kernel, as before; on CUDA autocast casts these ops to fp32 anyway).
    def _norm_params_in_fp32_for_fp32_input(self, module: nn.Module, args: Any) -> None:
        self._batchnorm_params_back(module)
        if args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float32:
            self._batchnorm_params_in_fp32(module, args)

    def _batchnorm_params_back(self, module: nn.Module, *_: Any) -> None:
        for name, param in self._stats_stash.pop(module, {}).items():
            module._parameters[name] = param  # type: ignore[assignment]

    # ---- EmbeddingBag's per-sample weights in mixed precision ------------------------------------------------
    # ``F.embedding_bag`` takes per-sample weights only in its weight's dtype. Plain Lightning's mixed precision
    # keeps the weight fp32, so a model passes fp32 per-sample weights; here the weight is the compute-dtype copy,
    # so they are cast to it (differentiably) for the call, as autocast casts a listed op's inputs.
    @staticmethod
    def _per_sample_weights_in_compute_dtype(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        dtype = weight.dtype
        if len(args) > 2 and isinstance(args[2], torch.Tensor) and args[2].dtype != dtype:
            return (*args[:2], args[2].to(dtype), *args[3:]), kwargs
        weights = kwargs.get("per_sample_weights")
        if isinstance(weights, torch.Tensor) and weights.dtype != dtype:
            return args, {**kwargs, "per_sample_weights": weights.to(dtype)}
        return None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._remove_leaf_hooks()
        self._saved.release()
        for module in list(self._stats_stash):  # a forward that raised: hand back the parameters
            self._batchnorm_params_back(module)

    def _remove_leaf_hooks(self) -> None:
        for handle in self._leaf_handles:
            handle.remove()
        self._leaf_handles.clear()

    # ---- tensors autograd saves for backward ([Note: saved weights] in saved_weights.py) -----------------
    @contextmanager
    def saved_tensors(self) -> Generator[None, None, None]:
        """Around a training forward: saved weights by reference, and the warm-up's saved-tensor accounting."""
        self._remove_leaf_hooks()
        with self._saved.hooks():
            try:
                yield
            except RuntimeError as err:
                if "torch.func" in str(err) and "saved tensor hooks" in str(err):
                    raise RuntimeError(
                        "PatrickStar tracks the weights autograd saves in a training step with saved-tensor hooks,"
                        " which torch.func's transforms (grad, vjp, jacrev, hessian; vmap over them) refuse. HINT:"
                        " compute per-sample gradients with torch.autograd.grad in a loop over the samples, or train"
                        " this model with another strategy."
                    ) from err
                raise

    # ---- factories (closures keep the per-module record list; nothing is stored on the module) --------
    def _make_pre_forward(self, index: int, records: Sequence[ParamRecord]) -> Any:
        manager = self.manager

        def post_backward() -> None:
            manager.post_backward(records)

        def pre_forward(module: nn.Module, args: Any) -> None:
            if _profiling():
                _traced("pstar::pre_forward", manager.pre_forward, records, index)
            else:
                manager.pre_forward(records, index)
            if torch.is_grad_enabled() and not manager.stationary:  # stationary: nothing to let move
                inputs = _grad_tensors(args)
                if inputs:
                    # fires once the module's backward has produced the gradient of its inputs: its
                    # chunks may move again (a tied weight waits for its gradient elsewhere, unpinned)
                    self._register(inputs, post_backward, inputs=True)

        return pre_forward

    def _make_post_forward(self, index: int, records: Sequence[ParamRecord]) -> Any:
        manager = self.manager

        def pre_backward() -> None:
            if _profiling():
                _traced("pstar::pre_backward", manager.pre_backward, records, index)
            else:
                manager.pre_backward(records, index)

        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            outputs = _grad_tensors(output) if torch.is_grad_enabled() else []
            manager.post_forward(records, index, backward_follows=bool(outputs))
            if outputs and not manager.stationary:  # stationary: the chunks are resident through the backward
                self._register(outputs, pre_backward, inputs=False)

        return post_forward

    def _make_grad_hook(self, record: ParamRecord) -> Any:
        # weak: the parameter's hook dict is held from C++, out of the garbage collector's sight, so a hook that
        # held the engine would keep the engine, the chunks and the model alive forever once they are dropped
        # (a Fabric run is never torn down): [Note: hooks that hold the engine]
        manager_ref, record_ref = weakref.ref(self.manager), weakref.ref(record)

        def grad_hook(param: torch.Tensor) -> None:
            grad = param.grad
            manager, record = manager_ref(), record_ref()
            if grad is None or manager is None or record is None:  # pragma: no cover - (the engine is gone)
                return
            if _profiling():
                _traced("pstar::grad_ready", manager.grad_ready, record, grad)
            else:
                manager.grad_ready(record, grad)
            param.grad = None  # the chunk holds it now; free autograd's copy

        return grad_hook

    def _register(self, tensors: list[torch.Tensor], fn: Any, *, inputs: bool) -> None:
        """Call ``fn`` once per backward, when the first gradient of any of ``tensors`` has been computed.

        What ``register_multi_grad_hook(tensors, fn, mode="any")`` does, without its per-call lock, wrapper and
        handle objects, and armed again for each backward of the graph (``retain_graph``: the second backward
        makes the module's chunks resident, and meets the transition guard, as the first did). Outputs get a
        pre-hook on their autograd node (what ``Tensor.register_hook`` installs on a non-leaf, less its handle and
        the tensor's hook dict; one per node): the module's backward is that node running. Inputs get
        ``Tensor.register_hook``, which autograd also calls for a tensor whose gradient it only captures
        (``torch.autograd.grad(..., inputs=h)``), where the node never runs; a leaf's hook (a parameter passed as
        an input) is removed at the next training forward, so hooks do not pile up on the leaf.
        """
        fired = -2  # the backward (autograd graph task) it last fired in
        # weak ([Note: hooks that hold the engine]): ``fn`` lives in the module's own forward hook, which the
        # collector sees; a tensor's or a node's hooks are held from C++
        fn_ref = weakref.ref(fn)

        def once(*_: Any) -> None:
            nonlocal fired
            task = _graph_task()
            if task != fired:
                fired = task
                call = fn_ref()
                if call is not None:
                    call()

        if inputs:
            for tensor in tensors:
                handle = tensor.register_hook(once)
                if tensor.grad_fn is None:
                    self._leaf_handles.append(handle)
            return
        seen = None
        for tensor in tensors:
            node = tensor.grad_fn
            if node is None:  # an output that is a leaf (an input handed back)
                tensor.register_hook(once)
            elif node is not seen:
                node.register_prehook(once)
                seen = node
