"""The GPU path (skipped without a GPU): equivalence with single-device training
on one GPU and with replicas sharing it, stream ordering without host syncs,
16-bit types, the collectives API on torch tensors and CuPy arrays, timeouts."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import Mixed, exact_blocks, make_batches
from ranks import SGD, data, eval_norm, my_rows, net, reference
from spawn import spawn
from torch import nn

import pyddp
from pyddp.runtime import libraries as _runtime

pytestmark = pytest.mark.cuda
ATOL, RTOL = 1e-5, 1e-4  # GPU kernels (cuBLAS, atomics in embedding backward) reassociate more


@pytest.fixture(autouse=True)
def no_tf32():
    # TF32 (10-bit mantissa) would make batch-size-dependent algorithm choices
    # differ far beyond float32 rounding.
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("run", ["auto", "in_turn"])
@pytest.mark.parametrize("path", ["gather", "loss"])
@pytest.mark.parametrize("cap", [0, 25])
@pytest.mark.parametrize("devices", [["cuda:0"], ["cuda:0", "cuda:0"], ["cuda:0"] * 3])
def test_matches_single_device_on_gpu(devices, cap, path, run):
    # run: replicas sharing the GPU on worker threads and in turn (auto
    # switches between both over these steps), with the optimizer stepping
    # replica 0 and the others copying it.
    torch.manual_seed(0)
    model = Mixed().cuda()
    ref = copy.deepcopy(model)
    dm = pyddp.wrap(model, devices, bucket_cap_mb=cap, run_replicas=run)
    opt = dm.optimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    for x, y in make_batches(10, 13):
        x, y = x.cuda(), y.cuda()
        loss = dm.loss(F.cross_entropy, x, y) if path == "loss" else F.cross_entropy(dm(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for rep in dm.replicas[1:]:
            for p, p0 in zip(rep.parameters(), dm.module.parameters()):
                assert torch.equal(p, p0)
    for p, q in zip(dm.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)
    if run == "in_turn" and len(devices) > 1:
        assert dm.run_replicas() == {"*": "in_turn"}


class _Delay(torch.autograd.Function):
    """Identity whose backward first occupies the stream for a while: the
    gradient after it is *queued* at once but *computed* late."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time on the compute stream
        return g


class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4096, 4096) * 0.01)  # 64 MiB gradient

    def forward(self, x):
        return _Delay.apply(x @ self.w)


def test_stream_ordering_without_host_syncs():
    # Without the event waits the reduction would read the gradient buffer
    # before the delayed kernels wrote it (zeros), and the read after backward
    # would see unreduced values. Both are checked against closed-form values.
    torch.manual_seed(0)
    dm = pyddp.wrap(Big().cuda(), ["cuda:0", "cuda:0"], bucket_cap_mb=0)
    x = torch.ones(8, 4096, device="cuda")
    for _ in range(3):
        dm.zero_grad()
        dm(x).sum().backward()
        # No host sync: backward returned while the delayed kernels still run.
        assert not torch.cuda.current_stream().query()
        # d(sum(x @ w))/dw = x^T 1 = 8 rows of ones split 4/4: each replica 4, sum 8
        grad = dm.module.w.grad.clone()  # on the compute stream, right after backward
        assert torch.equal(grad, torch.full_like(grad, 8.0))
        assert torch.equal(dm.replicas[1].w.grad, grad)


@pytest.mark.parametrize("devices", [["cuda:0"] * 2, ["cuda:0"] * 3])
def test_backward_and_step_on_other_streams_than_the_forward(devices):
    # autograd runs the backward on the forward's stream (its device thread)
    # and makes the caller's stream wait for that stream only, before
    # finish(): pyddp must order the caller's stream, where the step reads
    # the gradients, after the reductions too (the simulated tier's
    # test_backward_runs_as_autograd_runs_it_on_gpus, here with torch's own
    # autograd). The delayed backward kernels keep the reduction late. The
    # accumulators are torch's, made on the forward's stream, not the one
    # current at wrap: torch warns when one runs on another stream than the
    # gradient's producer (pyddp._hot's refresh rebinds them).
    torch.manual_seed(0)
    dm = pyddp.wrap(Big().cuda(), devices, bucket_cap_mb=0)
    x = torch.ones(8 * len(devices), 4096, device="cuda")
    forward, caller = torch.cuda.Stream(), torch.cuda.Stream()
    forward.wait_stream(torch.cuda.current_stream())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            with torch.cuda.stream(forward):
                dm.zero_grad()
                out = dm(x).sum()
            with torch.cuda.stream(caller):
                out.backward()
                grad = dm.module.w.grad.clone()  # on the caller's stream, no host sync
                other = dm.replicas[-1].w.grad.clone()
            caller.synchronize()
            # d(sum(x @ w))/dw = x^T 1: 8 rows of ones per replica, summed
            assert torch.equal(grad, torch.full_like(grad, 8.0 * len(devices)))
            assert torch.equal(other, grad)
            forward.wait_stream(caller)
    mismatched = [w for w in seen if "AccumulateGrad node's stream" in str(w.message)]
    assert not mismatched, mismatched[0].message


