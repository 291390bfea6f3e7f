"""The published data-parallel scaling results the simulator is checked
against (published.py reproduces each): per case, the publication's model,
per-GPU batch, precision, hardware (a hardware.SYSTEMS preset), the
gradient-sync policy its framework used, its throughput where the
calibration is taken, and its efficiency at other GPU counts, with the
source and its words. The split into a fit half and a held-out half is
published.held_out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple


@dataclass(frozen=True)
class Point:
    """Published efficiency at `gpus` relative to `baseline` GPUs (each run
    with its own micro-batches per optimizer step)."""

    baseline: int
    gpus: int
    published: float
    baseline_accumulate: int = 1
    accumulate: int = 1


def _points(*triples: Tuple[int, int, float]) -> Tuple[Point, ...]:
    return tuple(Point(*t) for t in triples)


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    batch: int
    system: str
    precision: str
    optimizer: str
    policy: str
    # Published samples/s per GPU where the calibration is taken: one GPU, or
    # (BERT) one node of GPUs running one_gpu_accumulate micro-batches per step.
    one_gpu_per_s: float
    one_gpu_accumulate: int  # micro-batches per step behind one_gpu_per_s
    points: Tuple[Point, ...]
    source: str
    quote: str
    caveat: str = ""
    fp16_gradients: bool = False  # gradients reduced in FP16
    calibrate_gpus: int = 1  # the GPU count behind one_gpu_per_s


_DDP_BENCH = (
    "https://github.com/pytorch/pytorch/blob/main/benchmarks/distributed/ddp/README.md "
    "(benchmark.py: batch 32 per GPU, synthetic FP32 input, SGD, bucket_cap_mb 25)"
)
_HOROVOD_OLD = (
    "Horovod README before PR #44 (2017-10-17), https://github.com/horovod/horovod/pull/44: "
    '"4 servers with 4 Pascal GPUs each connected by RoCE-capable 25 Gbit/s network", '
    "RDMA Horovod (allreduce on GPU with NCCL), baseline single-GPU batch size 64"
)
_HOROVOD_DOCS = "https://github.com/horovod/horovod/blob/master/docs/benchmarks.rst"
_DLE_RN50 = (
    "https://github.com/NVIDIA/DeepLearningExamples/blob/master/PyTorch/Classification/"
    "ConvNets/resnet50v1.5/README.md (pytorch-21.03; batch from configs.yml)"
)


def _torch_bench(model: str, one: float, two: float, eight: float, sixteen: float) -> Case:
    """torch DDP's own benchmark: per-GPU rates on 1 (no DDP), 2, 8 and 16 GPUs."""
    return Case(
        f"torch DDP benchmark, {_LABEL[model]}",
        model,
        32,
        "v100-dgx1",
        "fp32",
        "sgd",
        "torch DDP",
        one,
        1,
        _points(
            (1, 2, two / one), (1, 8, eight / one), (1, 16, sixteen / one), (8, 16, sixteen / eight)
        ),
        _DDP_BENCH,
        _DDP_QUOTES[model],
    )


def _horovod(
    model: str,
    one: float,
    points: Tuple[Point, ...],
    scale: str,
    source: str,
    quote: str,
    caveat: str,
) -> Case:
    """Horovod's benchmark on its 25 Gb/s Pascal cluster, batch 64 per GPU."""
    return Case(
        f"Horovod {scale} GPUs, {_LABEL[model]}",
        model,
        64,
        "p100-pcie-25gbe",
        "fp32",
        "sgd",
        "horovod",
        one,
        1,
        points,
        source,
        quote,
        caveat,
    )


def _rn50(
    machine: str, system: str, precision: str, batch: int, one: float, eight: float, speedup: str
) -> Case:
    """NVIDIA's ResNet-50 v1.5 training rates on 1 and 8 GPUs of one machine
    (`speedup`: its "Strong Scaling" column, verbatim)."""
    memory = "16GB" if system == "v100-dgx1" else "80GB"
    return Case(
        f"NVIDIA RN50 v1.5, {machine} {precision.upper()}",
        "resnet50",
        batch,
        system,
        precision,
        "sgd",
        "torch DDP",
        one,
        1,
        _points((1, 8, eight / 8 / one)),
        _DLE_RN50,
        f"{machine} {memory}: 1 GPU {one:g} img/s, 8 GPUs {eight:g} img/s ({speedup})",
        "includes the DALI input pipeline",
    )


