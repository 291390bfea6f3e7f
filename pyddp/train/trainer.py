"""pyddp.Trainer: the training loop on top of the engine. One persistent worker
per replica; each replica computes its loss on its own shard (no gather);
gradients are reduced during backward; every replica steps its own optimizer.
Validation, loop state (learning curve, smoothed validation loss, best model,
early stopping), atomic checkpoints with exact resume, callbacks and Ctrl-C."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Type, Union

import torch
from torch import nn

from .._link import exchange
from ..engine.options import Options
from ..errors import TrainingError
from ..replicas.model import wrap
from ..runtime.devices import DeviceLike
from .arguments import check_arguments, optimizer_spec, qualname
from .callbacks import Callback, Emission, MetricsLogger, ProgressBar
from .checkpoints.identity import run_signature, scheduler_settings, validation_signature
from .checkpoints.resume import TrainerCheckpoints
from .checkpoints.run_files import RunFiles
from .config import TrainConfig, check_made
from .data import ShardedLoader, overridden_settings
from .epoch import EpochLoop
from .evaluation import eval_loader, evaluate
from .interrupt import CtrlC
from .rng import seed_generators
from .scaler import LossScaler
from .state import LoopState

__all__ = ["FitResult", "LoopState", "Trainer", "TrainingError"]

OptimizerSpec = Union[Type[torch.optim.Optimizer], functools.partial]
Metric = Callable[[Any, Any], torch.Tensor]  # (outputs, targets) -> mean over the shard


# The Trainer's exchanges across processes (see pyddp._link.control).
_BATCHES = exchange("the number of batches per epoch on each rank")
_OUTPUT_DIR = exchange("rank 0's output directory")
_SETTINGS = exchange("each rank's Trainer settings at fit()")
# TrainConfig's fields a rank may set for itself: rank 0's output_dir is
# every rank's, only rank 0 shows progress and prunes checkpoints, and the
# prefetch depth is local.
_RANK_OWN = ("output_dir", "progress", "max_to_keep", "prefetch")


@dataclass
class FitResult:
    state: LoopState
    best_state_dict: Optional[Dict[str, torch.Tensor]]  # by smoothed validation loss
    stop_reason: str
    output_dir: Optional[Path]


class Trainer(EpochLoop, TrainerCheckpoints):
    """fit(train_data, valid_data) / evaluate(data) for `model` replicated over
    `devices` (default: every GPU, else two CPU replicas; after `pyddp.init()`
    under torchrun, this process's GPU, else one CPU replica per process).
    Across processes every rank trains on its slice of each global batch and
    sees the same reduced loss and metrics; rank 0 alone shows progress and
    writes files; resume reads rank 0's checkpoint on every rank.

    optimizer: an optimizer class or functools.partial(cls, **kwargs);
    loss_fn(outputs, targets): mean over a shard; metrics: name -> fn(outputs,
    targets) giving a mean over the shard (e.g. accuracy); scheduler: a function
    optimizer -> LR scheduler; wrap_options go to pyddp.wrap.

    The Trainer owns the wrapped model's worker threads: `close()` (or leaving
    `with Trainer(...) as trainer:`) stops them; a closed Trainer refuses fit
    and evaluate.
    """

    def __init__(
        self,
        model: nn.Module,
        devices: Optional[Sequence[DeviceLike]] = None,
        *,
        optimizer: OptimizerSpec,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        config: Optional[TrainConfig] = None,
        scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None,
        metrics: Optional[Mapping[str, Metric]] = None,
        callbacks: Sequence[Callback] = (),
        **wrap_options: Any,
    ):
        self._closed = True  # until the model is wrapped: close() has nothing to release
        self._busy = False
        self.config = config if config is not None else TrainConfig()
        if not isinstance(self.config, TrainConfig):
            raise TypeError(f"config must be a pyddp.TrainConfig, got {type(config).__name__}")
        self.config.validate()
        self._optimizer_class, optimizer_args, optimizer_kwargs = optimizer_spec(optimizer)
        check_arguments(loss_fn, scheduler, metrics, callbacks)
        options = Options.for_wrap(wrap_options)  # checked before anything starts
        self.model = wrap(model, devices, _options=options)
        self._closed = False
        # Across processes: this rank's place; rank 0 alone shows progress and
        # writes files, every rank trains on its slice of each global batch.
        self.ranks = self.model.ranks
        self.rank, self.world = self.ranks.rank, self.ranks.world
        self._made_with = dataclasses.replace(self.config)  # (fit() refuses changes: check_made)
        self._seeded: Optional[int] = None  # the seed of this rank's streams, at the first fit
        try:
            if self.config.precision == "fp16" and self.model.devices[0].type != "cuda":
                raise ValueError("precision='fp16' needs CUDA replicas; use 'bf16' on CPU")
            self.optimizer = self.model.optimizer(
                self._optimizer_class,
                *optimizer_args,
                shard=self.config.shard_optimizer,
                **optimizer_kwargs,
            )
            self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
            if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise ValueError(
                    "scheduler: ReduceLROnPlateau steps on a metric, and the Trainer steps its "
                    "scheduler without one (it failed after the first epoch); step it yourself "
                    "from a callback's on_validation_end(view, metrics) with "
                    "metrics['valid_loss'], and pass no scheduler here"
                )
            # What this run's result depends on: in every checkpoint, compared at resume
            # (taken at each fit, from its config; the scheduler's arguments as made).
            self._scheduler_made = scheduler_settings(self.scheduler)
            self._signature = functools.partial(
                run_signature, self.model.module, optimizer=self._optimizer_class,
                optimizer_args=optimizer_args, optimizer_kwargs=optimizer_kwargs,
                replicas_per_process=self.ranks.replicas_per_rank,
                scheduler=self._scheduler_made,
            )  # fmt: skip
            signature = self._signature(self.config)
        except BaseException:
            self.close()  # no worker threads left behind by a failed constructor
            raise
        self.loss_fn = loss_fn
        self.metrics = dict(metrics or {})
        self.output_dir = Path(self.config.output_dir) if self.config.output_dir else None
        # Rank 0's, on every rank: the others never touch it, but they take
        # part in checkpoints (their RNG states) exactly when it writes them,
        # also when a script sets output_dir on rank 0 only.
        self.output_dir = self.ranks.from_root(self.output_dir, _OUTPUT_DIR)
        self.callbacks: List[Callback] = list(callbacks)
        if self.config.progress and self.rank == 0:
            self.callbacks.append(ProgressBar())
        if self.output_dir is not None and self.rank == 0:
            self.callbacks.append(MetricsLogger(self.output_dir))
        self.state = LoopState()
        self.best_state_dict: Optional[Dict[str, torch.Tensor]] = None
        self.steps_per_epoch = 0
        self._scaler = LossScaler(enabled=self.config.precision == "fp16")
        self._ctrl_c = CtrlC()
        # The batch index where the open accumulation window began (None
        # between windows). An exception (a second Ctrl-C, a failing replica)
        # that leaves fit() inside a window leaves partial gradients: the next
        # fit clears them and redoes the window ("window"). One that leaves it
        # inside the optimizer step ("step") may have stepped some replicas
        # only, which only a checkpoint repairs.
        self._window: Optional[int] = None
        self._window_rng: Any = None
        self._interrupted_in: Optional[str] = None
        self._boundary_due: Optional[tuple] = None
        self._validation_end: Optional[Emission] = None
        scheduler_class = type(self.scheduler) if self.scheduler is not None else None
        self._files = (
            None
            if self.output_dir is None
            else RunFiles(
                self.output_dir,
                self.ranks,
                self.config,
                signature,
                {
                    "optimizer": qualname(self._optimizer_class),
                    "scheduler": qualname(scheduler_class),
                },
            )
        )

    # -------------------------------------------------------------- public
    def fit(self, train_data: Any, valid_data: Any = None) -> FitResult:
        with self._use("fit"):
            try:
                return self._fit(train_data, valid_data)
            finally:
                if self._files is not None:
                    self._files.release()

    @torch.no_grad()
    def evaluate(self, data: Any) -> Dict[str, float]:
        """Loss and metrics over `data`, sharded over this process's replicas
        and reduced: means over all rows, as one device would compute them.
        Across processes it does not communicate: each calling rank evaluates
        all of `data` (so rank 0 may evaluate alone, and every rank that calls
        it gets the same figures); validation inside fit() is sharded over
        the ranks instead."""
        with self._use("evaluate", reentrant=True):
            return self._evaluate(data, across_ranks=False)

    def close(self) -> None:
        """Stops the replicas' worker threads and removes the gradient hooks
        (DistributedModel.close). `model.module` keeps its weights. Safe to
        call twice; fit and evaluate raise afterwards."""
        if self._busy:
            raise RuntimeError(
                "pyddp: Trainer.close() called during fit() (from a callback?); "
                "stop training first, e.g. set trainer.state.stop_reason"
            )
        if self._closed:
            return
        self._closed = True
        self.model.close()

    def __enter__(self) -> Trainer:
        self._check_open("__enter__")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"pyddp: Trainer.{what}: this Trainer was closed; create a new one "
                "(with resume=True it continues from the last checkpoint)"
            )

    @contextlib.contextmanager
    def _use(self, what: str, reentrant: bool = False):
        self._check_open(what)
        if self._busy and not reentrant:
            raise RuntimeError(f"pyddp: Trainer.{what} called while fit() is running")
        was_busy, self._busy = self._busy, True
        try:
            yield
        finally:
            self._busy = was_busy

    # ------------------------------------------------------------------ fit
    def _fit(self, train_data: Any, valid_data: Any) -> FitResult:
        cfg = self.config
        cfg.validate()
        check_made(self._made_with, cfg, self._seeded)
        self.ranks.leave_note(None)  # (a callback raised in the last fit(): this rank is back)
        self._same_settings_on_every_rank(cfg, valid_data)
        loader = ShardedLoader(
            train_data,
            cfg.batch_size,
            self.model.devices,
            shuffle=cfg.shuffle,
            drop_last=cfg.drop_last,
            seed=cfg.seed,
            prefetch=cfg.prefetch,
            rank=self.rank,
            world=self.world,
        )
        self._even_out(loader)
        self.steps_per_epoch = -(-len(loader) // cfg.grad_accum_steps)
        if getattr(train_data, "persistent_workers", False) and train_data.num_workers > 0:
            warnings.warn(
                "pyddp: a DataLoader with persistent_workers=True: its workers are seeded once "
                "and their random state runs on across epochs, so a run resumed in a later "
                "epoch draws other random transforms than the uninterrupted one (not bitwise); "
                "persistent_workers=False replays them",
                stacklevel=3,
            )
        unused = overridden_settings(cfg, train_data, valid_data)
        if unused:
            warnings.warn(
                "pyddp: TrainConfig " + "; ".join(unused) + ": not used, a DataLoader's batches "
                "are taken as it cuts them; set it on the DataLoader, or pass its Dataset",
                stacklevel=3,
            )
        validates = cfg.eval_every_epochs or cfg.eval_every_steps
        if valid_data is not None:  # refused now, not after an epoch of training
            eval_loader(self.model, valid_data, cfg, self.ranks.spans_processes, "valid_data")
        if cfg.early_stopping_patience is not None and (valid_data is None or not validates):
            warnings.warn(
                f"pyddp: early_stopping_patience={cfg.early_stopping_patience} without "
                "validation ("
                + (
                    "no valid_data"
                    if valid_data is None
                    else "eval_every_epochs and eval_every_steps are None"
                )
                + "): the run never stops early",
                stacklevel=3,
            )
        self._recover_interrupted_fit()
        batches = len(loader)  # (without files, in one process: no item read)
        data, differ = self._data_signature(train_data, batches, self._files is not None)
        if differ and loader.rows_global:
            # (each rank trained on its slice of its own data: most rows unseen, silently)
            raise ValueError(
                "pyddp: the ranks passed different training data to fit() ("
                + "; ".join(f"{k}: {data[k]}" for k in differ)
                + "): the Trainer cuts the same global batches on every rank, each rank taking "
                "its slice; pass every rank the same data, or a DataLoader with a "
                "DistributedSampler to give each rank its own"
            )
        if self._seeded is None:  # at the first fit: what ran since construction draws nothing
            seed_generators(cfg.seed, self.rank, self.model.devices)
            self._seeded = cfg.seed
        if self._files is not None:
            self._files.config = cfg  # this fit's resume and max_to_keep
            self._files.signature = self._signature(cfg)
            self._files.data = data
            self._files.check_dir()
            if cfg.resume:
                self._resume()
            self._files.checked = True
        self._within_the_epoch(batches, {**self._signature(cfg), **data})
        # A fit starts at a window boundary: no gradient is carried into it
        # (an aborted backward's, or one the model held when it was wrapped).
        self.model.zero_grad()
        state = self.state
        # Early stopping is final; any other reason is re-judged against this
        # config, so re-running a finished script does not train further.
        if state.stop_reason != "early_stopping":
            state.stop_reason = None
            if cfg.max_epochs is not None and state.epoch >= cfg.max_epochs:
                state.stop_reason = "max_epochs"
            elif cfg.max_steps is not None and state.step >= cfg.max_steps:
                state.stop_reason = "max_steps"
        if state.stop_reason is not None:  # (a second fit() on new data trained nothing, silently)
            further = (
                "early stopping is final" if state.stop_reason == "early_stopping"
                else "raise max_epochs or max_steps to train further"
            )  # fmt: skip
            warnings.warn(
                f"pyddp: fit() trains nothing: this Trainer's run already ended "
                f"({state.stop_reason}, epoch {state.epoch}, step {state.step}); {further}, "
                "or make a new Trainer for a new run",
                stacklevel=3,
            )
        start_step = state.step
        with self._ctrl_c:
            try:
                self._emit("on_train_start")
                self._redo_boundary(valid_data)
                while state.stop_reason is None:
                    self._run_epoch(loader, valid_data)
                self._ctrl_c.check()
                if self.output_dir is not None and state.step != start_step:
                    self._checkpoint()
                self._emit("on_train_end")
            except BaseException:
                if self._window is not None and self._interrupted_in is None:
                    self._interrupted_in = "window"
                raise
        return FitResult(self.state, self.best_state_dict, self.state.stop_reason, self.output_dir)

    def _same_settings_on_every_rank(self, cfg: TrainConfig, valid_data: Any) -> None:
        """Across processes the loop's validation, checkpoints and stop
        decisions are collective: ranks that fit with other limits, cadences
        or batch sizes would wait for each other at different steps, and the
        first to finish would be blamed as missing. Refused at fit() on
        every rank, naming each field that differs and each rank's value."""
        if not self.ranks.spans_processes:
            return
        mine = {f.name: repr(getattr(cfg, f.name)) for f in fields(cfg) if f.name not in _RANK_OWN}
        mine["scheduler"] = (
            f"{qualname(type(self.scheduler))} {self._scheduler_made}"
            if self.scheduler is not None
            else "None"
        )
        mine["metrics"] = repr(list(self.metrics))  # (the validation's sums, by position)
        mine["valid_data"] = validation_signature(valid_data)
        every = self.ranks.gather(mine, _SETTINGS)
        differ = [k for k in mine if len({e.get(k) for e in every}) > 1]
        if differ:
            names = self.ranks.global_ranks
            shown = "; ".join(
                f"{k}: " + ", ".join(f"rank {names[r]} {e.get(k)}" for r, e in enumerate(every))
                for k in differ
            )
            raise ValueError(
                f"pyddp Trainer: the ranks fit with different settings ({shown}); every rank "
                "validates, checkpoints and stops together, so every rank must fit with the "
                "same TrainConfig, scheduler, metrics and validation data (output_dir, progress, "
                "max_to_keep and prefetch excepted)"
            )

    def _even_out(self, loader: ShardedLoader) -> None:
        """Every rank must take the same number of steps per epoch (its
        validation, checkpoints and stop decisions are collective): a
        DataLoader of the caller's whose sampler gives the ranks different
        numbers of batches is cut to the smallest, said once, as
        DistributedSampler(drop_last=True) would (the Trainer does not train
        under Join: its per-step exchanges would need shadowing too)."""
        if not self.ranks.spans_processes:
            return
        mine = [0.0] * self.world
        mine[self.rank] = float(len(loader))
        counts = [int(c) for c in self.ranks.sum(mine, _BATCHES)]
        if len(set(counts)) == 1:
            return
        loader.limit = min(counts)
        each = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        warnings.warn(
            f"pyddp Trainer: the ranks' data give different numbers of batches per epoch "
            f"({each}); every rank trains {loader.limit} per epoch and skips the rest, as "
            "DistributedSampler(drop_last=True) would. Give every rank the same number "
            "(DistributedSampler pads by default), or train in your own loop under "
            "dmodel.join(), which shadows the missing steps instead",
            stacklevel=3,
        )

    def _evaluate(self, data: Any, across_ranks: bool) -> Dict[str, float]:
        """`across_ranks`: every rank evaluates its slice and the sums are
        exchanged (every rank must call it); else this rank evaluates all."""
        across = across_ranks and self.ranks.spans_processes
        try:
            return evaluate(self.model, data, self.config, self.loss_fn, self.metrics,
                            self._autocast, across)  # fmt: skip
        except Exception as e:  # a metric raising on this rank: the others wait for its sums
            if across:
                self.ranks.leave_note(f"fit(): its validation raised {e!r}")
            raise

    # --------------------------------------------------------------- misc
    def _autocast(self) -> contextlib.AbstractContextManager:
        precision = self.config.precision
        if precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(self.model.devices[0].type, dtype=dtype)

    def _emit(self, hook: Any, *args: Any) -> None:
        """Every callback's `hook` (a name, or a resumable callbacks.Emission).
        One raising across processes (not a Ctrl-C, which every rank stops at
        together) leaves a note: a rank timing out waiting for this one names it."""
        event = hook if isinstance(hook, Emission) else Emission(hook, *args)
        try:
            event.run(self, self.callbacks)
        except Exception as e:
            who = type(self.callbacks[event.done]).__name__
            self.ranks.leave_note(f"fit(): its callback {who}.{event.hook} raised {e!r}")
            raise
