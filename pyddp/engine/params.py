"""Which parameters the replicas synchronise, checked once: trainable, dense,
of a reducible dtype, identical in name, shape and dtype on every replica, each
replica on one device; and the checks that keep replicas from silently
differing at construction: the replicas are identical, and no parameter is
synchronised by two live reducers (which would reduce every gradient twice and
fight over `param.grad`). `assemble` makes, from those checks, the parts a
Reducer is built from, so that its owner holds the same link, work record and
placement instead of reaching into the reducer for them."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .._link import Link, WorkRecord, connect, resolve_group
from ..runtime import mkl
from ..runtime.libraries import DTYPE_NAMES
from .options import Options
from .streams import Placement, gpu_placement


@dataclass(frozen=True)
class Parts:
    """What a Reducer is built from, checked and connected (`assemble`)."""

    replicas: List[nn.Module]
    options: Options  # resolved in the group
    names: List[str]  # the trainable parameters', replica 0's order
    params: List[List[nn.Parameter]]  # [replica][parameter]
    devices: List[torch.device]  # per replica
    gpu: Optional[Placement]  # (CUDA device per replica, stream provider); None on CPUs
    link: Link  # to the other processes (one process: a link that does nothing)
    work: WorkRecord  # compared across processes at every synced backward

    @property
    def gpu_devices(self) -> Optional[List[int]]:
        return None if self.gpu is None else self.gpu[0]

    @property
    def streams(self) -> Optional[Any]:
        return None if self.gpu is None else self.gpu[1]

    @property
    def reduces(self) -> bool:
        """False for one replica in one process: nothing to reduce."""
        return len(self.replicas) > 1 or self.link.spans_processes


def assemble(replicas: List[nn.Module], opts: Options, what: str = "GradSync") -> Parts:
    """Checks `replicas` (trainable parameters, none synchronised twice,
    identical unless opts says the caller made them so), places them and
    connects them to the other processes of `opts.group`."""
    # Before any replica (or torch's intra-op threads) races on oneMKL's
    # first calls (runtime/mkl.py): wrap and GradSync both come here first.
    mkl.warm()
    group = resolve_group(opts.group)
    opts = opts.in_group(group)
    for m in replicas:
        refuse_unready(m)
    names, params = trainable_params(replicas)
    refuse_synced_twice(names, params)
    if opts.check_replicas:
        check_identical(replicas)
    devices = [ps[0].device for ps in params]
    gpu = gpu_placement(devices, what)
    # The group says which ranks: pyddp reduces on gloo groups of its own
    # over them (and NCCL for GPUs), whatever the group's backend.
    link = connect(
        group,
        replicas,
        names,
        devices[0].type,
        opts.timeout_s,
        opts.op,
        opts.compared(),
        None if gpu is None else gpu[0],
    )
    work = WorkRecord(params[0], replicas[0], gpu is not None)
    return Parts(list(replicas), opts, names, params, devices, gpu, link, work)


def dtype_name(name: str, p: torch.Tensor) -> str:
    try:
        return DTYPE_NAMES[p.dtype]
    except KeyError:
        raise ValueError(
            f"parameter {name!r} has dtype {p.dtype}; pyddp reduces float32, float64, "
            "float16 and bfloat16 gradients"
        ) from None


def refuse_unready(model: Any) -> None:
    """Raises unless `model` is a module whose parameters and buffers all
    exist (a lazy module's exist after its first forward) and none of which
    torch DDP was told to leave alone."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    ignored = sorted(getattr(model, "_ddp_params_and_buffers_to_ignore", None) or ())
    if ignored:  # DistributedDataParallel._set_params_and_buffers_to_ignore_for_model's list
        raise NotImplementedError(
            f"pyddp: the model carries torch DDP's list of parameters and buffers to leave "
            f"alone ({', '.join(map(str, ignored[:3]))}{', ...' if len(ignored) > 3 else ''}): "
            "pyddp broadcasts every parameter and buffer at wrap and reduces every trainable "
            "parameter, so they would not stay per rank; keep per-rank state outside the "
            "wrapped module, or clear the list (model._ddp_params_and_buffers_to_ignore = [])"
        )
    lazy = [n for n, t in model.named_parameters() if is_lazy(t)]
    lazy += [n for n, t in model.named_buffers() if is_lazy(t)]
    if lazy:
        raise ValueError(
            f"the model has uninitialized (lazy) parameters or buffers ({', '.join(lazy[:3])}"
            f"{', ...' if len(lazy) > 3 else ''}): their shapes are known only after a "
            "forward, so replicas cannot be made or compared; run one forward on the model "
            "(a dummy batch) before wrapping it, as torch DDP asks"
        )


def trainable_params(
    replicas: Sequence[nn.Module],
) -> Tuple[List[str], List[List[nn.Parameter]]]:
    named = [[(n, p) for n, p in m.named_parameters() if p.requires_grad] for m in replicas]
    names = [n for n, _ in named[0]]
    if not names:
        raise ValueError(
            "the model has no trainable parameters (none with requires_grad=True): "
            "there is nothing to synchronise"
        )
    for m in replicas[0].modules():
        if getattr(m, "sparse", False) is True and isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            raise ValueError(
                f"{type(m).__name__} with sparse=True produces sparse gradients, which pyddp "
                "does not reduce; construct it with sparse=False"
            )
        renorm = isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
        if renorm and len(replicas) > 1:
            raise ValueError(
                f"{type(m).__name__} with max_norm renormalises, in place in its forward, the "
                "rows its input looks up: each replica would renormalise other rows and the "
                "replicas would drift apart; drop max_norm (clip the rows after the optimizer "
                "step instead), or run one replica per process"
            )
    params = []
    for r, pairs in enumerate(named):
        if [n for n, _ in pairs] != names:
            raise ValueError(
                f"replica {r} has trainable parameters {[n for n, _ in pairs][:5]}..., replica 0 "
                f"has {names[:5]}...: replicas must be copies of one model"
            )
        devices = {p.device for _, p in pairs}
        if len(devices) != 1:
            raise ValueError(
                f"replica {r} has parameters on several devices {sorted(map(str, devices))}: "
                "each replica must live on one device"
            )
        for (n, p), p0 in zip(pairs, (p for _, p in named[0])):
            if p.shape != p0.shape or p.dtype != p0.dtype:
                raise ValueError(
                    f"parameter {n!r}: replica {r} has shape {tuple(p.shape)} {p.dtype}, "
                    f"replica 0 has {tuple(p0.shape)} {p0.dtype}; replicas must be copies"
                )
        params.append([p for _, p in pairs])
    return names, params


# Parameters synchronised by a live GradSync, by id (tensors cannot be weak
# dictionary keys: their == is elementwise).
_SYNCED: Dict[int, Tuple[Any, Any]] = {}


def note_synced(sync: Any, params: Sequence[Sequence[torch.Tensor]]) -> None:
    """`sync` (with a `closed` attribute) synchronises `params` from now on."""
    for key in [k for k, (p, s) in _SYNCED.items() if p() is None or s() is None]:
        del _SYNCED[key]
    for replica in params:
        for p in replica:
            _SYNCED[id(p)] = (weakref.ref(p), weakref.ref(sync))


def _span(p: torch.Tensor) -> Tuple[int, int]:
    """The bytes [start, end) a tensor's elements lie in (strides included)."""
    extent = 1 + sum((n - 1) * st for n, st in zip(p.shape, p.stride()))
    return p.data_ptr(), p.data_ptr() + extent * p.element_size()


def _refuse_shared_memory(names: Sequence[str], params: Sequence[Sequence[torch.Tensor]]) -> None:
    """Sorted by start, a span that begins before the furthest end so far
    overlaps the span reaching there; the refusal names the first shared
    parameter in the model's order (a search run only then)."""
    live = [[(name, _span(p)) for name, p in zip(names, replica) if p.numel() and not p.is_meta]
            for replica in params]  # fmt: skip
    reach: Optional[Tuple[int, int, int]] = None
    for start, end, r in sorted((*span, r) for r, spans in enumerate(live) for _, span in spans):
        if reach is not None and start < reach[1] and reach[2] != r:
            break
        if reach is None or end > reach[1]:
            reach = (start, end, r)
    else:
        return
    for r, spans in enumerate(live):
        for name, (start, end) in spans:
            for q, (other, (a, b)) in ((k, s) for k in range(r) for s in live[k]):
                if start < b and a < end:
                    how = "is" if (start, end) == (a, b) else "shares memory with"
                    raise ValueError(
                        f"replica {r}'s {name!r} {how} replica {q}'s {other!r} ("
                        + ("the same memory" if how == "is" else "overlapping views")
                        + "): each replica needs its own copy of the model "
                        "(copy.deepcopy(model)), or its gradient is counted twice"
                    )  # fmt: skip


def refuse_synced_twice(names: Sequence[str], params: Sequence[Sequence[torch.Tensor]]) -> None:
    # One tensor (or any of its bytes) in two replicas: its gradient would be
    # counted once per replica holding it, and the shared elements stepped
    # once per replica, silently (GradSync([m, m]), views of one buffer).
    _refuse_shared_memory(names, params)
    for replica in params:
        for name, p in zip(names, replica):
            p_ref, sync_ref = _SYNCED.get(id(p), (None, None))
            other = sync_ref() if p_ref is not None and p_ref() is p else None
            if other is not None and not other.closed:
                raise ValueError(
                    f"parameter {name!r} is already synchronised by a live pyddp model or "
                    "GradSync (a model wrapped twice?): close() the first one, or wrap a copy "
                    "(copy.deepcopy(model))"
                )


def check_identical(replicas: Sequence[nn.Module]) -> None:
    """GradSync sums gradients of identical replicas: replicas that start apart
    stay apart, silently. A one-time comparison of every parameter (frozen ones
    included) and buffer."""

    def state(m: nn.Module) -> Dict[str, torch.Tensor]:
        return {**dict(m.named_parameters()), **dict(m.named_buffers())}

    first = state(replicas[0])
    with torch.no_grad():
        for r, replica in enumerate(replicas[1:], start=1):
            mine = state(replica)
            if list(mine) != list(first):
                raise ValueError(
                    f"replica {r} has parameters and buffers {list(mine)[:5]}..., replica 0 has "
                    f"{list(first)[:5]}...: replicas must be copies of one model"
                )
            for name, t in mine.items():
                other = first[name].to(t.device)
                if t.shape != other.shape or not torch.equal(t, other):
                    gap = (
                        (t.double() - other.double()).abs().max().item()
                        if t.shape == other.shape
                        else float("nan")
                    )
                    raise ValueError(
                        f"replica {r}'s {name!r} differs from replica 0's (max abs difference "
                        f"{gap:.3g}): GradSync needs identical replicas. Copy replica 0's state "
                        "to the others (m.load_state_dict(m0.state_dict())), or pass "
                        "check_replicas=False if you make them equal yourself"
                    )


def same_dtypes(layout: Any) -> None:
    """The engine reduces each bucket in the dtype its parameters had when it
    was made (its element size): a parameter converted since (`.double()`,
    `.half()`, `.to(dtype)`) would be laid out in buffers of another size,
    summed wrong or written past (a probe: reattach() after .double() gave
    gradients 0.13 off one device, after .half() a segfault). Refused."""
    for r, params in enumerate(layout.params):
        for i, p in enumerate(params):
            if DTYPE_NAMES.get(p.dtype) != layout.dtypes[i]:
                raise RuntimeError(
                    f"pyddp: replica {r}'s parameter {layout.window.names[i]!r} is {p.dtype}, "
                    f"made {layout.dtypes[i]}: the buckets cannot follow a dtype change "
                    "(.double(), .half(), .to(dtype)); close() the GradSync and make a new one "
                    "after converting (a wrapped model: close() and wrap again)"
                )
