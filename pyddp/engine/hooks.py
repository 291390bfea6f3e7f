"""The autograd hooks that feed the engine. A gradient accumulated on replica
r marks parameter i ready (on GPUs with the stream that produced it); a
forward pre-hook readies the replica for the next backward. Hooks sit on the
replicas' parameters, replica 0's being the user's model: they hold their
reducer weakly, so dropping the wrapped model releases it, and they copy as
standard-library callables, so a copied or pickled model carries no live
pyddp state.

Replicas get C++ hooks instead where the torch-linked hot path is built for
this torch (pyddp._hot, runtime.libraries.hot): on each parameter's
gradient accumulator, as torch DDP's reducer registers them, doing the
common case (copy into the bucket view, mark ready; on GPUs with the
current stream, read from torch's stream state or the stream provider's C
entry points) without Python, and handing the rest to the Python hook
below. They live on the accumulators, not the parameters, so a copied model
carries none either."""

from __future__ import annotations

import functools
import operator
import weakref
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import nn

from .. import _C
from ..runtime.libraries import DTYPE_NAMES, hot
from .params import same_dtypes
from .streams import cuda_stream_handle


def install_hooks(reducer: Any, handles: List[Any], began: bool, prepare_on_forward: bool) -> None:
    """The reducer's hooks on every replica, their handles into `handles`:
    a post-accumulate-grad hook per parameter, and (`prepare_on_forward`)
    a forward pre-hook per replica."""
    owner, mark = weakref.ref(reducer), reducer._engine.mark_ready
    gpus, streams = reducer._gpu_devices, reducer._streams
    layout = reducer._layout
    layout.handles = handles  # (sharded gradients' guards join them: released alike)
    fast = hot()
    python_hooks: List[List[Callable[[torch.Tensor], None]]] = []
    for r, (module, params) in enumerate(zip(reducer._replicas, reducer._params)):
        device = -1 if gpus is None else gpus[r]
        views, ptrs = layout.views[r], layout.ptrs[r]
        python_hooks.append([])
        for i, p in enumerate(params):
            hook = grad_hook(owner, views, ptrs, r, i, mark, streams, device, began)
            if fast is None:
                handles.append(p.register_post_accumulate_grad_hook(hook))
            python_hooks[r].append(hook)
        if prepare_on_forward:  # wrap prepares all replicas itself, hook-free
            handles.append(module.register_forward_pre_hook(PrepareHook(reducer, r)))
    if fast is not None:
        layout.hot = _cpp_hooks(fast, reducer, python_hooks, began, gpus, streams)
        handles.append(layout.hot)
        layout.tell_hooks()


def _cpp_hooks(
    fast: Any,
    reducer: Any,
    python_hooks: List[List[Any]],
    began: bool,
    gpus: Optional[List[int]],
    streams: Any,
) -> Any:
    """pyddp._hot's hooks: `python_hooks[r][i]` runs for whatever they leave
    to Python (called with the parameter). GPU replicas (`gpus`, their
    devices) read their current streams from the stream provider's C entry
    points (`streams.hot_source()`), or from torch's stream state where it
    has none."""
    params = reducer._params
    owner = weakref.ref(reducer)

    def fallback(r: int, i: int) -> None:
        python_hooks[r][i](params[r][i])

    engine, mark = reducer._engine.hot_entry()
    return fast.HookSet(
        params,
        engine,
        mark,
        fallback,
        functools.partial(_began, owner) if began else None,
        _C.ReduceError,
        _C.UsageError,
        reducer._layout._handed,
        devices=[] if gpus is None else list(gpus),
        source=None if gpus is None else streams.hot_source(),
        translate=None if gpus is None else cuda_stream_handle,
    )


