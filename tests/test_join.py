"""dmodel.join(): in one process (it changes nothing there) and its misuse;
across processes (torchrun, where ranks run out of inputs) against torch
DDP's Join and the closed form, per step and per epoch."""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
from ranks import SGD, TOL, eval_norm, max_diff, net
from spawn import spawn, write
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

import pyddp


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_a_wrapped_model_is_one_of_torchs_joinables():
    with pyddp.wrap(_model(), ["cpu", "cpu"]) as dm:
        assert isinstance(dm, Joinable)
        assert dm.join_device == torch.device("cpu")
        assert dm.join_process_group is None  # one process: no group


def test_join_in_one_process_changes_nothing():
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    results = []
    for joined in (False, True):
        with pyddp.wrap(_model(), ["cpu", "cpu"]) as dm:
            opt = dm.optimizer(torch.optim.SGD, lr=0.1)
            with dm.join() if joined else torch.enable_grad():
                for _ in range(3):
                    opt.zero_grad()
                    nn.functional.mse_loss(dm(x), y).backward()
                    opt.step()
            results.append([p.detach().clone() for p in dm.module.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"divide_by_initial_world_size": 1},
        {"enable": "yes"},
        {"throw_on_early_termination": None},
    ],
)
def test_join_refuses_non_bool_flags(kwargs):
    with (
        pyddp.wrap(_model(), ["cpu", "cpu"]) as dm,
        pytest.raises(TypeError, match=next(iter(kwargs))),
    ):
        dm.join(**kwargs)


def test_join_hook_needs_processes_and_join_needs_an_open_model():
    dm = pyddp.wrap(_model(), ["cpu", "cpu"])
    with pytest.raises(RuntimeError, match="one process"):
        dm.join_hook()
    dm.close()
    with pytest.raises(RuntimeError, match="closed"):
        dm.join()


