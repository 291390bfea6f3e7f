"""pyddp.Trainer: the training loop on top of the engine. One persistent worker
per replica; each replica computes its loss on its own shard (no gather);
gradients are reduced during backward; every replica steps its own optimizer.
Validation, loop state (learning curve, smoothed validation loss, best model,
early stopping), atomic checkpoints with exact resume, callbacks and Ctrl-C."""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Type, Union

import torch
from torch import nn

from ._tree import flatten
from ._workers import ReplicaError
from .callbacks import Callback, MetricsLogger, ProgressBar
from .checkpoint import load_latest, save_atomic, save_checkpoint
from .config import TrainConfig
from .data import ShardedLoader
from .devices import DeviceLike, default_devices
from .model import wrap
from .sync import ReduceError

OptimizerSpec = Union[Type[torch.optim.Optimizer], functools.partial]
Metric = Callable[[Any, Any], torch.Tensor]  # (outputs, targets) -> mean over the shard


class TrainingError(RuntimeError):
    """A step failed; names the replica, epoch and step. The last checkpoint is intact."""


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


@dataclass
class FitResult:
    state: LoopState
    best_state_dict: Optional[Dict[str, torch.Tensor]]  # by smoothed validation loss
    stop_reason: str
    output_dir: Optional[Path]


