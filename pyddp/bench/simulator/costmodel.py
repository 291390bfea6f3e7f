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
FLOPs come only from torch's formulas (matmuls, convolutions, attention),
priced at the tensor-core peak for the precision (the FP32 peak for "fp32");
every other operator counts as memory-bound. Bytes: each distinct tensor
argument read once and each result written once (an in-place op reads and
writes). Views cost nothing. Mixed precision ("amp") halves the bytes of
every floating tensor, a simplification: autocast keeps parameters, their
gradients and some reductions in float32. Gradient sizes for the reductions
are the parameters' own (float32 unless the model is in another dtype).

What this does not model: kernel fusion (torch.compile, cuDNN's fused
kernels), host launch overhead when the GPU runs ahead, caching-allocator
effects, and the slowdown of compute kernels by NCCL kernels running beside
them (they share SMs and memory bandwidth).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from .._util import write_json

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
        # Tensors the step brings from elsewhere (a loss's CPU target, a class
        # weight) join the meta step; moving them is not part of the step.
        args, kwargs = tree_map(_to_meta, (args, kwargs or {}))
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if func.is_view or packet in _FREE:
            return out
        formula = flop_registry.get(packet)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula else 0
        # Bytes: each distinct tensor argument read once, each result written
        # once (an in-place op reads and writes the same tensor).
        total, floating = 0, 0
        for group in (_distinct(tree_flatten((args, kwargs))[0]), _distinct(tree_flatten(out)[0])):
            for t in group:
                n = t.numel() * t.element_size()
                total += n
                floating += n if t.is_floating_point() else 0
        self.trace.ops.append(Op(str(packet).split(".")[-1], self.backward, flops, total, floating))
        return out


def _to_meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, torch.Tensor) and x.device.type != "meta" else x


def _distinct(items: Sequence[Any]) -> List[torch.Tensor]:
    seen: Dict[int, torch.Tensor] = {}
    for t in items:
        if isinstance(t, torch.Tensor):
            seen.setdefault(id(t), t)
    return list(seen.values())


