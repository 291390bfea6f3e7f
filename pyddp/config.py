"""TrainConfig: the Trainer's settings as a typed dataclass that validates
itself at construction (a wrong field raises ValueError naming it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainConfig:
    batch_size: int = 64  # global batch, split over the replicas
    max_epochs: Optional[int] = 1
    max_steps: Optional[int] = None  # optimizer steps; stops whichever limit comes first
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    eval_every_epochs: Optional[int] = 1
    eval_every_steps: Optional[int] = None
    eval_batch_size: Optional[int] = None  # default: batch_size
    scheduler_interval: str = "step"  # when the LR scheduler steps: "step" or "epoch"
    clip_grad_norm: Optional[float] = None  # max global gradient norm
    precision: str = "fp32"  # "fp32", "bf16" (autocast), "fp16" (autocast + loss scaling, GPU)
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    prefetch: int = 2  # batches prepared ahead per epoch
    output_dir: Optional[str] = None  # checkpoints, metrics; None: keep nothing on disk
    checkpoint_every_steps: Optional[int] = None
    checkpoint_every_epochs: Optional[int] = 1
    max_to_keep: Optional[int] = 3
    resume: bool = True  # continue from the newest checkpoint in output_dir
    smoothing: float = 0.6  # weight of the past in the smoothed validation loss
    early_stopping_patience: Optional[int] = None  # evaluations without improvement
    progress: bool = True

    def __post_init__(self) -> None:
        _positive(self, "batch_size")
        _positive(self, "grad_accum_steps")
        for name in (
            "max_epochs",
            "max_steps",
            "eval_every_epochs",
            "eval_every_steps",
            "eval_batch_size",
            "checkpoint_every_steps",
            "checkpoint_every_epochs",
            "max_to_keep",
            "early_stopping_patience",
        ):
            if getattr(self, name) is not None:
                _positive(self, name)
        if self.max_epochs is None and self.max_steps is None:
            raise ValueError("max_epochs and max_steps are both None: set at least one")
        if self.scheduler_interval not in ("step", "epoch"):
            raise ValueError(
                f"scheduler_interval={self.scheduler_interval!r}: use 'step' or 'epoch'"
            )
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision={self.precision!r}: use 'fp32', 'bf16' or 'fp16'")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm={self.clip_grad_norm!r} must be > 0")
        if not 0 <= self.smoothing < 1:
            raise ValueError(f"smoothing={self.smoothing!r} must be in [0, 1)")
        if self.prefetch < 1:
            raise ValueError(f"prefetch={self.prefetch!r} must be >= 1")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")


def _positive(cfg: TrainConfig, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
