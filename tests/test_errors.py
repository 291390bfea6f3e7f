"""Bad input gives a clear error (what is wrong, what to do), never a hang,
crash or silent wrong result; after a failure the next step works."""

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from conftest import Mixed, SharedAcrossDepth, make_batches
from torch import nn

import pyddp


@pytest.mark.parametrize(
    "devices, error, message",
    [
        ([], ValueError, "devices is empty"),
        ("cpu", TypeError, "must be a list"),
        # A set or dict gave one replica per distinct device, silently.
        ({"cpu": 2}, TypeError, "must be a list"),
        ({"cpu", "cpu:0"}, TypeError, "must be a list"),
        (b"cpu", TypeError, "must be a list"),
        (["cuda:3"], ValueError, "cuda:3 is not available"),
        (["tpu"], ValueError, "not a device|unsupported device type"),
        (["cpu", "meta"], ValueError, "unsupported device type 'meta'"),
    ],
)
def test_bad_devices(devices, error, message):
    with pytest.raises(error, match=message):
        pyddp.wrap(nn.Linear(2, 2), devices)


def test_not_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        pyddp.wrap(lambda x: x, ["cpu"])


def test_no_trainable_parameters():
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        pyddp.wrap(frozen, ["cpu", "cpu"])
    with pytest.raises(ValueError, match="no trainable parameters"):
        pyddp.wrap(nn.ReLU(), ["cpu"])


def test_sparse_embedding_rejected():
    with pytest.raises(ValueError, match="sparse=False"):
        pyddp.wrap(nn.Embedding(10, 3, sparse=True), ["cpu", "cpu"])


def test_torch_ddps_list_of_what_to_leave_alone_is_refused_by_name():
    # Found by a probe: DDP leaves the listed parameters and buffers per
    # rank; pyddp broadcast and reduced them, silently (0.81 on one rank).
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    ddp = nn.parallel.DistributedDataParallel
    ddp._set_params_and_buffers_to_ignore_for_model(model, ["1.bias", "0.bias", "1.weight", "x"])
    with pytest.raises(NotImplementedError, match=r"leave alone \(0\.bias, 1\.bias, 1\.weight, "):
        pyddp.wrap(model, ["cpu", "cpu"])
    with pytest.raises(NotImplementedError, match="per rank"):
        pyddp.GradSync([model, copy.deepcopy(model)])
    model._ddp_params_and_buffers_to_ignore = []
    pyddp.wrap(model, ["cpu", "cpu"]).close()


def test_lazy_modules_refused_until_a_forward_made_them():
    # Their shapes exist only after a forward: refused by name (torch's own
    # error from reading a shape said nothing of pyddp), on every entry point.
    def lazy():
        return nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyBatchNorm1d())

    for make in (
        lambda: pyddp.wrap(lazy(), ["cpu", "cpu"]),
        lambda: pyddp.wrap(lazy(), ["cpu"]),
        lambda: pyddp.GradSync([lazy(), lazy()]),
        lambda: pyddp.Trainer(
            lazy(), ["cpu", "cpu"], optimizer=torch.optim.SGD, loss_fn=F.mse_loss
        ),
    ):
        named = r"lazy.*0\.weight, 0\.bias, 2\.weight, \.\.\..*forward"
        with pytest.raises(ValueError, match=named):
            make()
    model = lazy()
    model(torch.randn(3, 5))  # the forward the error asks for
    dmodel = pyddp.wrap(model, ["cpu", "cpu"])
    assert dmodel(torch.randn(4, 5)).shape == (4, 4)
    dmodel.close()


@pytest.mark.filterwarnings("ignore:Complex modules")
def test_unsupported_parameter_dtype():
    with pytest.raises(ValueError, match="dtype torch.complex64"):
        pyddp.wrap(nn.Linear(2, 2).to(torch.complex64), ["cpu", "cpu"])


def test_gradsync_replicas_must_match():
    with pytest.raises(ValueError, match="replica 1 has shape \\(3, 2\\)"):
        pyddp.GradSync([nn.Linear(2, 2), nn.Linear(2, 3)])
    with pytest.raises(ValueError, match="replica 1 has trainable parameters"):
        pyddp.GradSync([nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2))])
    with pytest.raises(ValueError, match="replicas is empty"):
        pyddp.GradSync([])
    # One module, not a list: found iterated (a Sequential's layers taken as
    # replicas, "replica 1 has trainable parameters []").
    with pytest.raises(TypeError, match="a list of modules, one per replica, got one Sequential"):
        pyddp.GradSync(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))


