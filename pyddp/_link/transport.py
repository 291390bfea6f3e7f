"""The bucket transport of the link: per bucket, after this process's
replicas are summed (in C++), the engine's launcher calls `launch(bucket)`,
an asynchronous all-reduce of replica 0's bucket on the link's own gloo
group, in bucket-index order on every rank; `wait()` at the end of backward
waits for them with pyddp's timeout. Also the blocking reduction
`pyddp.all_reduce` uses across processes."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..runtime.libraries import hot
from .failure import Failure, WaitPost
from .groups import Peers, all_to_all, allreduce, first_line, own_group
from .link import GradBucket

TAIL = -1  # the agreement's reduction, after the buckets


class _InFlight:
    """The bucket reductions launched in this iteration and their completion
    times, completed from gloo's worker threads (pyddp._hot's Flight is the
    same record in C++, where its launches complete)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.pending = 0
        self.errors: Dict[int, str] = {}
        self.order: List[int] = []
        self.done_ns: Dict[int, int] = {}

    def launched(self, bucket: int) -> None:
        with self.cv:
            self.pending += 1
            self.order.append(bucket)

    def finished(self, bucket: int, error: Optional[str]) -> None:
        with self.cv:
            self.done_ns[bucket] = time.monotonic_ns()
            if error is not None:
                self.errors[bucket] = error
            self.pending -= 1
            self.cv.notify_all()

    def settle(self, seconds: float) -> bool:
        """Waits at most `seconds` for every launch to complete or one to
        fail; whether that happened."""
        with self.cv:
            return self.cv.wait_for(lambda: self.pending == 0 or bool(self.errors), seconds)

    def snapshot(self) -> Tuple[List[int], Dict[int, str], int, List[int]]:
        """(launched in order, errors, still pending, done buckets)."""
        with self.cv:
            return list(self.order), dict(self.errors), self.pending, list(self.done_ns)

    def next(self, tail: int) -> Dict[int, int]:
        """Starts the next iteration; returns this one's completion times."""
        with self.cv:
            done = {b: t for b, t in self.done_ns.items() if b != tail}
            self.order.clear()
            self.done_ns.clear()
        return done


class _Done:
    """A completion flag as _wait_flight waits for a flight."""

    def __init__(self, event: threading.Event):
        self.settle = event.wait


def _done(flight: Any, bucket: int, fut: Any) -> None:
    """A Python-launched reduction completed (on a gloo worker thread)."""
    err = None
    try:
        fut.value()
    except Exception as e:  # noqa: BLE001 - reported by wait()
        err = first_line(e)
    flight.finished(bucket, err)


