"""SyncBatchNorm under pyddp: `torch.nn.SyncBatchNorm` layers of a wrapped
model normalize over the global batch (every replica of every process), in
forward and backward, as one device running BatchNorm on the whole batch.

The model is converted as for torch DDP
(`torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)`, or
`pyddp.convert_sync_batchnorm`); `pyddp.wrap` then runs each replica's
SyncBatchNorm layers through an `Meeting`: the replicas' threads meet in the
middle of forward (and of backward), sum their per-channel statistics on
devices[0], and one thread sums them over the processes on a gloo group of
their own (so they never pair with a gradient bucket in flight). A replica
that raises before a meeting breaks it, so the others raise instead of
waiting. Outside a pyddp forward the layers are torch's own again.

On GPUs the statistics are summed on the devices: the replicas' threads
meet on the host (they only count arrivals), then the last to arrive
launches one NCCL all-reduce over every GPU of every process (a
communicator of SyncBatchNorm's own across processes, apart from the
buckets'), ordered after each replica's current stream as it was when that
replica arrived (an event recorded there: autograd's per-device backward
threads each have theirs), and each of those streams waits for the sum. The
host never waits for a GPU (the global count stays on the device too), as
with torch's SyncBatchNorm on NCCL; like it, across processes on GPUs the
meetings are not compared by a header first (a forward in training mode on
some ranks only is found by the timeout)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

# Summed over the replicas and processes per layer and channel: statistics
# travel in float64 (sums of squares of float32 activations would lose the
# variance to cancellation in float32).
STATS_DTYPE = torch.float64


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """torch's conversion (BatchNorm*d -> torch.nn.SyncBatchNorm), returned
    for pyddp.wrap: the converted layers then synchronize over pyddp's
    replicas and processes."""
    return nn.SyncBatchNorm.convert_sync_batchnorm(module)


def sync_layers(module: nn.Module) -> List[nn.SyncBatchNorm]:
    return [m for m in module.modules() if isinstance(m, nn.SyncBatchNorm)]


class MeetingBroken(RuntimeError):
    """A replica stopped at a meeting because another failed: the workers
    report the other's error first."""

    consequence = True


