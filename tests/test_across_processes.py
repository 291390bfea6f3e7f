"""pyddp across processes on localhost (torchrun, gloo): equal to single-device
training and to torch DDP (2 and 3 processes, 1 and 2 replicas each), the
collectives, a subgroup, two models in one backward, two torchrun nodes
through the c10d rendezvous; models and settings that differ across ranks
refused at wrap, and ranks doing different work named at the next synced
backward."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import SGD, TOL, data, eval_norm, max_diff, my_rows, net, sequence_of, side_by_side
from spawn import command, environment, free_port, result, spawn, write_and_exit
from torch import nn

import pyddp

pytestmark = pytest.mark.multiprocess


def one_group(out: dict) -> None:
    """collectives, mismatch and equivalence in one group (fewer launches)."""
    collectives(out)
    mismatch(out)
    equivalence(out)


def collectives(out: dict) -> None:
    rank = pyddp.rank()
    ts = [torch.full((3,), 2.0 * rank + 1), torch.full((3,), 2.0 * rank + 2)]
    pyddp.all_reduce(ts)
    out["sum"] = ts[1].tolist()
    ts = [torch.full((3,), 2.0 * rank + 1), torch.full((3,), 2.0 * rank + 2)]
    pyddp.all_reduce(ts, op="avg")
    out["avg"] = ts[0].tolist()
    # Ranks that disagree: gloo aborted the process (shape), or rank 1
    # returned a sum while rank 0's count exchange paired with its next call.
    for name, op, shape in (("op", ["avg", "sum"], [3, 3]), ("shape", ["sum"] * 2, [3, 4])):
        try:
            pyddp.all_reduce([torch.ones(shape[rank])], op=op[rank])
            out[f"{name} mismatch"] = None
        except ValueError as e:
            out[f"{name} mismatch"] = str(e)
    ts = [torch.full((2,), rank + 1.0)]
    pyddp.all_reduce(ts, op="avg")  # the group stays usable
    out["after mismatch"] = ts[0].tolist()


def mismatch(out: dict) -> None:
    model = nn.Linear(4, 3 if pyddp.rank() == 0 else 5)
    try:
        pyddp.wrap(model, ["cpu"])
    except ValueError as e:
        out["error"] = str(e)
    # A layer frozen on one rank only: other buckets on each rank, which used
    # to end in gloo's abort at the first backward (size mismatch).
    frozen = nn.Linear(4, 3)
    frozen.bias.requires_grad_(pyddp.rank() != 0)
    try:
        pyddp.wrap(frozen, ["cpu"])
        out["frozen on one rank"] = None
    except ValueError as e:
        out["frozen on one rank"] = str(e)
    # A conv weight in channels_last on one rank only: its gradient's bucket
    # view is laid out as the weight, so the ranks would sum elements of
    # other positions (a probe's channels_last finding).
    conv = nn.Conv2d(3, 4, 3)
    if pyddp.rank() == 0:
        conv.to(memory_format=torch.channels_last)
    try:
        pyddp.wrap(conv, ["cpu"])
        out["layout on one rank"] = None
    except ValueError as e:
        out["layout on one rank"] = str(e)
    # SyncBatchNorm on one rank only (same parameters and buffers): both
    # ranks waited the whole timeout, the errors naming a stats group.
    syncbn = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    if pyddp.rank() == 0:
        syncbn = pyddp.convert_sync_batchnorm(syncbn)
    try:
        pyddp.wrap(syncbn, ["cpu"])
        out["syncbn on one rank"] = None
    except ValueError as e:
        out["syncbn on one rank"] = str(e)
    # Settings that must agree: each used to end in an abort (bucket_cap_mb:
    # std::terminate), a timeout (rebuild_buckets) or a failed broadcast.
    out["settings"] = {}
    for name, here, there in (
        ("bucket_cap_mb", 25.0, 10.0),
        ("rebuild_buckets", True, False),
        ("broadcast_buffers", True, False),
        ("find_unused_parameters", True, False),
        ("static_graph", True, False),
        ("taper_buckets", True, False),
    ):
        try:
            pyddp.wrap(nn.Linear(4, 3), ["cpu"], **{name: here if pyddp.rank() == 0 else there})
            out["settings"][name] = None
        except ValueError as e:
            out["settings"][name] = str(e)


def equivalence(out: dict) -> None:
    rank, world = pyddp.rank(), pyddp.world()
    local = int(os.environ.get("LOCAL_REPLICAS", "1"))
    batches = data(4, 12)
    ref = eval_norm(net())  # single-device training on the global batches
    opt = torch.optim.SGD(ref.parameters(), **SGD)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()

    for cap in (0.0, 25.0):  # per-parameter and bucketed
        model = eval_norm(net(seed=rank))  # different init per rank: the broadcast fixes it
        with pyddp.wrap(model, ["cpu"] * local, bucket_cap_mb=cap) as dm:
            dm.module.norm.eval()
            for m in dm.replicas:
                m.norm.eval()
            dopt = dm.optimizer(torch.optim.SGD, **SGD)
            for x, y in batches:
                rows = my_rows(len(x), rank, world)
                dopt.zero_grad()
                loss = dm.loss(nn.functional.mse_loss, x[rows], y[rows])
                loss.backward()
                dopt.step()
            out[f"wrap_loss_cap{cap:g}"] = max_diff(dm.module, ref)
            grads = {n: p.grad is None for n, p in dm.module.named_parameters()}
            out[f"never_none_cap{cap:g}"] = grads["never.weight"]
            out[f"stats_cap{cap:g}"] = dm.stats()["mean"].get("agree_s", -1.0)

    # Uneven global batch (13 rows over the ranks): dmodel.loss weighs by rows.
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(13, 6, generator=g), torch.randn(13, 3, generator=g)
    ref2 = eval_norm(net())
    nn.functional.mse_loss(ref2(x), y).backward()
    model = eval_norm(net())
    with pyddp.wrap(model, ["cpu"] * local) as dm:
        ranks = dm.ranks  # (pyddp.Ranks, what the README's table names)
        out["ranks"] = [ranks.rank, ranks.world, ranks.replicas_per_rank, ranks.spans_processes]
        out["global_ranks"] = ranks.global_ranks
        for m in dm.replicas:
            m.norm.eval()
        rows = my_rows(13, rank, world)
        dm.loss(nn.functional.mse_loss, x[rows], y[rows]).backward()
        out["uneven_grad"] = max(
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(dm.module.parameters(), ref2.parameters())
            if q.grad is not None
        )
        out["uneven_global_loss"] = abs(
            dm.last_global_loss - nn.functional.mse_loss(ref2(x), y).item()
        )
        # A "sum" step has no global loss: None, not the last mean step's.
        dm.zero_grad()
        loss_sum = partial(nn.functional.mse_loss, reduction="sum")
        dm.loss(loss_sum, x[rows], y[rows], reduction="sum").backward()
        out["global_loss_after_sum"] = dm.last_global_loss

    # dmodel.loss over steps whose global batch changes size (13, 13, 7, 13
    # rows, then a window of two micro-batches of 13 and 5 under no_sync):
    # the rows are exchanged at the first step, then assumed, and the
    # agreement after the buckets corrects the weighting when they change.
    # Equal to one device on the whole batches, step by step.
    g = torch.Generator().manual_seed(6)
    steps = [[13], [13], [7], [13], [13, 5], [13]]
    windows = [[(torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)) for n in st]
               for st in steps]  # fmt: skip
    ref4 = eval_norm(net())
    ref4_opt = torch.optim.SGD(ref4.parameters(), **SGD)
    model = eval_norm(net())
    with pyddp.wrap(model, ["cpu"] * local) as dm:
        for m in dm.replicas:
            m.norm.eval()
        dopt = dm.optimizer(torch.optim.SGD, **SGD)
        worst, worst_loss, exchanges = 0.0, 0.0, []
        for window in windows:
            ref4_opt.zero_grad()
            dopt.zero_grad()
            for k, (x, y) in enumerate(window):
                nn.functional.mse_loss(ref4(x), y).backward()
                rows = my_rows(len(x), rank, world)
                before = sequence_of(dm)
                with dm.no_sync() if k < len(window) - 1 else _null():
                    dm.loss(nn.functional.mse_loss, x[rows], y[rows]).backward()
                exchanges.append(sequence_of(dm) - before)
            true_loss = nn.functional.mse_loss(ref4(window[-1][0]), window[-1][1]).item()
            worst_loss = max(worst_loss, abs(dm.last_global_loss - true_loss))
            worst = max(
                worst,
                max((p.grad - q.grad).abs().max().item()
                    for p, q in zip(dm.module.parameters(), ref4.parameters())
                    if q.grad is not None),
            )  # fmt: skip
            ref4_opt.step()
            dopt.step()
        out["weighing_grad"] = worst
        out["weighing_loss"] = worst_loss
        out["weighing_params"] = max_diff(dm.module, ref4)
        # Control exchanges per micro-batch: the first step exchanges rows;
        # steady steps none; a step after rows changed exchanges again; the
        # no_sync window exchanges each of its micro-batches.
        out["weighing_exchanges"] = exchanges

    # Two synced backwards before one step (no no_sync()), the second with
    # other rows (13 then 7), then gradients carried over a step without
    # zero_grad (7 then 13): the buckets hold the first reduction, which a
    # rescale for the rows at the end of the second must not touch (it did:
    # 1.25-2x one device's gradient).
    g = torch.Generator().manual_seed(7)
    ref5, model = eval_norm(net()), eval_norm(net())
    ref5_opt = torch.optim.SGD(ref5.parameters(), **SGD)
    worst = 0.0
    with pyddp.wrap(model, ["cpu"] * local) as dm:
        for m in dm.replicas:
            m.norm.eval()
        dopt = dm.optimizer(torch.optim.SGD, **SGD)
        for window, zero in (([13, 7], True), ([7, 13], False), ([13, 13], True)):
            if zero:
                ref5_opt.zero_grad()
                dopt.zero_grad()
            for n in window:
                x, y = torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)
                nn.functional.mse_loss(ref5(x), y).backward()
                rows = my_rows(n, rank, world)
                dm.loss(nn.functional.mse_loss, x[rows], y[rows]).backward()
            worst = max(worst, max((p.grad - q.grad).abs().max().item()
                                   for p, q in zip(dm.module.parameters(), ref5.parameters())
                                   if q.grad is not None))  # fmt: skip
            ref5_opt.step()
            dopt.step()
        out["twice_grad"], out["twice_params"] = worst, max_diff(dm.module, ref5)

    # Low-level GradSync with per-replica losses, no_sync accumulation, and a
    # parameter used on rank 0 only.
    model = eval_norm(net())
    reps = [model] + [eval_norm(copy.deepcopy(model)) for _ in range(local - 1)]
    with pyddp.GradSync(reps, bucket_cap_mb=0.0005) as sync:
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(9))
        x[:, 0] = 0.0
        x[0, 0] = 5.0  # row 0 uses `rare`: only the rank holding it
        y = torch.zeros(8, 3)
        for accum in range(2):
            ctx = sync.no_sync() if accum == 0 else _null()
            with ctx:
                rows = my_rows(8, rank, world)
                xs, ys = x[rows], y[rows]
                parts = [my_rows(len(xs), r, local) for r in range(local)]
                for r, m in enumerate(reps):
                    loss = nn.functional.mse_loss(m(xs[parts[r]]), ys[parts[r]], reduction="sum")
                    (loss / (8 * 3)).backward()
                if accum == 1:
                    sync.finish()
        ref3 = eval_norm(net())
        for _ in range(2):
            (nn.functional.mse_loss(ref3(x), y, reduction="sum") / (8 * 3)).backward()
        # Across processes gradients average: each rank's loss above is a sum
        # over its rows / global rows, so the average is 1/world of the sum.
        out["gradsync_rare"] = max(
            (p.grad * world - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), ref3.parameters())
            if q.grad is not None
        )
        out["gradsync_rare_has_grad"] = model.rare.weight.grad is not None
        out["gradsync_never_none"] = model.never.weight.grad is None
        out["replicas_equal"] = all(
            torch.equal(p.grad, q.grad)
            for m in reps[1:]
            for p, q in zip(model.parameters(), m.parameters())
            if p.grad is not None
        )

    # Buffers: rank 0's BatchNorm statistics reach every rank before each
    # training forward, as in torch DDP (each rank's own batch moved them).
    model = net(seed=rank)
    seen = []
    model.norm.register_forward_pre_hook(lambda m, a: seen.append(m.running_mean.clone()))
    with pyddp.wrap(model, ["cpu"] * local) as dm:
        for _ in range(2):
            dm(torch.randn(4, 6) + rank).sum().backward()
    gathered = [torch.zeros(16) for _ in range(world)]
    dist.all_gather(gathered, seen[-1])  # what replica 0 saw entering forward 2
    out["buffers_equal_across_ranks"] = all(torch.equal(g, gathered[0]) for g in gathered)
    out["buffers_moved"] = bool(seen[-1].abs().sum() > 0)

    # torch DDP (gloo) on the same split, gathered-output style loss.
    ddp_model = eval_norm(net())
    ddp = nn.parallel.DistributedDataParallel(
        ddp_model, broadcast_buffers=False, find_unused_parameters=True
    )
    dopt = torch.optim.SGD(ddp.parameters(), **SGD)
    model = eval_norm(net())
    with pyddp.wrap(model, ["cpu"] * local) as dm:
        for m in dm.replicas:
            m.norm.eval()
        side_by_side(ddp, dopt, dm, batches)
        out["vs_ddp"] = max_diff(dm.module, ddp_model)

    # static_graph, a layer shared by three reentrant checkpointed segments
    # (its gradient arrives three times per backward): against torch DDP
    # with static_graph=True on the same rows.
    from conftest import SharedAcrossDepth

    torch.manual_seed(0)
    model = SharedAcrossDepth(True)
    ddp_model = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(ddp_model, static_graph=True)
    dopt = torch.optim.SGD(ddp.parameters(), **SGD)
    g = torch.Generator().manual_seed(2)
    with pyddp.wrap(model, ["cpu"] * local, static_graph=True) as dm:
        popt = dm.optimizer(torch.optim.SGD, **SGD)
        for _ in range(3):
            x, y = torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g)
            rows = my_rows(len(x), rank, world)
            dopt.zero_grad()
            popt.zero_grad()
            nn.functional.cross_entropy(ddp(x[rows]), y[rows]).backward()
            dopt.step()
            dm.loss(nn.functional.cross_entropy, x[rows], y[rows]).backward()
            popt.step()
        out["static_graph_vs_ddp"] = max_diff(dm.module, ddp_model)
        out["static_graph_counts"] = dm._reducer._engine.expected_counts[:6]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.fixture(scope="module")
def basics(tmp_path_factory):
    """One 2-process group runs all_reduce, the model mismatch check and the
    equivalence checks (each torchrun launch costs seconds)."""
    out = tmp_path_factory.mktemp("basics")
    return spawn(one_group, env={"LOCAL_REPLICAS": "1"}, out=out)


@pytest.mark.parametrize("nproc,local", [(2, 1), (2, 2), (3, 1)])
def test_processes_equal_single_device_and_torch_ddp(tmp_path, basics, nproc, local):
    if (nproc, local) == (2, 1):
        got = basics
    else:
        got = spawn(equivalence, nproc, env={"LOCAL_REPLICAS": str(local)}, out=tmp_path)
    for i, r in enumerate(got):
        assert r["world"] == nproc
        assert r["ranks"] == [i, nproc, [local] * nproc, True], r["ranks"]
        assert r["global_ranks"] == list(range(nproc)), r["global_ranks"]
        for cap in ("0", "25"):  # per-parameter and bucketed
            assert r[f"wrap_loss_cap{cap}"] <= TOL
            assert r[f"never_none_cap{cap}"], "unused everywhere must stay None"
            assert r[f"stats_cap{cap}"] >= 0.0  # the agreement's cost is measured
        assert r["uneven_grad"] <= TOL, "dmodel.loss must weigh an uneven global batch"
        assert r["uneven_global_loss"] <= TOL
        assert r["global_loss_after_sum"] is None
        # Global batches of changing size, rows assumed and corrected after
        # the buckets: equal to one device; exchanges only where needed.
        assert r["weighing_grad"] <= TOL and r["weighing_params"] <= TOL, r
        assert r["weighing_loss"] <= TOL, r
        # Two synced backwards of other rows before a step, and a carry-over.
        assert r["twice_grad"] <= TOL and r["twice_params"] <= TOL, r
        # Control exchanges (each with its header) per micro-batch: the rows
        # exchange at the first step, after rows changed (step 4) and in the
        # no_sync() window (both micro-batches), + the bucket plan after the
        # first step, + the shard modes before the first synced backward
        # (once per dmodel.optimizer). The buffer broadcast after each synced
        # backward (BatchNorm) has no header: the agreement was its header.
        # Steady steps: none.
        assert r["weighing_exchanges"] == [3, 0, 0, 1, 1, 1, 0], r["weighing_exchanges"]
        assert r["gradsync_rare"] <= TOL, "used on one rank only: reduced everywhere"
        assert r["gradsync_rare_has_grad"] and r["gradsync_never_none"]
        assert r["replicas_equal"]
        assert r["buffers_equal_across_ranks"] and r["buffers_moved"]
        assert r["vs_ddp"] <= TOL
        assert r["static_graph_vs_ddp"] <= TOL
        assert r["static_graph_counts"] == [1, 1, 3, 3, 1, 1]


def test_different_models_are_refused_at_wrap_naming_rank_and_parameter(basics):
    for r in basics:
        assert "rank 1" in r["error"] and "weight" in r["error"], r["error"]
        assert "(3, 4)" in r["error"] and "(5, 4)" in r["error"], r["error"]


def test_syncbatchnorm_on_one_rank_only_is_refused_at_wrap(basics):
    for r in basics:
        error = r["syncbn on one rank"]
        assert error is not None and "rank 1 has module '1' of class BatchNorm1d" in error, error
        assert "rank 0 has module '1' of class SyncBatchNorm" in error, error


def test_a_layer_frozen_on_one_rank_only_is_refused_at_wrap(basics):
    for r in basics:
        error = r["frozen on one rank"]
        assert error is not None and "rank 1 has parameter bias (3,) float32 trained" in error
        assert "rank 0 has parameter bias (3,) float32 frozen" in error, error


def test_a_memory_format_on_one_rank_only_is_refused_at_wrap(basics):
    for r in basics:
        error = r["layout on one rank"]
        assert error is not None and "strides" in error and "weight" in error, error


def test_settings_that_differ_across_ranks_are_refused_at_wrap(basics):
    for r in basics:
        for name, error in r["settings"].items():
            assert error is not None, name
            assert f"rank 1 has setting {name}=" in error and "rank 0 has setting" in error, error


def test_all_reduce_across_processes(basics):
    for r in basics:
        assert (
            r["sum"] == [1.0 + 2.0 + 3.0 + 4.0] * 3
        )  # 2 tensors per rank, rank r fills 2r+1, 2r+2
        assert r["avg"] == [2.5] * 3
        assert "rank 0: op avg, 3 elements, float32; rank 1: op sum" in r["op mismatch"]
        assert "rank 1: op sum, 4 elements, float32" in r["shape mismatch"]
        assert r["after mismatch"] == [1.5] * 2


def test_two_nodes_on_localhost_through_the_c10d_rendezvous(tmp_path):
    port = free_port()
    common = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=pyddp-test",
        # the rendezvous is what is tested here: a light scenario
        *command(collectives, tmp_path)[1:],
    ]
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = []
    for log in logs:  # files, not pipes: a full pipe would stall a node mid-collective
        with open(log, "w") as f:
            nodes.append(
                subprocess.Popen(
                    common, env=environment(), cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT
                )
            )
    codes = [n.wait(timeout=240) for n in nodes]
    assert codes == [0, 0], "".join(log.read_text()[-2000:] for log in logs)
    for r in [result(collectives, tmp_path, rank) for rank in range(2)]:
        assert r["sum"] == [10.0] * 3 and r["avg"] == [2.5] * 3


def subgroup(out: dict) -> None:
    """3 processes: ranks 0 and 1 train on a subgroup, then every rank trains
    over all processes (pyddp's own groups are named the same on every member,
    whatever groups each rank made before); rank 2 cannot wrap on the subgroup."""
    rank, world = pyddp.rank(), pyddp.world()
    sub = dist.new_group([0, 1])
    x, y = torch.randn(12, 6, generator=torch.Generator().manual_seed(2)), torch.zeros(12, 3)

    def trained(ranks):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        ref = copy.deepcopy(model)
        group = sub if ranks == [0, 1] else None
        with pyddp.wrap(model, ["cpu"], group=group) as dm:
            rows = my_rows(12, ranks.index(rank), len(ranks))
            dm.loss(nn.functional.mse_loss, x[rows], y[rows]).backward()
        nn.functional.mse_loss(ref(x), y).backward()
        return max(
            (p.grad - q.grad).abs().max().item()
            for p, q in zip(model.parameters(), ref.parameters())
        )

    if rank < 2:
        out["sub"] = trained([0, 1])
    else:
        try:
            pyddp.wrap(nn.Linear(2, 2), ["cpu"], group=sub)
        except ValueError as e:
            out["not_member"] = str(e)
    out["all"] = trained(list(range(world)))


def test_a_subgroup_then_every_process(tmp_path):
    got = spawn(subgroup, 3, env={"PYDDP_TIMEOUT_S": "20"}, out=tmp_path)
    assert got[0]["sub"] <= TOL and got[1]["sub"] <= TOL
    assert "not in the group" in got[2]["not_member"]
    assert all(r["all"] <= TOL for r in got)


def two_models(out: dict) -> None:
    """Two wrapped models in one backward: each GradSync reduces on a group of
    its own, so the two launcher threads cannot pair one model's bucket with
    the other's on another rank (they did when the group was shared)."""
    rank, world = pyddp.rank(), pyddp.world()
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    b = copy.deepcopy(a)
    da, db = pyddp.wrap(a, ["cpu"], bucket_cap_mb=0), pyddp.wrap(b, ["cpu"], bucket_cap_mb=0)
    ref_a = nn.parallel.DistributedDataParallel(copy.deepcopy(a))
    ref_b = nn.parallel.DistributedDataParallel(copy.deepcopy(b))
    worst = 0.0
    for step in range(60):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * world + rank))
        (da(x).pow(2).mean() + db(x * 2).pow(2).mean()).backward()
        (ref_a(x).pow(2).mean() + ref_b(x * 2).pow(2).mean()).backward()
        for m, r in ((a, ref_a.module), (b, ref_b.module)):
            for p, q in zip(m.parameters(), r.parameters()):
                worst = max(worst, (p.grad - q.grad).abs().max().item())
                p.grad = q.grad = None
    out["worst"] = worst


