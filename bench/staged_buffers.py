"""What staging rank 0's buffers costs a receiving rank per synced step
(pyddp/replicas/staged.py), alone, in one process: receive() at the end of
the backward (a copy of this rank's buffers; the broadcast itself left
out) and put_in() at the next forward (a comparison per buffer, then the
copy of what was received), for MLPs with a BatchNorm1d after each hidden
layer. Medians of 300 calls, in microseconds.

    python bench/staged_buffers.py"""

from __future__ import annotations

import statistics
import time
import types
from typing import Any, List

import torch
from torch import nn

from pyddp.replicas.staged import StagedBuffers


class _Receiving:
    """A link as a receiving rank sees it: rank 1, outside Join, the
    broadcast a no-op."""

    rank = 1
    joining = types.SimpleNamespace(step=None, staged_from=None)

    def broadcast(self, tensors: List[torch.Tensor], what: str) -> None:
        pass


def mlp_bn(width: int, depth: int) -> nn.Module:
    layers: List[Any] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU()]
    return nn.Sequential(*layers)


def main() -> None:
    torch.set_num_threads(1)
    print(f"{'model':>14} {'buffers':>8} {'receive us':>11} {'put_in us':>10}")
    for width, depth in ((128, 3), (1024, 6), (64, 10)):
        model, staged, link = mlp_bn(width, depth), StagedBuffers(gpus=False), _Receiving()
        receive, put_in = [], []
        for _ in range(300):
            t0 = time.perf_counter()
            staged.receive(link, model)
            t1 = time.perf_counter()
            staged.put_in(link, model)
            put_in.append(time.perf_counter() - t1)
            receive.append(t1 - t0)
        buffers = sum(1 for _ in model.buffers())
        print(
            f"{f'MLP {width}x{depth}':>14} {buffers:>8} "
            f"{statistics.median(receive) * 1e6:>11.1f} {statistics.median(put_in) * 1e6:>10.1f}"
        )


if __name__ == "__main__":
    main()
