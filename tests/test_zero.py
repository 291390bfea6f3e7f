"""Sharded optimizer state in one process (dmodel.optimizer(..., shard=True)):
equal to the unsharded optimizer bit for bit, state divided over the
replicas, a consolidated state dict. Across processes: tests/test_multiprocess.py
(`zero`, also against torch's ZeroRedundancyOptimizer)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import pyddp
from pyddp.optim.shards import plan_shards
from pyddp.optim.zero import state_bytes


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def _train(shard, n, cls, steps=4, params=None, **kw):
    torch.manual_seed(1)
    x, y = torch.randn(24, 8), torch.randn(24, 4)
    dm = pyddp.wrap(_model(), ["cpu"] * n)
    opt = dm.optimizer(cls, params, shard=shard, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(dm(x), y).backward()
        opt.step()
        sched.step()
    return dm, opt


OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
    (torch.optim.AdamW, dict(lr=1e-2)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=[c.__name__ for c, _ in OPTIMIZERS])
def test_sharded_equals_unsharded_bit_for_bit(n, cls, kw):
    a, oa = _train(False, n, cls, **kw)
    b, ob = _train(True, n, cls, **kw)
    assert type(ob).__name__ == f"Sharded{cls.__name__}" and isinstance(ob, cls)
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)
    for m in b.replicas:  # every replica took the stepped parameters
        for p, q in zip(m.parameters(), b.module.parameters()):
            assert torch.equal(p, q)
    # State: each replica holds 1/n of one unsharded copy (the elements are
    # split evenly; a parameter cut in two keeps a scalar step count in each
    # piece: a few bytes more).
    full, shares = state_bytes(oa), state_bytes(ob)
    assert len(set(full)) == 1
    assert full[0] <= sum(shares) <= full[0] + 64 * n
    assert max(shares) <= full[0] / n + 64
    assert_same_state_dict(oa.state_dict(), ob.state_dict())


def assert_same_state_dict(a: dict, b: dict) -> None:
    """Two optimizer state dicts are equal bit for bit (also used on the
    simulated GPUs: test_simgpu.py)."""
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for k, state in a["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][k][key])), key


def test_an_optimizer_that_is_not_elementwise_is_sharded_by_whole_parameters():
    # Adafactor factors each matrix's second moment by rows and columns: its
    # parameters are never cut, and the result is still the unsharded one.
    a, _ = _train(False, 3, torch.optim.Adafactor, lr=1e-2)
    b, ob = _train(True, 3, torch.optim.Adafactor, lr=1e-2)
    assert not ob._pyddp.split
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)


def _conv_run(shard, channels_last, refresh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Tanh(), nn.Conv2d(8, 4, 3))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    dm = pyddp.wrap(model, ["cpu"] * 3)
    opt = dm.optimizer(torch.optim.Adam, shard=shard, lr=1e-2)
    torch.manual_seed(1)
    x = torch.randn(6, 3, 8, 8)
    for step in range(3):
        if refresh and step == 1:
            dm.module.double().float()  # new storage for every parameter
        opt.zero_grad()
        dm(x).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in dm.module.parameters()]


@pytest.mark.parametrize("channels_last,refresh", [(True, False), (False, True)])
def test_layouts_and_new_storage_after_the_optimizer_was_made(channels_last, refresh):
    # Whole parameters in channels_last; parameters given new storage
    # (Module._apply) after the optimizer was made: its views follow.
    a = _conv_run(False, channels_last, refresh)
    b = _conv_run(True, channels_last, refresh)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def test_adagrads_state_is_the_shards_only():
    # Adagrad makes its state when built: the sharded optimizer's own object
    # keeps none of it (each replica a share).
    dm, opt = _train(True, 4, torch.optim.Adagrad, lr=0.1)
    _, full = _train(False, 4, torch.optim.Adagrad, lr=0.1)
    assert len(opt.state) == 0
    assert max(state_bytes(opt)) <= state_bytes(full)[0] / 4 + 64


def test_param_groups_and_a_subset_of_parameters():
    def groups(m):
        return [{"params": m[0].parameters(), "lr": 0.05}, {"params": m[4].parameters()}]

    a, _ = _train(False, 3, torch.optim.SGD, params=groups, lr=0.1, momentum=0.9)
    b, ob = _train(True, 3, torch.optim.SGD, params=groups, lr=0.1, momentum=0.9)
    for p, q in zip(a.module.parameters(), b.module.parameters()):
        assert torch.equal(p, q)
    assert ob.param_groups[0]["lr"] == 0.05 * 0.25  # the scheduler reached the shards


def test_the_consolidated_state_dict_loads_both_ways():
    dm, opt = _train(True, 3, torch.optim.Adam, lr=1e-2)
    sd = opt.state_dict()
    plain = torch.optim.Adam(copy.deepcopy(dm.module).parameters(), lr=1e-2)
    plain.load_state_dict(sd)  # the unsharded optimizer's format
    again = pyddp.wrap(copy.deepcopy(dm.module), ["cpu"] * 2)  # another replica count
    opt2 = again.optimizer(torch.optim.Adam, shard=True, lr=1e-2)
    opt2.load_state_dict(plain.state_dict())
    back = opt2.state_dict()
    for k in sd["state"]:
        assert torch.equal(back["state"][k]["exp_avg_sq"], sd["state"][k]["exp_avg_sq"])
    # Loading copies: the shards never share a buffer with the dict given.
    sd["state"][0]["exp_avg"].add_(1.0)
    assert not torch.equal(opt2.state_dict()["state"][0]["exp_avg"], sd["state"][0]["exp_avg"])


def test_plan_shards_divides_elements_or_whole_parameters():
    # Elementwise optimizers: equal ranges of the elements laid end to end,
    # cutting inside parameters (a 10-element one is split 7 + 3 here).
    assert plan_shards([10, 1, 1, 10, 5], 3, True) == [
        [(0, 0, 9)],
        [(0, 9, 10), (1, 0, 1), (2, 0, 1), (3, 0, 6)],
        [(3, 6, 10), (4, 0, 5)],
    ]
    # Others: whole parameters, largest first to the least loaded slot.
    assert plan_shards([10, 1, 1, 10, 5], 2, False) == [
        [(0, 0, 10), (4, 0, 5)],
        [(1, 0, 1), (2, 0, 1), (3, 0, 10)],
    ]
    assert plan_shards([3], 4, True) == [[], [(0, 0, 1)], [(0, 1, 2)], [(0, 2, 3)]]


def test_misuse_is_refused():
    dm = pyddp.wrap(_model(), ["cpu", "cpu"])
    with pytest.raises(TypeError, match="shard must be a bool"):
        dm.optimizer(torch.optim.SGD, shard="yes", lr=0.1)
    opt = dm.optimizer(torch.optim.SGD, shard=True, lr=0.1)
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(opt)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(ValueError, match="parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    # Another model's state (the same count of parameters, other shapes).
    other = nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )
    foreign = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    for p in other.parameters():
        p.grad = torch.ones_like(p)
    foreign.step()
    sd = foreign.state_dict()
    sd["state"][0]["momentum_buffer"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="momentum_buffer"):
        opt.load_state_dict(sd)
    dm.close()


def test_torchs_zero_spellings_port_unchanged():
    # Issue 30, item 10: optimizer_class= and consolidate_state_dict(to=0),
    # as torch's ZeroRedundancyOptimizer spells them.
    dm = pyddp.wrap(_model(), ["cpu", "cpu"])
    opt = dm.optimizer(optimizer_class=torch.optim.Adam, shard=True, lr=0.01)
    assert isinstance(opt, torch.optim.Adam)
    x = torch.randn(6, next(dm.module.parameters()).shape[1])
    dm(x).sum().backward()
    opt.step()
    every = opt.state_dict()
    opt.consolidate_state_dict(to=0)
    kept = opt.state_dict()
    assert kept["state"].keys() == every["state"].keys()
    for a, b in zip(every["state"].values(), kept["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])
    with pytest.raises(ValueError, match="to=1"):
        opt.consolidate_state_dict(to=1)  # one process: rank 0 only
    with pytest.raises(TypeError, match="once"):
        dm.optimizer(torch.optim.SGD, optimizer_class=torch.optim.SGD, lr=0.1)
    dm.close()
