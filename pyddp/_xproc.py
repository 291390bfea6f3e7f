"""One GradSync's link to the other processes, on torch.distributed.

Per bucket, after this process's replicas are summed (in C++), the engine's
launcher calls `launch(bucket)`: an asynchronous all-reduce of replica 0's
bucket on the data group, in bucket-index order on every rank. `wait()` at the
end of backward waits for them with pyddp's timeout. Everything else (the
model check and broadcast at wrap, the per-iteration agreement on unused
parameters, rank 0's bucket plan) runs on a second gloo group of the same
ranks, so it never interleaves with bucket reductions still in flight."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import itertools
import pickle
import threading
import time
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from . import _C
from .dist import job_prefix

# Every small blocking exchange on a control group is preceded by a header
# (its name's tag and its place in the group's sequence), compared on every
# rank: two ranks at different exchanges raise, naming both, instead of
# pairing (an evaluation's sums with a training step's weighting) or crashing
# gloo on different sizes. Names are declared at import, so a rank can name
# an exchange it never made itself.
_TAGS: Dict[int, str] = {}
_sequence: Dict[Tuple[int, ...], int] = {}  # per control group (its ranks)
# Works left pending by a failure stay referenced here: dropping a pending
# gloo work from the thread that fails (inside autograd's end-of-backward
# callback) could block it on that work's completion.
_in_flight: List[Any] = []


def _tag(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def exchange(name: str) -> str:
    """Declares the name of a control exchange (at import time)."""
    _TAGS[_tag(name)] = name
    return name


MODEL_CHECK = exchange("the comparison of models and settings at wrap")
REPLICA_COUNTS = exchange("the exchange of replica counts")
PARAMS_BROADCAST = exchange("the broadcast of rank 0's parameters and buffers")
BUFFERS_BROADCAST = exchange("the broadcast of rank 0's buffers before a training forward")
PLAN_BROADCAST = exchange("the bucket plan broadcast")
LOSS_WEIGHTS = exchange("the loss weighting of a training step")
DISAGREEMENT = exchange("the records of a disagreement between ranks")
AGREEMENT = exchange("the agreement at the end of a synced backward")
_groups: Dict[tuple, Any] = {}
# Released while the interpreter is whole: a gloo group destroyed during
# interpreter teardown can end the process in std::terminate.
atexit.register(_groups.clear)


class ProcessGroupError(_C.ReduceError):
    """A collective across processes failed or timed out (a ReduceError)."""


def resolve_group(group: Any) -> Optional[Any]:
    """The process group to span, or None to stay in one process."""
    if group is not None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "group= was given but torch.distributed is not initialised: call pyddp.init()"
            )
        return group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


_made: Dict[tuple, int] = {}  # (ranks, role) -> gloo groups made so far


def _own_group(ranks: List[int], timeout_s: float, role: str, store: Any) -> Any:
    """A gloo process group over `ranks` for pyddp alone, with pyddp's timeout,
    its rendezvous keys named by pyddp: (restart, ranks, role, how many such
    groups this rank made before). Every member makes them in the same order,
    so the names agree (torch's own names for groups made by their members
    only depend on each rank's whole group history, and diverge after a
    subgroup). "data": one per GradSync, so another model's launcher or the
    caller's collectives never pair with its buckets. "control": one per set
    of ranks, for small blocking exchanges that must not pair with a bucket
    reduction launched earlier."""
    key = (tuple(ranks), role)
    if role == "control" and key in _groups:
        return _groups[key]
    n = _made.get(key, 0)
    _made[key] = n + 1
    name = f"{job_prefix()}/gloo/{'-'.join(map(str, ranks))}/{role}/{n}"
    # Each member says it arrived, so a timeout can name the ranks that did not.
    me = dist.get_rank()
    _store_call(store, "set", (f"{name}/arrived/{me}", "1"), _STORE_DEADLINE_S)
    try:
        pg = dist.ProcessGroupGloo(
            dist.PrefixStore(name, store),
            ranks.index(me),
            len(ranks),
            datetime.timedelta(seconds=timeout_s),
        )
    except Exception as e:  # noqa: BLE001 - named below
        missing = []
        for r in ranks:
            answer = _store_call(store, "check", ([f"{name}/arrived/{r}"],), _STORE_DEADLINE_S)
            if not answer:  # the store is gone or stopped too: say what we know
                missing = []
                break
            if not answer[0]:
                missing.append(r)
        who = (
            f"rank {', '.join(map(str, missing))} never arrived (stalled or failed before "
            "pyddp.wrap / GradSync, or running different code)"
            if missing
            else f"{_first_line(e)}"
        )
        raise ProcessGroupError(
            f"pyddp: rank {me} could not set up pyddp's {role} group over ranks {ranks} "
            f"within {timeout_s:g} s: {who}"
        ) from None
    if role == "control":
        _groups[key] = pg
    return pg


def _allreduce(pg: Any, t: torch.Tensor, op: Any = None) -> Any:
    opts = dist.AllreduceOptions()
    if op is not None:
        opts.reduceOp = op
    return pg.allreduce([t], opts)


def _broadcast(pg: Any, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0  # the group's rank 0
    pg.broadcast([t], opts).wait()


class _InFlight:
    """The bucket reductions launched in this iteration and their completion
    times, completed from gloo's worker threads."""

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

    def done(self, bucket: int, fut: Any) -> None:
        err = None
        try:
            fut.value()
        except Exception as e:  # noqa: BLE001 - reported by wait()
            err = _first_line(e)
        with self.cv:
            self.done_ns[bucket] = time.monotonic_ns()
            if err is not None:
                self.errors[bucket] = err
            self.pending -= 1
            self.cv.notify_all()

    def next(self) -> Dict[int, int]:
        """Starts the next iteration; returns this one's completion times."""
        with self.cv:
            done = dict(self.done_ns)
            self.order.clear()
            self.done_ns.clear()
        return done


