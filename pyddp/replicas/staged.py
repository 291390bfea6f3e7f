"""Rank 0's buffers across processes, in at torch DDP's moment.

torch DDP sends rank 0's buffers (BatchNorm statistics) to every rank before
a forward that follows a synced training step; pyddp sends them at the end of
that step's backward, where the ranks have just met in its last all-reduce, so
that a forward that follows needs no collective (an evaluation may run on some
ranks only). Received there, they go in at this rank's next forward through
the wrapper, as DDP's would: until then every rank keeps its own, as under DDP
(an evaluation through the unwrapped module after the last step, as the
transformers Trainer and Accelerate run it, sees each rank's own statistics).

A buffer this rank wrote in between (a checkpoint loaded on every rank) keeps
what was written: rank 0 wrote the same, which DDP would send."""

from __future__ import annotations

from typing import List, Optional

import torch

from .._link.control import BUFFERS_BROADCAST
from .._link.link import Link


class StagedBuffers:
    __slots__ = ("_buffers", "_received", "_versions")

    def __init__(self) -> None:
        self._buffers: Optional[List[torch.Tensor]] = None
        self._received: List[torch.Tensor] = []
        self._versions: List[int] = []

    def receive(self, link: Link, buffers: List[torch.Tensor]) -> None:
        """Rank 0's values of `buffers` (this rank's, in the model's order),
        held for put_in; the buffers themselves are left as they are."""
        received = [b.detach().clone() for b in buffers]
        link.broadcast(received, BUFFERS_BROADCAST)
        self._buffers, self._received = buffers, received
        self._versions = [b._version for b in buffers]

    def put_in(self) -> None:
        """Writes what receive() held into the buffers that nothing wrote
        since, once."""
        if self._buffers is None:
            return
        pairs = [
            (b, r)
            for b, r, v in zip(self._buffers, self._received, self._versions)
            if b._version == v
        ]
        self._buffers, self._received, self._versions = None, [], []
        if pairs:
            with torch.no_grad():
                torch._foreach_copy_([b for b, _ in pairs], [r for _, r in pairs])
