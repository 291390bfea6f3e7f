"""The Trainer's epoch: each batch's loss and backward on the replicas (a
window of grad_accum_steps micro-batches under no_sync()), the optimizer step
(fp16 unscaling, clipping, the scheduler), and at each step's or epoch's end
validation, checkpoints and the stop decision, taken on every rank alike. A
mixin of Trainer (trainer.py), whose state it reads."""

from __future__ import annotations

import contextlib
import itertools
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Protocol

import torch

from .._link import exchange
from .._link.control import Ranks
from ..errors import ReduceError, ReplicaError, TrainingError
from ..replicas.model import DistributedModel
from .callbacks import Emission
from .checkpoints.run_files import RunFiles
from .checkpoints.saving import save_atomic
from .config import TrainConfig
from .data import ShardedLoader
from .evaluation import shard_rows
from .interrupt import CtrlC, sigint_deferred
from .rng import rng_states
from .scaler import LossScaler
from .state import LoopState

_TRAIN_LOSS = exchange("the training loss of a step (GPU replicas)")
_STOP = exchange("the stop decision after a step (Ctrl-C or a stop on any rank)")
_BEST = exchange("rank 0's writing of best.pt")
_WINDOW_ROWS = exchange("the rows of each micro-batch of a window (each rank's own batches)")


class EpochHost(Protocol):
    """What EpochLoop reads of the Trainer it is mixed into (trainer.py;
    train/checkpoints/resume.py for `_checkpoint`) and does not define."""

    config: TrainConfig
    state: LoopState
    model: DistributedModel
    optimizer: torch.optim.Optimizer
    scheduler: Optional[Any]  # an LR scheduler, or None
    loss_fn: Callable[..., torch.Tensor]
    output_dir: Optional[Path]
    ranks: Ranks
    _scaler: LossScaler
    _ctrl_c: CtrlC
    _files: Optional[RunFiles]  # None without output_dir
    _window: Optional[int]
    _window_rng: Any  # rng.rng_states at the open window's start
    _boundary_due: Optional[tuple]  # _boundary's arguments while it runs
    _validation_end: Optional[Emission]  # while its callbacks are called

    def _checkpoint(self) -> None: ...
    def _evaluate(self, data: Any, across_ranks: bool) -> Dict[str, float]: ...
    def _autocast(self) -> contextlib.AbstractContextManager: ...
    def _emit(self, hook: Any, *args: Any) -> None: ...