_LABEL = {
    "resnet50": "ResNet-50",
    "resnet101": "ResNet-101",
    "inception_v3": "Inception V3",
    "vgg16": "VGG-16",
}
_DDP_QUOTES = {
    "resnet50": "resnet50 | 0.097s 329/s (1 GPU, no DDP) | 1M/2G 0.103s 310/s | 1M/8G 0.104s "
    "307/s | 2M/8G 0.104s 306/s",
    "resnet101": "resnet101 | 0.162s 197/s (1 GPU, no DDP) | 1M/2G 0.176s 182/s | 1M/8G 0.179s "
    "179/s | 2M/8G 0.179s 178/s",
}
_HOROVOD_CAVEAT = (
    "GPU model not stated (a maintainer: PCIe Pascal servers, 2 GPUs per CPU; "
    "horovod#979); TensorFlow, synthetic data"
)
_HOROVOD_512_QUOTE = (
    '"Horovod achieves 90% scaling efficiency for both Inception V3 and ResNet-101, '
    'and 68% [512 GPUs; 79% at 128] scaling efficiency for VGG-16"'
)
_HOROVOD_512_CAVEAT = (
    "single-GPU rate taken from the 16-GPU table; per-GPU batch 64 or 32 (horovod#425)"
)


def _horovod16(model: str, one: float, sixteen: float, speedup: str) -> Case:
    quote = f"{_LABEL[model]}: single GPU {one:g}, 16 GPUs {sixteen:,.1f} ({speedup})"
    points = _points((1, 16, sixteen / 16 / one))
    return _horovod(model, one, points, "16", _HOROVOD_OLD, quote, _HOROVOD_CAVEAT)


def _horovod512(model: str, one: float, at128: float, at512: float) -> Case:
    points = _points((1, 128, at128), (1, 512, at512), (128, 512, at512 / at128))
    source = _HOROVOD_DOCS + " (and its 128-GPU version)"
    return _horovod(model, one, points, "128/512", source, _HOROVOD_512_QUOTE, _HOROVOD_512_CAVEAT)


_DLE = "https://github.com/NVIDIA/DeepLearningExamples/blob/"
_DLE_TF_RN50 = (
    _DLE + "1d4211fe9d94550d7bc72bb9b0ac4f576533ca52/TensorFlow/Classification/ConvNets/"
    "resnet50v1.5/README.md (TensorFlow 20.06-tf1, XLA, training_perf.sh, weak scaling)"
)
_DLE_MX_RN50 = (
    _DLE + "134510b4b7ff6225a76805b809e414fec3163071/MxNet/Classification/RN50v1.5/"
    "README.md (mxnet-20.12, benchmark.py, total IPS with data, weak scaling)"
)
_DLE_BERT_2111 = (
    _DLE + "1c7f6137d89ae25fad2c65de5f318f759c6fcbed/PyTorch/LanguageModeling/BERT/README.md "
    "(pytorch:21.11, pre-training phase 1, sequence 128, weak scaling by accumulation)"
)
_DLE_BERT_1907 = (
    _DLE + "23a6382cbe8f77c22b0a7b7d263191ee6b947dfa/PyTorch/LanguageModeling/BERT/README.md "
    "(pytorch:19.07, multi-node DGX-2H, FP16, sequence 128, batch 64 per GPU; "
    "accumulation 64, 16 and 4 on 1, 4 and 16 nodes from its loss table)"
)
_DLE_TF_BERT = (
    _DLE + "002bcd8c45a0ae4bdf2f01918ab22e0752ffa3e6/TensorFlow/LanguageModeling/BERT/"
    "README.md (TF 20.06, multi-node DGX A100 40GB, mixed precision, sequence 128, "
    "batch 64 per GPU, global batch 65,536 by accumulation)"
)


def _weak(
    framework: str,
    machine: str,
    system: str,
    precision: str,
    batch: int,
    rates: Tuple[Tuple[int, float], ...],
    source: str,
    caveat: str = "",
) -> Case:
    """ResNet-50 v1.5, images/s at each GPU count of one machine, the first
    at 1 GPU (weak scaling: the same batch per GPU)."""
    (one_gpus, one), rest = rates[0], rates[1:]
    assert one_gpus == 1
    quote = ", ".join(f"{g} GPU{'s' if g > 1 else ''} {r:g} img/s" for g, r in rates)
    return Case(
        f"{framework} RN50 v1.5, {machine} {precision.upper()}",
        "resnet50",
        batch,
        system,
        precision,
        "sgd",
        "horovod" if framework == "TensorFlow" else "torch DDP",
        one,
        1,
        _points(*((1, g, r / g / one) for g, r in rest)),
        source,
        f"{machine}: {quote}",
        caveat,
    )


