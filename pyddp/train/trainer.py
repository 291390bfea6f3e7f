"""pyddp.Trainer: the training loop on top of the engine. One persistent worker
per replica; each replica computes its loss on its own shard (no gather);
gradients are reduced during backward; every replica steps its own optimizer.
Validation, loop state (learning curve, smoothed validation loss, best model,
early stopping), atomic checkpoints with exact resume, callbacks and Ctrl-C."""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Type, Union

import torch
from torch import nn

from .._link import exchange
from ..engine.options import Options
from ..errors import ReduceError, ReplicaError, TrainingError
from ..replicas.model import wrap
from ..runtime.devices import DeviceLike
from .arguments import check_arguments, optimizer_spec, qualname
from .callbacks import Callback, MetricsLogger, ProgressBar
from .checkpoints.identity import data_signature, run_signature
from .checkpoints.run_files import RunFiles
from .checkpoints.saving import restoring, save_atomic
from .config import TrainConfig
from .data import ShardedLoader
from .evaluation import evaluate, shard_rows
from .interrupt import CtrlC, sigint_deferred
from .rng import cuda_rng_states, restore_generators, seed_generators
from .scaler import LossScaler
from .state import LoopState

__all__ = ["FitResult", "LoopState", "Trainer", "TrainingError"]

OptimizerSpec = Union[Type[torch.optim.Optimizer], functools.partial]
Metric = Callable[[Any, Any], torch.Tensor]  # (outputs, targets) -> mean over the shard


# The Trainer's exchanges across processes (see pyddp._link.control).
_TRAIN_LOSS = exchange("the training loss of a step (GPU replicas)")
_STOP = exchange("the stop decision after a step (Ctrl-C on any rank)")
_BATCHES = exchange("the number of batches per epoch on each rank")
_RNG = exchange("the RNG states for a checkpoint")
_OUTPUT_DIR = exchange("rank 0's output directory")
_SAVED = exchange("rank 0's writing of a checkpoint")
_BEST = exchange("rank 0's writing of best.pt")
_DATA = exchange("each rank's training data signature")


@dataclass
class FitResult:
    state: LoopState
    best_state_dict: Optional[Dict[str, torch.Tensor]]  # by smoothed validation loss
    stop_reason: str
    output_dir: Optional[Path]


