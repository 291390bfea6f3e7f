"""What the trainer examples (lightning_digits, fabric_digits,
accelerate_digits, hf_trainer, ray_digits) share: the digits model they all
train, and how rank 0 reports a run (the final parameters and a summary
the integration tests compare)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch
from torch import nn


def make_model() -> nn.Module:
    # No dropout: Lightning's and Fabric's checkpoints do not carry RNG
    # state, and the resume tests check that a resumed run equals an
    # uninterrupted one.
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(),
                         nn.Linear(64, 10))  # fmt: skip


def step_times(times: Sequence[float]) -> Dict[str, Optional[float]]:
    """A run's step times for its summary (None where no step ran: a resumed
    run at its end): `step_s`, the median, and `mean_step_s`, the mean after
    the first tenth of the steps (warm-up): the time training takes per step.
    With gradient accumulation the steps are two populations (micro-batches
    that reduce nothing, and the one that waits for the reduction), whose
    median falls between them and jumps from run to run; the mean does not."""
    if not times:
        return {"step_s": None, "mean_step_s": None}
    return {
        "step_s": statistics.median(times),
        "mean_step_s": statistics.mean(times[len(times) // 10 :]),
    }


def report(out: Path, state_dict: Dict[str, Any], summary: Dict[str, Any]) -> None:
    """On rank 0: the final parameters (params.pt) and summary.json in `out`."""
    torch.save(state_dict, out / "params.pt")
    (out / "summary.json").write_text(json.dumps(summary))
    print(json.dumps(summary))
