"""Failures across processes: a rank killed (in a backward, in join(), in a
SyncBatchNorm meeting), stalled, stopped or never wrapping; a forward that
raises on one rank; uneven inputs without join(); the store host or a whole
node stopped; text someone else wrote in the store. The survivors must raise
pyddp's error naming the rank, within the timeout (most scenarios start the
ranks without torchrun's agent, which would stop the survivors first). And
the exits: torchrun's root cause, gloo work in flight at exit."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from spawn import (
    command,
    environment,
    expect_failure,
    free_port,
    launch,
    result,
    write,
    write_and_exit,
)
from torch import nn

import pyddp

pytestmark = pytest.mark.multiprocess


def killed(out: dict) -> None:
    """Rank 1 dies inside its second backward; the others must fail fast,
    naming it and the bucket they were reducing."""
    rank = pyddp.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    step = [0]
    if rank == 1:
        model[0].weight.register_hook(lambda g: os._exit(3) if step[0] == 1 else g)
    dm = pyddp.wrap(model, ["cpu"], bucket_cap_mb=0)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    for step[0] in range(3):
        t0 = time.monotonic()
        try:
            nn.functional.mse_loss(dm(x), y).backward()
            opt.step()
            opt.zero_grad()
        except pyddp.ReduceError as e:
            out["error"] = f"{type(e).__name__}: {e}"
            out["seconds"] = time.monotonic() - t0
            return
    out["error"] = None


def test_a_killed_rank_is_named_quickly(tmp_path):
    run = launch(killed, out=tmp_path, env={"PYDDP_TIMEOUT_S": "60"}, agent=False)
    assert run.codes[1] == 3  # rank 1 died on purpose
    r0 = run.result(0)
    assert r0["error"] is not None, "rank 0 must not hang or succeed"
    # Seen by a bucket's reduction or by the agreement at the end of backward.
    where = "bucket" in r0["error"] or "the agreement at the end" in r0["error"]
    assert "missing: rank 1" in r0["error"] and where, r0["error"]
    assert r0["seconds"] < 30, "a dead peer is seen long before the timeout"


def killed_in_join(out: dict) -> None:
    """Rank 1 dies while rank 0, out of batches, waits in dmodel.join()
    (torch's Join's all-reduces, pyddp's shadowed steps): rank 0 must name
    it, not report gloo's "Connection reset"."""
    rank = pyddp.rank()
    torch.manual_seed(0)
    dm = pyddp.wrap(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)), ["cpu"])
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    x, y = torch.randn(8, 6), torch.randn(8, 3)

    def run() -> None:
        with dm.join():
            for step in range(1 if rank == 0 else 4):
                if rank == 1 and step == 2:
                    time.sleep(1.0)  # rank 0 is in its join loop by now
                    os._exit(3)
                nn.functional.mse_loss(dm(x), y).backward()
                opt.step()
                opt.zero_grad()

    expect_failure(out, run)


def killed_in_syncbn(out: dict) -> None:
    """Rank 1 dies in its second forward, before SyncBatchNorm's meeting
    that rank 0 waits in: rank 0 must name it."""
    rank = pyddp.rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    dm = pyddp.wrap(pyddp.convert_sync_batchnorm(model), ["cpu"])
    step = [0]
    if rank == 1:
        model[0].register_forward_hook(lambda *a: os._exit(3) if step[0] == 1 else None)
    opt = dm.optimizer(torch.optim.SGD, lr=0.1)
    x, y = torch.randn(8, 6), torch.randn(8, 3)

    def run() -> None:
        for step[0] in range(3):
            nn.functional.mse_loss(dm(x), y).backward()
            opt.step()
            opt.zero_grad()

    expect_failure(out, run)


@pytest.mark.parametrize("scenario", ["killed_in_join", "killed_in_syncbn"])
def test_a_rank_killed_in_join_or_a_syncbatchnorm_meeting_is_named(tmp_path, scenario):
    # Issue 30, item 14: gloo's raw "Connection reset" / "Timed out", no rank.
    run = launch(f"{__name__}:{scenario}", out=tmp_path, env={"PYDDP_TIMEOUT_S": "30"}, agent=False)
    assert run.codes[1] == 3  # rank 1 died on purpose
    r0 = run.result(0)
    assert r0["error"] is not None, "rank 0 must not hang or succeed"
    assert "missing: rank 1" in r0["error"], r0["error"]


