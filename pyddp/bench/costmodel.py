"""A GPU step's timing without a GPU: record the operators one training step
runs, once, then price each on a device's roofline.

Recording: the model runs forward and backward on the meta device (shapes,
no data, no memory) under a TorchDispatchMode that logs every aten operator
autograd really executes, in its real order, with its FLOPs (torch's own
formulas, torch.utils.flop_counter) and the bytes it reads and writes (its
tensor arguments and results). A post-accumulate-grad hook on every parameter
marks, in the same log, the moment its gradient is complete: in the order
autograd produces them, which is the order a stream-ordered all-reduce could
start them on a GPU.

Pricing, per operator (a roofline with stated efficiencies, see
hardware.Gpu):
    time = max(flops / (peak x compute_eff), bytes / (memory bw x memory_eff),
               kernel floor)
where peak is the tensor-core rate for the precision on ops torch has a FLOP
formula for (matmuls, convolutions, attention) and the vector rate otherwise.
Views cost nothing. Mixed precision ("amp") halves the bytes of floating
tensors and uses the 16-bit tensor-core peak; gradients stay float32 (as
torch.autocast keeps float32 parameters).

What this does not model: kernel fusion (torch.compile, cuDNN's fused
kernels), host launch overhead when the GPU runs ahead, caching-allocator
effects, and the slowdown of compute kernels by NCCL kernels running beside
them (they share SMs and memory bandwidth).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ._util import write_json

_aten = torch.ops.aten
# Operators that allocate or relabel without moving data.
_FREE = {
    _aten.detach,
    _aten.empty,
    _aten.empty_like,
    _aten.empty_strided,
    _aten.new_empty,
    _aten.new_empty_strided,
    _aten._unsafe_view,
    _aten.lift_fresh,
    _aten.alias,
}


@dataclass
class Op:
    name: str
    backward: bool
    flops: int
    bytes: int  # read + written, at the recorded dtypes
    float_bytes: int  # the part of `bytes` in floating tensors


@dataclass
class Trace:
    """What one training step ran: operators in execution order, and after
    which operator each parameter's gradient was complete."""

    names: List[str]
    param_bytes: List[int]
    param_dtypes: List[str]
    ops: List[Op] = field(default_factory=list)
    ready_after: List[int] = field(default_factory=list)  # param -> ops completed before ready
    ready_order: List[int] = field(default_factory=list)  # params in the order they became ready

    @property
    def forward_ops(self) -> int:
        return next((i for i, op in enumerate(self.ops) if op.backward), len(self.ops))

    def flops(self, backward: bool) -> int:
        return sum(op.flops for op in self.ops if op.backward == backward)


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: Trace):
        super().__init__()
        self.trace = trace
        self.backward = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if func.is_view or packet in _FREE:
            return out
        formula = flop_registry.get(packet)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula else 0
        seen, total, floating = set(), 0, 0
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                n = t.numel() * t.element_size()
                total += n
                floating += n if t.is_floating_point() else 0
        self.trace.ops.append(Op(str(packet).split(".")[-1], self.backward, flops, total, floating))
        return out


def record(model: nn.Module, inputs: Sequence[Any], loss: Callable[[Any], torch.Tensor]) -> Trace:
    """One training step of `model` (built on the meta device, or moved there)
    on `inputs` (moved to meta), taking the gradient of `loss(model(*inputs))`:
    its operators and parameter ready points."""
    model = model.to("meta")
    model.train()
    inputs = [x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no parameters that require a gradient")
    trace = Trace(
        [n for n, _ in named],
        [p.numel() * p.element_size() for _, p in named],
        [str(p.dtype).replace("torch.", "") for _, p in named],
    )
    trace.ready_after = [-1] * len(named)
    recorder = _Recorder(trace)

    def hook(i: int) -> Callable[[torch.Tensor], None]:
        def mark(_: torch.Tensor) -> None:
            trace.ready_after[i] = len(trace.ops)
            trace.ready_order.append(i)

        return mark

    handles = [p.register_post_accumulate_grad_hook(hook(i)) for i, (_, p) in enumerate(named)]
    try:
        with recorder:
            value = loss(model(*inputs))
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise ValueError(f"the loss must be a one-element tensor, got {type(value)}")
            recorder.backward = True
            value.backward()
    finally:
        for h in handles:
            h.remove()
    unused = [trace.names[i] for i, r in enumerate(trace.ready_after) if r < 0]
    if unused:
        shown = ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else "")
        raise ValueError(
            f"{len(unused)} parameter(s) got no gradient in the recorded step ({shown}): "
            "every rank would reduce them anyway; give a loss that uses them, or freeze them"
        )
    return trace


