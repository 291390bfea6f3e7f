"""Hardware presets for `pyddp-bench simulate`, each figure with its public
source, and NCCL's own cost model of an all-reduce over them.

GPUs (dense peaks; NVIDIA's "*" figures are with 2:4 sparsity, twice these):
- P100 PCIe (no tensor cores): 9.3 FP32 / 18.7 FP16 TFLOPS at 1300 MHz,
  NVIDIA as quoted by Tom's Hardware,
  https://www.tomshardware.com/news/nvidia-tesla-p100-pcie-gpu,32119.html ;
  HBM2 732 GB/s (16 GB), P100 datasheet.
- V100 SXM2: NVIDIA Ampere architecture blog, Table 3
  (developer.nvidia.com/blog/nvidia-ampere-architecture-in-depth/): FP32 15.7,
  FP16 tensor 125 TFLOPS, 900 GB/s.
- A100 SXM4 80GB: NVIDIA A100 datasheet (nvidia-a100-datasheet-nvidia-us-2188504-web.pdf):
  FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS (dense), 2,039 GB/s; NVLink 600 GB/s.
- H100 SXM5: NVIDIA H100 datasheet
  (resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet):
  FP32 67, TF32 989* and BF16 1,979* TFLOPS with sparsity (dense 494.7 and
  989.4), 3.35 TB/s.

Achievable fractions of those peaks (assumptions, with what they rest on):
- compute_eff 0.6 of the tensor-core peak for matmuls, convolutions and
  attention: between Megatron-LM's 52% of peak end to end on A100 (Narayanan
  et al., SC'21, arXiv:2104.04473) and 69% for a large FP16 matmul on an A800
  (mli/transformers-benchmarks#4).
- memory_eff 0.85 of HBM bandwidth for everything else: measured copies reach
  87% (A100 40GB, PTsolvers/gpu-workshop-JuliaCon23#7) and 89% (A800,
  mli/transformers-benchmarks#4).
- kernel floor 3 us per operator: back-to-back launches of a 2.9 us kernel
  take 3.8 us each on V100 (NVIDIA blog "Getting Started with CUDA Graphs").

Links (bus bandwidth an NCCL ring all-reduce reaches, GB/s, per GPU):
- NVLink: NCCL's own effective figure per link and direction, src/graph/topo.h
  (SM60_NVLINK_BW 18.0, SM70 20.0, SM80 20.0): "~20GB/s effective bandwidth
  with a 128B payload size ... ~230GB/s" on A100 (S. Jeaugey, NVIDIA/nccl-tests#149).
  V100 in DGX-1: 6 links x 20 = 120 for 8 GPUs, fewer for a subset (no
  NVSwitch: 20 for GPUs 0-1, which share one link); A100 NVSwitch:
  230 (measured, same comment); H100 NVSwitch ring: 370 ("NCCL can get an
  effective NVLink bandwidth of 370GB/s ... with NCCL_ALGO=RING",
  NVIDIA/nccl-tests#212). NVLink SHARP (NVLS, ~480 busbw on H100) is not modelled.
- PCIe gen3 x16: 12.0 GB/s (NCCL topo.h PCI_BW, "PCI Gen3 x16").
- InfiniBand/RoCE NICs: 0.96 of line rate per NIC (NCCL topo.h NET_BW 12.0 for
  100 Gbit; "12.2 GB/s (for a 100Gbps card) is as good as you can get. DGX-1
  can get 48 GB/s because we have 4 IB adapters", NVIDIA/nccl-tests#29; DGX
  A100 "8x200Gbit/s IB cards and we measure 192GB/s AllReduce BusBW",
  NVIDIA/nccl#812; NDR "46-48GB/s per NIC", NVIDIA/nccl-tests#290).
- NICs per node: DGX-1 4x EDR 100 Gb/s (Mellanox ConnectX-4 DGX-1 brief), DGX
  A100 8x HDR 200 Gb/s (DGX A100 spec), DGX H100 8x NDR 400 Gb/s ConnectX-7
  (NVIDIA MLPerf inference v3.1 dgx-h100.md).

Collective time: NCCL's tuning model (src/graph/tuning.cc, NVIDIA/nccl),
simplified: for ring and tree and for the LL, LL128 and Simple protocols,
    time = latency + bytes / algorithm bandwidth
with NCCL's base and per-hop latencies, ring latency growing with its
2(n-1) steps (intra- and inter-node hops priced apart), tree latency with
2((gpus per node - 1) intra + log2(nodes) inter) hops, NCCL's protocol
bandwidth factors, and the cheapest pair chosen, as NCCL does. Trees
arrived in NCCL 2.4 ("Massively Scale Your Deep Learning Training with NCCL
2.4", NVIDIA developer blog, 2019): the 2017-era P100 presets use rings only.
Also from NCCL's model: 2 x nodes network steps per ring, the network post
overhead on ring hops across nodes, the LL bandwidth caps, tree LL128 factors.
Also NCCL's per-size tree correction factors (its "trees are not perfectly
sticking to the model for medium sizes": tree bandwidth times 0.4-1.0 by
power of two of the message size, 64 B to 256 MB), and its rule that LL128
crosses nodes only where the NIC sits on the GPU's PCIe switch
(System.ll128_net; tuning.cc: typeInter <= PATH_PXB).

Across nodes NCCL's own network hop latencies are too low for what
nccl-tests measures: a 1 KiB all-reduce over 2 x 8 A100s on 8x HDR takes
35.85 us (microsoft/mscclpp docs/performance-ndmv4.md, NCCL 2.17.1), NCCL's
model 25 us. NET_LATENCY_SCALE multiplies the network rows of _HW_LAT so
that the model gives that figure on the a100-dgx preset (2.05; derived from
that one small-message point, checked by tests/test_simulate.py), and
applies to every preset's network. Checked against published nccl-tests at
1-64 MiB across nodes, none of which was used to set it: nccl_tests.py.

Not modelled: per-channel bandwidth caps and the channel count (the ring
plateau factor is applied to every multi-node Simple message), topology
latencies (latencyInter), NVLS and CollNet (in-network reduction, SHARP),
PXN, and transports other than InfiniBand/RoCE verbs (AWS EFA, TCP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Dict, Tuple

from .checks import numbers_of

# NCCL src/graph/tuning.cc (the NVLS-era version, commit b6475625): latencies
# in microseconds, [algorithm][protocol] with protocols (LL, LL128, Simple).
_BASE_LAT = {"tree": (6.8, 14.0, 0.0), "ring": (6.6, 14.0, 8.4)}
_HW_LAT = {
    "nvlink": {"tree": (0.6, 1.25, 28.0), "ring": (0.6, 1.9, 3.4)},
    "pcie": {"tree": (1.0, 1.9, 28.0), "ring": (1.0, 2.5, 5.7)},
    "net": {"tree": (5.0, 8.5, 28.0), "ring": (2.7, 4.0, 14.0)},
}
_PROTOCOLS = ("LL", "LL128", "Simple")
# tuning.cc treeCorrectionFactor[protocol][log2(bytes / 64)], 64 B to 256 MB.
_TREE_CORRECTION = {
    "LL": (
        1,
        1,
        1,
        1,
        0.9,
        0.8,
        0.7,
        0.7,
        0.7,
        0.7,
        0.6,
        0.5,
        0.4,
        0.4,
        0.5,
        0.6,
        0.7,
        0.8,
        0.9,
        1,
        1,
        1,
        1,
    ),
    "LL128": (
        1,
        1,
        1,
        1,
        1,
        0.9,
        0.8,
        0.8,
        0.8,
        0.7,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.6,
        0.8,
        0.9,
        0.9,
        0.9,
        0.9,
        1,
        1,
    ),
    "Simple": (
        0.9,
        0.9,
        0.9,
        0.9,
        0.9,
        0.9,
        0.9,
        0.8,
        0.7,
        0.6,
        0.6,
        0.5,
        0.5,
        0.5,
        0.5,
        0.6,
        0.7,
        0.8,
        0.7,
        0.7,
        0.8,
        0.9,
        0.9,
    ),
}
# See the module's docstring: 2 x 8 A100, 1 KiB, 35.85 us published.
NET_LATENCY_SCALE = 2.05


@dataclass(frozen=True)
class Gpu:
    name: str
    fp32: float  # FLOP/s, vector
    tf32: float  # FLOP/s, tensor core (0: none)
    half: float  # FLOP/s, FP16/BF16 tensor core (or packed FP16 without tensor cores)
    memory_bw: float  # bytes/s
    arch: int  # compute capability x 10 (60 Pascal, 70 Volta, 80 Ampere, 90 Hopper)
    compute_eff: float = 0.6
    memory_eff: float = 0.85
    kernel_floor_s: float = 3e-6

    def __post_init__(self) -> None:
        numbers_of(self, "fp32 half memory_bw", "tf32 kernel_floor_s", "compute_eff memory_eff")

    def peaks(self, precision: str) -> Tuple[float, float]:
        """(matmul peak, vector peak) in FLOP/s at `precision`."""
        if precision == "fp32":
            return self.fp32, self.fp32
        if precision == "tf32":
            if not self.tf32:
                raise ValueError(f"{self.name} has no TF32 tensor cores: use fp32 or amp")
            return self.tf32, self.fp32
        if precision == "amp":
            return self.half, self.fp32
        raise ValueError(f"precision {precision!r}: one of fp32, tf32, amp")


T = 1e12
GPUS: Dict[str, Gpu] = {
    "p100-pcie": Gpu("P100 PCIe 16GB", 9.3 * T, 0.0, 18.7 * T, 732e9, 60),
    "v100": Gpu("V100 SXM2", 15.7 * T, 0.0, 125 * T, 900e9, 70),
    "a100": Gpu("A100 SXM4 80GB", 19.5 * T, 156 * T, 312 * T, 2039e9, 80),
    "h100": Gpu("H100 SXM5 80GB", 67 * T, 494.7 * T, 989.4 * T, 3350e9, 90),
}


@dataclass(frozen=True)
class System:
    """A node type and its network: GPUs per node, the bus bandwidth of an
    NCCL ring inside a node, its hop type, and the node's NICs."""

    name: str
    gpu: Gpu
    gpus_per_node: int
    intra_busbw: float  # bytes/s
    intra_hop: str  # "nvlink" or "pcie": which NCCL latency row applies
    nics: int
    nic_gbit: float  # line rate per NIC, Gbit/s
    nic_eff: float = 0.96
    cpu: str = "intel"  # the hosts' CPU vendor: NCCL's LL bandwidth caps across nodes depend on it
    # Bus bandwidth for fewer GPUs than a node where it is lower (no NVSwitch).
    partial_busbw: Tuple[Tuple[int, float], ...] = ()
    ll128: bool = True  # NCCL enables LL128 on NVLink platforms (Volta and newer)
    # ... and across nodes only where each GPU's NIC is on its PCIe switch (DGX
    # systems); a virtual machine or a NIC behind the CPU turns it off.
    ll128_net: bool = True
    # NCCL before 2.4 (2019) had rings only; 2.4 added double binary trees.
    algorithms: Tuple[str, ...] = ("ring", "tree")
    about: str = ""

    def __post_init__(self) -> None:
        numbers_of(self, "gpus_per_node intra_busbw", "nics nic_gbit", "nic_eff")  # (0: no network)

    def uses_ll128(self, nodes: int) -> bool:
        """Whether NCCL runs LL128 over `nodes` nodes of this system."""
        return self.ll128 and (nodes == 1 or self.ll128_net)

    @property
    def inter_busbw(self) -> float:
        return self.nics * self.nic_gbit / 8 * 1e9 * self.nic_eff

    def with_network(self, nics: int, gbit: float, **changes: Any) -> System:
        return replace(
            self, nics=nics, nic_gbit=gbit, name=f"{self.name}, {nics}x{gbit:g}Gb", **changes
        )

    def busbw(self, gpus: int) -> float:
        """Bus bandwidth of a ring over `gpus` GPUs (bytes/s)."""
        nodes, per_node = self.topology(gpus)
        intra = dict(self.partial_busbw).get(per_node, self.intra_busbw)
        return intra if nodes == 1 else min(intra, self.inter_busbw)

    def allreduce_s(self, nbytes: float, gpus: int) -> float:
        return _allreduce_s(self, float(nbytes), gpus)[0]

    def algorithm(self, nbytes: float, gpus: int) -> str:
        return _allreduce_s(self, float(nbytes), gpus)[1]

    def hop_latency_us(self, across_nodes: bool) -> float:
        """One Simple-protocol ring hop's latency (us): the network's, scaled
        as every network hop here, or the node's own link's."""
        if across_nodes:
            return _HW_LAT["net"]["ring"][2] * NET_LATENCY_SCALE
        return _HW_LAT[self.intra_hop]["ring"][2]

    def gather_s(self, nbytes: float, gpus: int) -> float:
        """A reduce-scatter or an all-gather of `nbytes` in all (each GPU
        holds or receives nbytes / gpus): NCCL's ring, its only algorithm for
        them here (NVLS and CollNet are not modelled)."""
        return _gather_s(self, float(nbytes), gpus)

    def topology(self, gpus: int) -> Tuple[int, int]:
        """(nodes, GPUs per node) for `gpus` GPUs: fill nodes first."""
        if gpus <= self.gpus_per_node:
            return 1, gpus
        if gpus % self.gpus_per_node or self.inter_busbw <= 0:
            why = ("is not a whole number of", "cannot span, with no network,")[
                self.inter_busbw <= 0
            ]
            raise ValueError(f"{gpus} GPUs {why} {self.name}'s {self.gpus_per_node}-GPU nodes")
        return gpus // self.gpus_per_node, self.gpus_per_node


