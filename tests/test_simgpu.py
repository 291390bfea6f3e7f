"""pyddp's GPU path on the simulated CUDA driver, NCCL and NVRTC (tests/simgpu):
the real NcclBackend, SharedGpuBackend, Engine, GradSync and wrap, with host
tensors standing in for device memory. Each scenario is a function run in a
process of its own (tests/spawn.py's run_alone) with
PYDDP_CUDA_LIBRARY/PYDDP_NCCL_LIBRARY/PYDDP_NVRTC_LIBRARY pointing at the
simulation, so a real driver is never shadowed; every scenario ends with the
simulation asserting it saw no broken rule. Failures (timeouts, NCCL errors,
dead contexts): tests/test_simgpu_failures.py; the kernel, its loading and
the doctor: tests/test_simgpu_kernel.py; the sharded optimizer and
SyncBatchNorm: tests/test_zero.py and tests/test_syncbn.py; across
processes: tests/test_simgpu_processes.py."""

import contextlib
import copy
import operator
import os
import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import Mixed, exact_blocks, make_batches
from spawn import run_alone
from torch import nn

import pyddp
from pyddp.engine.streams import simulated_gpus
from pyddp.runtime import libraries as _runtime

pytestmark = pytest.mark.simgpu


def collectives_closed_form_all_dtypes(kind):
    from simulated import sim, streams

    for n in (2, 3):
        devs = [0] * n if kind == "device" else list(range(n))
        backend = _runtime.make_backend(devs, timeout=30)
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            for size in (0, 1, 7, (1 << 16) + 3):
                ts = [streams.upload(d, torch.full((size,), float(r + 1), dtype=dtype))
                      for r, d in enumerate(devs)]  # fmt: skip
                backend.reduce([t.data_ptr() for t in ts], devs, [0] * n, size,
                               str(dtype).split(".")[1], "sum")  # fmt: skip
                for d in set(devs):
                    sim.synchronize(0, d)
                for t in ts:
                    assert torch.equal(t, torch.full_like(t, n * (n + 1) / 2)), (dtype, size, t[:3])
        backend.close()


@pytest.mark.parametrize("kind", ["device", "nccl"])
def test_collectives_closed_form_all_dtypes(kind):
    run_alone(collectives_closed_form_all_dtypes, kind)


def wrap_equals_single_device_with_slow_streams(devices, cap, own_streams):
    from simulated import check_equal_to_single_device, sim

    sim.lib.simgpu_set_delay_us(None, 150)
    stream_map = {d: sim.stream(d) for d in set(devices)} if own_streams else None
    check_equal_to_single_device(devices, cap, stream_map=stream_map)


@pytest.mark.parametrize("own_streams", [False, True])
@pytest.mark.parametrize("cap", [0, 25])
@pytest.mark.parametrize("devices", [[0, 0], [0, 0, 0], [0, 1], [0, 1, 2]])
def test_wrap_equals_single_device_with_slow_streams(devices, cap, own_streams):
    # Every simulated stream (compute and communication) is slowed down, and
    # gradients land late on their producing streams: a missing wait or fence
    # reads stale buffers instead of passing by luck. own_streams: forward,
    # backward and the step run on a stream of each device's own, not the
    # default one (torch.cuda.stream(...) around the training step).
    run_alone(wrap_equals_single_device_with_slow_streams, devices, cap, own_streams)


def train_on_two_stream_sets(dm, ref, batches, devices, provider, on_forward, on_caller,
                             twice_at=None):  # fmt: skip
    """zero_grad and forward under on_forward(), backward and AdamW's step
    under on_caller() (two backwards over one graph at step `twice_at`),
    beside single-device training of `ref`: equal after every step."""
    opt = dm.optimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    for step, (x, y) in enumerate(batches):
        with on_forward():
            opt.zero_grad()
            loss = F.cross_entropy(dm(x), y)
        with on_caller():
            if step == twice_at:
                loss.backward(retain_graph=True)
            loss.backward()
            # The optimizer's kernels read on the caller's streams: the host
            # stands in for them once those streams are drained.
            provider.synchronize_all(devices)
            opt.step()
            provider.synchronize_all(devices)
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        if step == twice_at:
            ref_loss.backward(retain_graph=True)
        ref_loss.backward()
        ref_opt.step()
        for rep in dm.replicas[1:]:
            for p, p0 in zip(rep.parameters(), dm.module.parameters()):
                assert torch.equal(p, p0), f"step {step}: replicas differ"
        for p, q in zip(dm.module.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=f"step {step}")


def shared_gpu_replicas_step_once(devices, source):
    from simulated import check_equal_to_single_device

    from pyddp.optim.zero import state_bytes

    @contextlib.contextmanager
    def around_step(step, dm, opt):
        assert opt._pyddp.source == source
        if step == 2:  # a checkpoint round trip: still no state where no step runs
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        # The model's mirror takes a replica whose version counters moved
        # otherwise than replica 0's for one changed alone, and copies its
        # parameters again before the next forward: the copying replicas'
        # counters must move with the stepping replica's.
        params = dm._mirror.params
        before = [list(map(operator.attrgetter("_version"), ps)) for ps in params]
        yield
        moved = [[p._version - b for p, b in zip(ps, bs)] for ps, bs in zip(params, before)]
        assert all(m == moved[0] for m in moved[1:]), (step, moved)
        held = state_bytes(opt)
        for r, src in enumerate(source):
            assert (held[r] > 0) == (r == src), (step, held)

    check_equal_to_single_device(devices, 25, around_step=around_step)


