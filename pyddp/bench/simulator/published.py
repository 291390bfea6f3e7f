"""Published data-parallel scaling results (cases.py), each reproduced from
its own setup by `pyddp-bench simulate --validate`: predicted vs published
scaling efficiency, side by side, with the error in points; the Effects
fitted on the fit half (fit), their cross-validation there and the band it
gives every prediction (cross_validate, band).

Efficiency is throughput per GPU at N over throughput per GPU at the
baseline count (1 GPU, or one node where that is what the publication
compares with).

Two predictions per point:
- "calibrated": the roofline profile scaled so that the one-GPU step takes
  what the publication measured. This checks what the simulator is for, the
  communication and its overlap, on the publication's own compute time.
- "roofline": the roofline's own compute time, uncalibrated; the table also
  shows its one-GPU throughput against the published one.
"""

from __future__ import annotations

import zlib
from dataclasses import astuple, replace
from functools import cache
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .._util import pyplot, save_figure
from . import costmodel, hardware, simulate
from .architectures import PRESETS
from .cases import CASES, Case, Point

__all__ = ["CASES", "Case", "Point", "held_out", "run", "fit", "cross_validate", "band"]


def held_out(case: Case) -> bool:
    """THE SPLIT, fixed before anything was fitted: a case (every point of one
    publication's setup together, so no setup is on both sides) is held out
    when the CRC-32 of its name is odd. Effects are fitted on the other half
    only; the held-out half's miss is what the README reports."""
    return zlib.crc32(case.name.encode()) % 2 == 1


def calibrated_at(
    profile: costmodel.Profile,
    system: hardware.System,
    gpus: int,
    policy: str,
    accumulate: int,
    measured_s: float,
    effects: simulate.Effects = simulate.NO_EFFECTS,
) -> costmodel.Profile:
    """The profile's compute scaled so that the simulated step at `gpus` GPUs
    (`accumulate` micro-batches, `policy`, `effects`) takes `measured_s`:
    communication there is the model's, compute is the measurement's."""
    hi = profile.calibrated(measured_s, accumulate)  # compute alone takes it all
    if gpus == 1:
        return hi

    def at(factor: float) -> float:
        scaled = profile.scaled(factor, "")
        return simulate.step(scaled, system, gpus, policy, accumulate, effects=effects).step_s

    factor = hi.forward_s / profile.forward_s
    tiny = at(factor * 1e-9)
    if tiny >= measured_s:
        raise ValueError(
            f"communication alone ({tiny * 1e3:.1f} ms) exceeds the measured step "
            f"({measured_s * 1e3:.1f} ms) at {gpus} GPUs of {system.name}"
        )
    lo_f, hi_f = 0.0, factor
    for _ in range(60):  # the step grows with the compute factor: bisect
        mid = (lo_f + hi_f) / 2
        lo_f, hi_f = (mid, hi_f) if at(mid) < measured_s else (lo_f, mid)
    return profile.scaled(hi_f, f"{profile.source}, calibrated at {gpus} GPUs under {policy}")


def _calibrate(
    profile: costmodel.Profile,
    system: hardware.System,
    case: Case,
    measured_s: float,
    effects: simulate.Effects,
) -> costmodel.Profile:
    """Compute scaled to the publication's rate where it measured it."""
    try:
        return calibrated_at(
            profile,
            system,
            case.calibrate_gpus,
            case.policy,
            case.one_gpu_accumulate,
            measured_s,
            effects,
        )
    except ValueError as e:
        raise ValueError(f"{case.name}: {e}: the hardware preset is wrong") from None


@cache
def _trace(model: str, batch: int) -> costmodel.Trace:
    preset = PRESETS[model]
    with torch.device("meta"):
        built = preset.build()
    return costmodel.record(built, *preset.example(batch))