class Trainer:
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
        seed_generators(self.config.seed, self.rank, self.model.devices)
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
            counts = self.ranks.replicas_per_rank
            # What this run's result depends on: in every checkpoint, compared at resume.
            signature = run_signature(
                self.model.module,
                self.config,
                self._optimizer_class,
                optimizer_args,
                optimizer_kwargs,
                counts,
            )
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
        self._interrupted_in: Optional[str] = None
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
            return self._fit(train_data, valid_data)

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
        self._recover_interrupted_fit()
        if self._files is not None:
            self._files.config = cfg  # this fit's resume and max_to_keep
            self._files.data = self._data_signature(train_data, len(loader))
            self._files.check_dir()
            if cfg.resume:
                self._resume()
                self._within_the_epoch(len(loader))
            self._files.checked = True
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
        start_step = state.step
        with self._ctrl_c:
            try:
                self._emit("on_train_start")
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

    def _data_signature(self, train_data: Any, batches: int) -> Dict[str, str]:
        """What the run depends on from its data, the same on every rank:
        each rank's entry where the ranks' data differ (a change on any
        rank is then a change)."""
        mine = data_signature(train_data, batches)
        if not self.ranks.spans_processes:
            return mine
        ranks = self.ranks.gather(mine, _DATA)
        return {
            key: value
            if all(r[key] == value for r in ranks)
            else ", ".join(f"rank {i}: {r[key]}" for i, r in enumerate(ranks))
            for key, value in ranks[0].items()
        }

    def _within_the_epoch(self, batches: int) -> None:
        """A resumed position past the end of this data's epoch (a shorter
        loader, resumed with resume_if_changed or from a checkpoint that
        did not record its data) would skip the rest of the epoch silently:
        the epoch restarts instead, said in a warning."""
        state = self.state
        if state.batch_in_epoch <= batches:  # == batches: its last step was checkpointed
            return
        if self.rank == 0:
            warnings.warn(
                f"pyddp: resumed at batch {state.batch_in_epoch} of epoch {state.epoch + 1}, "
                f"past the end of this data's {batches} batches per epoch: epoch "
                f"{state.epoch + 1} restarts at its first batch",
                stacklevel=4,
            )
        state.batch_in_epoch = 0

    def _recover_interrupted_fit(self) -> None:
        """After a fit that raised mid-step: drop partial gradients and redo the
        accumulation window, or insist on a checkpoint if replicas may differ."""
        if self._interrupted_in is None:
            return
        if self._interrupted_in == "step" and not (
            self.config.resume and self._files is not None and self._files.has_checkpoints()
        ):
            raise RuntimeError(
                "pyddp: the previous fit() failed inside the optimizer step, so the replicas "
                "may hold different weights; resume from a checkpoint (output_dir with "
                "resume=True) or create a new Trainer"
            )
        # Replica work still queued from the aborted step (a Ctrl-C leaves the
        # other replicas' backward running) ends before fit() zeroes the
        # gradients it writes.
        n = len(self.model.replicas)
        self.model.map_replicas(lambda r, m, s: None, [None] * n, "wait")
        self.model._reducer.abort()  # a backward cut short is still open in the engine
        self.state.batch_in_epoch = self._window
        self._window = self._interrupted_in = None

    def _evaluate(self, data: Any, across_ranks: bool) -> Dict[str, float]:
        """`across_ranks`: every rank evaluates its slice and the sums are
        exchanged (every rank must call it); else this rank evaluates all."""
        return evaluate(
            self.model,
            data,
            self.config,
            self.loss_fn,
            self.metrics,
            self._autocast,
            across_ranks and self.ranks.spans_processes,
        )

    def _run_epoch(self, loader: ShardedLoader, valid_data: Any) -> None:
        cfg, state = self.config, self.state
        n_batches = len(loader)
        window_loss = torch.zeros((), device=self.model.devices[0])
        # closing(): the loader's clean-up runs here, where a Ctrl-C raised in
        # it propagates, not in a generator finalizer that would only print it.
        with contextlib.closing(loader.epoch(state.epoch, start=state.batch_in_epoch)) as batches:
            for shards in batches:
                self._ctrl_c.check()
                index = state.batch_in_epoch
                start = index - index % cfg.grad_accum_steps
                window = min(cfg.grad_accum_steps, n_batches - start)
                last = index == start + window - 1
                self._window = start
                try:
                    with contextlib.nullcontext() if last else self.model.no_sync():
                        loss = self.model.loss_on_shards(
                            self.loss_fn, shards, context=self._autocast
                        )
                        (loss * (self._scaler.scale / window)).backward()
                    if self.ranks.spans_processes:  # the global batch's loss, as one device
                        loss = self._global_loss(loss, shards)
                    window_loss += loss.detach().to(window_loss.device) / window
                    state.batch_in_epoch += 1
                    stepped = last and self._optimizer_step()
                except (ReplicaError, ReduceError) as e:
                    where = f"epoch {state.epoch + 1}, step {state.step + 1}"
                    who = f"replica {e.replica}" if isinstance(e, ReplicaError) else "all-reduce"
                    raise TrainingError(f"training failed at {where} ({who}): {e}") from e
                if not stepped:  # mid-window, or an fp16 overflow skipped the step
                    if last:
                        window_loss.zero_()
                    continue
                metrics = {
                    "epoch": state.epoch + 1,
                    "step": state.step,
                    "train_loss": window_loss.item(),
                    "lr": self.optimizer.param_groups[0]["lr"],
                }
                window_loss.zero_()
                state.train_losses.append(metrics["train_loss"])
                self._emit("on_step_end", metrics)
                self._after_step(valid_data, metrics)
                if state.stop_reason is not None:
                    return
        state.epoch += 1
        state.batch_in_epoch = 0
        if self.scheduler is not None and cfg.scheduler_interval == "epoch":
            self.scheduler.step()
        self._emit("on_epoch_end", {"epoch": state.epoch, "step": state.step})
        self._boundary(
            valid_data,
            state.epoch,
            cfg.eval_every_epochs,
            cfg.checkpoint_every_epochs,
            cfg.max_epochs,
            "max_epochs",
        )

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
        flats = [self.model._reducer.flat_grads(r) for r in range(len(self.model.replicas))]
        return self._scaler.unscale_(flats)

    def _after_step(self, valid_data: Any, metrics: Dict[str, Any]) -> None:
        cfg, state = self.config, self.state
        self._boundary(
            valid_data,
            state.step,
            cfg.eval_every_steps,
            cfg.checkpoint_every_steps,
            cfg.max_steps,
            "max_steps",
        )
        stop = self._ctrl_c.stop_requested
        # A Ctrl-C on any rank stops every rank at this step.
        stop = self.ranks.sum([float(stop)], _STOP)[0] > 0
        if stop:
            state.stop_reason = "interrupted"  # fit() writes the checkpoint on the way out

    def _boundary(
        self,
        valid_data: Any,
        count: int,
        eval_every: Optional[int],
        checkpoint_every: Optional[int],
        limit: Optional[int],
        reason: str,
    ) -> None:
        """End of a step or an epoch (`count` of them done): validate and
        checkpoint when due, stop at the limit."""
        state = self.state
        if (
            valid_data is not None
            and eval_every
            and count % eval_every == 0
            and not state.validated_here
        ):  # not twice for one model, also across a resume
            self._validate(valid_data)
        if self.output_dir is not None and checkpoint_every and count % checkpoint_every == 0:
            self._checkpoint()
        if limit is not None and count >= limit:
            state.stop_reason = state.stop_reason or reason

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
        self._emit("on_validation_end", row)

    # ---------------------------------------------------------- checkpoints
    def _checkpoint(self) -> None:
        # Every rank's own random state (its dropout masks differ from the
        # others'), so that a resumed rank draws what it would have drawn.
        rng = {"torch": torch.get_rng_state(), "cuda": cuda_rng_states(self.model.devices)}
        ranks = self.ranks.gather(rng, _RNG)
        # On every rank: a sharded optimizer's state dict is gathered from all.
        optimizer = self.optimizer.state_dict()

        def write() -> Path:  # every rank holds the same model: rank 0 writes it
            payload = {
                "model": self.model.state_dict(),
                "optimizer": optimizer,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "loop": asdict(self.state),
                "best": self.best_state_dict,
                "loss_scaler": self._scaler.state_dict(),
                "rng": {"ranks": ranks},
            }
            return self._files.save(payload, self.state.step)

        # Every rank waits for the outcome: a write that fails (a full disk)
        # is named on every rank, not seen there as rank 0 leaving the group.
        path = self._files.on_rank_0(write, _SAVED)
        if self.rank == 0:
            self._emit("on_checkpoint", path)

    def _resume(self) -> None:
        found = self._files.latest()
        if found is None:
            return
        path, payload = found  # its form checked (RunFiles.latest): each part is there
        with restoring(path, "loop state"):  # first: it changes nothing if it fails
            state = LoopState(**payload["loop"])
        with restoring(path, "model"):
            self.model.load_state_dict(payload["model"])
        with restoring(path, "optimizer state"):
            self.optimizer.load_state_dict(payload["optimizer"])
        if self.scheduler is not None and payload.get("scheduler") is not None:
            with restoring(path, "scheduler state"):
                self.scheduler.load_state_dict(payload["scheduler"])
        with restoring(path, "loss scaler state"):
            if "loss_scaler" in payload:
                self._scaler.load_state_dict(payload["loss_scaler"])
            else:  # written before the clean-step count was kept
                self._scaler.scale = float(payload["loss_scale"])
        self.state = state
        self.best_state_dict = payload.get("best")
        with restoring(path, "RNG state"):
            seed, step = self.config.seed, state.step
            shared = restore_generators(payload["rng"], self.rank, self.model.devices, seed, step)
        if shared and self.world > 1 and self.rank == 0:
            warnings.warn(
                f"pyddp: checkpoint {path} holds one RNG state (written before pyddp kept each "
                "rank's): rank 0 resumes it, the other ranks draw new streams derived from seed "
                f"{seed} and step {step}, so their dropout masks differ from rank 0's but are "
                "not those of an uninterrupted run",
                stacklevel=4,
            )
        if self.rank == 0:
            print(f"pyddp: resumed from {path} (epoch {self.state.epoch}, step {self.state.step})")

    # --------------------------------------------------------------- misc
    def _autocast(self) -> contextlib.AbstractContextManager:
        precision = self.config.precision
        if precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(self.model.devices[0].type, dtype=dtype)

    def _emit(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)
