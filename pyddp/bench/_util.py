"""Shared bits of the benchmarks: robust summaries, tables, results files, models."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

import pyddp
from pyddp.runtime.writing import write_atomic, write_text


def summary(values: Sequence[float]) -> Dict[str, float]:
    """Median with the 10th and 90th percentiles: robust to this VM's outliers."""
    v = sorted(values)
    if not v:
        return {"median": float("nan"), "p10": float("nan"), "p90": float("nan"), "n": 0}
    q = statistics.quantiles(v, n=10, method="inclusive") if len(v) > 1 else [v[0]] * 9
    return {"median": statistics.median(v), "p10": q[0], "p90": q[-1], "n": len(v)}


def rotated(items: List[Any], k: int) -> List[Any]:
    """`items` starting at position k: interleaved runs change who goes first
    each round, so no variant always follows the same neighbour."""
    k %= len(items)
    return items[k:] + items[:k]


def table(headers: List[str], rows: List[List[Any]]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def cpu_busy(seconds: float = 0.5) -> float:
    """Fraction of all cores busy over `seconds` while this process sleeps: the
    other work that will share a small machine with the benchmark."""

    def ticks() -> List[int]:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]

    try:
        a = ticks()
        time.sleep(seconds)
        b = ticks()
    except OSError:
        return float("nan")
    delta = [y - x for x, y in zip(a, b)]
    idle = delta[3] + (delta[4] if len(delta) > 4 else 0)  # idle + iowait
    return 1.0 - idle / max(1, sum(delta))


def busy_note(busy: Optional[float]) -> str:
    """The warning a measured figure needs when cpu_busy() found other work."""
    return " (other work is running: figures will be noisy)" if busy and busy > 0.1 else ""


def machine(root: Optional[Path] = None) -> Dict[str, Any]:
    """What a results file records of the machine and code it was measured on
    (pyddp-bench's JSON and the bench/ scripts'); `root`: see git_state."""
    cpu = platform.processor() or platform.machine()
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
        "git": git_state(root),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def git_state(root: Optional[Path] = None) -> str:
    """The commit measured, marked dirty when pyddp/ or csrc/ differ from it:
    figures only mean something next to the code they were taken on. `root`:
    the clone (default: the one this pyddp is in); "unknown" outside one."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return "unknown"
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


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, imported on first use: it is
    optional (pyddp-engine[bench]) and only the charts need it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Any, dpi: int) -> Path:
    """Writes `fig` (a PNG, or the format its name says: making its folder;
    whole or not at all, never through a link: runtime/writing.py) and
    releases it."""
    try:
        kind = Path(path).suffix[1:].lower()  # (matplotlib's choice by the name, else PNG)
        kind = kind if kind in fig.canvas.get_supported_filetypes() else "png"
        return write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=kind))
    finally:
        pyplot().close(fig)


def write_json(path: Path, payload: Dict[str, Any]) -> Path:
    """`payload` as JSON at `path`, as save_figure writes."""
    return write_text(path, json.dumps(payload, indent=2))


def make_model(kind: str, width: int, depth: int, classes: int = 10) -> nn.Module:
    """The benchmark models; every one maps make_input(kind, ...) to class logits."""
    torch.manual_seed(0)
    if kind in ("mlp", "mlp_bn"):  # mlp_bn: BatchNorm1d after each hidden layer (buffers)
        layers: List[nn.Module] = []
        for _ in range(depth):
            norm = [nn.BatchNorm1d(width)] if kind == "mlp_bn" else []
            layers += [nn.Linear(width, width), *norm, nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, classes))
    if kind == "conv":
        layers = [nn.Conv2d(3, width, 3, padding=1), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Conv2d(width, width, 3, padding=1), nn.ReLU()]
        return nn.Sequential(
            *layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes)
        )
    if kind == "transformer":
        return _Transformer(width, depth, classes)
    raise ValueError(f"model {kind!r}: use mlp, mlp_bn, conv or transformer")


class _Transformer(nn.Module):
    def __init__(self, width: int, depth: int, classes: int):
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            width,
            # about one head per 64 features, a divisor of the width (129 failed in torch)
            nhead=max(h for h in range(1, max(1, width // 64) + 1) if width % h == 0),
            dim_feedforward=4 * width,
            batch_first=True,
            dropout=0.0,
        )
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(1))


def make_input(kind: str, width: int, batch: int, classes: int = 10, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    if kind in ("mlp", "mlp_bn"):
        x = torch.randn(batch, width, generator=g)
    elif kind == "conv":
        x = torch.randn(batch, 3, 32, 32, generator=g)
    else:
        x = torch.randn(batch, 32, width, generator=g)
    return x, torch.randint(classes, (batch,), generator=g)


def model_size(args: argparse.Namespace) -> Dict[str, int]:
    """The model and batch measured: --quick's are small."""
    if args.quick:
        return {
            "width": min(args.width, 64),
            "depth": min(args.depth, 2),
            "batch": min(args.batch, 16),
        }
    return {"width": args.width, "depth": args.depth, "batch": args.batch}
