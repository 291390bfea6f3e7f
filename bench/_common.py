"""Shared helpers for the bench/ scripts: summaries of repeated timings (median
with p10/p90), plain-text tables, and the JSON results file that records the
machine a run was measured on. Benchmarks report; they never assert timings."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict

import torch

import pyddp
from pyddp.bench._util import (  # noqa: F401  (rotated, summary, table: re-exported)
    busy_note,
    cpu_busy,
    git_state,
    machine,
    rotated,
    summary,
    table,
)

ROOT = Path(__file__).resolve().parent.parent  # the clone the scripts measure
RESULTS_DIR = ROOT / "bench" / "results"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a few-second smoke run (tiny sizes)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results JSON (default bench/results/<name>.json, <name>-quick.json)",
    )
    return p


_busy_at_start: Dict[str, float] = {}


def header() -> str:
    """One line naming what is measured and how busy the machine was at the start."""
    busy = cpu_busy()
    _busy_at_start["cpu_busy_fraction"] = busy
    return (
        f"pyddp {pyddp.__version__} [{git_state(ROOT)}], torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads, {os.cpu_count()} cores, "
        f"CPU busy before start {busy:.0%}{busy_note(busy)}"
    )


def write_results(name: str, args: argparse.Namespace, results: Dict[str, Any]) -> Path:
    # A smoke run must not overwrite the figures of a real one.
    path = args.out or RESULTS_DIR / (f"{name}-quick.json" if args.quick else f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        # Other work on a 2-core machine moves every figure: record how busy it was.
        "machine": {**machine(ROOT), **_busy_at_start},
        "results": results,
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"\nresults: {path}")
    return path