class EpochLoop:
    def _run_epoch(self, loader: ShardedLoader, valid_data: Any) -> None:
        cfg, state = self.config, self.state
        n_batches = len(loader)
        self._window_loss = torch.zeros((), device=self.model.devices[0])
        # closing(): the loader's clean-up runs here, where a Ctrl-C raised in
        # it propagates, not in a generator finalizer that would only print it.
        with contextlib.closing(loader.epoch(state.epoch, start=state.batch_in_epoch)) as batches:
            for first in batches:
                # A window's micro-batches, read ahead: each one's loss (the
                # mean over its rows) is weighted by its share of the window's
                # rows, so a short last batch counts as on one device.
                index = state.batch_in_epoch
                start = index - index % cfg.grad_accum_steps
                window = min(cfg.grad_accum_steps, n_batches - start)
                items = [first, *itertools.islice(batches, start + window - index - 1)]
                # The loader's rows are the global batch's; where each rank draws
                # its own (a DistributedSampler) this rank's, summed over the
                # ranks here (once per window): an uneven window weighs as one device.
                rows_of = [rows for _, rows in items]
                if not loader.rows_global:
                    rows_of = [round(r) for r in self.ranks.sum(rows_of, _WINDOW_ROWS)]
                total = sum(rows_of)
                for k, ((shards, _), rows) in enumerate(zip(items, rows_of)):
                    stop = self._micro_batch(
                        shards, rows / total, rows, k == len(items) - 1, valid_data
                    )
                    if stop and state.batch_in_epoch < n_batches:
                        return  # (a stop at the epoch's last step ends the epoch first)
        state.epoch += 1
        state.batch_in_epoch = 0
        if self.scheduler is not None and cfg.scheduler_interval == "epoch":
            with warnings.catch_warnings():
                # A run resumed at an epoch's end steps no optimizer in this
                # process before the epoch's scheduler step: in order, said not.
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step",
                                        UserWarning)  # fmt: skip
                self.scheduler.step()
        self._boundary(
            valid_data,
            state.epoch,
            cfg.eval_every_epochs,
            cfg.checkpoint_every_epochs,
            cfg.max_epochs,
            "max_epochs",
            Emission("on_epoch_end", {"epoch": state.epoch, "step": state.step}),
        )
        self._agree_on_stop()

    def _micro_batch(
        self, shards: Any, weight: float, rows: Optional[int], last: bool, valid_data: Any
    ) -> bool:
        """One micro-batch's loss and backward (`weight`: its share of the
        window's rows; `rows`: the global batch's, if known), and after the
        window's last its optimizer step, the step's metrics and what follows a
        step. Returns whether to stop."""
        state = self.state
        self._ctrl_c.check()
        self._window = state.batch_in_epoch - state.batch_in_epoch % self.config.grad_accum_steps
        if self._window == state.batch_in_epoch:  # a window begins: its draws (dropout), to redo
            self._window_rng = rng_states(self.model.devices)
        try:
            with contextlib.nullcontext() if last else self.model.no_sync():
                loss = self.model.loss_on_shards(
                    self.loss_fn, shards, context=self._autocast, global_rows=rows
                )
                (loss * (self._scaler.scale * weight)).backward()
            if self.ranks.spans_processes:  # the global batch's loss, as one device
                loss = self._global_loss(loss, shards)
            self._window_loss += loss.detach().to(self._window_loss.device) * weight
            state.batch_in_epoch += 1
            lr = self.optimizer.param_groups[0]["lr"]  # this step's (a scheduler moves it)
            stepped = last and self._optimizer_step()
        except (ReplicaError, ReduceError) as e:
            where = f"epoch {state.epoch + 1}, step {state.step + 1}"
            who = f"replica {e.replica}" if isinstance(e, ReplicaError) else "all-reduce"
            raise TrainingError(f"training failed at {where} ({who}): {e}") from e
        if not stepped:  # mid-window, or an fp16 overflow skipped the step
            if last:
                self._window_loss.zero_()
            return False
        metrics = {
            "epoch": state.epoch + 1,
            "step": state.step,
            "train_loss": self._window_loss.item(),
            "lr": lr,
        }
        self._window_loss.zero_()
        state.train_losses.append(metrics["train_loss"])
        self._after_step(valid_data, metrics)
        return state.stop_reason is not None

    def _global_loss(self, loss: torch.Tensor, shards: Any) -> torch.Tensor:
        g = self.model.last_global_loss  # from the agreement's sums (CPU)
        if g is None:  # GPU replicas: the host reads the loss here, once per step
            rows = sum(shard_rows(s) for s in shards)
            rows_all, total = self.ranks.sum([rows, loss.item() * rows], _TRAIN_LOSS)
            g = total / rows_all
        return torch.tensor(g)

    def _optimizer_step(self) -> bool:
        """Steps every replica; False if an fp16 overflow skipped the step. A
        Ctrl-C lands before or after this, never between two replicas' steps."""
        cfg = self.config
        with sigint_deferred():
            if self._scaler.enabled and not self._unscale():
                self.optimizer.zero_grad()  # overflow: skip this step, retry with a smaller scale
                self._window = None
                return False
            if cfg.clip_grad_norm is not None:
                self.model.clip_grad_norm_(cfg.clip_grad_norm)
            try:
                self.optimizer.step()
            except BaseException:
                self._interrupted_in = "step"
                raise
            self.optimizer.zero_grad()
            if self.scheduler is not None and cfg.scheduler_interval == "step":
                self.scheduler.step()
            self.state.step += 1
            self._window = None
        return True

    def _unscale(self) -> bool:
        return self._scaler.unscale_(self.model._flat_grads(), self.model._sharded_finite())

    def _after_step(self, valid_data: Any, metrics: Dict[str, Any]) -> None:
        cfg, state = self.config, self.state
        self._boundary(
            valid_data,
            state.step,
            cfg.eval_every_steps,
            cfg.checkpoint_every_steps,
            cfg.max_steps,
            "max_steps",
            Emission("on_step_end", metrics),
        )
        self._agree_on_stop()

    def _agree_on_stop(self) -> None:
        """After a step and an epoch's end: a Ctrl-C on any rank stops every
        rank here; so does a stop a callback set on some ranks only
        (trainer.state.stop_reason, from any hook)."""
        state = self.state
        flags = [float(self._ctrl_c.stop_requested), float(state.stop_reason is not None)]
        ctrl_c, stopped = self.ranks.sum(flags, _STOP)
        if ctrl_c > 0:
            state.stop_reason = "interrupted"  # fit() writes the checkpoint on the way out
        elif stopped > 0 and state.stop_reason is None:
            state.stop_reason = "stopped on another rank"

    def _boundary(
        self,
        valid_data: Any,
        count: int,
        eval_every: Optional[int],
        checkpoint_every: Optional[int],
        limit: Optional[int],
        reason: str,
        event: Emission,
    ) -> None:
        """End of a step or an epoch (`count` of them done): its `event` to the
        callbacks, validate and checkpoint when due, stop at the limit. Until
        done, the next fit() redoes it (an exception left fit() in it: a second
        Ctrl-C, a metric or callback that raised), so no validation, nor any
        callback's event (logged lines), is skipped."""
        state = self.state
        self._boundary_due = (state.step, state.epoch, count, eval_every, checkpoint_every, limit,
                              reason, event)  # fmt: skip
        self._emit(event)
        if (
            valid_data is not None
            and eval_every
            and count % eval_every == 0
            and not state.validated_here
        ):  # not twice for one model, also across a resume
            self._validate(valid_data)
        elif self._validation_end is not None:  # a redo: its callbacks not all called
            self._emit(self._validation_end)
        self._validation_end = None
        if self.output_dir is not None and checkpoint_every and count % checkpoint_every == 0:
            self._checkpoint()
        if limit is not None and count >= limit:
            state.stop_reason = state.stop_reason or reason
        self._boundary_due = None

    def _validate(self, valid_data: Any) -> None:
        cfg = self.config
        with torch.no_grad():
            result = self._evaluate(valid_data, across_ranks=True)
        row, best = self.state.record_validation(result, cfg.smoothing, cfg.early_stopping_patience)
        if best:
            self.best_state_dict = {
                k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()
            }
            if self._files is not None:  # rank 0 writes; every rank hears how it went
                best_pt = self.output_dir / "best.pt"
                self._files.on_rank_0(lambda: save_atomic(self.best_state_dict, best_pt), _BEST)
        self._validation_end = Emission("on_validation_end", row)
        self._emit(self._validation_end)
