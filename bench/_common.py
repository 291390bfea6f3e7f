"""Shared helpers for the bench/ scripts: summaries of repeated timings (median
with p10/p90), plain-text tables, and the JSON results file that records the
machine a run was measured on. Benchmarks report; they never assert timings."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import numpy as np
import torch

import pyddp
from pyddp.bench._util import cpu_busy, rotated, summary, table  # noqa: F401  (re-exported)

RESULTS_DIR = Path(__file__).resolve().parent / "results"


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
    note = " (other work is running: figures will be noisy)" if busy > 0.1 else ""
    return (
        f"pyddp {pyddp.__version__} [{_git_state()}], torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads, {os.cpu_count()} cores, "
        f"CPU busy before start {busy:.0%}{note}"
    )


def machine() -> Dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "pyddp": pyddp.__version__,
        "platform": platform.platform(),
        "git": _git_state(),
        # Other work on a 2-core machine moves every figure: record how busy it was.
        **_busy_at_start,
    }


def _git_state() -> str:
    """The commit measured, marked dirty when pyddp/ or csrc/ differ from it:
    figures only mean something next to the code they were taken on."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "pyddp", "csrc"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def write_results(name: str, args: argparse.Namespace, results: Dict[str, Any]) -> Path:
    # A smoke run must not overwrite the figures of a real one.
    path = args.out or RESULTS_DIR / (f"{name}-quick.json" if args.quick else f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine(),
        "results": results,
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"\nresults: {path}")
    return path