class _Escape(BaseException):
    """Not caught by main(): the process ends with it, as a user's would."""


def named_exit(out: dict) -> None:
    """Rank 0 alone in eval(): every rank's synced backward raises pyddp's
    named error, and the processes end with it (uncaught): torchrun's root
    cause must read pyddp's message (tested from torchrun's own report)."""
    torch.manual_seed(0)
    dm = pyddp.wrap(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), ["cpu"])
    if pyddp.rank() == 0:
        dm.eval()
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    try:
        nn.functional.mse_loss(dm(x), y).backward()
    except pyddp.ReduceError as e:
        raise _Escape("the named error ends the process") from e


def test_torchrun_reports_pyddps_named_error_as_the_root_cause(tmp_path):
    # Issue 30, item 15: the launcher's summary read "Signal 6" (a gloo
    # thread aborting once the peer closed) or "To enable traceback see".
    run = launch(named_exit, out=tmp_path, env={"PYDDP_TIMEOUT_S": "20"})
    assert run.returncode != 0
    root = run.stderr[run.stderr.index("Root Cause") :]
    assert "pyddp: across 2 processes" in root, root[-2000:]
    assert "Signal 6" not in root and "To enable traceback" not in root.split("Other")[0]


def stalled(out: dict) -> None:
    """Rank 1 stops arriving (sleeps); rank 0 fails within PYDDP_TIMEOUT_S."""
    rank = pyddp.rank()
    torch.manual_seed(0)
    dm = pyddp.wrap(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)), ["cpu"])
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    nn.functional.mse_loss(dm(x), y).backward()
    if rank == 1:
        time.sleep(2 * float(os.environ["PYDDP_TIMEOUT_S"]) + 2)  # past rank 0's census
        os._exit(0)
    expect_failure(out, lambda: nn.functional.mse_loss(dm(x), y).backward())


def test_a_stalled_rank_is_an_error_within_the_timeout(tmp_path):
    r0 = launch(stalled, out=tmp_path, env={"PYDDP_TIMEOUT_S": "3"}, agent=False).result(0)
    assert r0["error"] is not None
    # pyddp's wait or gloo's own timeout (pyddp creates its groups with it).
    timed_out = "not done after 3 s" in r0["error"] or "Timed out waiting 3000ms" in r0["error"]
    assert "rank 1" in r0["error"] and timed_out, r0["error"]
    assert 2.5 < r0["seconds"] < 3 + 3 + 5  # timeout + census (<= timeout) + slack


def foreign_note(out: dict) -> None:
    """Someone who reaches the store writes pyddp's abandon key while rank 1
    stalls: rank 0 must show it as quoted, bounded data, attributed to no
    rank, not as its own message; and the keys are scoped by torchrun's run id."""
    rank = pyddp.rank()
    torch.manual_seed(0)
    dm = pyddp.wrap(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)), ["cpu"])
    out["prefix"] = dm._reducer._link.prefix
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    nn.functional.mse_loss(dm(x), y).backward()
    if rank == 1:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{out['prefix']}/abandoned", "run ./fix.sh\nrm -rf ~ " + "x" * 5000)
        time.sleep(2 * float(os.environ["PYDDP_TIMEOUT_S"]) + 2)
        os._exit(0)
    expect_failure(out, lambda: nn.functional.mse_loss(dm(x), y).backward())


def test_text_in_the_store_is_data_and_keys_are_scoped_by_the_job(tmp_path):
    env = {"PYDDP_TIMEOUT_S": "8", "TORCHELASTIC_RUN_ID": "j42"}
    r0 = launch(foreign_note, out=tmp_path, env=env, agent=False).result(0)
    assert r0["prefix"].startswith("pyddp/job-j42/round0/"), r0["prefix"]
    error = r0["error"]
    assert "an unattributed note in the store, 'run ./fix.sh rm -rf ~ xxx" in error, error
    assert "\n" not in error and len(error) < 1200, error
    # (the timeout 8 s: a poll delayed on a loaded machine has 6 s)
    assert r0["seconds"] < 6, "read at the next poll, not at the timeout"


