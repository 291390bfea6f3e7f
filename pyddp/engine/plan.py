"""The bucket plan over a GradSync's life: the planners (pyddp's, public,
and torch DDP's by torch's own assignment), the first plan (pyddp's, from the
parameters in reverse order), the one rebuild from the ready order observed in
the first synced backward (rank 0's, across processes), torch DDP's plan once a
communication hook sees the buckets, 16-bit wire copies on GPUs, and the
re-allocation after Module._apply moved the gradients. Every change lays the
buckets out again and retires the old memory after the reductions that may
still use it.

Communication hooks (torch DDP's `register_comm_hook`) land here too, since a
hook changes the plan: torch's built-in hooks by short name, and how each
reaches the buckets. On CPU replicas across processes the hook itself runs on
every summed bucket (the link's transport calls it). On GPUs the buckets never
come back to Python: NCCL reduces them from pyddp's C++ core, which runs
torch's 16-bit compression hooks itself (cast, scale by 1/ranks, NCCL sum in
16 bits, cast back; the scaling bitwise the hooks' own arithmetic on CUDA
tensors, the sums NCCL's: docs/across-processes.md), so only those are
accepted there."""

from __future__ import annotations

import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from .. import _C
from ..runtime.libraries import nvrtc_path
from .buckets import BucketLayout
from .options import Options
from .params import dtype_name, same_dtypes
from .streams import StreamOrder

WIRE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _default_hooks() -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks


def builtin_comm_hook(name: str) -> Callable[..., Any]:
    """torch DDP's built-in compression hooks, by short name."""
    hooks = _default_hooks()
    named = {
        "fp16": hooks.fp16_compress_hook,
        "bf16": hooks.bf16_compress_hook,
        "allreduce": hooks.allreduce_hook,
    }
    if name not in named:
        raise ValueError(f"register_comm_hook: unknown hook {name!r}; built in: {', '.join(named)}")
    return named[name]


def resolve_hook(hook: Any) -> Callable[..., Any]:
    """A hook by name or a callable (state, bucket) -> Future."""
    if isinstance(hook, str):
        hook = builtin_comm_hook(hook)
    if not callable(hook):
        raise TypeError(
            f"register_comm_hook: hook must be callable (state, bucket) -> Future, or "
            f"'fp16'/'bf16', got {type(hook).__name__}"
        )
    return hook


def gpu_wire_dtype(hook: Callable[..., Any]) -> Optional[str]:
    """The wire type that runs `hook` on GPUs in pyddp's core ("float32":
    the plain all-reduce), or None: the hook runs in Python, per bucket."""
    hooks = _default_hooks()
    return {
        hooks.fp16_compress_hook: "float16",
        hooks.bf16_compress_hook: "bfloat16",
        hooks.allreduce_hook: "float32",
    }.get(hook)


def check_gpu_state(state: Any, group: Optional[Any]) -> None:
    """torch's hooks take the process group as their state; on GPUs pyddp's
    NCCL communicator spans the wrapped group, so that is the only one."""
    if state is not None and state is not group:
        raise ValueError(
            "register_comm_hook: on GPUs the hook's state must be None or the process group "
            f"the model was wrapped with (pyddp's NCCL communicator spans it), got {state!r}"
        )


# Fields of torch's hook states that only decide when a rank logs: ranks may differ.
_LOGGING_ONLY = frozenset({"compression_stats_logging_frequency", "next_stats_report"})


def hook_state_settings(state: Any) -> Dict[str, str]:
    """What of a communication hook's `state` every rank must share, as text
    compared across ranks when the hook is registered (ranks whose PowerSGD
    ranks or start steps differ send all-reduces of different sizes: gloo
    aborted both processes). torch's states (PowerSGDState,
    PostLocalSGDState, a process group) by each setting; another class only
    by its name: its fields may differ by rank on purpose (a user's `rank`)."""
    if state is None or _is_group(state):
        return {"group": _group_text(state)}
    kind = type(state)
    settings = {"type": f"{kind.__module__}.{kind.__qualname__}"}
    if not kind.__module__.startswith("torch."):
        return settings
    names = [n for k in kind.__mro__ for n in getattr(k, "__slots__", ())]
    for name in names + sorted(getattr(state, "__dict__", {})):
        value = getattr(state, name, None)
        if name in _LOGGING_ONLY or name.startswith("_"):
            continue
        if name == "process_group" and (value is None or _is_group(value)):
            settings[name] = _group_text(value)
        elif value is None or isinstance(value, (bool, int, float, str)):
            settings[name] = repr(value)
    # (Not PowerSGD's random generator: ranks with different seeds start from
    # different matrices, but every rank reduces to the same result.)
    return settings


