"""Trainer hooks and the built-in callbacks: a progress bar (tqdm) and a
metrics logger writing CSV and JSONL (engine statistics included)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

if TYPE_CHECKING:
    from .trainer import Trainer


class Callback:
    """Override what you need; every hook receives the trainer (its `state`,
    `model`, `config`)."""

    def on_train_start(self, trainer: Trainer) -> None: ...
    def on_train_end(self, trainer: Trainer) -> None: ...
    def on_step_end(self, trainer: Trainer, metrics: Dict[str, Any]) -> None: ...
    def on_epoch_end(self, trainer: Trainer, metrics: Dict[str, Any]) -> None: ...
    def on_validation_end(self, trainer: Trainer, metrics: Dict[str, Any]) -> None: ...
    def on_checkpoint(self, trainer: Trainer, path: Path) -> None: ...


class ProgressBar(Callback):
    """One tqdm bar per epoch with the running loss."""

    def __init__(self) -> None:
        self._bar: Optional[Any] = None
        self._epoch = -1

    def on_step_end(self, trainer: Trainer, metrics: Dict[str, Any]) -> None:
        from tqdm.auto import tqdm

        state = trainer.state
        if self._bar is None or state.epoch != self._epoch:
            self._close()
            self._epoch = state.epoch
            self._bar = tqdm(
                total=trainer.steps_per_epoch,
                initial=(state.batch_in_epoch - 1) // trainer.config.grad_accum_steps,
                desc=f"epoch {state.epoch + 1}",
                leave=False,
                dynamic_ncols=True,
            )
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{metrics['train_loss']:.4f}", refresh=False)

    def on_validation_end(self, trainer: Trainer, metrics: Dict[str, Any]) -> None:
        from tqdm.auto import tqdm

        tqdm.write(_line(metrics))

    def on_epoch_end(self, trainer: Trainer, metrics: Dict[str, Any]) -> None:
        self._close()

    def on_train_end(self, trainer: Trainer) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class MetricsLogger(Callback):
    """Appends every step's and every validation's metrics to metrics.jsonl and
    the validation rows to metrics.csv in the output directory."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.jsonl = self.directory / "metrics.jsonl"
        self.csv = self.directory / "metrics.csv"
        self._csv_fields: Optional[List[str]] = None

    def on_train_start(self, trainer: Trainer) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    def on_step_end(self, trainer: Trainer, metrics: Dict[str, Any]) -> None:
        row = dict(metrics, kind="train", engine=trainer.model.stats())
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_validation_end(self, trainer: Trainer, metrics: Dict[str, Any]) -> None:
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(dict(metrics, kind="valid")) + "\n")
        new = not self.csv.exists()
        if self._csv_fields is None:
            if new:
                # train_loss first: it is missing from a validation right after a resume
                self._csv_fields = ["epoch", "step", "train_loss"]
                self._csv_fields += [k for k in metrics if k not in self._csv_fields]
            else:  # resumed run: keep the columns the file already has
                with open(self.csv, newline="") as f:
                    self._csv_fields = next(csv.reader(f))
        with open(self.csv, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._csv_fields, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow(metrics)


def _line(metrics: Dict[str, Any]) -> str:
    parts = []
    for k, v in metrics.items():
        parts.append(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}")
    return "  ".join(parts)