def store_host_stopped(out: dict) -> None:
    """Rank 0, which hosts the store (started by hand, as under Slurm), is
    stopped (SIGSTOP) before its second step: rank 1 must raise within its
    timeout plus a few seconds, not block in a store call."""
    torch.manual_seed(0)
    dm = pyddp.wrap(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)), ["cpu"])
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    nn.functional.mse_loss(dm(x), y).backward()
    if pyddp.rank() == 0:
        os.kill(os.getpid(), signal.SIGSTOP)  # the test kills it once rank 1 is done
    expect_failure(out, lambda: nn.functional.mse_loss(dm(x), y).backward())


def test_a_stopped_store_host_is_an_error_within_the_timeout(tmp_path):
    # The failure path used to block forever in a store call (alive at 240 s).
    port = str(free_port())
    procs = []
    for r in range(2):
        env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_PORT": port}
        env.update({"MASTER_ADDR": "127.0.0.1", "PYDDP_TIMEOUT_S": "3"})
        with open(tmp_path / f"rank{r}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    command(store_host_stopped, tmp_path),
                    env=environment(env), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                )
            )  # fmt: skip
    try:
        assert procs[1].wait(timeout=60) == 0, (tmp_path / "rank1.log").read_text()[-2000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    r1 = result(store_host_stopped, tmp_path, 1)
    assert r1["error"] is not None and "synced backward 2" in r1["error"], r1["error"]
    assert r1["seconds"] < 3 + 5 + 5, r1  # timeout + one store deadline + slack


def late_wrap(out: dict) -> None:
    """Rank 1 stalls before wrap: rank 0's wrap must name it within the
    timeout (it used to end in a raw DistStoreError naming store keys)."""
    if pyddp.rank() == 1:
        time.sleep(2 * float(os.environ["PYDDP_TIMEOUT_S"]) + 2)
        os._exit(0)
    expect_failure(out, lambda: pyddp.wrap(nn.Linear(4, 3), ["cpu"]))


def test_a_rank_that_never_wraps_is_named(tmp_path):
    r0 = launch(late_wrap, out=tmp_path, env={"PYDDP_TIMEOUT_S": "3"}, agent=False).result(0)
    assert r0["error"] and "rank 1 never arrived" in r0["error"], r0["error"]
    assert r0["seconds"] < 3 + 5, r0


def node_loop(out: dict) -> None:
    """Trains until stopped; writes READY_DIR/ready<rank> after a few steps
    and READY_DIR/error<rank> (JSON: time, error) when a step fails."""
    rank, folder = pyddp.rank(), os.environ["READY_DIR"]
    torch.manual_seed(0)
    dm = pyddp.wrap(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)), ["cpu"])
    opt = dm.optimizer(torch.optim.SGD, lr=0.01)
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    try:
        for step in range(1_000_000):
            nn.functional.mse_loss(dm(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step == 10:
                with open(os.path.join(folder, f"ready{rank}"), "w") as f:
                    f.write(str(os.getpid()))
            time.sleep(0.01)
    except Exception as e:  # noqa: BLE001 - reported to the test
        with open(os.path.join(folder, f"error{rank}"), "w") as f:
            json.dump({"time": time.time(), "error": str(e)}, f)
        os._exit(1)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_stopped_node_leaves_the_other_node_raising_within_the_timeout(tmp_path):
    # Two torchrun "nodes" (c10d rendezvous, hosted by node 0's agent): node 0's
    # agent and worker are stopped (SIGSTOP) mid-training. Node 1's worker used
    # to be still alive at +120 s; it must raise within timeout + a few seconds.
    import signal
    import time

    port = free_port()
    agents = []
    for n in range(2):
        args = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
        args += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=stop"]
        args += command(node_loop, tmp_path)[1:]
        env = environment({"PYDDP_TIMEOUT_S": "4", "READY_DIR": str(tmp_path)})
        with open(tmp_path / f"node{n}.log", "w") as log:
            agents.append(
                subprocess.Popen(args, env=env, cwd=tmp_path, stdout=log, stderr=log,
                                 start_new_session=True)
            )  # fmt: skip
        time.sleep(1)  # node 0's agent hosts the rendezvous store
    try:
        deadline = time.time() + 120
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert time.time() < deadline, (tmp_path / "node1.log").read_text()[-2000:]
            time.sleep(0.2)
        workers = [int((tmp_path / f"ready{r}").read_text()) for r in range(2)]
        node0 = next(a for a in agents if _parent(workers[0]) == a.pid)
        os.kill(node0.pid, signal.SIGSTOP)  # node 0's agent (hosting the store)...
        os.kill(workers[0], signal.SIGSTOP)  # ...and its worker, rank 0
        stopped = time.time()
        while not (tmp_path / "error1").exists():
            assert time.time() < stopped + 60, "the other node's worker did not raise"
            time.sleep(0.2)
        failure = json.loads((tmp_path / "error1").read_text())
    finally:
        for r in range(2):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int((tmp_path / f"ready{r}").read_text()), signal.SIGKILL)
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
    assert failure["time"] - stopped < 4 + 2 * 5 + 3, failure  # timeout + store deadlines
    assert "rank 1" in failure["error"], failure


def uneven(out: dict) -> None:
    """Rank 1 has one batch fewer and then waits in a barrier of its own:
    rank 0 fails within the timeout naming it; nothing pairs the barrier
    with a bucket reduction (pyddp reduces on a group of its own)."""
    rank = pyddp.rank()
    torch.manual_seed(0)
    dm = pyddp.wrap(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), ["cpu"])
    x, y = torch.randn(4, 6), torch.randn(4, 3)

    def run() -> None:
        for _ in range(3 if rank == 0 else 2):
            nn.functional.mse_loss(dm(x), y).backward()
        dist.barrier()

    expect_failure(out, run)