class _TellsWire:
    """A BucketTransport attribute (kept as `_name`) whose every change
    tells pyddp._hot's Wire again what it may launch."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.slot, value)
        obj._tell_wire()


class BucketTransport:
    def __init__(self, peers: Peers, failure: Failure, names: Sequence[str]):
        self.peers, self.failure = peers, failure
        # Bucket reductions go on a group of this link's own: another model's
        # launcher thread, or the caller's collectives, would launch on a
        # shared group in an order that differs between ranks, and gloo would
        # pair one model's bucket with another's.
        self.group = own_group(peers, "data")
        self.names = list(names)
        self._flats: List[torch.Tensor] = []  # replica 0's buckets
        self.buckets: List[List[int]] = []
        # A communication hook (torch DDP's signature: hook(state, bucket) ->
        # Future of the reduced bucket) and what its buckets show: replica
        # 0's parameters and gradient views, by parameter index.
        self._hook: Any = None
        self.hook_state: Any = None
        self.params: List[torch.Tensor] = []
        self.views: List[Any] = []
        self.hook_error: Optional[BaseException] = None  # the hook's own exception
        # The agreement riding in the last bucket (agreement.py): replica 0's
        # last bucket with room after it, and what fills the room.
        self.wire: Optional[torch.Tensor] = None
        self._rider: Optional[Callable[[torch.Tensor, int], None]] = None
        self._armed = False
        self.wait_ns = self.wait_end_ns = 0  # the last iteration's wait for the reductions
        self.done_ns_last: Dict[int, int] = {}
        # Sharded gradients (shard='gradients', one replica per process):
        # buckets reduce-scatter, this process keeping block `rank`.
        self._scatter = False
        self._bypassed = False
        # The torch-linked hot path: pyddp._hot's Wire launches the plain
        # buckets from the engine's launcher thread in C++, without the
        # interpreter lock, and completes them in its Flight, which this
        # transport's own launches (hooks, reduce-scatter, the agreement's
        # tail, an unfilled rider) share. None: every launch is Python's.
        fast = hot()
        self.wire_hot = None if fast is None else fast.Wire(self.group, peers.world)
        self._flight: Any = _InFlight() if fast is None else self.wire_hot.flight()
        failure.on_fail(self._stop_wire)

    # What the Wire may launch itself: a change tells it again.
    flats = _TellsWire()  # replica 0's buckets (the layout's own list)
    hook = _TellsWire()  # a communication hook, or None
    scatter = _TellsWire()  # reduce-scatter (sharded gradients, CPU)
    bypassed = _TellsWire()  # GPUs: NCCL's communicator carries the buckets

    def _tell_wire(self) -> None:
        """The Wire's buckets: replica 0's, unless a hook or reduce-scatter
        launches them in Python (then none: under sharded gradients the
        layout frees its buckets, which the Wire must not hold)."""
        if self.wire_hot is not None:
            # (A bucket of a sharded layout may be None: not allocated now.)
            plain = self._hook is None and not self._scatter and not self._bypassed
            plain = plain and all(f is not None for f in self._flats)
            self.wire_hot.set_buckets(
                list(self._flats) if plain else [], self.wire if plain and self.rides else None
            )

    @property
    def armed(self) -> bool:
        """Whether the agreement's room holds this step's record, not sent
        yet (the Wire's own flag where it launches: its launch of the last
        bucket clears it)."""
        return self.wire_hot.armed() if self.wire_hot is not None else self._armed

    @armed.setter
    def armed(self, on: bool) -> None:
        self._armed = on
        if self.wire_hot is not None:
            self.wire_hot.arm(on)

    def _stop_wire(self) -> None:
        """The link failed: nothing more from C++ (the Python launch raises)."""
        if self.wire_hot is not None:
            self.wire_hot.stop()

    def ride_on(
        self, wire: Optional[torch.Tensor], rider: Optional[Callable[[torch.Tensor, int], None]]
    ) -> None:
        """`wire`: replica 0's last bucket followed by room for the agreement,
        which `rider(wire, bucket elements)` fills as it launches (None: the
        agreement travels on its own after the buckets)."""
        self.wire, self._rider = (wire, rider) if rider is not None else (None, None)
        self.armed = False  # arm() filled the room for the next launch
        self._tell_wire()

    def arm(self) -> None:
        """At the end of a synced forward: the agreement's room filled now,
        on the caller's thread, so the launch of the last bucket (on the
        launcher thread, which takes the GIL for it) only sends it."""
        if self.rides:
            self._rider(self.wire, self.flats[-1].numel())
            self.armed = True
            self.peers.in_backward = True  # (the launches may all be C++'s)

    @property
    def rides(self) -> bool:
        """Whether the agreement rides in the last bucket (a hook replaces
        what crosses the wire: then it travels on its own)."""
        return self.wire is not None and self.hook is None

    def launch(self, bucket: int) -> None:
        """On the engine's launcher thread, in bucket-index order, for what
        the Wire leaves to Python (every bucket without it)."""
        self.failure.check()
        flat = self.flats[bucket]
        self.peers.in_backward = True
        if self.scatter:
            # Block `rank` of the average. gloo's own reduce-scatter moves an
            # all-reduce's bytes (measured: bench/wire_bytes.py), so: an
            # all-to-all (each rank sends block k to rank k, (N-1)/N of the
            # bucket), then the N blocks received summed in rank order into
            # this rank's block, on gloo's thread as the future completes.
            flat.div_(self.peers.world)
            future = all_to_all(self.group, flat).then(
                functools.partial(_sum_blocks, flat, self.peers.rank, self.peers.world)
            )
            self._flight.launched(bucket)
            future.then(functools.partial(_done, self._flight, bucket))
            return
        if self.hook is None:
            # Averaged across processes (torch DDP's convention), divided before
            # the sum so 16-bit gradients do not overflow in transit.
            flat.div_(self.peers.world)
            wire = flat
            if bucket == len(self.flats) - 1 and self.rides:
                if not self.armed:  # no forward told the link (GradSync's own callers)
                    self._rider(self.wire, flat.numel())
                self.armed = False
                wire = self.wire
            future = allreduce(self.group, wire).get_future()
        else:
            future = self._hooked(bucket, flat)
        self._flight.launched(bucket)
        # The callback runs on a gloo worker thread and holds only the flight
        # record, never the link: were it to drop the last reference to the
        # group there, the group would join that very thread (std::terminate,
        # "Resource deadlock avoided").
        future.then(functools.partial(_done, self._flight, bucket))

    def _hooked(self, bucket: int, flat: torch.Tensor) -> Any:
        """The user's hook reduces the bucket (it averages, as under DDP);
        its result lands in the bucket unless it wrote there itself. Into
        the bucket as it was before the hook ran: a hook's set_buffer
        (torch's fp16_compress_wrapper) replaces what buffer() returns, not
        where the result belongs."""
        return self._call_hook(bucket, flat).then(functools.partial(_into_bucket, flat))

    def _call_hook(self, bucket: int, flat: torch.Tensor) -> Any:
        """The user's hook's future for the bucket (a Future, or the link fails)."""
        members = self.buckets[bucket]
        params = [self.params[i] for i in members]
        grads = [self.views[i] for i in members]
        view = GradBucket(bucket, bucket == len(self.flats) - 1, flat, params, grads)
        try:
            future = self.hook(self.hook_state, view)
        except Exception as e:  # noqa: BLE001 - named below, and handed to the user
            self.hook_error = e  # raised with its own type at the end of backward
            self.failure.fail(
                f"the communication hook raised {type(e).__name__} on bucket {bucket}: "
                f"{first_line(e)}"
            )
        if not isinstance(future, torch._C.Future):  # torch.futures.Future subclasses it
            self.failure.fail(
                f"the communication hook returned {type(future).__name__} for bucket {bucket}; "
                "it must return a torch.futures.Future of the reduced bucket (torch DDP's rule)"
            )
        return future

    def on_gpu(self, provider: Any, device: int, stream: int) -> Callable[[int], None]:
        """GPUs (NcclBackend.set_hook): what the backend calls for each bucket,
        from the engine's launcher thread, in bucket order, once `stream`
        (torch's, on `device`) waits for the bucket's gradients: the hook
        with `stream` current."""
        return functools.partial(self._launch_on_stream, provider, device, stream)

    def _launch_on_stream(self, provider: Any, device: int, stream: int, bucket: int) -> None:
        """The hook's work queues on `stream` (torch's NCCL collectives make
        their own stream wait for it); its future is waited for there (a
        future of device tensors makes the current stream wait, without the
        host: torch's CUDA futures), and its result copied into the bucket
        there. Before that, a future that completes on the host (gloo) is
        waited for as the transport waits: the timeout, the store read each
        second (a rank whose hook raised ends this wait at once)."""
        self.failure.check()
        self.peers.in_backward = True
        flat = self.flats[bucket]
        with provider.on(device, stream):
            future = self._call_hook(bucket, flat)
            self._flight.launched(bucket)
            done = threading.Event()
            future.add_done_callback(lambda _: done.set())
            # (Named as wait() names its wait: a rank a bucket ahead, or at
            # the end of backward, waits at the same place.)
            post = WaitPost(self.failure, self._waiting_for())
            try:
                self._wait_flight(_Done(done), time.monotonic() + self.peers.timeout, post)
            finally:
                post.withdraw()
            if not done.is_set():  # nothing further launches
                self.failure.fail(
                    f"the communication hook's future for bucket {bucket} "
                    f"({self._names(bucket)}) was not done after {self.peers.timeout:g} s"
                )
            error = None
            try:
                future.wait()  # CUDA tensors: this stream waits for them
                _into_bucket(flat, future)  # in this stream's order
            except Exception as e:  # noqa: BLE001 - reported by wait()
                error = first_line(e)
            self._flight.finished(bucket, error)

    def launch_tail(self, part: torch.Tensor) -> None:
        """After the engine's finish (every bucket launched): the agreement's
        sums (agreement.py), in place, on the same group, so every rank
        pairs it with the others' (it follows the same buckets)."""
        self.failure.check()
        work = allreduce(self.group, part)
        self._flight.launched(TAIL)
        work.get_future().then(functools.partial(_done, self._flight, TAIL))

    def wait(self) -> List[int]:
        """Waits for every launched bucket (and the agreement's sums), at most
        the timeout; returns the buckets."""
        timeout = self.peers.timeout
        start = time.monotonic()
        deadline = start + timeout
        flight = self._flight
        self.wait_ns = self.wait_end_ns = 0  # (a failed wait leaves no stale figures)
        self.done_ns_last = {}
        self.peers.in_backward = True
        post = WaitPost(self.failure, self._waiting_for())
        try:
            self._wait_flight(flight, deadline, post)
        finally:
            post.withdraw()
        order, errors, pending, done = flight.snapshot()
        launched = [b for b in order if b != TAIL]
        if errors or pending:
            failed = sorted(b for b in errors if b != TAIL)
            waiting = [b for b in launched if b not in done]
            bucket = failed[0] if failed else waiting[0] if waiting else TAIL
            why = errors.get(bucket, f"not done after {timeout:g} s")
            if "timeout" in why.lower():  # gloo's words for pyddp's timeout
                why = f"not done after {timeout:g} s ({why})"
            what = "the agreement after the buckets" if bucket == TAIL else f"bucket {bucket}"
            self.failure.fail(f"all-reduce of {what} ({self._names(bucket)}) failed: {why}")
        self.wait_end_ns = time.monotonic_ns()  # (after every done stamp: merge_timing)
        self.wait_ns = self.wait_end_ns - int(start * 1e9)
        self.done_ns_last = flight.next(TAIL)
        self.peers.iteration += 1
        self.peers.in_backward = False
        return launched

    def _waiting_for(self) -> str:
        return f"the reductions of synced backward {self.peers.iteration + 1}"

    def _wait_flight(self, flight: Any, deadline: float, post: WaitPost) -> None:
        """Waits for the flight; the store is read once a second of waiting,
        not at each completion (a store call costs a round trip: a wait that
        ends within the second touches the store not at all)."""
        next_poll = time.monotonic() + 1.0
        while True:
            now = time.monotonic()
            # Slices of 0.1 s: the C++ flight waits without the interpreter,
            # which runs a Ctrl-C's handler only between slices.
            if now >= deadline or flight.settle(min(deadline, next_poll, now + 0.1) - now):
                return
            now = time.monotonic()
            if now >= deadline:
                return
            if now >= next_poll:
                next_poll = now + 1.0
                self.failure.check_abandoned()
                post.poll()

    def _names(self, bucket: int) -> str:
        if bucket == TAIL:
            return "the agreement on unused parameters and work done"
        if 0 <= bucket < len(self.buckets):
            members = [self.names[i] for i in self.buckets[bucket][:3]]
            return ", ".join(members) + (", ..." if len(self.buckets[bucket]) > 3 else "")
        return "?"


def _sum_blocks(flat: torch.Tensor, rank: int, world: int, future: Any) -> torch.Tensor:
    """Sharded gradients: the all-to-all's blocks (one per source rank,
    block `rank` of each one's bucket) summed in rank order into this
    rank's block of `flat`."""
    got = future.value()
    got = got[0] if isinstance(got, (list, tuple)) else got
    c = flat.numel() // world
    blocks = got.view(world, c)
    mine = flat[rank * c : (rank + 1) * c]
    mine.copy_(blocks[0])
    for k in range(1, world):
        mine.add_(blocks[k])
    return flat


def _into_bucket(flat: torch.Tensor, future: Any) -> torch.Tensor:
    value = future.value()
    if isinstance(value, (list, tuple)):
        value = value[0]
    if not isinstance(value, torch.Tensor) or value.numel() != flat.numel():
        raise RuntimeError(
            "the communication hook's future must hold the reduced bucket, a tensor of "
            f"{flat.numel()} elements, got "
            + (
                f"one of {value.numel()}"
                if isinstance(value, torch.Tensor)
                else type(value).__name__
            )
        )
    if value.data_ptr() != flat.data_ptr():
        flat.copy_(value.view_as(flat))
    return flat


def all_reduce_blocking(tensor: torch.Tensor, count: int, op: str, group: Any) -> None:
    """`pyddp.all_reduce` across processes: `tensor` holds this process's sum
    of `count` tensors; afterwards it holds the sum over every process, or
    with op "avg" the mean over every process's tensors. Blocks. The ranks'
    calls are compared first (one small all-gather, which also carries the
    counts): other ops, shapes or dtypes raise on every rank, where gloo
    aborted the process or an "avg" paired its count with another call."""
    kind = (op == "avg", tensor.numel(), _CODES.get(tensor.dtype, -1), hash(tuple(tensor.shape)))
    mine = torch.tensor([count, *kind], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    rows = [e.tolist() for e in every]
    if any(r[1:] != rows[0][1:] for r in rows):
        told = "; ".join(f"rank {i}: op {'avg' if r[1] else 'sum'}, {r[2]} elements, "
                         f"{_NAMES.get(r[3], '?')}" for i, r in enumerate(rows))  # fmt: skip
        raise ValueError(
            f"pyddp.all_reduce: the ranks passed different ops, shapes or dtypes ({told}); "
            "every rank must pass tensors of one shape and dtype, with one op"
        )
    dist.all_reduce(tensor, group=group)
    if op == "avg":
        tensor.div_(sum(r[0] for r in rows))


_CODES = {t: i for i, t in enumerate((torch.float32, torch.float64, torch.float16, torch.bfloat16))}
_NAMES = {i: str(t).replace("torch.", "") for t, i in _CODES.items()}
