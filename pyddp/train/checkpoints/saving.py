"""Checkpoints a crash or a Ctrl-C cannot corrupt: written to a temporary file
with an unguessable name, fsynced, then renamed over (atomic on POSIX), with
Ctrl-C held back until the rename is done; never written or read through a
symbolic link; loaded with torch.load(weights_only=True), so loading runs no
code from the file; a corrupt or truncated newest checkpoint is reported and
the previous one used."""

from __future__ import annotations

import contextlib
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ...errors import ReduceError
from ..files import SafeDir

_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:08d}.pt"


def _open(directory: Path, create: bool) -> Optional[SafeDir]:
    """`directory` (a folder pyddp owns, so not a link) inside its parent."""
    directory = Path(directory)
    parent = SafeDir.open(directory.parent, create=create)
    if parent is None:
        return None
    with parent:
        return parent.subdir(directory.name, create=create)


def _steps(folder: SafeDir) -> List[Tuple[int, str]]:
    """(step, name) of every checkpoint, newest first; a link or a special
    file under a checkpoint's name raises UnsafePathError."""
    found = [(int(m.group(1)), n) for n in folder.names() if (m := _NAME.match(n))]
    for _, name in found:
        folder.check(name)
    return sorted(found, reverse=True)


def list_checkpoints(directory: Path) -> List[Path]:
    """Checkpoints in `directory`, newest (highest step) first."""
    folder = _open(directory, create=False)
    if folder is None:
        return []
    with folder:
        return [folder.path / name for _, name in _steps(folder)]


def save_atomic(payload: Dict[str, Any], path: Path) -> None:
    """torch.save(payload) to `path` atomically; `path` must not be a link."""
    path = Path(path)
    with SafeDir.open(path.parent) as folder:
        folder.write_atomic(path.name, lambda f: torch.save(payload, f))


def fits(best: Optional[Dict[str, Any]], model: Dict[str, torch.Tensor]) -> None:
    """Raises ValueError unless `best` (None, or a state dict) has the
    model's keys, shapes and dtypes."""
    if best is None:
        return
    form = {k: (tuple(v.shape), v.dtype) for k, v in model.items()}
    theirs = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v
              for k, v in best.items()}  # fmt: skip
    if theirs != form:
        wrong = sorted(k for k in form.keys() | theirs.keys() if form.get(k) != theirs.get(k))
        raise ValueError(f"keys, shapes or dtypes differ from the model's: {', '.join(wrong[:4])}")


def put_best(output_dir: Path, best: Optional[Dict[str, Any]]) -> None:
    """output_dir/best.pt holds `best` (removed where there is none yet)."""
    if best is not None:
        save_atomic(best, Path(output_dir) / "best.pt")
        return
    with SafeDir.open(output_dir) as folder:
        folder.remove("best.pt")


def save_checkpoint(
    payload: Dict[str, Any], directory: Path, step: int, max_to_keep: Optional[int]
) -> Path:
    """Writes the checkpoint of `step`; with `max_to_keep`, prunes the oldest.
    Only checkpoints of earlier steps are pruned: one of a higher step is
    not this run's past (the run resumed before it), and pruning by step
    number would delete the checkpoint just written in its favour."""
    with _open(directory, create=True) as folder:
        name = checkpoint_path(folder.path, step).name
        folder.write_atomic(name, lambda f: torch.save(payload, f))
        if max_to_keep is not None:
            older = [n for s, n in _steps(folder) if s < step]
            for old in older[max_to_keep - 1 :]:
                folder.remove(old)
        return folder.path / name


def check_classes(
    path: Path, saved: Dict[str, Optional[str]], mine: Dict[str, Optional[str]]
) -> None:
    """A checkpoint's optimizer state fits only the optimizer class that wrote
    it (Adam's lacks SGD's momentum, SGD's lacks Adam's betas): refuse another
    class at load rather than fail at the first step; likewise a scheduler of
    another class (adding or dropping a scheduler on resume is allowed).
    `saved`/`mine` map "optimizer" and "scheduler" to module.Class names."""
    for kind, want in mine.items():
        if kind == "scheduler" and (want is None or saved.get(kind) is None):
            continue
        if saved.get(kind) != want:
            raise ValueError(
                f"pyddp: checkpoint {path} was written with {kind} {saved.get(kind)}, this "
                f"Trainer uses {want}: resume with the same {kind}, or start afresh with "
                "resume=False or another output_dir"
            )


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# LoopState's fields (state.py): a test of each value, and what it must be.
_LOOP_FORMS: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "epoch": (_count, "a count (an int >= 0)"),
    "batch_in_epoch": (_count, "a count (an int >= 0)"),
    "step": (_count, "a count (an int >= 0)"),
    "evals_without_improvement": (_count, "a count (an int >= 0)"),
    "best_step": (lambda v: v is None or _count(v), "None or a count"),
    "history": (
        lambda v: isinstance(v, list) and all(isinstance(r, dict) and "step" in r for r in v),
        "a list of validation rows (dicts with a step)",
    ),
    "train_losses": (lambda v: isinstance(v, list) and all(map(_number, v)), "a list of numbers"),
    "smoothed_valid_loss": (lambda v: v is None or _number(v), "None or a number"),
    "best_smoothed_valid_loss": (lambda v: v is None or _number(v), "None or a number"),
    "stop_reason": (lambda v: v is None or isinstance(v, str), "None or a str"),
}


