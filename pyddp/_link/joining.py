"""Uneven inputs (torch's Join) on the link. While some ranks have run out
of inputs ("joined"), each forward of the others begins with one exchange on
the control group saying what that iteration does, and each joined rank's
join hook makes the same exchange and shadows exactly that, nothing more:

    [broadcasts, syncs, rows] + one slot per rank (1.0: it has inputs)

summed over the ranks: which ranks still have inputs (the highest of them
is the source of the buffer broadcast in place of rank 0, which may have
joined: torch DDP's choice under Join), whether they broadcast buffers
at the end of its backward (a synced forward, broadcast_buffers on), whether a
synced backward follows it (grad enabled, not under no_sync()), and the rows
of the global batch over them, so that dmodel.loss weighs every forward
exactly without an exchange of its own.
The active ranks must agree on the first two (one rank under no_sync()
alone would make the joined ranks shadow the wrong work): every
rank raises otherwise.

A step of a sharded optimizer (ZeRO: every rank steps its own shard, then
gathers the others') is an iteration of its own: the ranks with inputs
announce it the same way (`optimizer`: its place among dmodel.optimizer's,
agreed on by every active rank), and the highest of them sends its
settings (the learning rate a scheduler moved) and the gradients it steps
with (clipped or unscaled since the backward, as the case may be): the
joined ranks step their shards with those.

`Joining` is what the wrapped model drives (replicas/uneven.py): the step
of the forward under way, and the exchanges at each forward, at each join
hook call and at the end. One process has nothing to join (`Joining`);
across processes the link holds a `ProcessJoining`."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from .control import Control, exchange
from .failure import Failure
from .groups import Peers, first_line

JOIN_STEP = exchange("the uneven-inputs exchange of a forward under Join")
JOIN_ARGUMENTS = exchange("the comparison of dmodel.join()'s arguments as it is entered")
JOIN_LAST = exchange("the choice of the last rank to join, at the end of Join")
JOIN_FINAL = exchange("the broadcast of the last joiner's parameters and buffers after Join")
JOIN_OPTIMIZERS_CHECK = exchange("the comparison of optimizers at the end of Join")
JOIN_OPTIMIZERS = exchange("the broadcast of the last joiner's optimizer states after Join")
JOIN_SETTINGS = exchange(
    "the broadcast of a sharded optimizer's settings to the ranks that joined, under Join"
)
JOIN_GRADIENTS = exchange(
    "the broadcast of a sharded optimizer step's gradients to the ranks that joined, under Join"
)

# broadcasts, syncs, rows, the optimizer stepping (its place + 1) and its square
_HEAD = 5


@dataclass
class JoinStep:
    """One forward under Join, as every rank sees it."""

    active: List[int]  # the ranks (in the group's order) that have inputs
    broadcasts: bool  # they broadcast buffers at the end of its backward
    syncs: bool  # a synced backward follows it
    rows: float  # the global batch's rows, over the active ranks
    # Not a forward: a step of the sharded optimizer at this place among
    # dmodel.optimizer's (the joined ranks step their shards too).
    optimizer: Optional[int] = None
    # The buffers sent at the last synced backward came from another rank
    # than `source` (it joined since): `source` sends its own before this
    # forward, as DDP's does, and every rank takes them.
    resend: bool = False

    @property
    def source(self) -> int:
        """The rank whose buffers every rank takes (the highest active one,
        as torch DDP under Join)."""
        return self.active[-1]


def encode(
    world: int,
    rank: Optional[int],
    broadcasts: bool,
    syncs: bool,
    rows: float,
    optimizer: Optional[int] = None,
) -> List[float]:
    """A rank's part; `rank` None for a joined rank (it adds nothing)."""
    part = [0.0] * (_HEAD + world)
    if rank is not None:
        k = 0.0 if optimizer is None else float(optimizer + 1)
        part[:_HEAD] = [float(broadcasts), float(syncs), float(rows), k, k * k]
        part[_HEAD + rank] = 1.0
    return part


def decode(sums: Sequence[float], ranks: Sequence[int]) -> JoinStep:
    """The step every rank sees (`ranks`: the group's global ranks, for
    messages). Raises ValueError, on every rank alike, if the active ranks
    disagree on what the step does."""
    active = [r for r in range(len(ranks)) if sums[_HEAD + r] > 0.5]
    broadcasts, syncs, rows, k, k2 = sums[:_HEAD]
    n = len(active)
    # The same place on every active rank, or none: a sum of n places and
    # of their squares that n equal ones give (their variance is zero).
    if k != 0.0 and (k % n or k2 * n != k * k):
        raise ValueError(
            f"under Join, the ranks that still have inputs ({_ranks(ranks, active)}) disagree "
            "on what comes next: some step a sharded optimizer (or another one than the rest) "
            "where others run a forward; every rank must make the same optimizer steps"
        )
    optimizer = int(k) // n - 1 if k else None
    for value, what in ((broadcasts, "a buffer broadcast"), (syncs, "a synced backward")):
        if value not in (0.0, float(n)):
            raise ValueError(
                f"under Join, the ranks that still have inputs ({_ranks(ranks, active)}) "
                f"disagree on whether this forward is {what}: {int(value)} of {n} said so "
                "(one rank in eval(), under torch.no_grad() or under no_sync() alone); the "
                "ranks that joined cannot shadow both"
            )
    return JoinStep(active, broadcasts > 0, syncs > 0, rows, optimizer)


