"""A training run's identity in its output directory: what its result depends
on (recorded in every checkpoint and compared at resume, so a changed run is
never "resumed" silently), the refusal to start a new run over another run's
checkpoints (whose pruning would delete them), and the removal of pyddp's own
temporaries left by a kill mid-write."""

from __future__ import annotations

import copy
import hashlib
import numbers
import random
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from ...replicas.tree import flatten
from ..arguments import qualname
from ..files import SafeDir

# pyddp's own temporaries: SafeDir.write_atomic's ".NAME.<16 hex>.tmp" for the
# files the Trainer writes (checkpoints, best.pt, metrics).
_TEMPORARY = re.compile(
    r"^\.(ckpt-\d{8}\.pt|best\.pt|metrics\.csv|metrics\.jsonl|learning_curve\.png)"
    r"\.[0-9a-f]{16}\.tmp$"
)


def run_signature(
    model: Any,
    config: Any,
    optimizer: type,
    optimizer_args: Any,
    optimizer_kwargs: Dict[str, Any],
    replicas_per_process: List[int],
    scheduler: Dict[str, str],
) -> Dict[str, str]:
    """What the result of a run depends on, as comparable strings. Leaves out
    what may change between a run and its resumption: the limits
    (max_epochs, max_steps), evaluation and checkpoint cadence, progress;
    and the optimizer's and scheduler's classes, which checkpoint.check_classes
    judges (a scheduler may be added or dropped on resume). `scheduler`:
    scheduler_settings' entries."""
    entries = [
        f"{kind} {name} {tuple(t.shape)} {t.dtype}"
        for kind, named in (
            ("parameter", model.named_parameters()),
            ("buffer", model.named_buffers()),
        )
        for name, t in named
    ]
    arguments = [_stable(v) for v in optimizer_args]
    arguments += [f"{k}={_stable(v)}" for k, v in sorted(optimizer_kwargs.items())]
    shapes = hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]
    return {
        "model": f"{type(model).__qualname__}, {len(entries)} tensors (layout {shapes})",
        "replicas per process": str(replicas_per_process),
        "batch_size": repr(config.batch_size),
        "grad_accum_steps": repr(config.grad_accum_steps),
        "drop_last": repr(config.drop_last),
        "shuffle": repr(config.shuffle),
        "seed": repr(config.seed),
        "precision": repr(config.precision),
        "clip_grad_norm": repr(config.clip_grad_norm),
        # (when the learning rate moves; how the best model and early stopping judge)
        "scheduler_interval": repr(config.scheduler_interval),
        "smoothing": repr(config.smoothing),
        "optimizer": f"{qualname(optimizer)}({', '.join(arguments)})",
        **scheduler,
    }


_SCHEDULER = "scheduler "  # the scheduler's entries' prefix in a run signature


def scheduler_settings(scheduler: Any) -> Dict[str, str]:
    """An LR scheduler's state as made, before its first step: what its
    arguments set (T_max, gamma, milestones, ...; its progress reads alike
    in every run then), as signature entries ("scheduler T_max": "10"); a
    composite one's schedulers and a LambdaLR's callable objects entry by
    entry ("scheduler _schedulers.1.T_max")."""
    if scheduler is None:
        return {}
    return {_SCHEDULER + path: text for path, text in _entries(scheduler.state_dict())}


def _entries(value: Any, path: str = "", into: bool = True) -> List[Tuple[str, str]]:
    """(dotted path, _stable text) of a state dict's entries: its own, and
    those of the dicts in its lists (a composite's schedulers, a LambdaLR's
    callable objects), whose other values (a MultiStepLR's milestones, a
    Counter) are read whole."""
    if into and isinstance(value, Mapping):
        items = [(str(k), v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))]
        return [e for k, v in items for e in _entries(v, f"{path}.{k}" if path else k, False)]
    if isinstance(value, (list, tuple)) and any(isinstance(v, Mapping) for v in value):
        return [e for k, v in enumerate(value) for e in _entries(v, f"{path}.{k}")]
    return [(path, _stable(value))]


def _changed_scheduler_entries(
    saved: Dict[str, str], mine: Dict[str, str]
) -> List[Tuple[str, str, str]]:
    """(key, checkpoint's text, ours) of each scheduler entry that differs,
    over the entries of both runs (other milestones, a scheduler of a
    composite replaced: other entries); none where one run recorded none (an
    older checkpoint, or a scheduler added or dropped on resume:
    check_classes judges that)."""
    theirs = {k: v for k, v in saved.items() if k.startswith(_SCHEDULER)}
    ours = {k: v for k, v in mine.items() if k.startswith(_SCHEDULER)}
    if not theirs or not ours:
        return []
    return [
        (key, theirs.get(key, "(none)"), ours.get(key, "(none)"))
        for key in sorted(theirs.keys() | ours.keys())
        if theirs.get(key) != ours.get(key)
    ]