# ------------------------------------------------- across processes (torchrun)
def joined_uneven_inputs(out: dict) -> None:
    """Uneven inputs under Join: rank r has its own number of batches
    (JOIN_COUNTS, one per rank). pyddp's dmodel.join() against torch DDP's
    on the same model, data and counts (divide_by_initial_world_size True
    and False, plain losses, no_sync() micro-batches); dmodel.loss against
    one device training on the global batch the ranks with inputs hold;
    throw_on_early_termination, after which the model trains on."""
    rank, world = pyddp.rank(), pyddp.world()
    counts = [int(c) for c in os.environ["JOIN_COUNTS"].split(",")]
    g = torch.Generator().manual_seed(11)
    rows = [5 + r for r in range(world)]  # uneven global batches too
    batches = [
        [(torch.randn(rows[r], 6, generator=g) * 1.5, torch.randn(rows[r], 3, generator=g))
         for _ in range(counts[r])]
        for r in range(world)
    ]  # fmt: skip

    def joined_steps(engine, opt, divide: bool, micro: int) -> None:
        """This rank's batches under the engine's join(), `micro`
        micro-batches per step (no_sync() for all but the last)."""
        with engine.join(divide_by_initial_world_size=divide):
            for x, y in batches[rank]:
                opt.zero_grad()
                for k, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                    ctx = engine.no_sync() if k < micro - 1 else contextlib.nullcontext()
                    with ctx:
                        nn.functional.mse_loss(engine(xs), ys).backward()
                opt.step()

    def ddp_run(divide: bool, micro: int, frozen: bool) -> nn.Module:
        model = eval_norm(net()) if frozen else net()
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        joined_steps(ddp, torch.optim.SGD(ddp.parameters(), **SGD), divide, micro)
        return model

    def pyddp_run(divide: bool, micro: int, replicas: int, frozen: bool) -> nn.Module:
        dm = pyddp.wrap(eval_norm(net()) if frozen else net(), ["cpu"] * replicas)
        for m in dm.replicas if frozen else []:
            m.norm.eval()
        joined_steps(dm, dm.optimizer(torch.optim.SGD, **SGD), divide, micro)
        out.setdefault("records", []).append(dm._reducer._work.steps)
        model = dm.module
        dm.close()
        return model

    def diff(a: nn.Module, b: nn.Module) -> float:
        pairs = list(zip(a.parameters(), b.parameters())) + list(zip(a.buffers(), b.buffers()))
        return max((p.double() - q.double()).abs().max().item() for p, q in pairs)

    def emulated(divide: bool, micro: int) -> nn.Module:
        """The closed form, in this process (BatchNorm frozen): each step,
        the ranks with inputs' gradients (the mean over micro-batches of
        each micro-batch's mean loss, as no_sync() accumulates) summed and
        divided by the world or by the ranks with inputs; the last joiner's
        model at the end, which is every rank's trajectory alike here."""
        model = eval_norm(net())
        opt = torch.optim.SGD(model.parameters(), **SGD)
        for step in range(max(counts)):
            active = [r for r in range(world) if step < counts[r]]
            opt.zero_grad()
            for r in active:
                x, y = batches[r][step]
                for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
                    loss = nn.functional.mse_loss(model(xs), ys)
                    (loss / (world if divide else len(active))).backward()
            opt.step()
        return model

    # One replica per rank: BatchNorm in training mode, its buffers taken
    # from the highest rank with inputs before each forward, as DDP does
    # (not with no_sync() micro-batches: DDP skips the buffer broadcast in
    # the forward after a no_sync() one, pyddp broadcasts before every
    # training forward, so the running statistics differ by design). Two:
    # BatchNorm frozen (its batch statistics would be per replica).
    for divide in (True, False):
        for micro in (1, 2):
            for replicas, frozen in ((1, False), (2, True)):
                if micro == 2 and not frozen:
                    continue
                ref = ddp_run(divide, micro, frozen)
                got = pyddp_run(divide, micro, replicas, frozen)
                out[f"vs_ddp_divide{divide}_micro{micro}_r{replicas}"] = diff(got, ref)
                if frozen:
                    closed = emulated(divide, micro)
                    out[f"vs_closed_divide{divide}_micro{micro}"] = diff(got, closed)
                    out[f"ddp_vs_closed_divide{divide}_micro{micro}"] = diff(ref, closed)

    out["divide_matters"] = diff(emulated(True, 1), emulated(False, 1))

    # torch's own Join around the model, with torch DDP's fp16 compression
    # hook on both engines: the joined ranks shadow through the hook too.
    from torch.distributed.algorithms import Join
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # With divide_by_initial_world_size=False too, which torch DDP leaves to
    # the hook (it divides by the whole group): pyddp warns and does the same,
    # also for a hook registered inside the Join ("late": found in review).
    for divide, late in ((True, False), (False, False), (False, True)):
        ddp_model = eval_norm(net())
        ddp = nn.parallel.DistributedDataParallel(ddp_model, find_unused_parameters=True)
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        dm = pyddp.wrap(eval_norm(net()), ["cpu"])
        if not late:
            dm.register_comm_hook(None, "fp16")
        for model in (ddp, dm):
            opt = torch.optim.SGD(model.parameters(), **SGD)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with Join([model], divide_by_initial_world_size=divide):
                    if late and model is dm:
                        dm.register_comm_hook(None, "fp16")
                    for x, y in batches[rank]:
                        opt.zero_grad()
                        nn.functional.mse_loss(model(x), y).backward()
                        opt.step()
        said = [w for w in caught if "no effect with a communication" in str(w.message)]
        out[f"hook_warned_divide{divide}{'_late' * late}"] = len(said)
        out[f"fp16_hook_vs_ddp_divide{divide}{'_late' * late}"] = diff(dm.module, ddp_model)
        if divide:
            out["fp16_hook_vs_closed"] = diff(dm.module, emulated(True, 1))  # 16 bits on the wire
        dm.close()

    # dmodel.loss: each step's global batch is what the ranks with inputs
    # hold; one device trains on it (BatchNorm in eval: per-rank batch
    # statistics differ from the global batch's in any data-parallel run).
    ref = eval_norm(net())
    ref_opt = torch.optim.SGD(ref.parameters(), **SGD)
    ref_losses = []
    for step in range(max(counts)):
        here = [batches[r][step] for r in range(world) if step < counts[r]]
        ref_opt.zero_grad()
        x, y = torch.cat([b[0] for b in here]), torch.cat([b[1] for b in here])
        loss = nn.functional.mse_loss(ref(x), y)
        loss.backward()
        ref_losses.append(loss.item())
        ref_opt.step()
    dm = pyddp.wrap(eval_norm(net()), ["cpu", "cpu"])
    for m in dm.replicas:
        m.norm.eval()
    opt = dm.optimizer(torch.optim.SGD, **SGD)
    losses = []
    with dm.join():
        for x, y in batches[rank]:
            opt.zero_grad()
            with torch.no_grad():
                dm(x)  # an evaluation in the loop: the joined ranks shadow nothing
            dm.loss(nn.functional.mse_loss, x, y).backward()
            opt.step()
            losses.append(dm.last_global_loss)
    out["loss_vs_one_device"] = diff(dm.module, ref)
    out["loss_vs_divided_by_world"] = diff(dm.module, emulated(True, 1))  # a control
    pairs = zip(losses, ref_losses[: len(losses)])
    out["global_losses"] = max((abs(a - b) for a, b in pairs), default=0.0)
    # Training goes on after Join with the ranks' usual weighing.
    x, y = batches[0][0]
    dm.loss(nn.functional.mse_loss, x, y).backward()
    opt.step()
    out["after_join_finite"] = all(bool(p.isfinite().all()) for p in dm.module.parameters())
    dm.close()

    # throw_on_early_termination: every rank raises once one has run out;
    # the model trains on outside Join.
    dm = pyddp.wrap(net(), ["cpu"])
    opt = dm.optimizer(torch.optim.SGD, **SGD)
    dm.join()  # never entered: changes nothing
    out["join_not_entered_enabled"] = dm._join_config.enable
    try:
        with dm.join(throw_on_early_termination=True):
            for x, y in batches[rank]:
                nn.functional.mse_loss(dm(x), y).backward()
                opt.step()
                opt.zero_grad()
        out["thrown"] = None
    except RuntimeError as e:
        out["thrown"] = str(e)
    out["join_left_after_throw"] = dm._reducer._link.joining.step is None  # rank 0's buffers again
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    nn.functional.mse_loss(dm(x), y).backward()
    opt.step()
    out["after_throw_ok"] = True
    dm.close()

    # Hostile: under Join, the ranks with inputs disagree on train/eval: every
    # rank raises, naming it, instead of shadowing the wrong work (the
    # agreement names it: buffers go after eval-mode synced steps too, as
    # under DDP, so the Join exchange no longer tells the modes apart).
    dm = pyddp.wrap(net(), ["cpu"])
    if rank == 0:
        dm.eval()
    try:
        with dm.join():
            for x, y in batches[rank]:
                nn.functional.mse_loss(dm(x), y).backward()
        out["disagree"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["disagree"] = f"{type(e).__name__}: {e}"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "counts",
    ["2,4", "3,0,2", "4,2,3", "4,3,2"],
    ids=[
        "rank0-runs-out-first",
        "3-ranks-one-with-no-batch",
        "3-ranks-the-middle-one-last",
        "3-ranks-the-sender-joins-first",
    ],
)
def test_join_shadows_uneven_inputs_as_torch_ddp_and_the_closed_form(tmp_path, counts):
    """dmodel.join() with a different number of batches per rank
    (`joined_uneven_inputs` above)."""
    world = len(counts.split(","))
    env = {"JOIN_COUNTS": counts}
    got = spawn(joined_uneven_inputs, world, env=env, timeout=400, out=tmp_path)
    every_rank_had_a_batch = min(int(c) for c in counts.split(",")) > 0
    for r in got:
        for divide in (True, False):
            for micro in (1, 2):
                # The closed form (BatchNorm frozen): the ranks with inputs'
                # gradients over the world, or over themselves.
                assert r[f"vs_closed_divide{divide}_micro{micro}"] <= TOL, r
                if every_rank_had_a_batch:
                    # torch DDP itself strays by 1.4e-4 from the closed form
                    # when a rank never had a batch: compared only otherwise.
                    assert r[f"vs_ddp_divide{divide}_micro{micro}_r2"] <= TOL, r
            if every_rank_had_a_batch:  # BatchNorm training, buffers from the highest rank
                assert r[f"vs_ddp_divide{divide}_micro1_r1"] <= TOL, r
        assert r["divide_matters"] > 1e-3  # the two divisions are told apart
        if every_rank_had_a_batch:  # torch's Join([dmodel]) and an fp16 hook, as DDP
            # With 3 ranks the engines' gloo rings add the three values in
            # other orders (the buckets differ in size), and 16-bit sums
            # round at 2**-11 of the gradient: 3.3e-5 after 4 steps here
            # (in float32, 4.5e-8).
            for case in ("True", "False", "False_late"):
                assert r[f"fp16_hook_vs_ddp_divide{case}"] <= (TOL if world == 2 else 1e-4), r
        assert r["hook_warned_divideTrue"] == 0 and r["hook_warned_divideFalse"] == 1, r
        assert r["hook_warned_divideFalse_late"] == 1, r
        assert 0 < r["fp16_hook_vs_closed"] < 1e-2, r  # compressed, and close
        # dmodel.loss: one device on the global batch of the ranks with
        # inputs, and not the average over the world (the control).
        assert r["loss_vs_one_device"] <= TOL and r["loss_vs_divided_by_world"] > 1e-3, r
        assert r["global_losses"] <= 1e-5, r  # the global batch's loss, reported
        assert r["after_join_finite"] and r["after_throw_ok"]
        assert r["join_not_entered_enabled"] is False  # dmodel.join() without `with`
        assert r["join_left_after_throw"], r  # nothing of Join left after it raised
        assert "did different work" in r["disagree"], r
        assert "modules in training mode: rank 0 0, rank 1 " in r["disagree"], r
    # Every rank ends with the last joiner's model and step count.
    assert len({tuple(r["records"]) for r in got}) == 1
    fewest = min(range(world), key=lambda k: int(counts.split(",")[k]))
    assert got[fewest]["thrown"] == f"Rank {fewest} exhausted all inputs."
    others = [r["thrown"] for k, r in enumerate(got) if k != fewest]
    assert all("exhausted inputs" in t for t in others), others


