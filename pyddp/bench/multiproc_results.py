"""The results of `pyddp-bench overlap --processes N` (multiproc.py): rank
0 combines every rank's samples into the payload the parent writes as JSON
(`combine`), and the parent prints it as a table with its notes (`report`)."""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from ._util import summary, table

PYDDP, DDP = "pyddp", "torch DDP"


def report(result: Dict[str, Any]) -> str:
    """The table and its notes, as the parent prints them."""
    cfg = result["config"]
    rows = [
        [
            r["variant"],
            r["step_s"]["median"] * 1e3,
            r["step_s"]["p10"] * 1e3,
            r["step_s"]["p90"] * 1e3,
            r["cpu_s"]["median"] * 1e3,
            f"{100 * r['overlap_fraction']:.0f}%",
            r["comm_s"] * 1e3,
            r["exposed_comm_s"] * 1e3,
            r["backward_compute_s"] * 1e3,
        ]
        for r in result["results"]
    ]
    ratio, agree = result["ratio"], result["agreement"]
    paired, cpaired = ratio["paired"], ratio["cpu_paired"]
    lines = [
        f"{cfg['model']} width {cfg['width']} depth {cfg['depth']}, global batch "
        f"{cfg['batch']}, {cfg['processes']} processes x 1 CPU replica (torchrun), "
        f"{_plural(cfg['threads'], 'intra-op thread')} per process ({cfg['threads_from']}, "
        f"{cfg['cores']} cores); "
        f"{cfg['rounds']} interleaved A/B samples of {cfg['steps']} steps after a warm-up round",
        table(
            [
                "variant",
                "step ms",
                "p10",
                "p90",
                "CPU ms",
                "overlap",
                "comm ms",
                "exposed comm ms",
                "bwd compute ms",
            ],
            rows,
        ),
        f"pyddp / torch DDP step time: {ratio['pyddp_over_ddp']:.3f}x (ratio of the medians); "
        f"per-round paired ratios p10-p90 {paired['p10']:.3f}-{paired['p90']:.3f}; CPU time "
        f"{ratio['cpu_pyddp_over_ddp']:.3f}x (paired p10-p90 {cpaired['p10']:.3f}-"
        f"{cpaired['p90']:.3f})",
        f"cross-process agreement (pyddp: building it and reading its sums, mean over ranks "
        f"and timed steps): {agree['mean_us']:.1f} us per step, "
        f"{100 * agree['fraction_of_step']:.2f}% of pyddp's median step; launch order: "
        "bucket index on rank 0's plan, agreed once at the first iteration (no per-step cost)",
        "step: the slowest rank's mean per sample; CPU: the process's CPU time per step (every "
        "thread), mean over ranks. overlap = overlap / comm (torch DDP's "
        "definitions): pyddp from dm.stats()\nover every timed step, torch DDP from "
        "_get_ddp_logging_data() per iteration, one per sample.",
    ]
    wire = result.get("wire_bytes_per_step")
    if wire:
        hook = cfg.get("comm_hook")
        lines.append(
            f"into the all-reduce per rank and step: {wire / 2**20:.2f} MiB "
            + (f"({hook} compression hook on both engines)" if hook else "(float32, no hook)")
            + (f", rank {cfg['power_sgd_rank']}" if hook == "power_sgd" else "")
        )
    if cfg["processes"] * cfg["threads"] > cfg["cores"]:
        lines.append(
            f"{cfg['processes']} processes x {cfg['threads']} threads exceed the "
            f"{cfg['cores']} cores: the processes compete for them"
        )
    return "\n".join(lines)


def combine(cfg: Dict[str, Any], per_rank: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Per-rank samples -> the results payload (rank 0, or a test)."""
    results = []
    step: Dict[str, List[float]] = {}
    cpus: Dict[str, List[float]] = {}
    for name in (PYDDP, DDP):
        # A sample lasts as long as its slowest rank: the others waited for it.
        step[name] = [max(s) for s in zip(*(p["times"][name] for p in per_rank))]
        # CPU time: the mean over ranks per sample (steadier on a shared machine).
        cpus[name] = cpu = [sum(s) / len(s) for s in zip(*(p["cpu"][name] for p in per_rank))]
        pooled = [s for p in per_rank for s in p["stats"][name]]
        means = {k: _mean([s[k] for s in pooled]) for k in ("backward_compute_s", "comm_s")}
        overlap = _mean([s["overlap_s"] for s in pooled])
        results.append(
            {
                "variant": name,
                "step_s": summary(step[name]),
                "cpu_s": summary(cpu),
                "samples_s": step[name],
                "overlap_fraction": overlap / means["comm_s"] if means["comm_s"] > 0 else 0.0,
                "overlap_s": overlap,
                "exposed_comm_s": means["comm_s"] - overlap,
                **means,
                "per_rank_samples_s": [p["times"][name] for p in per_rank],
                "per_rank_stats": [p["stats"][name] for p in per_rank],
            }
        )
    median_p, median_d = results[0]["step_s"]["median"], results[1]["step_s"]["median"]
    agree = _mean([s["agree_s"] for p in per_rank for s in p["stats"][PYDDP]])
    return {
        "config": dict(cfg),
        "results": results,
        "ratio": {
            "pyddp_over_ddp": median_p / median_d,
            # Same-round pairs: the spread of the ratio itself, drift cancelled.
            "paired": summary([a / b for a, b in zip(step[PYDDP], step[DDP])]),
            "cpu_pyddp_over_ddp": results[0]["cpu_s"]["median"] / results[1]["cpu_s"]["median"],
            "cpu_paired": summary([a / b for a, b in zip(cpus[PYDDP], cpus[DDP])]),
        },
        "agreement": {
            "mean_s": agree,
            "mean_us": agree * 1e6,
            "fraction_of_step": agree / median_p,
        },
        "ddp_logging_avg_ns": [p["ddp_logging"] for p in per_rank],
        # Per rank and step, into the all-reduce: the buckets' bytes, halved by
        # a 16-bit compression hook (the same for both engines' hooks).
        "bucket_bytes_per_step": per_rank[0].get("bucket_bytes_per_step"),
        "wire_bytes_per_step": per_rank[0].get("wire_bytes_per_step"),
    }


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
