"""`python -m pyddp.doctor --selftest`: pyddp's GPU checks on this machine's
real GPUs. pyddp's GPU path is tested in CI against a simulated CUDA driver and
NCCL only (no project machine has a GPU), so this is the first run on real
hardware: equivalence with single-device training, stream ordering without host
syncs (custom streams included), the four collectives in every dtype (copies
bit for bit: pyddp/doctor/collectives.py), the sharded optimizer (stages 1
and 2), SyncBatchNorm summed on the devices (2+ GPUs), the timeout. Prints
one pass/fail table and what to put in a bug report."""

from __future__ import annotations

import copy
import time
import traceback
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import collectives


def _check_collectives(devices: List[str]) -> str:
    return (
        collectives.check(len(devices), lambda r, t: t.to(devices[r]), torch.cuda.synchronize)
        + f" ({', '.join(devices)})"
    )


def _check_equivalence(
    devices: List[str], stream: bool = False, shard: Any = False, hook: Optional[str] = None
) -> str:
    """Five SGD steps of a wrapped model against one device. `stream`: under
    a side stream, with small buckets, so that the first step's rebuild frees
    buckets the model's default stream allocated while the side stream used
    them (torch's caching allocator must not hand them out early); `shard`:
    sharded optimizer state, or "gradients" (ZeRO stage 2: the backend's
    reduce-scatter; bitwise the unsharded step, so the same tolerance);
    `hook`: "fp16" compression on the wire (11 mantissa bits: 1e-2)."""
    import pyddp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 5)).cuda()
    ref = copy.deepcopy(model)
    side = torch.cuda.Stream() if stream else None
    dm = pyddp.wrap(model, devices, bucket_cap_mb=0.004 if stream else 0)
    if hook is not None:
        dm.register_comm_hook(None, hook)
    opt = dm.optimizer(torch.optim.SGD, shard=shard, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator(device="cpu").manual_seed(1)
    for _ in range(5):
        x, y = (
            torch.randn(12, 32, generator=g).cuda(),
            torch.randint(0, 5, (12,), generator=g).cuda(),
        )
        ctx = (
            torch.cuda.stream(side)
            if side is not None
            else torch.cuda.stream(torch.cuda.current_stream())
        )
        with ctx:
            if side is not None:
                side.wait_stream(torch.cuda.default_stream())
            F.cross_entropy(dm(x), y).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    worst = max(
        (p - q).abs().max().item() for p, q in zip(dm.module.parameters(), ref.parameters())
    )
    dm.close()
    if worst > (1e-2 if hook is not None else 1e-4):
        raise AssertionError(f"parameters differ from single-device training by {worst:.2e}")
    return f"max |diff| {worst:.1e} after 5 steps"


def _check_syncbn(devices: List[str]) -> str:
    """SyncBatchNorm on one replica per GPU (statistics summed by NCCL on the
    devices) against one device running BatchNorm on the whole batch, 3
    SGD steps."""
    import pyddp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    model = model.cuda()
    ref = copy.deepcopy(model)
    dm = pyddp.wrap(pyddp.convert_sync_batchnorm(model), devices)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator(device="cpu").manual_seed(2)
    for _ in range(3):
        x = (torch.randn(24, 16, generator=g) * 2 + 1).cuda()
        y = torch.randint(0, 4, (24,), generator=g).cuda()
        F.cross_entropy(dm(x), y).backward()
        opt.step()
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.cuda.synchronize()
    worst = max(
        (a.float() - b.float()).abs().max().item()
        for a, b in zip(
            list(dm.module.parameters()) + list(dm.module.buffers()),
            list(ref.parameters()) + list(ref.buffers()),
        )
    )
    dm.close()
    if worst > 1e-4:
        raise AssertionError(f"SyncBatchNorm differs from one device's BatchNorm by {worst:.2e}")
    return f"max |diff| {worst:.1e} after 3 steps (parameters and running statistics)"


def _check_ordering(devices: List[str]) -> str:
    import pyddp

    class Delay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            torch.cuda._sleep(50_000_000)  # the gradient below is computed late
            return g

    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2048, 2048))

        def forward(self, x):
            return Delay.apply(x @ self.w)

    dm = pyddp.wrap(Big().cuda(), devices, bucket_cap_mb=0)
    x = torch.ones(8, 2048, device="cuda")
    for _ in range(3):
        dm.zero_grad()
        dm(x).sum().backward()
        got = dm.module.w.grad.clone()  # on the compute stream: ordered, no host sync
        if not torch.equal(got, torch.full_like(got, 8.0)):
            raise AssertionError(f"gradient read {got.flatten()[:3].tolist()}, expected 8.0")
    dm.close()
    return "3 backwards with a delayed producer"