def _bert_node(
    machine: str,
    system: str,
    precision: str,
    batch: int,
    accumulate: int,
    one: float,
    eight: float,
    source: str,
) -> Case:
    """BERT-large pre-training on 1 and 8 GPUs of one node, the same
    accumulation on each (weak scaling), one FP16 all-reduce after it."""
    return Case(
        f"NVIDIA BERT-large, {machine} {precision.upper()}",
        "bert-large",
        batch,
        system,
        precision,
        "adamw",
        "one all-reduce",
        one,
        accumulate,
        (Point(1, 8, eight / 8 / one, accumulate, accumulate),),
        source,
        f"{machine}: 1 GPU {one:g} seq/s, 8 GPUs {eight:g} seq/s, {accumulate} micro-batches "
        f"of {batch}",
        "LAMB priced as AdamW; micro-batch per the later 21.11 revision's column",
        fp16_gradients=True,
    )


def _bert_nodes(
    name: str,
    system: str,
    batch: int,
    node_gpus: int,
    runs: Tuple[Tuple[int, float, int], ...],
    source: str,
    quote: str,
    caveat: str,
) -> Case:
    """BERT-large pre-training with AMP on whole nodes: `runs` gives (nodes,
    sequences/s, micro-batches per step), the first the baseline; one FP16
    all-reduce after the accumulated micro-batches, calibrated at one node."""
    (base_nodes, base_rate, base_accumulate), rest = runs[0], runs[1:]
    assert base_nodes == 1
    return Case(
        name,
        "bert-large",
        batch,
        system,
        "amp",
        "adamw",
        "one all-reduce",
        base_rate / node_gpus,
        base_accumulate,
        tuple(
            Point(node_gpus, nodes * node_gpus, rate / nodes / base_rate, base_accumulate, acc)
            for nodes, rate, acc in rest
        ),
        source,
        quote,
        caveat,
        fp16_gradients=True,
        calibrate_gpus=node_gpus,
    )


