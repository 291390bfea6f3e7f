"""A Trainer run's files under its output_dir: rank 0 reads and writes them,
every rank gets the answer through the link (no shared filesystem needed).
Checking the folder before the first file (stale temporaries removed, another
run's checkpoints refused), writing a checkpoint, and finding the one to
resume from, checked against this run (what wrote it, what it depends on)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from ..._link import exchange
from ..._link.control import Ranks
from ..config import TrainConfig
from ..files import SafeDir
from ..state import LoopState
from .identity import (
    changed_run_message,
    fresh_run_message,
    remove_stale_temporaries,
    run_differences,
)
from .saving import (
    check_classes,
    check_payload,
    list_checkpoints,
    load_latest,
    save_checkpoint,
)

_RESUME = exchange("rank 0's checkpoint at resume")
# Where unreadable checkpoints are moved at resume (under checkpoints/).
UNREADABLE = "unreadable"
_DIR_CHECK = exchange("rank 0's check of the output directory")
_LOCK = exchange("rank 0's lock of the output directory")
LOCK_FILE = ".pyddp-run.lock"  # in output_dir, held by the run fitting there


class RunFiles:
    def __init__(
        self,
        output_dir: Path,
        ranks: Ranks,
        config: TrainConfig,
        signature: Dict[str, Any],
        classes: Dict[str, Optional[str]],
    ):
        self.output_dir = output_dir
        self.checkpoints = output_dir / "checkpoints"
        self.ranks = ranks
        self.config = config  # read when used: resume and max_to_keep may change between fits
        self.signature = signature  # what this run's result depends on
        self.data: Dict[str, str] = {}  # and from its training data (set by each fit)
        self.classes = classes  # what writes its checkpoints
        self.checked = False  # the folder holds this run's files only
        self._lock: Optional[int] = None  # rank 0, during a fit: the folder's lock

    def check_dir(self) -> None:
        """At each fit, before its first files: rank 0 locks the folder
        (another run writing there now is refused: the two would write the
        same checkpoint names, and each took the other's temporaries for
        stale); once, removes pyddp's stale temporaries and refuses to start
        afresh over another run's checkpoints."""
        self.on_rank_0(self._take_lock, _LOCK)
        if self.checked:
            return

        def check() -> Optional[str]:
            for folder in (self.output_dir, self.checkpoints):
                remove_stale_temporaries(folder)
            found = [] if self.config.resume else list_checkpoints(self.checkpoints)
            return fresh_run_message(self.checkpoints, [p.name for p in found]) if found else None

        refusal = self.on_rank_0(check, _DIR_CHECK)
        if refusal is not None:
            raise ValueError(refusal)

    def _take_lock(self) -> None:
        if self._lock is not None:
            return
        with SafeDir.open(self.output_dir) as folder:
            fd, holder = folder.lock(LOCK_FILE)
        if fd is None:
            who = holder or "a process"
            raise RuntimeError(
                f"pyddp: another run is writing to {self.output_dir} now ({who} holds "
                f"{LOCK_FILE}); an output_dir is for one run at a time: wait for it to end, "
                "or choose another output_dir"
            )
        self._lock = fd

    def release(self) -> None:
        """At the end of a fit: the folder is free for another run."""
        if self._lock is not None:
            os.close(self._lock)  # (the OS drops the lock with the process too)
            self._lock = None

    def save(self, payload: Dict[str, Any], step: int) -> Path:
        """Writes `payload` (rank 0 only) as the checkpoint of `step`."""
        return save_checkpoint(
            {**payload, "classes": self.classes, "run": {**self.signature, **self.data}},
            self.checkpoints,
            step,
            self.config.max_to_keep,
        )

    def latest(self) -> Optional[Tuple[Path, Dict[str, Any]]]:
        """Rank 0's latest checkpoint on every rank (no rank picks a different
        "latest"), refused if another optimizer or scheduler class wrote it,
        or if what the run depends on changed (unless resume_if_changed)."""
        found = self.on_rank_0(lambda: load_latest(self.checkpoints, UNREADABLE), _RESUME)
        if found is None:
            return None
        path, payload = found
        check_payload(path, payload, [f.name for f in dataclasses.fields(LoopState)])
        check_classes(path, payload["classes"], self.classes)
        changed = run_differences(payload["run"], {**self.signature, **self.data})
        if changed and not self.config.resume_if_changed:
            raise ValueError(changed_run_message(path, changed))
        if changed and self.ranks.rank == 0:
            warnings.warn(
                f"pyddp: resuming {path} with changes (resume_if_changed=True): "
                + "; ".join(changed),
                stacklevel=4,
            )
        return path, payload

    def has_checkpoints(self) -> bool:
        return bool(list_checkpoints(self.checkpoints))

    def on_rank_0(self, fn: Callable[[], Any], what: str) -> Any:
        """fn() on rank 0 (the files are rank 0's), its result on every rank
        through one exchange. An exception on rank 0 is raised there as it is
        and, by its text, on every other rank, so none waits for the timeout."""
        if not self.ranks.spans_processes:
            return fn()
        result: Any = None
        error: Optional[BaseException] = None
        if self.ranks.rank == 0:
            try:
                result = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - raised below, here and on every rank
                error, result = e, ("error", f"{type(e).__name__}: {e}")
        kind, value = self.ranks.from_root(result, what)
        if error is not None:
            raise error
        if kind == "error":
            raise RuntimeError(f"pyddp: on rank 0, {what} failed: {value}")
        return value