def test_cpp_hooks_mark_every_gradient_with_its_producing_stream_on_gpu():
    # pyddp._hot's hooks on GPU replicas read torch's current stream from C++
    # (c10, each stream id turned into its CUstream once): on the default
    # stream and on a stream of the user's, every gradient is marked from
    # C++ and the reduction orders after the delayed kernels (closed form).
    if _runtime.hot() is None:
        pytest.skip("pyddp._hot is not loaded (not built, or PYDDP_HOT=0)")
    torch.manual_seed(0)
    dm = pyddp.wrap(Big().cuda(), ["cuda:0", "cuda:0"], bucket_cap_mb=0)
    hot = dm._reducer._layout.hot
    assert hot is not None
    x = torch.ones(8, 4096, device="cuda")
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side, side, torch.cuda.current_stream()):
        with torch.cuda.stream(stream):
            dm.zero_grad()
            before = hot.marks()
            dm(x).sum().backward()
            assert hot.marks() - before == 2  # one parameter on each replica, from C++
            grad = dm.module.w.grad.clone()
            assert torch.equal(grad, torch.full_like(grad, 8.0))
            assert torch.equal(dm.replicas[1].w.grad, grad)
    torch.cuda.synchronize()
    gpu = dm.stats()["gpu"]["cuda:0"]  # host against GPU time (which bounds: timing)
    assert gpu["backwards"] == 4 and gpu["gpu_ms"] is not None and gpu["bound"] in ("host", "gpu")
    dm.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_collectives_closed_form_on_one_gpu(dtype, n):
    for size in (0, 1, 7, (1 << 20) + 3):
        ts = [torch.full((size,), float(r + 1), dtype=dtype, device="cuda") for r in range(n)]
        pyddp.all_reduce(ts)
        for t in ts:
            assert torch.equal(t, torch.full_like(t, n * (n + 1) / 2))
    ts = [torch.full((5,), float(r + 1), dtype=dtype, device="cuda") for r in range(n)]
    pyddp.all_reduce(ts, op="avg")
    assert torch.equal(ts[0], torch.full_like(ts[0], (n + 1) / 2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_broadcast_all_gather_reduce_scatter_past_one_grid_on_one_gpu(dtype):
    # pyddp's kernels run at most 4096 blocks of 256 threads and loop over the
    # rest: 3 replicas sharing the GPU, past one grid per replica (the
    # simulated tier's test_every_collective_past_one_block_and_past_one_grid_...).
    n, size = 3, 4096 * 256 + 3
    vals = exact_blocks(n, size, dtype, "cuda")
    ts = [v.clone() for v in vals]
    pyddp.broadcast(ts, root=n - 1)
    assert all(torch.equal(t, vals[n - 1]) for t in ts)
    for out in pyddp.all_gather([v.clone() for v in vals]):
        assert all(torch.equal(out[k], vals[k]) for k in range(n))
    fulls = exact_blocks(n, n * size, dtype, "cuda")
    want = sum(f.double() for f in fulls).to(dtype).view(n, size)
    got = pyddp.reduce_scatter(fulls)
    assert all(torch.equal(got[r], want[r]) for r in range(n))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL path needs two GPUs")
def test_collectives_nccl_two_gpus():
    ts = [torch.full((1001,), float(r + 1), device=f"cuda:{r}") for r in range(2)]
    pyddp.all_reduce(ts)
    assert all(torch.equal(t.cpu(), torch.full((1001,), 3.0)) for t in ts)


def test_collectives_on_cupy_arrays():
    cupy = pytest.importorskip("cupy")
    arrays = [cupy.full((1000,), r + 1, dtype=cupy.float32) for r in range(3)]
    pyddp.all_reduce(arrays)
    torch.cuda.synchronize()
    for a in arrays:
        assert float(a.min()) == 6.0 and float(a.max()) == 6.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_training_on_shared_gpu(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).cuda().to(dtype)
    ref = copy.deepcopy(model)
    dm = pyddp.wrap(model, ["cuda:0", "cuda:0"])
    x = torch.randn(8, 16, device="cuda", dtype=dtype)
    y = torch.randint(0, 4, (8,), device="cuda")
    F.cross_entropy(dm(x).float(), y).backward()
    F.cross_entropy(ref(x).float(), y).backward()
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # 8 / 11 mantissa bits
    for p, q in zip(dm.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.float(), q.grad.float(), atol=tol, rtol=tol)


def test_stalled_reduction_times_out_with_a_clear_error():
    backend = _runtime.make_backend([torch.device("cuda", 0)] * 2, timeout=0.2)
    ts = [torch.ones(1024, device="cuda") for _ in range(2)]
    torch.cuda._sleep(2_000_000_000)  # ~1 s: the reduction waits behind it
    stream = torch.cuda.current_stream().cuda_stream
    backend.reduce([t.data_ptr() for t in ts], [0, 0], [stream, stream], 1024, "float32", "sum")
    import time

    time.sleep(0.6)
    # The watchdog marked it failed on its own: the next launch refuses, with
    # no check() call in between.
    with pytest.raises(pyddp.ReduceError, match="did not complete within 0.2 s"):
        backend.reduce([t.data_ptr() for t in ts], [0, 0], [stream, stream], 1024, "float32")
    torch.cuda.synchronize()  # nothing hangs: the queued work drains
    assert torch.equal(ts[0], torch.full_like(ts[0], 2.0))  # and it was right, only late


def test_failed_reduction_on_gpu_then_a_clean_step():
    torch.manual_seed(0)
    model = Mixed().cuda()
    ref = copy.deepcopy(model)
    dm = pyddp.wrap(model, ["cuda:0", "cuda:0"], bucket_cap_mb=0, rebuild_buckets=False)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (x, y), (x2, y2) = [(a.cuda(), b.cuda()) for a, b in make_batches(2, 8)]
    dm._reducer._engine.inject_fault(3, "simulated failure")
    with pytest.raises(pyddp.ReduceError, match="simulated failure"):
        F.cross_entropy(dm(x), y).backward()
    opt.zero_grad()
    F.cross_entropy(dm(x2), y2).backward()
    opt.step()
    F.cross_entropy(ref(x2), y2).backward()
    ref_opt.step()
    for p, q in zip(dm.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)


def gpu_processes(out: dict) -> None:
    """Real GPUs (one per process): what gradsync_on_simulated_gpus
    (tests/test_simgpu_processes.py) checks on the simulation, on hardware.
    Equal to one device with an uneven, changing global batch (dmodel.loss),
    rank 0's buffers through NCCL, and in steady state no host
    synchronisation (torch's sync debug mode counts them)."""
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


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA GPUs (one per process)",
)
def test_two_processes_on_two_gpus(tmp_path):
    # The cross-process GPU path on hardware: the agreement and the buffer
    # broadcast through NCCL, dmodel.loss's rows assumed and corrected on the
    # device. The host syncs torch's sync debug mode reports in steady state
    # come only from the agreement's wait (the model has a parameter nobody
    # uses, which must stay None).
    for r in spawn(gpu_processes, out=tmp_path):
        assert r["diff"] <= ATOL, r
        assert r["never_none"], r
        assert len(r["syncs"]) <= 3, r["syncs"]  # one per steady step at most
        assert r["buffer"] == [1.0] * 16, r


class Capturable(Mixed):
    """Mixed without its host-side branch (`if mask.any()` reads the GPU: a
    CUDA graph cannot hold it), and with every parameter used: pyddp settles
    a parameter without a gradient on the host, which a replay would not
    redo, so it refuses such a capture (by name)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.features(tokens)
        h = torch.where((tokens[:, 0] == 0)[:, None], self.rare(h), h)
        return self.head(h + self.never(h))


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"]])
def test_a_captured_step_matches_eager_steps(devices):
    # The captured step (pyddp/engine/streams.py, StepCapture) on torch's side: forward,
    # backward with pyddp's reductions inside it and a capturable AdamW step,
    # captured once with torch.cuda.graph after eager warm-up steps on a
    # side stream (torch's recipe), then replayed on new batches copied into
    # the static inputs; against the same steps run eagerly on a copy
    # (passed on an H200, 2026-11-28; the simulation captures pyddp's own
    # calls, not torch's).
    torch.manual_seed(0)
    model = Capturable().cuda()
    twin = copy.deepcopy(model)
    batches = [(x.cuda(), y.cuda()) for x, y in make_batches(8, 13)]
    dm, ref = pyddp.wrap(model, devices), pyddp.wrap(twin, devices)
    opt = dm.optimizer(torch.optim.AdamW, lr=0.01, capturable=True)
    ref_opt = ref.optimizer(torch.optim.AdamW, lr=0.01, capturable=True)
    static_x, static_y = (t.clone() for t in batches[0])

    def step(m, o, x, y):
        o.zero_grad(set_to_none=True)
        F.cross_entropy(m(x), y).backward()
        o.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in batches[:3]:
            static_x.copy_(x)
            static_y.copy_(y)
            step(dm, opt, static_x, static_y)
            step(ref, ref_opt, x, y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(dm, opt, static_x, static_y)
    assert dm.stats()["captured_backwards"] == 1
    hot = dm._reducer._layout.hot
    if hot is not None:  # C++ hooks: their accumulators followed the side and capture streams
        assert hot.rebound() > 0
    for x, y in batches[3:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        step(ref, ref_opt, x, y)
    torch.cuda.synchronize()
    # The capture itself ran nothing: the replays are steps 4 to 8, as the reference's.
    for p, q in zip(dm.module.parameters(), ref.module.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL)
    for rep in dm.replicas[1:]:
        for p, p0 in zip(rep.parameters(), dm.module.parameters()):
            assert torch.equal(p, p0)
