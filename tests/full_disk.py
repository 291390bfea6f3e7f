"""A disk that fills, for the full-disk tests in one process
(tests/test_trainer_files.py) and across processes
(tests/test_trainer_processes.py `trainer_disk_full`): torch.save whose
files raise ENOSPC after `room` bytes once the Trainer has written its first
checkpoint, and the callback that arms it."""

from __future__ import annotations

import errno
import io
from typing import Any, Callable, Tuple

import torch

import pyddp


class _FillingDisk:
    """A file on a disk that fills after `room` bytes."""

    def __init__(self, f: Any, room: int):
        self.f, self.room = f, room

    def write(self, b: bytes) -> int:
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(b)
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


def full_after_first_checkpoint(room: int) -> Tuple[Callable[..., Any], pyddp.Callback]:
    """(a torch.save to install in its place, the callback to give the
    Trainer): checkpoints after the first one meet a disk with `room` bytes
    left (10: a bare OSError; 3000: torch.save's "unexpected pos")."""
    full, real_save = [], torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        on_disk = isinstance(f, io.BufferedWriter)  # not pickle's in-memory torch.save
        return real_save(obj, _FillingDisk(f, room) if full and on_disk else f, *args, **kwargs)

    class FillAfterFirst(pyddp.Callback):
        def on_checkpoint(self, trainer: Any, path: Any) -> None:
            full.append(path)

    return save, FillAfterFirst()
