"""Evaluation for the Trainer: loss and metrics over a dataset, sharded over
this process's replicas (and over the ranks during fit()), as sums weighted
by rows so the result is the mean over all rows, as on one device."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from .._link import exchange
from ..replicas.scatter import call_arguments
from ..replicas.tree import flatten
from .config import TrainConfig
from .data import ShardedLoader

_VALID_SUMS = exchange("the sums of a validation during fit()")


def evaluate(
    model: Any,
    data: Any,
    cfg: TrainConfig,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    metrics: Dict[str, Callable[[Any, Any], torch.Tensor]],
    autocast: Callable[[], Any],
    across_ranks: bool,
) -> Dict[str, float]:
    """Loss and metrics of the wrapped `model` over `data` (means over all
    rows, as one device would compute them). `across_ranks`: every rank
    evaluates its slice and the sums are exchanged (every rank must call
    it); else this process evaluates all of `data`."""
    ranks = model.ranks
    loader = eval_loader(model, data, cfg, across_ranks)
    # Each module's own mode comes back afterwards (a user may keep, say,
    # BatchNorm in eval mode while training the rest).
    modes = [(m, m.training) for m in model.module.modules()]
    model._broadcast_buffers_now()  # evaluate replica 0's statistics everywhere
    model.eval()
    names = ["loss", *metrics]
    totals: Optional[torch.Tensor] = None
    rows = 0

    def shard_sums(r: int, replica: nn.Module, shard: Any) -> torch.Tensor:
        (inputs, targets), n = shard, shard_rows(shard)
        args, kwargs = call_arguments(inputs)
        with autocast():
            out = replica(*args, **kwargs)
            values = [loss_fn(out, targets)]
            values += [fn(out, targets) for fn in metrics.values()]
        for name, value in zip(names, values):
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                what = "loss_fn" if name == "loss" else f"the metric {name!r}"
                raise ValueError(
                    f"{what} must return a scalar tensor (the mean over the shard's rows), "
                    f"got {getattr(value, 'shape', type(value).__name__)}"
                )
        return torch.stack([v.detach().float().reshape(()) * n for v in values])

    try:
        with contextlib.closing(loader.epoch(0)) as batches:
            for shards, _ in batches:
                if not shards:  # none of this batch's rows are this rank's
                    continue
                sums = model._map_replicas(shard_sums, shards, "evaluate")
                batch = sum(s.to(model.devices[0]) for s in sums)
                totals = batch if totals is None else totals + batch
                rows += sum(shard_rows(s) for s in shards)
    finally:
        for m, mode in modes:
            m.train(mode)
        model.training = model.module.training
    if not across_ranks and rows == 0:  # (a DistributedSampler's share of padding alone)
        raise ValueError(
            "evaluate: this rank's share of the data holds no rows (its DistributedSampler "
            "gave it padding only); evaluate during fit(), where the ranks' sums are exchanged"
        )
    if across_ranks:  # every rank's rows: the same figures everywhere
        local = totals.tolist() if totals is not None else [0.0] * len(names)
        sums = ranks.sum([rows, *local], _VALID_SUMS)
        rows, totals = sums[0], torch.tensor(sums[1:], dtype=torch.float64)
    values = (totals / rows).tolist()  # one host sync for the whole evaluation
    return {f"valid_{n}" if n == "loss" else n: v for n, v in zip(names, values)}


def eval_loader(model: Any, data: Any, cfg: TrainConfig, across_ranks: bool,
                name: str = "data") -> ShardedLoader:  # fmt: skip
    """The loader of an evaluation over `data` (see evaluate); built early,
    fit() refuses bad `valid_data` (`name`) before it trains."""
    ranks = model.ranks
    return ShardedLoader(
        data,
        cfg.eval_batch_size or cfg.batch_size,
        model.devices,
        shuffle=False,
        seed=cfg.seed,
        prefetch=cfg.prefetch,
        rank=ranks.rank if across_ranks else 0,
        world=ranks.world if across_ranks else 1,
        keep_short=True,  # every row counts; a rank may get none of the last batch
        name=name,
    )


def shard_rows(shard: Any) -> int:
    """The rows of one replica's shard, (inputs, targets)."""
    args, _ = shard
    return next(t.shape[0] for t in flatten(args)[0] if t.dim() > 0)
