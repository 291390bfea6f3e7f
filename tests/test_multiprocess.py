"""pyddp across processes on localhost: torchrun (torch.distributed.run) starts
2-3 processes running tests/multiprocess/scenarios.py; each rank writes what
it measured, checked here against single-device training and torch DDP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

import pyddp

pytestmark = pytest.mark.multiprocess

SCENARIOS = Path(__file__).parent / "multiprocess" / "scenarios.py"
TOL = 1e-6  # float32 sums over shards and processes associate differently


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    # The package under test: the installed one, or this checkout's when it
    # holds a build (tests run from the repository root).
    root = str(Path(pyddp.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYDDP_TIMEOUT_S", "60")
    env.update(extra or {})
    return env


def torchrun(
    scenario: str,
    out: Path,
    nproc: int = 2,
    env: Optional[Dict[str, str]] = None,
    extra_args: Optional[List[str]] = None,
    timeout: float = 240,
) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    args += extra_args or [f"--master-port={_free_port()}"]
    args += [str(SCENARIOS), scenario, str(out)]
    return subprocess.run(
        args, env=_env(env), capture_output=True, text=True, timeout=timeout, cwd=out
    )


def env_launch(scenario: str, out: Path, nproc: int, env: Dict[str, str]) -> List[int]:
    """Starts the ranks with torch.distributed's env:// variables set, without
    torchrun: its agent would stop the survivors as soon as one rank dies,
    and these tests check what the survivors see. Returns the exit codes."""
    port = str(_free_port())
    procs = []
    for r in range(nproc):
        rank_env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc)}
        rank_env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **env})
        with open(out / f"{scenario}.rank{r}.log", "w") as log:  # a pipe could fill and block
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(SCENARIOS), scenario, str(out)],
                    env=_env(rank_env),
                    cwd=out,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return [p.wait(timeout=240) for p in procs]


def results(out: Path, scenario: str, world: int) -> List[dict]:
    got = []
    for r in range(world):
        path = out / f"{scenario}.rank{r}.json"
        assert path.exists(), f"rank {r} wrote nothing"
        data = json.loads(path.read_text())
        assert "exception" not in data, data["exception"]
        got.append(data)
    return got


@pytest.fixture(scope="module")
def basics(tmp_path_factory):
    """One 2-process group runs all_reduce, the model mismatch check and the
    equivalence checks (each torchrun launch costs seconds)."""
    out = tmp_path_factory.mktemp("basics")
    run = torchrun("basics", out, 2, {"LOCAL_REPLICAS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return results(out, "basics", 2)


@pytest.mark.parametrize("nproc,local", [(2, 1), (2, 2), (3, 1)])
def test_processes_equal_single_device_and_torch_ddp(tmp_path, basics, nproc, local):
    if (nproc, local) == (2, 1):
        got = basics
    else:
        run = torchrun("equivalence", tmp_path, nproc, {"LOCAL_REPLICAS": str(local)})
        assert run.returncode == 0, run.stderr[-3000:]
        got = results(tmp_path, "equivalence", nproc)
    for r in got:
        assert r["world"] == nproc
        for cap in ("0", "25"):  # per-parameter and bucketed
            assert r[f"wrap_loss_cap{cap}"] <= TOL
            assert r[f"never_none_cap{cap}"], "unused everywhere must stay None"
            assert r[f"stats_cap{cap}"] >= 0.0  # the agreement's cost is measured
        assert r["uneven_grad"] <= TOL, "dmodel.loss must weigh an uneven global batch"
        assert r["uneven_global_loss"] <= TOL
        # Global batches of changing size, rows assumed and corrected after
        # the buckets: equal to one device; exchanges only where needed.
        assert r["weighing_grad"] <= TOL and r["weighing_params"] <= TOL, r
        assert r["weighing_loss"] <= TOL, r
        # Per micro-batch: 1 buffer broadcast after its synced backward
        # (BatchNorm; none after the no_sync() micro-batch, torch DDP's rule),
        # + the rows exchange at the first step, after rows changed (step 4)
        # and in the no_sync() window (both micro-batches), + the bucket plan
        # after the first step. Steady steps: the broadcast alone.
        assert r["weighing_exchanges"] == [3, 1, 1, 2, 1, 2, 1], r["weighing_exchanges"]
        assert r["gradsync_rare"] <= TOL, "used on one rank only: reduced everywhere"
        assert r["gradsync_rare_has_grad"] and r["gradsync_never_none"]
        assert r["replicas_equal"]
        assert r["buffers_equal_across_ranks"] and r["buffers_moved"]
        assert r["vs_ddp"] <= TOL


def test_different_models_are_refused_at_wrap_naming_rank_and_parameter(basics):
    for r in basics:
        assert "rank 1" in r["error"] and "weight" in r["error"], r["error"]
        assert "(3, 4)" in r["error"] and "(5, 4)" in r["error"], r["error"]


def test_settings_that_differ_across_ranks_are_refused_at_wrap(basics):
    for r in basics:
        for name, error in r["settings"].items():
            assert error is not None, name
            assert f"rank 1 has setting {name}=" in error and "rank 0 has setting" in error, error


def test_a_syncbatchnorm_forward_on_one_rank_is_named_on_every_rank(tmp_path):
    """Issue 30, item 7 (tests/multiprocess/scenarios.py `syncbn_alone`):
    SyncBatchNorm's exchanges carry a header like the control exchanges."""
    run = torchrun("syncbn_alone", tmp_path, 2, {"PYDDP_TIMEOUT_S": "20"})
    assert run.returncode == 0, run.stderr[-3000:]  # no SIGABRT
    for r in results(tmp_path, "syncbn_alone", 2):
        assert r["error"] and "do not pair across ranks" in r["error"], r
        assert "a forward without grad" in r["error"] and "a forward with grad" in r["error"]


