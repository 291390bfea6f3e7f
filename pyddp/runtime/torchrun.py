"""pyddp under torchrun, on torch.distributed: `init()` joins the group
torchrun started (its environment, the c10d store, gloo for CPUs and
NCCL for GPUs), and `rank()`/`world()`/`local_rank()` say where this process
is. Without `init()` and with torch.distributed uninitialised, pyddp runs in
one process as it always did: every helper here then answers for one process.
A process that a launcher started as one of several (WORLD_SIZE > 1) is the
exception: there wrap refuses to start until `init()` has run
(refuse_training_alone says why it refuses instead of initialising).

Launch: ``torchrun --nproc-per-node=P [--nnodes=N --rdzv-backend=c10d
--rdzv-endpoint=HOST:PORT] train.py``, where train.py calls ``pyddp.init()``
and then ``pyddp.wrap(model, devices)`` with this process's devices."""

from __future__ import annotations

import atexit
import datetime
import os
import re
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import libraries as _runtime
from .libraries import checked_timeout
from .libraries import timeout_s as _default_timeout

# What torchrun (and torch.distributed's env:// rendezvous) sets for every worker.
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# How long a process with a process group up gives gloo's worker threads at
# exit (see _let_gloo_settle).
GLOO_SETTLE_S = 0.1


@atexit.register
def _let_gloo_settle() -> None:
    """At exit, with a process group up: sleep briefly, the GIL released.

    A gloo worker thread drops its reference to a finished (or still
    running) collective's tensors after the caller has its result; if that
    happens once the interpreter has started finalizing, the tensor's
    Python object cannot be released (the thread cannot take the GIL, and
    is unwound through a noexcept frame) and the process aborts with
    "terminate called without an active exception" after its work is done
    (torch 2.13; about one exit in three for two gloo processes on a loaded
    2-core machine; destroy_process_group() does not help while a DDP model
    or pyddp still holds the group). atexit handlers run before
    finalization: this one gives those threads the time to let go. Any
    script that imports pyddp gets it, whichever trainer created the group.

    "A group up" includes one destroyed before exit (Accelerate's
    end_training() does that): its backend lives on in the models that hold
    it, so a worker launched as one of several (WORLD_SIZE > 1, as torchrun,
    Lightning's launcher and Ray Train set) always waits."""
    if launched_world() > 1 or (dist.is_available() and dist.is_initialized()):
        time.sleep(GLOO_SETTLE_S)


def init(backend: Optional[str] = None, timeout_s: Optional[float] = None) -> None:
    """Joins the process group torchrun set up, once; later calls do nothing
    (and a group the caller initialised is kept as is).

    ``backend`` defaults to gloo for CPU work plus NCCL for CUDA tensors when
    this machine has a GPU (``"cpu:gloo,cuda:nccl"``); GPU processes also
    select ``cuda:LOCAL_RANK`` as their current device. ``timeout_s`` bounds
    every collective (default $PYDDP_TIMEOUT_S or 300 s, not gloo's 30 min):
    a rank that stops arriving is an error naming it, not a hang."""
    if not dist.is_available():
        raise RuntimeError("pyddp.init(): this torch build has no torch.distributed")
    if dist.is_initialized():
        return
    seconds = _timeout(timeout_s)  # the argument (or $PYDDP_TIMEOUT_S) before the environment
    missing = [k for k in _TORCHRUN_ENV if not os.environ.get(k)]
    if missing:
        raise RuntimeError(
            f"pyddp.init(): environment variables {', '.join(missing)} are not set. Launch "
            "with `torchrun --nproc-per-node=N script.py` (it sets RANK, WORLD_SIZE, "
            "LOCAL_RANK, MASTER_ADDR and MASTER_PORT), or call "
            "torch.distributed.init_process_group yourself before pyddp.init()"
        )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if not os.environ[k].isdigit():
            raise RuntimeError(f"pyddp.init(): {k}={os.environ[k]!r} is not a non-negative int")
    rank_, world_ = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_ < 1 or rank_ >= world_:
        raise RuntimeError(f"pyddp.init(): RANK={rank_} is not below WORLD_SIZE={world_}")
    gpu = torch.cuda.is_available()
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if gpu else "gloo"
    if gpu:
        local = local_rank()
        if local >= torch.cuda.device_count():
            raise RuntimeError(
                f"pyddp.init(): LOCAL_RANK={local} but this machine has "
                f"{torch.cuda.device_count()} GPU(s): start at most that many processes per node"
            )
        torch.cuda.set_device(local)
    if timeout_s is not None:
        _runtime.INIT_TIMEOUT_S = seconds  # wrap/GradSync's default from now on
    timeout = datetime.timedelta(seconds=seconds)
    # torchrun's store outlives a restart of the group (--max-restarts): the
    # previous round's rendezvous keys are still in it, and gloo would connect
    # to the dead peers they name ("connectFullMesh ... Connection refused").
    # Every round gets its own key space.
    store, rank_, world_ = next(dist.rendezvous("env://", timeout=timeout))
    store = dist.PrefixStore(job_prefix(), store)
    dist.init_process_group(
        backend=backend, store=store, rank=rank_, world_size=world_, timeout=timeout
    )