def test_gradsync_misuse_is_refused_by_name():
    # Found by a probe: flat_grads(5) a bare IndexError, flat_grads(-1) the
    # last replica; no_sync() after close() accepted.
    m = nn.Linear(2, 2)
    sync = pyddp.GradSync([m, copy.deepcopy(m)])
    for bad in (2, -1, 1.0, True):
        with pytest.raises(IndexError, match=r"replica must be an int in \[0, 2\)"):
            sync.flat_grads(bad)
    assert len(sync.flat_grads(1)) == 1
    sync.close()
    with pytest.raises(RuntimeError, match="was closed"):
        sync.no_sync()


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(bucket_cap_mb=-1), "must be >= 0"),
        (dict(bucket_cap_mb=float("nan")), "bucket_cap_mb=nan .* must be >= 0"),
        (dict(first_bucket_cap_mb=float("nan")), "first_bucket_cap_mb=nan must be >= 0"),
        (dict(reduce_order="fifo"), "reduce_order"),
        (dict(group="x"), "group='x' must be a torch.distributed process group"),
    ],
)
def test_bad_options(kw, message):
    # NaN caps and a group that is no process group: found by a probe, they
    # failed at the first backward (NaN to int) or in Lightning's fit (KeyError).
    error = TypeError if "group" in kw else ValueError
    with pytest.raises(error, match=message):
        pyddp.wrap(nn.Linear(2, 2), ["cpu", "cpu"], **kw)


def test_caps_past_any_size_put_every_parameter_in_one_bucket():
    # Found by a probe: bucket_cap_mb=1e30 raised pybind's "incompatible
    # function arguments", inf an OverflowError at fit.
    for cap in (float("inf"), 1e30):
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        with pyddp.wrap(model, ["cpu", "cpu"], bucket_cap_mb=cap) as dm:
            dm(torch.randn(4, 2)).sum().backward()
            assert dm.stats()["buckets"] == 1