@pytest.mark.parametrize("replicas", [1, 2])
def test_sharded_optimizer_state_across_processes(tmp_path, replicas):
    # dmodel.optimizer(AdamW, shard=True) over 2 processes x `replicas`:
    # bitwise the unsharded optimizer (and torch's ZeroRedundancyOptimizer
    # under torch DDP), state per replica a share of one copy.
    run = torchrun("zero", tmp_path, 2, {"SCENARIO_REPLICAS": str(replicas)})
    assert run.returncode == 0, run.stderr[-3000:]
    check_zero(results(tmp_path, "zero", 2), replicas)


def check_zero(got: List[dict], replicas: int) -> None:
    """The zero scenario's results (also on simulated GPUs: test_simgpu.py)."""
    for r in got:
        assert r["vs_unsharded"] == 0.0 and r["replicas_equal"], r
        assert r["vs_one_device"] <= TOL, r
        assert r["state_keys_equal"] and r["state_diff"] == 0.0, r
        assert r["resumed"] == 0.0, r
        if replicas == 1:
            assert r["vs_torch_zero"] <= TOL, r
    shares, full = [b for r in got for b in r["bytes_sharded"]], got[0]["bytes_unsharded"][0]
    assert full <= sum(shares) <= full + 64 * len(shares)  # scalar step counts of cut pieces
    # Net's `never` (and `rare` on some steps) has no gradient, hence no state:
    # the slots' shares of elements are equal, their state need not be.
    assert max(shares) < 0.8 * full


def test_all_reduce_across_processes(basics):
    for r in basics:
        assert (
            r["sum"] == [1.0 + 2.0 + 3.0 + 4.0] * 3
        )  # 2 tensors per rank, rank r fills 2r+1, 2r+2
        assert r["avg"] == [2.5] * 3