def local_sgd_start(hook: Callable[..., Any], state: Any) -> Optional[int]:
    """torch's post-local SGD hook reduces over the whole group for its
    first `start_localSGD_iter` synced backwards, then over a subgroup or
    not at all: from there each rank's parameters differ on purpose until a
    model averager averages them. The synced backward where that starts
    (registration comes before the first backward), or None for any other
    hook."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook

    if getattr(hook, "func", hook) is not post_localSGD_hook.post_localSGD_hook:
        return None  # (also wrapped in another hook, e.g. fp16_compress_wrapper: not seen)
    start = getattr(state, "start_localSGD_iter", None)  # (a wrong state: the hook says so)
    return None if start is None else max(0, int(start) - int(getattr(state, "iter", 0)))


def _is_group(value: Any) -> bool:
    return torch.distributed.is_available() and isinstance(value, torch.distributed.ProcessGroup)


def _group_text(group: Any) -> str:
    """A process group as every rank sees it (None: the default group)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return "the default group"
    return f"a group of {torch.distributed.get_world_size(group)} ranks"


def plan_buckets(
    numels: Sequence[int],
    dtypes: Sequence[str],
    order: Sequence[int],
    first_cap: int,
    cap: int,
    taper: bool = False,
) -> List[List[int]]:
    """The engine's bucket plan (csrc/bucket_plan.cpp), public for planners
    such as the simulator: parameters taken in `order` (their ready order),
    one open bucket per dtype ("float32", ...); a bucket closes once it holds
    `first_cap` bytes (the first to close) or `cap` (every later one); the
    partial buckets left at the end follow. `taper` (the engine's
    `taper_buckets=True`): a later bucket opened when R bytes of its dtype
    are still unplaced closes at min(cap, max(first_cap, R / 2)), so the last
    buckets shrink by halves down to the first one's size. `cap` 0: one
    bucket per parameter."""
    if not isinstance(taper, bool):
        raise TypeError(f"taper={taper!r} must be True or False")
    return _C.plan_buckets(list(numels), list(dtypes), list(order), first_cap, cap, taper)


def ddp_plan(
    params: Sequence[torch.Tensor], limits: Sequence[int], order: Optional[Sequence[int]] = None
) -> List[List[int]]:
    """torch DDP's bucket plan, by torch's own assignment: with `order`
    None, its plan at construction (parameters in model order, buckets
    reversed so the last layers' launch first); with `order` (rank 0's
    ready order), its rebuilt plan after the first iteration. A
    communication hook sees these buckets, so a hook that depends on the
    grouping gives DDP's numbers (GradSync.register_comm_hook)."""
    import torch.distributed as dist  # torch's own; only a hooked model asks

    if order is None:
        buckets, _ = dist._compute_bucket_assignment_by_size(
            list(params), list(limits), [False] * len(params)
        )
        return [list(b) for b in reversed(buckets)]
    tensors = [params[i] for i in order]
    buckets, _ = dist._compute_bucket_assignment_by_size(
        tensors, list(limits), [False] * len(tensors), list(order)
    )
    return [list(b) for b in buckets]


def first_plan(params: Sequence[torch.Tensor], dtypes: List[str], opts: Options) -> List[List[int]]:
    """pyddp's plan before any backward: parameters in reverse order (about
    the order backward produces them), capped as `opts` says."""
    cap, first_cap = opts.cap_bytes()
    order = list(reversed(range(len(params))))
    return plan_buckets(
        [p.numel() for p in params], dtypes, order, first_cap, cap, opts.taper_buckets
    )


