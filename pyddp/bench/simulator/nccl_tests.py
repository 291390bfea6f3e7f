"""The all-reduce model (hardware.py) against published nccl-tests
`all_reduce_perf` times, float sum, out-of-place column, copied from each
source. `pyddp-bench simulate --validate` prints the comparison; the tests
hold the model to it.

What the sources are, and what they were used for:
- CALIBRATION, the one figure the model was set from: NET_LATENCY_SCALE
  (hardware.py) makes a 1 KiB all-reduce over 2 x 8 A100s take the published
  35.85 us. It is a small message, outside the 1-64 MiB range checked below.
- Every other row is a check; none was used to set any constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from . import hardware

MIB = 1 << 20


@dataclass(frozen=True)
class Source:
    name: str
    url: str
    setup: str  # as the source states it
    system: hardware.System  # the preset, with the source's network
    gpus: int
    rows: Tuple[Tuple[int, float], ...]  # (bytes, published time in us)
    note: str = ""


_A100 = hardware.SYSTEMS["a100-dgx"]

CALIBRATION = Source(
    "mscclpp, Azure NDmv4",
    "https://github.com/microsoft/mscclpp/blob/main/docs/performance-ndmv4.md",
    "2 nodes x 8 A100 80GB, NVSwitch, 8x HDR 200 Gb/s InfiniBand; NCCL 2.17.1; "
    'its table: "latency at 1K = 35.85 us"',
    _A100,
    16,
    ((1024, 35.85),),
)

SOURCES: Sequence[Source] = (
    Source(
        "OCI BM.GPU4.8, 2 nodes",
        "https://github.com/oracle-quickstart/oci-hpc-oke (README, an earlier revision)",
        "2 nodes x 8 A100 40GB (NVSwitch), 16x 100 GbE RoCE per node (the same 1.6 Tb/s as "
        "8x HDR), bare metal; all_reduce_perf -b 8 -e 8G, 16 ranks",
        _A100.with_network(16, 100),
        16,
        (
            (1 * MIB, 85.58),
            (2 * MIB, 99.19),
            (4 * MIB, 127.0),
            (8 * MIB, 174.3),
            (16 * MIB, 282.7),
            (32 * MIB, 452.3),
            (64 * MIB, 821.7),
            (1024 * MIB, 9187.8),
        ),
    ),
    Source(
        "Meta GCM health-check sample, 2 nodes",
        "https://github.com/facebookresearch/gcm/blob/main/gcm/tests/health_checks_tests/"
        "test_check_nccl.py",
        "2 nodes x 8 A100-SXM4-80GB, NCCL 2.12.12, -b 32M -e 1G; the network and the "
        "platform are not stated",
        _A100,
        16,
        ((32 * MIB, 650.2), (64 * MIB, 956.9), (128 * MIB, 1740.3), (1024 * MIB, 11013.0)),
        "the preset assumes a DGX, where LL128 crosses nodes",
    ),
    Source(
        "the same, read as LL128 off across nodes",
        "(as above)",
        "NCCL keeps LL128 inside a node when the NICs are not on the GPUs' PCIe switches "
        "(tuning.cc, typeInter <= PATH_PXB), as in many virtual machines; GCM's slow "
        "32-64 MiB times read as that",
        _A100.with_network(8, 200, ll128_net=False),
        16,
        ((32 * MIB, 650.2), (64 * MIB, 956.9), (128 * MIB, 1740.3), (1024 * MIB, 11013.0)),
    ),
    Source(
        "Meta GCM health-check sample, 1 node",
        "https://github.com/facebookresearch/gcm/blob/main/gcm/tests/health_checks_tests/"
        "test_check_nccl.py",
        "1 node x 8 A100-SXM4-80GB, NCCL 2.16.2",
        _A100,
        8,
        ((32 * MIB, 344.8), (64 * MIB, 557.4), (1024 * MIB, 8109.1)),
    ),
)


def compare(sources: Sequence[Source] = SOURCES) -> List[Dict[str, Any]]:
    """One row per published time: the model's, and the miss in percent."""
    rows = []
    for source in sources:
        nodes, _ = source.system.topology(source.gpus)
        for nbytes, published_us in source.rows:
            model_us = source.system.allreduce_s(nbytes, source.gpus) * 1e6
            rows.append(
                {
                    "source": source.name,
                    "url": source.url,
                    "gpus": source.gpus,
                    "nodes": nodes,
                    "bytes": nbytes,
                    "published_us": published_us,
                    "model_us": model_us,
                    "miss_percent": 100 * (model_us / published_us - 1),
                    "algorithm": source.system.algorithm(nbytes, source.gpus),
                    "in_range": nodes > 1 and MIB <= nbytes <= 64 * MIB,
                }
            )
    return rows


def size_label(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes} B"


def markdown(rows: Sequence[Dict[str, Any]]) -> str:
    lines = [
        "| nccl-tests source | GPUs | size | published µs | model µs | miss | NCCL (model) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['source']} | {r['gpus']} | {size_label(r['bytes'])} | {r['published_us']:g} "
            f"| {r['model_us']:.0f} | {r['miss_percent']:+.0f}% | {r['algorithm']} |"
        )
    return "\n".join(lines)
