"""GradSync across processes on the simulated CUDA driver and NCCL
(tests/simgpu; host tensors stand in for device memory): two processes x 1
or 2 simulated GPUs on one NCCL communicator (its unique id through
torch.distributed's store), equal to single-device training; in steady state
the host neither waits for a GPU nor reads a device value nor makes a gloo
exchange; rank 0's buffers through NCCL; Join, the GPUs far behind the host,
and fp16 compression, there too. The simulation must report no broken rule."""

from __future__ import annotations

import os
import threading
from functools import partial
from typing import Any, List

import pytest
import torch
from ranks import (
    SGD,
    data,
    eval_norm,
    max_diff,
    my_rows,
    net,
    reference,
    sequence_of,
    simulated_gpus_of_rank,
    step_on_rows,
    wrap_on,
)
from spawn import launch
from torch import nn

import pyddp
from pyddp.errors import ProcessGroupError

pytestmark = pytest.mark.simgpu


def gradsync_on_simulated_gpus(out: dict) -> None:
    """One NCCL communicator across processes, on the simulated CUDA driver and
    NCCL (tests/simgpu; host tensors stand in for device memory): equals
    single-device training; the simulation reports no broken rule."""
    rank, world = pyddp.rank(), pyddp.world()
    local = int(os.environ.get("LOCAL_REPLICAS", "1"))
    sim, streams, devices = simulated_gpus_of_rank(local)
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
                waits, exchanges = sim.counter("host_sync"), sequence_of(dm)
                reads.__enter__()
            dopt.zero_grad()
            dm.loss(nn.functional.mse_loss, x[rows], y[rows]).backward()
            streams.synchronize_all(devices)  # the optimizer "kernel" runs in stream order
            dopt.step()
            streams.synchronize_all(devices)
        reads.__exit__(None, None, None)
        out[f"steady_host_waits_cap{cap:g}"] = sim.counter("host_sync") - waits
        out[f"steady_host_reads_cap{cap:g}"] = reads.reads
        out[f"steady_exchanges_cap{cap:g}"] = sequence_of(dm) - exchanges
        out[f"diff_cap{cap:g}"] = max_diff(dm.module, ref)
        out[f"never_none_cap{cap:g}"] = dm.module.never.weight.grad is None
        out["backend"] = dm._reducer._backend.name
        # Buffers at the forward after a synced step (torch DDP's rule): rank 0's,
        # on the device (NCCL), bit for bit (a signed zero and an integer
        # counter included; BatchNorm is in eval mode: nothing else moves them).
        with torch.no_grad():
            for m in dm.replicas:
                m.norm.running_mean.fill_(float(rank + 1))
                m.norm.running_mean[0] = -0.0 if rank == 0 else 5.0
                m.norm.num_batches_tracked.fill_(7 + rank)
        before = sequence_of(dm)
        dm(batches[0][0][my_rows(12, rank, world)]).sum().backward()
        streams.synchronize_all(devices)
        out[f"buffer_exchanges_cap{cap:g}"] = sequence_of(dm) - before
        with torch.no_grad():  # they go in at the next forward, as DDP's
            dm(batches[0][0][my_rows(12, rank, world)])
        streams.synchronize_all(devices)
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
            waits, exchanges = sim.counter("host_sync"), sequence_of(dm)
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
    out["all_used_exchanges"] = sequence_of(dm) - exchanges
    dm.close()
    _join_on_simulated_gpus(out, devices, streams)
    _throttle_on_simulated_gpus(out, devices, streams)
    _compression_on_simulated_gpus(out, devices, streams)
    _python_hooks_on_simulated_gpus(out, devices, streams)
    out["violations"] = sim.violations()


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

    def joined(model: nn.Module, gpus: Any = None, shard: bool = False, hook: Any = None) -> Any:
        """This rank's batches under dm.join(); the closed wrapped model."""
        dm = wrap_on(model, len(devices), gpus)
        if hook is not None:
            dm.register_comm_hook(None, hook)
        for m in dm.replicas if not model.norm.training else []:
            m.norm.eval()
        dopt = dm.optimizer(torch.optim.SGD, shard=shard, **SGD)
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
    # A sharded optimizer (ZeRO stage 1): rank 0, joined, steps its shard with
    # the gradients it shadowed; gathered through NCCL; the unsharded bytes.
    sharded = joined(eval_norm(net(seed=rank)), (devices, streams), shard=True)
    out["join_sharded_vs_unsharded"] = max_diff(sharded.module, dm.module)
    out["join_sharded_replicas_equal"] = all(
        max_diff(m, sharded.module) == 0.0 for m in sharded.replicas
    )
    if len(devices) == 1:
        # A Python hook: rank 0, joined, calls it with zeros for every
        # bucket the others reduce (as under torch DDP's Join).
        hooked = joined(eval_norm(net(seed=rank)), (devices, streams), hook=gloo_average)
        out["join_hook_diff"] = max_diff(hooked.module, ref)

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