def grad_hook(
    owner: Any,
    views: List[Optional[torch.Tensor]],
    ptrs: List[int],
    r: int,
    i: int,
    mark: Callable[..., None],
    streams: Any = None,
    device: int = -1,
    began: bool = False,
) -> Callable[[torch.Tensor], None]:
    """Replica r's post-accumulate-grad hook for parameter i. `owner` is a
    weak reference to the reducer; `views[i]` is the gradient's bucket view,
    laid out at `ptrs[i]` (0: not tracked). `began`: tell the owner's wrapped
    model a gradient arrived (one replica per process, where a backward may
    bypass the model's outputs); every other hook skips that call. Either
    hook adopts a gradient that is not its view, or whose view left its
    slice (`p.grad.data = ...` after the forward): one inline test each, as
    it runs per parameter per step."""
    if streams is None:

        def on_grad(p: torch.Tensor) -> None:
            g = p.grad
            if g is not views[i] or (ptrs[i] and g.data_ptr() != ptrs[i]):
                _adopt(owner, p, views[i], r, i)
            if began:
                _began(owner)
            mark(r, i)

        return on_grad
    current, produced = streams.current, streams.produced

    def on_grad_gpu(p: torch.Tensor) -> None:
        g = p.grad
        if g is not views[i] or (ptrs[i] and g.data_ptr() != ptrs[i]):
            streams.before_host_write(device)
            _adopt(owner, p, views[i], r, i)
        if began:
            _began(owner)
        if produced is not None:  # the simulation's late write (see engine/streams.py)
            produced(device, views[i])
        # Autograd runs this hook on the stream that accumulated the
        # gradient: the reduction waits for that stream, not another.
        mark(r, i, current(device))

    return on_grad_gpu


def _began(owner: Any) -> None:
    """Tells the wrapped model a gradient arrived (its on_backward_start,
    set where a backward may bypass its outputs)."""
    reducer = owner()
    if reducer is not None and reducer._on_backward_start is not None:
        began = reducer._on_backward_start()
        if began is not None:
            began()


def arm_began(reducer: Any) -> None:
    """The C++ hooks tell the wrapped model of the next backward's first
    gradient (once per backward; the Python hooks tell it of every one):
    armed at construction, before each forward, after finish and abort."""
    if reducer._on_backward_start is not None and reducer._layout.hot is not None:
        reducer._layout.hot.arm_began()


def _adopt(owner: Any, p: torch.Tensor, view: torch.Tensor, r: int, i: int) -> None:
    """A gradient that arrived outside its bucket view is copied in; one of
    another dtype than its bucket's is refused by name (a parameter converted
    after the GradSync was made: torch's own error from the copy before)."""
    reducer = owner()
    if reducer is None:
        return
    if DTYPE_NAMES.get(p.dtype) != reducer._layout.dtypes[i]:  # (its view converted with it)
        same_dtypes(reducer._layout)  # (names the parameter and the remedy)
    reducer._layout.adopt(p, view, r, i)


def storage_kept(layout: Any, r: int) -> None:
    """Before replica r's forward (GradSync): its buckets are where the engine
    writes. share_memory() moves a bucket's storage under its views: the
    engine would write the freed memory."""
    if layout is None:
        return
    for b, flat in enumerate(layout.flat[r]):
        if flat is not None and flat.data_ptr() != layout.given.get((r, b), flat.data_ptr()):
            raise RuntimeError(
                f"pyddp: replica {r}'s gradients were given new storage after the GradSync "
                "laid out its buckets (share_memory() moves them with the gradients): call "
                "sync.reattach() after it, before the next forward"
            )


class InertCopy:
    """A forward pre-hook pyddp leaves on the user's modules. A copy of the
    module (copy.deepcopy, pickle, torch.save) must not carry a live pyddp
    hook, nor need pyddp to load: it copies as `functools.partial(dict.pop,
    {})`, a standard-library callable that returns the forward's arguments
    unchanged."""

    def __reduce__(self) -> Any:
        return functools.partial, (dict.pop, {})


def refuse_state_dict(module: nn.Module, why: str) -> List[Any]:
    """A state_dict pre-hook raising `why` on the user's model and each of its
    modules (a submodule's state dict holds the mix too); their handles."""
    hook = _RefuseStateDict(why)
    return [m.register_state_dict_pre_hook(hook) for m in module.modules()]


