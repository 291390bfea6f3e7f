"""The per-backward agreement of the link, carried with the bucket
reductions instead of a separate exchange: at each synced backward one more
small reduction follows the last bucket on the same route (the link's gloo
data group on CPU, the NCCL communicator on GPUs), so it needs no header,
no control group and no host round trip of its own. It carries, as float64
summed over every contributor (a process on CPU, a GPU on GPUs):

- which parameters hold a gradient here (1.0 or 0.0): a parameter nobody
  holds one for goes back to None;
- the rows this rank weighed its loss with (`dmodel.loss` without an
  exchange), its loss times rows (CPU), 1.0 if those rows differ from the
  rows it had when the ranks last exchanged them, 1.0 if it weighed
  several losses of different rows in this backward: the global batch's
  size and loss, so `dmodel.loss` needs no exchange per step (see
  ProcessLink.weigh_losses);
- the record of the work each rank did (optimizer steps, micro-batches,
  train/eval, a parameter checksum; record.py), each value as its 8 bytes
  and their squares: with N contributors the sums satisfy N * sum(b^2) ==
  sum(b)^2 for every byte exactly when every rank sent the same bytes, and
  every rank sees the same sums, so ranks that drifted apart all raise
  instead of averaging different iterations' gradients together.

On CPU the parts ride in the last bucket's all-reduce (Agreement.ride):
replica 0's last bucket is allocated with room for them after it, and
they are final when it launches (every parameter is then ready, or
settled in finish() as absent), so they need no round trip of their own;
the host reads the sums after waiting for the buckets. In a float32
bucket every value stays exact (bytes, squares and flags are small
integers; the rows travel as two parts), except loss x rows, summed in
float32 (the global batch's loss, as precise as the float32 loss itself).
A comm hook, a 16-bit last bucket or more than 256 processes (float32 sums
of squared bytes) send them as their own reduction after the buckets. On
GPUs the sums stay on the device: a rank that holds a gradient for every
parameter cannot find one nobody holds (the common case), so it reads them
later, when their copy to the host is done (polled, never waited for); only
a rank missing some gradient waits for them at the end of backward (torch
DDP's find_unused_parameters waits there too)."""

from __future__ import annotations

import collections
import json
import math
import struct
import time
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from .control import Control
from .record import WorkRecord
from .weighting import Weighting

_BYTES = 8  # per record value (int64)
LOADS = 4  # rows, loss x rows, rows changed, rows varied within the backward
WEIGHED = "losses weighed by dmodel.loss without an exchange"
RECORD_SLOTS = 8  # record fields a part riding in a bucket has room for
_ROWS_SPLIT = 4096.0  # riding, the rows travel as rows // this and the rest
_RIDE_EXTRA = LOADS + 1 + 2 * _BYTES * RECORD_SLOTS  # a riding part beyond its flags


@dataclass
class Sums:
    """The agreement's sums over every contributor, read on the host."""

    unused: List[int]  # parameters with a gradient on no process
    rows: float  # rows weighed without an exchange, over every rank
    loss_rows: float  # loss x rows (CPU replicas), summed likewise
    changed: float  # ranks whose rows changed since the last exchange
    varied: float  # ranks that weighed different rows within this backward


def encode(
    absent: Sequence[int], size: int, loads: Sequence[float], record: Dict[str, int]
) -> List[float]:
    """One contributor's part (see the module's docstring): the flags of
    `size` parameters (0.0 for `absent`), `loads` (rows, loss x rows, rows
    changed, rows varied), the record's bytes and their squares. Python
    floats: a few hundred values, built and read where the caches are cold
    (the end of a forward, after the wait for gloo), where list work costs
    less than numpy's or torch's per-call dispatch (measured: numpy's
    vectorised check took 17 us there against 9 for this)."""
    raw = struct.pack(f"<{len(record)}q", *map(int, record.values()))
    flags = [1.0] * size
    for i in absent:
        flags[i] = 0.0
    return flags + [float(v) for v in loads] + [float(b) for b in raw] + [float(b * b) for b in raw]


def record_for(
    work: WorkRecord, weighting: Weighting, iteration: int, peek: bool = False
) -> Dict[str, int]:
    """The record compared at synced backward `iteration` + 1, with the
    weighings dmodel.loss made on assumed rows; taken (the next starts)
    unless `peek` (the link calls work.synced() once the sums are read)."""
    record = work.peek(iteration) if peek else work.take(iteration)
    record[WEIGHED] = weighting.window.assumed
    return record


