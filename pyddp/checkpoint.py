"""Checkpoints a crash cannot corrupt: written to a temporary file, fsynced,
then renamed over (atomic on POSIX); loaded with torch.load(weights_only=True),
so loading runs no code from the file; a corrupt or truncated newest checkpoint
is reported and the previous one used."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"ckpt-{step:08d}.pt"


def list_checkpoints(directory: Path) -> List[Path]:
    """Checkpoints in `directory`, newest (highest step) first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def save_atomic(payload: Dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the name points at them
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # and the rename itself survives a crash
    finally:
        os.close(dir_fd)


def save_checkpoint(
    payload: Dict[str, Any], directory: Path, step: int, max_to_keep: Optional[int]
) -> Path:
    path = checkpoint_path(directory, step)
    save_atomic(payload, path)
    if max_to_keep is not None:
        for old in list_checkpoints(directory)[max_to_keep:]:
            old.unlink(missing_ok=True)
    return path


def load_latest(directory: Path) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The newest checkpoint that loads, or None. Unreadable ones are skipped
    with a warning naming the file and the reason."""
    for path in list_checkpoints(directory):
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # corrupt, truncated or not a checkpoint: try the previous one
            warnings.warn(
                f"pyddp: checkpoint {path} is unreadable ({type(e).__name__}: {e}); "
                "falling back to the previous one",
                stacklevel=2,
            )
            continue
        if not isinstance(payload, dict) or "loop" not in payload:
            warnings.warn(f"pyddp: {path} is not a pyddp checkpoint; skipping it", stacklevel=2)
            continue
        return path, payload
    return None
