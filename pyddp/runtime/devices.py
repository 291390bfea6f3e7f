"""Device list validation: turn what users pass into torch.devices, or say
clearly what is wrong and what to do."""

from __future__ import annotations

from collections.abc import Sequence
from typing import List, Union

import torch

DeviceLike = Union[str, int, torch.device]


def parse_devices(devices: Sequence[DeviceLike]) -> List[torch.device]:
    if not isinstance(devices, Sequence) or isinstance(devices, (str, bytes)):
        # (a set or dict would give one replica per distinct key, silently)
        raise TypeError(f"devices must be a list, e.g. ['cpu', 'cpu'], got {devices!r}")
    out = []
    for d in devices:
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"devices: {d!r} is not a device ({e})") from None
        out.append(_check_available(dev))
    if not out:
        raise ValueError("devices is empty: pass at least one device, e.g. ['cpu', 'cpu']")
    kinds = {d.type for d in out}
    if len(kinds) > 1:
        raise ValueError(
            f"devices mixes {sorted(kinds)}: replicas must all be on CPU or all on CUDA"
        )
    return out


def _check_available(dev: torch.device) -> torch.device:
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if dev.index is None else dev.index
        if index >= count:
            have = ", ".join(f"cuda:{i}" for i in range(count)) or "none"
            raise ValueError(
                f"devices: {dev} is not available (CUDA devices here: {have}); "
                "use 'cpu' replicas or one of the listed devices"
            )
        return torch.device("cuda", index)
    raise ValueError(f"devices: unsupported device type {dev.type!r}; use 'cpu' or 'cuda:N'")


def default_devices() -> List[torch.device]:
    """Every CUDA GPU (one replica each) when there are some, else two CPU replicas."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu"), torch.device("cpu")]


def process_devices(group: object = None) -> List[torch.device]:
    """wrap's default: across processes (torch.distributed initialised), this
    process's own GPU (cuda:LOCAL_RANK) or one CPU replica; in one process,
    default_devices()."""
    import torch.distributed as dist

    from .torchrun import local_rank

    if group is None and not (dist.is_available() and dist.is_initialized()):
        return default_devices()
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [_check_available(torch.device("cuda", local_rank()))]
    return [torch.device("cpu")]