@pytest.mark.parametrize(
    "devices,source", [([0, 0], [0, 0]), ([1, 1, 1], [0, 0, 0]), ([0, 1], [0, 1])]
)
def test_replicas_sharing_a_gpu_step_once_and_take_the_steppers_parameters(devices, source):
    # The replicated optimizer steps the first replica on each GPU; the
    # others on that GPU copy its parameters after (docs/gpus.md): the same
    # bytes, one step's work per GPU instead of one per replica, and no
    # optimizer state where no step runs (also after load_state_dict). One
    # replica per GPU: each steps, as before.
    run_alone(shared_gpu_replicas_step_once, devices, source)


def a_step_failing_on_one_gpu(devices):
    from simulated import gpu_step, gpu_wrap, streams

    torch.manual_seed(0)
    dm = gpu_wrap(Mixed(), devices)
    opt = dm.optimizer(torch.optim.Adam, lr=0.01)
    (x, y), (x2, y2) = make_batches(2, 13)
    gpu_step(F.cross_entropy(dm(x), y), opt, devices)
    F.cross_entropy(dm(x2), y2).backward()
    streams.synchronize_all(devices)

    def boom():
        raise RuntimeError("out of memory (simulated)")

    opt._pyddp.others[1].step = boom  # replica 2's step fails; 0 and 1 step
    with pytest.raises(pyddp.ReplicaError, match="reset to replica 0's, which completed") as e:
        opt.step()
    assert e.value.replica == 2
    state0 = opt.state_dict()["state"]
    for rep, other in zip(dm.replicas[1:], opt._pyddp.others):
        for p, p0 in zip(rep.parameters(), dm.module.parameters()):
            assert torch.equal(p, p0)
        for k, s in other.state_dict()["state"].items():
            for key in s:
                assert torch.equal(torch.as_tensor(s[key]), torch.as_tensor(state0[k][key])), key
    del opt._pyddp.others[1].step
    opt.zero_grad()
    gpu_step(F.cross_entropy(dm(x), y), opt, devices)
    for rep in dm.replicas[1:]:
        for p, p0 in zip(rep.parameters(), dm.module.parameters()):
            assert torch.equal(p, p0)
    dm.close()


def test_a_step_failing_on_one_gpu_leaves_the_replicas_equal():
    # Replicas on three GPUs each step their own optimizer: replica 2's
    # raising after 0 and 1 stepped resets every replica's parameters and
    # state to replica 0's, and names what happened.
    run_alone(a_step_failing_on_one_gpu, [0, 1, 2])


def replicas_in_turn_on_one_gpu(devices):
    from simulated import check_equal_to_single_device, sim

    sim.lib.simgpu_set_delay_us(None, 150)
    if len(set(devices)) > 1:
        with pytest.raises(ValueError, match="several GPUs run on their own threads"):
            check_equal_to_single_device(devices, 25, run_replicas="in_turn")
        return
    assert check_equal_to_single_device(devices, 25, run_replicas="in_turn") == {"*": "in_turn"}
    # auto: 5 forwards on threads, then in turn and threads alternating
    how = check_equal_to_single_device(devices, 0, steps=16, run_replicas="auto")
    assert how["forward"] == "trying", how


@pytest.mark.parametrize("devices", [[0, 0], [1, 1, 1], [0, 1]])
def test_replicas_sharing_one_gpu_may_run_in_turn_on_the_callers_thread(devices):
    # Replicas sharing one GPU launch onto the caller's streams of that GPU
    # whichever thread runs them (replica 0 always runs on the caller's):
    # run_replicas="in_turn" (and "auto", which tries both) train as one
    # device does; replicas on several GPUs keep a thread each.
    run_alone(replicas_in_turn_on_one_gpu, devices)


def backward_on_autograd_device_threads(devices, cap):
    from simulated import gpu_wrap, sim, streams

    # The communication streams slow (created at wrap), the caller's fast: a
    # caller's stream not ordered after the reductions reads before they land.
    sim.lib.simgpu_set_delay_us(None, 3000)
    torch.manual_seed(0)
    # Every parameter gets its gradient: none is settled on the caller's
    # streams at finish(), which would order them after the reductions anyway.
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 5))  # fmt: skip
    ref = copy.deepcopy(model)
    dm = gpu_wrap(model, devices, bucket_cap_mb=cap)
    forward = {d: sim.stream(d) for d in set(devices)}
    caller = {d: sim.stream(d) for d in set(devices)}
    for s in [*forward.values(), *caller.values()]:
        sim.lib.simgpu_set_delay_us(s, 0)
    seen = []  # (replica, thread, current stream of its device) at a gradient hook
    for r, rep in enumerate(dm.replicas):
        p = next(rep.parameters())
        p.register_post_accumulate_grad_hook(
            lambda p, r=r, d=devices[r]: seen.append((r, threading.get_ident(), streams.current(d)))
        )
    torch.manual_seed(1)
    batches = [(torch.randn(13, 10), torch.randint(0, 5, (13,))) for _ in range(4)]
    train_on_two_stream_sets(dm, ref, batches, devices, streams,
                             lambda: streams.stream(forward), lambda: streams.stream(caller),
                             twice_at=1)  # fmt: skip
    # Each replica's hooks ran on its device's autograd thread, with the
    # forward's stream current there, not on the caller's thread or streams.
    threads = streams.device_threads
    assert threads.backwards == 5 * len(devices), threads.backwards
    assert len(seen) == 5 * len(devices), seen
    for r, ident, stream in seen:
        assert ident == threads.idents[devices[r]], (r, ident, threads.idents)
        assert stream == forward[devices[r]], (r, stream, forward, caller)
    assert len(set(threads.idents.values())) == len(set(devices))
    dm.close()


