"""`torch.compile(dmodel)`, the way torch DDP is compiled (`torch.compile(DDP(model))`,
and Lightning Fabric's `setup` of a compiled model), made to work.

Dynamo cannot trace pyddp's forward (worker threads, gradient hooks, the
agreement's packing; across processes it failed with a RecursionError inside
pyddp). So the wrapped model's forward runs outside dynamo, and the first
forward called through a `torch.compile`d wrapper runs every replica through
that compile's own settings (its backend, mode, dynamic): what
`dmodel.compile(...)` does, with the same arguments. A `dmodel.compile(...)`
called before keeps its own. A compiled function that calls the wrapped model
(`torch.compile(train_step)`) runs it uncompiled, as a graph break, and
`fullgraph=True` fails at the wrapper, as `torch.compile(DDP(model),
fullgraph=True)` fails: `dmodel.compile(fullgraph=True)` compiles each replica
whole.

Only once dynamo is loaded (a torch.compile was made): before, forward is the
plain method, and pyddp does not import dynamo (a second to import)."""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, Optional

import torch


class OutsideDynamo:
    """A method that dynamo does not trace, run eagerly as a graph break
    (pyddp's replicated optimizer step: traced, replica 0's step ran
    compiled on the calling thread and the others' eagerly on their
    workers, and the replicas drifted apart, 2e-6 after 200 Adam steps).
    Before dynamo is loaded the plain method. The class reads the function
    itself (torch's optimizers read attributes of their step)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._eager: Optional[Callable[..., Any]] = None
        self.__doc__ = fn.__doc__

    def __get__(self, obj: Any, cls: Any = None) -> Any:
        if obj is None:
            return self._fn
        if "torch._dynamo" not in sys.modules:
            return types.MethodType(self._fn, obj)
        if self._eager is None:
            self._eager = self._outside(self._fn)
        return types.MethodType(self._eager, obj)

    def _outside(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch._dynamo.disable(fn)


class EagerUnderDynamo(OutsideDynamo):
    """A forward method that dynamo does not trace (see the module)."""

    def _outside(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return _outside_dynamo(fn)


def _outside_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    from torch._dynamo import eval_frame

    def forward(model: Any, *args: Any, **kwargs: Any) -> Any:
        if eval_frame._is_in_optimized_module() and not model._compiled_replicas:
            _compile_through_wrapper(model, eval_frame.OptimizedModule)
        return fn(model, *args, **kwargs)

    return torch._dynamo.disable(forward)


def _compile_through_wrapper(model: Any, optimized: type) -> None:
    """Compiles the replicas with the settings of the nearest OptimizedModule
    this call came through (torch.compile(dmodel), or of a module around it)."""
    frame = sys._getframe(2)
    call = optimized.__call__.__code__
    while frame is not None and frame.f_code is not call:
        frame = frame.f_back
    if frame is None:
        return
    wrapper = frame.f_locals.get("self")
    ctx = getattr(wrapper, "dynamo_ctx", None)
    if ctx is None:
        return
    model._callables = [ctx(replica) for replica in model._replicas]
    model._compiled_replicas = True
    model._workers.compiled()