def keep_changed_settings(
    saved: Dict[str, str], made: Dict[str, str], state: Any, loaded: Any
) -> Any:
    """resume_if_changed: `loaded` (the checkpoint's scheduler state) with
    each entry whose text as made (`made`, this run's scheduler_settings)
    differs from the checkpoint's run's (`saved`) taken from `state` (the
    scheduler's state as made: the new T_max over the checkpoint's
    progress); an entry of another form in the checkpoint (a composite's
    scheduler replaced) is taken whole, as made (it starts afresh)."""
    merged = copy.deepcopy(loaded)
    for key, _, _ in _changed_scheduler_entries(saved, made):
        path = key[len(_SCHEDULER) :].split(".")
        try:
            src, dst = state, merged
            for k in path[:-1]:
                src, dst = _at(src, k), _at(dst, k)
            _at(dst, path[-1])  # (the checkpoint holds it: this entry alone)
            _put(dst, path[-1], copy.deepcopy(_at(src, path[-1])))
        except (KeyError, IndexError, ValueError):  # (another form: the whole entry, as made)
            if path[0] in state:
                merged[path[0]] = copy.deepcopy(state[path[0]])
    return merged


def _at(container: Any, key: str) -> Any:
    return container[int(key)] if isinstance(container, (list, tuple)) else container[key]


def _put(container: Any, key: str, value: Any) -> None:
    if isinstance(container, list):
        container[int(key)] = value
    else:
        container[key] = value


def validation_signature(data: Any) -> str:
    """What the ranks compare of fit()'s valid_data: its form and rows (a
    DataLoader's dataset: a DistributedSampler splits the same one). Not its
    values: a Dataset may augment with a generator of its own, per rank."""
    if data is None:
        return "None"
    form = type(data.dataset if isinstance(data, DataLoader) else data).__name__
    try:
        return f"{form} of {data_rows(data)} rows"
    except Exception as e:  # (named by the check of valid_data that follows)
        return f"{form}, unreadable ({type(e).__name__})"


def data_signature(data: Any, batches_per_epoch: int, samples: bool = True) -> Dict[str, str]:
    """What a run depends on from its training data (the tensors, Dataset
    or DataLoader given to fit), cheaply: its rows, its batches per epoch,
    and (`samples`) a hash of a few samples (the first, the last and two
    between), never a pass over the data. A finished run "resumed" on other
    data would train nothing on it; a shorter one would resume past its end.
    Without `samples` no item is read (a Dataset's own generator stays put)."""
    if samples:
        rows, hashed = _rows_and_samples(data)
    else:
        rows, hashed = _rows(data), ""
    return {
        "training rows": rows,
        "training batches per epoch": str(batches_per_epoch),
        **({"training samples (hash of 4)": hashed} if samples else {}),
        **({"training DataLoader": _cutting(data)} if isinstance(data, DataLoader) else {}),
    }


def _rows(data: Any) -> str:
    try:
        return str(data_rows(data))
    except Exception:  # noqa: BLE001 - an iterable dataset: no length
        return "unknown"


def _cutting(loader: DataLoader) -> str:
    """How a DataLoader cuts its epochs (TrainConfig's batch_size, shuffle and
    drop_last do not apply to it): its batch size, drop_last, and its
    sampler's class and settings (a DistributedSampler's shuffle, seed, ...)."""
    sampler = loader.batch_sampler if loader.batch_size is None else loader.sampler
    return f"batch_size={loader.batch_size}, drop_last={loader.drop_last}, {_sampler(sampler)}"


def _sampler(sampler: Any) -> str:
    """A sampler's class and settings; a batch sampler's with its sampler's."""
    settings = [
        f"{k}={_stable(getattr(sampler, k))}"
        for k in ("shuffle", "seed", "drop_last", "replacement", "num_samples", "batch_size")
        if isinstance(getattr(sampler, k, None), (bool, int))
    ]
    inner = getattr(sampler, "sampler", None)
    if inner is not None and inner is not sampler:
        settings.append(_sampler(inner))
    return f"{type(sampler).__qualname__}({', '.join(settings)})"