@pytest.mark.parametrize("cap", [0, 25])
@pytest.mark.parametrize("devices", [[0, 0], [0, 1], [0, 1, 2]])
def test_backward_runs_as_autograd_runs_it_on_gpus(devices, cap):
    # On a GPU, autograd runs each device's backward on a thread of its own,
    # each op (and pyddp's hook after it) on the stream its forward ran on;
    # the caller's streams wait for those at the end, and finish() runs on
    # the caller's streams. The simulation does the same (device_threads.py),
    # so gradients land late on the forward's streams while the optimizer
    # reads on the caller's: pyddp's fence must order the caller's streams
    # after the reductions, not only the streams that wrote the gradients.
    run_alone(backward_on_autograd_device_threads, devices, cap)


def torch_streams_on_the_simulated_driver(devices):
    import contextlib

    from simulated import sim
    from torch_cuda import TorchStreamsOnSim, torch_cuda_on

    sim.lib.simgpu_set_delay_us(None, 3000)  # as above: the reductions land late
    provider = TorchStreamsOnSim(sim, devices)
    with torch_cuda_on(provider) as cuda:
        torch.manual_seed(0)
        model = Mixed()  # its gradients arrive out of order: buckets laid out again
        ref = copy.deepcopy(model)
        with simulated_gpus(devices, provider):  # built on the default streams
            dm = pyddp.wrap(model, ["cpu"] * len(devices), bucket_cap_mb=0.0005)
        forward = [torch.cuda.Stream(d) for d in sorted(set(devices))]
        caller = [torch.cuda.Stream(d) for d in sorted(set(devices))]
        for s in forward + caller:
            sim.lib.simgpu_set_delay_us(s.cuda_stream, 0)

        def on(streams):
            stack = contextlib.ExitStack()
            for s in streams:
                stack.enter_context(torch.cuda.stream(s))
            return stack

        train_on_two_stream_sets(dm, ref, make_batches(4, 13), devices, provider,
                                 lambda: on(forward), lambda: on(caller))  # fmt: skip
        # The simulated caching allocator's verdict on every bucket freed,
        # first: the first layout's, dropped at the re-layout while the
        # communication streams may still use them, must have been retired
        # with Tensor.record_stream (TorchStreams.retire).
        broken = sim.violations()
        assert not broken, broken
        # TorchStreams' own calls ran: record_stream, the GPU clock's events.
        assert cuda.recorded > 0
        stats = dm.stats()
        assert set(stats["gpu"]) == {f"cuda:{d}" for d in set(devices)}, stats
        assert provider.device_threads.backwards == 4 * len(devices)
        dm.close()


@pytest.mark.parametrize("devices", [[0, 0], [0, 1]])
def test_pyddps_torch_stream_provider_on_the_simulated_driver(devices):
    # The rest of this tier uses the simulation's own stream provider; on a
    # GPU pyddp uses TorchStreams (torch.cuda's streams, record_stream,
    # events). Here TorchStreams' own code runs, on a stand-in for those
    # torch.cuda calls on the simulated driver (tests/simgpu/torch_cuda.py):
    # a model built on the default streams, trained with zero_grad and
    # forward on one set of streams and backward and the step on another.
    run_alone(torch_streams_on_the_simulated_driver, devices)


def allocator_rule_sees_uses_not_yet_run():
    from simulated import sim, streams

    streams.late_us = 0
    backend = _runtime.make_backend([0, 1], timeout=30)
    other = {d: sim.stream(d) for d in (0, 1)}

    def free_while_used(how, record):
        # Memory allocated on cuda:0's default stream, then used on another
        # stream by an op that runs only later: a copy behind a 100 ms sleep,
        # or an NCCL all-reduce a non-blocking communicator queues only once
        # its group finishes. Freed at once: safe only if record_stream named
        # that stream (its marker then runs after the use).
        if how == "copy":
            src = streams.upload(0, torch.ones(1000))
            used = [streams.zeros(1000, torch.float32, 0)]
            sim.lib.simgpu_sleep(other[0], 100_000)
            sim.lib.simgpu_copy(other[0], used[0].data_ptr(), src.data_ptr(), 4000)
        else:
            used = [streams.upload(d, torch.ones(1000)) for d in (0, 1)]
            backend.reduce([t.data_ptr() for t in used], [0, 1], [other[0], other[1]], 1000,
                           "float32", "sum")  # fmt: skip
        if record:
            for d, t in enumerate(used):
                streams.record_stream(t, other[d])
        del used  # the free: checked once its markers ran, the uses' ops maybe not yet
        found = sim.violations()
        for d in (0, 1):
            sim.synchronize(other[d], d)
        sim.lib.simgpu_reset()
        return found

    for how in ("copy", "nccl"):
        assert free_while_used(how, record=True) == "", how
        found = free_while_used(how, record=False)
        assert "freed while" in found, (how, found)
    backend.close()


