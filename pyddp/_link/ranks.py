"""`dmodel.ranks`: the processes a wrapped model spans, as the Trainer, its
checkpoints and evaluation see them: where this process is, and the three
small exchanges they make (sums, rank 0's value, everyone's values). Every
exchange is collective (every rank calls it, in the same order) and named
(`what`, an exchange name from control.exchange), so a rank that calls another
one fails naming both. One process: every answer is this process's own."""

from __future__ import annotations

from typing import Any, List, Sequence

import torch

from .link import Link


class Ranks:
    def __init__(self, link: Link):
        self._link = link

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
        return self._link.global_ranks()

    def sum(self, values: Sequence[float], what: str) -> List[float]:
        """Element-wise sums of `values` over the ranks."""
        return self._link.sum_over_ranks(values, what)

    def from_root(self, obj: Any, what: str, root: int = 0) -> Any:
        """Rank `root`'s `obj` (picklable) on every rank."""
        return self._link.from_root(obj, what, root)

    def gather(self, obj: Any, what: str) -> List[Any]:
        """Every rank's `obj` (picklable), in rank order."""
        return self._link.gather_objects(obj, what)

    def gather_tensor(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's `t` (a CPU tensor of the same size and dtype on
        every rank), end to end in rank order, bit for bit."""
        return self._link.gather_tensor(t, what)