class Meeting:
    """Sums one tensor per replica, then over the processes (`across`), and
    hands every replica the total on its own device. Meetings happen in the
    same order on every replica (the same layers, forward then backward
    in reverse), so a generation count is all that pairs them."""

    def __init__(
        self,
        replicas: int,
        device: torch.device,
        across: Optional[Callable[[torch.Tensor, str], None]],
        timeout_s: float,
        gpu: Optional[Tuple[Sequence[int], Any, Any]] = None,
    ):
        """`gpu`: (CUDA device per replica, stream provider, backend) for
        GPU replicas, whose statistics are summed on the devices by the
        backend (every GPU of every process)."""
        self.device, self.across, self.timeout_s = device, across, timeout_s
        self.gpu = gpu
        self.replicas = replicas
        self._cond = threading.Condition()
        self._slots: List[Optional[torch.Tensor]] = [None] * replicas
        self._arrived = 0
        self._generation = 0
        self._total: Optional[torch.Tensor] = None
        self._broken: Optional[str] = None
        self.active = False  # inside a pyddp forward or backward

    def reset(self, replicas: Optional[int] = None) -> None:
        """Before a forward or a backward: no meeting is half-way; `replicas`:
        how many take part from now on (replicas 0.. of this process: a
        batch with fewer shards than replicas leaves the rest out)."""
        with self._cond:
            if replicas is not None:
                self.replicas = replicas
            self._slots = [None] * self.replicas
            self._arrived, self._broken, self._total = 0, None, None

    def abort(self, why: str) -> None:
        """A replica failed: the others raise at their meeting, now or next."""
        with self._cond:
            self._broken = why
            self._cond.notify_all()

    def sum(self, r: int, t: torch.Tensor, what: str) -> torch.Tensor:
        return self.sum_and_host(r, t, what)[0]

    def sum_and_host(
        self, r: int, t: torch.Tensor, what: str
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The sum on `t`'s device, and on the host where it was summed
        there (reading it waits for no GPU); GPUs: the sum on the device
        only (None)."""
        if self.gpu is None:
            total = self._sum(r, t, what)
            return total.to(t.device), total
        devices, streams, _ = self.gpu
        # The buffer the collective sums: the stream provider's memory (the
        # simulation's carries guards), filled on the current stream.
        buf = streams.zeros(t.numel(), t.dtype, devices[r]).view(t.shape)
        buf.copy_(t)
        if streams.produced is not None:  # the simulation: it lands late on the current stream
            streams.produced(devices[r], buf)
        self._sum(r, (buf, streams.current(devices[r])), what)
        streams.before_host_write(devices[r])  # the simulation: the sum lands in stream order
        return buf, None

    def _device_sum(self, slots: List[Any]) -> None:
        """Sums the replicas' (tensor, stream) in place over every GPU of
        every process; replicas left out of this forward (fewer shards)
        add zeros, as every GPU of the communicator must take part."""
        devices, streams, backend = self.gpu  # type: ignore[misc]
        first = next(s for s in slots if s is not None)[0]
        parts, order = [], []
        for r, d in enumerate(devices):
            if slots[r] is None:
                parts.append(streams.zeros(first.numel(), first.dtype, d))
                order.append(streams.current(d))
            else:
                parts.append(slots[r][0])
                order.append(slots[r][1])
        backend.reduce([p.data_ptr() for p in parts], list(devices), order, first.numel(),
                       "float64", "sum")  # fmt: skip

    def _sum(self, r: int, t: Any, what: str) -> torch.Tensor:
        with self._cond:
            self._raise_if_broken(r, what)
            generation = self._generation
            self._slots[r] = t
            self._arrived += 1
            if self._arrived == self.replicas:
                try:
                    if self.gpu is not None:
                        full = self._slots + [None] * (len(self.gpu[0]) - self.replicas)
                        self._device_sum(full)
                        total = t[0]
                    else:
                        total = self._slots[0].to(self.device)  # type: ignore[union-attr]
                        for s in self._slots[1:]:
                            total = total + s.to(self.device)  # type: ignore[union-attr]
                        if self.across is not None:
                            # One thread per process: the same order everywhere.
                            self.across(total, what)
                except BaseException as e:
                    where = "exchange across processes" if self.gpu is None else "device sum"
                    self._broken = f"replica {r}'s {where} raised: {e}"
                    self._cond.notify_all()
                    raise
                self._total, self._slots = total, [None] * self.replicas
                self._arrived, self._generation = 0, generation + 1
                self._cond.notify_all()
            else:
                deadline = time.monotonic() + self.timeout_s
                while self._generation == generation and self._broken is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        missing = [i for i, s in enumerate(self._slots) if s is None]
                        raise MeetingBroken(
                            f"pyddp: SyncBatchNorm ({what}): replica {r} waited "
                            f"{self.timeout_s:g} s for replica(s) {missing}, which never reached "
                            "this layer (a replica that skipped it, or stalled)"
                        )
                    self._cond.wait(min(left, 1.0))
                if self._generation == generation:
                    self._raise_if_broken(r, what)
            return self._total  # type: ignore[return-value]

    def _raise_if_broken(self, r: int, what: str) -> None:
        if self._broken is not None:
            raise MeetingBroken(
                f"pyddp: SyncBatchNorm ({what}) on replica {r} stopped: {self._broken}"
            )


class _SyncBatchNormFn(torch.autograd.Function):
    """Batch normalization with global statistics; backward sums the two
    per-channel gradient terms over every replica and process too."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
        mean: torch.Tensor,
        invstd: torch.Tensor,
        count: float,
        meet: Callable[[torch.Tensor, str], torch.Tensor],
    ) -> torch.Tensor:
        # mean and invstd are float32 at least: 16-bit inputs are
        # normalized in float32 and returned in their own dtype, as torch's.
        shape = _channel_shape(x)
        xhat = _normalize(x, mean, invstd)
        y = xhat if weight is None else xhat * weight.view(shape).to(mean.dtype)
        if bias is not None:
            y = y + bias.view(shape).to(mean.dtype)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.meet = count, meet
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Tuple[Any, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        shape, dims = _channel_shape(x), _reduce_dims(x)
        dtype = mean.dtype
        xhat = _normalize(x, mean, invstd)  # recomputed: saving it would double 16-bit inputs
        dy = dy.to(dtype)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        # Only the input's gradient needs the global sums; weight and bias
        # get this replica's own, reduced with every other gradient.
        local = torch.stack([sum_dy, sum_dy_xhat]).to(STATS_DTYPE)
        total = ctx.meet(local, "backward").to(dtype)
        scale = invstd if weight is None else invstd * weight.to(dtype)
        dx = dy - (total[0] / ctx.count).view(shape) - xhat * (total[1] / ctx.count).view(shape)
        dx = (dx * scale.view(shape)).to(x.dtype)
        dweight = dbias = None
        if weight is not None and ctx.needs_input_grad[1]:
            dweight = sum_dy_xhat.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            dbias = sum_dy.to(weight.dtype if weight is not None else dtype)
        return dx, dweight, dbias, None, None, None, None


def _normalize(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    shape = _channel_shape(x)
    return (x.to(mean.dtype) - mean.view(shape)) * invstd.view(shape)


def _channel_shape(x: torch.Tensor) -> Tuple[int, ...]:
    return (1, x.shape[1]) + (1,) * (x.dim() - 2)


def _reduce_dims(x: torch.Tensor) -> List[int]:
    return [0] + list(range(2, x.dim()))


class _Binding:
    """Which replica a layer belongs to and its Meeting. Copies and pickles
    of a bound layer (an EMA copy, torch.save of the model) drop it: they are
    torch's SyncBatchNorm again, never a second caller of this meeting."""

    def __init__(self, r: int, meeting: Meeting):
        self.r, self.meeting = r, meeting

    def __deepcopy__(self, memo: Any) -> None:
        return None

    def __reduce__(self) -> Any:
        return (_unbound, ())


def _unbound() -> None:
    return None


class BoundSyncBatchNorm(nn.SyncBatchNorm):
    """A torch.nn.SyncBatchNorm while its model is wrapped by pyddp (the
    class is swapped back when the wrapper closes): global statistics in a
    pyddp training forward, torch's own forward otherwise (evaluation, or a
    call outside pyddp, where torch's rules apply)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        binding = self.__dict__.get("_pyddp_binding")
        if binding is None or not (binding.meeting.active and self.training):
            if binding is not None and self.training and torch._C._current_graph_task_id() != -1:
                raise RuntimeError(
                    "pyddp: a SyncBatchNorm layer runs inside a backward: activation "
                    "checkpointing recomputes it there, where the replicas no longer meet, so "
                    "its statistics (and gradients) would be each replica's own. Keep "
                    "SyncBatchNorm layers out of checkpointed segments"
                )
            return super().forward(input)
        return _global_forward(self, input, binding.r, binding.meeting)


def _global_forward(
    layer: nn.SyncBatchNorm, x: torch.Tensor, r: int, meeting: Meeting
) -> torch.Tensor:
    if x.dim() < 2:
        raise ValueError(f"pyddp: SyncBatchNorm expects at least 2D input, got {x.dim()}D")

    def meet(t: torch.Tensor, what: str) -> torch.Tensor:
        return meeting.sum(r, t, what)

    dims = _reduce_dims(x)
    n = x.numel() // x.shape[1]
    # Named before no_grad: across processes the meeting's header says
    # which forward this is (_link/meetings.py).
    what = "forward" if torch.is_grad_enabled() else "forward without grad"
    with torch.no_grad():
        dtype = torch.promote_types(x.dtype, torch.float32)
        if n:
            var, m = torch.var_mean(x.detach().to(dtype), dims, correction=0)
            m64, v64 = m.to(STATS_DTYPE), var.to(STATS_DTYPE)
        else:  # a rank without rows this step adds nothing (its NaN mean made every rank's)
            m64 = v64 = x.new_zeros(x.shape[1], dtype=STATS_DTYPE)
        stats = torch.stack([torch.full_like(m64, float(n)), n * m64, n * (v64 + m64 * m64)])
        total, on_host = meeting.sum_and_host(r, stats, what)
        if on_host is not None:
            count: Any = float(on_host[0, 0])  # no wait for the GPU: the host summed it
            if count <= 1:
                raise ValueError(
                    "pyddp: SyncBatchNorm needs more than one value per channel over the "
                    f"global batch, got {count:g} (input of shape {tuple(x.shape)})"
                )
        else:
            # GPUs: the global count stays on the device (reading it would
            # wait for the GPU); torch's rule for what the host knows.
            count = total[0, 0]
            if n <= 1 and meeting.gpu[2].ranks(len(meeting.gpu[0])) == 1:
                raise ValueError(
                    f"pyddp: SyncBatchNorm needs more than one value per channel, got {n} (input "
                    f"of shape {tuple(x.shape)})"
                )
        mean64 = total[1] / count
        var64 = (total[2] / count - mean64 * mean64).clamp_min(0)
        mean, var = mean64.to(dtype), var64.to(dtype)
        invstd = torch.rsqrt(var + layer.eps)
        _update_running_stats(layer, mean, var * (count / (count - 1)))
    return _SyncBatchNormFn.apply(x, layer.weight, layer.bias, mean, invstd, count, meet)


def _update_running_stats(layer: nn.SyncBatchNorm, mean: torch.Tensor, unbiased: torch.Tensor):
    """As torch's _BatchNorm: momentum, or a cumulative average when None."""
    if not layer.track_running_stats or layer.running_mean is None:
        return
    if layer.num_batches_tracked is not None:
        layer.num_batches_tracked.add_(1)
    momentum = layer.momentum
    factor = 1.0 / float(layer.num_batches_tracked) if momentum is None else momentum  # type: ignore[arg-type]
    layer.running_mean.mul_(1 - factor).add_(mean.to(layer.running_mean.dtype), alpha=factor)
    layer.running_var.mul_(1 - factor).add_(unbiased.to(layer.running_var.dtype), alpha=factor)  # type: ignore[union-attr]


class SyncBatchNorms:
    """The wrapped model's SyncBatchNorm layers, every replica's, bound to
    one Meeting; `release()` makes them torch's SyncBatchNorm again."""

    def __init__(
        self,
        replicas: Sequence[nn.Module],
        device: torch.device,
        across: Optional[Callable[[torch.Tensor, str], None]],
        timeout_s: float,
        gpu: Optional[Tuple[Sequence[int], Any, Callable[[], Any]]] = None,
    ):
        """`gpu`: (CUDA device per replica, stream provider, a function
        making the backend the statistics are summed on)."""
        if gpu is not None and len(set(gpu[0])) != len(gpu[0]):
            raise NotImplementedError(
                "pyddp: SyncBatchNorm with replicas sharing a GPU: autograd runs one device's "
                "backward on one thread, so those replicas could never meet mid-backward; use "
                "one replica per GPU, or BatchNorm"
            )
        self.backend = None
        if gpu is not None:
            self.backend = gpu[2]()
            gpu = (gpu[0], gpu[1], self.backend)
        device = torch.device("cpu") if gpu is not None else device
        self.meeting = Meeting(len(replicas), device, across, timeout_s, gpu)
        self._bound: List[nn.Module] = []
        for r, replica in enumerate(replicas):
            for layer in sync_layers(replica):
                if layer.__dict__.get("_pyddp_binding") is not None:
                    raise RuntimeError(
                        "pyddp: this model's SyncBatchNorm layers belong to another pyddp "
                        "wrapper that is still open: close it (dmodel.close()) first"
                    )
                if layer.process_group is not None:
                    raise ValueError(
                        "pyddp: a SyncBatchNorm layer has its own process_group; pyddp "
                        "synchronizes over the wrapped model's replicas and processes (the "
                        "group given to wrap): convert with process_group=None"
                    )
                if type(layer) not in (nn.SyncBatchNorm, BoundSyncBatchNorm):
                    raise TypeError(
                        f"pyddp: {type(layer).__name__} is a subclass of torch.nn.SyncBatchNorm, "
                        "which pyddp cannot run on its own exchange; use torch.nn.SyncBatchNorm "
                        "(convert_sync_batchnorm), or BatchNorm without synchronization"
                    )
                layer.__class__ = BoundSyncBatchNorm
                layer._pyddp_binding = _Binding(r, self.meeting)
                self._bound.append(layer)

    @contextlib.contextmanager
    def meetings(self, replicas: int) -> Iterator[None]:
        """A pyddp forward over replicas 0..`replicas`-1: the layers meet."""
        self.meeting.reset(replicas)
        self.meeting.active = True
        try:
            yield
        finally:
            self.meeting.active = False

    def release(self) -> None:
        for layer in self._bound:
            layer.__dict__.pop("_pyddp_binding", None)
            layer.__class__ = nn.SyncBatchNorm
        self._bound = []
        if self.backend is not None:
            self.backend.close()


def refuse_full_graph(bound: Optional[SyncBatchNorms], options: Dict[str, Any]) -> None:
    """dmodel.compile(fullgraph=True) with SyncBatchNorm layers: refused by name
    (dynamo's own error names a Condition context manager, pyddp's meeting)."""
    if bound is not None and options.get("fullgraph"):
        raise ValueError(
            "pyddp: dmodel.compile(fullgraph=True) cannot compile SyncBatchNorm layers: their "
            "replicas meet inside the forward (each waits for the others' statistics), which "
            "one whole graph cannot hold. Compile without fullgraph=True: the graph breaks at "
            "those layers and the rest compiles"
        )
