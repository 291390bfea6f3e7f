"""The Trainer's checkpoints: what it writes (model, optimizer, scheduler,
loop state, best model, loss scaler, every rank's RNG state) and how it
resumes from them, checked against this run (identity.py) through its files
(run_files.py); and the repairs a fit needs after an interrupted one. A mixin
of Trainer (train/trainer.py), whose state it reads."""

from __future__ import annotations

import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch

from ..._link import exchange
from ..._link.control import Ranks
from ...replicas.model import DistributedModel
from ..config import TrainConfig
from ..rng import cuda_rng_states, restore_generators, set_rng_states
from ..scaler import LossScaler
from ..state import LoopState
from .identity import data_signature, keep_changed_settings
from .run_files import RunFiles
from .saving import fits, put_best, restoring

_RNG = exchange("the RNG states for a checkpoint")
_SAVED = exchange("rank 0's writing of a checkpoint")
_DATA = exchange("each rank's training data signature")
_BEST = exchange("rank 0's best.pt at resume")
# The run and data signature entries (identity.py) that say how an epoch is
# cut into batches: a position in an epoch means the same rows under them
# only. Not the hash of samples: a Dataset drawing from a generator of its
# own reads otherwise at every fit (a false restart, found by a review).
BATCHES = "training batches per epoch"
_CUT = ("batch_size", "shuffle", "seed", "training rows", BATCHES, "training DataLoader")


def _cut_of(run: Dict[str, str]) -> Dict[str, str]:
    """`run`'s _CUT entries; the seed only where it shuffles (a review: a
    resume with another seed restarted an epoch in order)."""
    return {k: run[k] for k in _CUT if k in run and (k != "seed" or run.get("shuffle") != "False")}


class CheckpointsHost(Protocol):
    """What TrainerCheckpoints reads of the Trainer it is mixed into
    (trainer.py) and does not define."""

    config: TrainConfig
    model: DistributedModel
    optimizer: torch.optim.Optimizer
    scheduler: Optional[Any]  # an LR scheduler, or None
    rank: int
    ranks: Ranks
    _scaler: LossScaler
    _files: Optional[RunFiles]  # None without output_dir
    output_dir: Optional[Path]
    _scheduler_made: Dict[str, str]  # identity.scheduler_settings at construction
    _window_rng: Any  # rng.rng_states at the open window's start (epoch.py)
    _validation_end: Any  # a callbacks.Emission (epoch.py)

    def _emit(self, hook: Any, *args: Any) -> None: ...
    def _boundary(
        self, valid_data: Any, count: int, eval_every: Optional[int],
        checkpoint_every: Optional[int], limit: Optional[int], reason: str, event: Any,
    ) -> None: ...  # fmt: skip