class _RefuseStateDict:
    """Raises: the model holds a mix of stepped and unstepped values. Copies
    of the model are inert (`functools.partial(slice)` takes the hook's
    three arguments and returns a value torch ignores)."""

    def __init__(self, why: str):
        self.why = why

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        raise RuntimeError(
            f"{self.why}. The model holds that mix, so its state_dict() is refused; "
            "close() the wrapped model to read it anyway"
        )

    def __reduce__(self) -> Any:
        return functools.partial, (slice,)


class PrepareHook(InertCopy):
    """Replica r's forward pre-hook: prepare(r) before a forward that may be
    followed by backward. Holds the reducer weakly."""

    def __init__(self, sync: Any, replica: int):
        self.owner = weakref.ref(sync)
        self.replica = replica

    def __call__(self, module: nn.Module, args: Any) -> None:
        sync = self.owner()
        if sync is not None and torch.is_grad_enabled():
            storage_kept(sync._layout, self.replica)
            sync.prepare(self.replica)
            if self.replica == 0:
                sync.compare_settings()  # (wrap compares at the forward's end)


def accumulate_hook_marks(params: Sequence[torch.Tensor]) -> List[Any]:
    """Per parameter, its post-accumulate-grad hooks' last key (None: none):
    a hook registered since shows as another."""
    return [next(reversed(d), None) if d else None for d in map(_ACCUMULATE_HOOKS, params)]


_ACCUMULATE_HOOKS = operator.attrgetter("_post_accumulate_grad_hooks")


def refuse_accumulate_hooks(
    names: Sequence[str], params: Sequence[Sequence[torch.Tensor]], marks: List[List[Any]]
) -> List[List[Any]]:
    """Several replicas in a process (`params[r]`: replica r's, named
    `names`): a post-accumulate-grad hook the user put on a parameter of
    replica 0 (the user's model) alone would run there alone, on replica
    0's share of the gradient before the reduction; an optimizer step in
    backward (torch's recipe) stepped that share (0.069 off one device),
    or, zeroing the gradient, failed inside pyddp. `marks`: each replica's
    accumulate_hook_marks as last seen. Hooks registered on every replica
    alike are kept. Returns the marks now; one pass over replica 0's
    parameters where its hooks did not change (a handle made elsewhere)."""
    now0 = accumulate_hook_marks(params[0])
    if now0 == marks[0]:
        return marks
    now = [now0] + [accumulate_hook_marks(ps) for ps in params[1:]]
    moved = [list(map(operator.ne, n, w)) for n, w in zip(now, marks)]
    for name, mine, *others in zip(names, *moved):
        if mine and not all(others):
            how = ": registered or removed"
            raise RuntimeError(_accumulate_hook_refusal(name, len(params), how))
    return now


def refuse_accumulate_hooks_at_wrap(model: nn.Module, replicas: int) -> None:
    """refuse_accumulate_hooks at wrap: any hook but pyddp's own (a model
    another wrap still holds is named as such where that is checked)."""
    if replicas < 2:
        return
    for name, p in model.named_parameters():
        hooks = p._post_accumulate_grad_hooks
        if hooks and any(getattr(h, "__module__", None) != __name__ for h in hooks.values()):
            raise RuntimeError(_accumulate_hook_refusal(name, replicas))


def _accumulate_hook_refusal(name: str, replicas: int, how: str = " has") -> str:
    return (
        f"pyddp: parameter {name!r}{how} a post-accumulate-grad hook "
        "(register_post_accumulate_grad_hook, e.g. an optimizer step in backward) on your model "
        f"alone: with {replicas} replicas in this process it runs on replica 0's share of "
        "the gradient alone, before the reduction. Step after the backward (dmodel.optimizer, "
        "or torch's over the model), hook every replica's share with p.register_hook, "
        "or run one replica per process (torchrun), where it runs on the process's "
        "gradient before the reduction, as under torch DDP"
    )