def join_device(group: Any) -> torch.device:
    """Where torch's Join's own all-reduces on `group` live (torch's
    Joinable.join_device): this process's GPU for NCCL, else the CPU."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def last_joiner(sums: Sequence[float]) -> int:
    """The rank whose model every rank takes at the end (torch's choice: the
    highest of the last to join)."""
    return max(r for r, v in enumerate(sums) if v > 0.5)


def _ranks(ranks: Sequence[int], active: Sequence[int]) -> str:
    return ", ".join(str(ranks[r]) for r in active) if active else "none"


class Joining:
    """torch's Join on the link of one process: nothing to exchange."""

    def __init__(self) -> None:
        self.step: Optional[JoinStep] = None  # under Join, this forward's step
        # Gradients averaged over the ranks with inputs (torch DDP's
        # divide_by_initial_world_size=False) rather than over every rank.
        self.divide_by_active = False
        self.hook_warned = False  # hook_divides said so in this Join
        # Under Join, what a sharded optimizer's step calls first on a rank
        # with inputs (the wrapped model's announcement: an iteration of
        # its own for the joined ranks).
        self.before_sharded_step: Optional[Callable[[Any], None]] = None
        # The rank whose buffers every rank received at the last synced
        # backward, until the next forward under Join (replicas/staged.py).
        self.staged_from: Optional[int] = None

    def enter(
        self,
        divide_by_active: bool,
        before_sharded_step: Optional[Callable[[Any], None]] = None,
        hooked: bool = False,
    ) -> None:
        """torch's Join hands out its hook: gradients are then averaged over
        the ranks with inputs (`divide_by_active`) or over every rank.
        `hooked`: a communication hook is registered (hook_divides)."""
        self.divide_by_active = divide_by_active
        self.before_sharded_step = before_sharded_step
        self.hook_warned = False
        self.hook_divides(hooked, stacklevel=4)  # (called by torch's Join, through join_hook)

    def hook_divides(self, hooked: bool, stacklevel: int = 1) -> float:
        """The divisor on top of a synced backward's average under Join with
        divide_by_initial_world_size=False where a communication hook is
        registered: none, as torch DDP leaves the division to the hook (its
        own hooks divide by the whole group). Warned once per Join."""
        if hooked and self.divide_by_active and not self.hook_warned:
            self.hook_warned = True
            warnings.warn(
                "pyddp: divide_by_initial_world_size=False has no effect with a communication "
                "hook, as under torch DDP: the hook divides the gradients (torch's own hooks "
                "by the whole group's size, joined ranks included)",
                stacklevel=stacklevel,
            )
        return 1.0

    def exchange_step(
        self,
        has_inputs: bool,
        broadcasts: bool,
        syncs: bool,
        rows: float,
        optimizer: Optional[int] = None,
    ) -> Optional[JoinStep]:
        """Under Join, once per forward (or sharded optimizer step:
        `optimizer`, its place) of the ranks with inputs, and once per join
        hook call on each rank without (has_inputs False, adding nothing):
        what this iteration does, as every rank sees it."""
        return None

    def leave(self) -> None:
        """After torch's Join, however it ended: nothing of it is left."""
        self.step = None
        self.divide_by_active = False
        self.before_sharded_step = None

    def end(self, last: bool, state: Sequence[torch.Tensor]) -> int:
        """After torch's Join, on every rank: the highest of the last ranks
        to join sends `state` (its parameters, buffers and counters) to
        every other (the joined ranks missed the steps taken after they
        joined); returns that rank (in the group's order). leave() follows."""
        return 0

    def refuse(self, message: str) -> None:
        """What this rank cannot shadow: raised (across processes on every
        rank, and the link fails for good)."""
        raise RuntimeError(f"pyddp: {message}")

    def name_failure(self, what: str, error: BaseException) -> None:
        """`error` from one of torch's Join's own collectives: raised again,
        across processes named after `what` with the ranks that died or
        stopped (the link then fails for good)."""
        raise error


class ProcessJoining(Joining):
    def __init__(self, peers: Peers, control: Control, failure: Failure, weighting: Any):
        super().__init__()
        self.peers, self.control, self.failure = peers, control, failure
        self.weighting = weighting  # dmodel.loss's: its rows exchanged again after Join

    def exchange_step(
        self,
        has_inputs: bool,
        broadcasts: bool,
        syncs: bool,
        rows: float,
        optimizer: Optional[int] = None,
    ) -> Optional[JoinStep]:
        rank = self.peers.rank if has_inputs else None
        part = encode(self.peers.world, rank, broadcasts, syncs, rows, optimizer)
        sums = self.control.sum_over_ranks(part, JOIN_STEP)
        try:
            self.step = decode(sums, self.peers.ranks)
        except ValueError as e:
            self.failure.fail(str(e), census=False)
        if self.step.optimizer is None:  # a forward: its buffers come from `source`
            self.step.resend = self.staged_from not in (None, self.step.source)
            self.staged_from = None
        return self.step

    def leave(self) -> None:
        super().leave()
        self.weighting.agreed = None  # exchanged again at the next weighing

    def end(self, last: bool, state: Sequence[torch.Tensor]) -> int:
        flags = [0.0] * self.peers.world
        flags[self.peers.rank] = 1.0 if last else 0.0
        source = last_joiner(self.control.sum_over_ranks(flags, JOIN_LAST))
        self.control.broadcast(state, JOIN_FINAL, source)
        return source

    def refuse(self, message: str) -> None:
        self.failure.fail(message, census=False)

    def name_failure(self, what: str, error: BaseException) -> None:
        self.failure.fail(f"{what} failed: {first_line(error)}")
