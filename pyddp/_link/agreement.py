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

On CPU the host reads the sums after waiting for the buckets, as before. On
GPUs the sums stay on the device: a rank that holds a gradient for every
parameter cannot find one nobody holds (the common case), so it reads them
later, when their copy to the host is done (polled, never waited for); only
a rank missing some gradient waits for them at the end of backward (torch
DDP's find_unused_parameters waits there too)."""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from .control import Control

_BYTES = 8  # per record value (int64)
LOADS = 4  # rows, loss x rows, rows changed, rows varied within the backward


@dataclass
class Sums:
    """The agreement's sums over every contributor, read on the host."""

    unused: List[int]  # parameters with a gradient on no process
    rows: float  # rows weighed without an exchange, over every rank
    loss_rows: float  # loss x rows (CPU replicas), summed likewise
    changed: float  # ranks whose rows changed since the last exchange
    varied: float  # ranks that weighed different rows within this backward


def encode(
    has_grad: Sequence[bool], loads: Sequence[float], record: Dict[str, int]
) -> torch.Tensor:
    """One contributor's part, float64 (see the module's docstring); `loads`:
    rows, loss x rows, rows changed."""
    values = torch.tensor([int(v) for v in record.values()], dtype=torch.int64)
    raw = values.view(torch.uint8).to(torch.float64)
    flags = torch.tensor([1.0 if h else 0.0 for h in has_grad], dtype=torch.float64)
    loads = torch.tensor([float(v) for v in loads], dtype=torch.float64)
    return torch.cat([flags, loads, raw, raw * raw])


def differing(summed: torch.Tensor, size: int, fields: Sequence[str], n: int) -> List[str]:
    """The record's fields whose bytes differ between contributors."""
    raw = summed[size + LOADS :]
    k = len(fields) * _BYTES
    s1, s2 = raw[:k], raw[k:]
    bad = (s2 * n != s1 * s1).view(len(fields), _BYTES).any(dim=1)
    return [f for f, b in zip(fields, bad.tolist()) if b]


class Agreement:
    def __init__(self, control: Control):
        self.control = control
        self.peers, self.failure = control.peers, control.failure
        self.exposed_ns = 0  # the last one's exposed time (encoding, and waiting once done)
        self.part: Optional[torch.Tensor] = None  # this synced backward's, to reduce
        self._size = 0
        self._absent: List[int] = []
        self._record: Dict[str, int] = {}
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
        """This rank's part for the synced backward now ending; reduced by
        the link after the buckets. `shadow`: a rank that joined (torch's
        Join) takes part with zeros: no gradient, no rows, no record (the
        ranks with inputs compare theirs among themselves)."""
        self.failure.check()
        t0 = time.perf_counter_ns()
        gone = set(absent)
        self.part = encode([i not in gone for i in range(size)], loads, record)
        if shadow:
            self.part.zero_()
        self._size, self._absent, self._record = size, list(absent), dict(record)
        self.exposed_ns = time.perf_counter_ns() - t0

    def read(self, summed: torch.Tensor, contributors: int, where: str) -> Sums:
        """The sums (on the host), checked: raises on every rank, naming the
        fields that differ and every rank's values, if the records differ."""
        t0 = time.perf_counter_ns()
        self._check(summed, self._record, contributors, where)
        size = self._size
        unused = [i for i in self._absent if summed[i].item() == 0.0]
        sums = Sums(unused, *(float(summed[size + k]) for k in range(LOADS)))
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
            self._check(fetch.get(), record, contributors, f"synced backward {iteration}")

    # ------------------------------------------------------- disagreement
    def _check(self, summed: torch.Tensor, record: Dict[str, int], n: int, where: str) -> None:
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
            "dmodel.loss the others did not, or changed its parameters outside pyddp; its "
            "replicas would differ for the rest of the run",
            census=False,
            where=where,
        )