class Trainer:
    """fit(train_data, valid_data) / evaluate(data) for `model` replicated over
    `devices` (default: every GPU, else two CPU replicas).

    optimizer: an optimizer class or functools.partial(cls, **kwargs);
    loss_fn(outputs, targets): mean over a shard; metrics: name -> fn(outputs,
    targets) giving a mean over the shard (e.g. accuracy); scheduler: a function
    optimizer -> LR scheduler; wrap_options go to pyddp.wrap.
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
        metrics: Optional[Dict[str, Metric]] = None,
        callbacks: Sequence[Callback] = (),
        **wrap_options: Any,
    ):
        self.config = config if config is not None else TrainConfig()
        torch.manual_seed(self.config.seed)
        self.model = wrap(model, default_devices() if devices is None else devices, **wrap_options)
        if self.config.precision == "fp16" and self.model.devices[0].type != "cuda":
            raise ValueError("precision='fp16' needs CUDA replicas; use 'bf16' on CPU")
        if isinstance(optimizer, functools.partial):
            self.optimizer = self.model.optimizer(
                optimizer.func, *optimizer.args, **optimizer.keywords
            )
        else:
            self.optimizer = self.model.optimizer(optimizer)
        self.scheduler = scheduler(self.optimizer) if scheduler is not None else None
        self.loss_fn = loss_fn
        self.metrics = dict(metrics or {})
        self.output_dir = Path(self.config.output_dir) if self.config.output_dir else None
        self.callbacks: List[Callback] = list(callbacks)
        if self.config.progress:
            self.callbacks.append(ProgressBar())
        if self.output_dir is not None:
            self.callbacks.append(MetricsLogger(self.output_dir))
        self.state = LoopState()
        self.best_state_dict: Optional[Dict[str, torch.Tensor]] = None
        self.steps_per_epoch = 0
        self._scale = 2.0**16 if self.config.precision == "fp16" else 1.0
        self._interrupted = False
        self._good_steps = 0  # fp16 steps since the loss scale last changed
        self._validated_at: Optional[int] = None  # step of the last validation
        self._train_losses: List[float] = []  # since the last validation

    # -------------------------------------------------------------- public
    def fit(self, train_data: Any, valid_data: Any = None) -> FitResult:
        cfg = self.config
        loader = ShardedLoader(
            train_data,
            cfg.batch_size,
            self.model.devices,
            shuffle=cfg.shuffle,
            drop_last=cfg.drop_last,
            seed=cfg.seed,
            prefetch=cfg.prefetch,
        )
        self.steps_per_epoch = -(-len(loader) // cfg.grad_accum_steps)
        if cfg.resume and self.output_dir is not None:
            self._resume()
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
        with self._sigint():
            self._emit("on_train_start")
            while state.stop_reason is None:
                self._run_epoch(loader, valid_data)
            if self.output_dir is not None and state.step != start_step:
                self._checkpoint()
            self._emit("on_train_end")
        return FitResult(self.state, self.best_state_dict, self.state.stop_reason, self.output_dir)

    @torch.no_grad()
    def evaluate(self, data: Any) -> Dict[str, float]:
        """Loss and metrics over `data`, sharded over every replica and reduced:
        means over all rows, as one device would compute them."""
        cfg = self.config
        loader = ShardedLoader(
            data,
            cfg.eval_batch_size or cfg.batch_size,
            self.model.devices,
            shuffle=False,
            seed=cfg.seed,
            prefetch=cfg.prefetch,
        )
        was_training = self.model.training
        self.model.broadcast_buffers_now()  # evaluate replica 0's statistics everywhere
        self.model.eval()
        names = ["loss", *self.metrics]
        totals: Optional[torch.Tensor] = None
        rows = 0

        def shard_sums(r: int, replica: nn.Module, shard: Any) -> torch.Tensor:
            (args, targets), n = shard, _rows(shard)
            with self._autocast():
                out = replica(*args)
                values = [self.loss_fn(out, targets)]
                values += [fn(out, targets) for fn in self.metrics.values()]
            return torch.stack([v.detach().float() * n for v in values])

        try:
            for shards in loader.epoch(0):
                sums = self.model.map_replicas(shard_sums, shards, "evaluate")
                batch = sum(s.to(self.model.devices[0]) for s in sums)
                totals = batch if totals is None else totals + batch
                rows += sum(_rows(s) for s in shards)
        finally:
            self.model.train(was_training)
        values = (totals / rows).tolist()  # one host sync for the whole evaluation
        return {f"valid_{n}" if n == "loss" else n: v for n, v in zip(names, values)}

    # ---------------------------------------------------------------- loop
    def _run_epoch(self, loader: ShardedLoader, valid_data: Any) -> None:
        cfg, state = self.config, self.state
        n_batches = len(loader)
        window_loss = torch.zeros((), device=self.model.devices[0])
        for shards in loader.epoch(state.epoch, start=state.batch_in_epoch):
            index = state.batch_in_epoch
            start = index - index % cfg.grad_accum_steps
            window = min(cfg.grad_accum_steps, n_batches - start)
            last = index == start + window - 1
            try:
                with contextlib.nullcontext() if last else self.model.no_sync():
                    loss = self.model.loss_on_shards(self.loss_fn, shards, context=self._autocast)
                    (loss * (self._scale / window)).backward()
                window_loss += loss.detach() / window
                state.batch_in_epoch += 1
                stepped = last and self._optimizer_step()
            except (ReplicaError, ReduceError) as e:
                self.model.zero_grad()
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
            self._train_losses.append(metrics["train_loss"])
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

    def _optimizer_step(self) -> bool:
        """Steps every replica; False if an fp16 overflow skipped the step."""
        cfg = self.config
        if self._scale != 1.0 and not self._unscale():
            self.optimizer.zero_grad()  # overflow: skip this step, retry with a smaller scale
            return False
        if cfg.clip_grad_norm is not None:
            self.model.clip_grad_norm_(cfg.clip_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None and cfg.scheduler_interval == "step":
            self.scheduler.step()
        self.state.step += 1
        return True

    def _unscale(self) -> bool:
        """fp16: divides every replica's gradients by the loss scale; False (and
        a halved scale) if they overflowed. Replicas hold the same reduced
        values, so the check on replica 0 decides for all."""
        flats = [self.model.sync.flat_grads(r) for r in range(len(self.model.replicas))]
        finite = all(bool(torch.isfinite(f).all()) for f in flats[0])
        if not finite:
            self._scale /= 2
            self._good_steps = 0
            return False
        for grads in flats:
            torch._foreach_mul_(grads, 1.0 / self._scale)
        self._good_steps += 1
        if self._good_steps >= 2000:  # GradScaler's schedule: grow back after a calm stretch
            self._scale *= 2
            self._good_steps = 0
        return True

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
        if self._interrupted:
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
            and self._validated_at != state.step
        ):  # not twice for one model
            self._validate(valid_data)
        if self.output_dir is not None and checkpoint_every and count % checkpoint_every == 0:
            self._checkpoint()
        if limit is not None and count >= limit:
            state.stop_reason = state.stop_reason or reason

    def _validate(self, valid_data: Any) -> None:
        cfg, state = self.config, self.state
        self._validated_at = state.step
        result = self.evaluate(valid_data)
        loss = result["valid_loss"]
        past = state.smoothed_valid_loss
        state.smoothed_valid_loss = (
            loss if past is None else cfg.smoothing * past + (1 - cfg.smoothing) * loss
        )
        row = {
            "epoch": state.epoch,
            "step": state.step,
            **result,
            "smoothed_valid_loss": state.smoothed_valid_loss,
        }
        if self._train_losses:  # the learning curve's training side: mean since last time
            row["train_loss"] = sum(self._train_losses) / len(self._train_losses)
            self._train_losses = []
        state.history.append(row)
        best = state.best_smoothed_valid_loss
        if best is None or state.smoothed_valid_loss < best:
            state.best_smoothed_valid_loss = state.smoothed_valid_loss
            state.best_step = state.step
            state.evals_without_improvement = 0
            self.best_state_dict = {
                k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()
            }
            if self.output_dir is not None:
                save_atomic(self.best_state_dict, self.output_dir / "best.pt")
        else:
            state.evals_without_improvement += 1
            patience = cfg.early_stopping_patience
            if patience is not None and state.evals_without_improvement >= patience:
                state.stop_reason = "early_stopping"
        self._emit("on_validation_end", row)

    # ---------------------------------------------------------- checkpoints
    def _checkpoint(self) -> None:
        payload = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "loop": asdict(self.state),
            "best": self.best_state_dict,
            "loss_scale": self._scale,
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            },
        }
        path = save_checkpoint(
            payload, self.output_dir / "checkpoints", self.state.step, self.config.max_to_keep
        )
        self._emit("on_checkpoint", path)

    def _resume(self) -> None:
        found = load_latest(self.output_dir / "checkpoints")
        if found is None:
            return
        path, payload = found
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        if self.scheduler is not None and payload["scheduler"] is not None:
            self.scheduler.load_state_dict(payload["scheduler"])
        self.state = LoopState(**payload["loop"])
        self.best_state_dict = payload["best"]
        self._scale = payload["loss_scale"]
        torch.set_rng_state(payload["rng"]["torch"])
        if payload["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(payload["rng"]["cuda"])
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

    @contextlib.contextmanager
    def _sigint(self):
        """First Ctrl-C: stop at the next step boundary, checkpoint, return.
        Second Ctrl-C: abort (KeyboardInterrupt)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        self._interrupted = False

        def on_sigint(signum: int, frame: Any) -> None:
            self._interrupted = True
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print("\npyddp: interrupted; stopping after this step (Ctrl-C again to abort)")

        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


def _rows(shard: Any) -> int:
    args, _ = shard
    return next(t.shape[0] for t in flatten(args)[0] if t.dim() > 0)
