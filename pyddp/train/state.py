"""The Trainer's loop state: what a checkpoint restores besides the model,
optimizer and scheduler. Its own module so that callbacks (which read it) and
the trainer (which writes it) both import it, and neither imports the other
the other way round."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


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

    def record_validation(
        self, result: Dict[str, float], smoothing: float, patience: Optional[int]
    ) -> Tuple[Dict[str, Any], bool]:
        """Books a validation at this step: the smoothed loss, the learning
        curve's row (with the mean training loss since the last one), the
        best so far and early stopping. Returns the row and whether this is
        the best model yet."""
        loss = result["valid_loss"]
        past = self.smoothed_valid_loss
        self.smoothed_valid_loss = (
            loss if past is None else smoothing * past + (1 - smoothing) * loss
        )
        row = {
            # The epoch this step belongs to, 1-based, as the training rows
            # say (at an epoch's end the count of epochs done already is).
            "epoch": self.epoch + (self.batch_in_epoch > 0),
            "step": self.step,
            **result,
            "smoothed_valid_loss": self.smoothed_valid_loss,
        }
        if self.train_losses:  # the learning curve's training side: mean since last time
            row["train_loss"] = sum(self.train_losses) / len(self.train_losses)
            self.train_losses = []
        self.history.append(row)
        best = self.best_smoothed_valid_loss
        if best is None or self.smoothed_valid_loss < best:
            self.best_smoothed_valid_loss = self.smoothed_valid_loss
            self.best_step = self.step
            self.evals_without_improvement = 0
            return row, True
        self.evals_without_improvement += 1
        if patience is not None and self.evals_without_improvement >= patience:
            self.stop_reason = "early_stopping"
        return row, False
