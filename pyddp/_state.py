"""The Trainer's loop state: what a checkpoint restores besides the model,
optimizer and scheduler. Its own module so that callbacks (which read it) and
the trainer (which writes it) both import it, and neither imports the other
the other way round."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class LoopState:
    epoch: int = 0  # epochs completed
    batch_in_epoch: int = 0  # batches of the current epoch consumed
    step: int = 0  # optimizer steps taken
    history: List[Dict[str, Any]] = field(default_factory=list)  # one row per validation
    smoothed_valid_loss: Optional[float] = None
    best_smoothed_valid_loss: Optional[float] = None
    best_step: Optional[int] = None
    evals_without_improvement: int = 0
    stop_reason: Optional[str] = None
    # Training losses of the steps since the last validation: the next history
    # row's train_loss is their mean, also across a resume.
    train_losses: List[float] = field(default_factory=list)

    @property
    def validated_here(self) -> bool:
        """True if the model at this step has been validated already."""
        return bool(self.history) and self.history[-1]["step"] == self.step