def test_the_allocator_rule_sees_uses_queued_but_not_yet_run():
    # The simulated caching allocator's order rule (the allocation stream's
    # next allocation may reuse a freed block at once) must see a use whose
    # op is queued but has not run when the free is checked, and an NCCL call
    # not yet queued: the verdict depends on the order asked for, not on how
    # far the streams got.
    run_alone(allocator_rule_sees_uses_not_yet_run)


def half_precision_training(dtype):
    from simulated import gpu_wrap, streams

    half = getattr(torch, dtype)
    for devices in ([0, 0], [0, 1]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(half)
        ref = copy.deepcopy(model)
        dm = gpu_wrap(model, devices)
        x = torch.randn(8, 16).to(half)
        y = torch.randint(0, 4, (8,))
        F.cross_entropy(dm(x).float(), y).backward()
        streams.synchronize_all(devices)
        F.cross_entropy(ref(x).float(), y).backward()
        tol = 1e-2 if dtype == "bfloat16" else 2e-3  # 8 / 11 mantissa bits
        for p, q in zip(dm.module.parameters(), ref.parameters()):
            assert p.grad.dtype == half
            torch.testing.assert_close(p.grad.float(), q.grad.float(), atol=tol, rtol=tol)
        dm.close()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_training_through_the_kernel_and_nccl(dtype):
    # 16-bit gradients reduced by the kernel (replicas sharing a GPU) and by
    # NCCL: equal to single-device gradients within 16-bit rounding (the
    # reference reduces in one order, the replicas in another).
    run_alone(half_precision_training, dtype)


def compression_hooks_arithmetic(hook):
    from simulated import WithDouble, gpu_wrap, streams
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    wire = torch.float16 if hook == "fp16" else torch.bfloat16
    hook = hook if hook == "fp16" else default_hooks.bf16_compress_hook
    devices = [0, 1, 2]
    torch.manual_seed(0)
    model = WithDouble()
    dm = gpu_wrap(model, devices, bucket_cap_mb=0.0005)
    dm.register_comm_hook(None, hook)
    op = dm._reducer._op
    for step, (x, y) in enumerate(make_batches(2, 13)):
        with dm.no_sync():
            F.cross_entropy(dm(x), y).backward()
        streams.synchronize_all(devices)
        local = [[None if p.grad is None else p.grad.clone() for p in rep.parameters()]
                 for rep in dm.replicas]  # fmt: skip
        dm.zero_grad()
        F.cross_entropy(dm(x), y).backward()
        streams.synchronize_all(devices)
        for i, p in enumerate(dm.module.parameters()):
            grads = [g[i] for g in local if g[i] is not None]
            if p.grad is None:  # no replica produced one (no_sync may leave zeros)
                assert all(not g.any() for g in grads), (step, i)
                continue
            grads += [torch.zeros_like(grads[0])] * (len(devices) - len(grads))
            n = len(devices)
            if p.dtype == torch.float32:
                acc = None
                for g in grads:  # NCCL's sum, rank order, rounded per hop
                    c = g.to(wire).div_(n)
                    acc = c if acc is None else acc + c
                want = acc.float() * (n if op == "sum" else 1)
            else:
                want = sum(grads[1:], grads[0].clone()) / (1 if op == "sum" else n)
            for rep in dm.replicas:
                got = list(rep.parameters())[i].grad
                assert torch.equal(got, want), (step, i, (got - want).abs().max())
        dm.optimizer(torch.optim.SGD, lr=0.1).step() if step == 0 else None
        dm.zero_grad()
        streams.synchronize_all(devices)
    assert dm._reducer._backend.compression == str(wire).split(".")[1]
    dm.close()


def python_hook_in_one_process():
    from simulated import gpu_wrap, streams

    def hook(state, bucket):  # would break the step if it ran
        raise AssertionError("a hook ran in one process")

    devices = [0, 1]
    trained = []
    for with_hook in (True, False):
        torch.manual_seed(0)
        dm = gpu_wrap(Mixed(), devices)
        if with_hook:
            with pytest.warns(UserWarning, match="hook is not used"):
                dm.register_comm_hook(None, hook)
        opt = dm.optimizer(torch.optim.SGD, lr=0.1)
        for x, y in make_batches(3, 8):
            opt.zero_grad()
            F.cross_entropy(dm(x), y).backward()
            streams.synchronize_all(devices)
            opt.step()
            streams.synchronize_all(devices)
        trained.append([p.detach().clone() for p in dm.module.parameters()])
        dm.close()
    assert all(torch.equal(a, b) for a, b in zip(*trained))


def test_a_python_hook_on_gpus_of_one_process_is_said_and_unused():
    # One process: no wire between its GPUs for a hook to act on (NCCL
    # reduces them in pyddp's core), as with CPU replicas in one process.
    run_alone(python_hook_in_one_process)


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_compression_hooks_on_nccl_are_torch_hooks_arithmetic(hook):
    # torch DDP's fp16/bf16 compression hooks run in pyddp's core on NCCL:
    # each replica's float32 gradient cast to 16 bits, divided by the ranks in
    # 16 bits, summed by NCCL in 16 bits, cast back. Closed form from each
    # replica's own gradient (no_sync keeps them apart): bitwise, on a model
    # with a float64 layer (its bucket is not compressed), a parameter some
    # replicas have no gradient for, and one nobody has.
    run_alone(compression_hooks_arithmetic, hook)


def custom_streams_under_wrap():
    from simulated import check_equal_to_single_device, gpu_wrap, sim, streams

    sim.lib.simgpu_set_delay_us(None, 150)
    s0, s1 = sim.stream(0), sim.stream(1)
    check_equal_to_single_device([0, 1], 0, stream_map={0: s0, 1: s1})
    t0 = sim.stream(0)
    check_equal_to_single_device([0, 0], 25, stream_map={0: t0})

    # Every replica's forward (on its worker thread) runs on the caller's
    # streams: its backward accumulates where pyddp zeroed the buckets.
    seen = []

    class Probe(nn.Linear):
        def forward(self, x):
            seen.append(streams.snapshot())
            return super().forward(x)

    dm = gpu_wrap(Probe(4, 2), [0, 1])
    with streams.stream({0: s0, 1: s1}):
        dm(torch.randn(4, 4)).sum().backward()
        streams.synchronize_all([0, 1])
    assert seen == [{0: s0, 1: s1}] * 2, seen
    dm.close()


def test_custom_streams_under_wrap():
    # `with torch.cuda.stream(s)`: forward, backward, zeroing and the step all
    # on user streams; the workers must run replicas on them too.
    run_alone(custom_streams_under_wrap)


def reduction_waits_for_the_producing_stream(comm_hook):
    from simulated import sim, streams

    streams.late_us = 0
    torch.manual_seed(0)
    base = nn.Linear(64, 64)
    reps = [base, copy.deepcopy(base)]
    prod = {0: sim.stream(0), 1: sim.stream(1)}
    late, delay = {}, [False]
    for r, m in enumerate(reps):
        for i, p in enumerate(m.parameters()):

            def hook(p, r=r, i=i):
                if not delay[0]:
                    return
                true = p.grad.clone()
                late[r, i] = true
                p.grad.zero_()
                s = streams.current(r)
                sim.lib.simgpu_sleep(s, 50000)
                sim.lib.simgpu_copy(s, p.grad.data_ptr(), true.data_ptr(), true.numel() * 4)

            p.register_post_accumulate_grad_hook(hook)
    with simulated_gpus([0, 1], streams):
        sync = pyddp.GradSync(reps, bucket_cap_mb=0)
    if comm_hook:
        sync.register_comm_hook(None, comm_hook)
    x = torch.randn(8, 64)
    for step in range(2):
        delay[0] = step == 1
        for r, m in enumerate(reps):
            with streams.stream({r: prod[r]}):
                sync._reducer.prepare(r)
                m(x[r * 4 : (r + 1) * 4]).pow(2).sum().backward()
        with streams.stream(prod):
            sync.finish()
            streams.synchronize_all([0, 1])
            if step == 0:
                sync.zero_grad()
    assert sync.stats()["adopted"] == 4, sync.stats()  # the first backward only
    for i, p in enumerate(reps[0].parameters()):
        expect = late[0, i] + late[1, i]
        if comm_hook:  # torch's fp16 hook's arithmetic: cast, halve, sum in fp16
            expect = (late[0, i].half() / 2 + late[1, i].half() / 2).float()
            expect *= 2 if sync._reducer._op == "sum" else 1
        assert torch.equal(p.grad, expect), (p.grad - expect).abs().max()
        assert torch.equal(list(reps[1].parameters())[i].grad, expect)
    sync.close()


@pytest.mark.parametrize("hook", [None, "fp16"])
def test_reduction_waits_for_the_stream_that_produced_each_gradient(hook):
    # The true gradient is written late on the producing stream (after a
    # sleep), as a slow backward kernel would: the reduction must wait for an
    # event recorded on that stream in the hook, not on another stream. The
    # second backward accumulates straight into the bucket views (no adopt
    # copy, so nothing on the host drains the stream on pyddp's behalf).
    # This test writes late itself: the provider's own late writes are off.
    # With fp16 compression, the kernel that casts the bucket is what must wait.
    run_alone(reduction_waits_for_the_producing_stream, hook)


def two_models_and_collectives_at_once():
    from simulated import check_equal_to_single_device, sim, streams

    sim.lib.simgpu_set_delay_us(None, 50)
    errors, finals = [], []
    check_equal_to_single_device([0, 1], 0, steps=3, final=finals)  # alone first

    def train():
        try:
            check_equal_to_single_device([0, 1], 0, steps=3, final=finals)
        except BaseException as e:
            errors.append(e)

    def collectives():
        try:
            backend = _runtime.make_backend([0, 1], timeout=30)
            for _ in range(20):
                ts = [streams.upload(r, torch.full((1000,), float(r + 1))) for r in range(2)]
                backend.reduce([t.data_ptr() for t in ts], [0, 1], [0, 0], 1000, "float32")
                sim.synchronize(0, 0)
                sim.synchronize(0, 1)
                assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in ts)
            backend.close()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=f) for f in (train, train, collectives)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # Sharing the communicators and the cores changes no byte of training.
    for other in finals[1:]:
        assert all(torch.equal(p, q) for p, q in zip(finals[0], other)), "differs from alone"
    assert len(finals) == 3
    assert sim.counter("stream_create") <= 2 + 4, sim.counter("stream_create")  # one set, not three
    # Same GPUs in another order: the same set (NCCL ranks follow device order).
    created = sim.counter("stream_create")
    a, b = _runtime.make_backend([1, 0], timeout=30), _runtime.make_backend([0, 1], timeout=30)
    assert sim.counter("stream_create") - created <= 2
    ts = [streams.upload(d, torch.full((5,), float(r + 1))) for r, d in enumerate([1, 0])]
    a.reduce([t.data_ptr() for t in ts], [1, 0], [0, 0], 5, "float32")
    sim.synchronize(0, 0)
    sim.synchronize(0, 1)
    assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in ts)
    a.close()
    b.close()


