"""Per-replica data: every global batch is split into one shard per replica,
each placed on its replica's device, prepared on a background thread a few
batches ahead so the next batch is ready when a step starts (the split data
loader of shared/references/burn-pr-2890-multi-device-data-loading.txt)."""

from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import fields
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)
from torch.utils.data._utils.collate import default_collate

from ..replicas.tree import flatten, shard_sizes
from .rng import derived_seed

Shard = Tuple[Any, Any]  # (model inputs, targets) on one replica's device
_PADS = DistributedSampler.__iter__  # (a subclass may draw otherwise)
_SHUFFLING = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


class ShardedLoader:
    """Global batches of `batch_size` rows from `data`, split over `devices`.

    `data` is a pair of tensors (inputs, targets) with the same first
    dimension, a map-style torch Dataset yielding (input, target) items, or a
    DataLoader (its batches are taken as global batches; each sampler's
    `generator`, where it has one (torch's random samplers, also inside a
    batch_sampler), is re-seeded, and its set_epoch called, each epoch). The
    order is a function of (seed, epoch) only, so a resumed run sees the same
    batches (for a DataLoader, as far as its sampler follows those two hooks).
    The last batch of an epoch may be smaller (drop_last=False):
    shards are then uneven and the trainer weights them by size, which keeps the
    step equal to single-device training on that batch.

    Across processes (`world` > 1) every rank draws the same global batches and
    takes its own contiguous slice of each (rank r gets rows
    shard_sizes(rows, world)[r]), then splits it over its devices: every rank
    takes the same number of steps, and the run equals single-device training
    on the same global batches. A last batch with fewer rows than processes is
    dropped (a rank would get none). A DataLoader whose sampler is a
    DistributedSampler already yields this rank's batches: they are used as
    they are.
    """

    def __init__(
        self,
        data: Any,
        batch_size: int,
        devices: Sequence[torch.device],
        *,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        prefetch: int = 2,
        rank: int = 0,
        world: int = 1,
        keep_short: bool = False,
        name: str = "data",
    ):
        """`name`: what errors call `data` (the Trainer's "valid_data")."""
        self.devices = list(devices)
        self.rank, self.world = rank, world
        # Evaluation keeps a last batch with fewer rows than processes (its
        # figures are sums exchanged once): some ranks then get no rows.
        self.keep_short = keep_short
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.prefetch = prefetch
        # Batches per epoch the ranks agreed on (the Trainer sets it when a
        # DataLoader of the caller's gives the ranks different numbers).
        self.limit: Optional[int] = None
        self._loader: Optional[DataLoader] = None
        self._tensors: Optional[Tuple[Any, Any]] = None
        self._dataset: Optional[Dataset] = None
        if isinstance(data, DataLoader):
            self._loader = data
            if isinstance(data.dataset, IterableDataset):
                raise TypeError(
                    f"{name}: a DataLoader over an IterableDataset has no length, and the Trainer "
                    "plans each epoch's steps from it; pass a map-style Dataset (or tensors)"
                )
            if data.batch_size is None and data.batch_sampler is None:
                raise ValueError(
                    f"{name}: a DataLoader with batch_size=None yields single samples, not "
                    "batches; give it a batch_size (or pass the Dataset and set TrainConfig's)"
                )
            if len(data) == 0:
                raise ValueError(f"{name}: the DataLoader yields no batches")
        elif isinstance(data, (tuple, list)) and len(data) == 2:
            leaves = flatten(tuple(data))[0]
            for part, side in ((data[0], "inputs"), (data[1], "targets")):
                if not flatten(part)[0] or _holds_numpy(part):  # (numpy failed in a replica)
                    raise TypeError(
                        f"{name}: {side} must be torch tensors (or tuples, lists, dicts of "
                        f"them), got {_kinds(part)} (torch.as_tensor converts a numpy array)"
                    )
            rows = {t.shape[0] for t in leaves if t.dim() > 0}
            if len(rows) != 1:
                raise ValueError(
                    f"{name}: inputs and targets must share their first dimension, got {rows}"
                )
            self._tensors = (data[0], data[1])
            self._rows = rows.pop()
        elif isinstance(data, Dataset) and hasattr(data, "__len__"):
            self._dataset = data
            self._rows = len(data)
        else:
            raise TypeError(
                f"{name} must be (inputs, targets) tensors, a map-style Dataset of (input, "
                f"target) items, or a DataLoader; got {type(data).__name__}"
            )
        if self._loader is None and self._rows == 0:
            raise ValueError(f"{name} is empty")
        # A DistributedSampler already gives each rank its own batches.
        own = self._loader is not None and any(
            isinstance(x, DistributedSampler) for x in samplers(self._loader)
        )
        self._sliced = world > 1 and not own
        # Whether epoch() hands the global batches' rows (else this rank's).
        self.rows_global = world == 1 or self._sliced
        if not self._sliced and len(self) == 0:  # drop_last, fewer rows than a batch
            raise ValueError(
                f"{name}: {self._rows} rows make no batch of batch_size={batch_size} with "
                "drop_last=True; use a smaller batch_size or drop_last=False"
            )
        if self._sliced and len(self) == 0:
            raise ValueError(
                f"{name}: no batch has at least {world} rows, one per process; use a smaller "
                "world or a larger batch_size"
            )

    def __len__(self) -> int:
        if self._loader is not None:
            full, rest = len(self._loader), self._loader_rest()
            full -= 1 if rest else 0
        else:
            full, rest = divmod(self._rows, self.batch_size)
            rest = 0 if self.drop_last else rest
        # Across processes every rank takes the same number of steps: a short
        # last batch that some rank would get no rows of is dropped (kept for
        # evaluation, whose figures are exchanged once).
        keep = rest and (not self._sliced or self.keep_short or rest >= self.world)
        n = full + (1 if keep else 0)
        return n if self.limit is None else min(n, self.limit)

    def _loader_rest(self) -> int:
        """Rows in the DataLoader's short last batch (0: none, or unknown):
        from what its sampler yields (a subset sampler covers part of the
        dataset), not the dataset's length."""
        loader = self._loader
        if loader.batch_size is None or loader.drop_last or not hasattr(loader.sampler, "__len__"):
            return 0
        return len(loader.sampler) % loader.batch_size

    def epoch(self, epoch: int, start: int = 0) -> Iterator[Tuple[List[Shard], int]]:
        """The shards of every batch of `epoch`, from batch index `start`,
        each with the rows of the global batch (every rank's; where each rank
        draws its own batches from a DistributedSampler, this rank's, which
        that sampler keeps equal across ranks)."""
        stop = threading.Event()
        ready: queue.Queue = queue.Queue(maxsize=max(1, self.prefetch))

        def produce() -> None:
            try:
                for i, (x, y, rows) in enumerate(self._global_batches(epoch)):
                    if stop.is_set():
                        return
                    if i >= start:
                        ready.put(("batch", (self._split((x, y)), rows)))
                ready.put(("end", None))
            except BaseException as e:  # handed to the consumer, raised there
                ready.put(("error", e))

        thread = threading.Thread(target=produce, name=f"pyddp-data-epoch{epoch}", daemon=True)
        thread.start()
        try:
            while True:
                kind, item = ready.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():  # unblock a producer waiting on a full queue
                with contextlib.suppress(queue.Empty):
                    ready.get(timeout=0.05)

    def _global_batches(self, epoch: int) -> Iterator[Tuple[Any, Any, int]]:
        """(inputs, targets) of this rank, and the global batch's rows."""
        if self._loader is not None:
            for k, sampler in enumerate(samplers(self._loader)):
                generator = getattr(sampler, "generator", False)  # (False: it has none)
                if generator is None or isinstance(generator, torch.Generator):
                    # torch's RandomSampler, SubsetRandomSampler, WeightedRandomSampler
                    # (also inside a batch_sampler): else from the global stream
                    seed = self.seed * 1_000_003 + epoch + k * 7_919
                    sampler.generator = torch.Generator().manual_seed(seed)
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(epoch)  # DistributedSampler and friends
            n, real = len(self), self._unpadded_rows()
            for i, batch in enumerate(self._loader_iterator(epoch)):
                if i >= n:  # the short last batch this rank must skip
                    return
                if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                    raise ValueError("DataLoader batches must be (inputs, targets) pairs")
                rows = _rows(batch)
                if real is not None:  # an evaluation counts each row once: no padding
                    leaves, rebuild = flatten(tuple(batch))
                    batch = rebuild([t[: max(real, 0)] if t.dim() > 0 else t for t in leaves])
                    real, rows = real - rows, min(rows, max(real, 0))
                if self._sliced and rows < self.world and not self.keep_short:
                    # A last batch of fewer rows than processes that __len__
                    # could not foresee (a batch_sampler's): every rank sees
                    # this global batch, so every rank drops it.
                    return
                x, y = self._mine(batch[0], batch[1]) if self._sliced else (batch[0], batch[1])
                yield x, y, rows
            return
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self._rows, generator=g)
        else:
            order = torch.arange(self._rows)
        for i in range(len(self)):
            idx = order[i * self.batch_size : (i + 1) * self.batch_size]
            rows = len(idx)
            if self._sliced:  # this rank's rows only: it loads nothing else
                idx = idx.split(shard_sizes(len(idx), self.world))[self.rank]
            if self._tensors is not None:
                x, y = self._tensors
                yield _index(x, idx), _index(y, idx), rows
            else:
                # (keep_short: a rank may get no rows: the first item's form, empty)
                items = [self._dataset[int(j)] for j in idx] or [self._dataset[0]]
                x, y = _pair(default_collate(items))
                yield (x, y, rows) if len(idx) else (*_index((x, y), idx), rows)

    def _unpadded_rows(self) -> Optional[int]:
        """For an evaluation (keep_short) over a DataLoader whose sampler is
        torch's DistributedSampler (as its `sampler`, or in the BatchSampler
        given as its `batch_sampler`; not a subclass drawing its own order)
        padding the dataset to a multiple of its ranks by repeating rows: this
        rank's rows before the padding (which comes last). None: none to leave out."""
        batches = self._loader.batch_sampler  # (batch_size=N: a BatchSampler of `sampler`)
        sampler = getattr(batches, "sampler", None)
        if not self.keep_short or type(batches) is not BatchSampler:
            return None
        if getattr(type(sampler), "__iter__", None) is not _PADS or sampler.drop_last:
            return None
        rows = len(sampler.dataset)
        if sampler.total_size == rows:
            return None
        return len(range(sampler.rank, rows, sampler.num_replicas))

    def _loader_iterator(self, epoch: int) -> Iterator[Any]:
        """iter(DataLoader) draws its workers' base seed from the loader's
        generator, else from torch's global one, which dropout draws from
        too: a resumed run drew it once more than the run it resumes and went
        on with another dropout stream. Drawn here from (seed, epoch), and
        this rank where each rank draws its own batches, so that the global
        stream is the training's alone (and random transforms in workers
        replay alike on resume)."""
        loader = self._loader
        mine = self.rank if not self._sliced else 0
        saved = loader.generator
        loader.generator = torch.Generator().manual_seed(derived_seed(self.seed, epoch, mine, 1))
        try:
            return iter(loader)
        finally:
            loader.generator = saved

    def _mine(self, inputs: Any, targets: Any) -> Tuple[Any, Any]:
        """This rank's contiguous slice of a global batch."""
        leaves, rebuild = flatten((inputs, targets))
        rows = next(t.shape[0] for t in leaves if t.dim() > 0)
        return rebuild([p[self.rank] for p in _pieces(leaves, shard_sizes(rows, self.world))])

    def _split(self, batch: Tuple[Any, Any]) -> List[Shard]:
        # Inputs are kept as they are: the model is called as dmodel.loss
        # calls it (a tuple: positional arguments; a dict: keyword arguments,
        # e.g. a tokenizer's batch; anything else: one argument).
        leaves, rebuild = flatten(tuple(batch))
        rows = next(t.shape[0] for t in leaves if t.dim() > 0)
        if rows == 0:  # keep_short: none of this batch is this rank's
            return []
        sizes = shard_sizes(rows, min(rows, len(self.devices)))
        pieces = _pieces(leaves, sizes)
        shards = []
        for r in range(len(sizes)):
            device = self.devices[r]
            pin = device.type == "cuda"
            moved = [
                (p[r].pin_memory() if pin and p[r].device.type == "cpu" else p[r]).to(
                    device, non_blocking=True
                )
                for p in pieces
            ]
            shards.append(rebuild(moved))
        return shards