def _check_timeout(devices: List[str]) -> str:
    import pyddp

    from ..runtime import libraries as _runtime

    backend = _runtime.make_backend([torch.device(d) for d in devices], timeout=0.2)
    ts = [torch.ones(1024, device=d) for d in devices]
    torch.cuda._sleep(2_000_000_000)
    streams = [torch.cuda.current_stream(torch.device(d)).cuda_stream for d in devices]
    idx = [torch.device(d).index for d in devices]
    backend.reduce([t.data_ptr() for t in ts], idx, streams, 1024, "float32", "sum")
    time.sleep(0.6)
    try:
        backend.reduce([t.data_ptr() for t in ts], idx, streams, 1024, "float32", "sum")
    except pyddp.ReduceError as e:
        torch.cuda.synchronize()
        backend.close()
        return f"raised: {str(e)[:60]}..."
    raise AssertionError("a stalled reduction did not time out")


def run() -> int:
    print()
    if not torch.cuda.is_available():
        print("selftest: torch sees no CUDA GPU here: nothing to test (CPU tier: pytest)")
        return 2
    n = torch.cuda.device_count()
    shared = ["cuda:0", "cuda:0"]
    checks: List[Tuple[str, Callable[[], str]]] = [
        ("collectives, 2 replicas on cuda:0 (kernel)", lambda: _check_collectives(shared)),
        ("equivalence, 2 replicas on cuda:0", lambda: _check_equivalence(shared)),
        ("equivalence under torch.cuda.stream(s)", lambda: _check_equivalence(shared, True)),
        ("stream ordering, no host sync", lambda: _check_ordering(shared)),
        (
            "sharded optimizer state, 2 replicas on cuda:0",
            lambda: _check_equivalence(shared, shard=True),
        ),
        (
            "sharded gradients (ZeRO-2), 2 replicas on cuda:0",
            lambda: _check_equivalence(shared, shard="gradients"),
        ),
        ("timeout of a stalled reduction", lambda: _check_timeout(shared)),
    ]
    if n >= 2:
        pair = ["cuda:0", "cuda:1"]
        checks += [
            ("collectives, cuda:0 + cuda:1 (NCCL)", lambda: _check_collectives(pair)),
            ("equivalence, cuda:0 + cuda:1 (NCCL)", lambda: _check_equivalence(pair)),
            ("equivalence, NCCL under a side stream", lambda: _check_equivalence(pair, True)),
            ("stream ordering, NCCL", lambda: _check_ordering(pair)),
            ("sharded optimizer state, NCCL", lambda: _check_equivalence(pair, True, shard=True)),
            (
                "sharded gradients (ZeRO-2), NCCL",
                lambda: _check_equivalence(pair, True, shard="gradients"),
            ),
            ("SyncBatchNorm on the devices, NCCL", lambda: _check_syncbn(pair)),
            ("fp16 compression on the wire, NCCL", lambda: _check_equivalence(pair, hook="fp16")),
        ]
    rows = []
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            detail, status = fn(), "PASS"
        except Exception as e:  # reported in the table, with the traceback below it
            detail, status = f"{type(e).__name__}: {e}", "FAIL"
            traceback.print_exc()
        rows.append((name, status, time.perf_counter() - t0, detail))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'check'.ljust(width)}  result  time    detail")
    for name, status, secs, detail in rows:
        print(f"{name.ljust(width)}  {status:6}  {secs:5.1f}s  {detail}")
    failed = sum(r[1] == "FAIL" for r in rows)
    print(
        f"\n{len(rows) - failed}/{len(rows)} passed. "
        + ("All good." if not failed else "")
        + "\nBug report: paste this whole output (doctor report and table) and `nvidia-smi` "
        "into an issue."
    )
    return 1 if failed else 0
