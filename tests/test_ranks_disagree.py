"""Ranks that disagree on what a sharded optimizer or a communication hook
hides, across 2 processes: different communication hooks (one rank with
torch's fp16 hook, the other with none, crashed both in gloo) or hook
states (PowerSGD's rank, crashed both alike), different
shard modes (shard='gradients' reduce-scatters each bucket, which cannot
pair with an all-reduce: found waiting the whole timeout, then blaming a
missing rank), and ranks stepping with different
optimizer settings (the sharded step's all-gather makes the parameters
equal again, so the checksum cannot see it: found training 40 steps
silently). Each is named on every rank, with every rank's value; and a
process that caught the named error ends with it and exit code 0, not in
gloo's abort (found: SIGABRT from a gloo::IoException at exit)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from spawn import environment, free_port, launch, write
from torch import nn

import pyddp

pytestmark = pytest.mark.multiprocess
TIMEOUT_S = 120  # a hang would end here, and read "missing: rank ..."


def _mode(text: str):
    return {"False": False, "True": True}.get(text, text)


def _train(out: dict, make, steps: int = 6, skip: int = -1) -> None:
    """Trains this rank's model, records the error (or None), and ends the
    process as a user's script would: returning from main."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    dm = pyddp.wrap(
        nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), ["cpu"], timeout_s=TIMEOUT_S
    )
    try:
        opt, sched = make(dm)
        for k in range(steps):
            opt.zero_grad()
            nn.functional.mse_loss(dm(x), y).backward()
            if k != skip:
                opt.step()
            if sched is not None:
                sched()
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    write(out)


def shard_modes(out: dict) -> None:
    mode = _mode(os.environ["SCENARIO_MODES"].split(",")[pyddp.rank()])
    _train(out, lambda dm: (dm.optimizer(torch.optim.SGD, shard=mode, lr=0.1), None))


@pytest.mark.parametrize(
    "modes", ["gradients,False", "True,gradients", "False,True", "gradients,gradients"]
)
def test_ranks_with_different_shard_modes_are_named(tmp_path, modes):
    run = launch(shard_modes, env={"SCENARIO_MODES": modes}, out=tmp_path, agent=False)
    got = [run.result(r) for r in range(2)]
    a, b = (_mode(m) for m in modes.split(","))
    if a == b:
        assert [r["error"] for r in got] == [None, None], got
    else:
        for r in got:
            error = r["error"] or ""
            assert f"rank 0 shard={a!r}, rank 1 shard={b!r}" in error, error
            assert "missing" not in error, error
    _ended_cleanly(run)


