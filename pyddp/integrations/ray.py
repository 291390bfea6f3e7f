"""pyddp in Ray Train: inside a `TorchTrainer`'s training function,
`pyddp.ray.prepare_model(model)` replaces `ray.train.torch.prepare_model`.

    import pyddp.ray

    def train_func(config):
        model = pyddp.ray.prepare_model(make_model())   # was ray.train.torch.prepare_model
        ...                                              # Ray Train as usual

    TorchTrainer(train_func, scaling_config=ScalingConfig(num_workers=N)).fit()

Ray Train starts the workers and their torch.distributed group (gloo on
CPUs, NCCL on GPUs: TorchConfig); pyddp wraps the model over the device Ray
gave this worker, on that group. Checkpoints (`ray.train.report`), restarts
after a worker failure (`FailureConfig`) and data sharding
(`ray.train.torch.prepare_data_loader`) stay Ray's."""

from __future__ import annotations

from typing import Any

try:
    import ray.train
    import ray.train.torch
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError(
        "pyddp.ray needs Ray Train: pip install 'pyddp-engine[ray]' (from a clone: '.[ray]')"
    ) from e

import torch.distributed as dist
from torch import nn

from ..replicas.ddp_args import wrap_options
from ..replicas.model import DistributedModel, wrap


def prepare_model(model: nn.Module, **options: Any) -> DistributedModel:
    """`model` on this worker's device (`ray.train.torch.get_device()`),
    wrapped by pyddp over Ray Train's process group. `options`: pyddp.wrap's
    (DDP's keywords read as in the other integrations)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"pyddp.ray.prepare_model: expected a torch.nn.Module, got "
                        f"{type(model).__name__}")  # fmt: skip
    options = wrap_options(options, "pyddp.ray.prepare_model")
    world = ray.train.get_context().get_world_size()
    if world > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"pyddp.ray.prepare_model: Ray Train runs {world} workers but torch.distributed is "
            "not initialised in this one; call it inside a TorchTrainer's training function"
        )
    return wrap(model, [ray.train.torch.get_device()], **options)
