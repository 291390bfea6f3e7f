"""Control exchanges of the link: small blocking messages on a gloo group
of their own (the model check and broadcast at wrap, sums and values from
rank 0 for the Trainer, rank 0's bucket plan), never interleaved with
bucket reductions still in flight.

`Ranks` is the face of these exchanges for the optimizers, the Trainer,
its checkpoints and evaluation (`dmodel.ranks`, `pyddp.Ranks`).

Every exchange is preceded by a header (its name's tag, its place in the
group's sequence and the wrapped model), compared on every rank: two ranks
at different exchanges raise, naming both, instead of pairing (an
evaluation's sums with a training step's weighting) or crashing gloo on
different sizes. Names are declared at import with `exchange`, so a rank
can name an exchange it never made itself."""

from __future__ import annotations

import itertools
import pickle
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .failure import Failure
from .groups import Peers, allreduce, broadcast, own_group

_TAGS: Dict[int, str] = {}
_sequence: Dict[Tuple[int, ...], int] = {}  # per control group (its ranks)


def tag(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def exchange(name: str) -> str:
    """Declares the name of a control exchange (at import time)."""
    _TAGS[tag(name)] = name
    return name


MODEL_CHECK = exchange("the comparison of models and settings at wrap")
REPLICA_COUNTS = exchange("the exchange of replica counts")
PARAMS_BROADCAST = exchange("the broadcast of rank 0's parameters and buffers")
BUFFERS_BROADCAST = exchange("the broadcast of rank 0's buffers before a training forward")
PLAN_BROADCAST = exchange("the bucket plan broadcast")
LOSS_WEIGHTS = exchange("the loss weighting of a training step")
SHARD_MODES = exchange(
    "the comparison of shard modes and communication hooks before a first synced backward "
    "(each rank's dmodel.optimizer(..., shard=...) and register_comm_hook)"
)


class Control:
    """Blocking exchanges over the peers, one at a time on the caller's
    thread: one control group per set of ranks is enough."""

    def __init__(self, peers: Peers, failure: Failure):
        self.peers = peers
        self.failure = failure
        self.group = own_group(peers, "control")

    # ------------------------------------------------------------- headers
    def same_exchange(self, what: str, where: Optional[str] = None) -> None:
        """Every rank must be at the same control exchange: compares each
        rank's (tag, sequence number, wrapped model) first, in a fixed-size
        all-gather."""
        self.failure.check()  # nothing more goes on the group
        self.check_header(what, self.start_header(what), where)

    def start_header(self, what: str) -> tuple:
        """Enqueues the header all-gather; check_header waits for it."""
        key = tuple(self.peers.ranks)
        seq = _sequence.get(key, 0) + 1
        _sequence[key] = seq
        # The model too: two wrapped models' exchanges of the same kind (a GAN's
        # generator and discriminator) must not pair.
        mine = torch.tensor([tag(what), seq, self.peers.id], dtype=torch.int64)
        outs = [torch.zeros(3, dtype=torch.int64) for _ in range(self.peers.world)]
        return self.group.allgather([outs], [mine]), mine, outs

    def check_header(self, what: str, header: tuple, where: Optional[str] = None) -> None:
        work, mine, outs = header
        self.failure.call(what, self.failure.wait, work, what)
        if all(torch.equal(o, mine) for o in outs):
            return
        sides = "; ".join(
            f"rank {self.peers.ranks[r]} at exchange {int(o[1])}, "
            + _TAGS.get(int(o[0]), f"an exchange unknown here (tag {int(o[0])})")
            + f" of wrapped model #{int(o[2])}"
            for r, o in enumerate(outs)
        )
        self.failure.fail(
            f"the ranks are not at the same exchange ({sides}); every rank must make the same "
            "pyddp calls in the same order (an evaluation, a fit or a wrap on some ranks only "
            "pairs with another exchange on the others)",
            census=False,
            where=where,
        )

    # ----------------------------------------------------------- exchanges
    def check_same(self, signature: List[tuple], what: str) -> None:
        """Refuses, on every rank, models or settings that differ across
        ranks, naming the first differing entry and the rank."""
        out = self.gather_objects(signature, MODEL_CHECK)
        ref, ranks = out[0], self.peers.ranks
        for r, sig in enumerate(out[1:], start=1):
            if sig == ref:
                continue
            for i, (a, b) in enumerate(itertools.zip_longest(ref, sig)):
                if a == b:
                    continue
                if "setting" in (a or ("",))[:1] + (b or ("",))[:1]:
                    raise ValueError(
                        f"pyddp: the wrap settings differ across processes: rank "
                        f"{ranks[r]} has {_entry(b)} where rank {ranks[0]} has "
                        f"{_entry(a)}; every process must wrap with the same settings"
                    )
                raise ValueError(
                    f"pyddp: the {what} differs across processes: rank {ranks[r]} has "
                    f"{_entry(b)} where rank {ranks[0]} has {_entry(a)} (entry {i}); every "
                    "process must wrap the same model"
                )

    def broadcast(
        self, tensors: Sequence[torch.Tensor], what: str, root: int = 0, header: bool = True
    ) -> None:
        """Overwrites `tensors` with rank `root`'s values (the group's rank 0
        unless said): CPU tensors as one message of their bytes, whatever
        their dtypes, others one message per dtype and device; nothing to
        send (a model without buffers) sends nothing (the model check made
        the tensors the same on every rank). `header` False: the caller
        knows every rank is at this exchange (see ProcessLink.broadcast)."""
        live = [t for t in tensors if t.numel()]
        if not live:
            return
        if header:
            self.same_exchange(what)
        else:
            self.failure.check()
        with torch.no_grad():
            if all(t.device.type == "cpu" for t in live):
                flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in live])
                self.failure.call(what, broadcast, self.group, flat, root)
                offset = 0
                for t in live:
                    n = t.numel() * t.element_size()
                    got = flat[offset : offset + n]
                    if t.is_contiguous():  # bytes into bytes: no alignment needed
                        t.view(-1).view(torch.uint8).copy_(got)
                    else:  # realigned first, then by value
                        t.copy_(got.clone().view(t.dtype).view(t.shape))
                    offset += n
                return
            by_kind: Dict[tuple, List[torch.Tensor]] = {}
            for t in live:
                by_kind.setdefault((t.dtype, t.device), []).append(t)
            for group in by_kind.values():
                flat = _flatten_dense_tensors([t.detach() for t in group])
                self.failure.call(what, broadcast, self.group, flat, root)
                for t, v in zip(group, _unflatten_dense_tensors(flat, group)):
                    t.copy_(v)

    def from_root(self, obj: Any, what: str, root: int = 0) -> Any:
        """Rank `root`'s `obj` on every rank (the group's rank 0 unless
        said; pickled through gloo)."""
        self.same_exchange(what)
        sends = self.peers.rank == root
        data = pickle.dumps(obj) if sends else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.failure.call(what, broadcast, self.group, size, root)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8)
        if sends:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.failure.call(what, broadcast, self.group, buf, root)
        return obj if sends else pickle.loads(buf.numpy().tobytes())

    def gather_objects(self, obj: Any, what: str) -> List[Any]:
        """Every rank's `obj`, in group rank order (pickled through gloo);
        `what` names the exchange (declared with `exchange`)."""
        self.same_exchange(what)
        world = self.peers.world
        data = pickle.dumps(obj)
        sizes = torch.zeros(world, dtype=torch.int64)
        sizes[self.peers.rank] = len(data)
        self.failure.call(what, self._sum, sizes)
        width = int(sizes.max().item())
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.zeros(width, dtype=torch.uint8) for _ in range(world)]
        self.failure.call(what, lambda: self.group.allgather([outs], [mine]).wait())
        return [pickle.loads(o[: int(n)].numpy().tobytes()) for o, n in zip(outs, sizes.tolist())]

    def gather_tensor(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's `t` (CPU, the same size and dtype everywhere: the
        header checks the exchange, not the sizes) end to end in group rank
        order, as bytes through gloo's all-gather: bit for bit, any dtype."""
        self.same_exchange(what)
        mine = t.detach().contiguous().reshape(-1).view(torch.uint8)
        outs = [torch.empty_like(mine) for _ in range(self.peers.world)]
        self.failure.call(what, lambda: self.group.allgather([outs], [mine]).wait())
        return torch.cat(outs).view(t.dtype)

    def sum_over_ranks(self, values: Sequence[float], what: str) -> List[float]:
        """Element-wise sums over ranks (float64); `what` names the exchange
        (declared with `exchange`)."""
        self.same_exchange(what)
        t = torch.tensor(list(values), dtype=torch.float64)
        self.failure.call(what, self._sum, t)
        return t.tolist()

    def counts(self, local: int) -> List[int]:
        """Every rank's number of replicas (they may differ)."""
        counts = torch.zeros(self.peers.world, dtype=torch.int64)
        counts[self.peers.rank] = local
        self.same_exchange(REPLICA_COUNTS)
        self.failure.call(REPLICA_COUNTS, self._sum, counts)
        return counts.tolist()

    def root_order(self, order: Sequence[int], size: int) -> Optional[List[int]]:
        """Rank 0's ready order, so every rank plans the same buckets (None if
        rank 0 saw an incomplete order and nobody should rebuild)."""
        t = torch.full((size + 1,), -1, dtype=torch.int64)
        if len(order) == size:
            t[0] = size
            t[1:] = torch.tensor(list(order), dtype=torch.int64)
        self.same_exchange(PLAN_BROADCAST)
        self.failure.call(PLAN_BROADCAST, broadcast, self.group, t)
        return None if t[0].item() != size else t[1:].tolist()

    def _sum(self, t: torch.Tensor) -> None:
        allreduce(self.group, t).wait()