def test_two_models_and_collectives_at_once_share_one_communicator_set():
    run_alone(two_models_and_collectives_at_once)


def all_reduce_after_late_writes(devices):
    from simulated import sim, streams

    streams.late_us = 2000
    devs = devices
    own = {d: sim.stream(d) for d in set(devs)}
    sim.lib.simgpu_set_delay_us(None, 100)
    n = len(devs)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for size in (1, 7, (1 << 16) + 3):
            ts = [streams.upload(d, torch.full((size,), float(r + 1), dtype=dtype))
                  for r, d in enumerate(devs)]  # fmt: skip
            with streams.stream(own):
                for d, t in zip(devs, ts):
                    streams.produced(d, t)  # written late on its device's current stream
                with simulated_gpus(devs, streams):
                    pyddp.all_reduce(ts)
                streams.synchronize_all(devs)
            for t in ts:
                assert torch.equal(t, torch.full_like(t, n * (n + 1) / 2)), (dtype, size, t[:3])
    for r, t in enumerate(ts):
        t.fill_(r + 1.0)
    with simulated_gpus(devs, streams):
        pyddp.all_reduce(ts, op="avg")
    streams.synchronize_all(devs)
    assert all(torch.equal(t, torch.full_like(t, (n + 1) / 2)) for t in ts)


