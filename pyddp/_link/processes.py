"""The link across processes, on torch.distributed: composes the rendezvous
(groups.py), the control exchanges (control.py), the per-backward agreement
(agreement.py), the bucket transport (transport.py) and the failure handling
(failure.py) behind the contract in link.py."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _C
from ..errors import ProcessGroupError
from ..runtime.libraries import process_group_backend
from .agreement import Agreement, record_for, ride_size
from .control import (
    BUFFERS_BROADCAST,
    LOSS_WEIGHTS,
    PARAMS_BROADCAST,
    SHARD_MODES,
    Control,
    model_signature,
)
from .failure import Failure
from .groups import Peers
from .joining import JOIN_GRADIENTS, ProcessJoining
from .link import Link
from .meetings import Statistics
from .record import WorkRecord, watch_steps
from .route import DeviceRoute
from .transport import BucketTransport
from .weighting import Weighting, Window


class ProcessLink(Link):
    spans_processes = True

    def __init__(self, peers: Peers, names: Sequence[str]):
        self.peers = peers
        self.failure = Failure(peers)
        self.transport = BucketTransport(peers, self.failure, names)
        self.control = Control(peers, self.failure)
        self.agreement = Agreement(self.control)
        self.rank, self.world = peers.rank, peers.world
        self.local_counts: List[int] = []
        self.weighting = Weighting(self.world)  # dmodel.loss's (weighting.py)
        self._route: Optional[DeviceRoute] = None
        self.group: Any = None  # the caller's process group (torch's Join runs on it)
        # torch's Join (its step as every rank saw it, how gradients
        # average): a face of its own for the model.
        self.joining = ProcessJoining(peers, self.control, self.failure, self.weighting)
        self.work: Optional[WorkRecord] = None  # the GradSync's (attach)
        self._just_agreed = False  # the last thing done was a CPU agreement read
        # The shard mode is compared before the first synced backward and
        # after each dmodel.optimizer: under shard='gradients' the buckets
        # are reduce-scattered, which cannot pair with another rank's
        # all-reduce (the agreement riding after them would never come).
        self._settings_due = True
        # register_comm_hook's hook and its state's settings, compared as the shard mode
        self.hook: Tuple[Optional[str], Dict[str, str]] = (None, {})
        self._differ_from: Optional[int] = None  # the hook lets parameters differ (post-local SGD)

    @property
    def global_loss(self) -> Optional[float]:
        return self.weighting.global_loss

    @property
    def statistics(self) -> Statistics:
        # Made when asked (at wrap, once the replica counts are known); the
        # GPUs' statistics get a communicator of their own.
        return Statistics(self.peers, self.failure, self._nccl_rendezvous("nccl_id_syncbn"))

    @property
    def prefix(self) -> str:
        """This link's key space in torch.distributed's store."""
        return self.peers.prefix

    # ------------------------------------------------------- construction
    def adopt_root_model(
        self, replicas: Sequence[Any], device_type: str, op: str, settings: Dict[str, Any]
    ) -> None:
        """At construction: the same model and settings on every rank (else a
        ValueError naming the first difference), then rank 0's parameters and
        buffers on every replica of every rank, as torch DDP does (its
        buffers too only with broadcast_buffers: DDP's False keeps each
        rank's own from the start, rank-local buffers)."""
        m0 = replicas[0]
        entries = [("parameter", n, p) for n, p in m0.named_parameters()]
        entries += [("buffer", n, b) for n, b in m0.named_buffers()]
        signature = [("setting", f"{k}={v!r}") for k, v in settings.items()]
        modules = [("module", n, m) for n, m in m0.named_modules()]
        signature += model_signature(entries + modules, device_type)
        self.control.check_same(signature, "model")
        self.local_counts = self.control.counts(len(replicas))
        if op == "avg" and len(set(self.local_counts)) != 1:
            raise ValueError(
                f"op='avg' across processes with {self.local_counts} replicas per process: "
                "use the same number of replicas in every process, or op='sum'"
            )
        buffers_too = settings.get("broadcast_buffers", True)
        state = [t for kind, _, t in entries if buffers_too or kind == "parameter"]
        self.control.broadcast(state, PARAMS_BROADCAST)
        with torch.no_grad():
            for m in replicas[1:]:
                mine = [p for p in m.parameters()] + [b for b in m.buffers()]
                for dst, src in zip(mine, state):
                    dst.copy_(src)

    def watch(self, record: WorkRecord) -> None:
        watch_steps(record)
        self.work = record
        record.differ_from = self._differ_from

    def gpu_reduction(self, op: str, local: int) -> Tuple[str, float, Optional[Callable]]:
        return (*nccl_op(op, self.local_counts), self._nccl_rendezvous())

    def _nccl_rendezvous(self, role: str = "nccl_id") -> Callable[[str], tuple]:
        """For make_backend: one NCCL communicator over every process's GPUs.
        Rank 0's unique id travels through torch.distributed's store (under
        `role`: one communicator per role); this process's GPUs are ranks
        first.. of the total."""
        first, total = sum(self.local_counts[: self.rank]), sum(self.local_counts)
        store, key = self.peers.store, f"{self.peers.prefix}/{role}"

        def rendezvous(nccl_path: str) -> tuple:
            if store is None:
                raise RuntimeError("NCCL across processes needs torch.distributed's store")
            if self.rank == 0:
                store.set(key, _C.nccl_unique_id(nccl_path))
            return bytes(store.get(key)), total, first

        return rendezvous

    def transport_backend(self, local: Any, on_gpu: bool) -> Any:
        if on_gpu:
            return local  # NCCL's communicator spans the processes itself
        # This process's replicas sum in C++, then the launcher hands each
        # bucket to the transport (launch holds no reference to the link).
        first = sum(self.local_counts[: self.rank])
        return process_group_backend(
            local, self.transport.launch, first, sum(self.local_counts), self.transport.wire_hot
        )

    def route_through(self, backend: Any, devices: Sequence[int], provider: Any) -> None:
        self._route = DeviceRoute(backend, devices, provider)
        self.transport.bypassed = True  # (NCCL carries the buckets: the Wire holds none)

    def set_scatter(self, ranks: int) -> None:
        # On GPUs NCCL reduce-scatters; on CPUs the transport, one replica
        # per process (zero.py refuses more), so its ranks are processes.
        self.transport.scatter = self._route is None and ranks > 0

    def spare_elements(self, dtype: torch.dtype) -> int:
        # CPU: the agreement rides in the last bucket (on GPUs it is summed
        # on the device after the buckets, never waited for); a bucket
        # reduce-scattered carries nothing else.
        if self._route is not None or self.transport.scatter:
            return 0
        return ride_size(len(self.transport.names), dtype, self.world)

    def set_buckets(
        self,
        flats: Sequence[torch.Tensor],
        buckets: Sequence[Sequence[int]],
        params: Sequence[torch.Tensor],
        views: Sequence[Any],
        wire: Optional[torch.Tensor] = None,
    ) -> None:
        rider = None
        if wire is not None and self.work is not None:
            agreement, work, weighting = self.agreement, self.work, self.weighting
            rider = lambda full, count: agreement.ride(full, count, work, weighting)  # noqa: E731
        self.transport.ride_on(wire, rider)
        # The layout's own lists: under shard='gradients' a bucket's buffer
        # is allocated at its first gradient and freed after its reduction.
        self.transport.flats = flats  # type: ignore[assignment]
        self.transport.buckets = [list(b) for b in buckets]
        self.transport.params, self.transport.views = list(params), views  # type: ignore[assignment]

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        # CPU replicas (GradSync checks once-before-the-first-backward for
        # every link, and runs GPU hooks in the NCCL backend). torch DDP's
        # default hooks take the process group as their state; None means the
        # group the buckets travel on (pyddp's own: a hook reducing on the
        # default group from pyddp's launcher thread could pair with the
        # caller's own collectives).
        self.transport.hook_state = self.transport.group if state is None else state
        self.transport.hook = hook

    def register_gpu_hook(self, state: Any, hook: Callable[..., Any], backend: Any) -> None:
        if self._route is None or not hasattr(backend, "set_hook"):
            raise NotImplementedError(
                "pyddp: a Python communication hook on GPUs runs on NCCL replicas, one GPU per "
                "process"
            )
        if len(self._route.devices) != 1:
            raise NotImplementedError(
                f"pyddp: a Python communication hook on GPUs takes one GPU per process (this "
                f"one has {len(self._route.devices)}): under torch DDP, too, a hook reduces "
                "each process's bucket; run one process per GPU under torchrun, or use a "
                "built-in hook ('fp16', 'bf16'), which pyddp's core runs on any GPUs"
            )
        self.register_comm_hook(state, hook)
        provider, device = self._route.provider, self._route.devices[0]
        # A stream of torch's (never pyddp's, which torch's allocator would
        # then hold a handle to past pyddp's close).
        stream = provider.side_stream(device)
        backend.set_hook(self.transport.on_gpu(provider, device, stream), stream)

    def root_order(self, order: Sequence[int], size: int) -> Optional[List[int]]:
        return self.control.root_order(order, size)

    # -------------------------------------------------------- per backward
    def start_agreement(
        self,
        absent: Sequence[int],
        size: int,
        record: Callable[[int], Dict[str, int]],
        shadow: bool = False,
    ) -> List[int]:
        # Every rank must launch the same buckets: a parameter without a
        # gradient here is reduced too, with zeros from here; which of them
        # have a gradient on no process at all travels in the last bucket
        # (CPU) or after the buckets.
        if self.transport.rides:
            self.agreement.expect(absent, shadow)
            if self.transport.armed and (absent or shadow):
                # Filled again (the last bucket, not launched while some
                # parameter is unsettled, has not read it yet).
                self.transport.arm()
        else:
            work = record_for(self.work, self.weighting, self.peers.iteration)
            self.agreement.start(absent, size, work, self.weighting.window.loads(), shadow)
        return list(absent)

    def _contributors(self) -> int:
        """Who adds a part to the agreement: every process (CPU) or GPU;
        under Join, those of the ranks with inputs (a joined rank's part is
        zeros)."""
        ranks = self.joining.step.active if self.joining.step is not None else range(self.world)
        if self._route is None:
            return len(ranks)
        return sum(self.local_counts[r] for r in ranks)

    def _join_divisor(self, window: Window) -> float:
        """Under Join with divide_by_initial_world_size=False: gradients
        averaged over every rank (joined ones adding zeros) are brought to
        the average over the ranks with inputs, unless a communication hook
        divides. dmodel.loss weighs the rows that exist (exact either way)."""
        joining, hooked = self.joining, self.hook[0] is not None
        if joining.step is None or not joining.divide_by_active or window.weighed or hooked:
            return joining.hook_divides(hooked and joining.step is not None)  # 1.0
        return self.world / max(1, len(joining.step.active))

    def forward_ended(self, syncing: bool) -> None:
        if syncing:
            self.compare_due()
        if syncing and self._route is None:
            self.transport.arm()

    def compare_due(self) -> None:
        # (Under torch's Join a rank that joined shadows without a forward:
        # compared after the Join.)
        if self._settings_due and self.work is not None and self.joining.step is None:
            self._settings_due = False
            self._compare_settings()

    def settings_changed(self) -> None:
        self._settings_due = True

    def note_hook(self, name: str, state: Dict[str, str], differ_from: Optional[int]) -> None:
        self.hook = (name, state)
        self._differ_from = differ_from
        if self.work is not None:
            self.work.differ_from = differ_from
        self._settings_due = True

    def _compare_settings(self) -> None:
        settings = self.control.gather_objects((self.work.shard, *self.hook), SHARD_MODES)
        ranks = self.peers.ranks
        if len({repr(s) for s, _, _ in settings}) > 1:
            shown = ", ".join(f"rank {ranks[r]} shard={s[0]!r}" for r, s in enumerate(settings))
            self.failure.fail(
                f"the ranks' optimizers shard differently ({shown}): every rank must make its "
                "optimizer with the same dmodel.optimizer(..., shard=...) (shard='gradients' "
                "reduce-scatters each bucket, which cannot pair with an all-reduce)",
                census=False,
            )
        if len({h for _, h, _ in settings}) > 1:
            hooks = [h or "none" for _, h, _ in settings]
            shown = ", ".join(f"rank {ranks[r]}: {h}" for r, h in enumerate(hooks))
            self.failure.fail(
                f"the ranks registered different communication hooks ({shown}): every rank "
                "must register the same hook (or none), or their buckets could not pair",
                census=False,
            )
        states = [st for _, _, st in settings]
        differ = sorted({k for st in states for k in st if len({s.get(k) for s in states}) > 1})
        if differ:
            shown = "; ".join(
                f"rank {ranks[r]}: " + ", ".join(f"{k}={st.get(k, 'unset')}" for k in differ)
                for r, st in enumerate(states)
            )
            self.failure.fail(
                f"the ranks registered the communication hook {settings[0][1]} with different "
                f"states ({shown}): every rank must give it the same settings (what a "
                "bucket sends depends on them: PowerSGD's rank or start step, differing, "
                "makes all-reduces that cannot pair)",
                census=False,
            )

    def wait(self) -> Tuple[List[int], List[int], Any]:
        window = self.weighting.take_window()
        if self._route is None:
            # CPU: the agreement rode in the last bucket, or follows the
            # buckets on the data group. While they are on the wire: the
            # next synced backward's parameter checksum, if it takes one.
            transport = self.transport
            if not transport.rides:
                transport.launch_tail(self.agreement.part)
            self.work.ahead(self.peers.iteration + 1)
            launched = transport.wait()
            if transport.rides:
                summed = self.agreement.landed(transport.wire, transport.flats[-1].numel())
            else:
                summed = self.agreement.part
            where = f"synced backward {self.peers.iteration}"
            sums = self.agreement.read(summed, self._contributors(), where)
            self.work.synced()  # (a riding record was peeked)
            self._just_agreed = True  # (broadcast)
            factor = self.weighting.cpu_factor(window, sums, self.failure.fail)
            return launched, sums.unused, factor * self._join_divisor(window)
        # GPUs: through the NCCL communicator, after the buckets; nothing for
        # the transport to wait for (this counts the iteration).
        launched = self.transport.wait()
        where = f"synced backward {self.peers.iteration}"
        contributors = self._contributors()
        parts = self._route.reduce(self.agreement.part, self.agreement.rows_slot)
        fetch = self._route.fetch(parts)
        self.agreement.poll()
        unused: List[int] = []
        if self.agreement.missing_here:
            # Only a rank without some gradient can find one nobody has: it
            # waits for the sums (as torch DDP's find_unused_parameters does).
            unused = self.agreement.read(fetch.get(), contributors, where).unused
        else:
            self.agreement.defer(fetch, contributors)
        factor: Any = self._join_divisor(window)
        agreed = self.weighting.agreed
        if window.assumed and agreed is not None:
            # On the device: the host does not know the global rows.
            factor = self._route.factors(parts, self.agreement.rows_slot, agreed[0])
        return launched, unused, factor

    def settle(self) -> None:
        if self._route is not None:
            self.agreement.poll(drain=True)

    def merge_timing(self, raw: Dict[str, int], timeline: Any, finish_called_ns: int) -> None:
        # The engine saw its launches return; the reductions ended when
        # torch.distributed's futures completed, after finish() waited.
        done, transport = self.transport.done_ns_last, self.transport
        if done:
            raw["last_done_ns"] = max(raw["last_done_ns"], max(done.values()))
            if timeline is not None:
                for b, t in done.items():
                    timeline["bucket_done_ns"][b] = t
        # The engine's clock is the steady clock: time.monotonic_ns here.
        raw["finish_start_ns"] = min(raw["finish_start_ns"], finish_called_ns)
        raw["wait_ns"] += transport.wait_ns
        # finish() ended once its wait for the reductions did, after each one's
        # done stamp (a probe: the engine's end plus the wait fell before some).
        raw["finish_end_ns"] = max(raw["finish_end_ns"] + transport.wait_ns, transport.wait_end_ns)
        raw["agree_ns"] = self.agreement.exposed_ns

    def check_usable(self) -> None:
        self.failure.check()

    def abandon(self, reason: str) -> None:
        self.failure.abandon(reason)

    def abandon_unfinished(self) -> None:
        self.failure.abandon("a backward did not finish (it raised?)")
        raise ProcessGroupError(self.failure.failed)

    # ------------------------------------------- for the model and trainer
    def weigh_losses(
        self,
        losses: List[torch.Tensor],
        rows: int,
        reduction: str,
        synced: bool,
        carried: bool,
        known: Optional[int] = None,
    ) -> List[torch.Tensor]:
        # A communication hook sees the weighted buckets: a rescale after it
        # (assumed rows) would miss its state (PowerSGD's error feedback).
        hooked = self.hook[0] is not None  # (any: GPU built-ins never reach the transport)
        return self.weighting.weigh(
            losses,
            rows,
            reduction,
            synced,
            carried or hooked,
            known,
            self.joining.step,
            self._route is None,
            lambda values: self.control.sum_over_ranks(values, LOSS_WEIGHTS),
        )

    def broadcast(self, tensors: Sequence[torch.Tensor], what: str) -> None:
        # Under Join, rank 0 may have joined: the highest rank with inputs.
        from_source = what in (BUFFERS_BROADCAST, JOIN_GRADIENTS)
        root = self.joining.step.source if self.joining.step is not None and from_source else 0
        if self._route is not None and from_source:
            # GPUs, after every synced training step: on the device, through
            # NCCL, as torch DDP does (no host round trip).
            # The NCCL root: the root process's first GPU.
            self._route.broadcast(tensors, sum(self.local_counts[:root]))
            return
        # Right after a synced backward whose agreement every rank passed
        # (outside Join), every rank is at this broadcast: the agreement
        # was its header, and it goes as one message.
        agreed, self._just_agreed = self._just_agreed, False
        header = not (agreed and what == BUFFERS_BROADCAST and self.joining.step is None)
        self.control.broadcast(tensors, what, root, header)

    def hook_error(self) -> Optional[BaseException]:
        return self.transport.hook_error


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
