"""Trainer hooks and the built-in callbacks: a progress bar (tqdm) and a
metrics logger writing CSV and JSONL (engine statistics included). Callbacks
see the trainer through `TrainerView`, so this module does not import the
trainer (the trainer imports it)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol

from ..replicas.model import DistributedModel
from .config import TrainConfig
from .files import SafeDir
from .state import LoopState


class TrainerView(Protocol):
    """What every hook receives: the running `pyddp.Trainer`."""

    config: TrainConfig
    state: LoopState
    model: DistributedModel
    steps_per_epoch: int
    output_dir: Optional[Path]


class Callback:
    """Override what you need; every hook receives the trainer (its `state`,
    `model`, `config`)."""

    def on_train_start(self, trainer: TrainerView) -> None: ...
    def on_train_end(self, trainer: TrainerView) -> None: ...
    def on_step_end(self, trainer: TrainerView, metrics: Dict[str, Any]) -> None: ...
    def on_epoch_end(self, trainer: TrainerView, metrics: Dict[str, Any]) -> None: ...
    def on_validation_end(self, trainer: TrainerView, metrics: Dict[str, Any]) -> None: ...
    def on_checkpoint(self, trainer: TrainerView, path: Path) -> None: ...


class Emission:
    """One event's calls to the callbacks, in order, resumable: `done` of
    them returned. One cut short (a second Ctrl-C landing in a callback) is
    finished when the next fit() redoes its step's or epoch's end, from the
    callback that raised: no callback misses the event, none that returned
    gets it twice (the metrics logger writes each step once)."""

    def __init__(self, hook: str, *args: Any) -> None:
        self.hook, self.args, self.done = hook, args, 0

    def run(self, trainer: Any, callbacks: List[Callback]) -> None:
        while self.done < len(callbacks):
            getattr(callbacks[self.done], self.hook)(trainer, *self.args)
            self.done += 1


class ProgressBar(Callback):
    """One tqdm bar per epoch with the running loss."""

    def __init__(self) -> None:
        self._bar: Optional[Any] = None
        self._epoch = -1

    def on_step_end(self, trainer: TrainerView, metrics: Dict[str, Any]) -> None:
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

    def on_validation_end(self, trainer: TrainerView, metrics: Dict[str, Any]) -> None:
        from tqdm.auto import tqdm

        tqdm.write(_line(metrics))

    def on_epoch_end(self, trainer: TrainerView, metrics: Dict[str, Any]) -> None:
        self._close()

    def on_train_end(self, trainer: TrainerView) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class MetricsLogger(Callback):
    """metrics.jsonl in `directory`: a line per step (kind "train", engine
    statistics included) and per validation (kind "valid"); metrics.csv: a row
    per validation, i.e. the loop's history.

    At the start of every fit both files are made to match the loop state: a
    resumed run drops the lines of steps it will replay (each step is logged
    once) and a fresh run starts them empty. A metric that appears later (added
    on resume) adds a column: the CSV is rewritten with the wider header.
    Neither file is written through a symbolic link."""

    JSONL = "metrics.jsonl"
    CSV = "metrics.csv"

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.jsonl = self.directory / self.JSONL
        self.csv = self.directory / self.CSV
        self._csv_fields: Optional[List[str]] = None
        self._csv_rows = 0  # rows of the history the CSV holds

    def on_train_start(self, trainer: TrainerView) -> None:
        with SafeDir.open(self.directory) as folder:
            _trim_jsonl(folder, self.JSONL, trainer.state)
            self._rewrite_csv(folder, trainer.state.history)

    def on_step_end(self, trainer: TrainerView, metrics: Dict[str, Any]) -> None:
        row = dict(metrics, kind="train", engine=trainer.model.stats())
        with SafeDir.open(self.directory) as folder:
            folder.append(self.JSONL, json.dumps(row) + "\n")

    def on_validation_end(self, trainer: TrainerView, metrics: Dict[str, Any]) -> None:
        with SafeDir.open(self.directory) as folder:
            folder.append(self.JSONL, json.dumps(dict(metrics, kind="valid")) + "\n")
            history = trainer.state.history  # holds this row (already in the CSV
            new = history[self._csv_rows :]  # if fit() rewrote it since: a redone event)
            if self._csv_fields is None or any(k not in self._csv_fields for k in metrics):
                self._rewrite_csv(folder, history)
            elif new:
                folder.append(self.CSV, _csv_text(self._csv_fields, new, header=False))
                self._csv_rows = len(history)

    def _rewrite_csv(self, folder: SafeDir, rows: List[Dict[str, Any]]) -> None:
        self._csv_fields = _csv_fields(rows) if rows else None
        self._csv_rows = len(rows)
        if not rows and not folder.check(self.CSV):
            return  # nothing to write, nothing to clear
        text = _csv_text(self._csv_fields, rows, header=True) if rows else ""
        folder.write_atomic(self.CSV, lambda f: f.write(text.encode("utf-8")))


def _csv_fields(rows: List[Dict[str, Any]]) -> List[str]:
    # train_loss next to the step: a row without it (no step since the last
    # validation) leaves the cell empty instead of shifting columns.
    fields = ["epoch", "step", "train_loss"]
    for row in rows:
        fields += [k for k in row if k not in fields]
    return fields


def _csv_text(fields: List[str], rows: List[Dict[str, Any]], header: bool) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _trim_jsonl(folder: SafeDir, name: str, state: LoopState) -> None:
    """Keeps the lines the loop state accounts for: training steps up to
    state.step and the first len(state.history) validations. Lines of replayed
    steps, of a run started afresh, and a line cut short by a crash go."""
    text = folder.read_text(name)
    if not text:
        return
    kept, valid = [], 0
    for line in text.splitlines():
        try:
            row = json.loads(line)
            kind, step = row["kind"], row["step"]
        except (ValueError, TypeError, KeyError):
            continue
        if kind == "valid":
            valid += 1
            if valid > len(state.history):
                continue
        elif step > state.step:
            continue
        kept.append(line + "\n")
    if len(kept) != len(text.splitlines()) or not text.endswith("\n"):
        data = "".join(kept).encode("utf-8")
        folder.write_atomic(name, lambda f: f.write(data))


def _line(metrics: Dict[str, Any]) -> str:
    parts = []
    for k, v in metrics.items():
        parts.append(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}")
    return "  ".join(parts)
