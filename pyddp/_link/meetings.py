"""SyncBatchNorm's statistics across processes. Each meeting (one layer's
sums in a forward or a backward) travels on a gloo group of its own, after a
fixed-size header every rank compares, as the control exchanges do: its
place in this model's sequence of meetings, what it is (a forward with grad,
one without, a backward), its size and the wrapped model. A forward on some
ranks only (a logging forward in training mode on rank 0) then raises on
every rank naming each rank's meeting, instead of summing its statistics
into another rank's step, or gloo aborting the process on different sizes.

`Statistics` is what the wrapped model asks of the link for its
SyncBatchNorm layers: the summer of CPU statistics across processes (these
meetings) and, on GPUs, a backend of the statistics' own."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import torch

from ..runtime.libraries import make_backend
from .failure import Failure
from .groups import Peers, allreduce, own_group


class Statistics:
    """SyncBatchNorm's statistics on the link: across processes `peers`
    and `failure` make the CPU meetings, `rendezvous` the GPUs'
    communicator; one process has neither."""

    def __init__(
        self,
        peers: Optional[Peers] = None,
        failure: Optional[Failure] = None,
        rendezvous: Optional[Callable[[str], tuple]] = None,
    ):
        self.peers, self.failure, self.rendezvous = peers, failure, rendezvous

    def summer(self) -> Optional[Callable[[torch.Tensor, str], None]]:
        """A function that sums a CPU tensor over the processes in place,
        given "forward", "forward without grad" or "backward" (None in one
        process: nothing to sum). Made at wrap, on every rank."""
        if self.peers is None or self.failure is None:
            return None
        return Meetings(self.peers, self.failure)

    def backend(self, devices: Sequence[int], timeout: Optional[float]) -> Any:
        """For GPUs: a backend whose collectives span every GPU of every
        process, apart from the buckets' (its own communicator: the sums
        are launched from the replicas' threads mid-forward and
        mid-backward while the launcher launches buckets; on one
        communicator the two orders could differ between processes). One
        process: communicators whose launches each cover every GPU of the
        process under one lock, so any interleaving pairs."""
        return make_backend(list(devices), timeout, self.rendezvous)


_KINDS: Dict[int, str] = {1: "a forward with grad", 2: "a forward without grad", 3: "a backward"}


class Meetings:
    def __init__(self, peers: Peers, failure: Failure):
        # Made at wrap, on every rank: the statistics are summed mid-forward
        # and mid-backward, while buckets are in flight on the data group
        # and the agreement on the control one.
        self.peers, self.failure = peers, failure
        self.group = own_group(peers, "stats")
        self.sequence = 0

    def __call__(self, t: torch.Tensor, what: str) -> None:
        """Sums `t` over the ranks in place; `what`: "forward", "forward
        without grad" or "backward". Called from one thread per process, in
        the layers' order."""
        self.failure.check_abandoned()
        self.sequence += 1
        kind = {"forward": 1, "forward without grad": 2, "backward": 3}[what]
        mine = torch.tensor([self.sequence, kind, t.numel(), self.peers.id], dtype=torch.int64)
        outs = [torch.zeros(4, dtype=torch.int64) for _ in range(self.peers.world)]
        header = "the header of a SyncBatchNorm exchange"
        # Named on failure (failure.call): a rank that died or stopped here
        # is named, not gloo's "Connection reset" or its timeout.
        work = self.group.allgather([outs], [mine])
        self.failure.call(header, self.failure.wait, work, header)
        if not all(torch.equal(o, mine) for o in outs):
            sides = "; ".join(
                f"rank {self.peers.ranks[r]} at its exchange {int(o[0])}: "
                f"{_KINDS.get(int(o[1]), '?')}, {int(o[2])} values, wrapped model #{int(o[3])}"
                for r, o in enumerate(outs)
            )
            self.failure.fail(
                f"SyncBatchNorm's statistics exchanges do not pair across ranks ({sides}): "
                "every rank must run the same forwards and backwards through the wrapped "
                "model; a forward in training mode on some ranks only (logging, a check) "
                "meets the other ranks' layers. Run such a forward in eval mode "
                "(dmodel.eval()) or on dmodel.module",
                census=False,
            )
        what = "the sum of SyncBatchNorm statistics"
        self.failure.call(what, self.failure.wait, allreduce(self.group, t), what)