def ride_size(params: int, dtype: torch.dtype, contributors: int) -> int:
    """The elements a part riding in a bucket of `dtype` takes, or 0 where
    its sums would not be exact (see the module's docstring)."""
    if dtype == torch.float32 and contributors * 255 * 255 < 2**24:
        pass
    elif dtype != torch.float64:
        return 0
    return params + _RIDE_EXTRA


def to_ride(part: List[float], params: int) -> List[float]:
    """A part (encode's layout) as it rides: the rows split in two, the
    record padded with zero bytes to RECORD_SLOTS fields."""
    raw = part[params + LOADS :]
    k = len(raw) // 2
    if k > RECORD_SLOTS * _BYTES:
        raise RuntimeError(f"pyddp: the record has {k // _BYTES} fields, room for {RECORD_SLOTS}")
    pad = [0.0] * (RECORD_SLOTS * _BYTES - k)
    rows = part[params]
    hi = float(math.floor(rows / _ROWS_SPLIT))
    loads = [hi, rows - hi * _ROWS_SPLIT] + part[params + 1 : params + LOADS]
    return part[:params] + loads + raw[:k] + pad + raw[k:] + pad


def from_ride(w: List[float], params: int, fields: int) -> List[float]:
    """The sums of riding parts (the room after the last bucket, as a
    list), back in encode's layout."""
    k, room = fields * _BYTES, RECORD_SLOTS * _BYTES
    raw = w[params + LOADS + 1 :]
    rows = w[params] * _ROWS_SPLIT + w[params + 1]
    return w[:params] + [rows] + w[params + 2 : params + LOADS + 1] + raw[:k] + raw[room : room + k]