def _roofline(case: Case) -> costmodel.Profile:
    system = hardware.SYSTEMS[case.system]
    trace = _trace(case.model, case.batch)
    roofline = costmodel.price(trace, system.gpu, case.precision, case.optimizer)
    if case.fp16_gradients:
        n = len(roofline.param_bytes)
        roofline = replace(
            roofline, param_bytes=[b // 2 for b in roofline.param_bytes], dtypes=["float16"] * n
        )
    return roofline


def _efficiency(
    profile: costmodel.Profile,
    system: hardware.System,
    case: Case,
    point: Point,
    effects: simulate.Effects,
) -> float:
    """Per-GPU throughput at point.gpus over that at point.baseline (samples
    per step differ with accumulation)."""
    base = simulate.step(
        profile, system, point.baseline, case.policy, point.baseline_accumulate, effects=effects
    )
    at = simulate.step(profile, system, point.gpus, case.policy, point.accumulate, effects=effects)
    return (point.accumulate / at.step_s) / (point.baseline_accumulate / base.step_s)


def run(
    cases: Sequence[Case] = CASES, effects: Optional[simulate.Effects] = None
) -> List[Dict[str, Any]]:
    """One row per (case, GPU count): published, predicted with `effects`
    (default simulate.FITTED), with the communication model alone, and with
    the uncalibrated roofline."""
    effects = simulate.FITTED if effects is None else effects
    rows = []
    for case in cases:
        system = hardware.SYSTEMS[case.system]
        roofline = _roofline(case)
        k = case.one_gpu_accumulate
        measured = k * case.batch / case.one_gpu_per_s
        calibrated = _calibrate(roofline, system, case, measured, effects)
        bare = _calibrate(roofline, system, case, measured, simulate.NO_EFFECTS)
        for point in case.points:
            predicted = _efficiency(calibrated, system, case, point, effects)
            rows.append(
                {
                    "case": case.name,
                    "half": "held out" if held_out(case) else "fit",
                    "model": case.model,
                    "batch": case.batch,
                    "system": case.system,
                    "precision": case.precision,
                    "policy": case.policy,
                    "gpus": point.gpus,
                    "baseline_gpus": point.baseline,
                    "published": point.published,
                    "predicted": predicted,
                    "error_points": 100 * (predicted - point.published),
                    "predicted_comm_only": _efficiency(
                        bare, system, case, point, simulate.NO_EFFECTS
                    ),
                    "predicted_roofline": _efficiency(
                        roofline, system, case, point, simulate.NO_EFFECTS
                    ),
                    "one_gpu_published_per_s": case.one_gpu_per_s,
                    "one_gpu_roofline_per_s": k * case.batch / roofline.step_s(k),
                    "source": case.source,
                    "quote": case.quote,
                    "caveat": case.caveat,
                }
            )
    return rows


# The grid fit() searches (each effect from zero up).
GRID = {
    "overhead": [i * 0.0025 for i in range(41)],  # 0 to 10% of a micro-batch
    "interference": [i * 0.05 for i in range(21)],  # 0 to 1 s per overlapped s
    "jitter": [i * 0.001 for i in range(41)],  # coefficient of variation 0 to 4%
}


@cache
def _terms(case: Case) -> Tuple[Tuple[float, Tuple[float, ...], Tuple[float, ...]], ...]:
    """Per point of `case`: its published efficiency and, at the baseline
    and at its GPU count, (step seconds with no effects, micro-batches, the
    three terms simulate.Effects multiplies), compute calibrated as run()
    does without effects: the effects then add in closed form."""
    system = hardware.SYSTEMS[case.system]
    k = case.one_gpu_accumulate
    measured = k * case.batch / case.one_gpu_per_s
    profile = _calibrate(_roofline(case), system, case, measured, simulate.NO_EFFECTS)
    compute = profile.forward_s + profile.backward_s
    out = []
    for point in case.points:
        ends = []
        for gpus, acc in (
            (point.baseline, point.baseline_accumulate),
            (point.gpus, point.accumulate),
        ):
            s = simulate.step(profile, system, gpus, case.policy, acc)
            ends.append((s.step_s, acc, *simulate.Effects.terms(gpus, compute, acc, s.overlap_s)))
        out.append((point.published, ends[0], ends[1]))
    return tuple(out)


def _arrays(cases: Sequence[Case]) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """_terms of every point of `cases` as arrays: the published
    efficiencies, and per end (baseline, point) one row each of (step with
    no effects, micro-batches, terms...)."""
    rows = [t for case in cases for t in _terms(case)]
    return (
        np.array([r[0] for r in rows]),
        np.array([r[1] for r in rows]),
        np.array([r[2] for r in rows]),
    )


def _predict(base: np.ndarray, at: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Efficiencies (grid rows x points) with each grid row's coefficients
    multiplying the terms (columns 2 on of `base` and `at`)."""
    base_s = base[:, 0] + grid @ base[:, 2:].T
    at_s = at[:, 0] + grid @ at[:, 2:].T
    return (at[:, 1] / at_s) / (base[:, 1] / base_s)


def _efficiencies(cases: Sequence[Case], grid: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Predicted efficiency of every point of `cases` (columns) under every
    row of `grid` (overhead, interference, jitter); and the published ones."""
    published, base, at = _arrays(cases)
    return _predict(base, at, grid), published


def _fit(cases: Sequence[Case]) -> simulate.Effects:
    """The Effects on GRID with the least squared miss over `cases`' points."""
    axes = np.meshgrid(*(np.array(GRID[k]) for k in GRID), indexing="ij")
    grid = np.stack([a.ravel() for a in axes], axis=1)
    predicted, published = _efficiencies(cases, grid)
    best = grid[int(np.argmin(((predicted - published) ** 2).sum(axis=1)))]
    return simulate.Effects(*(round(float(v), 6) for v in best))


def fit(cases: Sequence[Case] = CASES) -> simulate.Effects:
    """The Effects with the least squared miss over the FIT half's points
    (held_out() false), searched on GRID. Squares, not absolute values: a
    least-absolute fit follows the median point and leaves the mean signed
    miss positive, where the publications' unexplained losses pile up;
    cross_validate() compares the two. Each point's communication is
    simulated once with no effects, compute calibrated as run() does; the
    effects then add in closed form (simulate.Effects.terms)."""
    return _fit([c for c in cases if not held_out(c)])


def cross_validate(cases: Sequence[Case] = CASES) -> List[Dict[str, Any]]:
    """Leave one case out, on the fit half only: each fit-half case's points
    predicted by the Effects fitted to the other fit-half cases. Its misses
    are out of sample, so they say how far a prediction can be trusted
    (band()) without touching the held-out half."""
    mine = [c for c in cases if not held_out(c)]
    rows = []
    for case in mine:
        effects = _fit([c for c in mine if c is not case])
        predicted, published = _efficiencies([case], np.array([astuple(effects)]))
        for point, p, q in zip(case.points, predicted[0], published):
            rows.append(
                {
                    "case": case.name,
                    "gpus": point.gpus,
                    "baseline_gpus": point.baseline,
                    "published": float(q),
                    "predicted": float(p),
                    "error_points": 100 * float(p - q),
                }
            )
    return rows


def band(cv_rows: Sequence[Dict[str, Any]], coverage: float = 0.8) -> simulate.Band:
    """The band that held `coverage` of the cross-validated misses: between
    their (1 - coverage)/2 and (1 + coverage)/2 quantiles, in points."""
    if not 0 < coverage < 1:
        raise ValueError(f"coverage={coverage!r}: give a fraction between 0 and 1")
    errors = np.array([r["error_points"] for r in cv_rows])
    if not len(errors):
        raise ValueError("no misses to take a band from: cross_validate() gave no rows")
    tail = (1 - coverage) / 2
    low, high = np.quantile(errors, [tail, 1 - tail])
    return simulate.Band(
        below=round(float(high), 1), above=round(float(-low), 1), coverage=coverage
    )


def covered(rows: Sequence[Dict[str, Any]], b: simulate.Band) -> int:
    """How many of `rows` have their published efficiency inside the band
    around their prediction."""
    return sum(1 for r in rows if -b.above <= r["error_points"] <= b.below)


def summary(
    rows: Sequence[Dict[str, Any]],
    cv_rows: Sequence[Dict[str, Any]] = (),
    b: simulate.Band = simulate.BAND,
) -> Dict[str, Dict[str, float]]:
    """Per half: points, mean absolute miss (points) of the model, of the
    communication model alone and of the trivial "always 100%" predictor,
    the model's mean signed miss, how many it over-predicts and how many
    published values lie inside the band `b` around it; with `cv_rows`
    (cross_validate()), the same for the fit half's out-of-sample
    predictions (no communication-alone figure there)."""
    out: Dict[str, Dict[str, float]] = {}
    halves = [(h, [r for r in rows if r["half"] == h]) for h in ("fit", "held out")]
    if cv_rows:
        halves.insert(1, ("fit, each case left out of the fit", list(cv_rows)))
    for half, mine in halves:
        n = len(mine)
        out[half] = {
            "points": n,
            "model": sum(abs(r["error_points"]) for r in mine) / n,
            "model_signed": sum(r["error_points"] for r in mine) / n,
            "always_100": sum(abs(100 - 100 * r["published"]) for r in mine) / n,
            "positive": sum(1 for r in mine if r["error_points"] > 0),
            "in_band": covered(mine, b),
        }
        out[half]["ratio"] = out[half]["model"] / out[half]["always_100"]
        if all("predicted_comm_only" in r for r in mine):
            out[half]["comm_only"] = (
                sum(abs(100 * (r["predicted_comm_only"] - r["published"])) for r in mine) / n
            )
    return out


def markdown_summary(summary: Dict[str, Dict[str, float]], b: simulate.Band = simulate.BAND) -> str:
    """The held-out comparison as the README shows it."""
    lines = [
        "| half | points | mean miss, model | mean signed miss, model | over / under "
        f"| inside the {b.coverage:.0%} band | mean miss, communication alone "
        '| mean miss, "always 100%" |',
        "|---|---|---|---|---|---|---|---|",
    ]
    for half, s in summary.items():
        comm = f"{s['comm_only']:.2f}" if "comm_only" in s else "-"
        lines.append(
            f"| {half} | {s['points']} | {s['model']:.2f} | {s['model_signed']:+.2f} "
            f"| {s['positive']} / {s['points'] - s['positive']} | {s['in_band']} "
            f"| {comm} | {s['always_100']:.2f} |"
        )
    return "\n".join(lines)


def markdown(rows: Sequence[Dict[str, Any]]) -> str:
    """The validation table as the docs show it."""
    lines = [
        "| Publication, setup | half | GPUs | published | predicted | error, points "
        "| communication alone | roofline only | rate per GPU, published / roofline compute |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['half']} | {r['baseline_gpus']}→{r['gpus']} "
            f"| {100 * r['published']:.1f}% | {100 * r['predicted']:.1f}% "
            f"| {r['error_points']:+.1f} | {100 * r['predicted_comm_only']:.1f}% "
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