# NCCL tuning.cc (b6475625): LL bandwidth caps in GB/s, [row][column] with
# row = GPU generation on one node (Volta, Ampere, Hopper) or the CPU vendor
# across nodes (Intel, AMD), column = 1 node, 2 nodes, more.
_LL_MAX_BW = ((39.0, 39.0, 20.4), (87.7, 22.5, 19.0), (87.7, 22.5, 19.0))


@lru_cache(maxsize=1 << 16)
def _allreduce_s(system: System, nbytes: float, gpus: int) -> Tuple[float, str]:
    if gpus <= 1 or nbytes <= 0:
        return 0.0, "-"
    nodes, per_node = system.topology(gpus)
    busbw = system.busbw(gpus) / 1e9  # GB/s, as NCCL's tables
    arch = system.gpu.arch
    if nodes == 1:
        ll_cap = _LL_MAX_BW[0 if arch < 80 else 1 if arch < 90 else 2][0]
    else:
        ll_cap = _LL_MAX_BW[1 if system.cpu == "amd" else 0][1 if nodes == 2 else 2]
    net_overhead = 2.0 if system.cpu == "amd" else 1.0  # us per network post (getNetOverhead)
    best = (math.inf, "")
    log_size = int(nbytes // 64).bit_length() - 1  # NCCL's log2i(nBytes >> 6)
    for algo in system.algorithms:
        for p, proto in enumerate(_PROTOCOLS):
            if proto == "LL128" and not system.uses_ll128(nodes):
                continue
            intra = _HW_LAT[system.intra_hop][algo][p]
            inter = _HW_LAT["net"][algo][p] * NET_LATENCY_SCALE
            if algo == "ring":
                steps = 2 * (gpus - 1)
                inter_steps = 2 * nodes if nodes > 1 else 0
                if nodes > 1:
                    intra = max(intra, net_overhead * (3 if proto == "Simple" else 1))
                lat = _BASE_LAT[algo][p] + (steps - inter_steps) * intra + inter_steps * inter
                if proto == "Simple" and nodes > 1:
                    lat *= 1.9 if arch < 80 else 1.4  # NCCL: "plateau effect of ring"
                bw = {"LL": min(ll_cap, busbw / 4), "LL128": busbw * 0.92, "Simple": busbw}[proto]
                algbw = bw * gpus / steps
            else:
                log2_nodes = nodes.bit_length() - 1  # NCCL's log2i
                lat = _BASE_LAT[algo][p] + 2 * ((per_node - 1) * intra + log2_nodes * inter)
                tree = busbw * 0.92
                bw = {
                    "LL": min(tree / 3.8, ll_cap),
                    "LL128": tree * (7 / 9 if nodes == 1 else 120 / 128),
                    "Simple": tree,
                }[proto]
                algbw = bw * 0.5
                if 0 <= log_size < len(_TREE_CORRECTION[proto]):
                    algbw *= _TREE_CORRECTION[proto][log_size]
            t = lat * 1e-6 + nbytes / (algbw * 1e9)
            if t < best[0]:
                best = (t, f"{algo}/{proto}")
    return best


@lru_cache(maxsize=1 << 16)
def _gather_s(system: System, nbytes: float, gpus: int) -> float:
    """NCCL tuning.cc for ncclFuncReduceScatter / ncclFuncAllGather on a
    ring: gpus - 1 steps, nodes - 1 of them across the network; LL's bus
    bandwidth is a third of the link's in one node (a quarter across nodes,
    as for an all-reduce); no ring plateau factor (all-reduce only); NCCL's
    nBytes is the whole buffer (the per-rank count times the ranks)."""
    if gpus <= 1 or nbytes <= 0:
        return 0.0
    nodes, _ = system.topology(gpus)
    busbw = system.busbw(gpus) / 1e9
    arch = system.gpu.arch
    if nodes == 1:
        ll_cap = _LL_MAX_BW[0 if arch < 80 else 1 if arch < 90 else 2][0]
    else:
        ll_cap = _LL_MAX_BW[1 if system.cpu == "amd" else 0][1 if nodes == 2 else 2]
    net_overhead = 2.0 if system.cpu == "amd" else 1.0
    steps, inter_steps = gpus - 1, nodes - 1
    best = math.inf
    for p, proto in enumerate(_PROTOCOLS):
        if proto == "LL128" and not system.uses_ll128(nodes):
            continue
        intra = _HW_LAT[system.intra_hop]["ring"][p]
        inter = _HW_LAT["net"]["ring"][p] * NET_LATENCY_SCALE
        if nodes > 1:
            intra = max(intra, net_overhead * (3 if proto == "Simple" else 1))
        lat = _BASE_LAT["ring"][p] + (steps - inter_steps) * intra + inter_steps * inter
        ll = busbw / (4 if nodes > 1 else 3)
        bw = {"LL": min(ll_cap, ll), "LL128": busbw * 0.92, "Simple": busbw}[proto]
        algbw = bw * gpus / steps
        best = min(best, lat * 1e-6 + nbytes / (algbw * 1e9))
    return best


GB = 1e9
SYSTEMS: Dict[str, System] = {
    "p100-pcie-25gbe": System(
        "4x P100 PCIe per node, 25 Gb/s RoCE",
        GPUS["p100-pcie"],
        4,
        12.0 * GB,
        "pcie",
        1,
        25,
        ll128=False,
        algorithms=("ring",),
        about="Horovod's 2017 benchmark servers: PCIe, 2 GPUs per CPU, one 25 Gb/s RoCE NIC, "
        "NCCL 2.0",
    ),
    "v100-dgx1": System(
        "DGX-1: 8x V100 SXM2 NVLink hybrid cube-mesh, 4x EDR 100 Gb/s IB",
        GPUS["v100"],
        8,
        120 * GB,
        "nvlink",
        4,
        100,
        # GPUs 0..n-1: the fewest NVLinks any of them has to the others, x 20 GB/s
        # (nvidia-smi topo -m of the torch DDP benchmark's DGX-1,
        # benchmarks/distributed/ddp/README.md: GPU0-GPU1 share one link, GPU4
        # reaches only GPU0 among GPUs 0-4, ...).
        partial_busbw=(
            (2, 20 * GB),
            (3, 40 * GB),
            (4, 80 * GB),
            (5, 40 * GB),
            (6, 60 * GB),
            (7, 80 * GB),
        ),
    ),
    "v100-dgx2": System(
        "DGX-2: 16x V100 SXM3 32GB NVSwitch, 8x EDR 100 Gb/s IB",
        GPUS["v100"],
        16,
        # 6 NVLinks per GPU into the NVSwitches, NCCL's 20 GB/s each (topo.h SM70).
        120 * GB,
        "nvlink",
        8,
        100,
        about="NVIDIA DGX-2 (and DGX-2H, whose faster clocks the calibration absorbs)",
    ),
    "a100-dgx": System(
        "DGX A100: 8x A100 80GB NVSwitch, 8x HDR 200 Gb/s IB",
        GPUS["a100"],
        8,
        230 * GB,
        "nvlink",
        8,
        200,
        cpu="amd",  # DGX A100: 2x AMD EPYC 7742
    ),
    "h100-nvlink": System(
        "DGX H100: 8x H100 SXM5 NVSwitch, 8x NDR 400 Gb/s IB",
        GPUS["h100"],
        8,
        370 * GB,
        "nvlink",
        8,
        400,
    ),
}