def test_bad_batches():
    dm = pyddp.wrap(nn.Linear(2, 2), ["cpu", "cpu"])
    with pytest.raises(ValueError, match="inputs has 4 rows and targets 3"):
        dm.loss(F.mse_loss, torch.zeros(4, 2), torch.zeros(3, 2))

    # Named by where they were given, with the ways to pass what is not
    # one row per example (a probe: a mask over positions, class weights).
    class Masked(nn.Linear):
        def forward(self, x, mask=None):
            return super().forward(x)

    masked = pyddp.wrap(Masked(2, 2), ["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"args\[0\] has 4 rows and kwargs\['mask'\] 5.*set it on"):
        masked(torch.zeros(4, 2), mask=torch.ones(5, 5))
    assert "broadcast" not in str(pytest.raises(ValueError, masked, torch.zeros(4, 2),
                                                 mask=torch.ones(5, 5)).value)  # fmt: skip
    # One row to broadcast over the batch (transformers' position_ids of
    # shape (1, S), a probe): the expansion that splits, named; and it works.
    with pytest.raises(ValueError, match=r"if kwargs\['mask'\] is one row .*\.expand\(4, \.\.\.\)"):
        masked(torch.zeros(4, 2), mask=torch.ones(1, 5))
    masked(torch.zeros(4, 2), mask=torch.ones(1, 5).expand(4, -1))
    one = pytest.raises(ValueError, masked, torch.zeros(1, 2), mask=torch.ones(4, 5)).value
    assert "broadcast" not in str(one)  # one example beside a mask: not the first's to expand
    masked.close()
    with pytest.raises(ValueError, match="no tensor with a batch dimension"):
        dm(torch.tensor(1.0))


class Flaky(nn.Module):
    """Raises in forward (or backward) when its input contains the marker -1."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.fail_backward = False

    def forward(self, x):
        if not self.fail_backward and bool((x == -1).any()):
            raise RuntimeError("bad row in shard")
        out = self.lin(x)
        if self.fail_backward and bool((x == -1).any()):
            out = _RaiseInBackward.apply(out)
        return out


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward blew up")


def train_step(dm, opt, x):
    F.mse_loss(dm(x), torch.zeros(len(x), 2)).backward()
    opt.step()
    opt.zero_grad()


def assert_identical(dm):
    for rep in dm.replicas[1:]:
        for p, p0 in zip(rep.parameters(), dm.module.parameters()):
            assert torch.equal(p, p0)


@pytest.mark.parametrize("run", ["threads", "in_turn"])
def test_exception_in_one_replica_forward_reaches_caller_and_next_step_works(run):
    dm = pyddp.wrap(Flaky(), ["cpu"] * 3, run_replicas=run)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    x = torch.ones(6, 2)
    x[4, 0] = -1  # rows 4-5 go to replica 2
    with pytest.raises(pyddp.ReplicaError, match="replica 2 failed during forward.*bad row") as e:
        dm(x)
    assert e.value.replica == 2
    train_step(dm, opt, torch.ones(6, 2))
    assert_identical(dm)


class _Coded(ValueError):
    def __init__(self, message, code=0):
        super().__init__(message)
        self.code = code


class _Compiling(RuntimeError):
    """An __init__ of other arguments (as dynamo's BackendCompilerFailed)."""

    def __init__(self, backend, inner):
        super().__init__(f"{backend} raised {inner}")
        self.backend = backend


@pytest.mark.parametrize("run", ["threads", "in_turn"])
def test_a_replicas_exception_is_caught_by_its_own_type(run):
    # A probe: "skip the bad batch" code (`except torch.OutOfMemoryError`,
    # `except ValueError`) did not catch a replica's error, which came as a
    # ReplicaError (a RuntimeError) only.
    class Raises(nn.Linear):
        def forward(self, x):
            if bool((x == -1).any()):
                raise self.error
            return super().forward(x)

    model = Raises(2, 2)
    dm = pyddp.wrap(model, ["cpu"] * 2, run_replicas=run)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    x = torch.ones(4, 2)
    x[3, 0] = -1  # replica 1's rows
    errors = [
        torch.OutOfMemoryError("out of memory"),
        _Coded("bad batch", code=7),
        KeyError("k"),
        _Compiling("inductor", "a failure"),  # (a review: a TypeError hid it)
    ]
    for error in errors:
        for replica in dm.replicas:
            replica.error = error
        with pytest.raises(type(error)) as caught:
            dm(x)
        e = caught.value
        assert isinstance(e, pyddp.ReplicaError) and e.replica == 1 and e.cause is error
        assert type(e).__name__ == "ReplicaError" and str(e).startswith("replica 1 failed")
        assert getattr(e, "code", 7) == 7  # the exception's own attributes
        if not isinstance(error, _Compiling):  # (which does not unpickle alone either)
            again = pickle.loads(pickle.dumps(e))  # (Ray, multiprocessing send them)
            assert isinstance(again, type(error)) and again.replica == 1
        train_step(dm, opt, torch.ones(4, 2))  # the next batch runs
    for replica in dm.replicas:  # a type Python cannot combine stays a ReplicaError
        replica.error = FileNotFoundError(2, "gone")
    with pytest.raises(pyddp.ReplicaError, match="FileNotFoundError"):
        dm(x)
    assert_identical(dm)
    dm.close()


@pytest.mark.parametrize("run", ["threads", "in_turn"])
def test_exception_in_one_replica_backward_reaches_caller_and_next_step_works(run):
    torch.manual_seed(0)
    model = Flaky()
    ref = copy.deepcopy(model)
    model.fail_backward = True
    dm = pyddp.wrap(model, ["cpu"] * 2, run_replicas=run)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    x = torch.ones(4, 2)
    x[3, 1] = -1  # replica 1
    loss = F.mse_loss(dm(x), torch.zeros(4, 2))
    with pytest.raises(pyddp.ReplicaError, match="replica 1 failed during backward.*blew up"):
        loss.backward()
    with pytest.raises(RuntimeError, match="last backward failed.*zero_grad"):
        opt.step()
    opt.zero_grad()
    good = torch.randn(4, 2)
    train_step(dm, opt, good)
    assert_identical(dm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.mse_loss(ref(good), torch.zeros(4, 2)).backward()
    ref_opt.step()
    for p, q in zip(dm.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_failed_reduction_raises_and_the_next_step_is_clean():
    torch.manual_seed(0)
    model = Mixed()
    ref = copy.deepcopy(model)
    dm = pyddp.wrap(model, ["cpu"] * 2, bucket_cap_mb=0, rebuild_buckets=False)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (x, y), (x2, y2) = make_batches(2, 8)
    dm._reducer._engine.inject_fault(0, "simulated link failure")
    with pytest.raises(pyddp.ReduceError, match="bucket 0 .*simulated link failure"):
        F.cross_entropy(dm(x), y).backward()
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.step()
    opt.zero_grad()
    F.cross_entropy(dm(x2), y2).backward()
    opt.step()
    F.cross_entropy(ref(x2), y2).backward()
    ref_opt.step()
    assert_identical(dm)
    for p, q in zip(dm.module.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_parameter_used_outside_forward_is_an_error():
    dm = pyddp.wrap(nn.Linear(3, 2), ["cpu", "cpu"])
    x = torch.randn(4, 3)
    loss = dm(x).sum() + sum(p.pow(2).sum() for p in dm.parameters())
    with pytest.raises(Exception, match="twice"):
        loss.backward()
    dm.zero_grad()
    dm(x).sum().backward()  # recovers


def test_one_backward_over_two_outputs_names_the_cause_and_remedy():
    # Issue 30, item 11: the message suggested weight decay or no_sync().
    dm = pyddp.wrap(nn.Linear(3, 2), ["cpu", "cpu"])
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="two dmodel") as info:
        (dm(a).sum() + dm(b).sum()).backward()
    assert "Concatenate the batches" in str(info.value)
    assert "weight_decay" not in str(info.value)
    dm.zero_grad()
    dm(torch.cat([a, b])).sum().backward()  # recovers
    assert all(p.grad is not None for p in dm.parameters())


def test_loss_fn_must_return_a_scalar():
    dm = pyddp.wrap(nn.Linear(3, 2), ["cpu", "cpu"])
    with pytest.raises(pyddp.ReplicaError, match="scalar"):
        dm.loss(lambda out, y: (out - y) ** 2, torch.randn(4, 3), torch.randn(4, 2))
    with pytest.raises(ValueError, match="reduction"):
        dm.loss(F.mse_loss, torch.randn(4, 3), torch.randn(4, 2), reduction="avg")


def test_optimizer_misuse():
    dm = pyddp.wrap(nn.Linear(3, 2), ["cpu", "cpu"])
    with pytest.raises(TypeError, match="Optimizer subclass"):
        dm.optimizer(object)
    for shard in (False, True):  # (every step of it was refused: made, unusable)
        with pytest.raises(ValueError, match="LBFGS steps through a closure"):
            dm.optimizer(torch.optim.LBFGS, shard=shard)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(ValueError, match="add_param_group: 1 parameter"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(ValueError, match="assign=True"):
        dm.load_state_dict(dm.state_dict(), assign=True)


@pytest.mark.parametrize("shard", [False, True, "gradients"])
def test_a_params_function_giving_tensors_outside_its_argument_is_refused(shard):
    # A probe: the function is applied to every replica; a tensor it gives
    # that is not the replica's own (closing over the model instead of
    # using `m`, a learnable value beside the model) was stepped once per
    # replica, silently (0.084 off one device; a temperature at 1.63
    # against 1.13).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    temperature = nn.Parameter(torch.ones(()))
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm:
        for params in (
            lambda m: model.parameters(),
            lambda m: [{"params": m.parameters()}, {"params": [temperature], "lr": 0.01}],
            lambda m: [*m.parameters(), temperature],
        ):
            with pytest.raises(ValueError, match="not a parameter of the module it was given"):
                dm.optimizer(torch.optim.SGD, params, shard=shard, lr=0.1)
        with pytest.raises(TypeError, match="got a tensor"):
            dm.optimizer(torch.optim.SGD, lambda m: m[0].weight, shard=shard, lr=0.1)
        # A set's order differs between replicas (a review: 0.65 apart in turn).
        for params in (
            lambda m: set(m.parameters()),
            lambda m: [{"params": set(m[0].parameters())}],
        ):
            with pytest.raises(TypeError, match="gave a set"):
                dm.optimizer(torch.optim.SGD, params, shard=shard, lr=0.1)
        # Generators inside groups and (name, parameter) pairs still reach torch whole.
        opt = dm.optimizer(
            torch.optim.SGD,
            lambda m: [{"params": m[0].parameters(), "lr": 0.5}, {"params": m[2].parameters()}],
            shard=shard,
            lr=0.1,
        )
        assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
        if not shard:
            named = dm.optimizer(torch.optim.SGD, lambda m: m.named_parameters(), lr=0.1)
            assert len(named.param_groups[0]["params"]) == 4


def test_add_param_group_steps_every_replica_as_one_device():
    # Issue 30, item 10: refused before; torch's optimizers (and ZeRO) take it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    x, y = torch.randn(12, 4), torch.randn(12, 2)
    with pyddp.wrap(model, ["cpu", "cpu", "cpu"]) as dm:
        opt = dm.optimizer(torch.optim.SGD, lambda m: m[2].parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref[2].parameters(), lr=0.1, momentum=0.9)
        for step in range(4):
            if step == 2:  # the first layer joins, with its own learning rate
                opt.add_param_group({"params": dm.module[0].parameters(), "lr": 0.05})
                ref_opt.add_param_group({"params": ref[0].parameters(), "lr": 0.05})
            F.mse_loss(dm(x), y).backward()
            F.mse_loss(ref(x), y).backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        for replica in dm.replicas:  # every replica stepped its own copy
            for p, q in zip(replica.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
        assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.05
        sharded = dm.optimizer(torch.optim.SGD, shard=True, lr=0.1)
        with pytest.raises(RuntimeError, match="sharded optimizer"):
            sharded.add_param_group({"params": dm.module[0].parameters()})


def test_comm_hook_in_one_process_is_said_and_unused_and_bad_hooks_are_refused():
    model = torch.nn.Linear(4, 2)
    with pyddp.wrap(model, ["cpu", "cpu"]) as dm:
        with pytest.warns(UserWarning, match="communication hook is not used.*one process"):
            dm.register_comm_hook(None, "fp16")
        with pytest.raises(TypeError, match="must be callable"):
            dm.register_comm_hook(None, 3)
        with pytest.raises(ValueError, match="unknown hook 'int8'.*fp16, bf16"):
            dm.register_comm_hook(None, "int8")
        dm(torch.randn(4, 4)).sum().backward()  # still trains, reducing in memory
        assert dm.replicas[1].weight.grad is not None


def test_what_of_a_hook_state_ranks_must_share():
    # Compared across ranks at the first synced forward (the ranks' crash
    # it prevents: tests/test_ranks_disagree.py -k hook_states).
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from pyddp.engine.plan import hook_state_settings

    def settings(**kw):
        return hook_state_settings(psgd.PowerSGDState(None, **kw))

    base = settings(matrix_approximation_rank=2)
    assert base["matrix_approximation_rank"] == "2" and base["start_powerSGD_iter"] == "1000"
    for same in [{"compression_stats_logging_frequency": 7}, {"random_seed": 1}]:
        assert base == settings(matrix_approximation_rank=2, **same), same
    for differs in [{"matrix_approximation_rank": 1}, {"warm_start": False}]:
        assert base != settings(**{"matrix_approximation_rank": 2, **differs}), differs

    class Mine:  # a user's state: its fields may differ by rank on purpose
        def __init__(self, rank):
            self.rank = rank

    assert hook_state_settings(Mine(0)) == hook_state_settings(Mine(1)) != base
    assert hook_state_settings(None) == {"group": "the default group"}


def _launched_as(monkeypatch, world: str, rank: str = "1") -> None:
    """This process's environment as torchrun sets it for one of its workers."""
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    for name, value in [
        ("WORLD_SIZE", world),
        ("RANK", rank),
        ("LOCAL_RANK", rank),
        ("TORCHELASTIC_RUN_ID", "job1"),
    ]:
        monkeypatch.setenv(name, value)


def test_a_torchrun_worker_that_forgot_init_is_refused_by_name(monkeypatch):
    # Issue 30, item 5: without pyddp.init(), each of torchrun's ranks built
    # two CPU replicas of its own and trained alone, diverging from the others.
    _launched_as(monkeypatch, "2")
    for start in [
        lambda: pyddp.wrap(nn.Linear(2, 2)),
        lambda: pyddp.wrap(nn.Linear(2, 2), ["cpu"]),
        lambda: pyddp.GradSync([nn.Linear(2, 2)]),
        lambda: pyddp.all_reduce([torch.ones(2), torch.ones(2)]),
    ]:
        with pytest.raises(RuntimeError, match=r"pyddp\.init\(\)") as info:
            start()
        message = str(info.value)
        assert "torchrun" in message and "rank 1 of 2" in message and "WORLD_SIZE" in message
    assert not torch.distributed.is_initialized()  # refused, not initialised behind the back


def test_a_single_process_launch_still_runs_in_one_process(monkeypatch):
    _launched_as(monkeypatch, "1", rank="0")  # torchrun --nproc-per-node=1
    with pyddp.wrap(nn.Linear(2, 2), ["cpu", "cpu"]) as dm:
        dm(torch.ones(4, 2)).sum().backward()
    assert pyddp.world() == 1
    monkeypatch.setenv("WORLD_SIZE", "not a number")  # not a launcher's: one process
    with pyddp.wrap(nn.Linear(2, 2), ["cpu"]):
        pass


def test_ddp_keywords_are_accepted_or_refused_with_what_to_use():
    # Issue 30, item 10: a port from torch DDP got "unknown wrap option".
    model = nn.Linear(2, 2)
    for name, value, hint in [
        ("device_ids", [0], "devices="),
        ("output_device", 0, "devices[0]"),
        ("dim", 1, "dim 0"),
        ("mixed_precision", object(), "autocast"),
        ("bucket_cap_mb_list", [1, 2], "bucket_cap_mb"),
    ]:
        with pytest.raises(TypeError, match=name) as info:
            pyddp.wrap(model, ["cpu", "cpu"], **{name: value})
        assert hint in str(info.value)
    with pytest.raises(TypeError, match="not both"):
        pyddp.wrap(model, ["cpu"], group=None, process_group=None)
    ddp_style = dict(find_unused_parameters=True, static_graph=False, dim=0,
                     gradient_as_bucket_view=True, process_group=None)  # fmt: skip
    with pyddp.wrap(model, ["cpu", "cpu"], **ddp_style) as dm:
        dm(torch.ones(4, 2)).sum().backward()
    with pytest.raises(TypeError, match="find_unused_parameters"):
        pyddp.wrap(model, ["cpu"], find_unused_parameters="yes")
    # torch 2.13's names: forward_sync_buffers is broadcast_buffers (it was
    # refused as unknown), init_sync=True what pyddp does.
    with pyddp.wrap(model, ["cpu", "cpu"], forward_sync_buffers=False, init_sync=True) as dm:
        assert dm.broadcast_buffers is False
    with pytest.raises(TypeError, match="forward_sync_buffers= and broadcast_buffers= differ"):
        pyddp.wrap(model, ["cpu"], forward_sync_buffers=False, broadcast_buffers=True)
    with pytest.raises(TypeError, match="init_sync"):
        pyddp.wrap(model, ["cpu"], init_sync=False)


def test_a_model_inside_torchs_data_parallel_wrappers_is_refused_by_name():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="DataParallel: wrap its .module"):
        pyddp.wrap(nn.DataParallel(model), ["cpu"])


@pytest.mark.parametrize("how", ["prune", "weight_norm"])
def test_a_model_that_cannot_be_copied_is_refused_with_what_works(how):
    # torch's own deepcopy error named weight_norm only (for a pruned model,
    # the wrong cause) and no remedy.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    if how == "prune":
        from torch.nn.utils import prune

        prune.l1_unstructured(model[2], "weight", amount=0.5)
    else:
        with pytest.warns(FutureWarning):  # torch's own deprecation
            torch.nn.utils.weight_norm(model[2])
    with pytest.raises(TypeError, match=r"cannot be copied.*prune\.remove.*one replica per"):
        pyddp.wrap(model, ["cpu", "cpu"])
    pyddp.wrap(model, ["cpu"]).close()  # one replica copies nothing


@pytest.mark.parametrize("layer", [nn.Embedding, nn.EmbeddingBag])
def test_an_embedding_that_renormalises_in_its_forward_is_refused_on_several_replicas(layer):
    # max_norm renormalises the looked-up rows in place: each replica its
    # shard's rows. The replicas drifted apart, silently (9.5 apart in the
    # weights after a step; the version counters moved alike, so the
    # follow check saw nothing).
    model = nn.Sequential(layer(20, 4, max_norm=1.0), nn.Linear(4, 2))
    with pytest.raises(
        ValueError, match=f"{layer.__name__} with max_norm renormalises.*one replica"
    ):
        pyddp.wrap(model, ["cpu", "cpu"])
    pyddp.wrap(model, ["cpu"]).close()  # one replica in one process: as one device


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "orthogonal"])
def test_parametrized_layers_train_as_one_device_and_cached_is_refused(kind):
    # torch caches by the module the parametrization was registered on,
    # which the copies share: under parametrize.cached() replica 1 ran on
    # replica 0's weight and graph ("backward through the graph a second
    # time", or, racing, nothing). Without it, each replica computes its own.
    from torch.nn.utils import parametrizations, parametrize

    torch.manual_seed(0)
    model = nn.Sequential(getattr(parametrizations, kind)(nn.Linear(4, 4)), nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    with pyddp.wrap(model, ["cpu", "cpu"], run_replicas="in_turn") as dm:
        with parametrize.cached(), pytest.raises(RuntimeError, match=r"parametrize.cached\(\)"):
            dm(x)
        opt = dm.optimizer(torch.optim.SGD, lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(3):
            nn.functional.mse_loss(dm(x), y).backward()
            opt.step()
            opt.zero_grad()
            nn.functional.mse_loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_bucket_cap_mb_alone_sizes_the_first_bucket_as_ddp():
    # torch DDP (2.x): an explicit bucket_cap_mb sizes the first bucket too.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])  # 16.6 KB per layer
    cap = 40_000 / 2**20
    with pyddp.wrap(model, ["cpu", "cpu"], bucket_cap_mb=cap) as dm:
        alone = dm._reducer.buckets
    with pyddp.wrap(model, ["cpu", "cpu"], bucket_cap_mb=cap, first_bucket_cap_mb=1e-6) as dm:
        small_first = dm._reducer.buckets
    # Weights 16 KiB, biases 256 B, last layer first: 6 tensors reach 40 KB,
    # the first bucket too (with pyddp's old 1 MiB first bucket: all 8 in one).
    assert [len(b) for b in alone] == [6, 2]
    assert [len(b) for b in small_first] == [1, 5, 2]


def test_a_backward_through_the_wrapped_models_own_module_after_a_step_names_it():
    # With the user's own torch optimizer (torch's zero_grad), a backward
    # through the model object itself: the message spoke of finish(), which a
    # wrap user never calls.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dm = pyddp.wrap(model, ["cpu", "cpu"])
    x = torch.randn(6, 4)
    dm(x).sum().backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(
        RuntimeError, match=r"through the wrapped model's own module .* dmodel\(\.\.\.\)"
    ):
        model(x).sum().backward()
    dm.close()


@pytest.mark.parametrize("mode", ["reentrant", "reentrant_static_graph", "not_reentrant"])
def test_a_parameter_shared_by_checkpointed_segments(mode):
    # Reentrant: each segment's backward accumulates the shared layer once, so
    # its gradient arrives three times in one backward: refused, naming the
    # case and both remedies. use_reentrant=False trains as one device; so
    # does static_graph=True, whose first backward counts the arrivals (and
    # reduces after backward), as torch DDP's static_graph does.
    torch.manual_seed(0)
    model = SharedAcrossDepth(mode != "not_reentrant")
    ref = copy.deepcopy(model)
    static = mode == "reentrant_static_graph"
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(12, 8, generator=g), torch.randint(0, 3, (12,), generator=g))]
    batches *= 4
    with pyddp.wrap(model, ["cpu", "cpu"], static_graph=static) as dm:
        if mode == "reentrant":
            with pytest.raises(
                RuntimeError,
                match="reentrant activation checkpointing.*use_reentrant=False.*static_graph=True",
            ):
                F.cross_entropy(dm(batches[0][0]), batches[0][1]).backward()
            return
        opt = dm.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for x, y in batches:
            F.cross_entropy(dm(x), y).backward()
            F.cross_entropy(ref(x), y).backward()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        if static:  # inp, shared (3 arrivals each), out; per replica
            assert dm._reducer._engine.expected_counts == [1, 1, 3, 3, 1, 1] * 2


def test_static_graph_plans_its_buckets_from_the_ready_order():
    # Its counting backward reduces after backward, in index order: the plan
    # learnt from that order put the first layer (ready last) in the first
    # bucket, which across processes launches first: no overlap at any step.
    plans = []
    for static in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(40, 40) for _ in range(6)])
        with pyddp.wrap(model, ["cpu", "cpu"], static_graph=static, bucket_cap_mb=0.02) as dm:
            for _ in range(3):
                dm(torch.randn(8, 40)).sum().backward()
                dm.zero_grad()
            plans.append(dm._reducer.buckets)
    assert plans[1] == plans[0] and plans[0][0][0] == 11, plans


def test_static_graph_refuses_a_graph_that_changed():
    # After the first backward counted 3 arrivals: 2 still equal one device
    # (reduced after backward); a 4th is refused, naming static_graph.
    torch.manual_seed(0)
    model = SharedAcrossDepth(True)
    ref = copy.deepcopy(model)
    x, y = torch.randn(12, 8), torch.randint(0, 3, (12,))
    with pyddp.wrap(model, ["cpu", "cpu"], static_graph=True) as dm:
        F.cross_entropy(dm(x), y).backward()
        dm.zero_grad()
        F.cross_entropy(dm(x, depth=2), y).backward()
        F.cross_entropy(ref(x, depth=2), y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        dm.zero_grad()
        with pytest.raises(RuntimeError, match="arrived 4 times .* counted 3 .*static_graph"):
            F.cross_entropy(dm(x, depth=4), y).backward()
        dm.zero_grad()  # drops that backward: the next one is whole again
        ref.zero_grad()
        F.cross_entropy(dm(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["sparse", "nested"])
def test_inputs_pyddp_cannot_split_are_named(kind):
    x = torch.randn(4, 6)
    if kind == "sparse":
        x = x.to_sparse()
    else:
        x = torch.nested.nested_tensor([x[0], x[1]], layout=torch.jagged)
    dm = pyddp.wrap(nn.Linear(6, 2), ["cpu", "cpu"])
    with pytest.raises(ValueError, match=f"an input is a .*{kind}.* tensor"):
        dm(x)
    dm.close()


def test_a_hook_result_of_the_wrong_size_names_both_sizes():
    from pyddp._link.transport import _into_bucket

    future = torch.futures.Future()
    future.set_result(torch.zeros(675))
    with pytest.raises(RuntimeError, match="a tensor of 676 elements, got one of 675"):
        _into_bucket(torch.zeros(676), future)


def test_trainer_options_that_are_not_a_dict_are_named():
    # Found by a probe: PyddpTrainer(pyddp_options=[("bucket_cap_mb", 1)])
    # raised a bare "'list' object has no attribute 'items'".
    from pyddp.replicas.ddp_args import wrap_options

    with pytest.raises(TypeError, match=r"PyddpTrainer\(pyddp_options=...\): takes a dict"):
        wrap_options([("bucket_cap_mb", 1)], "PyddpTrainer(pyddp_options=...)")
    assert wrap_options({"bucket_cap_mb": 1}, "x") == {"bucket_cap_mb": 1}


@pytest.mark.parametrize("between", ["no_grad", "inference_mode", "eval", "grad"])
def test_a_forward_between_backward_and_step(between):
    # Several replicas in a process each keep the reduced gradient, and a
    # training forward starts the next step (replicas 1.. drop their copy):
    # the step after it is refused by name, where one device and torch DDP
    # allow it (a probe logging a second loss). A forward without grad, or
    # in eval under no_grad, steps as one device; after the refusal,
    # zero_grad() and the step again train on.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    dm = pyddp.wrap(model, ["cpu", "cpu"])
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    x = torch.randn(6, 4)
    dm(x).square().mean().backward()
    if between == "grad":
        dm(x)
        with pytest.raises(RuntimeError, match="a forward ran after the last backward"):
            opt.step()
        opt.zero_grad()
        dm(x).square().mean().backward()
    elif between == "eval":
        model.eval()
        with torch.no_grad():
            dm(x)
        model.train()
    else:
        with getattr(torch, between)():
            dm(x)
    opt.step()
    ref(x).square().mean().backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    dm.close()
