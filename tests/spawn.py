"""Runs a test scenario in other processes. A scenario is a module-level
function of a test module, named by the function itself or as "module:name"
(`"test_zero:sharded_across_processes"`); it runs in fresh processes that
import its module, so it sits beside the assertions that check it.

- `spawn(fn, nproc)`: under torchrun (`python -m torch.distributed.run`), one
  process per rank, each in pyddp.init()'s group; `fn(out)` fills the dict
  `out`, which comes back as that rank's result. Returns every rank's.
- `launch(fn, nproc)`: the same without the checks, for scenarios that test
  failures (a killed rank, a stall): the exit codes, the output and each
  rank's result, read one at a time. `agent=False` starts the ranks with
  torch.distributed's env:// variables and no torchrun agent, which would
  stop the survivors as soon as one rank dies (those tests check what the
  survivors see).
- `run_alone(fn, *args)`: `fn(*args)` in one fresh process, no group. With
  `simgpu=True` (the default) on the simulated CUDA driver, NCCL and NVRTC
  (tests/simgpu), chosen in the environment before torch and pyddp load;
  the simulation must report no broken rule when `fn` returns.

A rank that raised fails the test with its own traceback (the scenario's
file and line), not only with an exit code.

In the scenario's processes (rank side): `write`, `write_and_exit`,
`expect_failure` and `out_dir`. Run as a script, this file is the entry point
of those processes: `spawn.py MODULE:NAME OUT_DIR [ARGS_JSON]`."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

HERE = Path(__file__).resolve().parent
Scenario = Union[str, Callable[..., Any]]

# Set in the scenario's processes by _main: where this rank writes its result.
_target: Dict[str, str] = {}


class RankFailed(AssertionError):
    """A scenario's process failed: its traceback, or its output when it
    wrote nothing."""


# ------------------------------------------------------------ the test's side
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This process's environment for a scenario's processes under torch's
    launchers: one thread each (2 cores run several ranks), pyddp's timeout
    60 s unless given, `extra` on top."""
    env = dict(os.environ)
    env["PYTHONPATH"] = _package_root() + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYDDP_TIMEOUT_S", "60")
    env.update(extra or {})
    return env


def simgpu_libraries() -> Dict[str, str]:
    """The variables that select the simulated driver, NCCL and NVRTC (built
    on first use, cached by source hash)."""
    sys.path.insert(0, str(HERE / "simgpu"))
    from simgpu import build

    lib = build()
    return {k: lib for k in ("PYDDP_CUDA_LIBRARY", "PYDDP_NCCL_LIBRARY", "PYDDP_NVRTC_LIBRARY")}


def command(scenario: Scenario, out: Path) -> List[str]:
    """The command line of one of the scenario's processes, for tests that
    launch them their own way (two torchrun nodes, a store host stopped)."""
    return [sys.executable, str(HERE / "spawn.py"), _name(scenario), str(out)]


def spawn(
    scenario: Scenario,
    nproc: int = 2,
    *,
    env: Optional[Dict[str, str]] = None,
    simgpu: bool = False,
    timeout: float = 240,
    out: Optional[Path] = None,
    torchrun_args: Sequence[str] = (),
) -> List[dict]:
    """Runs `scenario(out)` on `nproc` ranks under torchrun and returns each
    rank's `out`; raises RankFailed if torchrun failed or a rank raised.
    `out` (a folder) holds the results and whatever the scenario writes
    there (its working directory); a temporary one when not given."""
    with _folder(out) as folder:
        run = launch(
            scenario, nproc, env=env, simgpu=simgpu, timeout=timeout, out=folder,
            torchrun_args=torchrun_args,
        )  # fmt: skip
        return run.results()


