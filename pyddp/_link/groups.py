"""Rendezvous for the link: which process group to span, pyddp's own gloo
groups over its ranks (keys scoped by job, restart and role), and calls on
torch.distributed's store that cannot hang."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..errors import ProcessGroupError
from ..runtime.torchrun import job_prefix, refuse_training_alone

STORE_DEADLINE_S = 5.0  # a store call on the failure path; the store answers in ms

_groups: Dict[tuple, Any] = {}  # (ranks, "control") -> the one control group
# Released while the interpreter is whole: a gloo group destroyed during
# interpreter teardown can end the process in std::terminate.
atexit.register(_groups.clear)
_made: Dict[tuple, int] = {}  # (ranks, role) -> gloo groups made so far


def resolve_group(group: Any) -> Optional[Any]:
    """The process group to span, or None to stay in one process (refused
    in a process a launcher started as one of several: pyddp.init() first)."""
    if group is not None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "group= was given but torch.distributed is not initialised: call pyddp.init()"
            )
        return group
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    refuse_training_alone()
    return None


@dataclass
class Peers:
    """Who is on the other end, and where this rank is in the run (for
    messages): shared by the control exchanges, the bucket transport and the
    failure handling of one link."""

    ranks: List[int]  # global ranks, in group order
    rank: int  # this process's index in `ranks`
    store: Any  # torch.distributed's store
    timeout: float
    id: int = 0  # which of the models wrapped over these ranks (same on every member)
    iteration: int = 0  # synced backwards whose reductions were waited for
    in_backward: bool = False  # between the first bucket launch and the wait

    @property
    def world(self) -> int:
        return len(self.ranks)

    @property
    def root(self) -> int:
        """The global rank of the group's rank 0."""
        return self.ranks[0]

    @property
    def prefix(self) -> str:
        """This link's key space in the store."""
        return f"{job_prefix()}/{'-'.join(map(str, self.ranks))}/{self.id}"

    def where(self) -> str:
        """Where this rank is in the run, for messages: the synced backward
        under way, or the exchange after the last one."""
        if self.in_backward:
            return f"synced backward {self.iteration + 1}"
        return f"the exchange after synced backward {self.iteration}"


def peers_of(group: Any, timeout_s: float) -> Peers:
    """This process's place in `group` (a member only) and the store."""
    ranks = dist.get_process_group_ranks(group)
    if dist.get_rank() not in ranks:
        raise ValueError(
            f"group=: this process (rank {dist.get_rank()}) is not in the group "
            f"(ranks {ranks}); only its members may wrap with it"
        )
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception as e:  # noqa: BLE001 - named below
        raise RuntimeError(f"pyddp: torch.distributed's store is not reachable: {e}") from e
    return Peers(ranks, ranks.index(dist.get_rank()), store, timeout_s)


def own_group(peers: Peers, role: str) -> Any:
    """A gloo process group over the peers for pyddp alone, with pyddp's
    timeout, its rendezvous keys named by pyddp: (restart, ranks, role, how
    many such groups this rank made before). Every member makes them in the
    same order, so the names agree (torch's own names for groups made by
    their members only depend on each rank's whole group history, and
    diverge after a subgroup). "data": one per link, so another model's
    launcher or the caller's collectives never pair with its buckets.
    "control": one per set of ranks, for small blocking exchanges that must
    not pair with a bucket reduction launched earlier."""
    ranks, store = peers.ranks, peers.store
    key = (tuple(ranks), role)
    if role == "control" and key in _groups:
        return _groups[key]
    n = _made.get(key, 0)
    _made[key] = n + 1
    if role == "data":
        # Which of the models wrapped over these ranks this is: the same on
        # every member (a count per set of ranks, unlike a count of all the
        # links a process made, which differs after a subgroup).
        peers.id = n
    name = f"{job_prefix()}/gloo/{'-'.join(map(str, ranks))}/{role}/{n}"
    # Each member says it arrived, so a timeout can name the ranks that did not.
    me = dist.get_rank()
    store_call(store, "set", (f"{name}/arrived/{me}", "1"), STORE_DEADLINE_S)
    try:
        pg = dist.ProcessGroupGloo(
            dist.PrefixStore(name, store),
            ranks.index(me),
            len(ranks),
            datetime.timedelta(seconds=peers.timeout),
        )
    except Exception as e:  # noqa: BLE001 - named below
        missing = []
        for r in ranks:
            answer = store_call(store, "check", ([f"{name}/arrived/{r}"],), STORE_DEADLINE_S)
            if not answer:  # the store is gone or stopped too: say what we know
                missing = []
                break
            if not answer[0]:
                missing.append(r)
        who = (
            f"rank {', '.join(map(str, missing))} never arrived (stalled or failed before "
            "pyddp.wrap / GradSync, or running different code)"
            if missing
            else f"{first_line(e)}"
        )
        raise ProcessGroupError(
            f"pyddp: rank {me} could not set up pyddp's {role} group over ranks {ranks} "
            f"within {peers.timeout:g} s: {who}"
        ) from None
    if role == "control":
        _groups[key] = pg
    return pg


def store_call(store: Any, op: str, args: tuple, deadline: float) -> List[Any]:
    """store.op(*args) on a daemon thread, waited at most `deadline` seconds:
    [result], or [] if it failed or did not answer (the call is left behind)."""
    result: List[Any] = []

    def call() -> None:
        with contextlib.suppress(Exception):
            result.append(getattr(store, op)(*args))

    thread = threading.Thread(target=call, name="pyddp-store", daemon=True)
    thread.start()
    thread.join(deadline)
    return result


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    if not text:
        return type(e).__name__
    line = text.splitlines()[0]
    # gloo appends advice that does not apply here ("... GLHF!").
    return line.split(" This is typically caused")[0]


def allreduce(pg: Any, t: Any, op: Any = None) -> Any:
    """An asynchronous in-place all-reduce on a gloo group: its work."""
    opts = dist.AllreduceOptions()
    if op is not None:
        opts.reduceOp = op
    return pg.allreduce([t], opts)


def all_to_all(pg: Any, t: Any) -> Any:
    """An asynchronous all-to-all of `t` (cut into one equal block per rank)
    on a gloo group: block k goes to rank k; the future's value holds the
    blocks received, in source rank order."""
    out = torch.empty_like(t)
    return pg.alltoall_base(out, t, [], [], dist.AllToAllOptions()).get_future()


def broadcast(pg: Any, t: Any, root: int = 0) -> None:
    """The group's rank `root`'s `t` everywhere (a rank in the group's
    order), blocking."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([t], opts).wait()