def _entry(e: Any) -> str:
    if e is None:
        return "nothing (fewer entries)"
    return " ".join(str(x) for x in e)


class Ranks:
    """The processes a wrapped model spans, as the Trainer, its checkpoints,
    evaluation and the sharded optimizers see them: where this process is,
    and the small exchanges they make (sums, rank `root`'s value, everyone's
    values). Every exchange is collective (every rank calls it, in the same
    order) and named (`what`, an exchange name from `exchange`), so a rank
    that calls another one fails naming both. One process: every answer is
    this process's own. `pyddp.Ranks`; `dmodel.ranks` gives one."""

    def __init__(self, link: Any):
        self._link = link  # a Link: its rank, world, replica counts and Control

    @property
    def rank(self) -> int:
        """This process's index among the ranks (0 in one process)."""
        return self._link.rank

    @property
    def world(self) -> int:
        """How many processes."""
        return self._link.world

    @property
    def replicas_per_rank(self) -> List[int]:
        """Each rank's number of replicas, in rank order."""
        return list(self._link.local_counts)

    @property
    def spans_processes(self) -> bool:
        return self._link.spans_processes

    @property
    def global_ranks(self) -> List[int]:
        """Each rank's global rank (torch.distributed's), for messages."""
        return list(self._link.peers.ranks) if self.spans_processes else [0]

    def leave_note(self, why: Optional[str]) -> None:
        """Across processes, `why` this rank leaves the run here (a callback
        raised on it): a rank that then times out waiting for it names it
        rather than "died, stalled". None takes it back. Not an exchange."""
        if self.spans_processes:
            self._link.failure.note(why)

    def sum(self, values: Sequence[float], what: str) -> List[float]:
        """Element-wise sums of `values` over the ranks."""
        control = self._link.control
        return (
            [float(v) for v in values] if control is None else control.sum_over_ranks(values, what)
        )

    def from_root(self, obj: Any, what: str, root: int = 0) -> Any:
        """Rank `root`'s `obj` (picklable) on every rank."""
        control = self._link.control
        return obj if control is None else control.from_root(obj, what, root)

    def gather(self, obj: Any, what: str) -> List[Any]:
        """Every rank's `obj` (picklable), in rank order."""
        control = self._link.control
        return [obj] if control is None else control.gather_objects(obj, what)

    def gather_tensor(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's `t` (a CPU tensor of the same size and dtype on
        every rank), end to end in rank order, bit for bit."""
        control = self._link.control
        return t if control is None else control.gather_tensor(t, what)


def model_signature(entries: Sequence[tuple], device_type: str) -> List[tuple]:
    """What must match across ranks: every parameter's and buffer's name, shape
    and dtype, whether a parameter is trained (reduced) or frozen (else buckets
    of other sizes), a parameter's memory format (channels_last: its
    gradient's elements in another order), every module's class
    (SyncBatchNorm on one rank only waited the timeout, naming a stats
    group), and the kind of device."""
    sig: List[tuple] = [("device type", device_type)]
    for kind, name, t in entries:
        if kind == "module":
            sig.append((kind, repr(name or "(the model)"), "of class", type(t).__qualname__))
            continue
        entry = (kind, name, tuple(t.shape), str(t.dtype).replace("torch.", ""))
        if kind == "parameter":
            entry += ("trained" if t.requires_grad else "frozen",)
            if not t.is_contiguous():  # (its gradient's bucket view is laid out alike)
                entry += ("strides", tuple(t.stride()))
        sig.append(entry)
    return sig