class Plan:
    """Owns the bucket plan of one engine: when to re-plan and how, and the
    layout's memory through each change."""

    def __init__(
        self,
        engine: Any,
        layout: BucketLayout,
        order: StreamOrder,
        link: Any,
        params: Sequence[torch.Tensor],
        backend: Any,
        opts: Options,
    ):
        self.engine, self.layout, self.order, self.link = engine, layout, order, link
        self.params = params  # replica 0's
        self.backend = backend
        self.cap, self.first_cap = opts.cap_bytes()
        self.taper = opts.taper_buckets
        self.rebuild_pending = opts.rebuild_buckets and self.cap > 0
        self.rebuild_allowed = opts.rebuild_buckets
        # torch DDP's static_graph and find_unused_parameters: they shape its
        # bucket plan, which a hook sees (as_ddp, which sets ddp).
        self.ddp_args = (opts.static_graph, opts.find_unused_parameters)
        self.ddp = False
        self.hook_set = False  # register_comm_hook was called (once, as with DDP)

    @staticmethod
    def build(
        names: Sequence[str],
        params: Sequence[Sequence[torch.Tensor]],
        opts: Options,
        backend: Any,
        op: str,
        order: StreamOrder,
        link: Any,
    ) -> Tuple[Any, BucketLayout, Plan]:
        """A reducer's engine (on the first plan), its bucket layout
        (allocated) and this plan over both, for `params[replica][i]`."""
        first = params[0]
        dtypes = [dtype_name(n, p) for n, p in zip(names, first)]
        buckets = first_plan(first, dtypes, opts)
        numels = [p.numel() for p in first]
        engine = _C.Engine(
            len(params), list(names), numels, dtypes, buckets, opts.reduce_order, op, backend
        )
        if opts.static_graph:  # its first synced backward counts each gradient's arrivals
            engine.learn_counts()
        given: Dict[Tuple[int, int], int] = {}  # (replica, bucket) -> where the engine writes

        def set_buffer(r: int, b: int, ptr: int, *rest: Any) -> None:
            given[r, b] = ptr
            engine.set_buffer(r, b, ptr, *rest)

        layout = BucketLayout(params, dtypes, set_buffer, order.devices, order.fence, order.zeros)
        layout.given = given  # (hooks.storage_kept reads it)
        layout.window.names = names
        plan = Plan(engine, layout, order, link, first, backend, opts)
        plan.allocate(buckets)
        return engine, layout, plan

    def allocate(self, buckets: Sequence[Sequence[int]]) -> None:
        same_dtypes(self.layout)
        old = self.layout.memory()
        # The link may send something with the last bucket (the agreement).
        spare = self.link.spare_elements(self.params[buckets[-1][0]].dtype)
        self.layout.allocate(buckets, spare)
        self.order.retire(self.engine, old)
        layout = self.layout
        self.link.set_buckets(layout.flat[0], buckets, self.params, layout.views[0], layout.riding)

    def set_scatter(self, ranks: int) -> None:
        """Sharded gradients from the next backward on: every bucket a
        reduce-scatter over `ranks` ranks, padded to a block per rank; the
        bucket plan is final from now on (the shards are cut from it)."""
        if self.engine.active:
            self.engine.abort()
        if any(p.grad is not None for p in self.params):
            # allocate() copies them into the new buckets on the host: after
            # the reductions still reading the old ones. (Without gradients
            # nothing is written; the old buckets are retired either way.)
            self.order.fence_all()
        self.rebuild_pending = False
        self.layout.pad_to = ranks
        # CPUs in one process: a bucket's reduction is done when the engine's
        # call returns, so its buffers are freed during backward.
        early = self.order.devices is None and not self.link.spans_processes
        # The cross-process CPU backend writes each block in place itself.
        direct = self.order.devices is not None or not self.link.spans_processes
        rank_of = [self.backend.rank_of(r) for r in range(len(self.layout.params))]
        self.layout.scatter_setup(rank_of, self.engine, self.order.retire, early, direct)
        self.link.set_scatter(ranks)
        self.engine.set_scatter(ranks)
        self.allocate(self.engine.buckets)

    def rebuild_once(self) -> None:
        """After the first synced backward: every process plans from rank 0's
        ready order."""
        if not self.rebuild_pending:
            return
        order = self.link.root_order(self.engine.ready_order(), len(self.params))
        if not order:  # rank 0 has none: static_graph's counting backward (the next one plans)
            return
        self.rebuild_pending = False
        if len(order) != len(self.params):
            return
        if self.ddp:  # torch DDP's rebuilt plan: a hook sees it
            buckets = ddp_plan(self.params, [self.first_cap, self.cap], order)
        else:
            numels = [p.numel() for p in self.params]
            buckets = plan_buckets(
                numels, self.layout.dtypes, order, self.first_cap, self.cap, self.taper
            )
        self.set(buckets)

    def set(self, buckets: List[List[int]]) -> None:
        if buckets == self.engine.buckets:
            return
        self.order.fence_all()
        self.engine.set_buckets(buckets)
        self.allocate(buckets)

    def reattach(self, params_moved: Optional[Callable[[], Set[int]]] = None) -> None:
        """Fresh bucket buffers for every gradient, values kept (after the
        wrapped model's changes inside a no_sync() window are judged: Window.check)."""
        same_dtypes(self.layout)
        self.layout.window.check(self.layout, params_moved)
        if self.layout.scattered is not None:
            # shard='gradients': the blocks hold the reduced values, kept
            # across a step too (fresh ones from the placeholders lost the
            # kept gradients); only a no_sync() window's open buckets, which
            # the gradients left, take fresh buffers.
            for r in range(len(self.layout.params)):
                self.layout.scattered.relay(r)
        else:
            if self.engine.active:
                self.engine.abort()
            self.order.fence_all()
            self.allocate(self.engine.buckets)
        self.layout.window.check(self.layout, params_moved, relaid=True)  # (the new buckets)

    def as_ddp(self) -> None:
        """A communication hook sees buckets: from now on they are torch
        DDP's for the same arguments (its initial plan, then its rebuild
        from rank 0's ready order, or none with find_unused_parameters)."""
        static, unused = self.ddp_args
        if static or not unused:
            limits = [sys.maxsize]  # DDP's first iteration: one bucket
        elif self.first_cap < self.cap:
            limits = [self.first_cap, self.cap]
        else:
            limits = [self.cap]
        self.ddp = True
        # DDP rebuilds once unless it looks for unused parameters every step.
        self.rebuild_pending = self.rebuild_allowed and (static or not unused)
        self.set(ddp_plan(self.params, limits))

    def register_comm_hook(self, state: Any, hook: Any, on_gpus: bool, used: bool) -> None:
        """GradSync.register_comm_hook, once the hook is known valid for now
        (`used`: a backward or a step already ran)."""
        hook = resolve_hook(hook)
        if self.engine.scatter_ranks:
            raise RuntimeError(
                "pyddp: a communication hook on a model whose gradients are sharded "
                "(shard='gradients'): a hook sees and returns whole buckets, which are "
                "reduce-scattered here; use shard=True with the hook"
            )
        if self.hook_set:
            raise RuntimeError(
                "pyddp: a communication hook is already registered; register one, once, as "
                "with torch DDP"
            )
        if used:
            raise RuntimeError(
                "pyddp: register_comm_hook must be called before the first backward (torch "
                "DDP's docs ask the same, though it accepts one later): every rank must reduce "
                "every step the same way, and a hook's state starts with the run"
            )
        if not on_gpus:
            self.link.register_comm_hook(state, hook)
            if self.link.spans_processes:
                self.as_ddp()
        else:
            self._compress_on_gpus(state, hook)  # elementwise: the grouping does not matter
        fn = getattr(hook, "func", hook)  # (a functools.partial's function)
        name = getattr(fn, "__qualname__", type(fn).__name__)
        module = getattr(fn, "__module__", None) or "?"
        self.link.note_hook(
            f"{module}.{name}", hook_state_settings(state), local_sgd_start(hook, state)
        )
        self.hook_set = True

    def _compress_on_gpus(self, state: Any, hook: Callable[..., Any]) -> None:
        """The hook on GPUs: torch's 16-bit hooks run by the NCCL backend;
        any other is called per bucket on the backend's stream."""
        wire = gpu_wire_dtype(hook)
        if wire is None:
            self.link.register_gpu_hook(state, hook, self.backend)
            if self.link.spans_processes:
                self.as_ddp()  # the buckets a hook sees are DDP's, as on CPUs
            return
        check_gpu_state(state, self.link.group)
        if wire == "float32":
            return
        if not hasattr(self.backend, "set_compression"):
            warnings.warn(
                "pyddp: the communication hook is not used: these replicas share one GPU, and "
                "pyddp's kernel reduces them in its memory (nothing crosses a wire)",
                stacklevel=5,
            )
            return
        self.backend.set_compression(wire, nvrtc_path("compressed buckets convert with NVRTC"))
        self.layout.wire_dtype = WIRE_DTYPES[wire]
        self.allocate(self.engine.buckets)