def launch(
    scenario: Scenario,
    nproc: int = 2,
    *,
    env: Optional[Dict[str, str]] = None,
    simgpu: bool = False,
    out: Path,
    timeout: float = 240,
    torchrun_args: Sequence[str] = (),
    agent: bool = True,
) -> Launched:
    """Runs `scenario(out)` on `nproc` ranks with `out` as their folder and
    returns what happened, unchecked. agent=False: without torchrun (see the
    module's docstring); `timeout` then applies to each rank's wait."""
    extra = dict(env or {})
    if simgpu:
        extra = {**simgpu_libraries(), "SCENARIO_SIMGPU": "1", **extra}
    if not agent:
        return _launch_without_agent(_name(scenario), nproc, extra, timeout, Path(out))
    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    # --standalone: the agent's store binds a port of the system's choosing.
    # (A port found free beforehand may be taken meanwhile on a busy machine:
    # seen in CI, EADDRINUSE while other jobs ran.)
    args += ["--standalone", *torchrun_args, *command(scenario, out)[1:]]
    run = subprocess.run(
        args, env=environment(extra), capture_output=True, text=True, timeout=timeout, cwd=out
    )
    return Launched(_name(scenario), out, nproc, run.returncode, [], run.stdout, run.stderr)


def run_alone(
    scenario: Scenario,
    *args: Any,
    env: Optional[Dict[str, str]] = None,
    simgpu: bool = True,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """Runs `scenario(*args)` (JSON-able arguments) in one fresh process,
    without a process group; raises RankFailed if it raised or the process
    failed (then the simulation's broken rules, with simgpu). Returns the
    finished process (its output, for tests that read it)."""
    extra = {**(simgpu_libraries() if simgpu else {}), **(env or {})}
    if simgpu:
        extra["SCENARIO_SIMGPU"] = "1"
    environ = dict(os.environ, **extra)
    environ["PYTHONPATH"] = _package_root() + os.pathsep + environ.get("PYTHONPATH", "")
    environ["SPAWN_ALONE"] = "1"
    with _folder(None) as folder:
        cmd = command(scenario, folder) + [json.dumps(list(args))]
        run = subprocess.run(
            cmd, env=environ, capture_output=True, text=True, timeout=timeout, cwd=folder
        )
        launched = Launched(_name(scenario), folder, 1, run.returncode, [], run.stdout, run.stderr)
        launched.result(0)
        if run.returncode != 0:
            raise RankFailed(f"{launched.name} exited {run.returncode}\n{launched.tail(0)}")
    return run


class Launched:
    """A scenario's run: exit codes (torchrun's in `returncode`; each rank's
    in `codes` without the agent), output, and each rank's result."""

    def __init__(self, scenario, out, nproc, returncode, codes, stdout, stderr):
        self.scenario, self.out, self.nproc = scenario, Path(out), nproc
        self.name = scenario.rsplit(":", 1)[-1]  # its files: NAME.rankR.json and .log
        self.returncode, self.codes = returncode, codes
        self.stdout, self.stderr = stdout, stderr

    def log(self, rank: int) -> str:
        """Rank `rank`'s output without the agent; torchrun's output else."""
        path = self.out / f"{self.name}.rank{rank}.log"
        return path.read_text() if path.exists() else self.stdout + self.stderr

    def tail(self, rank: int, chars: int = 3000) -> str:
        return self.log(rank)[-chars:]

    def result(self, rank: int) -> dict:
        """What rank `rank` recorded; RankFailed with its traceback if the
        scenario raised there, with its output if it wrote nothing."""
        if not (self.out / f"{self.name}.rank{rank}.json").exists():
            raise RankFailed(f"{self.name}: rank {rank} wrote nothing\n{self.tail(rank)}")
        return result(self.scenario, self.out, rank)

    def results(self) -> List[dict]:
        """Every rank's result; RankFailed naming each rank that raised (or
        torchrun's output if it failed otherwise)."""
        raised = []
        for r in range(self.nproc):
            path = self.out / f"{self.name}.rank{r}.json"
            data = json.loads(path.read_text()) if path.exists() else {}
            if "exception" in data:
                raised.append(f"rank {r} raised\n{data['exception']}")
        if raised:
            raise RankFailed(f"{self.name}: " + "\n".join(raised))
        if self.returncode != 0 or any(self.codes):
            codes = self.codes or self.returncode
            raise RankFailed(f"{self.name} exited {codes}\n{self.tail(0)}")
        return [self.result(r) for r in range(self.nproc)]


def result(scenario: Scenario, out: Path, rank: int) -> dict:
    """What rank `rank` of `scenario` recorded in `out`, for tests that launch
    the ranks their own way; RankFailed with its traceback if it raised."""
    name = _name(scenario).rsplit(":", 1)[-1]
    data = json.loads((Path(out) / f"{name}.rank{rank}.json").read_text())
    if "exception" in data:
        raise RankFailed(f"{name}: rank {rank} raised\n{data['exception']}")
    return data


def _launch_without_agent(name, nproc, extra, timeout, out) -> Launched:
    port, stem = str(free_port()), name.rsplit(":", 1)[-1]
    procs = []
    for r in range(nproc):
        rank_env = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc)}
        rank_env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **extra})
        with open(out / f"{stem}.rank{r}.log", "w") as log:  # a pipe could fill and block
            procs.append(
                subprocess.Popen(
                    command(name, out), env=environment(rank_env), cwd=out,
                    stdout=log, stderr=subprocess.STDOUT,
                )
            )  # fmt: skip
    codes = [p.wait(timeout=timeout) for p in procs]
    return Launched(name, out, nproc, next((c for c in codes if c), 0), codes, "", "")