def data_rows(data: Any) -> int:
    """The rows of the data fit() takes: (inputs, targets) tensors, a Dataset,
    or a DataLoader's dataset (a DistributedSampler splits the same one)."""
    data = data.dataset if isinstance(data, DataLoader) else data
    if isinstance(data, (tuple, list)):  # (inputs, targets) tensors, as ShardedLoader takes them
        return next(t.shape[0] for t in flatten(tuple(data))[0] if t.dim() > 0)
    return len(data)


def _rows_and_samples(data: Any) -> Tuple[str, str]:
    if isinstance(data, DataLoader):
        data = data.dataset
        if isinstance(data, IterableDataset) or not hasattr(data, "__len__"):
            return "unknown", "not hashed (an iterable dataset)"
    pick: Callable[[int], Any]
    n = data_rows(data)
    if isinstance(data, (tuple, list)):
        leaves = flatten(tuple(data))[0]

        def pick(i: int) -> Any:
            return [t[i] if t.dim() > 0 else t for t in leaves]
    else:
        pick = data.__getitem__
    h = hashlib.sha256()
    # Random transforms in a Dataset draw the same numbers in every run, and
    # the training's own streams are left as they were.
    state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            random.seed(0)
            np.random.seed(0)
            for i in sorted({0, n // 3, 2 * n // 3, n - 1}):
                _digest(pick(i), h)
    except Exception as e:  # noqa: BLE001 - a DataLoader's dataset may take other keys than 0..n-1
        return str(n), f"not hashed (item 0..{n - 1} raised {type(e).__name__})"
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
    return str(n), h.hexdigest()[:16]


def _digest(obj: Any, h: Any) -> None:
    """Feeds `obj`'s values into the hash `h`: tensors and arrays by their
    bytes, containers item by item, anything else by type (its repr may
    hold a memory address)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.layout == torch.strided:
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        h.update(f"{obj.dtype}{obj.shape}".encode() + np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, Mapping):
        for key in sorted(obj, key=str):
            h.update(str(key).encode())
            _digest(obj[key], h)
    elif isinstance(obj, (tuple, list)):
        h.update(f"[{len(obj)}".encode())
        for item in obj:
            _digest(item, h)
    elif obj is None or isinstance(obj, (bool, numbers.Number, str, bytes)):
        h.update(repr(obj).encode())
    else:
        h.update(type(obj).__qualname__.encode())


def _stable(value: Any) -> str:
    """A value as it reads in every run: numbers as floats or ints (numpy's
    and tensors' reprs vary), callables by name, no memory addresses."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return repr(value)
    if isinstance(value, numbers.Number) or (hasattr(value, "numel") and value.numel() == 1):
        number = float(value)
        integral = isinstance(value, numbers.Integral) and number.is_integer()
        return repr(int(number)) if integral else repr(number)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_stable(v) for v in value) + ")"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def run_differences(saved: Dict[str, str], mine: Dict[str, str]) -> List[str]:
    """Lines naming each field that differs (the scheduler's entries over
    both runs' entries: _changed_scheduler_entries)."""
    return [
        f"{key}: checkpoint {saved.get(key, '(not recorded)')}, now {value}"
        for key, value in mine.items()
        if not key.startswith(_SCHEDULER) and saved.get(key, value) != value
    ] + [
        f"{key}: checkpoint {theirs}, now {ours}"
        for key, theirs, ours in _changed_scheduler_entries(saved, mine)
    ]


def changed_run_message(path: Path, lines: List[str]) -> str:
    return (
        f"pyddp: resume=True found {path}, written by a run that differs from this one:\n  "
        + "\n  ".join(lines)
        + "\nResuming it would continue that run with these changes. Use another output_dir "
        "(or resume=False in an empty one) for a new run, or TrainConfig(resume_if_changed=True) "
        "to continue it anyway."
    )


def fresh_run_message(directory: Path, names: List[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (
        f"pyddp: resume=False, but {directory} holds another run's checkpoints ({shown}). "
        "A new run there would prune them as it writes its own, and a later resume=True "
        "could pick up either run. pyddp never deletes another run's files: use another "
        "output_dir, move or delete those checkpoints, or resume=True to continue that run."
    )


def remove_stale_temporaries(directory: Path) -> List[str]:
    """Removes pyddp's own temporaries in `directory` (left by a process
    killed mid-write; never a finished file); returns their names."""
    folder = SafeDir.open(directory, create=False)
    if folder is None:
        return []
    with folder:
        stale = [n for n in folder.names() if _TEMPORARY.match(n)]
        for name in stale:
            folder.remove(name)
    return stale
