"""The simulation's own pieces under pyddp (tests/simgpu), each scenario a
function run in a process of its own (tests/spawn.py's run_alone): the
on-device kernel's 16-bit arithmetic (rounding, torch's wire scaling), how
the kernel is loaded on CUDA 12 drivers and newer GPUs, the simulated NCCL
across processes, and the doctor (its report and its selftest's collectives
checks) on the simulation."""

import ctypes
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import exact_blocks
from spawn import run_alone, simgpu_libraries

from pyddp import _C
from pyddp.engine.streams import simulated_gpus
from pyddp.runtime import libraries as _runtime

pytestmark = pytest.mark.simgpu


def kernel_16bit_rounding():
    from simulated import sim, streams

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        for n in (2, 3):
            backend = _runtime.make_backend([0] * n, timeout=30)
            vals = [
                (torch.randn(4099, generator=g)
                 * 10.0 ** torch.randint(-7, 4, (4099,), generator=g)).to(dtype)
                for _ in range(n)
            ]  # fmt: skip
            want = vals[0].float()
            for v in vals[1:]:
                want = want + v.float()
            for op, expect in (("sum", want.to(dtype)), ("avg", (want / n).to(dtype))):
                ts = [streams.upload(0, v) for v in vals]
                backend.reduce([t.data_ptr() for t in ts], [0] * n, [0] * n, 4099,
                               str(dtype).split(".")[1], op)  # fmt: skip
                sim.synchronize(0, 0)
                for t in ts:
                    assert torch.equal(t, expect), (
                        dtype, n, op, (t.float() - expect.float()).abs().max()
                    )  # fmt: skip
            backend.close()


def test_kernel_16bit_rounding_matches_torch():
    # The kernel sums in float32 in replica order and rounds once: exactly
    # torch's float32 sum cast back, for random values (subnormals included).
    run_alone(kernel_16bit_rounding)


def kernel_route():
    print(_C.load_device_kernel(0, os.environ["PYDDP_NVRTC_LIBRARY"]))


def kernel_newer_than_the_driver():
    try:
        _C.load_device_kernel(0, os.environ["PYDDP_NVRTC_LIBRARY"])
        raise AssertionError("loaded PTX newer than the driver")
    except RuntimeError as e:
        assert "rejected" in str(e) and "222" in str(e) and "PYDDP_NVRTC_LIBRARY" in str(e), e


def test_kernel_loads_on_a_cuda_12_driver_and_newer_gpus():
    # Defect: PTX from nvcc 13 (.version 9.0) is rejected by every CUDA 12
    # driver. The NVRTC route gives a cubin for the device, and PTX at the
    # NVRTC's own ISA only for a GPU newer than it knows.
    for cc, how in (
        ("80", "cubin for sm_80"),
        ("75", "cubin for sm_75"),
        ("100", "PTX (driver JIT) for compute_90"),
    ):
        out = run_alone(
            kernel_route,
            env={
                "SIMGPU_DRIVER_VERSION": "12020" if cc != "100" else "12040",
                "SIMGPU_CC": cc,
                "SIMGPU_NVRTC_VERSION": "124",
            },
        )
        assert how in out.stdout, out.stdout
    # An NVRTC newer than the driver (PTX path): a clear error, not a crash.
    run_alone(
        kernel_newer_than_the_driver,
        env={"SIMGPU_DRIVER_VERSION": "12040", "SIMGPU_CC": "110", "SIMGPU_NVRTC_VERSION": "130"},
    )


def test_doctor_names_the_simulation():
    env = dict(os.environ, **simgpu_libraries())
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


