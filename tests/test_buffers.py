"""Buffers across processes: at the forward after a training step every
replica of every rank holds rank 0's buffers bit for bit, whatever their
dtype (complex64, int64 above 2**53, bool, float16 with a signed zero and a
subnormal), over gloo (CPU) and over NCCL on simulated GPUs; until then each
rank keeps its own, as under torch DDP. (In one process the replicas follow
replica 0's: tests/test_replicas_follow.py.)"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import List

import pytest
import torch
from ranks import maybe_simulated_gpus, wrap_on
from spawn import spawn
from torch import nn

import pyddp


class _EveryDtype(nn.Module):
    """Buffers of the types models register beside float32: rotary
    position factors as complex64 (torchtitan's freqs_cis), int64 counters
    above 2**53, bool masks, float16 with a signed zero and a subnormal."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)
        for name, value in self.values(0).items():
            self.register_buffer(name, value)

    @staticmethod
    def values(rank: int) -> dict:
        tiny = [-0.0 if rank == 0 else 0.0, 6e-8 * (rank + 1), 1.0]
        return {
            "freqs_cis": torch.polar(torch.ones(3), torch.arange(3.0) + rank),
            "big": torch.tensor([2**53 + 1 + rank, -(2**62) + 3], dtype=torch.int64),
            "mask": torch.tensor([True, rank % 2 == 1, False]),
            "tiny": torch.tensor(tiny, dtype=torch.float16),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.freqs_cis.real[1]


def _bits(t: torch.Tensor) -> List[int]:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).tolist()


def buffers_every_dtype(out: dict) -> None:
    """At the forward after a training step every replica of every rank
    holds rank 0's buffers bit for bit, whatever their dtype; until then
    each rank its own (SCENARIO_REPLICAS replicas each; on simulated GPUs
    with spawn(..., simgpu=True))."""
    replicas = int(os.environ.get("SCENARIO_REPLICAS", "1"))
    gpus, settle = maybe_simulated_gpus(replicas)
    rank = pyddp.rank()
    want = [_bits(b) for b in _EveryDtype().buffers()]
    own = [_bits(b) for b in _EveryDtype.values(rank).values()]
    dm = wrap_on(_EveryDtype(), replicas, gpus)
    with torch.no_grad():  # each rank's own values now (wrap gave every rank rank 0's)
        for m in dm.replicas:
            for name, value in _EveryDtype.values(rank).items():
                getattr(m, name).copy_(value)
    settle()
    out["before"] = [[_bits(b) for b in m.buffers()] == want for m in dm.replicas]
    dm(torch.ones(2, 4)).sum().backward()
    settle()
    out["own_after_step"] = [_bits(b) for b in dm.module.buffers()] == own
    with torch.no_grad():
        dm(torch.ones(2, 4))
    settle()
    out["after"] = [[_bits(b) for b in m.buffers()] == want for m in dm.replicas]
    dm.close()
    if gpus:
        out["violations"] = gpus[1].sim.violations()


@pytest.mark.multiprocess
@pytest.mark.parametrize("replicas", [1, 2])
def test_buffers_of_every_dtype_are_rank_zeros_bit_for_bit(tmp_path, replicas):
    # complex64 (rotary freqs_cis), int64 above 2**53, bool, float16 with a
    # signed zero and a subnormal: every replica of every rank ends up with
    # rank 0's at the forward after a training step (before it, rank 1's
    # differ; right after the step each rank still holds its own, as DDP).
    env = {"SCENARIO_REPLICAS": str(replicas)}
    r0, r1 = spawn(buffers_every_dtype, env=env, out=tmp_path)
    assert r0["before"] == [True] * replicas and r1["before"] == [False] * replicas
    assert r0["own_after_step"] and r1["own_after_step"], (r0, r1)
    assert r0["after"] == r1["after"] == [True] * replicas, (r0, r1)


@pytest.mark.simgpu
@pytest.mark.parametrize("local", [1, 2])
def test_buffers_of_every_dtype_through_nccl_bit_for_bit(tmp_path, local):
    # The device buffer broadcast (2 processes x `local` GPUs): complex64,
    # int64 above 2**53, bool and float16 buffers arrive as rank 0's, bit for
    # bit, on every GPU; every part it sums lies on its own GPU.
    env = {"SCENARIO_REPLICAS": str(local)}
    r0, r1 = spawn(buffers_every_dtype, env=env, simgpu=True, out=tmp_path)
    assert r1["before"] == [False] * local
    assert r0["own_after_step"] and r1["own_after_step"], (r0, r1)
    assert r0["after"] == r1["after"] == [True] * local, (r0, r1)
    assert not r0["violations"] and not r1["violations"], (r0["violations"], r1["violations"])


def batchnorm_as_ddp(out: dict) -> None:
    """BatchNorm statistics on each rank against torch DDP's on the same
    rows: after every step (each rank its own, DDP sends rank 0's before
    the next forward), through the unwrapped module after the last step (how
    the transformers Trainer and Accelerate evaluate), at a forward through
    the wrapper, and after a checkpoint loaded on every rank between a step
    and the next forward (the loaded values stay)."""
    import copy

    rank = pyddp.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    saved = copy.deepcopy(model.state_dict())
    dm, ddp = pyddp.wrap(model), nn.parallel.DistributedDataParallel(ref)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref)]
    g = torch.Generator().manual_seed(1 + rank)
    worst = 0.0

    def buffers_apart() -> float:
        return max((a.double() - b.double()).abs().max().item()
                   for a, b in zip(model.buffers(), ref.buffers()))  # fmt: skip

    def step(x: torch.Tensor, zero: bool = False) -> None:  # each engine's step on x
        for wrapped, opt in zip((dm, ddp), opts):
            if zero:
                opt.zero_grad()
            wrapped(x).pow(2).mean().backward()
            opt.step()

    for _ in range(3):
        step(torch.randn(6, 4, generator=g) * (1 + rank), zero=True)
        worst = max(worst, buffers_apart())
    out["steps"] = worst
    own = [b.clone() for b in model.buffers()]
    others = [torch.zeros_like(own[1]) for _ in range(pyddp.world())]
    torch.distributed.all_gather(others, own[1])
    out["ranks_differ"] = not torch.equal(others[0], others[1])
    x = torch.randn(5, 4, generator=g)
    model.eval(), ref.eval()
    out["unwrapped_eval"] = (model(x) - ref(x)).abs().max().item()
    with torch.no_grad():
        out["wrapped_eval"] = (dm(x) - ddp(x)).abs().max().item()
    out["after_forward"] = buffers_apart()
    # A step, then the checkpoint loaded on every rank before the next forward.
    model.train(), ref.train()
    step(x)
    model.load_state_dict(saved), ref.load_state_dict(saved)
    model.eval(), ref.eval()
    with torch.no_grad():
        out["loaded_eval"] = (dm(x) - ddp(x)).abs().max().item()
    out["loaded_buffers"] = buffers_apart()
    # A step, then the statistics replaced by new tensors (DDP collects its
    # buffers again at each broadcast): rank 0's reach the new ones.
    model.train(), ref.train()
    step(x)
    for m in (model, ref):
        m[1].running_mean = m[1].running_mean.clone()
    model.eval(), ref.eval()
    with torch.no_grad():
        out["replaced_eval"] = (dm(x) - ddp(x)).abs().max().item()
    # A step in eval mode with grad enabled (BatchNorm frozen while the rest
    # fine-tunes) after a no_sync() micro-batch moved each rank's own
    # statistics: DDP sends rank 0's at the next forward; pyddp sent nothing.
    # (Before the next part, after which rank 1's differ from DDP's.)
    model.train(), ref.train()
    with dm.no_sync(), ddp.no_sync():
        for wrapped in (dm, ddp):
            wrapped(x * (2 + rank)).pow(2).mean().backward()
    model.eval(), ref.eval()
    step(x)
    model.train(), ref.train()
    step(x)
    out["eval_mode_step"] = buffers_apart()
    # Two forwards before one backward (SimCLR's two views), then a forward
    # with grad enabled that no backward follows (a loss only looked at):
    # DDP sends rank 0's before each next forward; pyddp sent nothing there
    # (found by a probe: 0.087 apart in running_var; Lightning's
    # StochasticWeightAveraging, whose BatchNorm epoch runs forwards alone,
    # ended 0.41 apart on rank 1).
    model.train(), ref.train()
    for wrapped, opt in zip((dm, ddp), opts):
        (wrapped(x).pow(2).mean() + wrapped(x * (2 + rank)).pow(2).mean()).backward()
        opt.step()
    for wrapped in (dm, ddp):
        wrapped(x * (3 + rank)).pow(2).mean()  # no backward
    step(x)
    out["forwards_without_backward"] = buffers_apart()
    # A step, then a training forward through the unwrapped module, which
    # moves BatchNorm's statistics but not their version counters: rank 0
    # keeps its own pass, as DDP's rank 0 (DDP's rank 1 would take rank 0's;
    # pyddp's keeps its own, documented).
    model.train(), ref.train()
    step(x)
    with torch.no_grad():
        model(x * 3), ref(x * 3)
    model.eval(), ref.eval()
    with torch.no_grad():
        dm(x), ddp(x)
    out["unwrapped_pass"] = buffers_apart()
    dm.close()