@dataclass
class Profile:
    """One device's step: forward, backward and optimizer times, and each
    parameter's gradient size and ready time (seconds after backward started),
    indexed in registration order (model.parameters())."""

    forward_s: float
    backward_s: float
    param_bytes: List[int]
    param_ready_s: List[float]
    optimizer_s: float = 0.0
    names: Optional[List[str]] = None
    dtypes: Optional[List[str]] = None
    source: str = ""

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    def ready_order(self) -> List[int]:
        return sorted(range(len(self.param_bytes)), key=lambda i: self.param_ready_s[i])

    def save(self, path: Any) -> Path:
        """JSON, for `pyddp-bench simulate --profile PATH`."""
        return write_json(Path(path), {"pyddp_profile": 1, **asdict(self)})

    @classmethod
    def load(cls, path: Any) -> Profile:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.pop("pyddp_profile", None) != 1:
            raise ValueError(f"{path}: not a profile written by pyddp's Profile.save")
        known = {f.name for f in fields(cls)}
        extra = sorted(set(data) - known)
        if extra:
            raise ValueError(f"{path}: unknown profile fields {extra}")
        profile = cls(**data)
        n = len(profile.param_bytes)
        lists = {
            "param_ready_s": profile.param_ready_s,
            "names": profile.names,
            "dtypes": profile.dtypes,
        }
        for name, value in lists.items():
            if value is not None and len(value) != n:
                raise ValueError(f"{path}: {name} has {len(value)} entries, param_bytes {n}")
        if n == 0 or min(profile.param_bytes) < 0 or min(profile.param_ready_s) < 0:
            raise ValueError(f"{path}: needs at least one parameter, sizes and times >= 0")
        return profile

    def scaled(self, factor: float, source: str) -> Profile:
        """All compute times times `factor` (a calibration to a measured step)."""
        return Profile(
            self.forward_s * factor,
            self.backward_s * factor,
            list(self.param_bytes),
            [t * factor for t in self.param_ready_s],
            self.optimizer_s * factor,
            self.names,
            self.dtypes,
            source,
        )


# Tensors of a parameter's size an optimizer step reads and writes: SGD with
# momentum reads p, g, m and writes p, m; AdamW reads p, g, m, v, writes p, m, v.
OPTIMIZER_WORDS = {"sgd": 5, "adamw": 7, "none": 0}


def price(trace: Trace, gpu: Any, precision: str, optimizer: str) -> Profile:
    """The trace's times on `gpu` (a hardware.Gpu) at `precision`
    ("fp32", "tf32" or "amp")."""
    if optimizer not in OPTIMIZER_WORDS:
        raise ValueError(f"optimizer {optimizer!r}: one of {sorted(OPTIMIZER_WORDS)}")
    matmul, vector = gpu.peaks(precision)
    shrink = 0.5 if precision == "amp" else 1.0
    bw = gpu.memory_bw * gpu.memory_eff

    def seconds(op: Op) -> float:
        nbytes = op.bytes - op.float_bytes * (1 - shrink)
        peak = matmul if op.name in _MATMUL_NAMES else vector
        return max(op.flops / (peak * gpu.compute_eff), nbytes / bw, gpu.kernel_floor_s)

    clock = [0.0]
    for op in trace.ops:
        clock.append(clock[-1] + seconds(op))
    fwd = clock[trace.forward_ops]
    total = clock[-1]
    # A fused or foreach step streams each parameter's tensors once.
    opt = sum(trace.param_bytes) * OPTIMIZER_WORDS[optimizer] / bw
    return Profile(
        fwd,
        total - fwd,
        list(trace.param_bytes),
        [clock[r] - fwd for r in trace.ready_after],
        opt,
        list(trace.names),
        list(trace.param_dtypes),
        f"roofline: {gpu.name}, {precision}",
    )


_MATMUL_NAMES = {str(p).split(".")[-1] for p in flop_registry}


def profile_from_timeline(dm: Any, forward_s: float, optimizer_s: float = 0.0) -> Profile:
    """A measured Profile from a model wrapped with `pyddp.wrap(...,
    timeline=N)` after at least one synced step: each parameter's ready time
    on replica 0 in the last kept iteration, relative to the end of forward,
    and backward's length (end of forward -> autograd done). `forward_s` and
    `optimizer_s` are what you measured for those phases. On GPUs the ready
    times are when autograd's hooks ran on the host, which may be ahead of
    the device: synchronize in the hooks' stream, or measure with timeline on
    a run that is GPU-bound, for figures the simulator can trust."""
    sync = dm.sync
    timelines = getattr(sync.observer, "timelines", None) if sync.observer else None
    if not timelines:
        raise ValueError("no timeline: wrap with timeline=N (or PYDDP_TIMELINE=N) and run a step")
    t = timelines[-1]
    raw, begin = t["raw"], t["raw"]["forward_end_ns"]
    n = len(sync.names)
    marks = t["param_ready_ns"][:n]
    if not begin or len(marks) < n or not all(marks):
        raise ValueError("the last kept iteration has no ready time for every parameter")
    return Profile(
        forward_s,
        (raw["finish_start_ns"] - begin) / 1e9,
        [p.numel() * p.element_size() for p in sync.params[0]],
        [max(0, m - begin) / 1e9 for m in marks],
        optimizer_s,
        list(sync.names),
        [str(p.dtype).replace("torch.", "") for p in sync.params[0]],
        "measured: pyddp timeline",
    )
