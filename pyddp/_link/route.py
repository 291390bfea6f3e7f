"""The way of the agreement and the buffer broadcast on GPUs across
processes: the engine's NCCL communicator, ordered on the replicas' current
streams (processes.py's ProcessLink uses it when its replicas are GPUs)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

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

    def broadcast(self, tensors: Sequence[torch.Tensor], root: bool) -> None:
        """The root process's values of `tensors` (replica 0's, on
        devices[0]) on every process, on the device, bit for bit: a sum in
        which every other GPU contributes -0.0 (x + -0.0 == x for every
        float x, signed zeros included; a NaN stays NaN, though a GPU's add
        may drop its payload), per floating type in that type
        (complex as its real pairs); any other type (integers, bool) travels
        as its bytes, each exact in float16 (0..255, to which the others add
        -0.0). A cast to one wide type would not do: float64 holds neither a
        complex value nor an int64 above 2**53."""
        groups: Dict[torch.dtype, List[torch.Tensor]] = {}
        for t in tensors:
            if t.numel():
                groups.setdefault(_wire_type(t.dtype), []).append(t)
        for wire, ts in groups.items():
            self._broadcast_group(wire, ts, root)

    def _broadcast_group(self, wire: torch.dtype, ts: List[torch.Tensor], root: bool) -> None:
        sizes = [_wire_count(t, wire) for t in ts]
        total = sum(sizes)
        first = self.devices[0]
        parts = [self.provider.zeros(total, wire, d) for d in self.devices]
        with torch.no_grad():
            self.provider.before_host_write(first)  # the simulation: stream order
            dst = parts[0].split(sizes)
            for t, d in zip(ts, dst):
                if root:
                    d.copy_(_as_wire(t, wire))
                else:
                    d.fill_(-0.0)
            for d, p in zip(self.devices[1:], parts[1:]):
                self.provider.before_host_write(d)
                p.fill_(-0.0)
            self._sum(parts, DTYPE_NAMES[wire])
            self.provider.before_host_write(first)
            for t, d in zip(ts, parts[0].split(sizes)):
                _from_wire(t, d)

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

    def factors(self, parts: List[torch.Tensor], slot: int, assumed: float) -> List[torch.Tensor]:
        """Per replica, on its device: assumed rows / the global batch's."""
        out = []
        for part, d in zip(parts, self.devices):
            self.provider.before_host_write(d)  # torch: queued on the current stream
            rows = part[slot]
            out.append(torch.where(rows > 0, assumed / rows, torch.ones_like(rows)))
        return out


def _wire_type(dtype: torch.dtype) -> torch.dtype:
    """The floating type a buffer of `dtype` is broadcast in, exactly."""
    if dtype in DTYPE_NAMES:
        return dtype
    if dtype.is_complex:
        return torch.empty(0, dtype=dtype).real.dtype
    return torch.float16  # its bytes, one per float16


def _wire_count(t: torch.Tensor, wire: torch.dtype) -> int:
    """How many `wire` elements carry `t`."""
    if t.dtype == wire:
        return t.numel()
    return 2 * t.numel() if t.dtype.is_complex else t.numel() * t.element_size()


def _as_wire(t: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """`t`'s values as a flat tensor of `wire` (a copy where not a view)."""
    flat = t.detach().reshape(-1)
    if t.dtype == wire:
        return flat
    if t.dtype.is_complex:
        return torch.view_as_real(flat).reshape(-1)
    return flat.contiguous().view(torch.uint8).to(wire)


def _from_wire(t: torch.Tensor, values: torch.Tensor) -> None:
    """Writes `values` (as _as_wire gave them) back into `t`."""
    if t.dtype.is_complex:
        values = torch.view_as_complex(values.view(-1, 2))
    elif values.dtype != t.dtype:
        values = values.to(torch.uint8).view(t.dtype)
    t.detach().copy_(values.view(t.shape))