def hooks(out: dict) -> None:
    """Each rank registers its own communication hook (or none) on a wrapped
    model, or on a GradSync (`SCENARIO_SYNC`)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    named = {"fp16": "fp16", "bf16": default_hooks.bf16_compress_hook,
             "allreduce": default_hooks.allreduce_hook}  # fmt: skip
    mine = os.environ["SCENARIO_HOOKS"].split(",")[pyddp.rank()]
    hook, state = named.get(mine), None
    if mine.startswith("psgd"):  # psgd-rank-start-seed
        rank, start, seed = (int(v) for v in mine.split("-")[1:])
        hook = psgd.powerSGD_hook
        state = psgd.PowerSGDState(
            None, matrix_approximation_rank=rank, start_powerSGD_iter=start, random_seed=seed
        )

    def register(dm):
        if hook is not None:
            dm.register_comm_hook(state, hook)
        return dm

    if not os.environ.get("SCENARIO_SYNC"):
        _train(out, lambda dm: (torch.optim.SGD(register(dm).parameters(), lr=0.1), None))
        return
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    sync = pyddp.GradSync([model], timeout_s=TIMEOUT_S)
    try:
        register(sync)
        for _ in range(3):
            nn.functional.mse_loss(model(torch.randn(8, 6)), torch.randn(8, 3)).backward()
            sync.finish()
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    write(out)


@pytest.mark.parametrize(
    "hooks_, sync",
    [
        ("fp16,none", ""),
        ("none,bf16", ""),
        ("fp16,allreduce", "1"),
        ("fp16,fp16", ""),
        ("bf16,bf16", "1"),
    ],  # fmt: skip
)
def test_ranks_with_different_communication_hooks_are_named(tmp_path, hooks_, sync):
    # Found: one rank with torch's fp16 hook, the other with none, crashed
    # both processes in gloo (SIGABRT: "Received data size doesn't match").
    env = {"SCENARIO_HOOKS": hooks_, "SCENARIO_SYNC": sync}
    run = launch(hooks, env=env, out=tmp_path, agent=False)
    got = [run.result(r) for r in range(2)]
    a, b = hooks_.split(",")
    if a == b:
        assert [r["error"] for r in got] == [None, None], got
    else:
        for r in got:
            error = r["error"] or ""
            assert "the ranks registered different communication hooks" in error, error
            assert f"rank 0: {_hook_name(a)}, rank 1: {_hook_name(b)}" in error, error
    _ended_cleanly(run)


@pytest.mark.parametrize(
    "hooks_, sync, differ",
    [
        ("psgd-1-2-0,psgd-2-2-0", "", "approximation_rank=1; rank 1: matrix_approximation_rank=2"),
        ("psgd-1-2-0,psgd-1-5-0", "1", "start_powerSGD_iter=2; rank 1: start_powerSGD_iter=5"),
        ("psgd-1-2-0,psgd-1-2-0", "", None),
        ("psgd-1-2-0,psgd-1-2-7", "", None),  # seeds: every rank still sums the same
    ],  # fmt: skip
)
def test_ranks_with_different_hook_states_are_named(tmp_path, hooks_, sync, differ):
    # Found: PowerSGD with rank 1 on one rank and rank 2 on the other (or
    # different start steps) crashed both processes in gloo (SIGABRT).
    env = {"SCENARIO_HOOKS": hooks_, "SCENARIO_SYNC": sync}
    run = launch(hooks, env=env, out=tmp_path, agent=False)
    got = [run.result(r) for r in range(2)]
    if differ is None:
        assert [r["error"] for r in got] == [None, None], got
    else:
        for r in got:
            error = r["error"] or ""
            assert "powerSGD_hook.powerSGD_hook with different states (rank 0: " in error, error
            assert differ in error, error
    _ended_cleanly(run)


def _hook_name(name: str) -> str:
    if name == "none":
        return "none"
    return f"torch.distributed.algorithms.ddp_comm_hooks.default_hooks.{name}_" + (
        "hook" if name == "allreduce" else "compress_hook"
    )


def _ended_cleanly(run) -> None:
    # Each process ended by returning from its scenario: no abort in gloo.
    for rank in range(2):
        assert "terminate called" not in run.log(rank), run.tail(rank)
    assert run.codes == [0, 0], (run.codes, run.tail(0), run.tail(1))


def optimizer_settings(out: dict) -> None:
    case, rank = os.environ["SCENARIO_CASE"], pyddp.rank()

    def make(dm):
        if case == "scheduler on rank 0":
            opt = dm.optimizer(torch.optim.AdamW, shard=True, lr=0.01)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
            return opt, (sched.step if rank == 0 else None)
        if case.startswith("skipped step"):
            return dm.optimizer(torch.optim.SGD, shard=_mode(case.split()[-1]), lr=0.01), None
        if case.startswith("loaded on rank 0"):
            # The usual `if rank == 0: opt.load_state_dict(...)`: the sharded
            # step's all-gather keeps the parameters equal, so rank 1 stepped
            # its share with other Adam moments, silently (found in review).
            opt = dm.optimizer(torch.optim.Adam, shard=_mode(case.split()[-1]), lr=0.01)
            saved = torch.optim.Adam(dm.module.parameters(), lr=0.01)
            for p in dm.module.parameters():
                saved.state[p] = {"step": torch.tensor(9.0), "exp_avg": torch.ones_like(p),
                                  "exp_avg_sq": torch.ones_like(p)}  # fmt: skip
            if rank == 0:
                opt.load_state_dict(saved.state_dict())
            return opt, None
        cls = torch.optim.AdamW if rank == 0 else torch.optim.SGD
        return dm.optimizer(cls, shard="gradients", lr=0.01), None

    _train(out, make, skip=2 if case.startswith("skipped step") and rank == 1 else -1)


@pytest.mark.parametrize(
    "case,field",
    [
        ("scheduler on rank 0", "optimizer settings"),
        ("AdamW and SGD", "optimizer settings"),
        ("skipped step True", ""),
        ("skipped step gradients", ""),
        ("loaded on rank 0 True", "optimizer settings"),
        ("loaded on rank 0 gradients", "optimizer settings"),
    ],
)
def test_ranks_stepping_with_different_optimizer_settings_are_named(tmp_path, case, field):
    run = launch(optimizer_settings, env={"SCENARIO_CASE": case}, out=tmp_path, agent=False)
    for r in (run.result(0), run.result(1)):
        error = r["error"] or ""
        assert "pyddp" in error and "missing" not in error, error
        if field:
            assert "did different work" in error and field in error, error
            assert "a learning rate a scheduler changed on one rank only" in error, error
            assert "an optimizer state dict loaded on one rank only" in error, error
    _ended_cleanly(run)


_SCRIPT = """
import sys, torch, pyddp
from torch import nn
pyddp.init()
rank = pyddp.rank()
torch.manual_seed(0)
x, y = torch.randn(8, 6), torch.randn(8, 3)
dm = pyddp.wrap(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), ["cpu"])
shard = "gradients" if sys.argv[1] == "gradients" else True
opt = dm.optimizer(torch.optim.SGD, shard=shard, lr=0.1)
for k in range(6):
    opt.zero_grad()
    nn.functional.mse_loss(dm(x), y).backward()
    if not (rank == 1 and k == 2):  # rank 1 skips a step: named, uncaught
        opt.step()
"""


@pytest.mark.parametrize("shard", ["state", "gradients"])
def test_a_script_ending_in_a_named_failure_exits_with_it_not_in_gloos_abort(tmp_path, shard):
    # As a user's script ends: the named error uncaught. Pending gloo
    # operations (each rank stopped at another exchange) used to fail at
    # exit on gloo's threads and abort both processes (SIGABRT).
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
         f"--master-port={free_port()}", str(script), shard],
        env=environment({"PYDDP_TIMEOUT_S": str(TIMEOUT_S)}), cwd=tmp_path,
        capture_output=True, text=True, timeout=4 * TIMEOUT_S,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 1, output[-3000:]
    assert "not at the same exchange" in output, output[-3000:]
    assert "terminate called" not in output and "SIGABRT" not in output, output[-3000:]
    # Both ranks' exits as torchrun reports them: with the error (status 1),
    # or, for a rank still on its way to raising when the other one exited,
    # stopped by torchrun itself (SIGTERM, -15): which one it is depends on
    # timing; an abort (-6) or a crash never.
    codes = re.findall(r"exitcode  : (-?\d+) ", output)
    assert len(codes) == 2 and "1" in codes, output[-3000:]
    assert set(codes) <= {"1", "-15"}, output[-3000:]
