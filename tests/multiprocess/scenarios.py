"""Run under torchrun by tests/test_multiprocess.py: `torchrun ... scenarios.py
NAME OUT_DIR`. Each rank checks what it can and writes OUT_DIR/NAME.rankR.json;
the test reads those. References are computed in every process (single-device
training on the global batch; torch DDP on the same split)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, List

import torch
import torch.distributed as dist
from torch import nn

import pyddp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ranks import (  # noqa: E402
    SGD,
    data,
    eval_norm,
    max_diff,
    my_rows,
    net,
    reference,
    wrap_on,  # noqa: E402
)
from ranks import sequence_of as _sequence_of  # noqa: E402
from ranks import simulated_gpus_of_rank as _simulated_gpus  # noqa: E402


# ------------------------------------------------------------------ scenarios
def simgpu(out: dict) -> None:
    """One NCCL communicator across processes, on the simulated CUDA driver and
    NCCL (tests/simgpu; host tensors stand in for device memory): equals
    single-device training; the simulation reports no broken rule."""
    rank, world = pyddp.rank(), pyddp.world()
    local = int(os.environ.get("LOCAL_REPLICAS", "1"))
    sim, streams, devices = _simulated_gpus(local)
    from simgpu import HostReads

    # The third global batch is smaller: dmodel.loss's rows, assumed after
    # the first step, are corrected on the device by the agreement's sums.
    batches = data(2, 12) + data(1, 7, seed=2) + data(1, 12, seed=3)
    ref = reference(batches)
    for cap in (0.0, 25.0):
        model = eval_norm(net(seed=rank))
        dm = wrap_on(model, local, (devices, streams), bucket_cap_mb=cap)
        dopt = dm.optimizer(torch.optim.SGD, **SGD)
        reads = HostReads()
        for k, (x, y) in enumerate(batches):
            rows = my_rows(len(x), rank, world)
            if k == 2:  # steady state from here: count the host's waits
                waits, exchanges = sim.counter("host_sync"), _sequence_of(dm)
                reads.__enter__()
            dopt.zero_grad()
            dm.loss(nn.functional.mse_loss, x[rows], y[rows]).backward()
            streams.synchronize_all(devices)  # the optimizer "kernel" runs in stream order
            dopt.step()
            streams.synchronize_all(devices)
        reads.__exit__(None, None, None)
        out[f"steady_host_waits_cap{cap:g}"] = sim.counter("host_sync") - waits
        out[f"steady_host_reads_cap{cap:g}"] = reads.reads
        out[f"steady_exchanges_cap{cap:g}"] = _sequence_of(dm) - exchanges
        out[f"diff_cap{cap:g}"] = max_diff(dm.module, ref)
        out[f"never_none_cap{cap:g}"] = dm.module.never.weight.grad is None
        out["backend"] = dm._reducer.backend.name
        # Buffers after a synced training step (torch DDP's rule): rank 0's,
        # on the device (NCCL), bit for bit (a signed zero and an integer
        # counter included; BatchNorm is in eval mode: nothing else moves them).
        with torch.no_grad():
            for m in dm.replicas:
                m.norm.running_mean.fill_(float(rank + 1))
                m.norm.running_mean[0] = -0.0 if rank == 0 else 5.0
                m.norm.num_batches_tracked.fill_(7 + rank)
        before = _sequence_of(dm)
        dm(batches[0][0][my_rows(12, rank, world)]).sum().backward()
        streams.synchronize_all(devices)
        out[f"buffer_exchanges_cap{cap:g}"] = _sequence_of(dm) - before
        out[f"buffers_cap{cap:g}"] = [
            [m.norm.running_mean.tolist(), int(m.norm.num_batches_tracked),
             str(m.norm.running_mean[0].item())]
            for m in dm.replicas
        ]  # fmt: skip
        dm.close()
    # A model whose every parameter gets a gradient on every rank (the common
    # case): in steady state the host neither waits nor reads nor exchanges.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    dm = wrap_on(model, local, (devices, streams), bucket_cap_mb=0.0005)
    for m in dm.replicas:
        m[1].eval()  # a 7-row batch over 4 GPUs: too few rows for batch statistics
    dopt = dm.optimizer(torch.optim.SGD, **SGD)
    reads = HostReads()
    for k, (x, y) in enumerate(batches + batches):
        rows = my_rows(len(x), rank, world)
        if k == 3:
            waits, exchanges = sim.counter("host_sync"), _sequence_of(dm)
            reads.__enter__()
        dopt.zero_grad()
        dm.loss(nn.functional.mse_loss, x[rows], y[rows]).backward()
        streams.synchronize_all(devices)
        dopt.step()
        streams.synchronize_all(devices)
    reads.__exit__(None, None, None)
    out["all_used_steady_steps"] = len(batches) * 2 - 3
    out["all_used_host_waits"] = sim.counter("host_sync") - waits
    out["all_used_host_reads"] = reads.reads
    out["all_used_exchanges"] = _sequence_of(dm) - exchanges
    dm.close()
    _join_on_simulated_gpus(out, devices, streams)
    _throttle_on_simulated_gpus(out, devices, streams)
    _compression_on_simulated_gpus(out, devices, streams)
    out["violations"] = sim.violations()


def _throttle_on_simulated_gpus(out: dict, devices, streams) -> None:
    """The GPUs far behind the host: no agreement's sums ever reach the host
    by themselves (their copies report not ready until waited for). The host
    reads none in the first three steps, then waits for the oldest once per
    step, so at most three are ever unread; training is unchanged."""
    from pyddp.engine.streams import HostCopy

    rank, world = pyddp.rank(), pyddp.world()
    waits: List[int] = []
    step = [0]
    real_fetch = streams.fetch

    def slow_fetch(device, tensor):
        copy = real_fetch(device, tensor)

        def synchronize():
            waits.append(step[0])
            copy.get()

        return HostCopy(tensor, lambda: False, synchronize)

    def model() -> nn.Module:  # every parameter used: the host never needs the sums
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    batches = data(5, 12)
    ref = model()
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
    for x, y in batches:
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    streams.fetch = slow_fetch
    try:
        dm = wrap_on(model(), len(devices), (devices, streams))
        dopt = dm.optimizer(torch.optim.SGD, **SGD)
        for k, (x, y) in enumerate(batches):
            step[0] = k
            rows = my_rows(len(x), rank, world)
            dopt.zero_grad()
            dm.loss(nn.functional.mse_loss, x[rows], y[rows]).backward()
            streams.synchronize_all(devices)
            dopt.step()
            streams.synchronize_all(devices)
        out["throttle_waits"] = waits[:]
        out["throttle_diff"] = max_diff(dm.module, ref)
        dm.close()  # reads the rest
        out["throttle_waits_at_close"] = len(waits) - len(out["throttle_waits"])
    finally:
        streams.fetch = real_fetch


def _compression_on_simulated_gpus(out: dict, devices, streams) -> None:
    """torch DDP's fp16 compression hook on the simulated GPUs: pyddp's core
    casts, scales by 1/GPUs (as torch's CUDA div_) and sums in 16 bits on
    NCCL. With one GPU per process (2 ranks: one sum, and torch's CPU div_
    agrees with CUDA's reciprocal there), bitwise the CPU path, where
    torch's own hook runs on gloo; with more, within fp16 rounding of one
    device."""
    rank, world = pyddp.rank(), pyddp.world()
    batches = data(3, 12, seed=4)
    ref = reference(batches)

    def train(places, gpus=None):
        dm = wrap_on(eval_norm(net(seed=rank)), len(places), gpus)
        dm.register_comm_hook(None, "fp16")
        dopt = dm.optimizer(torch.optim.SGD, **SGD)
        for x, y in batches:
            rows = my_rows(len(x), rank, world)
            dopt.zero_grad()
            dm.loss(nn.functional.mse_loss, x[rows], y[rows]).backward()
            streams.synchronize_all(devices)
            dopt.step()
            streams.synchronize_all(devices)
        return dm

    dm = train(devices, (devices, streams))
    out["fp16_wire"] = dm._reducer.backend.compression
    out["fp16_diff"] = max_diff(dm.module, ref)
    out["fp16_replicas_equal"] = all(max_diff(m, dm.module) == 0.0 for m in dm.replicas)
    if len(devices) == 1:
        cpu = train(["cpu"])
        out["fp16_vs_torch_hook"] = max_diff(dm.module, cpu.module)
        cpu.close()
    dm.close()


def _join_on_simulated_gpus(out: dict, devices, streams) -> None:
    """Under Join on the simulated GPUs: rank 0 runs out after one step and
    shadows the others' synced backwards through NCCL (the agreement on the
    device, over the GPUs of the ranks with inputs); equal to one device on
    the rows the ranks with inputs hold (dmodel.loss)."""
    rank, world = pyddp.rank(), pyddp.world()
    counts = [1] + [3] * (world - 1)
    g = torch.Generator().manual_seed(21)
    per_rank = [
        [(torch.randn(6, 6, generator=g), torch.randn(6, 3, generator=g)) for _ in range(c)]
        for c in counts
    ]
    ref = eval_norm(net())
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
    for step in range(max(counts)):
        here = [per_rank[r][step] for r in range(world) if step < counts[r]]
        ref_opt.zero_grad()
        x, y = torch.cat([b[0] for b in here]), torch.cat([b[1] for b in here])
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()

    def joined(model: nn.Module, gpus: Any = None) -> Any:
        """This rank's batches under dm.join(); the closed wrapped model."""
        dm = wrap_on(model, len(devices), gpus)
        for m in dm.replicas if not model.norm.training else []:
            m.norm.eval()
        dopt = dm.optimizer(torch.optim.SGD, **SGD)
        with dm.join():
            for x, y in per_rank[rank]:
                dopt.zero_grad()
                dm.loss(nn.functional.mse_loss, x, y).backward()
                streams.synchronize_all(devices)
                dopt.step()
                streams.synchronize_all(devices)
        streams.synchronize_all(devices)
        dm.close()
        return dm

    dm = joined(eval_norm(net(seed=rank)), (devices, streams))
    out["join_diff"] = max_diff(dm.module, ref)
    out["join_replicas_equal"] = all(max_diff(m, dm.module) == 0.0 for m in dm.replicas)

    # BatchNorm training: the ranks' running statistics differ, and each
    # training forward takes the highest rank with inputs' buffers (joined
    # ranks shadow that broadcast through NCCL). The same as on CPUs (whose
    # Join scenario matches torch DDP), parameters and buffers.
    on_gpus = joined(net(seed=rank), (devices, streams)).module
    on_cpus = joined(net(seed=rank)).module
    pairs = list(zip(on_gpus.parameters(), on_cpus.parameters()))
    pairs += list(zip(on_gpus.buffers(), on_cpus.buffers()))
    out["join_buffers_vs_cpu"] = max((a.double() - b.double()).abs().max().item() for a, b in pairs)
    out["join_buffers_moved"] = bool((on_gpus.norm.running_mean != 0).any())


def gpu_processes(out: dict) -> None:
    """Real GPUs (one per process): what the simgpu scenario checks on the
    simulation, on hardware. Equal to one device with an uneven, changing
    global batch (dmodel.loss), rank 0's buffers through NCCL, and in steady
    state no host synchronisation (torch's sync debug mode counts them)."""
    import warnings

    rank, world = pyddp.rank(), pyddp.world()
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    batches = data(2, 12) + data(1, 7, seed=2) + data(3, 12, seed=3)
    ref = reference(batches)
    model = eval_norm(net(seed=rank)).to(dev)
    dm = pyddp.wrap(model, [dev])
    dopt = dm.optimizer(torch.optim.SGD, **SGD)
    syncs = []
    for k, (x, y) in enumerate(batches):
        rows = my_rows(len(x), rank, world)
        xs, ys = x[rows].to(dev), y[rows].to(dev)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn" if k >= 3 else "default")
            dopt.zero_grad()
            dm.loss(nn.functional.mse_loss, xs, ys).backward()
            dopt.step()
            torch.cuda.set_sync_debug_mode("default")
        syncs += [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    torch.cuda.synchronize()
    out["diff"] = max((p.detach().cpu() - q).abs().max().item()
                      for p, q in zip(dm.module.parameters(), ref.parameters()))  # fmt: skip
    # `never` has no gradient anywhere: the agreement's wait leaves it None,
    # which is a host wait each step; the syncs come from there only.
    out["never_none"] = dm.module.never.weight.grad is None
    out["syncs"] = syncs
    with torch.no_grad():
        dm.module.norm.running_mean.fill_(float(rank + 1))
    dm(batches[0][0][my_rows(12, rank, world)].to(dev))
    out["buffer"] = dm.module.norm.running_mean.cpu().tolist()
    dm.close()


def _expect_failure(out: dict, run) -> None:
    """Runs `run`, records its error (None if it did not raise) and how long it
    took, then writes `out` and ends the process."""
    t0 = time.monotonic()
    try:
        run()
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - t0
    _write_and_exit(out)


def _write_and_exit(out: dict) -> None:
    _write(out)
    os._exit(0)  # the group is broken: no clean shutdown to wait for


def _write(out: dict) -> None:
    path = os.path.join(sys.argv[2], f"{sys.argv[1]}.rank{pyddp.rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    name = sys.argv[1]
    pyddp.init()
    out: dict = {"world": pyddp.world()}
    try:
        globals()[name](out)
    except Exception:  # noqa: BLE001 - the test shows it
        out["exception"] = traceback.format_exc()
    _write(out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