class CrossProcess:
    def __init__(self, group: Any, timeout_s: float, names: Sequence[str]):
        self.ranks = dist.get_process_group_ranks(group)
        if dist.get_rank() not in self.ranks:
            raise ValueError(
                f"group=: this process (rank {dist.get_rank()}) is not in the group "
                f"(ranks {self.ranks}); only its members may wrap with it"
            )
        self.rank = self.ranks.index(dist.get_rank())
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception as e:  # noqa: BLE001 - named below
            raise RuntimeError(f"pyddp: torch.distributed's store is not reachable: {e}") from e
        self.store: Optional[Any] = store
        # Bucket reductions go on a group of this GradSync's own: another
        # model's launcher thread, or the caller's collectives, would launch
        # on a shared group in an order that differs between ranks, and gloo
        # would pair one model's bucket with another's.
        self.group = _own_group(self.ranks, timeout_s, "data", store)
        # Which of the models wrapped over these ranks this is: the same on
        # every member (a count per set of ranks, unlike a count of all the
        # GradSyncs a process made, which differs after a subgroup).
        self.id = _made[(tuple(self.ranks), "data")] - 1
        self.world = len(self.ranks)
        self.root = self.ranks[0]  # the global rank of the group's rank 0
        self.timeout = timeout_s
        self.names = list(names)
        # Blocking exchanges run on the caller's thread, one at a time: one
        # control group per set of ranks is enough.
        self.ctrl = _own_group(self.ranks, timeout_s, "control", store)
        self.prefix = f"{job_prefix()}/{'-'.join(map(str, self.ranks))}/{self.id}"
        self.iteration = 0
        self.flats: List[torch.Tensor] = []  # replica 0's buckets (set by GradSync)
        self.buckets: List[List[int]] = []
        self.failed: Optional[str] = None
        self.local_counts: List[int] = []
        self._flight = _InFlight()
        self._store_unreachable = False
        self._store_misses = 0
        self.in_backward = False  # between the first launch and wait()
        self.agree_ns = 0  # the last iteration's unused-parameter agreement (exposed)
        self._agree_work: Optional[Any] = None
        self._agree_launch_ns = 0
        self._none_here: List[int] = []
        self._mask: Optional[torch.Tensor] = None
        self.wait_ns = 0  # the last iteration's wait for cross-process reductions
        self.done_ns_last: Dict[int, int] = {}

    def _same_exchange(self, what: str, where: Optional[str] = None) -> None:
        """Every rank must be at the same control exchange: compares each
        rank's (tag, sequence number, wrapped model) first, in a fixed-size
        all-gather."""
        if self.failed is not None:  # nothing more goes on the group
            raise ProcessGroupError(self.failed)
        self._check_header(what, self._start_header(what), where)

    def _start_header(self, what: str) -> tuple:
        """Enqueues the header all-gather; _check_header waits for it."""
        key = tuple(self.ranks)
        seq = _sequence.get(key, 0) + 1
        _sequence[key] = seq
        # The model too: two wrapped models' exchanges of the same kind (a GAN's
        # generator and discriminator) must not pair.
        mine = torch.tensor([_tag(what), seq, self.id], dtype=torch.int64)
        outs = [torch.zeros(3, dtype=torch.int64) for _ in range(self.world)]
        return self.ctrl.allgather([outs], [mine]), mine, outs

    def _check_header(self, what: str, header: tuple, where: Optional[str] = None) -> None:
        work, mine, outs = header
        self._ctrl_call(what, self._await, work)
        if all(torch.equal(o, mine) for o in outs):
            return
        sides = "; ".join(
            f"rank {self.ranks[r]} at exchange {int(o[1])}, "
            + _TAGS.get(int(o[0]), f"an exchange unknown here (tag {int(o[0])})")
            + f" of wrapped model #{int(o[2])}"
            for r, o in enumerate(outs)
        )
        self._fail(
            f"the ranks are not at the same exchange ({sides}); every rank must make the same "
            "pyddp calls in the same order (an evaluation, a fit or a wrap on some ranks only "
            "pairs with another exchange on the others)",
            census=False,
            where=where,
        )

    # ---------------------------------------------------------- at wrap time
    def check_same_model(self, signature: List[tuple], what: str) -> None:
        """Refuses, on every rank, models or settings that differ across
        ranks, naming the first differing entry and the rank."""
        out = self.gather_objects(signature, MODEL_CHECK)
        ref = out[0]
        for r, sig in enumerate(out[1:], start=1):
            if sig == ref:
                continue
            for i, (a, b) in enumerate(itertools.zip_longest(ref, sig)):
                if a == b:
                    continue
                if "setting" in (a or ("",))[:1] + (b or ("",))[:1]:
                    raise ValueError(
                        f"pyddp: the wrap settings differ across processes: rank "
                        f"{self.ranks[r]} has {_entry(b)} where rank {self.root} has "
                        f"{_entry(a)}; every process must wrap with the same settings"
                    )
                raise ValueError(
                    f"pyddp: the {what} differs across processes: rank {self.ranks[r]} has "
                    f"{_entry(b)} where rank {self.root} has {_entry(a)} (entry {i}); every "
                    "process must wrap the same model"
                )

    def broadcast(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        """Overwrites `tensors` with the group root's values (one message per
        dtype); nothing to send (a model without buffers) sends nothing (the
        model check made the tensors the same on every rank)."""
        by_kind: Dict[tuple, List[torch.Tensor]] = {}
        for t in tensors:
            if t.numel():
                by_kind.setdefault((t.dtype, t.device), []).append(t)
        if not by_kind:
            return
        self._same_exchange(what)
        with torch.no_grad():
            for group in by_kind.values():
                flat = _flatten_dense_tensors([t.detach() for t in group])
                self._ctrl_call(what, _broadcast, self.ctrl, flat)
                for t, v in zip(group, _unflatten_dense_tensors(flat, group)):
                    t.copy_(v)

    def join_model(
        self, replicas: Sequence[Any], device_type: str, op: str, settings: Dict[str, Any]
    ) -> None:
        """At construction: the same model and settings on every rank (else a
        ValueError naming the first difference), then rank 0's parameters and
        buffers on every replica of every rank, as torch DDP does."""
        m0 = replicas[0]
        entries = [("parameter", n, p) for n, p in m0.named_parameters()]
        entries += [("buffer", n, b) for n, b in m0.named_buffers()]
        signature = [("setting", f"{k}={v!r}") for k, v in settings.items()]
        signature += model_signature(entries, device_type)
        self.check_same_model(signature, "model")
        self.gather_local_counts(len(replicas))
        if op == "avg" and len(set(self.local_counts)) != 1:
            raise ValueError(
                f"op='avg' across processes with {self.local_counts} replicas per process: "
                "use the same number of replicas in every process, or op='sum'"
            )
        state = [t for _, _, t in entries]
        self.broadcast(state, PARAMS_BROADCAST)
        with torch.no_grad():
            for m in replicas[1:]:
                mine = [p for p in m.parameters()] + [b for b in m.buffers()]
                for dst, src in zip(mine, state):
                    dst.copy_(src)

    def gather_local_counts(self, local: int) -> None:
        """Every rank's number of replicas (they may differ)."""
        counts = torch.zeros(self.world, dtype=torch.int64)
        counts[self.rank] = local
        self._same_exchange(REPLICA_COUNTS)
        self._ctrl_call(REPLICA_COUNTS, self._sum, counts)
        self.local_counts = counts.tolist()

    def nccl_rendezvous(self, local: int) -> Any:
        """For make_backend: one NCCL communicator over every process's GPUs.
        Rank 0's unique id travels through torch.distributed's store; this
        process's `local` GPUs are ranks first.. of the total."""
        first, total = sum(self.local_counts[: self.rank]), sum(self.local_counts)

        def rendezvous(nccl_path: str) -> tuple:
            if self.store is None:
                raise RuntimeError("NCCL across processes needs torch.distributed's store")
            key = f"{self.prefix}/nccl_id"
            if self.rank == 0:
                self.store.set(key, _C.nccl_unique_id(nccl_path))
            return bytes(self.store.get(key)), total, first

        return rendezvous

    def root_order(self, order: Sequence[int], size: int) -> Optional[List[int]]:
        """Rank 0's ready order, so every rank plans the same buckets (None if
        rank 0 saw an incomplete order and nobody should rebuild)."""
        t = torch.full((size + 1,), -1, dtype=torch.int64)
        if len(order) == size:
            t[0] = size
            t[1:] = torch.tensor(list(order), dtype=torch.int64)
        self._same_exchange(PLAN_BROADCAST)
        self._ctrl_call(PLAN_BROADCAST, _broadcast, self.ctrl, t)
        return None if t[0].item() != size else t[1:].tolist()

    # ----------------------------------------------------------- per backward
    def start_agreement(self, none_here: Sequence[int], size: int, record: Dict[str, int]) -> None:
        """Starts the per-iteration exchange on which parameters hold a gradient
        on some process (a uint8 mask, MAX over ranks), carrying `record`
        (what every rank must agree on at this synced backward: step count,
        micro-batches, train/eval, a parameter checksum): its bytes and their
        complements, so MAX gives both the largest and the smallest value of
        each byte. Asynchronous on the control group: it travels while the
        bucket reductions finish, so it adds latency only where it outlasts
        them."""
        if self.failed is not None:
            raise ProcessGroupError(self.failed)
        t0 = time.perf_counter_ns()
        # A header first, as for every control exchange, enqueued without
        # waiting (the agreement stays overlapped with the bucket reductions)
        # and checked in unused_everywhere before the mask is read. A rank at
        # another exchange (a buffer broadcast before a training forward it
        # alone ran) sees the mismatch in its header and never sends that
        # exchange's payload, so the mask never meets a message of another size.
        self._agree_header = self._start_header(AGREEMENT)
        packed = torch.tensor([_AGREEMENT_TAG, *record.values()], dtype=torch.int64)
        packed = packed.view(torch.uint8)
        n = packed.numel()
        mask = torch.ones(size + 2 * n, dtype=torch.uint8)
        mask[list(none_here)] = 0
        mask[size : size + n] = packed
        mask[size + n :] = 255 - packed
        self._none_here = list(none_here)
        self._mask, self._record, self._size = mask, dict(record), size
        self._agree_work = _allreduce(self.ctrl, mask, dist.ReduceOp.MAX)
        self._agree_launch_ns = time.perf_counter_ns() - t0

    def unused_everywhere(self) -> List[int]:
        """After wait(): the parameters with a gradient on no process. Raises
        on every rank, naming fields and ranks, if the ranks' records differ."""
        work, self._agree_work = self._agree_work, None
        if work is None:
            return []
        t0 = time.perf_counter_ns()
        _in_flight.append(work)  # never destroyed while pending (see _in_flight)
        self._check_header(AGREEMENT, self._agree_header, where=f"synced backward {self.iteration}")
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 - named below
            self._fail(
                f"the exchange on unused parameters failed: {_first_line(e)}",
                where=f"synced backward {self.iteration}",
            )
        if ok is False:
            self._fail(
                f"the exchange on unused parameters took over {self.timeout:g} s",
                where=f"synced backward {self.iteration}",
            )
        # The exposed part: launching it, and waiting for it once the buckets
        # were done.
        _in_flight.remove(work)
        self.agree_ns = time.perf_counter_ns() - t0 + self._agree_launch_ns
        size, mask = self._size, self._mask
        n = (mask.numel() - size) // 2
        if not torch.equal(mask[size : size + n], 255 - mask[size + n :]):
            self._disagreement()
        return [i for i in self._none_here if not mask[i]]

    def _disagreement(self) -> None:
        """The ranks' records differ (every rank sees it): exchange them and
        name each differing field with every rank's value."""
        records = self.gather_objects(self._record, DISAGREEMENT)
        lines = []
        for field in self._record:
            values = [rec.get(field) for rec in records]
            if len(set(values)) > 1:
                shown = ", ".join(f"rank {self.ranks[r]} {v!r}" for r, v in enumerate(values))
                lines.append(f"{field}: {shown}")
        self._fail(
            "the ranks did different work before this synced backward ("
            + "; ".join(lines or ["records differ (a rank paired this exchange with another)"])
            + "): one rank stepped its optimizer more often, ran a micro-batch under no_sync() "
            "the others did not, switched model.train()/eval() alone, or changed its "
            "parameters outside pyddp; its replicas would differ for the rest of the run",
            census=False,
            where=f"synced backward {self.iteration}",  # wait() has counted it
        )

    def from_root(self, obj: Any, what: str) -> Any:
        """The group root's `obj` on every rank (pickled through gloo)."""
        self._same_exchange(what)
        data = pickle.dumps(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._ctrl_call(what, _broadcast, self.ctrl, size)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self.rank == 0:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._ctrl_call(what, _broadcast, self.ctrl, buf)
        return pickle.loads(buf.numpy().tobytes()) if self.rank else obj

    def gather_objects(self, obj: Any, what: str) -> List[Any]:
        """Every rank's `obj`, in group rank order (pickled through gloo);
        `what` names the exchange (declared with `exchange`)."""
        self._same_exchange(what)
        data = pickle.dumps(obj)
        sizes = torch.zeros(self.world, dtype=torch.int64)
        sizes[self.rank] = len(data)
        self._ctrl_call(what, self._sum, sizes)
        width = int(sizes.max().item())
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.world)]
        self._ctrl_call(what, lambda: self.ctrl.allgather([outs], [mine]).wait())
        return [pickle.loads(o[: int(n)].numpy().tobytes()) for o, n in zip(outs, sizes.tolist())]

    def _sum(self, t: torch.Tensor) -> None:
        _allreduce(self.ctrl, t).wait()

    def sum_over_ranks(self, values: Sequence[float], what: str) -> List[float]:
        """Element-wise sums over ranks (float64), on the control group; `what`
        names the exchange (declared with `exchange`)."""
        self._same_exchange(what)
        t = torch.tensor(list(values), dtype=torch.float64)
        self._ctrl_call(what, self._sum, t)
        return t.tolist()

    def launch(self, bucket: int) -> None:
        """On the engine's launcher thread, in bucket-index order."""
        if self.failed is not None:
            raise ProcessGroupError(self.failed)
        flat = self.flats[bucket]
        # Averaged across processes (torch DDP's convention), divided before the
        # sum so 16-bit gradients do not overflow in transit.
        flat.div_(self.world)
        self.in_backward = True
        work = _allreduce(self.group, flat)
        self._flight.launched(bucket)
        # The callback runs on a gloo worker thread and holds only the flight
        # record, never this object: were it to drop the last reference to
        # the group there, the group would join that very thread
        # (std::terminate, "Resource deadlock avoided").
        work.get_future().then(functools.partial(self._flight.done, bucket))

    def wait(self) -> List[int]:
        """Waits for every launched bucket, at most timeout_s; returns them."""
        start = time.monotonic()
        deadline = start + self.timeout
        flight = self._flight
        while True:
            with flight.cv:
                if flight.pending == 0 or flight.errors:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                flight.cv.wait(min(left, 1.0))
            if flight.pending and not flight.errors:
                self._check_abandoned()
        with flight.cv:
            launched, errors = list(flight.order), dict(flight.errors)
            pending = flight.pending
            first_pending = next((b for b in flight.order if b not in flight.done_ns), -1)
        if errors or pending:
            bucket = min(errors) if errors else first_pending
            why = errors.get(bucket, f"not done after {self.timeout:g} s")
            self._fail(f"all-reduce of bucket {bucket} ({self._names(bucket)}) failed: {why}")
        self.wait_ns = int((time.monotonic() - start) * 1e9)
        self.done_ns_last = flight.next()
        self.iteration += 1
        self.in_backward = False
        return launched

    def abandon(self, reason: str) -> None:
        """This rank drops the step (a replica's backward raised): tell the
        others, so they fail now instead of at the timeout."""
        if self.failed is None:
            self.failed = (
                f"pyddp: rank {dist.get_rank()} abandoned {self._where()} ({reason}); the "
                "processes can no longer agree on the step: restart them (torchrun "
                "--max-restarts=K resumes a Trainer from its last checkpoint)"
            )
            self._publish(reason)

    def _publish(self, reason: str) -> None:
        """Tells the other ranks through the store that this one stopped, so
        they fail at their next poll instead of at the timeout. Best effort:
        if the store is gone, the others time out instead. The reason is data
        for them: "rank|text", bounded and quoted where it is read."""
        self._store("set", f"{self.prefix}/abandoned", f"{dist.get_rank()}|{reason}")

    def _abandoned(self) -> Optional[str]:
        """Another rank's reason for abandoning the step, if it left one: read
        as data (anyone who reaches the store can write it), attributed to
        the rank it names, bounded and quoted."""
        key = f"{self.prefix}/abandoned"
        if not self._store("check", [key]):
            return None
        raw = self._store("get", key)
        if raw is None:
            return None
        who, _, text = bytes(raw).decode("utf-8", errors="replace").partition("|")
        if not (who.isdigit() and int(who) in self.ranks) or int(who) == dist.get_rank():
            return f"an unattributed note in the store, {_quoted(who + '|' + text)}"
        return f"rank {int(who)} abandoned the step, reporting {_quoted(text)}"

    def _check_abandoned(self) -> None:
        why = self._abandoned()
        if why is not None:
            self._fail(why, census=False)

    def _store(self, op: str, *args: Any) -> Any:
        """A call on torch.distributed's store with a deadline: on the failure
        path a store whose host is stopped (SIGSTOP, a hung node) would block
        forever. None (or False for check) when it fails or does not answer
        within a few seconds; the call is left behind on a daemon thread."""
        if self.store is None or self._store_unreachable:
            return False if op == "check" else None
        result = _store_call(self.store, op, args, min(_STORE_DEADLINE_S, self.timeout))
        if not result:
            # Twice in a row: a single slow answer does not end the polling.
            self._store_misses += 1
            self._store_unreachable = self._store_misses >= 2
            return False if op == "check" else None
        self._store_misses = 0
        return result[0]

    def _ctrl_call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        if self.failed is not None:
            raise ProcessGroupError(self.failed)
        try:
            fn(*args, **kwargs)
        except ProcessGroupError:
            raise  # already named (another rank abandoned the step)
        except Exception as e:  # noqa: BLE001 - named and re-raised below
            self._fail(f"{what} failed: {_first_line(e)}")

    def _await(self, work: Any) -> None:
        """Waits for a control exchange, reading the store every second: a rank
        that abandoned its step makes the others fail now, not at the timeout.
        The completion callback (on a gloo thread) holds only an Event."""
        done = threading.Event()
        work.get_future().then(functools.partial(_set_event, done))
        deadline = time.monotonic() + self.timeout
        while not done.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                break
            self._check_abandoned()
        work.wait()  # gloo's own error, or its timeout (the same as pyddp's)

    def _where(self) -> str:
        """Where this rank is in the run, for messages: the synced backward
        under way, or the exchange after the last one."""
        if self.in_backward:
            return f"synced backward {self.iteration + 1}"
        return f"the exchange after synced backward {self.iteration}"

    def _fail(self, what: str, census: bool = True, where: Optional[str] = None) -> None:
        why = self._abandoned() if census else None
        if why is not None:  # the root cause, rather than its echo here
            what, census = f"{what}, because {why}", False
        elif "abandoned the step, reporting" not in what and "note in the store" not in what:
            self._publish(what)  # found here: the others hear it now
        missing = self._census() if census else ""
        if self._store_unreachable and not missing:
            missing = "; the rendezvous store did not answer either (its host stopped or gone?)"
        self.failed = (
            f"pyddp: across {self.world} processes (this is rank {dist.get_rank()}), "
            f"{where or self._where()}: {what}{missing}. The process group cannot be used after "
            "this: restart the processes (torchrun --max-restarts=K resumes a Trainer from "
            "its last checkpoint)"
        )
        raise ProcessGroupError(self.failed)

    def _census(self) -> str:
        """Which ranks did not report this failure within a few seconds: the
        ones that died or stopped arriving."""
        if self.store is None:
            return ""
        key = f"{self.prefix}/fail/{self.iteration}"
        self._store("set", f"{key}/{self.rank}", "1")
        others = [r for r in range(self.world) if r != self.rank]
        deadline = time.monotonic() + min(5.0, self.timeout)
        while others and time.monotonic() < deadline and not self._store_unreachable:
            others = [r for r in others if not self._store("check", [f"{key}/{r}"])]
            time.sleep(0.05)
        if self._store_unreachable:
            return "; the rendezvous store is unreachable too (its host gone or stopped?)"
        if not others:
            return ""
        named = ", ".join(str(self.ranks[r]) for r in others)
        return (
            f"; missing: rank {named} (died, stalled, or ran out of batches: every rank must "
            "run the same number of steps)"
        )

    def _names(self, bucket: int) -> str:
        if 0 <= bucket < len(self.buckets):
            members = [self.names[i] for i in self.buckets[bucket][:3]]
            return ", ".join(members) + (", ..." if len(self.buckets[bucket]) > 3 else "")
        return "?"


