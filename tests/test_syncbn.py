"""SyncBatchNorm in one process: a converted model wrapped over N CPU
replicas equals one device running BatchNorm on the whole batch (losses,
gradients, running statistics), through both forward paths and with
accumulation; the layers are torch's again outside pyddp and after close;
a failing replica or a replica that skips a layer is an error, not a hang.
Below, across processes (torchrun: equal to one device on the global batch;
a forward on one rank alone named) and on simulated GPUs (in one process and
across two). A rank killed before a meeting: tests/test_failures.py.

Tolerance: as tests/test_equivalence.py (1e-6 absolute, 1e-5 relative):
per-channel sums are taken per shard and summed in float64, which changes
the float32 statistics by an ulp or so; measured max |difference| after 6
steps: ~2e-7."""

import copy
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from ranks import TOL, max_diff, maybe_simulated_gpus, wrap_on
from spawn import run_alone, spawn
from torch import nn

import pyddp
from pyddp.replicas.syncbn import BoundSyncBatchNorm

ATOL, RTOL = 1e-6, 1e-5
BATCH = 13  # uneven shards for 2, 3 and 4 replicas


class ConvNet(nn.Module):
    def __init__(self, momentum=0.1, affine=True):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3)
        self.bn2 = nn.BatchNorm2d(6, momentum=momentum, affine=affine)
        self.fc = nn.Linear(6 * 4 * 4, 16)
        self.bn1 = nn.BatchNorm1d(16, momentum=momentum)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = F.relu(self.bn2(self.conv(x)))
        return self.out(F.relu(self.bn1(self.fc(h.flatten(1)))))


def batches(steps, rows=BATCH):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        # an offset and scale so that a wrong mean or variance shows
        x = torch.randn(rows, 3, 6, 6, generator=g) * 2.5 + 1.5
        yield x, torch.randint(0, 4, (rows,), generator=g)


def assert_close_models(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=ATOL, rtol=RTOL, msg=name)
    for (name, t), u in zip(a.named_buffers(), b.buffers()):
        torch.testing.assert_close(t.float(), u.float(), atol=ATOL, rtol=RTOL, msg=name)