@pytest.mark.multiprocess
def test_batchnorm_statistics_on_every_rank_equal_torch_ddps(tmp_path):
    # Found differing from DDP on rank 1 after the last step (0.15 in
    # running_var): pyddp put rank 0's in at the end of the step's backward,
    # DDP at the next forward, so an evaluation through the unwrapped module
    # (Accelerate's, the transformers Trainer's) saw rank 0's statistics on
    # every rank. Equal to DDP's bit for bit at every point now.
    got = spawn(batchnorm_as_ddp, out=tmp_path)
    for r in got:
        assert r["ranks_differ"], "the ranks' rows must move their statistics apart"
        for key in ("steps", "unwrapped_eval", "wrapped_eval", "after_forward"):
            assert r[key] == 0.0, (key, r)
        assert r["loaded_eval"] == 0.0 and r["loaded_buffers"] == 0.0, r
        assert r["replaced_eval"] == 0.0 and r["eval_mode_step"] == 0.0, r
        assert r["forwards_without_backward"] == 0.0, r
    assert got[0]["unwrapped_pass"] == 0.0, got[0]


class _Sends:
    """The link staged buffers receive through: `rank`, and a broadcast
    that writes the sender's values."""

    def __init__(self, rank: int, values: List[torch.Tensor]):
        self.rank, self.values, self.sent = rank, values, None
        self.joining = SimpleNamespace(step=None, staged_from=None)  # no Join

    def under_join(self, source: int, resend: bool = False) -> _Sends:
        self.joining.step = SimpleNamespace(source=source, resend=resend)
        return self

    def broadcast(self, tensors, what):
        self.sent = [t.clone() for t in tensors]
        if self.rank != 0:
            for t, v in zip(tensors, self.values):
                t.copy_(v)


