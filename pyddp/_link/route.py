"""The way of the agreement, the buffer broadcast and the sharded optimizer's
all-gather on GPUs: the engine's backend (NCCL across processes), ordered on
the replicas' current streams (processes.py's ProcessLink uses it when its
replicas are GPUs, shards.py's DeviceGather for a sharded optimizer)."""

from __future__ import annotations

from typing import Any, List, Sequence

import torch

from ..runtime.libraries import DTYPE_NAMES
from .agreement import LOADS


class DeviceRoute:
    """The agreement's way on GPUs: one more float64 sum on the engine's
    NCCL communicator after the buckets, ordered on the replicas' current
    streams (which wait for it); its result travels to the host on its own
    and is read when there.

    Every buffer here is allocated on its replica's device and current
    stream, and that stream waits for the sum: dropping one right after is
    safe (torch's caching allocator reuses a block in its allocation
    stream's order)."""

    def __init__(self, backend: Any, devices: Sequence[int], provider: Any):
        self.backend, self.devices, self.provider = backend, list(devices), provider

    def reduce(self, part: torch.Tensor, rows_slot: int) -> List[torch.Tensor]:
        """Every replica's part on its device (the rows only in replica 0's:
        they are this process's), summed over every GPU of every process."""
        others = part.clone()
        others[rows_slot : rows_slot + LOADS] = 0.0
        parts = [
            self.provider.upload(d, part if r == 0 else others) for r, d in enumerate(self.devices)
        ]
        self._sum(parts)
        return parts

    def fetch(self, parts: List[torch.Tensor]) -> Any:
        """Replica 0's sums on their way to the host."""
        return self.provider.fetch(self.devices[0], parts[0])

    def broadcast(self, tensors: Sequence[torch.Tensor], root: int) -> None:
        """NCCL rank `root`'s process's values of `tensors` (replica 0's, on
        devices[0]) on every process, on the device, bit for bit, by one
        broadcast of their bytes (any dtypes; a broadcast copies, so a NaN's
        payload and a signed zero travel as they are). The bytes travel as
        16-bit words (padded to an even count): a copy has no arithmetic to
        care about the type."""
        live = [t for t in tensors if t.numel()]
        if not live:
            return
        sizes = [t.numel() * t.element_size() for t in live]
        total = sum(sizes)
        words = (total + 1) // 2
        first = self.devices[0]
        parts = [self.provider.zeros(words, torch.float16, d) for d in self.devices]
        # The replica at rank `root` sends (on the root process: the one on
        # its smallest device); the others receive.
        sender = [r for r in range(len(self.devices)) if self.backend.rank_of(r) == root]
        with torch.no_grad():
            if sender:
                (s,) = sender
                self.provider.before_host_write(self.devices[s])  # the simulation: stream order
                packed = parts[s].view(torch.uint8)[:total]
                torch._foreach_copy_(list(packed.split(sizes)), [_bytes_of(t) for t in live])
            self.backend.broadcast(
                [t.data_ptr() for t in parts],
                self.devices,
                [self.provider.current(d) for d in self.devices],
                words,
                "float16",
                root,
            )
            self.provider.before_host_write(first)
            got = parts[0].view(torch.uint8)[:total].split(sizes)
            for t, b in zip(live, got):
                if t.is_contiguous():
                    t.detach().view(-1).view(torch.uint8).copy_(b)
                else:  # realigned first, then by value
                    t.detach().copy_(b.clone().view(t.dtype).view(t.shape))

    def all_gather(self, sends: List[torch.Tensor], recvs: List[torch.Tensor]) -> None:
        """Each replica's `sends` (one per replica, on its device, the same
        length; may be its own block of its receive buffer) into every
        replica's `recvs` (ranks x that length), in rank order (see
        backend.rank_of), over every GPU of every process; each replica then
        reads its own on its current stream (ordered after it)."""
        self.backend.all_gather(
            [t.data_ptr() for t in sends],
            [t.data_ptr() for t in recvs],
            self.devices,
            [self.provider.current(d) for d in self.devices],
            sends[0].numel(),
            DTYPE_NAMES[sends[0].dtype],
        )
        for d in set(self.devices):
            self.provider.before_host_write(d)  # the simulation: stream order

    def zeros(self, count: int, dtype: torch.dtype, replica: int) -> torch.Tensor:
        """Memory on replica's device (the simulation adds guard zones)."""
        return self.provider.zeros(count, dtype, self.devices[replica])

    def _sum(self, parts: List[torch.Tensor], dtype: str = "float64") -> None:
        """Sums `parts` (one per replica) over every GPU of every process, in
        place, ordered on the current streams (which wait for it)."""
        self.backend.reduce(
            [t.data_ptr() for t in parts],
            self.devices,
            [self.provider.current(d) for d in self.devices],
            parts[0].numel(),
            dtype,
            "sum",
        )

    def factors(self, parts: List[torch.Tensor], slot: int, assumed: float) -> List[torch.Tensor]:
        """Per replica, on its device: assumed rows / the global batch's."""
        out = []
        for part, d in zip(parts, self.devices):
            self.provider.before_host_write(d)  # torch: queued on the current stream
            rows = part[slot]
            out.append(torch.where(rows > 0, assumed / rows, torch.ones_like(rows)))
        return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes, flat (a copy where `t` is not contiguous)."""
    return t.detach().contiguous().view(-1).view(torch.uint8)