def _meta_copy(model: nn.Module) -> nn.Module:
    """The model with every parameter and buffer replaced by a meta tensor of
    its shape: the caller's model and its data are left alone, and a
    parameter shared by two modules stays shared (one gradient)."""
    memo: Dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def record(model: nn.Module, inputs: Sequence[Any], loss: Callable[[Any], torch.Tensor]) -> Trace:
    """One training step of `model` on `inputs`, taking the gradient of
    `loss(model(*inputs))`: its operators and parameter ready points. It runs
    on a meta copy of the model (the model itself is not touched; build big
    ones under `with torch.device("meta"):` to skip allocating them at all),
    in training mode; tensors in `inputs` or captured by `loss` may live
    anywhere (only their shapes are used). Data-dependent Python control
    flow (`if x.sum() > 0`) cannot run on shapes alone and fails."""
    model = _meta_copy(model)
    model.train()
    inputs = tree_map(_to_meta, list(inputs))
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


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _whole(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


_DAY = 86400.0  # seconds: the longest step a profile may describe


@dataclass
class Profile:
    """One device's step: forward, backward and optimizer times, and each
    parameter's gradient size and ready time (seconds after backward started),
    indexed in registration order (model.parameters()). `order` is the order
    autograd completed them in, where known (ties in time keep it)."""

    forward_s: float
    backward_s: float
    param_bytes: List[int]
    param_ready_s: List[float]
    optimizer_s: float = 0.0
    names: Optional[List[str]] = None
    dtypes: Optional[List[str]] = None
    source: str = ""
    order: Optional[List[int]] = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raises ValueError, naming the field, unless this is a possible step."""
        n = len(self.param_bytes)
        if n == 0:
            raise ValueError("a profile needs at least one parameter")
        times = {"forward_s": self.forward_s, "backward_s": self.backward_s}
        times["optimizer_s"] = self.optimizer_s
        for name, value in times.items():  # (a day at most: 1e308 s printed inf and nan rows)
            if not _number(value) or not math.isfinite(value) or not 0 <= value <= _DAY:
                raise ValueError(f"{name} must be a number of seconds, 0 to {_DAY}, got {value!r}")
        if self.step_s() <= 0:
            raise ValueError("a profile's step takes no time")
        for b in self.param_bytes:
            if not _whole(b) or not 0 <= b <= 1 << 50:
                raise ValueError(f"param_bytes must be whole numbers 0 to 2**50, got {b!r}")
        lists = {"param_ready_s": self.param_ready_s, "names": self.names}
        lists.update(dtypes=self.dtypes, order=self.order)
        for name, value in lists.items():
            if value is not None and len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries, param_bytes {n}")
        slack = 1e-9 + 1e-6 * self.backward_s
        for t in self.param_ready_s:
            if not _number(t) or not math.isfinite(t) or not 0 <= t <= self.backward_s + slack:
                raise ValueError(
                    f"param_ready_s must lie within backward (0 to {self.backward_s} s), got {t!r}"
                )
        unknown = sorted(set(self.dtypes or []) - set(_DTYPE_BYTES))
        if unknown:
            raise ValueError(f"dtypes {unknown}: one of {sorted(_DTYPE_BYTES)}")
        if self.order is not None and (
            not all(_whole(i) for i in self.order) or sorted(self.order) != list(range(n))
        ):
            raise ValueError("order must name every parameter once")

    def step_s(self, accumulate: int = 1) -> float:
        """One device's step alone: `accumulate` forwards and backwards, then
        the optimizer."""
        return accumulate * (self.forward_s + self.backward_s) + self.optimizer_s

    def numels(self) -> List[int]:
        dtypes = self.dtypes or ["float32"] * len(self.param_bytes)
        return [b // _DTYPE_BYTES[d] for b, d in zip(self.param_bytes, dtypes)]

    def ready_order(self) -> List[int]:
        if self.order is not None:
            return sorted(self.order, key=lambda i: self.param_ready_s[i])  # stable: ties kept
        return sorted(range(len(self.param_bytes)), key=lambda i: self.param_ready_s[i])

    def save(self, path: Any) -> Path:
        """JSON, for `pyddp-bench simulate --profile PATH`."""
        return write_json(Path(path), {"pyddp_profile": 1, **asdict(self)})

    @classmethod
    def load(cls, path: Any) -> Profile:
        """A saved profile; ValueError (or OSError) saying what is wrong with it."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(data, dict) or data.pop("pyddp_profile", None) != 1:
            raise ValueError(f"{path}: not a profile written by pyddp's Profile.save")
        known = {f.name for f in fields(cls)}
        extra = sorted(set(data) - known)
        missing = sorted(f.name for f in fields(cls) if f.default is MISSING and f.name not in data)
        if extra or missing:
            raise ValueError(f"{path}: unknown fields {extra}, missing fields {missing}")
        try:
            return cls(**data)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None

    def scaled(self, factor: float, source: str) -> Profile:
        """All compute times times `factor`."""
        return replace(
            self,
            forward_s=self.forward_s * factor,
            backward_s=self.backward_s * factor,
            param_ready_s=[t * factor for t in self.param_ready_s],
            optimizer_s=self.optimizer_s * factor,
            source=source,
        )

    def calibrated(self, measured_s: float, accumulate: int = 1) -> Profile:
        """Scaled so that one device's step of `accumulate` micro-batches
        (their forwards and backwards, then the optimizer) takes `measured_s`,
        as measured on the real device."""
        source = f"{self.source}, calibrated to {measured_s * 1e3:g} ms"
        return self.scaled(measured_s / self.step_s(accumulate), source)


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
        list(trace.ready_order) or None,
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
    t = dm.ready_times()
    return Profile(
        forward_s,
        t.backward_s,
        t.bytes,
        t.ready_s,
        optimizer_s,
        t.names,
        t.dtypes,
        "measured: pyddp timeline",
    )
