"""Which parameters the replicas synchronise, checked once: trainable, dense,
of a reducible dtype, identical in name, shape and dtype on every replica, each
replica on one device."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import nn

from ..runtime.libraries import DTYPE_NAMES


def dtype_name(name: str, p: torch.Tensor) -> str:
    try:
        return DTYPE_NAMES[p.dtype]
    except KeyError:
        raise ValueError(
            f"parameter {name!r} has dtype {p.dtype}; pyddp reduces float32, float64, "
            "float16 and bfloat16 gradients"
        ) from None


def trainable_params(
    replicas: Sequence[nn.Module],
) -> Tuple[List[str], List[List[nn.Parameter]]]:
    named = [[(n, p) for n, p in m.named_parameters() if p.requires_grad] for m in replicas]
    names = [n for n, _ in named[0]]
    if not names:
        raise ValueError(
            "the model has no trainable parameters (none with requires_grad=True): "
            "there is nothing to synchronise"
        )
    for m in replicas[0].modules():
        if getattr(m, "sparse", False) is True and isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            raise ValueError(
                f"{type(m).__name__} with sparse=True produces sparse gradients, which pyddp "
                "does not reduce; construct it with sparse=False"
            )
    params = []
    for r, pairs in enumerate(named):
        if [n for n, _ in pairs] != names:
            raise ValueError(
                f"replica {r} has trainable parameters {[n for n, _ in pairs][:5]}..., replica 0 "
                f"has {names[:5]}...: replicas must be copies of one model"
            )
        devices = {p.device for _, p in pairs}
        if len(devices) != 1:
            raise ValueError(
                f"replica {r} has parameters on several devices {sorted(map(str, devices))}: "
                "each replica must live on one device"
            )
        for (n, p), p0 in zip(pairs, (p for _, p in named[0])):
            if p.shape != p0.shape or p.dtype != p0.dtype:
                raise ValueError(
                    f"parameter {n!r}: replica {r} has shape {tuple(p.shape)} {p.dtype}, "
                    f"replica 0 has {tuple(p0.shape)} {p0.dtype}; replicas must be copies"
                )
        params.append([p for _, p in pairs])
    return names, params
