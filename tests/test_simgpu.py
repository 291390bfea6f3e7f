"""pyddp's GPU path on the simulated CUDA driver, NCCL and NVRTC (tests/simgpu):
the real NcclBackend, SharedGpuBackend, Engine, GradSync and wrap, with host
tensors standing in for device memory. Each test runs in a subprocess with
PYDDP_CUDA_LIBRARY/PYDDP_NCCL_LIBRARY/PYDDP_NVRTC_LIBRARY pointing at the
simulation, so a real driver is never shadowed; every scenario ends by
asserting the simulation saw no broken rule."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.simgpu
HERE = os.path.dirname(os.path.abspath(__file__))

PRELUDE = """
import copy, os, sys, threading, time
sys.path.insert(0, {simdir!r}); sys.path.insert(0, {testdir!r})
import torch, torch.nn.functional as F
from torch import nn
import pyddp
from pyddp import _C
from pyddp.runtime import libraries as _runtime
from pyddp.engine.placement import simulated_gpus
from simgpu import Sim, SimStreams
from conftest import Mixed, make_batches
sim = Sim(os.environ["PYDDP_CUDA_LIBRARY"])
streams = SimStreams(sim)

def gpu_wrap(model, devices, **kw):
    with simulated_gpus(devices, streams):
        return pyddp.wrap(model, ["cpu"] * len(devices), **kw)

class WithDouble(Mixed):  # Mixed with a float64 layer: a bucket of its own dtype
    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(5, 5).double()

    def forward(self, t):
        out = super().forward(t)
        return out + self.extra(out[:, :5].double()).float()

def gpu_step(loss, opt, devices):
    # Backward, then the optimizer "kernel" in stream order (the simulation
    # runs torch's ops on the host at once: drain the streams around it).
    loss.backward()
    streams.synchronize_all(devices)
    opt.step()
    opt.zero_grad()
    streams.synchronize_all(devices)

def stepped_on_two_gpus():
    # Mixed wrapped on cuda:0 and cuda:1 after one synced step; the batches.
    torch.manual_seed(0)
    dm = gpu_wrap(Mixed(), [0, 1], bucket_cap_mb=0.001)
    batches = make_batches(4, 13)
    x, y = batches[0]
    F.cross_entropy(dm(x), y).backward()
    streams.synchronize_all([0, 1])
    dm.zero_grad()
    return dm, batches

