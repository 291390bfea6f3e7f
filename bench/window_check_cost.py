"""What watching a no_sync() window costs: with several replicas in one
process, pyddp records replica 0's buckets at each window backward's end
and checks them at the next backward's start (pyddp/engine/ending.py
Window.check: a change to the model's gradients inside the window is
refused). P parameters of 4 elements on 2 CPU replicas; per P, rounds of a
window's second micro-batch (forward and backward under no_sync()) with the watch
and with it switched off, interleaved; the medians (ms), their ratio, and
the watched rounds' p10-p90.

    python bench/window_check_cost.py [--sizes 250,1000,2000] [--rounds 15]"""

from __future__ import annotations

import contextlib
import time
from unittest import mock

import torch
from reseat_cost import Many, interleaved, table

import pyddp
from pyddp.engine import ending


class _Unwatched:
    """Window's record of a backward's end, switched off."""

    def __init__(self, layout: object) -> None:
        pass


def micro_batch_ms(count: int, rounds: int) -> dict:
    model = Many(count)
    dm = pyddp.wrap(model, ["cpu", "cpu"])
    opt = dm.optimizer(torch.optim.SGD, lr=0.0)
    x = torch.randn(2, 4)

    def once(watched: bool) -> float:
        """A window's second micro-batch (its start checks the first's end)."""
        opt.zero_grad()
        off = mock.patch.multiple(ending, _Seen=_Unwatched, follow_changes=lambda *a: None)
        with off if not watched else contextlib.nullcontext(), dm.no_sync():
            dm(x).backward()
            start = time.perf_counter()
            dm(x).backward()
            elapsed = time.perf_counter() - start
        return elapsed * 1e3

    result = interleaved(once, rounds)
    dm.close()
    return result


if __name__ == "__main__":
    table(__doc__, micro_batch_ms, 15, ("unwatched", "watched"), 2)