def test_uneven_inputs_fail_within_the_timeout_naming_the_rank(tmp_path):
    run = launch(uneven, out=tmp_path, env={"PYDDP_TIMEOUT_S": "3"}, agent=False)
    r0, r1 = run.result(0), run.result(1)
    assert r0["error"] and "rank 1" in r0["error"] and "same number of steps" in r0["error"]
    assert r1["error"], "rank 1's barrier must not be fed by rank 0's reduction"
    assert r0["seconds"] < 3 + 3 + 5


def raises(out: dict) -> None:
    """Rank 1's forward raises at step 1 and the script carries on: rank 0 must
    fail at once (not pair its step 1 with rank 1's step 2), rank 1 must refuse
    its next step."""
    rank = pyddp.rank()
    torch.manual_seed(0)
    dm = pyddp.wrap(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), ["cpu"])
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    errors = []
    t0 = time.monotonic()
    for step in range(3):
        try:
            if rank == 1 and step == 1:
                dm(torch.randn(4, 5))  # wrong width: the forward raises
            nn.functional.mse_loss(dm(x), y).backward()
        except Exception as e:  # noqa: BLE001 - a user script that carries on
            errors.append(f"{type(e).__name__}: {e}")
    out["errors"] = errors
    out["seconds"] = time.monotonic() - t0
    write_and_exit(out)


def test_a_forward_that_raises_on_one_rank_fails_the_others_at_once(tmp_path):
    run = launch(raises, out=tmp_path, env={"PYDDP_TIMEOUT_S": "30"}, agent=False)
    r0, r1 = run.result(0), run.result(1)
    assert r0["errors"] and "abandoned" in r0["errors"][0], r0
    assert r0["seconds"] < 15, "told through the store, not at the 30 s timeout"
    assert len(r1["errors"]) >= 2 and "abandoned" in r1["errors"][1], r1  # refuses step 2


def exit_in_flight(out: dict) -> None:
    """Exits with the group up and a gloo all-reduce still in flight, as a
    script whose trainer never destroys its group does: the process must exit
    0 (gloo's worker thread used to release the tensors during interpreter
    finalization and abort it; pyddp's exit handler gives it the time).
    SCENARIO_SETTLE_S overrides that time (0: the control that shows the abort)."""
    if "SCENARIO_SETTLE_S" in os.environ:
        pyddp.runtime.torchrun.GLOO_SETTLE_S = float(os.environ["SCENARIO_SETTLE_S"])
    for _ in range(5):
        dist.all_reduce(torch.ones(3))
    for _ in range(4):
        dist.all_reduce(torch.ones(1000), async_op=True)  # no reference kept, never waited
    write(out)
    sys.exit(0)  # past the harness's destroy_process_group: interpreter exit with the group up