def check_payload(path: Path, payload: Dict[str, Any], loop_fields: List[str]) -> None:
    """Refuses, naming the file and each problem, a checkpoint that lacks
    what a resume reads or holds it in another form (edited by hand, or
    written by another version of pyddp): before anything is loaded, rather
    than as a bare KeyError or TypeError halfway through."""
    problems = []
    for key in ("model", "optimizer", "loop", "rng", "loss_scaler", "classes", "run"):
        if key not in payload:
            problems.append(f'no "{key}"')
        elif not isinstance(payload[key], dict):
            problems.append(f'"{key}" is a {type(payload[key]).__name__}, not a dict')
    for key in ("scheduler", "best"):
        if payload.get(key) is not None and not isinstance(payload[key], dict):
            problems.append(f'"{key}" is a {type(payload[key]).__name__}, not a dict or None')
    loop, rng = payload.get("loop"), payload.get("rng")
    if isinstance(loop, dict):
        unknown = sorted(str(k) for k in loop if k not in loop_fields)
        missing = [k for k in ("epoch", "batch_in_epoch", "step") if k not in loop]
        if unknown:
            problems.append(f'"loop" has fields this pyddp does not know: {", ".join(unknown)}')
        if missing:
            problems.append(f'"loop" lacks {", ".join(missing)}')
        problems += [
            f'"loop" {k} is {v!r}, not {_LOOP_FORMS[k][1]}'
            for k, v in loop.items()
            if k in _LOOP_FORMS and not _LOOP_FORMS[k][0](v)
        ]
    if isinstance(rng, dict) and "ranks" not in rng:
        problems.append('"rng" holds no "ranks" (every rank\'s random state)')
    elif isinstance(rng, dict) and not (isinstance(rng["ranks"], list) and rng["ranks"]):
        problems.append('"rng" "ranks" is not a list of each rank\'s random state')
    if problems:
        raise ValueError(
            f"pyddp: checkpoint {path} cannot be resumed: {'; '.join(problems)}. It was "
            "edited by hand or written by another version of pyddp: move it out of "
            f"{Path(path).parent} to resume from the previous one, or start afresh "
            "(resume=False in another output_dir)"
        )


@contextlib.contextmanager
def restoring(path: Path, part: str) -> Iterator[None]:
    """Names the checkpoint and the part whose restore failed (a state dict
    of another model, optimizer or version): load_state_dict's own errors
    name neither the file nor what to do."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        if isinstance(e, ReduceError):  # a failure across processes: named already
            raise
        raise ValueError(
            f"pyddp: checkpoint {path}: its {part} does not fit this Trainer "
            f"({type(e).__name__}: {e}). Was it edited by hand, or written by another version "
            "of pyddp or of the model? Resume from a checkpoint of this run (move this one "
            "aside) or start afresh (resume=False in another output_dir); this Trainer may be "
            "partly restored: create a new one"
        ) from e


def load_latest(
    directory: Path, set_aside: Optional[str] = None
) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The newest checkpoint that loads, or None. Unreadable ones are skipped
    with a warning naming the file and the reason; with `set_aside` (a
    subfolder name) they are also moved there, so that neither a later
    resume nor max_to_keep's pruning (by step number) weighs them against
    the run's own checkpoints, and the user still has them to inspect."""
    folder = _open(directory, create=False)
    if folder is None:
        return None
    with folder:
        for _, name in _steps(folder):
            path = folder.path / name
            f = folder.open_read(name)  # a link swapped in meanwhile raises, not skipped
            if f is None:
                continue
            try:
                with f:
                    payload = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as e:  # corrupt, truncated or not a checkpoint: try the previous one
                why = f"is unreadable ({type(e).__name__}: {e})"
            else:
                if isinstance(payload, dict) and "loop" in payload:
                    return path, payload
                why = "is not a pyddp checkpoint"
            moved = ""
            if set_aside is not None:
                with folder.subdir(set_aside) as aside:
                    moved = f"; moved it to {folder.move_to(name, aside)}"
            warnings.warn(
                f"pyddp: checkpoint {path} {why}{moved}; falling back to the previous one "
                "(none left: the run starts at step 0)",
                stacklevel=2,
            )
    return None