def test_two_models_in_one_backward_do_not_mix_their_buckets(tmp_path):
    for r in spawn(two_models, out=tmp_path):
        assert r["worst"] <= TOL


def gradient_penalty(out: dict) -> None:
    """A WGAN-GP step, as GAN code writes it: the critic's gradient with
    respect to its inputs (autograd.grad, create_graph=True), its norm's
    penalty added to the loss, one backward; then the generator's step
    through the critic. Both models wrapped, one replica per process; the
    same under torch DDP on the same rows."""
    rank = pyddp.rank()

    def models():
        torch.manual_seed(0)
        gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))
        critic = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        return gen, critic

    def train(gen, critic, dgen, dcritic):
        g_opt = torch.optim.Adam(gen.parameters(), lr=1e-2, betas=(0.5, 0.9))
        c_opt = torch.optim.Adam(critic.parameters(), lr=1e-2, betas=(0.5, 0.9))
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(4):
            real, z = torch.randn(6, 6, generator=g), torch.randn(6, 4, generator=g)
            fake = dgen(z).detach()
            eps = torch.rand(6, 1, generator=g)
            mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
            (grad,) = torch.autograd.grad(dcritic(mixed).sum(), mixed, create_graph=True)
            penalty = ((grad.norm(2, dim=1) - 1) ** 2).mean()
            c_opt.zero_grad()
            (dcritic(fake).mean() - dcritic(real).mean() + 10 * penalty).backward()
            c_opt.step()
            g_opt.zero_grad()
            (-dcritic(dgen(z)).mean()).backward()
            g_opt.step()

    gen, critic = models()
    train(gen, critic, pyddp.wrap(gen), pyddp.wrap(critic))
    ref_gen, ref_critic = models()
    ddp = nn.parallel.DistributedDataParallel
    train(ref_gen, ref_critic, ddp(ref_gen), ddp(ref_critic))
    out["gen"], out["critic"] = max_diff(gen, ref_gen), max_diff(critic, ref_critic)