@pytest.mark.parametrize("devices", [[0, 0, 0], [0, 1, 2]])
def test_all_reduce_gpu_branch_orders_after_late_writes_on_current_streams(devices):
    # pyddp.all_reduce's GPU branch, through the same stream-provider seam as
    # GradSync: inputs written late on streams of each device's own (they
    # read NaN until those streams get there), then reduced in place; the
    # reduction must wait for those streams and they for it. The writes land
    # 2 ms late: later than NCCL's non-blocking launch takes to reach the
    # streams, so a missing wait cannot pass by that luck.
    run_alone(all_reduce_after_late_writes, devices)


def no_host_waits_in_steady_state(devices):
    from simgpu import HostReads
    from simulated import gpu_wrap, sim, streams

    torch.manual_seed(0)
    dm = gpu_wrap(Mixed(), devices, bucket_cap_mb=0.001)
    opt = dm.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
    reads = HostReads()
    for k, (x, y) in enumerate(make_batches(7, 13)):
        if k == 3:
            waits = sim.counter("host_sync")
            reads.__enter__()
        dm.loss(F.cross_entropy, x, y).backward()
        streams.synchronize_all(devices)  # the optimizer "kernel" in stream order
        opt.step()
        opt.zero_grad()
        streams.synchronize_all(devices)
    reads.__exit__(None, None, None)
    waits = sim.counter("host_sync") - waits
    assert waits == 0 and reads.reads == [], (waits, reads.reads)
    dm.close()


def host_reads_count_pyddps_code_wherever_it_loads_from():
    from simgpu import HostReads
    from simulated import streams

    import pyddp

    t = streams.zeros(4, torch.float32, 0)  # device memory
    # A read made from a module of pyddp's, wherever pyddp loads from (an
    # installed build in CI, this checkout in an editable install).
    probe = compile("t.tolist()", os.path.join(pyddp.__path__[0], "probe.py"), "exec")
    with HostReads(streams.sim) as reads:
        exec(probe, {"t": t})
        t.tolist()  # the test's own read: not pyddp's
    assert reads.reads == ["probe.py:1 tolist"], reads.reads


def test_host_reads_count_reads_from_pyddps_code_wherever_it_loads_from():
    # HostReads (the no-host-wait tests' counter) must see pyddp's code where
    # CI installs it (site-packages), not only in this checkout.
    run_alone(host_reads_count_pyddps_code_wherever_it_loads_from)