@pytest.mark.parametrize("path", ["gather", "loss"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("layers", ["default", "cumulative", "no_affine"])
def test_replicas_equal_one_device_on_the_whole_batch(n, path, layers):
    torch.manual_seed(0)
    kw = {"default": {}, "cumulative": {"momentum": None}, "no_affine": {"affine": False}}[layers]
    ref = ConvNet(**kw)
    model = pyddp.convert_sync_batchnorm(copy.deepcopy(ref))
    dm = pyddp.wrap(model, ["cpu"] * n, bucket_cap_mb=0.001)
    opt, ref_opt = dm.optimizer(torch.optim.SGD, lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches(6):
        loss = dm.loss(F.cross_entropy, x, y) if path == "loss" else F.cross_entropy(dm(x), y)
        loss.backward()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=ATOL, rtol=RTOL)
        for (name, p), q in zip(ref.named_parameters(), dm.module.parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=ATOL, rtol=RTOL, msg=name)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_close_models(ref, dm.module)
    # Evaluation uses the running statistics, which equal the reference's.
    dm.eval()
    ref.eval()
    x, _ = next(batches(1))
    with torch.no_grad():
        torch.testing.assert_close(dm(x), ref(x), atol=ATOL, rtol=RTOL)
    dm.close()


def test_the_statistics_are_global_not_per_replica():
    # The check that the equivalence test is not passing by luck: per-replica
    # BatchNorm (what plain BatchNorm under pyddp or DDP computes) differs
    # from the whole batch's by far more than the tolerance here.
    torch.manual_seed(0)
    ref = ConvNet()
    plain = pyddp.wrap(copy.deepcopy(ref), ["cpu"] * 2)
    synced = pyddp.wrap(pyddp.convert_sync_batchnorm(copy.deepcopy(ref)), ["cpu"] * 2)
    x, y = next(batches(1))
    x[:7] += 3.0  # the shards' statistics differ
    outs = {}
    for name, m in (("ref", ref), ("plain", plain), ("synced", synced)):
        F.cross_entropy(m(x), y).backward()
        outs[name] = (m.module if name != "ref" else m).conv.weight.grad
    torch.testing.assert_close(outs["synced"], outs["ref"], atol=ATOL, rtol=RTOL)
    assert (outs["plain"] - outs["ref"]).abs().max() > 1e-3


def test_accumulation_under_no_sync_equals_one_device():
    torch.manual_seed(0)
    ref = ConvNet()
    dm = pyddp.wrap(pyddp.convert_sync_batchnorm(copy.deepcopy(ref)), ["cpu"] * 3)
    micro = list(batches(3))
    with dm.no_sync():
        for x, y in micro[:2]:
            (F.cross_entropy(dm(x), y) / 3).backward()
    x, y = micro[2]
    (F.cross_entropy(dm(x), y) / 3).backward()
    for x, y in micro:
        (F.cross_entropy(ref(x), y) / 3).backward()
    for (name, p), q in zip(ref.named_parameters(), dm.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=ATOL, rtol=RTOL, msg=name)


def test_fewer_shards_than_replicas():
    # 3 rows over 4 replicas: three shards, the last replica sits out the
    # meetings. (Not 2 rows: BatchNorm of two values is +-1 whatever the
    # input, and the first layer's gradient is rounding noise.)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    dm = pyddp.wrap(pyddp.convert_sync_batchnorm(copy.deepcopy(ref)), ["cpu"] * 4)
    x = torch.randn(3, 5) * 3 + 1
    dm(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (name, p), q in zip(ref.named_parameters(), dm.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=ATOL, rtol=RTOL, msg=name)


class _CheckpointedNorm(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.lin, self.norm, self.head = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(
            lambda t: torch.relu(self.norm(self.lin(t))), x, use_reentrant=self.reentrant
        )
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_sync_batchnorm_inside_checkpointing_is_refused(reentrant):
    # Recomputed in backward, where the replicas no longer meet, it fell
    # back to torch's forward: each replica's own statistics (a gradient 3.8
    # off one device, reentrant), or torch's errors (a CheckpointError
    # about shapes; across processes "expected input tensor to be on GPU").
    model = nn.SyncBatchNorm.convert_sync_batchnorm(_CheckpointedNorm(reentrant))
    x = torch.randn(8, 4, requires_grad=True)
    dm = pyddp.wrap(model, ["cpu", "cpu"])
    with pytest.raises(Exception, match="SyncBatchNorm layer runs inside a backward"):
        dm(x).pow(2).mean().backward()
    dm.close()


def test_compiling_sync_batchnorm_as_one_whole_graph_is_refused_by_name():
    # dynamo's own error named "a Condition context manager" (the replicas'
    # meeting); without fullgraph the layers break the graph and work.
    model = nn.SyncBatchNorm.convert_sync_batchnorm(
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    )
    dm = pyddp.wrap(model, ["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"compile\(fullgraph=True\) cannot compile SyncBatchNorm"):
        dm.compile(backend="eager", fullgraph=True)
    dm.close()


def test_a_failing_replica_breaks_the_meeting_instead_of_hanging():
    class FailsOnReplica1(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            if x.shape[0] == 3:  # replica 1's shard of 7 rows over 2 replicas
                raise RuntimeError("boom on this shard")
            return self.bn(self.fc(x))

    dm = pyddp.wrap(pyddp.convert_sync_batchnorm(FailsOnReplica1()), ["cpu"] * 2)
    with pytest.raises(pyddp.ReplicaError, match="replica 1 failed during forward") as e:
        dm(torch.randn(7, 4))
    assert "boom on this shard" in str(e.value)  # the cause, not replica 0's broken meeting
    out = dm(torch.randn(8, 4))  # the next forward meets again
    assert out.shape == (8, 4)


def test_a_replica_that_skips_the_layer_is_named_within_the_timeout():
    class SkipsOnSmallShards(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return x if x.shape[0] < 4 else self.bn(x)

    dm = pyddp.wrap(pyddp.convert_sync_batchnorm(SkipsOnSmallShards()), ["cpu"] * 2, timeout_s=1)
    with pytest.raises(pyddp.ReplicaError, match=r"replica\(s\) \[1\], which never reached"):
        dm(torch.randn(7, 4))


def test_outside_pyddp_and_after_close_the_layers_are_torchs():
    model = pyddp.convert_sync_batchnorm(ConvNet())
    dm = pyddp.wrap(model, ["cpu"] * 2)
    assert type(model.bn2) is BoundSyncBatchNorm and isinstance(model.bn2, nn.SyncBatchNorm)
    # A copy (an EMA model, a checkpoint) is torch's SyncBatchNorm behaviour,
    # never a second caller of the replicas' meetings.
    twin = copy.deepcopy(model)
    assert twin.bn2.__dict__.get("_pyddp_binding") is None
    model.eval()
    twin.eval()
    x, _ = next(batches(1))
    with torch.no_grad():
        torch.testing.assert_close(twin(x), model(x))
    dm.close()
    assert type(model.bn2) is nn.SyncBatchNorm
    dm2 = pyddp.wrap(model, ["cpu"] * 2)  # wrapped again once closed
    dm2.close()


def test_misuse_is_refused_by_name():
    model = pyddp.convert_sync_batchnorm(ConvNet())
    dm = pyddp.wrap(model, ["cpu"] * 2)
    with pytest.raises(ValueError, match="already synchronised by a live pyddp model"):
        pyddp.wrap(model, ["cpu"] * 2)
    dm.close()
    grouped = nn.Sequential(nn.SyncBatchNorm(4))
    grouped[0].process_group = object()
    with pytest.raises(ValueError, match="process_group=None"):
        pyddp.wrap(grouped, ["cpu"] * 2)

    class Custom(nn.SyncBatchNorm):
        pass

    with pytest.raises(TypeError, match="subclass of torch.nn.SyncBatchNorm"):
        pyddp.wrap(nn.Sequential(Custom(4)), ["cpu"] * 2)
    with pytest.raises(pyddp.ReplicaError, match="more than one value per channel"):
        dm = pyddp.wrap(nn.Sequential(nn.SyncBatchNorm(4)), ["cpu"] * 2)
        dm(torch.randn(1, 4))


def test_gradsync_used_directly_says_it_does_not_synchronize_the_statistics():
    replicas = [nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4)) for _ in range(2)]
    replicas[1].load_state_dict(replicas[0].state_dict())
    with pytest.warns(UserWarning, match="does not synchronize SyncBatchNorm"):
        sync = pyddp.GradSync(replicas)
    sync.close()


def test_bf16_autocast_keeps_the_dtype_and_equals_one_device_to_bf16_rounding():
    # Statistics in float32 and the output in the input's dtype, as torch's
    # BatchNorm under autocast. Tolerance: bfloat16 keeps 8 significant bits
    # (2**-8 relative): outputs within one ulp; gradients (through bf16
    # layers on both sides) within two ulps of the largest gradient (the
    # first layer's bias gradient is analytically 0: rounding noise on both).
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    dm = pyddp.wrap(pyddp.convert_sync_batchnorm(copy.deepcopy(ref)), ["cpu"] * 2)
    x = torch.randn(16, 6) * 2 + 1
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref_out = dm(x), ref(x)
    assert out.dtype == ref_out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref_out, atol=0, rtol=2**-8)
    out.float().square().mean().backward()
    ref_out.float().square().mean().backward()
    scale = max(p.grad.abs().max().item() for p in ref.parameters())
    for (name, p), q in zip(ref.named_parameters(), dm.module.parameters()):
        assert q.grad.dtype == p.grad.dtype == torch.float32
        torch.testing.assert_close(q.grad, p.grad, atol=2**-7 * scale, rtol=0, msg=name)


# ------------------------------------------------- across processes (torchrun)
def synced_across_processes(out: dict) -> None:
    """SyncBatchNorm across processes (SCENARIO_REPLICAS replicas each):
    equal to one device running BatchNorm on the global batch, which every
    rank also trains here. Rank r's rows are its slice of each global batch
    (the same number per rank: the gradient average over processes is then
    the global mean, as under torch DDP). A forward in eval mode on rank 0
    alone afterwards: evaluation never meets."""
    replicas = int(os.environ.get("SCENARIO_REPLICAS", "1"))
    rank, world = pyddp.rank(), pyddp.world()
    gpus, settle = maybe_simulated_gpus(replicas)
    torch.manual_seed(0)
    ref = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 3 * 3, 8), nn.BatchNorm1d(8, momentum=None), nn.ReLU(), nn.Linear(8, 3),
    )  # fmt: skip
    dm = wrap_on(pyddp.convert_sync_batchnorm(copy.deepcopy(ref)), replicas, gpus)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rows = 7  # per rank: uneven shards over 2 replicas
    g = torch.Generator().manual_seed(3)
    worst_grad = 0.0
    for _ in range(5):
        x = torch.randn(rows * world, 2, 5, 5, generator=g) * 2 + 1
        y = torch.randint(0, 3, (rows * world,), generator=g)
        mine = slice(rank * rows, (rank + 1) * rows)
        F.cross_entropy(dm(x[mine]), y[mine]).backward()
        settle()  # simulated GPUs: the host reads what the streams wrote
        F.cross_entropy(ref(x), y).backward()
        for p, q in zip(dm.module.parameters(), ref.parameters()):
            worst_grad = max(worst_grad, (p.grad - q.grad).abs().max().item())
        opt.step()
        settle()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["grad"] = worst_grad
    out["params"] = max(
        (p - q).abs().max().item() for p, q in zip(dm.module.parameters(), ref.parameters())
    )
    out["buffers"] = max(
        (b.float() - c.float()).abs().max().item()
        for b, c in zip(dm.module.buffers(), ref.buffers())
    )
    if gpus is not None:  # one more step on simulated GPUs: no host wait, no host read
        from simgpu import HostReads

        sim = gpus[1].sim
        x = torch.randn(rows * world, 2, 5, 5, generator=g)
        y = torch.randint(0, 3, (rows * world,), generator=g)
        waits = sim.counter("host_sync")
        with HostReads(sim) as reads:
            F.cross_entropy(dm(x[mine]), y[mine]).backward()
        out["steady_host_waits"] = sim.counter("host_sync") - waits
        out["steady_host_reads"] = reads.reads
        settle()
        opt.zero_grad()
    if rank == 0:
        dm.eval()
        with torch.no_grad():
            dm(torch.randn(4, 2, 5, 5))
    dm.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("replicas", [1, 2])
def test_sync_batchnorm_across_processes_equals_one_device(tmp_path, replicas):
    # torch's SyncBatchNorm refuses CPU tensors, so the reference is one
    # device running BatchNorm on the global batch (every rank trains it).
    env = {"SCENARIO_REPLICAS": str(replicas)}
    for r in spawn(synced_across_processes, env=env, out=tmp_path):
        assert r["grad"] <= TOL and r["params"] <= TOL and r["buffers"] <= TOL, r


def a_rank_without_rows(out: dict) -> None:
    """Rank 0 gets no rows in one step (the tail of a dataset split by
    rank): torch's SyncBatchNorm leaves such a rank out of the statistics.
    Each rank's loss is a sum, averaged over the processes as under torch
    DDP, so the reference is one device on the global rows, its loss / world.
    (Before: the empty rank's NaN mean made every rank's statistics NaN.)"""
    rank, world = pyddp.rank(), pyddp.world()
    replicas = int(os.environ.get("SCENARIO_REPLICAS", "1"))
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    dm = pyddp.wrap(pyddp.convert_sync_batchnorm(copy.deepcopy(ref)), ["cpu"] * replicas)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5)
    for step in range(3):
        x = torch.randn(6 * world, 5, generator=g) * 2 + 1
        mine = x[:0] if step == 1 and rank == 0 else x[rank * 6 : (rank + 1) * 6]
        whole = x[6:] if step == 1 else x
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            dm(mine).square().sum().backward()
        # (an empty rank's statistics are not computed: torch's var_mean
        # warned "degrees of freedom <= 0" there)
        out.setdefault("warned", []).extend(str(w.message) for w in seen)
        (ref(whole).square().sum() / world).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["params"] = max_diff(dm.module, ref)
    out["buffers"] = max(
        (b.float() - c.float()).abs().max().item()
        for b, c in zip(dm.module.buffers(), ref.buffers())
    )
    dm.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_rank_without_rows_leaves_the_statistics_to_the_others(tmp_path, replicas):
    env = {"SCENARIO_REPLICAS": str(replicas)}
    for r in spawn(a_rank_without_rows, env=env, out=tmp_path):
        assert r["params"] <= TOL and r["buffers"] <= TOL, r
        assert not [w for w in r["warned"] if "degrees of freedom" in w], r["warned"]


def forward_on_rank_0_alone(out: dict) -> None:
    """SyncBatchNorm, hostile: rank 0 alone runs a forward in training mode
    without grad (logging) between two training steps. Its statistics
    exchange must not pair with rank 1's training forward: every rank
    raises naming each rank's exchange (gloo aborted the process on the
    sizes that differ, or the statistics mixed silently)."""
    rank = pyddp.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    dm = pyddp.wrap(pyddp.convert_sync_batchnorm(model), ["cpu"])
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    g = torch.Generator().manual_seed(4)
    try:
        for step in range(3):
            x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
            if step == 1 and rank == 0:
                with torch.no_grad():
                    dm(x)  # logging, on rank 0 only
            nn.functional.mse_loss(dm(x), y).backward()
            opt.step()
            opt.zero_grad()
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    dm.close()


@pytest.mark.multiprocess
def test_a_syncbatchnorm_forward_on_one_rank_is_named_on_every_rank(tmp_path):
    """Issue 30, item 7 (`forward_on_rank_0_alone` above):
    SyncBatchNorm's exchanges carry a header like the control exchanges."""
    # spawn fails the test on a rank's SIGABRT
    for r in spawn(forward_on_rank_0_alone, env={"PYDDP_TIMEOUT_S": "20"}, out=tmp_path):
        assert r["error"] and "do not pair across ranks" in r["error"], r
        assert "a forward without grad" in r["error"] and "a forward with grad" in r["error"]


# -------------------------------------------------------- on simulated GPUs
def on_three_simulated_gpus():
    """In a process of its own on the simulated GPUs (run_alone)."""
    from simgpu import HostReads
    from simulated import gpu_step, gpu_wrap, sim, streams

    devices = [0, 1, 2]
    torch.manual_seed(0)
    model = ConvNet()
    ref = copy.deepcopy(model)
    dm = gpu_wrap(pyddp.convert_sync_batchnorm(model), devices)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    own = {d: sim.stream(d) for d in devices}
    for x, y in batches(4):
        with streams.stream(own):
            gpu_step(F.cross_entropy(dm(x), y), opt, devices)
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_close_models(dm.module, ref)
    for rep in dm.replicas[1:]:
        for p, p0 in zip(rep.parameters(), dm.module.parameters()):
            assert torch.equal(p, p0), "replicas differ"
    # A steady step: the statistics are summed on the devices (NCCL, after
    # each replica's current stream), so the host never waits for a GPU
    # (host-blocking driver calls, counted by the simulation) nor reads a
    # device value.
    waits = sim.counter("host_sync")
    with streams.stream(own), HostReads(sim) as reads:
        F.cross_entropy(dm(x), y).backward()
    assert sim.counter("host_sync") - waits == 0
    assert not reads.reads, reads.reads
    streams.synchronize_all(devices)
    dm.close()
    try:
        gpu_wrap(pyddp.convert_sync_batchnorm(ConvNet()), [0, 0])
        raise AssertionError("replicas sharing a GPU were accepted")
    except NotImplementedError as e:
        assert "sharing a GPU" in str(e), e


@pytest.mark.simgpu
def test_syncbatchnorm_on_simulated_gpus_equals_one_device():
    # SyncBatchNorm over 3 simulated GPUs (the statistics, landing late on
    # each replica's current stream, summed by NCCL ordered after those
    # streams, which wait for the sum): equal to one device running BatchNorm
    # on the whole batch, parameters and running statistics, under the
    # caller's own streams, with no host wait in a steady step. Replicas
    # sharing a GPU are refused by name (autograd would run their backwards
    # on one thread).
    run_alone(on_three_simulated_gpus)


@pytest.mark.simgpu
@pytest.mark.parametrize("local", [1, 2])
def test_syncbatchnorm_across_processes_on_simulated_gpus(tmp_path, local):
    # synced_across_processes (equal to one device on the global batch) with
    # each rank's replicas on simulated GPUs: statistics summed over every GPU
    # of both processes by NCCL (a communicator of SyncBatchNorm's own), on
    # the devices: a steady step makes no host wait and no host read.
    env = {"SCENARIO_REPLICAS": str(local)}
    for r in spawn(synced_across_processes, env=env, simgpu=True, out=tmp_path):
        assert r["grad"] <= TOL and r["params"] <= TOL and r["buffers"] <= TOL, r
        assert r["steady_host_waits"] == 0 and r["steady_host_reads"] == [], r
