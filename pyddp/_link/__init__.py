"""GradSync's link to the other processes.

    hook -> engine (C++) -> backend -> link -> finish

The engine sums this process's replicas through its backend; the link hands
each summed bucket to the other processes (the bucket transport), agrees with
them at the end of each synced backward (unused parameters, a record of the
work done), and carries the small control exchanges the model and the
Trainer need (sums over ranks, values from rank 0, buffer broadcasts, loss
weighting). One process gets `Link`, which does nothing; several get
`ProcessLink`, on torch.distributed (its store, gloo groups of pyddp's own,
NCCL for GPUs)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from ..runtime.libraries import backend_kind
from ..runtime.libraries import timeout_s as default_timeout
from .control import exchange
from .groups import peers_of, resolve_group
from .link import Link
from .processes import ProcessLink
from .record import WorkRecord

__all__ = ["Link", "ProcessLink", "WorkRecord", "connect", "exchange", "resolve_group"]


def connect(
    group: Any,
    replicas: Sequence[Any],
    names: Sequence[str],
    device_type: str,
    timeout_s: Optional[float],
    op: str,
    settings: Dict[str, Any],
    gpu_devices: Optional[Sequence[int]] = None,
) -> Link:
    """The link for `replicas` (this process's): a ProcessLink over `group`
    (a process group, already resolved), or one process's Link for None.
    Across processes every rank must connect the same model with the same
    settings (checked); rank 0's parameters and buffers are adopted."""
    if group is None:
        return Link(len(replicas))
    if gpu_devices is not None and backend_kind(gpu_devices) != "nccl":
        raise NotImplementedError(
            "pyddp: across processes, GPU replicas need one GPU each (NCCL); several "
            "replicas sharing a GPU are supported in one process only"
        )
    seconds = default_timeout() if timeout_s is None else float(timeout_s)
    link = ProcessLink(peers_of(group, seconds), names)
    link.group = group
    link.adopt_root_model(replicas, device_type, op, settings)
    return link