@pytest.mark.parametrize("devices", [[0, 1], [0, 0]])
def test_no_host_waits_in_steady_state_in_one_process(devices):
    # Steady-state steps (forward through dm.loss, backward, optimizer step,
    # zero_grad) on NCCL and on the shared-GPU kernel: the host never waits
    # for a GPU (driver calls counted by the simulation, the test's own
    # stream drains excluded) and pyddp's code never reads a tensor's value.
    # Across processes: test_gradsync_across_processes_on_one_nccl_communicator.
    run_alone(no_host_waits_in_steady_state, devices)


def broadcast_gather_scatter_after_late_writes(devices):
    from simulated import sim, streams

    # Every input written 2 ms late on its device's own current stream (it
    # reads NaN until that stream gets there), and NCCL's ranks finish at
    # different times (the simulation's skew): the collectives must wait for
    # the producing streams, and the current streams for them.
    streams.late_us = 2000
    own = {d: sim.stream(d) for d in set(devices)}
    sim.lib.simgpu_set_delay_us(None, 100)
    n = len(devices)

    def run(inputs, collective):
        ts = [streams.upload(d, t) for d, t in zip(devices, inputs)]
        with streams.stream(own):
            for d, t in zip(devices, ts):
                streams.produced(d, t)
            try:
                with simulated_gpus(devices, streams):
                    outs = collective(ts)
            finally:  # a refused call too: the late writes land before ts is freed
                streams.synchronize_all(devices)
        return ts if outs is None else outs

    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for size in (1, 7, (1 << 16) + 3):
            values = exact_blocks(n, size, dtype)
            for root in (0, n - 1):
                got = run(values, lambda ts, root=root: pyddp.broadcast(ts, root=root))
                assert all(torch.equal(t, values[root]) for t in got), (dtype, size, root)
            got = run(values, pyddp.all_gather)
            for out in got:
                assert all(torch.equal(out[k], values[k]) for k in range(n)), (dtype, size)
            whole = exact_blocks(n, size * n, dtype)
            if devices != sorted(devices):
                with pytest.raises(NotImplementedError, match="increasing order"):
                    run(whole, pyddp.reduce_scatter)
                continue
            got = run(whole, pyddp.reduce_scatter)
            want = sum(t.double() for t in whole).to(dtype).view(n, size)
            assert all(torch.equal(got[r], want[r]) for r in range(n)), (dtype, size)
            # The mean: 3 (i % 16) + 96 over 3 replicas, exact too.
            got = run(whole, lambda ts: pyddp.reduce_scatter(ts, op="avg"))
            want = (sum(t.double() for t in whole) / n).to(dtype).view(n, size)
            assert all(torch.equal(got[r], want[r]) for r in range(n)), ("avg", dtype, size)
    assert not sim.violations(), sim.violations()


@pytest.mark.parametrize("devices", [[0, 0, 0], [0, 1, 2], [2, 0, 1]])
def test_broadcast_all_gather_reduce_scatter_order_after_late_writes(devices):
    # pyddp.broadcast / all_gather / reduce_scatter on the device kernel
    # (replicas sharing a GPU) and on NCCL, every dtype, sizes 1, odd and
    # over one NCCL chunk, inputs written late: closed-form results. [2, 0,
    # 1]: NCCL ranks follow the devices, so roots and blocks must be mapped.
    run_alone(broadcast_gather_scatter_after_late_writes, devices)


def host_bound_steps_are_named(devices):
    from simulated import gpu_step, gpu_wrap, sim

    torch.manual_seed(0)
    dm = gpu_wrap(Mixed(), devices, bucket_cap_mb=0.001)
    opt = dm.optimizer(torch.optim.SGD, lr=0.01)
    batches = make_batches(6, 13)
    for k, (x, y) in enumerate(batches):
        if k == 2:
            dm.reset_stats()
            waits = sim.counter("host_sync")
        # gpu_step drains the streams after backward and after the optimizer
        # step: the GPU has passed every event before the next forward.
        gpu_step(F.cross_entropy(dm(x), y), opt, devices)
    stats = dm.stats()
    assert sim.counter("host_sync") == waits  # the events were asked, never waited for
    assert set(stats["gpu"]) == {f"cuda:{d}" for d in set(devices)}, stats["gpu"]
    for d in stats["gpu"].values():
        assert d["backwards"] == 4 and d["gpu_waited_for_host"] == 1.0, d
        assert d["bound"] == "host" and d["host_ms"] > 0 and d["gpu_ms"] >= 0, d
    assert "one process per GPU" in stats["gpu_advice"]
    dm.close()


@pytest.mark.parametrize("devices", [[0, 1], [0, 0]])
def test_stats_name_a_host_bound_step_on_gpus(devices):
    # stats()["gpu"]: per device, host and GPU time per backward and whether
    # the GPU waited for the host at each forward (timing events, asked and
    # read without a host wait). Here the test drains the streams between
    # steps, so the GPU is idle at every forward: host-bound, by construction.
    # The GPU-bound verdict: tests/test_observe.py (events completed by hand).
    run_alone(host_bound_steps_are_named, devices)