_AGREEMENT_TAG = 0x70796464  # "pydd": a record paired with another exchange shows here


_STORE_DEADLINE_S = 5.0  # a store call on the failure path; the store answers in ms


def _store_call(store: Any, op: str, args: tuple, deadline: float) -> List[Any]:
    """store.op(*args) on a daemon thread, waited at most `deadline` seconds:
    [result], or [] if it failed or did not answer (the call is left behind)."""
    result: List[Any] = []

    def call() -> None:
        with contextlib.suppress(Exception):
            result.append(getattr(store, op)(*args))

    thread = threading.Thread(target=call, name="pyddp-store", daemon=True)
    thread.start()
    thread.join(deadline)
    return result


def _set_event(event: threading.Event, _future: Any) -> None:
    event.set()


def _quoted(text: str, limit: int = 300) -> str:
    """Text from another process (the store) shown as data: printable, one
    line, bounded, in quotes."""
    clean = "".join(c if c.isprintable() else " " for c in text)
    return repr(clean[:limit] + ("..." if len(clean) > limit else ""))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    if not text:
        return type(e).__name__
    line = text.splitlines()[0]
    # gloo appends advice that does not apply here ("... GLHF!").
    return line.split(" This is typically caused")[0]


def _entry(e: Any) -> str:
    if e is None:
        return "nothing (fewer entries)"
    return " ".join(str(x) for x in e)


def model_signature(modules_params: Sequence[tuple], device_type: str) -> List[tuple]:
    """What must match across ranks: every parameter's and buffer's name,
    shape and dtype, and the kind of device."""
    sig: List[tuple] = [("device type", device_type)]
    for kind, name, t in modules_params:
        sig.append((kind, name, tuple(t.shape), str(t.dtype).replace("torch.", "")))
    return sig


def nccl_op(op: str, counts: Sequence[int]) -> Tuple[str, float]:
    """NCCL's op and the scale after it, so that gradients are summed (op
    "sum") or averaged ("avg") over a process's replicas and averaged over
    processes. One GPU per process: NCCL's average is exactly that."""
    world = len(counts)
    if all(c == 1 for c in counts):
        return "avg", 1.0
    if op == "sum":
        return "sum", 1.0 / world
    if len(set(counts)) != 1:
        raise ValueError(
            f"op='avg' across processes with {counts} GPUs per process: use the same number "
            "of GPUs in every process, or op='sum'"
        )
    return "avg", 1.0
