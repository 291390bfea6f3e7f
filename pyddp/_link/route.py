"""The way of the agreement and the buffer broadcast on GPUs across
processes: the engine's NCCL communicator, ordered on the replicas' current
streams (processes.py's ProcessLink uses it when its replicas are GPUs)."""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch

from .._params import DTYPE_NAMES
from .agreement import LOADS


class DeviceRoute:
    """The agreement's way on GPUs: one more float64 sum on the engine's
    NCCL communicator after the buckets, ordered on the replicas' current
    streams (which wait for it); its result travels to the host on its own
    and is read when there."""

    def __init__(self, backend: Any, devices: Sequence[int], provider: Any):
        self.backend, self.devices, self.provider = backend, list(devices), provider
        # Parts still read or written by the GPUs: kept alive until each
        # device's stream passed their reduction (torch's caching allocator
        # would order a reuse after it anyway; host memory, as in the
        # simulation, would not).
        self._held: List[Tuple[List[torch.Tensor], List[Any]]] = []

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
        return self._hold(parts)[0]

    def broadcast(self, tensors: Sequence[torch.Tensor], root: bool) -> None:
        """The root process's values of `tensors` (replica 0's, on
        devices[0]) on every process, on the device: a float64 sum in which
        every other GPU contributes -0.0 (x + -0.0 == x for every x, signed
        zeros and NaN included; float64 holds every float32, float16 and
        bfloat16 value and integers up to 2**53 exactly)."""
        ts = [t for t in tensors if t.numel()]
        if not ts:
            return
        self.provider.before_host_write(self.devices[0])  # the simulation: stream order
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in ts])
            if not root:
                flat.fill_(-0.0)
            parts = [flat] + [torch.full_like(flat, -0.0) for _ in self.devices[1:]]
            self._sum(parts)
            self.provider.before_host_write(self.devices[0])
            offset = 0
            for t in ts:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        self._hold(parts)

    def zeros(self, count: int, dtype: torch.dtype, replica: int) -> torch.Tensor:
        """Memory on replica's device (the simulation adds guard zones)."""
        return self.provider.zeros(count, dtype, self.devices[replica])

    def sum_each(self, parts: List[torch.Tensor]) -> None:
        """Sums `parts` (one per replica, on its device, in any dtype) over
        every GPU of every process, in place: each replica then reads its own
        on its current stream (ordered after the sum)."""
        self._sum(parts, DTYPE_NAMES[parts[0].dtype])
        for d in set(self.devices):
            self.provider.before_host_write(d)  # the simulation: stream order

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
        self._held = [h for h in self._held if not all(c.ready() for c in h[1])]

    def _hold(self, parts: List[torch.Tensor]) -> List[Any]:
        """Keeps `parts` alive until every device's stream is past their
        reduction; returns their copies on the way to the host."""
        copies = [self.provider.fetch(d, p) for d, p in zip(self.devices, parts)]
        self._held.append((parts, copies))
        return copies

    def factors(self, parts: List[torch.Tensor], slot: int, assumed: float) -> List[torch.Tensor]:
        """Per replica, on its device: assumed rows / the global batch's."""
        out = []
        for part, d in zip(parts, self.devices):
            self.provider.before_host_write(d)  # torch: queued on the current stream
            rows = part[slot]
            out.append(torch.where(rows > 0, assumed / rows, torch.ones_like(rows)))
        return out
