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
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .._util import pyplot, save_figure
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
                    "one_gpu_roofline_per_s": k * case.batch / roofline.step_s(k),
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
    plt = pyplot()
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
    return save_figure(fig, path, 120)
