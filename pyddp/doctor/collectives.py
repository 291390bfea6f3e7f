"""The selftest's check of pyddp's collectives on real GPUs: all_reduce,
broadcast, all_gather and reduce_scatter in every dtype, sizes 0, 1, odd and
over a megabyte. broadcast and all_gather copy: compared bit for bit on
random bit patterns (NaN payloads, signed zeros, subnormals, infinities
among them). all_reduce and reduce_scatter on values whose sums are exact
in every dtype (integers under 256), against their closed form.

Written against three seams (where each replica's tensor is placed, how the
host waits for the devices, the placement context) so the test suite runs it
on the simulated driver and NCCL as the selftest runs it on torch's CUDA."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, List

import torch

Place = Callable[[int, torch.Tensor], torch.Tensor]  # replica, host tensor -> its copy

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SIZES = [0, 1, 7, (1 << 20) + 3]
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _random_bits(size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """`size` values of `dtype` with uniformly random bit patterns."""
    itype = _BITS[torch.empty(0, dtype=dtype).element_size()]
    info = torch.iinfo(itype)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(info.min, info.max, (size,), dtype=itype, generator=g).view(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    itype = _BITS[a.element_size()]
    return torch.equal(a.cpu().contiguous().view(itype), b.cpu().contiguous().view(itype))


def check(
    n: int,
    place: Place,
    done: Callable[[], None],
    placed: Callable[[], ContextManager] = contextlib.nullcontext,
    sizes: List[int] = SIZES,
) -> str:
    """Runs every collective over `n` replicas; raises AssertionError naming
    the collective, dtype and size that went wrong."""
    import pyddp

    def run(collective, inputs):
        ts = [place(r, t) for r, t in enumerate(inputs)]
        with placed():
            outs = collective(ts)
        done()
        return ts if outs is None else outs

    for dtype in DTYPES:
        for size in sizes:
            where = f"{dtype} size {size}"
            i = torch.arange(size * n, dtype=torch.float64) % 16
            whole = [(i + 16 * (r + 1)).to(dtype) for r in range(n)]
            want = sum(i + 16 * (r + 1) for r in range(n)).to(dtype)
            got = run(pyddp.all_reduce, [w[:size] for w in whole])
            if not all(torch.equal(t.cpu(), want[:size]) for t in got):
                raise AssertionError(f"all_reduce {where}: not the closed-form sum")
            got = run(pyddp.reduce_scatter, whole)
            for r, t in enumerate(got):
                if not torch.equal(t.cpu(), want[r * size : (r + 1) * size]):
                    raise AssertionError(f"reduce_scatter {where}: replica {r}'s block is wrong")
            bits = [_random_bits(size, dtype, seed=r) for r in range(n)]
            for root in sorted({0, n - 1}):
                got = run(lambda ts, root=root: pyddp.broadcast(ts, root=root), bits)
                if not all(_same_bits(t, bits[root]) for t in got):
                    raise AssertionError(f"broadcast {where} from {root}: not bit for bit")
            for r, out in enumerate(run(pyddp.all_gather, bits)):
                for k in range(n):
                    if not _same_bits(out[k], bits[k]):
                        raise AssertionError(
                            f"all_gather {where}: replica {r}'s block {k} is not bit for bit"
                        )
    return (
        f"4 collectives x {len(DTYPES)} dtypes x {len(sizes)} sizes on {n} replicas "
        "(copies bit for bit on random bit patterns)"
    )