def _pieces(leaves: List[Any], sizes: List[int]) -> List[List[Any]]:
    """Each leaf split along dim 0 by `sizes` (0-dim leaves repeated)."""
    return [list(t.split(sizes)) if t.dim() > 0 else [t] * len(sizes) for t in leaves]


def samplers(loader: DataLoader) -> List[Any]:
    """The samplers a DataLoader draws from: its batch_sampler, and each
    `sampler` inside (a BatchSampler's, or its own when batch_size=None)."""
    found: List[Any] = []
    todo = [loader.batch_sampler, loader.sampler]  # (its own sampler first: k=0 below)
    while todo:
        s = todo.pop()
        if s is not None and not any(s is f for f in found):
            found.append(s)
            todo.append(getattr(s, "sampler", None))
    return found


def overridden_settings(cfg: Any, train_data: Any, valid_data: Any) -> List[str]:
    """The TrainConfig fields set away from their defaults that a DataLoader
    of the caller's overrides (its batches are the global batches, as it cuts
    them), each with what the loader does instead: for the Trainer's warning."""
    default = {f.name: f.default for f in fields(cfg)}
    found = []
    if isinstance(train_data, DataLoader):
        shuffles = any(  # (torch's random samplers; a DistributedSampler's own flag)
            isinstance(s, _SHUFFLING) or getattr(s, "shuffle", False) for s in samplers(train_data)
        )
        drops = train_data.drop_last or getattr(train_data.batch_sampler, "drop_last", False)
        rows = _batch_rows(train_data)
        eval_uses = valid_data is not None and not isinstance(valid_data, DataLoader)
        eval_uses = eval_uses and cfg.eval_batch_size is None  # (its default: batch_size)
        for name, value, loader in (
            ("batch_size", rows, not eval_uses),
            ("shuffle", shuffles, True),
            ("drop_last", bool(drops), True),
        ):
            given = getattr(cfg, name)
            if loader and given != default[name] and given != value:
                found.append(f"{name}={given!r} (the training DataLoader's: {value!r})")
    if isinstance(valid_data, DataLoader) and cfg.eval_batch_size is not None:
        rows = _batch_rows(valid_data)
        if cfg.eval_batch_size != rows:
            found.append(f"eval_batch_size={cfg.eval_batch_size!r} (valid_data's: {rows!r})")
    return found