def dense() -> nn.Module:
    """A model whose every parameter gets a gradient on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def dense_alone(batches) -> nn.Module:
    """`dense` trained on one device on the global batches (SGD, mean squared error)."""
    return reference(batches, dense())


def _throttle_on_simulated_gpus(out: dict, devices, streams) -> None:
    """The GPUs far behind the host: no agreement's sums ever reach the host
    by themselves (their copies report not ready until waited for). The host
    reads none in the first three steps, then waits for the oldest once per
    step, so at most three are ever unread; training is unchanged."""
    from pyddp.engine.streams import HostCopy

    waits: List[int] = []
    step = [0]
    real_fetch = streams.fetch

    def slow_fetch(device, tensor):
        copy = real_fetch(device, tensor)

        def synchronize():
            waits.append(step[0])
            copy.get()

        return HostCopy(tensor, lambda: False, synchronize)

    batches = data(5, 12)
    ref = dense_alone(batches)
    streams.fetch = slow_fetch
    try:
        dm = wrap_on(dense(), len(devices), (devices, streams))
        dopt = dm.optimizer(torch.optim.SGD, **SGD)
        for k, (x, y) in enumerate(batches):
            step[0] = k
            step_on_rows(dm, dopt, x, y, partial(streams.synchronize_all, devices))
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
    rank = pyddp.rank()
    batches = data(3, 12, seed=4)
    ref = reference(batches)

    def train(places, gpus=None):
        dm = wrap_on(eval_norm(net(seed=rank)), len(places), gpus)
        dm.register_comm_hook(None, "fp16")
        dopt = dm.optimizer(torch.optim.SGD, **SGD)
        for x, y in batches:
            step_on_rows(dm, dopt, x, y, partial(streams.synchronize_all, devices))
        return dm

    dm = train(devices, (devices, streams))
    out["fp16_wire"] = dm._reducer._backend.compression
    out["fp16_diff"] = max_diff(dm.module, ref)
    out["fp16_replicas_equal"] = all(max_diff(m, dm.module) == 0.0 for m in dm.replicas)
    if len(devices) == 1:
        cpu = train(["cpu"])
        out["fp16_vs_torch_hook"] = max_diff(dm.module, cpu.module)
        cpu.close()
    dm.close()


def gloo_average(group, bucket):
    """A communication hook written for torch DDP: the bucket averaged over
    the processes of `group` (gloo here: host tensors)."""
    import torch.distributed as dist

    work = dist.all_reduce(bucket.buffer().div_(group.size()), group=group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


def _python_hooks_on_simulated_gpus(out: dict, devices, streams) -> None:
    """Python communication hooks on the simulated GPUs: called per bucket
    on the engine's launcher thread with the communication stream current,
    once the bucket's gradients are written there (the simulation writes
    them 20 ms late here, longer than a launch takes: a hook run before its
    ready events reads NaN). A hook written for DDP (gloo on the hook's
    group) equals one device; PowerSGD equals the CPU path's PowerSGD to
    the bit (host tensors: the same arithmetic). Several GPUs in a process:
    refused by name."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    batches = data(4, 12, seed=5)
    seen = []  # per call: (bucket, launcher thread?, stream current there, a NaN seen?)

    def user_hook(group, bucket):
        device = devices[0]
        seen.append((bucket.index(), threading.current_thread() is not threading.main_thread(),
                     streams.current(device), bool(bucket.buffer().isnan().any())))  # fmt: skip
        return gloo_average(group, bucket)

    kept = []  # the late hook's sources, alive until their copies ran

    def late_average(group, bucket):
        # A hook whose result lands on its stream 20 ms after it returned, as
        # a GPU collective's would: pyddp must order the step after it.
        buffer = bucket.buffer()
        average = buffer.clone()
        dist.all_reduce(average, group=group)
        kept.append(average.div_(group.size()))
        stream, lib = streams.current(devices[0]), streams.sim.lib
        assert lib.simgpu_sleep(stream, 20_000) == 0
        size = buffer.numel() * buffer.element_size()
        assert lib.simgpu_copy(stream, buffer.data_ptr(), average.data_ptr(), size) == 0
        future = torch.futures.Future()
        future.set_result(buffer)
        return future

    def train(places, hook, gpus=None):
        dm = wrap_on(dense(), len(places), gpus)
        state = None
        if hook == "powersgd":
            state = powersgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                min_compression_rate=0.5, random_seed=3,
            )  # fmt: skip
            hook = powersgd.powerSGD_hook
        elif hook == "fp16_wrapper":  # set_buffer: the sum in 16 bits, as under DDP
            hook = default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)
        dm.register_comm_hook(state, hook)
        dopt = dm.optimizer(torch.optim.SGD, **SGD)
        for x, y in batches:
            step_on_rows(dm, dopt, x, y, partial(streams.synchronize_all, devices))
        dm.close()
        return dm

    if len(devices) > 1:
        try:
            train(devices, user_hook, (devices, streams))
            out["hook_several_gpus"] = "accepted"
        except NotImplementedError as e:
            out["hook_several_gpus"] = str(e)
        return
    ref = dense_alone(batches)
    main_stream, late = streams.current(devices[0]), streams.late_us
    streams.late_us = 20_000
    try:
        dm = train(devices, user_hook, (devices, streams))
        gpu = train(devices, "powersgd", (devices, streams))
        wrapped = train(devices, "fp16_wrapper", (devices, streams))
        late_run = train(devices, late_average, (devices, streams))
    finally:
        streams.late_us = late
    on_gpu = list(seen)
    out["hook_diff"] = max_diff(dm.module, ref)
    out["hook_vs_cpu"] = max_diff(dm.module, train(["cpu"], user_hook).module)
    out["hook_calls"] = len(on_gpu)
    out["hook_on_launcher"] = all(s[1] for s in on_gpu)
    out["hook_streams"] = sorted({s[2] for s in on_gpu} - {main_stream, 0})
    out["hook_saw_nan"] = any(s[3] for s in on_gpu)
    cpu = train(["cpu"], "powersgd")
    out["powersgd_vs_cpu"] = max_diff(gpu.module, cpu.module)
    out["powersgd_vs_plain"] = max_diff(gpu.module, ref)
    out["wrapper_vs_cpu"] = max_diff(wrapped.module, train(["cpu"], "fp16_wrapper").module)
    out["wrapper_vs_plain"] = max_diff(wrapped.module, ref)
    out["late_hook_diff"] = max_diff(late_run.module, ref)

    # Rank 0's hook raises at the second step: rank 0's backward raises the
    # hook's own exception; rank 1, whose hook waits for rank 0 on gloo,
    # hears of it through the store, long before the (60 s) timeout.
    class HookBroke(ValueError):
        pass

    calls = []

    def breaks_on_rank_0(group, bucket):
        calls.append(1)
        if pyddp.rank() == 0 and len(calls) == 2:
            raise HookBroke("the user's hook broke")
        return user_hook(group, bucket)

    out["rank"] = pyddp.rank()
    dm = wrap_on(dense(), 1, (devices, streams), timeout_s=60)
    dm.register_comm_hook(None, breaks_on_rank_0)
    try:
        for x, _ in batches:
            dm(x).sum().backward()
            streams.synchronize_all(devices)
        out["hook_error"] = None
    except (HookBroke, ProcessGroupError) as e:
        out["hook_error"] = [type(e).__name__, str(e), str(e.__cause__)]