def test_staged_buffers_go_into_what_this_rank_left_alone():
    """rank 1 after a synced step: rank 0's values go in at the next
    forward into each buffer still holding rank 1's of then (a NaN, unequal
    to itself, included; a buffer replaced by a new tensor, or cast to
    another dtype, too); a buffer rank 1 wrote in between keeps what it
    wrote; DDP's sender at the forward (under Join, rank 1 itself) keeps its
    own; the sender holds nothing."""
    from pyddp.replicas.staged import StagedBuffers

    def model():
        m = nn.BatchNorm1d(3)
        m.register_buffer("odd", torch.tensor([float("nan"), 1.0]))
        return m

    sent = [torch.full((3,), 5.0), torch.full((3,), 6.0), torch.tensor(7), torch.tensor([8.0, 9])]
    for change, expect in (
        (None, "received"),
        (lambda m: m.running_mean.add_(1), "own mean"),
        (lambda m: setattr(m, "running_var", torch.ones(3)), "received"),
        (lambda m: m.double(), "received"),
        (lambda m: m.train()(torch.randn(4, 3)), "own mean"),
    ):
        m, staged, link = model(), StagedBuffers(gpus=False), _Sends(1, sent)
        staged.receive(link, m)
        assert torch.equal(m.running_mean, torch.zeros(3)), "receive changes no buffer"
        if change is not None:
            change(m)
        mean = m.running_mean.clone()
        staged.put_in(link, m)
        if expect == "received":
            got = [b.float() for b in m.buffers()]
            assert [torch.equal(a, b.float()) for a, b in zip(got, sent)] == [True] * 4, change
        else:
            assert torch.equal(m.running_mean, mean), "written in between: kept"
        staged.put_in(link, m)  # once only
    m, staged, link = model(), StagedBuffers(gpus=False), _Sends(1, sent)
    staged.receive(link, m)
    staged.put_in(link.under_join(1), m)  # under Join: rank 1 is the highest rank with inputs now
    assert torch.equal(m.running_mean, torch.zeros(3)), "the sender at the forward keeps its own"
    # Under Join, the sender at the backward (rank 0) joined since and rank 2
    # sends at the forward: rank 1 takes rank 2's buffers of now.
    m, staged, link = model(), StagedBuffers(gpus=False), _Sends(1, sent)
    staged.receive(link, m)
    assert link.joining.staged_from == 0
    m.running_mean.add_(1)
    link.values = [torch.full((3,), -1.0), torch.full((3,), -2.0), torch.tensor(3), torch.ones(2)]
    staged.put_in(link.under_join(2, resend=True), m)
    assert [torch.equal(a, b) for a, b in zip(m.buffers(), link.values)] == [True] * 4
    m, staged, link = model(), StagedBuffers(gpus=False), _Sends(0, sent)
    staged.receive(link, m)
    assert [torch.equal(a, b) for a, b in zip(link.sent, m.buffers())] == [True] * 3 + [False]
    staged.put_in(link, m)
    assert torch.equal(m.running_mean, torch.zeros(3)), "the sender holds nothing"