def nccl_rank(path, rank, uid, mismatch):
    """One process of two, straight on the simulated driver and NCCL (ctypes)."""
    lib = ctypes.CDLL(path)
    uid = uid.encode()
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
    ctx = vp()
    lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), rank)
    lib.cuCtxSetCurrent(ctx)
    comm = vp()
    assert lib.ncclCommInitRank(ctypes.byref(comm), 2, Id(uid), rank) == 0
    n = 300_001  # several shared-memory chunks
    buf = (ctypes.c_float * n)(*([rank + 1.0] * n))
    size = ctypes.c_size_t
    lib.simgpu_alloc.argtypes = [vp, size, size, size, ctypes.c_int, vp]
    assert lib.simgpu_alloc(buf, 0, ctypes.sizeof(buf), 0, rank, None) == 0  # device memory
    count = n - rank if mismatch else n
    assert lib.ncclAllReduce(buf, buf, count, 7, 0, comm, None) == 0
    assert lib.cuStreamSynchronize(None) == 0
    err = ctypes.c_int()
    lib.ncclCommGetAsyncError(comm, ctypes.byref(err))
    if mismatch:
        assert err.value == 5, err.value  # ncclInvalidUsage
    else:
        assert err.value == 0 and buf[0] == 3.0 and buf[n - 1] == 3.0, (
            err.value, buf[0], buf[n - 1]
        )  # fmt: skip
    print("RANK-OK")


@pytest.mark.parametrize("mismatch", [False, True])
def test_simulated_nccl_spans_processes(mismatch):
    # ncclCommInitRank with the unique id passed to another process (what
    # multi-process pyddp needs): closed form, and mismatched counts flagged.
    uid = f"simgpu:xproc:{os.getpid()}:{time.time_ns()}"
    lib = simgpu_libraries()["PYDDP_CUDA_LIBRARY"]
    with ThreadPoolExecutor(2) as pool:  # both at once: they meet in ncclCommInitRank
        runs = [
            pool.submit(run_alone, nccl_rank, lib, r, uid, mismatch, simgpu=False, timeout=60)
            for r in range(2)
        ]
        outs = [run.result() for run in runs]
    for out in outs:
        assert out.returncode == 0 and "RANK-OK" in out.stdout, out.stdout + out.stderr
    assert ("different kind/count" in outs[0].stderr) == mismatch


def wire_scaling():
    from simulated import sim

    run = sim.lib.simgpu_run_kernel
    run.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                    ctypes.c_longlong, ctypes.c_int]  # fmt: skip
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
            assert not bad.any(), (
                name, n, int(bad.sum()), x[bad][:3].tolist(),
                out[bad][:3].float().tolist(), want[bad][:3].float().tolist(),
            )  # fmt: skip
            assert torch.isnan(out[nan].float()).all(), (name, n)
            on_cpu = bits.view(wire).clone().div_(n)  # torch's hook on a CPU tensor
            if ((on_cpu.view(torch.int16) != want.view(torch.int16)) & ~nan).any():
                cpu_differs.setdefault(name, []).append(n)
    assert cpu_differs == {"f16": [14, 26, 28, 30, 52, 56, 60]}, cpu_differs


def test_wire_scaling_is_torch_cuda_div_for_every_16_bit_value_and_1_to_64_ranks():
    # torch's hooks: buffer.to(float16 or bfloat16).div_(world_size). On CUDA,
    # div_ by a CPU scalar multiplies by the reciprocal computed in float
    # (BinaryDivTrueKernel.cu: inv_b = opmath_t(1.0) / b, then a * inv_b,
    # rounded once to the 16-bit type); dividing instead gives other float16
    # subnormals for 14, 26, 28, 30, 52, 56 and 60 ranks. The compression
    # kernel against that closed form, for every 16-bit pattern and 1..64
    # ranks (NaN: any NaN). And what docs/across-processes.md says of the CPU
    # path, where torch's hook itself runs: CPU div_ divides, so it differs
    # from the GPU for exactly those world sizes (float16; bfloat16 never).
    run_alone(wire_scaling)


def selftest_collectives(devs):
    from simulated import sim, streams

    from pyddp.doctor import collectives

    detail = collectives.check(
        len(devs),
        lambda r, t: streams.upload(devs[r], t),
        lambda: streams.synchronize_all(devs),
        lambda: simulated_gpus(devs, streams),
        sizes=[0, 1, 7, (1 << 16) + 3],
    )
    assert detail.startswith("4 collectives x 4 dtypes x 4 sizes on"), detail
    assert not sim.violations(), sim.violations()


@pytest.mark.parametrize("devs", [[0, 1, 2], [0, 0]])
def test_selftest_collectives_check_runs_on_the_simulation(devs):
    # doctor --selftest's check of the four collectives (pyddp/doctor/
    # collectives.py) is for real GPUs; its code runs here on the simulated
    # NCCL (3 GPUs) and pyddp's kernels (2 replicas on one GPU): broadcast
    # and all-gather bit for bit on random bit patterns, the sums closed form.
    run_alone(selftest_collectives, devs)