CASES: Sequence[Case] = (
    _torch_bench("resnet50", 329, 310, 307, 306),
    _torch_bench("resnet101", 197, 182, 179, 178),
    _horovod16("inception_v3", 134.4, 2022.6, "15.0x"),
    _horovod16("resnet101", 119.4, 1746.2, "14.6x"),
    _horovod16("vgg16", 130.9, 1787.4, "13.7x"),
    _horovod512("inception_v3", 134.4, 0.90, 0.90),
    _horovod512("resnet101", 119.4, 0.90, 0.90),
    _horovod512("vgg16", 130.9, 0.79, 0.68),
    _rn50("DGX-1", "v100-dgx1", "fp32", 112, 367, 2855, "7.76x"),
    _rn50("DGX-1", "v100-dgx1", "amp", 256, 1200, 8322, "6.93x"),
    _rn50("DGX A100", "a100-dgx", "tf32", 256, 938, 7248, "7.72x"),
    _rn50("DGX A100", "a100-dgx", "amp", 256, 2470, 16621, "6.72x"),
    Case(
        "NVIDIA BERT-large on DGX A100, 1-32 nodes",
        "bert-large",
        256,
        "a100-dgx",
        "amp",
        "adamw",
        "one all-reduce",
        4553 / 8 * 32 / 32,
        32,
        tuple(
            Point(8, 8 * nodes, published, 32, 32 // nodes)
            for nodes, published in (
                (2, 2.02 / 2),
                (4, 3.98 / 4),
                (8, 7.86 / 8),
                (16, 15.50 / 16),
                (32, 30.37 / 32),
            )
        ),
        "https://github.com/NVIDIA/DeepLearningExamples/blob/master/PyTorch/LanguageModeling/"
        "BERT/README.md (pytorch:21.11, multi-node DGX A100 80GB, AMP, sequence 128, "
        "batch 256 per GPU, global batch 65,536 by gradient accumulation); "
        "scripts/run_pretraining.sh: allreduce_post_accumulation=true, "
        "allreduce_post_accumulation_fp16=true",
        "AMP throughput 4553 (1 node), 9191 (2), 18119 (4), 35774 (8), 70555 (16), "
        "138294 (32 nodes); strong scaling 2.02, 3.98, 7.86, 15.50, 30.37",
        "strong scaling: 32 micro-batches per step on 1 node, 1 on 32 nodes; one FP16 "
        "all-reduce after them; LAMB priced as AdamW; the "
        "inter-node network is not stated (a DGX A100 has 8x HDR 200 Gb/s)",
        fp16_gradients=True,
        calibrate_gpus=8,
    ),
    _bert_nodes(
        "NVIDIA BERT-large on DGX-1, 1-16 nodes",
        "v100-dgx1",
        16,
        8,
        ((1, 874.24, 512), (4, 3089.76, 128), (16, 12144.64, 32)),
        "https://github.com/NVIDIA/DeepLearningExamples/blob/master/PyTorch/LanguageModeling/"
        'BERT/README.md, July 2020 revision, "Pre-training on multiple NVIDIA DGX-1 With '
        '16G" (pytorch:19.07-py3, FP16, sequence 128, batch 16 per GPU); the same '
        "revision's pre-training table: global batch 65,536 by accumulating 512, 128 and "
        "32 micro-batches on 1, 4 and 16 nodes",
        "AMP seq/s 874.24 (1 node), 3089.76 (4 nodes, weak scaling 3.53), 12144.64 (16 "
        "nodes, 13.89)",
        "the throughput table does not state its accumulation: taken from the same "
        "release's pre-training table; the network is not stated (DGX-1: 4x EDR)",
    ),
    _weak("TensorFlow", "DGX A100", "a100-dgx", "tf32", 256, ((1, 909), (8, 7000)), _DLE_TF_RN50),
    _weak("TensorFlow", "DGX A100", "a100-dgx", "amp", 256, ((1, 2375), (8, 17400)), _DLE_TF_RN50),
    _weak("TensorFlow", "DGX-1", "v100-dgx1", "fp32", 128, ((1, 412), (8, 3170)), _DLE_TF_RN50),
    _weak("TensorFlow", "DGX-1", "v100-dgx1", "amp", 256, ((1, 1270), (8, 9510)), _DLE_TF_RN50),
    _weak("TensorFlow", "DGX-2", "v100-dgx2", "fp32", 128, ((1, 432), (16, 6500)), _DLE_TF_RN50),
    _weak("TensorFlow", "DGX-2", "v100-dgx2", "amp", 256, ((1, 1300), (16, 17250)), _DLE_TF_RN50),
    _weak(
        "MXNet",
        "DGX A100",
        "a100-dgx",
        "tf32",
        256,
        ((1, 1022), (2, 2032), (4, 4035), (8, 8001)),
        _DLE_MX_RN50,
    ),
    _weak(
        "MXNet",
        "DGX A100",
        "a100-dgx",
        "amp",
        256,
        ((1, 2180), (2, 4332), (4, 8587), (8, 16925)),
        _DLE_MX_RN50,
    ),
    _weak(
        "MXNet",
        "DGX-1",
        "v100-dgx1",
        "fp32",
        96,
        ((1, 384), (2, 763), (4, 1513), (8, 3005)),
        _DLE_MX_RN50,
    ),
    _weak(
        "MXNet",
        "DGX-1",
        "v100-dgx1",
        "amp",
        192,
        ((1, 1376), (2, 2768), (4, 5357), (8, 10723)),
        _DLE_MX_RN50,
    ),
    _weak(
        "MXNet",
        "DGX-2",
        "v100-dgx2",
        "fp32",
        128,
        ((1, 417), (2, 821), (4, 1623), (8, 3223), (16, 6338)),
        _DLE_MX_RN50,
    ),
    _weak(
        "MXNet",
        "DGX-2",
        "v100-dgx2",
        "amp",
        256,
        ((1, 1492), (2, 2935), (4, 5726), (8, 11368), (16, 21484)),
        _DLE_MX_RN50,
    ),
    _bert_node("DGX A100", "a100-dgx", "amp", 256, 32, 580, 4591, _DLE_BERT_2111),
    _bert_node("DGX A100", "a100-dgx", "tf32", 128, 64, 317, 2505, _DLE_BERT_2111),
    _bert_node("DGX-1 32GB", "v100-dgx1", "amp", 64, 64, 224, 1746, _DLE_BERT_2111),
    _bert_node("DGX-1 32GB", "v100-dgx1", "fp32", 32, 128, 50, 387, _DLE_BERT_2111),
    _bert_nodes(
        "NVIDIA BERT-large on DGX-2H, 1-16 nodes",
        "v100-dgx2",
        64,
        16,
        ((1, 3379.2, 64), (4, 12709.88, 16), (16, 51937.28, 4)),
        _DLE_BERT_1907,
        "seq/s 3379.2 (1 node), 12709.88 (4 nodes, 3.76), 51937.28 (16 nodes, 15.37)",
        "LAMB priced as AdamW; the network is not stated (DGX-2H: 8x EDR)",
    ),
    _bert_nodes(
        "NVIDIA TF BERT-large on DGX A100, 1-32 nodes",
        "a100-dgx",
        64,
        8,
        ((1, 2871.89, 128), (4, 11159, 32), (16, 41144, 8), (32, 77479.87, 4)),
        _DLE_TF_BERT,
        "mixed precision seq/s 2871.89 (1 node), 11159 (4 nodes), 41144 (16), 77479.87 (32)",
        "Horovod all-reduce after the accumulated micro-batches, taken as FP16 gradients; "
        "accumulation 128/32/8/4 from the global batch 65,536; LAMB priced as AdamW; the "
        "network is not stated (a DGX A100 has 8x HDR 200 Gb/s)",
    ),
)