def rank_local_buffers(out: dict) -> None:
    """Buffers that differ by rank at wrap (a rank id, statistics loaded per
    rank), with broadcast_buffers True and False, against torch DDP."""
    import copy

    rank = pyddp.rank()
    for broadcast in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
        model.register_buffer("rank_id", torch.tensor(float(rank)))
        with torch.no_grad():
            model[1].running_mean.fill_(1.0 + rank)
        ref = copy.deepcopy(model)
        dm = pyddp.wrap(model, broadcast_buffers=broadcast)
        ddp = nn.parallel.DistributedDataParallel(ref, broadcast_buffers=broadcast)
        apart = []
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(2):
            apart.append(max((a - b).abs().max().item()
                             for a, b in zip(model.buffers(), ref.buffers())))  # fmt: skip
            x = torch.randn(6, 4, generator=g)
            for wrapped in (dm, ddp):
                wrapped(x).sum().backward()
        out[str(broadcast)] = {"apart": apart, "rank_id": model.rank_id.item()}
        dm.close()


@pytest.mark.multiprocess
def test_rank_local_buffers_at_wrap_as_torch_ddp(tmp_path):
    # Found by a probe: broadcast_buffers=False still took rank 0's buffers
    # at wrap, where DDP keeps each rank's own (rank 1's running statistics
    # then ended 0.27 off DDP's).
    for rank, r in enumerate(spawn(rank_local_buffers, out=tmp_path)):
        assert r["True"]["apart"] == [0.0, 0.0] and r["True"]["rank_id"] == 0.0, r
        assert r["False"]["apart"] == [0.0, 0.0] and r["False"]["rank_id"] == rank, r


def flows_with_forwards_alone(out: dict) -> None:
    """Forwards that no backward answers, where the ranks' paths differ:
    rank 0 evaluating alone (eval mode, grad enabled: no torch.no_grad) after
    an answered step; and a forward alone on every rank before a Join where
    rank 1 has no batch. Each rank must then step with the others."""
    from torch.distributed.algorithms.join import Join

    rank = pyddp.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    dm = pyddp.wrap(model, timeout_s=20)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1 + rank)

    def step() -> None:
        opt.zero_grad()
        dm(torch.randn(6, 4, generator=g) * (1 + rank)).pow(2).mean().backward()
        opt.step()

    step()
    if rank == 0:
        dm.eval()
        for _ in range(3):
            dm(torch.randn(5, 4, generator=g)).sum()  # no backward, grad enabled
        dm.train()
    step()
    dm(torch.randn(6, 4, generator=g)).sum()  # a forward alone, on every rank
    with Join([dm]):
        for _ in range(2 if rank == 0 else 0):
            step()
    step()
    dm.eval()
    with torch.no_grad():
        dm(torch.randn(5, 4, generator=g))  # rank 0's statistics of the last step go in
    out["buffers"] = [b.double().sum().item() for b in model.buffers()]
    dm.close()


@pytest.mark.multiprocess
def test_forwards_alone_leave_the_ranks_exchanging_alike(tmp_path):
    # Found in review of the first version of the rule that sends rank 0's
    # buffers at the forward after one no backward answered: rank 0's second
    # evaluation forward sent alone, and a rank that joined without batches
    # kept the rule's flag past Join ("not at the same exchange" on both).
    got = spawn(flows_with_forwards_alone, out=tmp_path)
    assert got[0]["buffers"] == got[1]["buffers"], got  # rank 0's, at the last forward
