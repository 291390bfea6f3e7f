"""`pyddp-bench simulate`: the alpha-beta model of ring all-reduce,
    time(S, n) = 2(n-1) * alpha + 2(n-1)/n * S / beta,
fed with the per-parameter gradient ready times measured on this machine, to
predict step time and scaling efficiency on n devices with and without
overlap and bucketing. Only communication is modelled: compute per device is
this machine's (what one device does per step is the same at any n).

Link presets (assumptions, with sources; override with --alpha-us/--beta-gbps):
  nvlink-h100: beta 450 GB/s per direction (H100 SXM NVLink 4: 900 GB/s total
               bidirectional, NVIDIA H100 datasheet), alpha 5 us (order of NCCL
               small-message all-reduce latency within an NVLink node).
  ib-ndr:      beta 50 GB/s (400 Gb/s NDR InfiniBand, NVIDIA ConnectX-7
               datasheet), alpha 10 us (inter-node latency incl. NCCL launch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

LINKS: Dict[str, Tuple[float, float]] = {  # name -> (alpha seconds, beta bytes/second)
    "nvlink-h100": (5e-6, 450e9),
    "ib-ndr": (10e-6, 50e9),
}


def ring_allreduce_time(nbytes: float, n: int, alpha: float, beta: float) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


@dataclass
class Profile:
    """One replica's step on this machine: forward time, backward time, and each
    parameter's gradient size and ready time (seconds after backward started),
    in the order they became ready."""

    forward_s: float
    backward_s: float
    param_bytes: List[int]
    param_ready_s: List[float]


def bucketize(
    profile: Profile, cap_bytes: float, first_cap_bytes: float
) -> List[Tuple[float, int]]:
    """(ready time, bytes) per bucket, filling buckets in ready order like the
    engine's plan; cap 0 = one bucket per parameter."""
    order = sorted(range(len(profile.param_bytes)), key=lambda i: profile.param_ready_s[i])
    buckets, size, ready, cap = [], 0, 0.0, first_cap_bytes if cap_bytes else 0
    for i in order:
        size += profile.param_bytes[i]
        ready = max(ready, profile.param_ready_s[i])
        if size >= max(cap, 1):
            buckets.append((ready, size))
            size, cap = 0, cap_bytes
    if size:
        buckets.append((ready, size))
    return buckets


def predict(
    profile: Profile, n: int, alpha: float, beta: float, cap_bytes: float, first_cap_bytes: float
) -> Dict[str, float]:
    """Step times with one launcher issuing buckets in ready order (overlap) and
    with every bucket after backward (no overlap)."""
    buckets = bucketize(profile, cap_bytes, first_cap_bytes)
    compute = profile.forward_s + profile.backward_s
    end = 0.0
    for ready, size in buckets:
        end = max(ready, end) + ring_allreduce_time(size, n, alpha, beta)
    overlapped = profile.forward_s + max(profile.backward_s, end)
    serial = compute + sum(ring_allreduce_time(s, n, alpha, beta) for _, s in buckets)
    return {
        "devices": n,
        "buckets": len(buckets),
        "compute_s": compute,
        "step_overlap_s": overlapped,
        "step_no_overlap_s": serial,
        "efficiency_overlap": compute / overlapped,
        "efficiency_no_overlap": compute / serial,
    }


def table_rows(
    profile: Profile, devices: Sequence[int], alpha: float, beta: float, caps_mb: Sequence[float]
) -> List[Dict[str, float]]:
    rows = []
    for cap in caps_mb:
        for n in devices:
            row = predict(profile, n, alpha, beta, cap * (1 << 20), min(cap, 1.0) * (1 << 20))
            row["cap_mb"] = cap
            rows.append(row)
    return rows