def test_a_gradient_penalty_trains_as_under_torch_ddp(tmp_path):
    # Untested before (docs said only that CPU replicas in one process refuse
    # create_graph=True): torch DDP's WGAN-GP pattern, one replica per process.
    for r in spawn(gradient_penalty, out=tmp_path):
        assert r["gen"] <= TOL and r["critic"] <= TOL, r


def _against_ddp(build, optimizer, wrapped=lambda w: w):
    """The same 3 steps on each rank's own rows under pyddp.wrap and under
    torch DDP (`build()` the model, seeded alike; `wrapped(wrapper)` what the
    loop calls): {"pyddp": model, "ddp": model}."""
    rank = pyddp.rank()
    runs = {}
    for name, wrapper in (("pyddp", pyddp.wrap), ("ddp", nn.parallel.DistributedDataParallel)):
        torch.manual_seed(0)
        model = build()
        call = wrapped(wrapper(model))
        opt = optimizer(model.parameters())
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(3):
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(call(x), y).backward()
            opt.step()
        runs[name] = model
    return runs


def compiled_wrapper(out: dict) -> None:
    """torch.compile(pyddp.wrap(model)) against torch.compile(DDP(model)), the
    way torch's docs compile DDP; aot_eager: AOTAutograd's compiled backward,
    whose gradients the hooks must see, without inductor's code generation."""
    runs = _against_ddp(
        lambda: nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 3)),
        lambda params: torch.optim.AdamW(params, lr=1e-2),
        lambda w: torch.compile(w, backend="aot_eager"),
    )
    out["diff"] = max_diff(runs["pyddp"], runs["ddp"])