def unfreezing_followed(devices):
    # follow_unfreezing on GPUs: the conv frozen at wrap, unfrozen at step 2
    # (its hooks, C++ ones where pyddp._hot loads, registered while it was
    # thawed for the plan), through freezing and unfreezing again.
    from simulated import assert_replicas_equal, gpu_step, gpu_wrap

    torch.manual_seed(0)
    model = Mixed()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        m.conv.requires_grad_(False)
    dm = gpu_wrap(model, devices, bucket_cap_mb=0.001, follow_unfreezing=True)
    opt = dm.optimizer(torch.optim.SGD, params=lambda m: m.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    start = model.conv.weight.detach().clone()
    for step, (x, y) in enumerate(make_batches(6, 13)):
        for m in (model, ref):
            m.conv.requires_grad_(step in (2, 3, 5))
        gpu_step(F.cross_entropy(dm(x), y), opt, devices)
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_replicas_equal(dm)
    assert not torch.equal(model.conv.weight, start)
    for p, q in zip(dm.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    dm.close()


@pytest.mark.parametrize("devices", [[0, 0], [0, 1]])
def test_a_layer_frozen_at_wrap_unfrozen_later_with_follow_unfreezing(devices):
    run_alone(unfreezing_followed, devices)


def static_graph_counts_checkpointed_arrivals(devices):
    from conftest import SharedAcrossDepth
    from simulated import assert_replicas_equal, gpu_step, gpu_wrap, sim, streams

    sim.lib.simgpu_set_delay_us(None, 150)
    torch.manual_seed(0)
    model = SharedAcrossDepth(True)
    ref = copy.deepcopy(model)

    def ordered(grad):
        # torch accumulates the shared layer's next arrival in place on the
        # stream of the last one; the simulation runs it on the host at once:
        # drained first (the late write of the last arrival still lands late).
        streams.synchronize_all(devices)
        return grad

    for p in model.shared.parameters():
        p.register_hook(ordered)
    dm = gpu_wrap(model, devices, static_graph=True, bucket_cap_mb=0.0005)
    opt = dm.optimizer(torch.optim.AdamW, lr=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)
        gpu_step(F.cross_entropy(dm(x), y), opt, devices)
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_replicas_equal(dm)
    assert dm.stats()["buckets"] > 1
    assert dm._reducer._engine.expected_counts == [1, 1, 3, 3, 1, 1] * len(devices)
    for p, q in zip(dm.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    dm.close()


@pytest.mark.parametrize("devices", [[0, 0], [0, 1]])
def test_static_graph_counts_checkpointed_arrivals_on_gpus(devices):
    # A layer shared by three reentrant checkpointed segments arrives three
    # times in each backward: static_graph's first backward counts it (and
    # reduces after backward), later ones reduce at the third arrival, with
    # every stream that wrote it waited for (slow streams, gradients landing
    # late, several buckets).
    run_alone(static_graph_counts_checkpointed_arrivals, devices)


def gradients_touched_inside_a_window(devices, shard):
    # A no_sync() window of two micro-batches per step: the model's
    # gradients set to None after the first (reset on every GPU replica, as
    # on one device); zeroed in place, or scaled, is refused until zero_grad().
    from simulated import assert_replicas_equal, gpu_wrap, streams

    torch.manual_seed(0)
    model = Mixed()
    ref = copy.deepcopy(model)
    dm = gpu_wrap(model, devices, bucket_cap_mb=0.001)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1, shard=shard)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in make_batches(3, 14):
        for m in (dm, ref):
            with dm.no_sync() if m is dm else contextlib.nullcontext():
                F.cross_entropy(m(x[:7]), y[:7]).backward()
            streams.synchronize_all(devices)
            (dm.module if m is dm else m).zero_grad()  # (torch's own, on the user's model)
            F.cross_entropy(m(x[7:]), y[7:]).backward()
            streams.synchronize_all(devices)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        streams.synchronize_all(devices)
        assert_replicas_equal(dm)
    for p, q in zip(dm.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    x, y = make_batches(1, 14)[0]
    for touch in ("zero", "scale"):
        with dm.no_sync():
            F.cross_entropy(dm(x), y).backward()
        for p in dm.module.parameters():
            if p.grad is not None:
                p.grad.zero_() if touch == "zero" else p.grad.mul_(0.5)
        with pytest.raises(RuntimeError, match=r"inside a no_sync\(\) window"):
            F.cross_entropy(dm(x), y).backward()
        opt.zero_grad()
    F.cross_entropy(dm(x), y).backward()
    streams.synchronize_all(devices)
    dm.close()


@pytest.mark.parametrize("shard", [False, "gradients"])
@pytest.mark.parametrize("devices", [[0, 0], [0, 1]])
def test_gradients_touched_inside_a_no_sync_window_on_gpus(devices, shard):
    # Set to None on replica 0 in a window: reset on every GPU replica before
    # the synced backward (within 1e-6 of one device: float32 sums of
    # halves; before, zeroing in place reached replica 0's share alone); any
    # other touch refused.
    run_alone(gradients_touched_inside_a_window, devices, shard)