def test_a_process_exits_cleanly_with_its_group_up_and_gloo_work_in_flight(tmp_path):
    # Without pyddp's exit handler (SCENARIO_SETTLE_S=0) both ranks abort
    # ("terminate called without an active exception") in 10 runs of 10 here.
    for run in range(2):
        codes = launch(exit_in_flight, out=tmp_path, agent=False).codes
        logs = [(tmp_path / f"exit_in_flight.rank{r}.log").read_text() for r in range(2)]
        assert codes == [0, 0], (run, codes, logs)
        assert not any("terminate called" in log for log in logs), logs


def test_a_worker_whose_group_was_destroyed_still_lets_gloo_settle_at_exit(monkeypatch):
    # Accelerate's end_training() destroys the group while its DDP model still
    # holds it: the exit handler must wait in any worker launched as one of
    # several, group up or not (Accelerate's own DDP run aborted in 2 of 5
    # exits under load without this).
    slept = []
    monkeypatch.setattr(pyddp.runtime.torchrun.time, "sleep", slept.append)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    pyddp.runtime.torchrun._let_gloo_settle()
    assert slept == [pyddp.runtime.torchrun.GLOO_SETTLE_S]
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process, no group: exits at once
    pyddp.runtime.torchrun._let_gloo_settle()
    assert slept == [pyddp.runtime.torchrun.GLOO_SETTLE_S]


def test_init_without_torchrun_environment_says_how_to_launch(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="torchrun") as e:
        pyddp.init()
    assert "RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not set" in str(e.value)
    assert pyddp.rank() == 0 and pyddp.world() == 1  # one process, as before
    # Set, but not what torchrun sets: named before any rendezvous is tried.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    for rank, world, local, said in (
        ("-1", "2", "0", "RANK='-1' is not a non-negative int"),
        ("0", "two", "0", "WORLD_SIZE='two' is not a non-negative int"),
        ("2", "2", "0", "RANK=2 is not below WORLD_SIZE=2"),
        ("0", "0", "0", "RANK=0 is not below WORLD_SIZE=0"),
    ):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", world)
        monkeypatch.setenv("LOCAL_RANK", local)
        with pytest.raises(RuntimeError, match=re.escape(said)):
            pyddp.init()
        assert not torch.distributed.is_initialized()


def caught_then_exits(out: dict) -> None:
    """Rank 1's forward raises; both ranks catch the failure and end as a
    trainer does: sys.exit(3), with an exit handler of their own and a file
    left open with a line buffered."""
    import atexit

    rank = pyddp.rank()
    folder = os.environ["SCENARIO_FOLDER"]
    atexit.register(lambda: open(os.path.join(folder, f"atexit.rank{rank}"), "w").close())
    log = open(os.path.join(folder, f"metrics.rank{rank}.csv"), "w")  # noqa: SIM115
    log.write("step,loss\n")
    dm = pyddp.wrap(nn.Linear(6, 3), ["cpu"])
    try:
        for step in range(3):
            x = torch.randn(4, 5 if rank == 1 and step == 1 else 6)  # rank 1: a bad batch
            dm(x).sum().backward()
    except Exception as e:  # noqa: BLE001 - a trainer that reports and exits
        out["error"] = f"{type(e).__name__}: {e}"
    write(out)
    sys.exit(3)


def test_a_process_that_exits_after_a_caught_failure_keeps_its_status_and_exit_work(tmp_path):
    # Found by a probe: after a failure, pyddp ends the process with
    # os._exit (gloo would abort it in the interpreter's teardown), which
    # read 0 after sys.exit(3) (torchrun, a scheduler, --max-restarts saw a
    # success; Lightning's exit 1 after a Ctrl-C read 0 too), ran none of the
    # script's exit handlers and lost what open files buffered.
    run = launch(caught_then_exits, out=tmp_path, agent=False,
                 env={"PYDDP_TIMEOUT_S": "30", "SCENARIO_FOLDER": str(tmp_path)})  # fmt: skip
    assert run.codes == [3, 3], (run.codes, run.tail(0), run.tail(1))
    for r in range(2):
        assert "abandoned" in run.result(r)["error"] or "mat1" in run.result(r)["error"]
        assert (tmp_path / f"atexit.rank{r}").exists(), run.tail(r)
        assert (tmp_path / f"metrics.rank{r}.csv").read_text() == "step,loss\n"
        assert "terminate called" not in run.log(r)