def per_rank_batches(counts, seed: int) -> list:
    """Rank r's JOIN_COUNTS[r] batches of 5 rows, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    return [
        [(torch.randn(5, 6, generator=g) * 1.5, torch.randn(5, 3, generator=g))
         for _ in range(c)]
        for c in counts
    ]  # fmt: skip


def closed_form(batches, cls, kw, sched: bool) -> nn.Module:
    """The closed form of two epochs under Join (BatchNorm frozen): one model
    stepping on the gradients of the ranks with inputs summed over the world,
    with a per-step StepLR if `sched`."""
    world, steps = len(batches), max(len(b) for b in batches)
    model = eval_norm(net())
    opt = cls(model.parameters(), **kw)
    lr = torch.optim.lr_scheduler.StepLR(opt, 1, 0.8) if sched else None
    for _epoch in range(2):
        for step in range(steps):
            for rank_batches in batches:
                if step < len(rank_batches):
                    x, y = rank_batches[step]
                    (nn.functional.mse_loss(model(x), y) / world).backward()
            opt.step()
            opt.zero_grad()
            if lr is not None:
                lr.step()
    return model


def joined_per_epoch(out: dict) -> None:
    """dmodel.join() once per epoch, two epochs, rank r with JOIN_COUNTS[r]
    batches, the README's loop (zero_grad after the step): the rank that
    joined early must neither carry the shadowed reductions into the next
    epoch's first step nor keep the optimizer state (momentum, Adam's
    moments, a per-step StepLR) of the steps it missed. Against the closed
    form: one model stepping on the active ranks' gradients summed over the
    world (BatchNorm frozen), which is every rank's trajectory once Join
    hands the last joiner's model and optimizer to the others."""
    rank = pyddp.rank()
    counts = [int(c) for c in os.environ["JOIN_COUNTS"].split(",")]
    batches = per_rank_batches(counts, seed=12)
    kinds = {
        "sgd": (torch.optim.SGD, {"lr": 0.1}, False),
        "momentum": (torch.optim.SGD, SGD, False),
        "adam_steplr": (torch.optim.Adam, {"lr": 0.01}, True),
    }

    def state_sum(opt) -> float:
        total = 0.0
        for st in opt.state_dict()["state"].values():
            for v in st.values():
                if torch.is_tensor(v):
                    total += float(v.double().sum())
        return total + sum(g["lr"] for g in opt.param_groups)

    for name, (cls, kw, sched) in kinds.items():
        for replicas in (1, 2):
            dm = pyddp.wrap(eval_norm(net()), ["cpu"] * replicas)
            for m in dm.replicas:
                m.norm.eval()
            opt = dm.optimizer(cls, **kw)
            lr = torch.optim.lr_scheduler.StepLR(opt, 1, 0.8) if sched else None
            for _epoch in range(2):
                with dm.join():
                    for x, y in batches[rank]:
                        nn.functional.mse_loss(dm(x), y).backward()
                        opt.step()
                        opt.zero_grad()
                        if lr is not None:
                            lr.step()
            key = f"{name}_r{replicas}"
            out[f"{key}_vs_closed"] = max_diff(dm.module, closed_form(batches, cls, kw, sched))
            out[f"{key}_params"] = [float(p.double().sum()) for p in dm.module.parameters()]
            out[f"{key}_state"] = state_sum(opt)
            out[f"{key}_lr_epoch"] = None if lr is None else lr.last_epoch
            dm.close()

    # The user's own optimizer with momentum: pyddp cannot align it, so
    # every rank refuses the next training forward (the second epoch's
    # first) instead of stepping apart; evaluation stays possible.
    dm = pyddp.wrap(eval_norm(net()), ["cpu"])
    opt = torch.optim.SGD(dm.parameters(), **SGD)
    out["own_optimizer"] = None
    for _epoch in range(2):
        try:
            with dm.join():
                for x, y in batches[rank]:
                    nn.functional.mse_loss(dm(x), y).backward()
                    opt.step()
                    opt.zero_grad()
        except RuntimeError as e:
            out["own_optimizer"] = str(e)
    with torch.no_grad():
        dm(batches[1][0][0])
    dm.close()


