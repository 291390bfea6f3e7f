"""Uneven inputs (torch's Join) on the link. While some ranks have run out
of inputs ("joined"), each forward of the others begins with one exchange on
the control group saying what that iteration does, and each joined rank's
join hook makes the same exchange and shadows exactly that, nothing more:

    [broadcasts, syncs, rows] + one slot per rank (1.0: it has inputs)

summed over the ranks: which ranks still have inputs (the highest of them
is the source of the buffer broadcast in place of rank 0, which may have
joined: torch DDP's choice under Join), whether they broadcast buffers
at the end of its backward (a synced training forward), whether a
synced backward follows it (grad enabled, not under no_sync()), and the rows
of the global batch over them, so that dmodel.loss weighs every forward
exactly without an exchange of its own.
The active ranks must agree on the first two (one rank in eval(), or under
no_sync() alone, would make the joined ranks shadow the wrong work): every
rank raises otherwise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from .control import exchange

JOIN_STEP = exchange("the uneven-inputs exchange of a forward under Join")
JOIN_LAST = exchange("the choice of the last rank to join, at the end of Join")
JOIN_FINAL = exchange("the broadcast of the last joiner's parameters and buffers after Join")
JOIN_OPTIMIZERS_CHECK = exchange("the comparison of optimizers at the end of Join")
JOIN_OPTIMIZERS = exchange("the broadcast of the last joiner's optimizer states after Join")

_HEAD = 3  # broadcasts, syncs, rows


@dataclass
class JoinStep:
    """One forward under Join, as every rank sees it."""

    active: List[int]  # the ranks (in the group's order) that have inputs
    broadcasts: bool  # they broadcast buffers at the end of its backward
    syncs: bool  # a synced backward follows it
    rows: float  # the global batch's rows, over the active ranks

    @property
    def source(self) -> int:
        """The rank whose buffers every rank takes (the highest active one,
        as torch DDP under Join)."""
        return self.active[-1]


def encode(
    world: int, rank: Optional[int], broadcasts: bool, syncs: bool, rows: float
) -> List[float]:
    """A rank's part; `rank` None for a joined rank (it adds nothing)."""
    part = [0.0] * (_HEAD + world)
    if rank is not None:
        part[:_HEAD] = [float(broadcasts), float(syncs), float(rows)]
        part[_HEAD + rank] = 1.0
    return part


def decode(sums: Sequence[float], ranks: Sequence[int]) -> JoinStep:
    """The step every rank sees (`ranks`: the group's global ranks, for
    messages). Raises ValueError, on every rank alike, if the active ranks
    disagree on what the step does."""
    active = [r for r in range(len(ranks)) if sums[_HEAD + r] > 0.5]
    broadcasts, syncs, rows = sums[0], sums[1], sums[2]
    n = len(active)
    for value, what in ((broadcasts, "a training forward"), (syncs, "a synced backward")):
        if value not in (0.0, float(n)):
            raise ValueError(
                f"under Join, the ranks that still have inputs ({_ranks(ranks, active)}) "
                f"disagree on whether this forward is {what}: {int(value)} of {n} said so "
                "(one rank in eval(), under torch.no_grad() or under no_sync() alone); the "
                "ranks that joined cannot shadow both"
            )
    return JoinStep(active, broadcasts > 0, syncs > 0, rows)


def last_joiner(sums: Sequence[float]) -> int:
    """The rank whose model every rank takes at the end (torch's choice: the
    highest of the last to join)."""
    return max(r for r, v in enumerate(sums) if v > 0.5)


def _ranks(ranks: Sequence[int], active: Sequence[int]) -> str:
    return ", ".join(str(ranks[r]) for r in active) if active else "none"