def launched_world() -> int:
    """WORLD_SIZE as a launcher set it for this process (torchrun and
    torch.distributed.launch; Lightning's, Accelerate's and Ray Train's
    launchers too); 1 when unset or not a number."""
    raw = os.environ.get("WORLD_SIZE", "")
    return int(raw) if raw.isdigit() else 1


def refuse_training_alone() -> None:
    """Raises when a launcher started this process as one of several
    (WORLD_SIZE > 1) and torch.distributed is not initialised: the script
    forgot `pyddp.init()`, and every rank would train alone on its own
    replicas (two CPU replicas each, by default), diverging from the others
    while `pyddp.world()` says 1. Called by wrap, GradSync and all_reduce
    before they build anything.

    Why refuse rather than initialise here: joining the group is a
    rendezvous with every other rank, with a backend and a timeout, and
    belongs at one visible point at the top of the script, before anything
    prints or writes files as if it were the only process; a wrap that
    initialised on its own would also race the trainers that initialise
    torch.distributed themselves (Lightning, Accelerate, Ray Train), which
    always do so before they wrap and so never reach this error.
    WORLD_SIZE=1 (torchrun with one process) runs in one process as before."""
    world_ = launched_world()
    if world_ <= 1 or (dist.is_available() and dist.is_initialized()):
        return
    launcher = "torchrun" if os.environ.get("TORCHELASTIC_RUN_ID") else "a launcher"
    raise RuntimeError(
        f"pyddp: this process was started by {launcher} as rank "
        f"{os.environ.get('RANK', '?')} of {world_} (WORLD_SIZE={world_}), but "
        "torch.distributed is not initialised: every rank would train alone and diverge. "
        "Call pyddp.init() at the top of the script, before pyddp.wrap(), GradSync or "
        "all_reduce (or initialise torch.distributed yourself first); to run each "
        "process on its own on purpose, unset WORLD_SIZE"
    )


def rank(group: Any = None) -> int:
    """This process's rank in `group` (default: every process); 0 without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def world(group: Any = None) -> int:
    """The number of processes in `group` (default: all); 1 without
    torch.distributed (under torchrun too, until `pyddp.init()`: wrap refuses
    to start before it, see refuse_training_alone)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def local_rank() -> int:
    """This process's index on its machine (torchrun's LOCAL_RANK; 0 if unset)."""
    raw = os.environ.get("LOCAL_RANK", "0")
    return int(raw) if raw.isdigit() else 0


def is_main() -> bool:
    """Rank 0: the process that prints, shows progress and writes files."""
    return rank() == 0


def restart_count() -> int:
    """How many times torchrun restarted this group (scopes pyddp's store keys:
    a restarted group must not read the previous round's)."""
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(raw) if raw.isdigit() else 0


def job_prefix() -> str:
    """The store key space of this job and round: torchrun's run id (its
    --rdzv-id; "none" when not given) and the restart count, so neither
    another job sharing the store nor a previous round's keys are read."""
    job = re.sub(r"[^A-Za-z0-9_.-]", "_", os.environ.get("TORCHELASTIC_RUN_ID", "none"))[:64]
    return f"pyddp/job-{job}/round{restart_count()}"


def _timeout(seconds: Optional[float]) -> float:
    if seconds is None:
        return _default_timeout()  # $PYDDP_TIMEOUT_S, checked there
    return checked_timeout(seconds, f"pyddp.init(timeout_s={seconds!r})")