@pytest.mark.multiprocess
def test_join_per_epoch_leaves_no_stale_gradient_and_aligns_optimizer_state(tmp_path):
    """Two dmodel.join() blocks (epochs), rank 0 with fewer batches
    (`joined_per_epoch` above): equal to the closed
    form with plain SGD (stale shadowed gradients would add in), momentum
    and Adam with a per-step StepLR (the early joiner's optimizer and
    scheduler take the last joiner's); the user's own stateful optimizer is
    refused on every rank."""
    got = spawn(joined_per_epoch, env={"JOIN_COUNTS": "2,4"}, timeout=400, out=tmp_path)
    for r in got:
        assert "exception" not in r, r.get("exception")
        for name in ("sgd", "momentum", "adam_steplr"):
            for replicas in (1, 2):
                key = f"{name}_r{replicas}"
                assert r[f"{key}_vs_closed"] <= TOL, (key, r[f"{key}_vs_closed"])
        assert "Join" in r["own_optimizer"] and "dmodel.optimizer" in r["own_optimizer"], r
    for key in got[0]:
        if key.endswith(("_params", "_state", "_lr_epoch")):
            assert got[0][key] == got[1][key], key  # the ranks are one model again


def joined_sharded(out: dict) -> None:
    """A sharded optimizer (shard=True, ZeRO stage 1) under dmodel.join(),
    two epochs, rank r with JOIN_COUNTS[r] batches: every rank owns a shard
    no other rank steps, so a joined rank must step its shard with the
    reduced gradients of the backward it shadowed, with the learning rate a
    scheduler set on the ranks with inputs. Against the same run unsharded
    (bitwise: a sharded step is the unsharded arithmetic) and the closed
    form; the consolidated state against the unsharded state. Then the
    misuses: a rank with inputs that skips a step alone, and shard='gradients'
    under Join."""
    rank, world = pyddp.rank(), pyddp.world()
    counts = [int(c) for c in os.environ["JOIN_COUNTS"].split(",")]
    batches = per_rank_batches(counts, seed=13)
    kinds = {"momentum": (torch.optim.SGD, SGD), "adam_steplr": (torch.optim.Adam, {"lr": 0.01})}

    def trained(cls, kw, sched, replicas, shard, clip=None, scaled=False):
        dm = pyddp.wrap(eval_norm(net()), ["cpu"] * replicas)
        for m in dm.replicas:
            m.norm.eval()
        opt = dm.optimizer(cls, shard=shard, **kw)
        lr = torch.optim.lr_scheduler.StepLR(opt, 1, 0.8) if sched else None
        # The scale doubles after every clean step: a joined rank's scaler
        # misses those updates, and takes the last joiner's at Join's end.
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
        scaler = scaler if scaled else None
        for _epoch in range(2):
            with dm.join():
                for x, y in batches[rank]:
                    loss = nn.functional.mse_loss(dm(x), y)
                    if scaler is not None:  # unscale_ divides the gradients before the step
                        scaler.scale(loss).backward()
                        scaler.step(opt)
                        scaler.update()
                        opt.zero_grad()
                        continue
                    loss.backward()
                    if clip is not None:  # the gradients change between backward and step
                        dm.clip_grad_norm_(clip)
                    opt.step()
                    opt.zero_grad()
                    if lr is not None:
                        lr.step()
        state = opt.state_dict()  # collective: the consolidated state when sharded
        return dm, opt, state

    for name, (cls, kw) in kinds.items():
        sched = name.endswith("steplr")
        for replicas in (1, 2):
            key = f"{name}_r{replicas}"
            plain, _, plain_state = trained(cls, kw, sched, replicas, False)
            dm, opt, state = trained(cls, kw, sched, replicas, True)
            out[f"{key}_vs_unsharded"] = max_diff(dm.module, plain.module)
            out[f"{key}_vs_closed"] = max_diff(dm.module, closed_form(batches, cls, kw, sched))
            out[f"{key}_replicas_equal"] = all(max_diff(m, dm.module) == 0 for m in dm.replicas)
            out[f"{key}_state_vs_unsharded"] = max(
                (a - b).abs().max().item()
                for st, pst in zip(state["state"].values(), plain_state["state"].values())
                for a, b in zip(st.values(), pst.values())
                if torch.is_tensor(a) and a.dim() >= 1
            )
            out[f"{key}_lr"] = [gr["lr"] for gr in opt.param_groups]
            out[f"{key}_params"] = [float(p.double().sum()) for p in dm.module.parameters()]
            plain.close()
            dm.close()

    # Gradients clipped between backward and step (as GradScaler's unscale_
    # divides them): the joined ranks step with the clipped ones too.
    cls, kw = kinds["momentum"]
    for replicas in (1, 2):
        plain, _, _ = trained(cls, kw, False, replicas, False, clip=0.05)
        dm, _, _ = trained(cls, kw, False, replicas, True, clip=0.05)
        out[f"clipped_r{replicas}_vs_unsharded"] = max_diff(dm.module, plain.module)
        plain.close()
        dm.close()
        if 0 in counts:  # a rank without a batch never used its GradScaler
            try:
                trained(cls, kw, False, replicas, True, scaled=True)
                out[f"scaled_r{replicas}_refused"] = None
            except RuntimeError as e:
                out[f"scaled_r{replicas}_refused"] = str(e)
            continue
        plain, _, _ = trained(cls, kw, False, replicas, False, scaled=True)
        dm, _, _ = trained(cls, kw, False, replicas, True, scaled=True)
        out[f"scaled_r{replicas}_vs_unsharded"] = max_diff(dm.module, plain.module)
        closed = closed_form(batches, cls, kw, False)
        out[f"scaled_r{replicas}_vs_closed"] = max_diff(dm.module, closed)
        plain.close()
        dm.close()
        # A fused optimizer unscales in its kernel, with GradScaler's
        # grad_scale and found_inf, which the joined ranks get too.
        fused = dict(lr=1e-2, weight_decay=0.5, fused=True)
        plain, _, _ = trained(torch.optim.Adam, fused, False, replicas, False, scaled=True)
        dm, _, _ = trained(torch.optim.Adam, fused, False, replicas, True, scaled=True)
        out[f"fused_r{replicas}_vs_unsharded"] = max_diff(dm.module, plain.module)
        plain.close()
        dm.close()

    # The ZeRO checkpoint idiom (consolidate to rank 0, which alone calls
    # state_dict()), then an evaluation under Join with no step: Join's end
    # takes no sharded optimizer's state (every rank's is current), so the
    # kept consolidated state cannot pair with the others' gathering.
    dm, opt, _ = trained(cls, kw, False, 1, True)
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        opt.state_dict()
    with torch.no_grad(), dm.join():
        for x, _ in batches[rank]:
            dm(x)
    out["evaluated_after_consolidating"] = True
    dm.close()

    # Ported from ZeroRedundancyOptimizer: torch's Join([dmodel, opt]) is
    # dmodel.join(); the optimizer before its model is refused by name.
    from torch.distributed.algorithms import Join

    cls, kw = kinds["momentum"]
    plain, _, _ = trained(cls, kw, False, 1, True)
    dm = pyddp.wrap(eval_norm(net()), ["cpu"])
    dm.module.norm.eval()
    opt = dm.optimizer(cls, shard=True, **kw)
    for _epoch in range(2):
        with Join([dm, opt]):
            for x, y in batches[rank]:
                nn.functional.mse_loss(dm(x), y).backward()
                opt.step()
                opt.zero_grad()
    out["torch_join_vs_dmodel_join"] = max_diff(dm.module, plain.module)
    try:
        Join([opt, dm])
        out["optimizer_first"] = None
    except ValueError as e:
        out["optimizer_first"] = str(e)
    plain.close()
    dm.close()

    # A rank with inputs skips one step alone: every rank raises, naming it,
    # instead of gathering shards stepped at different iterations.
    dm = pyddp.wrap(net(), ["cpu"])
    opt = dm.optimizer(torch.optim.SGD, shard=True, lr=0.1)
    try:
        with dm.join():
            for k, (x, y) in enumerate(batches[rank]):
                nn.functional.mse_loss(dm(x), y).backward()
                if not (rank == world - 1 and k == 0):
                    opt.step()
                opt.zero_grad()
        out["skipped_step"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["skipped_step"] = f"{type(e).__name__}: {e}"

    # ZeRO stage 2 under Join: refused on every rank, on entering, by name.
    dm = pyddp.wrap(net(), ["cpu"])
    opt = dm.optimizer(torch.optim.SGD, shard="gradients", lr=0.1)
    x, y = batches[-1][0]
    nn.functional.mse_loss(dm(x), y).backward()
    opt.step()
    try:
        with dm.join():
            pass
        out["stage2"] = None
    except NotImplementedError as e:
        out["stage2"] = str(e)
    dm.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "counts", ["2,4", "3,0,2"], ids=["rank0-runs-out-first", "3-ranks-one-with-no-batch"]
)
def test_a_sharded_optimizer_steps_under_join_as_the_unsharded_one(tmp_path, counts):
    """`joined_sharded` above: ZeRO stage 1 under Join is the unsharded
    optimizer under Join, to the bit, and the closed form within TOL."""
    world = len(counts.split(","))
    got = spawn(joined_sharded, world, env={"JOIN_COUNTS": counts}, timeout=400, out=tmp_path)
    for r in got:
        for name in ("momentum", "adam_steplr"):
            for replicas in (1, 2):
                key = f"{name}_r{replicas}"
                assert r[f"{key}_vs_unsharded"] == 0.0, (key, r[f"{key}_vs_unsharded"])
                assert r[f"{key}_state_vs_unsharded"] == 0.0, key
                assert r[f"{key}_vs_closed"] <= TOL, (key, r[f"{key}_vs_closed"])
                assert r[f"{key}_replicas_equal"], key
        for replicas in (1, 2):  # clipped, or unscaled by GradScaler, before the step
            assert r[f"clipped_r{replicas}_vs_unsharded"] == 0.0, r
            if f"scaled_r{replicas}_refused" in r:  # a rank had no batch: its scaler unseen
                assert "whose GradScaler pyddp never saw" in r[f"scaled_r{replicas}_refused"]
                continue
            assert r[f"scaled_r{replicas}_vs_unsharded"] == 0.0, r
            # The scales aligned at each Join's end (powers of 2: exact).
            assert r[f"scaled_r{replicas}_vs_closed"] <= TOL, r[f"scaled_r{replicas}_vs_closed"]
            # torch's fused kernel rounds a cut piece otherwise than the whole
            # parameter (1.5e-8 without Join): float32 rounding, not bitwise.
            assert r[f"fused_r{replicas}_vs_unsharded"] <= TOL, r[f"fused_r{replicas}_vs_unsharded"]
        assert r["evaluated_after_consolidating"]
        assert r["torch_join_vs_dmodel_join"] == 0.0, r["torch_join_vs_dmodel_join"]
        assert "needs its wrapped model before it" in r["optimizer_first"], r["optimizer_first"]
        assert "disagree on what comes next" in r["skipped_step"], r["skipped_step"]
        assert "shard='gradients' (ZeRO stage 2) under Join" in r["stage2"], r["stage2"]
    for key in got[0]:
        if key.endswith(("_params", "_lr")):
            assert all(r[key] == got[0][key] for r in got), key  # one model on every rank