def differing(summed: List[float], size: int, fields: Sequence[str], n: int) -> List[str]:
    """The record's fields whose bytes differ between contributors: N times
    the sum of squares equals the square of the sum for each byte exactly
    when every contributor sent the same byte (float64: exact here)."""
    k = len(fields) * _BYTES
    raw = summed[size + LOADS :]
    bad = {i // _BYTES for i in range(k) if raw[k + i] * n != raw[i] * raw[i]}
    return [f for j, f in enumerate(fields) if j in bad]


class Agreement:
    def __init__(self, control: Control):
        self.control = control
        self.peers, self.failure = control.peers, control.failure
        self.exposed_ns = 0  # the last one's exposed time (encoding, and waiting once done)
        self.part: Optional[torch.Tensor] = None  # this synced backward's, to reduce
        self._size = 0
        self._absent: List[int] = []
        self._record: Dict[str, int] = {}
        # Riding in the last bucket (CPU): the parameters with no gradient
        # here and whether this rank shadows, final once it launches.
        self._absent_next: List[int] = []
        self._shadow_next = False
        # GPUs: sums on their way to the host, read when there:
        # (fetch, record, iteration, contributors).
        self._deferred: Deque[Tuple[Any, Dict[str, int], int, int]] = collections.deque()

    def start(
        self,
        absent: Sequence[int],
        size: int,
        record: Dict[str, int],
        loads: Sequence[float] = (0.0,) * LOADS,
        shadow: bool = False,
    ) -> None:
        """This rank's part for the synced backward now ending (self.part),
        reduced by the link after the buckets. `shadow`: a rank that joined
        (torch's Join) takes part with zeros: no gradient, no rows, no
        record (the ranks with inputs compare theirs among themselves)."""
        t0 = time.perf_counter_ns()
        self.part = torch.tensor(
            self._encode(absent, size, record, loads, shadow), dtype=torch.float64
        )
        self.exposed_ns = time.perf_counter_ns() - t0

    def _encode(
        self,
        absent: Sequence[int],
        size: int,
        record: Dict[str, int],
        loads: Sequence[float],
        shadow: bool,
    ) -> List[float]:
        self.failure.check()
        part = encode(absent, size, loads, record)
        self._size, self._absent, self._record = size, list(absent), dict(record)
        return [0.0] * len(part) if shadow else part

    # -------------------------------------------- CPU: in the last bucket
    def expect(self, absent: Sequence[int], shadow: bool) -> None:
        """At the end of a synced backward whose part rides in its last
        bucket: what ride() encodes, should that bucket launch after this
        (in steady state it launched during backward: nothing was absent)."""
        self._absent_next, self._shadow_next = list(absent), shadow

    def ride(self, wire: torch.Tensor, count: int, work: WorkRecord, weighting: Weighting) -> None:
        """This rank's part into the room after the last bucket (wire[:count]):
        on the caller's thread at the end of a synced forward (transport.arm,
        so the launch only sends it), or else on the engine's launcher thread
        as that bucket launches (the main thread is then past every hook and
        waits in the engine's finish for this launch: nothing read here
        changes meanwhile). The record is peeked; the link starts the next
        (work.synced()) once the sums are read."""
        t0 = time.perf_counter_ns()
        size = wire.numel() - count - _RIDE_EXTRA
        record = record_for(work, weighting, self.peers.iteration, peek=True)
        loads = weighting.window.loads()
        part = self._encode(self._absent_next, size, record, loads, self._shadow_next)
        values = to_ride(part, size)
        # One write through a numpy view: timed in a loop, a third of
        # torch.tensor of the list and a copy_.
        wire.narrow(0, count, len(values)).numpy()[:] = values
        self.exposed_ns = time.perf_counter_ns() - t0

    def landed(self, wire: torch.Tensor, count: int) -> List[float]:
        """After the wait: the riding parts' sums, in encode's layout; the
        next synced backward's defaults."""
        self._absent_next, self._shadow_next = [], False
        return from_ride(wire[count:].tolist(), self._size, len(self._record))

    def read(self, summed: Any, contributors: int, where: str) -> Sums:
        """The sums (a tensor on the host, or their list), checked: raises on
        every rank, naming the fields that differ and every rank's values,
        if the records differ."""
        t0 = time.perf_counter_ns()
        if isinstance(summed, torch.Tensor):
            summed = summed.tolist()
        self._check(summed, self._record, contributors, where)
        size = self._size
        unused = [i for i in self._absent if summed[i] == 0.0]
        sums = Sums(unused, *summed[size : size + LOADS])
        self.exposed_ns += time.perf_counter_ns() - t0
        return sums

    @property
    def missing_here(self) -> bool:
        """Whether this rank holds no gradient for some parameter."""
        return bool(self._absent)

    @property
    def rows_slot(self) -> int:
        """Where the rows are in a part (the device-side factor reads them)."""
        return self._size

    # ------------------------------------------------------------ GPUs
    def defer(self, fetch: Any, contributors: int) -> None:
        """The sums of this synced backward are on their way to the host:
        checked once there (poll), never waited for in steady state."""
        self._deferred.append((fetch, self._record, self.peers.iteration, contributors))

    def poll(self, drain: bool = False) -> None:
        """Checks the deferred sums that reached the host. With three unread
        (the host far ahead of its GPUs), or `drain`: waits for the oldest."""
        while self._deferred:
            fetch, record, iteration, contributors = self._deferred[0]
            if not (fetch.ready() or drain or len(self._deferred) > 2):
                return
            self._deferred.popleft()
            sums = fetch.get().tolist()
            self._check(sums, record, contributors, f"synced backward {iteration}")

    # ------------------------------------------------------- disagreement
    def _check(self, summed: List[float], record: Dict[str, int], n: int, where: str) -> None:
        fields = list(record)
        bad = differing(summed, self._size, fields, n)
        if bad:
            self._disagreement(record, bad, where)

    def _disagreement(self, record: Dict[str, int], bad: List[str], where: str) -> None:
        """The ranks' records differ (every rank sees it in the same sums):
        each leaves its record in the store and reads the others' (with a
        deadline), then every rank raises, naming each field with every
        rank's value."""
        peers = self.peers
        posted = self.failure.gather_notes(f"records/{where}", json.dumps(record))
        values = {r: json.loads(v) for r, v in posted.items()}
        lines = []
        for field in bad:
            shown = ", ".join(
                f"rank {peers.ranks[r]} {values[r].get(field)!r}"
                if r in values
                else f"rank {peers.ranks[r]} ?"
                for r in range(peers.world)
            )
            lines.append(f"{field}: {shown}")
        self.failure.fail(
            "the ranks did different work before this synced backward ("
            + "; ".join(lines)
            + "): one rank stepped its optimizer more often, ran a micro-batch under no_sync() "
            "the others did not, switched model.train()/eval() alone, weighed a loss with "
            "dmodel.loss the others did not, changed its parameters outside pyddp (nn.Embedding's "
            "max_norm does so in its forward, on the rows each rank looks up), or steps "
            "with other optimizer settings (another class or shard mode, a learning rate a "
            "scheduler changed on one rank only, an optimizer state dict loaded on one rank "
            "only: load it on every rank); its replicas would differ for the rest of "
            "the run",
            census=False,
            where=where,
        )
