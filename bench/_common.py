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
from torch import nn

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


class DecoderLM(nn.Module):
    """A GPT-like stack for the GPU benchmarks: token and position
    embeddings, pre-norm transformer layers under a causal mask, an LM head."""

    def __init__(
        self, vocab: int, d: int, heads: int, layers: int, seq: int, head_bias: bool = True
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        block = nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab, bias=head_bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        return self.head(self.blocks(h, mask=mask, is_causal=True))