def test_a_subgroup_then_every_process(tmp_path):
    run = torchrun("subgroup", tmp_path, 3, {"PYDDP_TIMEOUT_S": "20"})
    assert run.returncode == 0, run.stderr[-3000:]
    got = results(tmp_path, "subgroup", 3)
    assert got[0]["sub"] <= TOL and got[1]["sub"] <= TOL
    assert "not in the group" in got[2]["not_member"]
    assert all(r["all"] <= TOL for r in got)


def test_two_models_in_one_backward_do_not_mix_their_buckets(tmp_path):
    run = torchrun("two_models", tmp_path, 2)
    assert run.returncode == 0, run.stderr[-3000:]
    for r in results(tmp_path, "two_models", 2):
        assert r["worst"] <= TOL


@pytest.mark.parametrize("replicas", [1, 2])
def test_sync_batchnorm_across_processes_equals_one_device(tmp_path, replicas):
    # torch's SyncBatchNorm refuses CPU tensors, so the reference is one
    # device running BatchNorm on the global batch (every rank trains it).
    run = torchrun("syncbn", tmp_path, 2, {"SCENARIO_REPLICAS": str(replicas)})
    assert run.returncode == 0, run.stderr[-3000:]
    for r in results(tmp_path, "syncbn", 2):
        assert r["grad"] <= TOL and r["params"] <= TOL and r["buffers"] <= TOL, r


@pytest.mark.parametrize("replicas", [1, 2])
def test_buffers_of_every_dtype_are_rank_zeros_bit_for_bit(tmp_path, replicas):
    # complex64 (rotary freqs_cis), int64 above 2**53, bool, float16 with a
    # signed zero and a subnormal: every replica of every rank ends up with
    # rank 0's after a training step (before it, rank 1's differ).
    run = torchrun("buffers_every_dtype", tmp_path, 2, {"SCENARIO_REPLICAS": str(replicas)})
    assert run.returncode == 0, run.stderr[-3000:]
    r0, r1 = results(tmp_path, "buffers_every_dtype", 2)
    assert r0["before"] == [True] * replicas and r1["before"] == [False] * replicas
    assert r0["after"] == r1["after"] == [True] * replicas, (r0, r1)


def test_two_nodes_on_localhost_through_the_c10d_rendezvous(tmp_path):
    port = _free_port()
    common = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=pyddp-test",
        str(SCENARIOS),
        "collectives",  # the rendezvous is what is tested here: a light scenario
        str(tmp_path),
    ]
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = []
    for log in logs:  # files, not pipes: a full pipe would stall a node mid-collective
        with open(log, "w") as f:
            nodes.append(
                subprocess.Popen(
                    common, env=_env(), cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT
                )
            )
    codes = [n.wait(timeout=240) for n in nodes]
    assert codes == [0, 0], "".join(log.read_text()[-2000:] for log in logs)
    for r in results(tmp_path, "collectives", 2):
        assert r["sum"] == [10.0] * 3 and r["avg"] == [2.5] * 3


def test_a_sharded_optimizers_state_dict_on_rank_0_alone_is_named_as_collective(tmp_path):
    run = torchrun("zero_alone", tmp_path, 2, {"PYDDP_TIMEOUT_S": "20"})
    assert run.returncode == 0, run.stderr[-3000:]
    got = results(tmp_path, "zero_alone", 2)
    for r in got:
        assert r["error"] is not None and "state_dict() is collective" in r["error"], r
    assert got[0]["consolidated_equal"] is True  # consolidate_state_dict(to=0), as torch's


def test_ranks_doing_different_work_are_named_at_the_next_synced_backward(tmp_path):
    run = torchrun("diverge", tmp_path, 2)
    assert run.returncode == 0, run.stderr[-3000:]
    expect = {
        "extra step": "optimizer steps: rank 0 1, rank 1 2",
        "extra no_sync": "micro-batches since the last synced backward: rank 0 1, rank 1 2",
        "eval": "modules in training mode: rank 0 4, rank 1 0",
        "edited parameters": "parameter checksum: rank 0",
    }
    for r in results(tmp_path, "diverge", 2):
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