def _batch_rows(loader: DataLoader) -> Optional[int]:
    """The rows a DataLoader's batches take: its batch_size, or its batch_sampler's."""
    return loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)


def _holds_numpy(tree: Any) -> bool:
    if type(tree).__module__ == "numpy":
        return True
    items = tree.values() if isinstance(tree, dict) else tree
    return isinstance(tree, (tuple, list, dict)) and any(map(_holds_numpy, items))


def _kinds(tree: Any) -> str:
    """The types in `tree`, for an error."""
    if isinstance(tree, (tuple, list, dict)):
        items = tree.values() if isinstance(tree, dict) else tree
        return f"{type(tree).__name__} of " + ", ".join(sorted({type(t).__name__ for t in items}))
    return type(tree).__name__


def _index(tree: Any, idx: torch.Tensor) -> Any:
    leaves, rebuild = flatten(tree)
    return rebuild([t[idx] if t.dim() > 0 else t for t in leaves])


def _rows(batch: Any) -> int:
    """The rows of a batch: the first dimension of its first tensor that has one."""
    return next(t.shape[0] for t in flatten(batch)[0] if t.dim() > 0)


def _pair(batch: Any) -> Tuple[Any, Any]:
    """A collated batch of a Dataset's items as (inputs, targets)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    form = f"dicts with keys {sorted(batch)}" if isinstance(batch, dict) else type(batch).__name__
    if isinstance(batch, (tuple, list)):
        form = f"{len(batch)}-tuples"
    raise ValueError(
        f"data: a Dataset's items must be (input, target) pairs, got {form}; wrap it so each "
        "item is a pair (inputs may be a dict or a tuple: ((ids, mask), label))"
    )