@pytest.mark.parametrize("local", [1, 2])
def test_gradsync_across_processes_on_one_nccl_communicator(tmp_path, local):
    # Two processes x `local` simulated GPUs: one communicator across them
    # (unique id through torch.distributed's store), equal to one device.
    env = {"LOCAL_REPLICAS": str(local)}
    run = launch(gradsync_on_simulated_gpus, out=tmp_path, env=env, simgpu=True, agent=False)
    assert run.codes == [0, 0], run.codes
    for r in run.results():
        assert r["backend"] == "nccl"
        assert r["diff_cap0"] <= 1e-6 and r["diff_cap25"] <= 1e-6, r
        assert r["never_none_cap0"] and r["never_none_cap25"]
        # Steady state, a model with every gradient everywhere: the host never
        # waits for a GPU (driver calls counted by the simulation), never reads
        # a device value from pyddp's code, makes no gloo exchange.
        assert r["all_used_steady_steps"] >= 4
        assert r["all_used_host_waits"] == 0, r
        assert r["all_used_host_reads"] == [], r
        assert r["all_used_exchanges"] == 0, r
        for cap in ("0", "25"):
            # Net's `never` has no gradient here: to leave it None (nobody has
            # one) the host waits for the agreement's sums once per step, as
            # torch DDP's find_unused_parameters does; nothing else.
            assert r[f"steady_host_waits_cap{cap}"] == 2, r
            assert r[f"steady_host_reads_cap{cap}"] == [], r
            assert r[f"steady_exchanges_cap{cap}"] == 0, r
        for cap in ("0", "25"):  # buffers: rank 0's, through NCCL (no gloo exchange)
            assert r[f"buffer_exchanges_cap{cap}"] == 0, r
            for mean, tracked, zero in r[f"buffers_cap{cap}"]:
                assert mean[1:] == [1.0] * 15 and tracked == 7 and zero == "-0.0", r
        # Join: rank 0 runs out first and shadows through NCCL; one device
        # on the global batch of the ranks with inputs.
        assert r["join_diff"] <= 1e-6 and r["join_replicas_equal"], r
        assert r["join_sharded_vs_unsharded"] == 0.0 and r["join_sharded_replicas_equal"], r
        if local == 1:
            assert r["join_hook_diff"] <= 1e-6, r  # a Python hook under Join
        # BatchNorm training under Join (the ranks' buffers differ): as on CPUs.
        assert r["join_buffers_moved"] and r["join_buffers_vs_cpu"] <= 1e-6, r
        # fp16 compression on NCCL: torch's hook's arithmetic (bitwise the CPU
        # path, where the hook itself runs, with one GPU per process: 2 ranks,
        # where CPU and CUDA division agree); 11
        # mantissa bits on the wire over 3 steps stay within 2e-3 of one device.
        assert r["fp16_wire"] == "float16" and r["fp16_replicas_equal"], r
        assert 0 < r["fp16_diff"] <= 2e-3, r
        if local == 1:
            assert r["fp16_vs_torch_hook"] == 0.0, r
            # A Python hook: called on the launcher thread with pyddp's
            # communication stream current, after the late gradient writes
            # (never a NaN), every step; equal to one device and to the CPU
            # path. PowerSGD: the CPU path's to the bit, and compressing.
            assert r["hook_calls"] >= len(data(4, 12)) and r["hook_on_launcher"], r
            assert len(r["hook_streams"]) == 1 and not r["hook_saw_nan"], r
            assert r["hook_diff"] <= 1e-6 and r["hook_vs_cpu"] == 0.0, r
            assert r["powersgd_vs_cpu"] == 0.0 and r["powersgd_vs_plain"] > 1e-4, r
            # torch's fp16_compress_wrapper (set_buffer): the CPU path's bits.
            assert r["wrapper_vs_cpu"] == 0.0 and 0 < r["wrapper_vs_plain"] <= 2e-3, r
            # A hook whose result lands on its stream late: the step waits.
            assert r["late_hook_diff"] <= 1e-6, r
            kind, message, cause = r["hook_error"]
            if r["rank"] == 0:
                assert kind == "HookBroke" and message == "the user's hook broke", r
                assert "communication hook raised HookBroke on bucket 0" in cause, cause
            else:
                assert kind == "ProcessGroupError", r
                assert "communication hook raised HookBroke on bucket 0" in message, message
        else:
            assert "one GPU per process" in r["hook_several_gpus"], r
        # The GPUs far behind (no sums reach the host unasked): three sums
        # stay unread; from the fourth synced backward on, the host waits for
        # the oldest, one per step; close() reads the last three.
        assert r["throttle_diff"] <= 1e-6, r
        assert r["throttle_waits"] == [3, 4] and r["throttle_waits_at_close"] == 3, r
        assert not r["violations"], r["violations"]
