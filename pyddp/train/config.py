"""TrainConfig: the Trainer's settings as a typed dataclass that validates
itself at construction (a wrong field raises ValueError naming it, the value
given and what it must be). Types are checked, not coerced: `resume="no"` is
an error, not True."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]

_SEED_LIMIT = 2**32  # the loader seeds torch generators with seed * 1_000_003 + epoch


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
    # Optimizer state divided over every replica of every process (ZeRO stage
    # 1, dmodel.optimizer(..., shard=True)), or "gradients" too (stage 2:
    # buckets reduce-scattered); the same result bit for bit.
    shard_optimizer: Union[bool, str] = False
    precision: str = "fp32"  # "fp32", "bf16" (autocast), "fp16" (autocast + loss scaling, GPU)
    seed: int = 0  # in [0, 2**32)
    shuffle: bool = True
    drop_last: bool = False
    prefetch: int = 2  # batches prepared ahead per epoch
    output_dir: Optional[PathLike] = None  # checkpoints, metrics; None: keep nothing on disk
    checkpoint_every_steps: Optional[int] = None
    checkpoint_every_epochs: Optional[int] = 1
    max_to_keep: Optional[int] = 3
    resume: bool = True  # continue from the newest checkpoint in output_dir
    # ... even if it was written by a run with other settings (refused otherwise)
    resume_if_changed: bool = False
    smoothing: float = 0.6  # weight of the past in the smoothed validation loss
    early_stopping_patience: Optional[int] = None  # evaluations without improvement
    progress: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks every field (the Trainer calls it again, in case one was
        assigned after construction); raises ValueError naming the field."""
        for f in fields(self):
            check = _CHECKS[f.name]
            value = getattr(self, f.name)
            normal = check(f.name, value)
            if normal is not value:
                setattr(self, f.name, normal)
        if self.max_epochs is None and self.max_steps is None:
            raise ValueError("max_epochs and max_steps are both None: set at least one")


# What a Trainer builds from its config at construction (the optimizer, sharded
# or not; loss scaling; the run's files and callbacks): assigned afterwards,
# they would be ignored, or half applied.
_MADE_WITH = ("shard_optimizer", "precision", "output_dir", "progress")


def check_made(made: TrainConfig, now: TrainConfig, seeded: Optional[int]) -> None:
    """At fit(): refuses, naming each, the fields assigned since the Trainer
    was made that it took at construction, and a seed other than the one
    its random streams were seeded with at its first fit()."""
    changed = [
        f"{name}: {getattr(made, name)!r} at construction, now {getattr(now, name)!r}"
        for name in _MADE_WITH
        if getattr(now, name) != getattr(made, name)
    ]
    if seeded is not None and now.seed != seeded:
        changed.append(f"seed: {seeded!r} at the first fit (its random streams), now {now.seed!r}")
    if changed:
        raise ValueError(
            "pyddp Trainer: TrainConfig fields were assigned after the Trainer took them ("
            + "; ".join(changed)
            + "); they would not take effect: make a new Trainer with them (with output_dir "
            "and resume=True it continues from the last checkpoint)"
        )


def _fail(name: str, value: Any, must: str) -> ValueError:
    return ValueError(f"TrainConfig.{name}={value!r} ({type(value).__name__}): must be {must}")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise _fail(name, value, "a positive int")
    return value if type(value) is int else int(value)


def _optional(check):
    def optional(name: str, value: Any) -> Any:
        return None if value is None else check(name, value)

    return optional


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, value, "True or False")
    return value


def _flag_or(word: str):
    def flag_or(name: str, value: Any) -> Union[bool, str]:
        if not isinstance(value, bool) and value != word:
            raise _fail(name, value, f"True, False or {word!r}")
        return value

    return flag_or


def _choice(*choices: str):
    def choice(name: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise _fail(name, value, "one of " + ", ".join(repr(c) for c in choices))
        return value

    return choice


def _positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, value, "a positive number")
    if not (math.isfinite(value) and value > 0):
        raise _fail(name, value, "a positive finite number")
    return value if type(value) is float else float(value)


def _smoothing(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise _fail(name, value, "a number in [0, 1)")
    return value if type(value) is float else float(value)


def _seed(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(name, value, "an int")
    if not 0 <= value < _SEED_LIMIT:
        raise _fail(name, value, "in [0, 2**32)")
    return value if type(value) is int else int(value)


def _directory(name: str, value: Any) -> Optional[PathLike]:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise _fail(name, value, "None, a str or a path (os.PathLike)")
    if not os.fspath(value):
        raise _fail(name, value, "a non-empty path (None keeps nothing on disk)")
    return value


_CHECKS = {
    "batch_size": _positive_int,
    "max_epochs": _optional(_positive_int),
    "max_steps": _optional(_positive_int),
    "grad_accum_steps": _positive_int,
    "eval_every_epochs": _optional(_positive_int),
    "eval_every_steps": _optional(_positive_int),
    "eval_batch_size": _optional(_positive_int),
    "scheduler_interval": _choice("step", "epoch"),
    "clip_grad_norm": _optional(_positive_float),
    "precision": _choice("fp32", "bf16", "fp16"),
    "seed": _seed,
    "shuffle": _flag,
    "drop_last": _flag,
    "prefetch": _positive_int,
    "output_dir": _directory,
    "checkpoint_every_steps": _optional(_positive_int),
    "checkpoint_every_epochs": _optional(_positive_int),
    "max_to_keep": _optional(_positive_int),
    "resume": _flag,
    "resume_if_changed": _flag,
    "smoothing": _smoothing,
    "early_stopping_patience": _optional(_positive_int),
    "progress": _flag,
    "shard_optimizer": _flag_or("gradients"),
}