@contextlib.contextmanager
def _folder(out: Optional[Path]) -> Iterator[Path]:
    """`out` as is, or a temporary folder removed afterwards."""
    if out is not None:
        yield Path(out)
        return
    with tempfile.TemporaryDirectory(prefix="spawn-") as tmp:
        yield Path(tmp)


def _name(scenario: Scenario) -> str:
    if isinstance(scenario, str):
        return scenario
    module, name = scenario.__module__, scenario.__name__
    if getattr(sys.modules.get(module), name, None) is not scenario:
        raise ValueError(f"scenario {scenario!r} must be a module-level function of a test module")
    return f"{module}:{name}"


def _package_root() -> str:
    """The package under test: the installed one, or this checkout's when it
    holds a build (tests run from the repository root)."""
    import pyddp

    return str(Path(pyddp.__file__).resolve().parent.parent)


# ------------------------------------------------------ the scenario's side
def out_dir() -> str:
    """The scenario's folder (the test's `out`), for files it writes."""
    return _target["dir"]


def write(out: dict) -> None:
    """Writes `out` as this rank's result (atomically: a reader never sees
    half of it)."""
    rank = 0 if os.environ.get("SPAWN_ALONE") else _rank()
    path = os.path.join(_target["dir"], f"{_target['name']}.rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)


def write_and_exit(out: dict) -> None:
    write(out)
    os._exit(0)  # the group is broken: no clean shutdown to wait for


def expect_failure(out: dict, run: Callable[[], Any]) -> None:
    """Runs `run`, records its error (None if it did not raise) and how long it
    took, then writes `out` and ends the process."""
    t0 = time.monotonic()
    try:
        run()
        out["error"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - t0
    write_and_exit(out)


def _rank() -> int:
    import pyddp

    return pyddp.rank()


def _main(argv: List[str]) -> None:
    target, folder = argv[1], argv[2]
    # tests/simgpu's modules by name (`from simgpu import HostReads`), not the
    # folder tests/simgpu as a namespace package.
    sys.path.insert(1, str(HERE / "simgpu"))
    module, name = target.split(":")
    _target.update(dir=folder, name=name)
    fn = getattr(importlib.import_module(module), name)
    if os.environ.get("SPAWN_ALONE"):
        _alone(fn, json.loads(argv[3]) if len(argv) > 3 else [])
        return
    import torch.distributed as dist

    import pyddp

    pyddp.init()
    out: dict = {"world": pyddp.world()}
    try:
        fn(out)
    except Exception:  # noqa: BLE001 - the test shows it
        out["exception"] = traceback.format_exc()
    write(out)
    dist.destroy_process_group()


def _alone(fn: Callable[..., Any], args: list) -> None:
    try:
        fn(*args)
        if os.environ.get("SCENARIO_SIMGPU"):
            from simulated import sim

            broken = sim.violations()
            assert not broken, "simulation rules broken:\n" + broken
    except Exception:  # noqa: BLE001 - the test shows it
        write({"exception": traceback.format_exc()})
        sys.exit(1)
    write({})


if __name__ == "__main__":
    # This file again under its module name, so the scenario's modules (which
    # import spawn) and _main share _target.
    import spawn

    spawn._main(sys.argv)
