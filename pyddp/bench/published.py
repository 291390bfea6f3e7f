"""Published data-parallel scaling results, each reproduced from its own
setup by `pyddp-bench simulate --validate`: predicted vs published scaling
efficiency, side by side, with the error in points.

Each case gives the publication's model, per-GPU batch, precision, hardware
(a hardware.SYSTEMS preset), the gradient-sync policy its framework used, its
single-GPU throughput and its efficiency at N GPUs. Efficiency is throughput
per GPU at N over throughput per GPU at the baseline count (1 GPU, or one
node where that is what the publication compares with).

Two predictions per point:
- "calibrated": the roofline profile scaled so that the one-GPU step takes
  what the publication measured. This checks what the simulator is for, the
  communication and its overlap, on the publication's own compute time.
- "roofline": the roofline's own compute time, uncalibrated; the table also
  shows its one-GPU throughput against the published one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch

from . import costmodel, hardware, simulate
from .architectures import PRESETS


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

CASES: Sequence[Case] = (
    Case(
        "torch DDP benchmark, ResNet-50",
        "resnet50",
        32,
        "v100-dgx1",
        "fp32",
        "sgd",
        "torch DDP",
        329,
        1,
        _points((1, 2, 310 / 329), (1, 8, 307 / 329), (1, 16, 306 / 329), (8, 16, 306 / 307)),
        _DDP_BENCH,
        "resnet50 | 0.097s 329/s (1 GPU, no DDP) | 1M/2G 0.103s 310/s | 1M/8G 0.104s 307/s "
        "| 2M/8G 0.104s 306/s",
    ),
    Case(
        "torch DDP benchmark, ResNet-101",
        "resnet101",
        32,
        "v100-dgx1",
        "fp32",
        "sgd",
        "torch DDP",
        197,
        1,
        _points((1, 2, 182 / 197), (1, 8, 179 / 197), (1, 16, 178 / 197), (8, 16, 178 / 179)),
        _DDP_BENCH,
        "resnet101 | 0.162s 197/s (1 GPU, no DDP) | 1M/2G 0.176s 182/s | 1M/8G 0.179s 179/s "
        "| 2M/8G 0.179s 178/s",
    ),
    Case(
        "Horovod 16 GPUs, Inception V3",
        "inception_v3",
        64,
        "p100-pcie-25gbe",
        "fp32",
        "sgd",
        "horovod",
        134.4,
        1,
        _points((1, 16, 2022.6 / 16 / 134.4)),
        _HOROVOD_OLD,
        "Inception V3: single GPU 134.4, 16 GPUs 2,022.6 (15.0x)",
        "GPU model not stated (a maintainer: PCIe Pascal servers, 2 GPUs per CPU; "
        "horovod#979); TensorFlow, synthetic data",
    ),
    Case(
        "Horovod 16 GPUs, ResNet-101",
        "resnet101",
        64,
        "p100-pcie-25gbe",
        "fp32",
        "sgd",
        "horovod",
        119.4,
        1,
        _points((1, 16, 1746.2 / 16 / 119.4)),
        _HOROVOD_OLD,
        "ResNet-101: single GPU 119.4, 16 GPUs 1,746.2 (14.6x)",
        "as above",
    ),
    Case(
        "Horovod 16 GPUs, VGG-16",
        "vgg16",
        64,
        "p100-pcie-25gbe",
        "fp32",
        "sgd",
        "horovod",
        130.9,
        1,
        _points((1, 16, 1787.4 / 16 / 130.9)),
        _HOROVOD_OLD,
        "VGG-16: single GPU 130.9, 16 GPUs 1,787.4 (13.7x)",
        "as above",
    ),
    Case(
        "Horovod 128/512 GPUs, Inception V3",
        "inception_v3",
        64,
        "p100-pcie-25gbe",
        "fp32",
        "sgd",
        "horovod",
        134.4,
        1,
        _points((1, 128, 0.90), (1, 512, 0.90), (128, 512, 1.0)),
        _HOROVOD_DOCS + " (and its 128-GPU version)",
        '"Horovod achieves 90% scaling efficiency for both Inception V3 and ResNet-101, '
        'and 68% [512 GPUs; 79% at 128] scaling efficiency for VGG-16"',
        "single-GPU rate taken from the 16-GPU table; per-GPU batch 64 or 32 (horovod#425)",
    ),
    Case(
        "Horovod 128/512 GPUs, ResNet-101",
        "resnet101",
        64,
        "p100-pcie-25gbe",
        "fp32",
        "sgd",
        "horovod",
        119.4,
        1,
        _points((1, 128, 0.90), (1, 512, 0.90), (128, 512, 1.0)),
        _HOROVOD_DOCS,
        "as above",
        "as above",
    ),
    Case(
        "Horovod 128/512 GPUs, VGG-16",
        "vgg16",
        64,
        "p100-pcie-25gbe",
        "fp32",
        "sgd",
        "horovod",
        130.9,
        1,
        _points((1, 128, 0.79), (1, 512, 0.68), (128, 512, 0.68 / 0.79)),
        _HOROVOD_DOCS,
        "as above",
        "as above",
    ),
    Case(
        "NVIDIA RN50 v1.5, DGX-1 FP32",
        "resnet50",
        112,
        "v100-dgx1",
        "fp32",
        "sgd",
        "torch DDP",
        367,
        1,
        _points((1, 8, 2855 / 8 / 367)),
        _DLE_RN50,
        "DGX-1 16GB: 1 GPU 367 img/s, 8 GPUs 2855 img/s (7.76x)",
        "includes the DALI input pipeline",
    ),
    Case(
        "NVIDIA RN50 v1.5, DGX-1 AMP",
        "resnet50",
        256,
        "v100-dgx1",
        "amp",
        "sgd",
        "torch DDP",
        1200,
        1,
        _points((1, 8, 8322 / 8 / 1200)),
        _DLE_RN50,
        "DGX-1 16GB: 1 GPU 1200 img/s, 8 GPUs 8322 img/s (6.93x)",
        "includes the DALI input pipeline",
    ),
    Case(
        "NVIDIA RN50 v1.5, DGX A100 TF32",
        "resnet50",
        256,
        "a100-dgx",
        "tf32",
        "sgd",
        "torch DDP",
        938,
        1,
        _points((1, 8, 7248 / 8 / 938)),
        _DLE_RN50,
        "DGX A100 80GB: 1 GPU 938 img/s, 8 GPUs 7248 img/s (7.72x)",
        "includes the DALI input pipeline",
    ),
    Case(
        "NVIDIA RN50 v1.5, DGX A100 AMP",
        "resnet50",
        256,
        "a100-dgx",
        "amp",
        "sgd",
        "torch DDP",
        2470,
        1,
        _points((1, 8, 16621 / 8 / 2470)),
        _DLE_RN50,
        "DGX A100 80GB: 1 GPU 2470 img/s, 8 GPUs 16621 img/s (6.72x)",
        "includes the DALI input pipeline",
    ),
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
    Case(
        "NVIDIA BERT-large on DGX-1, 1-16 nodes",
        "bert-large",
        16,
        "v100-dgx1",
        "amp",
        "adamw",
        "one all-reduce",
        874.24 / 8,
        512,
        (
            Point(8, 32, 3089.76 / 4 / 874.24, 512, 128),
            Point(8, 128, 12144.64 / 16 / 874.24, 512, 32),
        ),
        "https://github.com/NVIDIA/DeepLearningExamples/blob/master/PyTorch/LanguageModeling/"
        'BERT/README.md, July 2020 revision, "Pre-training on multiple NVIDIA DGX-1 With '
        '16G" (pytorch:19.07-py3, FP16, sequence 128, batch 16 per GPU); the same '
        "revision's pre-training table: global batch 65,536 by accumulating 512, 128 and "
        "32 micro-batches on 1, 4 and 16 nodes",
        "AMP seq/s 874.24 (1 node), 3089.76 (4 nodes, weak scaling 3.53), 12144.64 (16 "
        "nodes, 13.89)",
        "the throughput table does not state its accumulation: taken from the same "
        "release's pre-training table; the network is not stated (DGX-1: 4x EDR)",
        fp16_gradients=True,
        calibrate_gpus=8,
    ),
)


def _calibrate(
    profile: costmodel.Profile, system: hardware.System, case: Case, measured_s: float
) -> costmodel.Profile:
    """The profile's compute scaled so that the simulated step where the
    publication measured its rate (case.calibrate_gpus GPUs, its
    micro-batches, its policy) takes what it measured: communication there is
    the model's, compute is the publication's."""
    k, gpus = case.one_gpu_accumulate, case.calibrate_gpus
    hi = profile.calibrated(measured_s, k)  # compute alone takes it all
    if gpus == 1:
        return hi
    factor = hi.forward_s / profile.forward_s
    tiny = simulate.step(profile.scaled(factor * 1e-9, ""), system, gpus, case.policy, k).step_s
    if tiny >= measured_s:
        raise ValueError(
            f"{case.name}: communication alone ({tiny * 1e3:.1f} ms) exceeds the published "
            f"step ({measured_s * 1e3:.1f} ms) at {gpus} GPUs: the hardware preset is wrong"
        )
    lo_f, hi_f = 0.0, factor
    for _ in range(60):  # the step grows with the compute factor: bisect
        mid = (lo_f + hi_f) / 2
        step = simulate.step(profile.scaled(mid, ""), system, gpus, case.policy, k).step_s
        lo_f, hi_f = (mid, hi_f) if step < measured_s else (lo_f, mid)
    return profile.scaled(hi_f, f"{profile.source}, calibrated at {gpus} GPUs")


def run(cases: Sequence[Case] = CASES) -> List[Dict[str, Any]]:
    """One row per (case, GPU count)."""
    traces: Dict[Tuple[str, int], costmodel.Trace] = {}
    rows = []
    for case in cases:
        key = (case.model, case.batch)
        if key not in traces:
            preset = PRESETS[case.model]
            with torch.device("meta"):
                model = preset.build()
            traces[key] = costmodel.record(model, *preset.example(case.batch))
        system = hardware.SYSTEMS[case.system]
        roofline = costmodel.price(traces[key], system.gpu, case.precision, case.optimizer)
        if case.fp16_gradients:
            n = len(roofline.param_bytes)
            roofline = replace(
                roofline,
                param_bytes=[b // 2 for b in roofline.param_bytes],
                dtypes=["float16"] * n,
            )
        k = case.one_gpu_accumulate
        measured = k * case.batch / case.one_gpu_per_s
        calibrated = _calibrate(roofline, system, case, measured)
        modelled = k * (roofline.forward_s + roofline.backward_s) + roofline.optimizer_s
        for point in case.points:
            predicted = {}
            for label, profile in (("calibrated", calibrated), ("roofline", roofline)):
                base = simulate.step(
                    profile, system, point.baseline, case.policy, point.baseline_accumulate
                )
                at = simulate.step(profile, system, point.gpus, case.policy, point.accumulate)
                # per-GPU throughput ratio: samples per step differ with accumulation
                predicted[label] = (point.accumulate / at.step_s) / (
                    point.baseline_accumulate / base.step_s
                )
            gpus, baseline, published = point.gpus, point.baseline, point.published
            rows.append(
                {
                    "case": case.name,
                    "model": case.model,
                    "batch": case.batch,
                    "system": case.system,
                    "precision": case.precision,
                    "policy": case.policy,
                    "gpus": gpus,
                    "baseline_gpus": baseline,
                    "published": published,
                    "predicted": predicted["calibrated"],
                    "error_points": 100 * (predicted["calibrated"] - published),
                    "predicted_roofline": predicted["roofline"],
                    "one_gpu_published_per_s": case.one_gpu_per_s,
                    "one_gpu_roofline_per_s": k * case.batch / modelled,
                    "source": case.source,
                    "quote": case.quote,
                    "caveat": case.caveat,
                }
            )
    return rows


def markdown(rows: Sequence[Dict[str, Any]]) -> str:
    """The validation table as the README shows it."""
    lines = [
        "| Publication, setup | GPUs | published | predicted | error, points "
        "| roofline only | rate per GPU, published / roofline compute |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['baseline_gpus']}→{r['gpus']} | {100 * r['published']:.1f}% "
            f"| {100 * r['predicted']:.1f}% | {r['error_points']:+.1f} "
            f"| {100 * r['predicted_roofline']:.1f}% "
            f"| {r['one_gpu_published_per_s']:.0f} / {r['one_gpu_roofline_per_s']:.0f} |"
        )
    return "\n".join(lines)


def chart(rows: Sequence[Dict[str, Any]], path: Any) -> Any:
    """Predicted vs published efficiency, one point per row, with the y = x
    line and the ±5-point band (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    sources = dict.fromkeys(r["case"].split(",")[0] for r in rows)  # publication and setup
    for k, source in enumerate(sources):
        mine = [r for r in rows if r["case"].split(",")[0] == source]
        ax.plot(
            [100 * r["published"] for r in mine],
            [100 * r["predicted"] for r in mine],
            "osD^v"[k % 5],
            label=source,
            alpha=0.8,
        )
    low = min(60.0, *(100 * min(r["published"], r["predicted"]) for r in rows))
    ax.plot([low, 102], [low, 102], "k-", lw=0.8)
    ax.fill_between([low, 102], [low - 5, 97], [low + 5, 107], color="grey", alpha=0.15)
    ax.set_xlim(low, 102)
    ax.set_ylim(low, 102)
    ax.set_xlabel("published scaling efficiency, %")
    ax.set_ylabel("predicted (calibrated compute), %")
    ax.set_title("pyddp-bench simulate --validate (band: ±5 points)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
