"""What every simulated-GPU scenario in one process starts from (the
scenarios run by tests/spawn.py's run_alone, simgpu=True): the simulation
`sim` (tests/simgpu) and `streams`, the stand-in for torch.cuda's current
streams, and helpers that wrap and train on them. Importing this module loads
the simulated driver named by PYDDP_CUDA_LIBRARY: only a scenario's own
process imports it (inside the scenario function), never pytest's."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading

import torch
import torch.nn.functional as F
from conftest import Mixed, make_batches
from torch import nn

import pyddp
from pyddp.engine.streams import simulated_gpus

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "simgpu"))
from simgpu import Sim, SimStreams  # noqa: E402

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


_SEEDED = threading.Lock()


def assert_replicas_equal(dm):
    for rep in dm.replicas[1:]:
        for p, p0 in zip(rep.parameters(), dm.module.parameters()):
            assert torch.equal(p, p0), "replicas differ"


def check_equal_to_single_device(
    devices, cap, steps=4, stream_map=None, around_step=None, final=None, **kw
):
    """wrap on simulated `devices` against single-device AdamW, replicas
    bitwise equal after each step; `around_step(step, dm, opt)`: a context
    manager around each backward and step (after the forward); `final`: a
    list that receives the trained parameters. Returns dm.run_replicas()."""
    around_step = around_step or (lambda *_: contextlib.nullcontext())
    with _SEEDED:  # torch's generator is the process's: two threads seeding
        torch.manual_seed(0)  # at once interleave their draws (another init)
        model = Mixed()
    ref = copy.deepcopy(model)
    dm = gpu_wrap(model, devices, bucket_cap_mb=cap, **kw)
    opt = dm.optimizer(torch.optim.AdamW, lr=0.01, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    for step, (x, y) in enumerate(make_batches(steps, 13)):
        with streams.stream(stream_map or {}):
            loss = F.cross_entropy(dm(x), y)
            with around_step(step, dm, opt):
                gpu_step(loss, opt, devices)
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert_replicas_equal(dm)
    # float32 sums of two halves against one whole, and AdamW divides by the
    # gradient's scale: a rounding difference in a near-zero gradient can
    # move a parameter by a good part of lr, so the bound holds for this
    # seed's model and batches (1.2e-7 measured), not for every init. Both
    # sides are deterministic (two at once train to the same bytes as one
    # alone: test_two_models_and_collectives_at_once_share_one_communicator_set).
    for p, q in zip(dm.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    if final is not None:
        final.append([p.detach().clone() for p in dm.module.parameters()])
    how = dm.run_replicas()
    dm.close()
    return how


# What a scenario leaves alive until its process exits, as a script's globals
# are: what pyddp does at exit (its atexit hook closing what is still open
# before the driver's teardown) is part of what some scenarios test.
alive_at_exit: list = []