class TrainerCheckpoints:
    # How the epoch whose position the loop state holds was cut (_CUT's
    # entries): set by each fit and by a resume.
    _cut: Optional[Dict[str, str]] = None

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
        with restoring(path, "best model"):  # (best.pt is rewritten from it below)
            fits(payload.get("best"), self.model.state_dict())
        with restoring(path, "optimizer state"):
            self.optimizer.load_state_dict(payload["optimizer"])
        if self.scheduler is not None and payload.get("scheduler") is not None:
            with restoring(path, "scheduler state"):
                # resume_if_changed: the arguments this run made it with (T_max=20, not 10)
                made, now = self._scheduler_made, self.scheduler.state_dict()
                kept = keep_changed_settings(payload["run"], made, now, payload["scheduler"])
                self.scheduler.load_state_dict(kept)
        with restoring(path, "loss scaler state"):
            self._scaler.load_state_dict(payload["loss_scaler"])
        self.state = state
        self._cut = _cut_of(payload["run"])  # how its position was cut
        self.best_state_dict = payload.get("best")
        # best.pt as of the resumed step: one written after it (the run went on
        # and crashed) would stay, another model than best_state_dict.
        self._files.on_rank_0(lambda: put_best(self.output_dir, self.best_state_dict), _BEST)
        with restoring(path, "RNG state"):
            restore_generators(payload["rng"], self.rank, self.model.devices)
        if self.rank == 0:
            print(f"pyddp: resumed from {path} (epoch {self.state.epoch}, step {self.state.step})")

    def _within_the_epoch(self, batches: int, run: Dict[str, str]) -> None:
        """A fit continuing an epoch part-way (a resume, or a fit after a
        max_steps stop or an exception) whose epoch is cut otherwise now
        (another batch_size or shuffle, other data: `run`, this fit's run
        and data signature, against the cut the position was reached under)
        or is shorter than the position would skip or repeat rows silently:
        the epoch restarts instead, said in a warning."""
        state, cut = self.state, _cut_of(run)
        before, self._cut = self._cut or cut, cut
        changed = [f"{k} {before[k]}, now {v}" for k, v in cut.items() if before.get(k, v) != v]
        if state.batch_in_epoch == 0 or (not changed and state.batch_in_epoch <= batches):
            return  # (== batches: its last step was taken, or checkpointed)
        if str(state.batch_in_epoch) == before.get(BATCHES):
            state.batch_in_epoch = batches  # its last step was checkpointed: the epoch ends
            return
        if self.rank == 0:
            why = (
                f"the epoch is cut otherwise now ({'; '.join(changed)}): the rows from there "
                "would not be those the last fit left"
                if changed
                else f"past the end of this data's {batches} batches per epoch"
            )
            warnings.warn(
                f"pyddp: this fit continues epoch {state.epoch + 1} at batch "
                f"{state.batch_in_epoch}, {why}; epoch {state.epoch + 1} restarts at its first "
                "batch instead (change these settings between epochs to avoid it)",
                stacklevel=4,
            )
        state.batch_in_epoch = 0

    def _recover_interrupted_fit(self) -> None:
        """After a fit that raised mid-step: drop partial gradients and redo the
        accumulation window, or insist on a checkpoint if replicas may differ."""
        if self._interrupted_in is None:
            return
        broken = getattr(getattr(self.optimizer, "_pyddp", None), "broken", "")
        if broken:  # (a sharded step: a checkpoint loaded here would not repair it)
            raise RuntimeError(
                f"pyddp: the previous fit() failed inside a sharded optimizer step ({broken}); "
                "this Trainer cannot go on: make a new Trainer (with output_dir and "
                "resume=True it resumes from the last checkpoint)"
            )
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
        self.model._drop_interrupted_step()
        self.state.batch_in_epoch = self._window
        if self._window_rng is not None:  # the window's dropout masks drawn again, as they were
            set_rng_states(self._window_rng, self.model.devices)
        self._window = self._interrupted_in = None

    def _redo_boundary(self, valid_data: Any) -> None:
        """The validation and checkpoint of a step or epoch end that an
        exception interrupted (a second Ctrl-C in a metric), unless fit()
        resumed from elsewhere since."""
        due, self._boundary_due = self._boundary_due, None
        if due is not None and due[:2] == (self.state.step, self.state.epoch):
            self._boundary(valid_data, *due[2:])
        self._validation_end = None

    def _data_signature(
        self, train_data: Any, batches: int, samples: bool
    ) -> Tuple[Dict[str, str], List[str]]:
        """What the run depends on from its data, the same on every rank:
        each rank's entry where the ranks' data differ (a change on any
        rank is then a change); and the keys that differ. `samples`: with a
        hash of samples (identity.data_signature), where the run has files
        to compare it with, or several ranks."""
        mine = data_signature(train_data, batches, samples or self.ranks.spans_processes)
        if not self.ranks.spans_processes:
            return mine, []
        ranks = self.ranks.gather(mine, _DATA)
        differ = [key for key, value in ranks[0].items() if any(r[key] != value for r in ranks)]
        return {
            key: ", ".join(f"rank {i}: {r[key]}" for i, r in enumerate(ranks))
            if key in differ
            else value
            for key, value in ranks[0].items()
        }, differ