def raises_inside_join(out: dict) -> None:
    """Two wrapped models under one Join, refused on every rank; then rank 1
    raises after its third step inside dmodel.join() and catches it
    outside; rank 0 has more batches."""
    rank = pyddp.rank()
    dm = pyddp.wrap(_model(), ["cpu"], timeout_s=120)
    other = pyddp.wrap(_model(), ["cpu"], timeout_s=120)
    refusals = []
    for make in (lambda: Join([dm, other]), lambda: nested(dm, other)):
        try:
            make()
        except RuntimeError as e:
            refusals.append(str(e))
    out["two_models"] = refusals
    try:  # the ranks' arguments differ: named on every rank, the model usable after
        with dm.join(divide_by_initial_world_size=rank == 0):
            pass
    except RuntimeError as e:
        out["arguments"] = str(e)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    try:
        with dm.join():
            for k in range(6 if rank == 0 else 3):
                opt.zero_grad()
                nn.functional.mse_loss(dm(x), y).backward()
                opt.step()
                if rank == 1 and k == 2:
                    raise ValueError("a bad batch")
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    try:  # the caught rank going on (its next epoch): refused, not paired
        nn.functional.mse_loss(dm(x), y).backward()
        out["after"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["after"] = type(e).__name__
    write(out)


def nested(a, b) -> None:
    with a.join(), b.join():
        pass


@pytest.mark.multiprocess
def test_an_exception_leaving_one_ranks_join_block_is_told_to_the_others(tmp_path):
    # Before, the other rank went on pairing its steps with whatever the
    # raising rank did next (its next epoch's), or waited for it until the
    # timeout (120 s here) and then blamed it for running out of batches.
    got = spawn(raises_inside_join, 2, out=tmp_path)
    assert got[1]["error"] == "ValueError: a bad batch"
    assert "rank 1 abandoned" in got[0]["error"], got[0]["error"]
    assert "ValueError left its join() block: a bad batch" in got[0]["error"], got[0]["error"]
    assert got[1]["after"] == "ProcessGroupError"
    # Two wrapped models under one Join waited on each other until the
    # timeout (a joined rank shadows one model's step at a time): refused
    # when the Join is made, on every rank, the first model left usable.
    # Different join() arguments: rank 0's flag decided the average (or the
    # ranks waited until the timeout, for throw_on_early_termination).
    for r in got:
        assert "entered join() with different arguments" in r["arguments"], r["arguments"]
        assert "rank 1: enable=True, divide_by_initial_world_size=False" in r["arguments"]
    for r in got:
        assert len(r["two_models"]) == 2, r["two_models"]
        assert all("two wrapped models under Join at once" in e for e in r["two_models"])