def check_equal_to_single_device(devices, cap, steps=4, stream_map=None, **kw):
    torch.manual_seed(0)
    model = Mixed()
    ref = copy.deepcopy(model)
    dm = gpu_wrap(model, devices, bucket_cap_mb=cap, **kw)
    opt = dm.optimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    for x, y in make_batches(steps, 13):
        with streams.stream(stream_map or {{}}):
            gpu_step(F.cross_entropy(dm(x), y), opt, devices)
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for rep in dm.replicas[1:]:
            for p, p0 in zip(rep.parameters(), dm.module.parameters()):
                assert torch.equal(p, p0), "replicas differ"
    for p, q in zip(dm.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    dm.close()
"""

EPILOGUE = """
v = sim.violations()
assert not v, "simulation rules broken:\\n" + v
print("SIMGPU-OK")
"""


@pytest.fixture(scope="session")
def simlib():
    sys.path.insert(0, os.path.join(HERE, "simgpu"))
    from simgpu import build

    return build()


def sim_env(simlib, **extra):
    """The variables that select the simulated driver, NCCL and NVRTC."""
    libs = ("PYDDP_CUDA_LIBRARY", "PYDDP_NCCL_LIBRARY", "PYDDP_NVRTC_LIBRARY")
    return {**{k: simlib for k in libs}, **extra}


def run_sim(simlib, body, timeout=120, env=None, expect_ok=True):
    code = PRELUDE.format(simdir=os.path.join(HERE, "simgpu"), testdir=HERE)
    code += textwrap.dedent(body) + EPILOGUE
    full = dict(os.environ, **sim_env(simlib, **(env or {})))
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full,
        cwd=os.path.expanduser("~"),
    )
    if expect_ok:
        assert out.returncode == 0 and "SIMGPU-OK" in out.stdout, out.stdout + out.stderr
    return out


@pytest.mark.parametrize("kind", ["device", "nccl"])
def test_collectives_closed_form_all_dtypes(simlib, kind):
    run_sim(
        simlib,
        f'''
    for n in (2, 3):
        devs = [0] * n if "{kind}" == "device" else list(range(n))
        backend = _runtime.make_backend(devs, timeout=30)
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            for size in (0, 1, 7, (1 << 16) + 3):
                ts = [streams.upload(d, torch.full((size,), float(r + 1), dtype=dtype))
                      for r, d in enumerate(devs)]
                backend.reduce([t.data_ptr() for t in ts], devs, [0] * n, size,
                               str(dtype).split(".")[1], "sum")
                for d in set(devs):
                    sim.synchronize(0, d)
                for t in ts:
                    assert torch.equal(t, torch.full_like(t, n * (n + 1) / 2)), (dtype, size, t[:3])
        backend.close()
    ''',
    )


def test_kernel_16bit_rounding_matches_torch(simlib):
    # The kernel sums in float32 in replica order and rounds once: exactly
    # torch's float32 sum cast back, for random values (subnormals included).
    run_sim(
        simlib,
        """
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for n in (2, 3):
            backend = _runtime.make_backend([0] * n, timeout=30)
            vals = [(torch.randn(4099, generator=g) * 10.0 ** torch.randint(-7, 4, (4099,), generator=g)).to(dtype) for _ in range(n)]
            want = vals[0].float()
            for v in vals[1:]:
                want = want + v.float()
            for op, expect in (("sum", want.to(dtype)), ("avg", (want / n).to(dtype))):
                ts = [streams.upload(0, v) for v in vals]
                backend.reduce([t.data_ptr() for t in ts], [0] * n, [0] * n, 4099,
                               str(dtype).split(".")[1], op)
                sim.synchronize(0, 0)
                for t in ts:
                    assert torch.equal(t, expect), (dtype, n, op, (t.float() - expect.float()).abs().max())
            backend.close()
    """,
    )


@pytest.mark.parametrize("own_streams", [False, True])
@pytest.mark.parametrize("cap", [0, 25])
@pytest.mark.parametrize("devices", [[0, 0], [0, 0, 0], [0, 1], [0, 1, 2]])
def test_wrap_equals_single_device_with_slow_streams(simlib, devices, cap, own_streams):
    # Every simulated stream (compute and communication) is slowed down, and
    # gradients land late on their producing streams: a missing wait or fence
    # reads stale buffers instead of passing by luck. own_streams: forward,
    # backward and the step run on a stream of each device's own, not the
    # default one (torch.cuda.stream(...) around the training step).
    streams = "{d: sim.stream(d) for d in set(devices)}" if own_streams else "None"
    run_sim(
        simlib,
        f"""
    sim.lib.simgpu_set_delay_us(None, 150)
    devices = {devices}
    check_equal_to_single_device(devices, {cap}, stream_map={streams})
    """,
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_training_through_the_kernel_and_nccl(simlib, dtype):
    # 16-bit gradients reduced by the kernel (replicas sharing a GPU) and by
    # NCCL: equal to single-device gradients within 16-bit rounding (the
    # reference reduces in one order, the replicas in another).
    run_sim(
        simlib,
        f"""
    for devices in ([0, 0], [0, 1]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(torch.{dtype})
        ref = copy.deepcopy(model)
        dm = gpu_wrap(model, devices)
        x = torch.randn(8, 16).to(torch.{dtype})
        y = torch.randint(0, 4, (8,))
        F.cross_entropy(dm(x).float(), y).backward()
        streams.synchronize_all(devices)
        F.cross_entropy(ref(x).float(), y).backward()
        tol = 1e-2 if "{dtype}" == "bfloat16" else 2e-3  # 8 / 11 mantissa bits
        for p, q in zip(dm.module.parameters(), ref.parameters()):
            assert p.grad.dtype == torch.{dtype}
            torch.testing.assert_close(p.grad.float(), q.grad.float(), atol=tol, rtol=tol)
        dm.close()
    """,
    )


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_compression_hooks_on_nccl_are_torch_hooks_arithmetic(simlib, hook):
    # torch DDP's fp16/bf16 compression hooks run in pyddp's core on NCCL:
    # each replica's float32 gradient cast to 16 bits, divided by the ranks in
    # 16 bits, summed by NCCL in 16 bits, cast back. Closed form from each
    # replica's own gradient (no_sync keeps them apart): bitwise, on a model
    # with a float64 layer (its bucket is not compressed), a parameter some
    # replicas have no gradient for, and one nobody has.
    run_sim(
        simlib,
        f"""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    wire = torch.float16 if "{hook}" == "fp16" else torch.bfloat16
    hook = "{hook}" if "{hook}" == "fp16" else default_hooks.bf16_compress_hook
    devices = [0, 1, 2]
    torch.manual_seed(0)
    model = WithDouble()
    dm = gpu_wrap(model, devices, bucket_cap_mb=0.0005)
    dm.register_comm_hook(None, hook)
    op = dm._reducer.op
    for step, (x, y) in enumerate(make_batches(2, 13)):
        with dm.no_sync():
            F.cross_entropy(dm(x), y).backward()
        streams.synchronize_all(devices)
        local = [[None if p.grad is None else p.grad.clone() for p in rep.parameters()]
                 for rep in dm.replicas]
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
    assert dm._reducer.backend.compression == str(wire).split(".")[1]
    dm.close()
    """,
    )


def test_custom_streams_under_wrap(simlib):
    # `with torch.cuda.stream(s)`: forward, backward, zeroing and the step all
    # on user streams; the workers must run replicas on them too.
    run_sim(
        simlib,
        """
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
    """,
    )


@pytest.mark.parametrize("hook", [None, "fp16"])
def test_reduction_waits_for_the_stream_that_produced_each_gradient(simlib, hook):
    # The true gradient is written late on the producing stream (after a
    # sleep), as a slow backward kernel would: the reduction must wait for an
    # event recorded on that stream in the hook, not on another stream. The
    # second backward accumulates straight into the bucket views (no adopt
    # copy, so nothing on the host drains the stream on pyddp's behalf).
    # This test writes late itself: the provider's own late writes are off.
    # With fp16 compression, the kernel that casts the bucket is what must wait.
    run_sim(
        simlib,
        f"""
    comm_hook = {hook!r}
    streams.late_us = 0
    torch.manual_seed(0)
    base = nn.Linear(64, 64)
    reps = [base, copy.deepcopy(base)]
    prod = {{0: sim.stream(0), 1: sim.stream(1)}}
    late, delay = {{}}, [False]
    for r, m in enumerate(reps):
        for i, p in enumerate(m.parameters()):
            def hook(p, r=r, i=i):
                if not delay[0]:
                    return
                true = p.grad.clone(); late[r, i] = true
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
            with streams.stream({{r: prod[r]}}):
                sync._reducer.prepare(r)
                m(x[r * 4:(r + 1) * 4]).pow(2).sum().backward()
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
            expect *= 2 if sync._reducer.op == "sum" else 1
        assert torch.equal(p.grad, expect), (p.grad - expect).abs().max()
        assert torch.equal(list(reps[1].parameters())[i].grad, expect)
    sync.close()
    """,
    )


def test_two_models_and_collectives_at_once_share_one_communicator_set(simlib):
    run_sim(
        simlib,
        """
    sim.lib.simgpu_set_delay_us(None, 50)
    errors = []
    def train():
        try:
            check_equal_to_single_device([0, 1], 0, steps=3)
        except BaseException as e:
            errors.append(e)
    def collectives():
        try:
            backend = _runtime.make_backend([0, 1], timeout=30)
            for _ in range(20):
                ts = [streams.upload(r, torch.full((1000,), float(r + 1))) for r in range(2)]
                backend.reduce([t.data_ptr() for t in ts], [0, 1], [0, 0], 1000, "float32")
                sim.synchronize(0, 0); sim.synchronize(0, 1)
                assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in ts)
            backend.close()
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=f) for f in (train, train, collectives)]
    [t.start() for t in threads]; [t.join() for t in threads]
    assert not errors, errors
    assert sim.counter("stream_create") <= 2 + 4, sim.counter("stream_create")  # one set, not three
    # Same GPUs in another order: the same set (NCCL ranks follow device order).
    created = sim.counter("stream_create")
    a, b = _runtime.make_backend([1, 0], timeout=30), _runtime.make_backend([0, 1], timeout=30)
    assert sim.counter("stream_create") - created <= 2
    ts = [streams.upload(d, torch.full((5,), float(r + 1))) for r, d in enumerate([1, 0])]
    a.reduce([t.data_ptr() for t in ts], [1, 0], [0, 0], 5, "float32")
    sim.synchronize(0, 0); sim.synchronize(0, 1)
    assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in ts)
    a.close(); b.close()
    """,
    )


def test_timeout_names_the_reduction_then_zero_grad_recovers(simlib):
    run_sim(
        simlib,
        """
    torch.manual_seed(0)
    model = Mixed(); ref = copy.deepcopy(model)
    dm = gpu_wrap(model, [0, 1], bucket_cap_mb=0, rebuild_buckets=False, timeout_s=0.3)
    other = gpu_wrap(Mixed(), [1, 0], bucket_cap_mb=0)  # shares the communicators
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (x, y), (x2, y2) = make_batches(2, 8)
    sim.lib.simgpu_nccl_stall(1, 1)           # cuda:1's rank never arrives
    F.cross_entropy(dm(x), y).backward()     # returns: nothing blocks the host
    time.sleep(1.0)
    try:
        opt.step()
        raise AssertionError("stepped on a timed-out reduction")
    except pyddp.ReduceError as e:
        msg = str(e)
        assert "did not complete within 0.3 s" in msg and "cuda:0, cuda:1" in msg, msg
        assert "NCCL all-reduce of" in msg and "aborted" in msg, msg
    sim.lib.simgpu_nccl_stall(1, 0)
    opt.zero_grad()                          # rebuilds the aborted communicators
    streams.synchronize_all([0, 1])
    with torch.no_grad():                    # the failed step left no trace to compare
        for p, q in zip(dm.module.parameters(), ref.parameters()):
            q.copy_(p)
    F.cross_entropy(dm(x2), y2).backward()
    streams.synchronize_all([0, 1])
    opt.step()
    F.cross_entropy(ref(x2), y2).backward(); ref_opt.step()
    for p, q in zip(dm.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    # The other model on these GPUs learns of the abort and recovers too.
    try:
        F.cross_entropy(other(x2), y2).backward()
        raise AssertionError("launched on aborted communicators")
    except pyddp.ReduceError as e:
        assert "aborted" in str(e), str(e)
    other.zero_grad()
    F.cross_entropy(other(x2), y2).backward()
    streams.synchronize_all([0, 1])
    assert sim.counter("nccl_abort") == 2
    dm.close(); other.close()
    """,
    )


def test_async_nccl_error_is_seen_by_the_next_step(simlib):
    run_sim(
        simlib,
        """
    model = Mixed()
    dm = gpu_wrap(model, [0, 1], bucket_cap_mb=0)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    (x, y), = make_batches(1, 8)
    sim.lib.simgpu_nccl_fail_next(0, 6)      # ncclRemoteError on cuda:0's next collective
    try:
        # Seen by the next launch of this backward, or else by the step.
        F.cross_entropy(dm(x), y).backward()
        streams.synchronize_all([0, 1])
        opt.step()
        raise AssertionError("stepped after an asynchronous NCCL error")
    except pyddp.ReduceError as e:
        assert "remote process exited" in str(e), str(e)
    opt.zero_grad()                          # rebuilds the communicators
    assert sim.counter("nccl_abort") == 2
    F.cross_entropy(dm(x), y).backward()
    streams.synchronize_all([0, 1])
    opt.step()
    dm.close()
    """,
    )


def test_close_and_exit_with_a_reduction_in_flight_do_not_hang(simlib):
    # A stuck reduction at close(): communicators are aborted, not destroyed
    # (ncclCommDestroy would wait forever). Then a second model is left alive
    # at exit: the atexit hook closes it before the driver's teardown.
    out = run_sim(
        simlib,
        """
    (x, y), = make_batches(1, 8)
    idle = gpu_wrap(Mixed(), [0, 1], bucket_cap_mb=0)
    F.cross_entropy(idle(x), y).backward()
    streams.synchronize_all([0, 1])
    idle.close()  # nothing in flight: finalized and destroyed, not aborted
    assert sim.counter("nccl_destroy") == 2 and sim.counter("nccl_abort") == 0
    # A stuck reduction and a timeout far past this script's own limit: a
    # close() that waited for the reduction (or the timeout) never returns.
    dm = gpu_wrap(Mixed(), [0, 1], bucket_cap_mb=0, timeout_s=3600)
    sim.lib.simgpu_nccl_stall(1, 1)
    F.cross_entropy(dm(x), y).backward()
    dm.close()
    assert sim.counter("nccl_abort") == 2 and sim.counter("nccl_destroy") == 2
    try:
        dm(x)
        raise AssertionError("a closed model ran")
    except RuntimeError as e:
        assert "closed" in str(e)
    sim.lib.simgpu_nccl_stall(1, 0)
    keep = gpu_wrap(Mixed(), [0, 1], bucket_cap_mb=0)
    F.cross_entropy(keep(x), y).backward()
    """,
        timeout=180,
    )
    assert "teardown" not in out.stderr, out.stderr


def test_kernel_loads_on_a_cuda_12_driver_and_newer_gpus(simlib):
    # Defect: PTX from nvcc 13 (.version 9.0) is rejected by every CUDA 12
    # driver. The NVRTC route gives a cubin for the device, and PTX at the
    # NVRTC's own ISA only for a GPU newer than it knows.
    for cc, how in (
        ("80", "cubin for sm_80"),
        ("75", "cubin for sm_75"),
        ("100", "PTX (driver JIT) for compute_90"),
    ):
        out = run_sim(
            simlib,
            """
        print(_C.load_device_kernel(0, os.environ["PYDDP_NVRTC_LIBRARY"]))
        """,
            env={
                "SIMGPU_DRIVER_VERSION": "12020" if cc != "100" else "12040",
                "SIMGPU_CC": cc,
                "SIMGPU_NVRTC_VERSION": "124",
            },
        )
        assert how in out.stdout, out.stdout
    # An NVRTC newer than the driver (PTX path): a clear error, not a crash.
    out = run_sim(
        simlib,
        """
    try:
        _C.load_device_kernel(0, os.environ["PYDDP_NVRTC_LIBRARY"])
        raise AssertionError("loaded PTX newer than the driver")
    except RuntimeError as e:
        assert "rejected" in str(e) and "222" in str(e) and "PYDDP_NVRTC_LIBRARY" in str(e), e
    """,
        env={"SIMGPU_DRIVER_VERSION": "12040", "SIMGPU_CC": "110", "SIMGPU_NVRTC_VERSION": "130"},
    )


def test_doctor_names_the_simulation(simlib):
    env = dict(os.environ, **sim_env(simlib))
    out = subprocess.run(
        [sys.executable, "-m", "pyddp.doctor"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=os.path.expanduser("~"),
    )
    assert out.returncode == 0, out.stderr
    assert "SIMULATED" in out.stdout
    assert "on-device kernel on cuda:0: loaded (cubin for sm_80" in out.stdout


XPROC = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1]); rank = int(sys.argv[2]); uid = sys.argv[3].encode()
mismatch = sys.argv[4] == "1"
vp = ctypes.c_void_p
class Id(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]
lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
lib.cuCtxSetCurrent.argtypes = [vp]
lib.cuStreamSynchronize.argtypes = [vp]
lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), ctypes.c_int, Id, ctypes.c_int]
lib.ncclAllReduce.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, vp, vp]
lib.ncclCommGetAsyncError.argtypes = [vp, ctypes.POINTER(ctypes.c_int)]
assert lib.cuInit(0) == 0
ctx = vp(); lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), rank); lib.cuCtxSetCurrent(ctx)
comm = vp()
assert lib.ncclCommInitRank(ctypes.byref(comm), 2, Id(uid), rank) == 0
n = 300_001  # several shared-memory chunks
buf = (ctypes.c_float * n)(*([rank + 1.0] * n))
lib.simgpu_alloc.argtypes = [vp, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, vp]
assert lib.simgpu_alloc(buf, 0, ctypes.sizeof(buf), 0, rank, None) == 0  # device memory
count = n - rank if mismatch else n
assert lib.ncclAllReduce(buf, buf, count, 7, 0, comm, None) == 0
assert lib.cuStreamSynchronize(None) == 0
err = ctypes.c_int()
lib.ncclCommGetAsyncError(comm, ctypes.byref(err))
if mismatch:
    assert err.value == 5, err.value  # ncclInvalidUsage
else:
    assert err.value == 0 and buf[0] == 3.0 and buf[n - 1] == 3.0, (err.value, buf[0], buf[n - 1])
print("RANK-OK")
"""


@pytest.mark.parametrize("mismatch", [False, True])
def test_simulated_nccl_spans_processes(simlib, mismatch):
    # ncclCommInitRank with the unique id passed to another process (what
    # multi-process pyddp needs): closed form, and mismatched counts flagged.
    uid = f"simgpu:xproc:{os.getpid()}:{time.time_ns()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", XPROC, simlib, str(r), uid, "1" if mismatch else "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "RANK-OK" in out, out + err
    assert ("different count" in outs[0][1]) == mismatch


@pytest.mark.parametrize("devices", [[0, 0, 0], [0, 1, 2]])
def test_all_reduce_gpu_branch_orders_after_late_writes_on_current_streams(simlib, devices):
    # pyddp.all_reduce's GPU branch, through the same stream-provider seam as
    # GradSync: inputs written late on streams of each device's own (they
    # read NaN until those streams get there), then reduced in place; the
    # reduction must wait for those streams and they for it. The writes land
    # 2 ms late: later than NCCL's non-blocking launch takes to reach the
    # streams, so a missing wait cannot pass by that luck.
    run_sim(
        simlib,
        f"""
    streams.late_us = 2000
    devs = {devices}
    own = {{d: sim.stream(d) for d in set(devs)}}
    sim.lib.simgpu_set_delay_us(None, 100)
    n = len(devs)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for size in (1, 7, (1 << 16) + 3):
            ts = [streams.upload(d, torch.full((size,), float(r + 1), dtype=dtype)) for r, d in enumerate(devs)]
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
    """,
    )


@pytest.mark.parametrize("devices", [[0, 1], [0, 0]])
def test_no_host_waits_in_steady_state_in_one_process(simlib, devices):
    # Steady-state steps (forward through dm.loss, backward, optimizer step,
    # zero_grad) on NCCL and on the shared-GPU kernel: the host never waits
    # for a GPU (driver calls counted by the simulation, the test's own
    # stream drains excluded) and pyddp's code never reads a tensor's value.
    # Across processes: test_gradsync_across_processes_on_one_nccl_communicator.
    run_sim(
        simlib,
        f"""
        from simgpu import HostReads
        torch.manual_seed(0)
        dm = gpu_wrap(Mixed(), {devices!r}, bucket_cap_mb=0.001)
        opt = dm.optimizer(torch.optim.SGD, lr=0.01, momentum=0.9)
        reads = HostReads()
        for k, (x, y) in enumerate(make_batches(7, 13)):
            if k == 3:
                waits = sim.counter("host_sync")
                reads.__enter__()
            dm.loss(F.cross_entropy, x, y).backward()
            streams.synchronize_all({devices!r})  # the optimizer "kernel" in stream order
            opt.step()
            opt.zero_grad()
            streams.synchronize_all({devices!r})
        reads.__exit__(None, None, None)
        waits = sim.counter("host_sync") - waits
        assert waits == 0 and reads.reads == [], (waits, reads.reads)
        dm.close()
        """,
    )


def test_an_illegal_address_kills_the_context_and_pyddp_says_restart(simlib):
    # A kernel that touches memory it does not own (a user's here; pyddp's
    # own would be caught by the guard zones) leaves the CUDA context dead
    # for good: every later call on it returns the error. pyddp must report
    # it, and zero_grad() must not rebuild communicators on it as if it were
    # a timeout: every later step says the same, with "restart the process".
    run_sim(
        simlib,
        """
        dm, batches = stepped_on_two_gpus()
        sim.lib.simgpu_kill_context(1)
        errors = []
        for x, y in batches[1:]:
            try:
                F.cross_entropy(dm(x), y).backward()
                dm._reducer.check_step()
                dm.zero_grad()
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - checked below
                errors.append(f"{type(e).__name__}: {e}")
        assert all(e is not None for e in errors), errors
        for e in errors:
            assert "illegal memory access" in e and "restart the process" in e, errors
        # zero_grad() (the recovery point after a timeout) raises too.
        try:
            dm.zero_grad()
            refused = None
        except Exception as e:  # noqa: BLE001 - checked below
            refused = str(e)
        assert refused is not None and "restart the process" in refused, refused
        assert "cuda:1's context is dead" in sim.violations()
        sim.lib.simgpu_reset()  # the violation was injected: the epilogue checks the rest
        """,
        env={"SIMGPU_LATE_US": "0"},
    )


def test_a_forward_inside_cuda_graph_capture_is_refused_by_name(simlib):
    # Not modelled (docs/gpus.md): the simulation has no graph capture. What
    # pyddp does under one is: refuse, naming it, before anything is queued.
    run_sim(
        simlib,
        """
        torch.manual_seed(0)
        dm = gpu_wrap(Mixed(), [0, 1])
        (x, y), = make_batches(1, 8)
        streams.capture = True
        try:
            dm(x)
            raise AssertionError("a forward under capture was accepted")
        except RuntimeError as e:
            assert "CUDA graph capture" in str(e), str(e)
        streams.capture = False
        F.cross_entropy(dm(x), y).backward()
        streams.synchronize_all([0, 1])
        dm.close()
        """,
    )


@pytest.mark.parametrize("when", ["step", "backward"])
@pytest.mark.parametrize("call", ["cuStreamWaitEvent", "cuEventRecord"])
@pytest.mark.parametrize("code", [700, 702, 214, 220, 999])
def test_a_sticky_error_first_seen_by_any_driver_call_says_restart(simlib, code, call, when):
    # Illegal address, launch timeout, uncorrectable ECC / NVLink, unknown:
    # each leaves the context dead whichever driver call reports it first
    # (armed before a step: the forward's stream wait or the end-of-backward
    # fence; armed after the forward: the ready event or the launch's stream
    # wait), not only the watchdog's event query. pyddp must name the error
    # and the GPU and say "restart the process" at this step and every later
    # one, and zero_grad() must refuse to rebuild communicators on the dead
    # context (a rebuild fails with NCCL's "unhandled cuda error" instead).
    run_sim(
        simlib,
        f"""
        dm, batches = stepped_on_two_gpus()
        arm = lambda: sim.lib.simgpu_fail_next_driver_call({call!r}.encode(), 1, {code})
        if {when!r} == "step":
            arm()
        errors = []
        for k, (x, y) in enumerate(batches[1:]):
            try:
                loss = F.cross_entropy(dm(x), y)
                if k == 0 and {when!r} == "backward":
                    arm()
                loss.backward()
                dm._reducer.check_step()
                dm.zero_grad()
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - checked below
                errors.append(f"{{type(e).__name__}}: {{e}}")
        assert sim.lib.simgpu_sticky(1) == {code}, "the injected fault never fired"
        assert all(e is not None for e in errors), errors
        if {when!r} == "backward" and "restart the process" not in errors[0]:
            # torch's own work in that backward may meet the dead context
            # first (here the harness's drain standing in for it: torch
            # raises "CUDA error: ...", the harness asserts on other codes).
            assert "CUDA error" in errors[0] or errors[0] == "AssertionError: {code}", errors
            errors = errors[1:]
        # The first failure, every time: not whatever call fails next.
        assert len(set(errors)) == 1, errors
        assert "CUDA error {code}" in errors[0] and "restart the process" in errors[0], errors
        assert "cuda:1" in errors[0], errors
        try:
            dm.zero_grad()
            refused = None
        except Exception as e:  # noqa: BLE001 - checked below
            refused = f"{{type(e).__name__}}: {{e}}"
        assert refused == errors[0], (refused, errors)
        """,
        env={"SIMGPU_LATE_US": "0"},
    )


def test_wire_scaling_is_torch_cuda_div_for_every_16_bit_value_and_1_to_64_ranks(simlib):
    # torch's hooks: buffer.to(float16 or bfloat16).div_(world_size). On CUDA,
    # div_ by a CPU scalar multiplies by the reciprocal computed in float
    # (BinaryDivTrueKernel.cu: inv_b = opmath_t(1.0) / b, then a * inv_b,
    # rounded once to the 16-bit type); dividing instead gives other float16
    # subnormals for 14, 26, 28, 30, 52, 56 and 60 ranks. The compression
    # kernel against that closed form, for every 16-bit pattern and 1..64
    # ranks (NaN: any NaN). And what docs/across-processes.md says of the CPU
    # path, where torch's hook itself runs: CPU div_ divides, so it differs
    # from the GPU for exactly those world sizes (float16; bfloat16 never).
    run_sim(
        simlib,
        """
    import ctypes
    run = sim.lib.simgpu_run_kernel
    run.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                    ctypes.c_longlong, ctypes.c_int]
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)  # every pattern
    cpu_differs = {}
    for name, wire in (("f16", torch.float16), ("bf16", torch.bfloat16)):
        x = bits.view(wire).float()  # exact in float32
        nan = torch.isnan(x)
        for n in range(1, 65):
            out = torch.empty(65536, dtype=wire)
            kernel = f"pyddp_compress_{name}".encode()
            assert run(kernel, x.data_ptr(), out.data_ptr(), n, 65536, 0) == 0
            inv = torch.tensor(1.0, dtype=torch.float32) / n  # in float, as torch's opmath
            want = (x * inv).to(wire)
            bad = (out.view(torch.int16) != want.view(torch.int16)) & ~nan
            assert not bad.any(), (name, n, int(bad.sum()), x[bad][:3].tolist(),
                                   out[bad][:3].float().tolist(), want[bad][:3].float().tolist())
            assert torch.isnan(out[nan].float()).all(), (name, n)
            on_cpu = bits.view(wire).clone().div_(n)  # torch's hook on a CPU tensor
            if ((on_cpu.view(torch.int16) != want.view(torch.int16)) & ~nan).any():
                cpu_differs.setdefault(name, []).append(n)
    assert cpu_differs == {"f16": [14, 26, 28, 30, 52, 56, 60]}, cpu_differs
    """,
    )


MINUS_ZERO_CHILD = """
import os, sys
sys.path.insert(0, {simdir!r})
import pyddp
from pyddp.doctor import minus_zero as _minus_zero
from simgpu import Sim, SimStreams
sim = Sim(os.environ["PYDDP_CUDA_LIBRARY"])
streams = SimStreams(sim)
devs = [0, 1, 2]

def all_reduce(ts):
    if os.environ["NCCL_ALGO"] == "NVLS":  # what NCCL says without NVLink SHARP
        raise RuntimeError("NCCL error 5 (invalid usage): no algorithm/protocol available "
                           "for function AllReduce; NCCL_ALGO was set to NVLS")
    with simulated_gpus(devs, streams):
        pyddp.all_reduce(ts)
    streams.synchronize_all(devs)

_minus_zero.child(all_reduce, lambda r, t: streams.upload(devs[r], t), len(devs))
"""


def test_selftest_minus_zero_checks_run_on_the_simulation(simlib):
    # doctor --selftest's checks of the -0.0 trick (pyddp/doctor/minus_zero.py)
    # are for real GPUs under NCCL_ALGO=Ring and NVLS; here their code runs on
    # the simulated NCCL over 3 GPUs: the checks in this process (every class
    # bitwise, as the simulation adds in IEEE float), then the selftest's
    # child process and report. The simulation has no NVLS: under
    # NCCL_ALGO=NVLS the child raises what NCCL says without NVLink SHARP, so
    # the skip is what runs.
    child = MINUS_ZERO_CHILD.format(simdir=os.path.join(HERE, "simgpu"))
    run_sim(
        simlib,
        f"""
    from pyddp.doctor import minus_zero as _minus_zero
    devs = [0, 1, 2]
    def all_reduce(ts):
        with simulated_gpus(devs, streams):
            pyddp.all_reduce(ts)
        streams.synchronize_all(devs)
    results = _minus_zero.run_trick(all_reduce, lambda r, t: streams.upload(devs[r], t), 3)
    assert set(results) == {{"float32", "float16", "bfloat16", "float64"}}, results
    bad = {{(d, c): w for d, per in results.items() for c, w in per.items() if w != "ok"}}
    # The simulated NCCL sums float16 through float32 and back, quieting a
    # NaN to 0x7e00 (as pyddp's kernel conversion does; a GPU's half add
    # gives its own canonical NaN): the payload is lost, the NaN kept.
    assert list(bad) == [("float16", "NaN payloads")], bad
    assert bad["float16", "NaN payloads"] == "payload 0x7e01 -> 0x7e00 on rank 0 (root 0)", bad
    command = [sys.executable, "-c", {child!r}]
    detail = _minus_zero.check("Ring", 3, command, timeout=100)
    assert detail.startswith("bitwise on 3 GPUs: 4 dtypes"), detail
    assert "NaN payloads not kept: float16 NaN payloads: payload 0x7e01" in detail, detail
    try:
        _minus_zero.check("NVLS", 3, command, timeout=100)
        raise AssertionError("NVLS was not skipped")
    except _minus_zero.Skipped as e:
        assert "NCCL_ALGO=NVLS did not run here: RuntimeError: NCCL error 5" in str(e), e
    """,
    )
