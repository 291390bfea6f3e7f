"""Lifecycle of a wrapped model: dropping it releases everything, close() and
context managers, a closed model refuses use, and the user's model stays
copyable and saveable with no live pyddp state attached."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import subprocess
import sys
import threading
import time
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import Mixed, make_batches
from torch import nn

import pyddp


def step(dm, opt, x, y):
    F.cross_entropy(dm(x), y).backward()
    opt.step()
    opt.zero_grad()


def settle_threads(limit: int, timeout: float = 10.0) -> int:
    deadline = time.time() + timeout
    while threading.active_count() > limit and time.time() < deadline:
        gc.collect()
        time.sleep(0.05)
    return threading.active_count()


def pyddp_hooks(model: nn.Module) -> int:
    count = sum(len(m._forward_pre_hooks) for m in model.modules())
    for p in model.parameters():
        count += len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
    return count


def test_dropping_a_wrapped_model_releases_threads_memory_and_hooks():
    ((x, y),) = make_batches(1, 8)
    baseline = threading.active_count()
    models = []
    syncs = []
    for _ in range(12):
        model = Mixed()
        dm = pyddp.wrap(model, ["cpu", "cpu", "cpu"])
        opt = dm.optimizer(torch.optim.SGD, lr=0.1)
        step(dm, opt, x, y)
        syncs.append(weakref.ref(dm._reducer))
        replica = weakref.ref(dm.replicas[1])
        models.append(model)  # the user keeps the model, drops the wrapper
        del dm, opt
    gc.collect()
    assert all(s() is None for s in syncs), "a dropped wrap is still alive"
    assert replica() is None, "a dropped wrap's replica copy is still alive"
    assert settle_threads(baseline) <= baseline, threading.enumerate()
    for model in models:
        assert pyddp_hooks(model) == 0
        model(x).sum().backward()  # plain torch again


@pytest.mark.parametrize("kept", ["optimizer", "scheduler"])
def test_a_wrapper_dropped_while_its_optimizer_lives_leaves_the_model_plain(kept):
    # Found keeping the hooks on the user's model: the optimizer held the
    # reducer, and the model's own training failed at its second backward
    # ("gradient produced twice"); wrapping it again was refused as "already
    # synchronised by a live pyddp model", with no handle left to close it.
    ((x, y),) = make_batches(1, 8)
    model = Mixed()
    ref = copy.deepcopy(model)
    dm = pyddp.wrap(model, ["cpu", "cpu"])
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    held = opt if kept == "optimizer" else torch.optim.lr_scheduler.StepLR(opt, 1)
    del opt
    step(dm, held if kept == "optimizer" else held.optimizer, x, y)
    step(ref, torch.optim.SGD(ref.parameters(), lr=0.1), x, y)
    del dm
    gc.collect()
    assert pyddp_hooks(model) == 0
    plain, ref_opt = (
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.SGD(ref.parameters(), lr=0.1),
    )
    for _ in range(3):
        step(model, plain, x, y)
        step(ref, ref_opt, x, y)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    stale = held if kept == "optimizer" else held.optimizer
    with pytest.raises(RuntimeError, match="was closed"):
        stale.step()
    pyddp.wrap(model, ["cpu", "cpu"]).close()  # wrapping it again is allowed


@pytest.mark.parametrize("keep_optimizer", [False, True])
def test_a_dropped_wrapper_releases_its_sync_batchnorm_layers_and_threads(keep_optimizer):
    # Found (a review): SyncBatchNorm layers stayed bound to a dropped
    # wrapper, so wrapping the model again was refused ("belong to another
    # pyddp wrapper that is still open"); with its optimizer alive, the
    # replicas' worker threads lived on too.
    baseline = threading.active_count()
    model = nn.Sequential(nn.Linear(4, 8), nn.SyncBatchNorm(8), nn.ReLU(), nn.Linear(8, 2))
    dm = pyddp.wrap(model, ["cpu", "cpu"])
    opt = dm.optimizer(torch.optim.SGD, lr=0.1) if keep_optimizer else None
    dm(torch.randn(4, 4)).sum().backward()
    del dm
    gc.collect()
    assert settle_threads(baseline) <= baseline, threading.enumerate()
    pyddp.wrap(model, ["cpu", "cpu"]).close()
    assert opt is None or opt.param_groups


def test_close_and_context_managers():
    ((x, y),) = make_batches(1, 8)
    baseline = threading.active_count()
    model = Mixed()
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm:
        step(dm, dm.optimizer(torch.optim.SGD, lr=0.1), x, y)
    assert pyddp_hooks(model) == 0
    for use in (lambda: dm(x), lambda: dm.loss(F.cross_entropy, x, y), lambda: dm.zero_grad()):
        with pytest.raises(RuntimeError, match="closed"):
            use()
    dm.close()  # idempotent
    assert settle_threads(baseline) <= baseline
    model(x)  # the model itself stays usable
    with pyddp.GradSync([Mixed(), Mixed()], check_replicas=False) as sync:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        sync.check_step()


def test_wrapping_twice_is_refused_until_closed():
    model = Mixed()
    dm = pyddp.wrap(model, ["cpu", "cpu"])
    with pytest.raises(TypeError, match="already wrapped"):
        pyddp.wrap(dm, ["cpu", "cpu"])
    with pytest.raises(ValueError, match="already synchronised"):
        pyddp.wrap(model, ["cpu", "cpu"])
    with pytest.raises(ValueError, match="already synchronised"):
        pyddp.GradSync([model.head, copy.deepcopy(model.head)])
    dm.close()
    pyddp.wrap(model, ["cpu", "cpu"]).close()


def test_gradsync_refuses_replicas_sharing_a_parameter():
    # The same module twice (or replicas viewing one tensor's memory) would
    # count each gradient once per replica: 2x, silently, before this check.
    m = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="replica 1's 'weight' is replica 0's 'weight'"):
        pyddp.GradSync([m, m])
    other = torch.nn.Linear(2, 2)
    other.weight = torch.nn.Parameter(m.weight.detach())  # another tensor, the same memory
    with pytest.raises(ValueError, match="the same memory"):
        pyddp.GradSync([m, other], check_replicas=False)
    with pyddp.GradSync([m, copy.deepcopy(m)]):
        pass
    # Views of one buffer that overlap without starting at one address were
    # accepted: the shared elements were stepped once per replica.
    base = torch.zeros(13)
    a, b = torch.nn.Linear(3, 4, bias=False), torch.nn.Linear(3, 4, bias=False)
    a.weight = torch.nn.Parameter(base[0:12].view(4, 3))
    b.weight = torch.nn.Parameter(base[1:13].view(4, 3))
    with pytest.raises(ValueError, match="replica 1's 'weight' shares memory with replica 0's"):
        pyddp.GradSync([a, b], check_replicas=False)


def _two_replicas():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    return [m, copy.deepcopy(m)], torch.randn(2, 5, 4)


@pytest.mark.parametrize("how", ["finish forgotten", "abort without zero_grad", "replaced on 1"])
def test_gradsync_refuses_a_step_after_which_the_replicas_would_differ(how):
    """Each passed check_step() and stepped the replicas apart (0.084 in a
    gradient): finish() after the "produced twice" error a forgotten
    finish() raises; a backward and finish() after abort() without
    zero_grad() (the aborted replica's share mixed in); a gradient assigned
    or set to None on a replica other than 0 after finish() (replica 0's
    are copied to every replica, the others' were not looked at)."""
    replicas, x = _two_replicas()
    sync = pyddp.GradSync(replicas, op="avg")

    def backward(r):
        replicas[r](x[r]).square().mean().backward()

    if how == "finish forgotten":
        backward(0), backward(1)
        with pytest.raises(Exception, match="produced twice"):
            backward(0)  # the previous backward's finish() was forgotten
        sync.finish()
    elif how == "abort without zero_grad":
        backward(0)
        sync.abort()
        backward(0), backward(1)
        sync.finish()
    else:
        backward(0), backward(1)
        sync.finish()
        sync.check_step()  # whole
        replicas[1][0].weight.grad = replicas[1][0].weight.grad * 0.5
    with pytest.raises(RuntimeError, match="call zero_grad|replaced .*after finish"):
        sync.check_step()
    if how != "replaced on 1":  # refused until zero_grad(): another window, no_sync() in it
        with sync.no_sync():
            backward(0), backward(1)
        backward(0), backward(1)
        sync.finish()
        with pytest.raises(RuntimeError, match="call zero_grad"):
            sync.check_step()
    sync.zero_grad()
    backward(0), backward(1)
    sync.finish()
    sync.check_step()  # after zero_grad(), a whole step again
    sync.close()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradsync_steps_again_after_an_abort_cleared_by_torchs_zero_grad(set_to_none):
    # torch's own zero_grad over every replica (embedding.md: it works) does
    # what GradSync.zero_grad() asks after an abort: the next step is whole.
    replicas, x = _two_replicas()
    sync = pyddp.GradSync(replicas, op="avg")
    replicas[0](x[0]).square().mean().backward()
    sync.abort()
    for m in replicas:
        m.zero_grad(set_to_none=set_to_none)
    for r in (0, 1):
        replicas[r](x[r]).square().mean().backward()
    sync.finish()
    sync.check_step()
    ref, _ = _two_replicas()
    for r in (0, 1):
        (ref[0](x[r]).square().mean() / 2).backward()
    for p, q in zip(replicas[1].parameters(), ref[0].parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    sync.close()


def test_the_wrapper_refuses_pickling_and_copying_clearly():
    dm = pyddp.wrap(Mixed(), ["cpu", "cpu"])
    for attempt in (
        lambda: pickle.dumps(dm),
        lambda: copy.deepcopy(dm),
        lambda: torch.save(dm, io.BytesIO()),
    ):
        with pytest.raises(TypeError, match=r"dmodel\.module"):
            attempt()
    dm.close()


def test_the_users_model_stays_copyable_and_saveable():
    # With a Dropout layer (its checkpointing guard, a hook on the user's
    # layer): found refusing copy.deepcopy, pickle, torch.save and
    # swa_utils.AveragedModel ("cannot pickle '_queue.SimpleQueue'").
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    dm = pyddp.wrap(model, ["cpu", "cpu"], run_replicas="threads")
    assert model[2]._forward_pre_hooks  # (what the copies must carry as nothing)
    torch.optim.swa_utils.AveragedModel(model)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    clone = copy.deepcopy(model)
    blob = pickle.dumps(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    # The copies are plain models: training one leaves the wrapped model alone.
    for m in (clone, pickle.loads(blob)):
        F.cross_entropy(m(x), y).backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    for _ in range(2):
        F.cross_entropy(dm(x), y).backward()
        opt.step()
        opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    # A saved model loads where pyddp cannot be imported at all.
    code = (
        "import io, sys; sys.modules['pyddp'] = None; import torch\n"
        "m = torch.load(io.BytesIO(sys.stdin.buffer.read()), weights_only=False)\n"
        "print(m(torch.ones(1, 4)).shape)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], input=buf.getvalue(), capture_output=True, timeout=120
    )
    assert out.returncode == 0 and b"[1, 2]" in out.stdout, out.stderr.decode()
    dm.close()


@pytest.mark.parametrize("on", [[0], [1], [0, 1]])
def test_gradsync_reduces_a_gradient_given_new_storage_between_forward_and_backward(on):
    """`p.grad.data = tensor` after a replica's forward, before its
    backward: the backward accumulated into the new storage and the bucket
    reduced the old (found under wrap, 0.135 off one device)."""
    replicas, x = _two_replicas()
    ref = copy.deepcopy(replicas[0])
    sync = pyddp.GradSync(replicas, op="avg")
    for r in (0, 1):
        replicas[r](x[r]).square().mean().backward()
    sync.finish()
    (ref(x[0]).square().mean() + ref(x[1]).square().mean()).div(2).backward()
    losses = [replicas[r](x[r]).square().mean() for r in (0, 1)]
    for r in on:
        for p in replicas[r].parameters():
            p.grad.data = torch.full_like(p, 0.25)
    for loss in losses:
        loss.backward()
    sync.finish()
    sync.check_step()
    kept = {r: 0.25 if r in on else None for r in (0, 1)}  # what each replica's gradient was
    for p in ref.parameters():
        p.grad = sum(p.grad if k is None else torch.full_like(p, k) for k in kept.values()) / 2
    (ref(x[0]).square().mean() + ref(x[1]).square().mean()).div(2).backward()
    for m in replicas:
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)
    sync.close()


def test_gradsync_takes_new_storage_on_replica_0_after_finish_as_an_assignment():
    """`p.grad.data = tensor` on replica 0 after finish() (a clamp through
    `.data`) is what `p.grad = tensor` is: copied to every replica at
    check_step (it was refused, "call sync.reattach()")."""
    replicas, x = _two_replicas()
    sync = pyddp.GradSync(replicas, op="avg")
    for r in (0, 1):
        replicas[r](x[r]).square().mean().backward()
    sync.finish()
    w = replicas[0][0].weight
    w.grad.data = w.grad.detach().clamp(-0.01, 0.01)
    sync.check_step()
    assert replicas[1][0].weight.grad.abs().max() <= 0.01
    torch.testing.assert_close(replicas[1][0].weight.grad, w.grad, atol=0, rtol=0)
    sync.close()


def test_gradsync_closed_while_a_backward_is_under_way_warns():
    # A probe: replica 0's backward, close(), replica 1's backward left the
    # replicas with different, unreduced gradients, silently.
    replicas, x = _two_replicas()
    sync = pyddp.GradSync(replicas, op="avg")
    replicas[0](x[0]).square().mean().backward()
    with pytest.warns(UserWarning, match="closed while a backward was under way"):
        sync.close()
    again = pyddp.GradSync(replicas, op="avg")  # a whole iteration: closed quietly
    again.zero_grad()
    for r in (0, 1):
        replicas[r](x[r]).square().mean().backward()
    again.finish()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.close()


@pytest.mark.parametrize("then", ["reattach", "backward", "backward, gradients held"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_gradsync_refuses_a_dtype_change(dtype, then):
    # A probe: reattach() after .double() laid the gradients out in float64
    # buffers the engine summed as float32 (0.13 off one device, replicas
    # 0.26 apart), and after .half() the engine wrote past them (a segfault);
    # without reattach(), the backward failed in torch's words.
    replicas, x = _two_replicas()
    sync = pyddp.GradSync(replicas, op="avg")
    if then == "backward, gradients held":  # (converted with them: a review)
        for r in (0, 1):
            replicas[r](x[r]).square().mean().backward()
        sync.finish()
    for m in replicas:
        m.to(dtype)
    with pytest.raises(RuntimeError, match=f"parameter '0.weight' is {dtype}, made float32"):
        if then == "reattach":
            sync.reattach()
        else:
            replicas[0](x[0].to(dtype)).square().mean().backward()
    sync.close()


@pytest.mark.parametrize("how", ["share_memory", "double then float", "grad.data", "on 0 alone"])
def test_gradsync_refuses_moved_buckets_until_reattach_and_reduces_moved_gradients(how):
    """After zero_grad(set_to_none=False), Module._apply on the replicas
    (share_memory(), .double().float()) moved each bucket's storage under its
    views: the engine wrote the freed memory ("corrupted double-linked list"
    at exit) and each replica stepped on its own gradient; `p.grad.data = ...`
    left the gradient outside the bucket, unreduced. A bucket moved
    (share_memory()) is refused by name at the next forward, and reattach()
    makes it right; a gradient given storage of its own (.double().float()
    sets each `p.grad.data`) is copied into its bucket by the backward's
    hook, as an assigned gradient is (they were refused at check_step, until
    reattach())."""
    replicas, x = _two_replicas()
    ref = copy.deepcopy(replicas[0])
    sync = pyddp.GradSync(replicas, op="avg")

    def backward(r):
        replicas[r](x[r]).square().mean().backward()

    backward(0), backward(1)
    sync.finish()
    sync.zero_grad(set_to_none=False)
    for m in replicas[:1] if how == "on 0 alone" else replicas:
        if how == "share_memory":
            m.share_memory()
        elif how == "double then float":
            m.double().float()
        else:  # "on 0 alone": found in review, replica 0's unreduced gradient was
            for p in m.parameters():  # stepped on every replica, taken as assigned
                p.grad.data = torch.zeros_like(p)
    if how == "share_memory":
        with pytest.raises(RuntimeError, match="given new storage .*reattach"):
            backward(0)
        sync.zero_grad()
        sync.reattach()
    backward(0), backward(1)
    sync.finish()
    sync.check_step()
    (ref(x[0]).square().mean() + ref(x[1]).square().mean()).div(2).backward()
    for m in replicas:
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)
    sync.close()
