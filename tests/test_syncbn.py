"""SyncBatchNorm in one process: a converted model wrapped over N CPU
replicas equals one device running BatchNorm on the whole batch (losses,
gradients, running statistics), through both forward paths and with
accumulation; the layers are torch's again outside pyddp and after close;
a failing replica or a replica that skips a layer is an error, not a hang.
(Across processes: tests/test_multiprocess.py, scenario syncbn.)

Tolerance: as tests/test_equivalence.py (1e-6 absolute, 1e-5 relative):
per-channel sums are taken per shard and summed in float64, which changes
the float32 statistics by an ulp or so; measured max |difference| after 6
steps: ~2e-7."""

import copy

import pytest
import torch
import torch.nn.functional as F
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
