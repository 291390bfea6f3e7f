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