def test_torch_compile_of_the_wrapped_model_trains_as_torch_compile_of_ddp(tmp_path):
    # Broke before inside pyddp's forward (dynamo: RecursionError in the
    # agreement's packing); found by a probe through Lightning Fabric.
    for r in spawn(compiled_wrapper, out=tmp_path):
        assert r["diff"] <= TOL, r


def pruned(out: dict) -> None:
    """A model pruned with torch.nn.utils.prune (a mask applied by a forward
    pre-hook), one replica per process, against torch DDP on the same rows:
    the remedy pyddp names where replicas in one process cannot copy it."""
    from torch.nn.utils import prune

    def build() -> nn.Module:
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        prune.l1_unstructured(model[0], "weight", amount=0.5)
        return model

    runs = _against_ddp(build, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    out["diff"] = max_diff(runs["pyddp"], runs["ddp"])
    first = runs["pyddp"][0]
    out["masked_zero"] = bool((first.weight[first.weight_mask == 0] == 0).all())


def test_a_pruned_model_trains_one_replica_per_process_as_torch_ddp(tmp_path):
    for r in spawn(pruned, out=tmp_path):
        assert r["diff"] <= TOL and r["masked_zero"], r


def diverge(out: dict) -> None:
    """Ranks that do different work: each case used to diverge silently (torch
    DDP misses them too). Each must raise on every rank at the next synced
    backward, naming the field and both ranks' values."""
    rank = pyddp.rank()
    x, y = torch.randn(8, 6), torch.randn(8, 3)

    def step(dm, opt, extra=None) -> None:
        nn.functional.mse_loss(dm(x), y).backward()
        opt.step()
        if extra is not None:
            extra()
        opt.zero_grad()

    def case(name: str, odd, steps: int = 1) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        dm = pyddp.wrap(model, ["cpu"])
        opt = dm.optimizer(torch.optim.SGD, lr=0.1)
        try:
            step(dm, opt, extra=(lambda: odd(dm, opt, model)) if rank == 1 else None)
            for _ in range(steps):  # the checksum is taken every CHECKSUM_EVERY
                step(dm, opt)
            out[name] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = str(e)

    def extra_no_sync(dm, opt, model) -> None:
        with dm.no_sync():
            nn.functional.mse_loss(dm(x), y).backward()

    def edit(dm, opt, model) -> None:
        model[0].weight.data.add_(1.0)  # through .data: no version bump, the checksum sees it

    case("extra step", lambda dm, opt, model: opt.step())  # gradients still there
    case("extra no_sync", extra_no_sync)
    case("eval", lambda dm, opt, model: model.eval())
    case("edited parameters", edit, steps=pyddp._link.record.CHECKSUM_EVERY)

    # One rank in eval(): rank 0 broadcasts buffers after its synced
    # training backward and rank 1 does not (this used to fail as "broadcast
    # of rank 0's buffers failed", or abort in gloo on the sizes); or only
    # its BatchNorm in eval().
    # The whole model last: that failure leaves exchanges pending (the group
    # cannot be used after it, as the message says).
    for name, switch in (
        ("batchnorm eval", lambda m: m[1].eval()),
        ("model eval", lambda m: m.eval()),
    ):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
        dm = pyddp.wrap(model, ["cpu"])
        if rank == 1:
            switch(model)
        try:
            nn.functional.mse_loss(dm(x), y).backward()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - reported to the test
            out[name] = str(e)
    write_and_exit(out)


def test_ranks_doing_different_work_are_named_at_the_next_synced_backward(tmp_path):
    expect = {
        "extra step": "optimizer steps: rank 0 1, rank 1 2",
        "extra no_sync": "micro-batches since the last synced backward: rank 0 1, rank 1 2",
        "eval": "modules in training mode: rank 0 4, rank 1 0",
        "edited parameters": "parameter checksum: rank 0",
    }
    for r in spawn(diverge, out=tmp_path):
        for case, field in expect.items():
            assert r[case] is not None, case
            assert "did different work" in r[case] and field in r[case], (case, r[case])
        error = r["batchnorm eval"]
        assert error and "modules in training mode: rank 0 4, rank 1 3" in error, error
        # The whole model in eval() on one rank: the agreement names it (rank
        # 0's buffer broadcast, which rank 1 in eval would not make, comes
        # after the backward, torch DDP's rule; it used to meet rank 1's
        # reductions first and be named as two waits at different exchanges).
        error = r["model eval"]
        assert error and "modules in training mode: rank 0 4, rank 1 0" in error, error


def replicas_differ_per_rank(out: dict) -> None:
    """Rank r wraps 1 + r CPU replicas and steps with dmodel.optimizer:
    torch's SGD on rank 0, pyddp's replicated subclass of it on rank 1."""
    rank = pyddp.rank()
    ref = eval_norm(net())
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
    dm = pyddp.wrap(eval_norm(net()), ["cpu"] * (1 + rank))
    opt = dm.optimizer(torch.optim.SGD, **SGD)
    for x, y in data(4, 12):
        nn.functional.mse_loss(dm(x[my_rows(12, rank, 2)]), y[my_rows(12, rank, 2)]).backward()
        opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    out["diff"] = max_diff(dm.module, ref)
    write_and_exit(out)


def test_ranks_with_one_and_two_replicas_step_with_dmodel_optimizer(tmp_path):
    # Found by a probe: the ranks' optimizer settings were compared by the
    # optimizer's class, torch's SGD on one rank and pyddp's ReplicatedSGD
    # on the other: both failed at the second synced backward, blaming
    # "optimizer settings". The class compared is now the one the user chose.
    for r in spawn(replicas_differ_per_rank, env={"PYDDP_TIMEOUT_S": "20"}, out=tmp_path):
        assert r["diff"] < TOL, r


def an_empty_batch_on_one_rank(out: dict) -> None:
    """Rank 0 gets no rows at step 1 (a rank's tail of a dataset split by
    rank), 2 replicas per process. The gathered path averages over the
    processes as torch DDP (reference: one device on the global rows, its
    summed loss / world); dmodel.loss's sum is the global batch's sum
    (reference: one device, the summed loss). Before, the empty rank
    raised "the batch is empty" and the other lost its process group."""
    rank, world = pyddp.rank(), pyddp.world()
    path = os.environ["SCENARIO_PATH"]
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    dm = pyddp.wrap(copy.deepcopy(ref), ["cpu"] * 2)
    opt = dm.optimizer(torch.optim.SGD, lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)

    def summed(o, t):
        return (o - t).square().sum()

    for step in range(3):
        x, y = torch.randn(4 * world, 6, generator=g), torch.randn(4 * world, 2, generator=g)
        empty = step == 1 and rank == 0
        mine = slice(0, 0) if empty else slice(rank * 4, rank * 4 + 4)
        rows = slice(4, None) if step == 1 else slice(None)  # every rank's rows this step
        if path == "loss":
            dm.loss(summed, x[mine], y[mine], reduction="sum").backward()
            summed(ref(x[rows]), y[rows]).backward()
        elif path == "loss, mean":
            dm.loss(F.mse_loss, x[mine], y[mine]).backward()
            want = F.mse_loss(ref(x[rows]), y[rows])
            want.backward()
            # the global batch's loss, which the empty rank's NaN made NaN
            out.setdefault("global_loss", []).append(abs(dm.last_global_loss - want.item()))
        else:
            summed(dm(x[mine]), y[mine]).backward()
            (summed(ref(x[rows]), y[rows]) / world).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    out["params"] = max_diff(dm.module, ref)
    dm.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("path", ["gather", "loss", "loss, mean"])
def test_an_empty_batch_on_one_rank_trains_on_as_torch_ddp(tmp_path, path):
    for r in spawn(an_empty_batch_on_one_rank, env={"SCENARIO_PATH": path}, out=tmp_path):
        assert r["params"] <= TOL and all(d <= 1e-6 for d in r.get("global_loss", [])), r