# pyddp launches its kernels with 256 threads a block and at most 4096 blocks
# (csrc/gpu_backend.cpp): these sizes per replica cover one partial block,
# two blocks, and more than one grid (the grid-stride loop's second pass).
PAST_ONE_BLOCK = (200, 257, 4096 * 256 + 3)


def kernels_past_one_block_and_the_grid(kind):
    from simulated import sim, streams

    n = 2 if kind == "nccl" else 3
    devs = list(range(n)) if kind == "nccl" else [0] * n
    backend = _runtime.make_backend(devs, timeout=60)

    def done():
        for d in set(devs):
            sim.synchronize(0, d)

    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        name = str(dtype).split(".")[1]
        for size in PAST_ONE_BLOCK:
            vals = exact_blocks(n, size, dtype)
            # all-reduce (in place by nature)
            ts = [streams.upload(d, v) for d, v in zip(devs, vals)]
            backend.reduce([t.data_ptr() for t in ts], devs, [0] * n, size, name, "sum")
            done()
            want = sum(v.double() for v in vals).to(dtype)
            assert all(torch.equal(t, want) for t in ts), ("reduce", dtype, size)
            # broadcast (in place)
            ts = [streams.upload(d, v) for d, v in zip(devs, vals)]
            backend.broadcast([t.data_ptr() for t in ts], devs, [0] * n, size, name, n - 1)
            done()
            assert all(torch.equal(t, vals[n - 1]) for t in ts), ("broadcast", dtype, size)
            # all-gather, out of place and in place (rank r's input is block r
            # of its own output, as ZeRO gathers its shards)
            whole = torch.cat(vals)
            for in_place in (False, True):
                if in_place:
                    outs = [streams.upload(d, torch.zeros(n * size, dtype=dtype)) for d in devs]
                    for r, o in enumerate(outs):
                        o[r * size : (r + 1) * size].copy_(vals[r])
                    sends = [o[r * size : (r + 1) * size] for r, o in enumerate(outs)]
                else:
                    sends = [streams.upload(d, v) for d, v in zip(devs, vals)]
                    outs = [streams.upload(d, torch.zeros(n * size, dtype=dtype)) for d in devs]
                backend.all_gather([s.data_ptr() for s in sends], [o.data_ptr() for o in outs],
                                   devs, [0] * n, size, name)  # fmt: skip
                done()
                assert all(torch.equal(o, whole) for o in outs), (
                    "all_gather",
                    dtype,
                    size,
                    in_place,
                )
            # reduce-scatter, out of place and in place (rank r's output is
            # block r of its own input)
            fulls = exact_blocks(n, n * size, dtype)
            want = sum(f.double() for f in fulls).to(dtype).view(n, size)
            for in_place in (False, True):
                sends = [streams.upload(d, f) for d, f in zip(devs, fulls)]
                if in_place:
                    recvs = [s[r * size : (r + 1) * size] for r, s in enumerate(sends)]
                else:
                    recvs = [streams.upload(d, torch.zeros(size, dtype=dtype)) for d in devs]
                backend.reduce_scatter([s.data_ptr() for s in sends], [o.data_ptr() for o in recvs],
                                       devs, [0] * n, size, name, "sum")  # fmt: skip
                done()
                for r, o in enumerate(recvs):
                    assert torch.equal(o, want[r]), ("reduce_scatter", dtype, size, in_place, r)
    backend.close()


@pytest.mark.parametrize("kind", ["device", "nccl"])
def test_every_collective_past_one_block_and_past_one_grid_in_and_out_of_place(kind):
    # The shared-GPU kernel ("device", 3 replicas on one GPU) and the
    # simulated NCCL (2 GPUs), every collective at sizes that cover a partial
    # block, two blocks and more than one grid of blocks (the grid-stride
    # loop's later passes), in place and out of place where both exist:
    # closed-form values, every dtype width (16, 32, 64 bits).
    run_alone(kernels_past_one_block_and_the_grid, kind, timeout=600)
