"""What every rank must agree on at each synced backward (the record the
link's agreement compares): ranks that stepped, accumulated or switched mode
differently would reduce different iterations' gradients together and
diverge for good."""

from __future__ import annotations

import weakref
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .weak import LenientWeakKeys

CHECKSUM_EVERY = 16  # synced backwards between parameter checksums across processes


class WorkRecord:
    """One GradSync's work since its last synced backward. Optimizer steps
    are counted by a hook on every optimizer stepping replica 0's parameters
    (dmodel.optimizer's or the user's own), once the link watches it."""

    def __init__(self, params: Sequence[torch.Tensor], module: nn.Module, on_gpu: bool):
        self.params = params  # replica 0's
        self.module = module
        self._modules = list(module.modules())  # walked once: the record is taken every step
        self.on_gpu = on_gpu
        self.backwards_since_sync = 0  # under no_sync() (finish counts them)
        self.steps = 0  # optimizer steps over replica 0's parameters
        self._stepping = LenientWeakKeys()  # optimizer -> whether it steps ours
        self._ahead: Optional[Tuple[int, int]] = None  # (synced backward, its checksum)
        # How this rank's optimizers shard (dmodel.optimizer's shard=): a
        # sharded step's all-gather makes the parameters equal again, so
        # the checksum cannot see ranks stepping with different settings.
        self.shard: Any = False
        self._made: List[weakref.ref] = []  # dmodel.optimizer's, in the order made
        # From this synced backward on, a communication hook lets the ranks'
        # parameters differ on purpose (torch's post-local SGD, between its
        # model averager's averages): no checksum from there.
        self.differ_from: Optional[int] = None

    def backward_done(self) -> None:
        self.backwards_since_sync += 1

    def count_step(self, optimizer: Any) -> None:
        """A step of `optimizer`: counted if it steps replica 0's parameters."""
        steps_ours = self._stepping.get(optimizer)
        if steps_ours is None:
            mine = {id(p) for p in self.params}
            steps_ours = any(id(p) in mine for g in optimizer.param_groups for p in g["params"])
            self._stepping[optimizer] = steps_ours
        if steps_ours:
            self.steps += 1

    def stepping(self) -> List[Any]:
        """The optimizers seen stepping replica 0's parameters (alive)."""
        return [o for o, ours in list(self._stepping.items()) if ours]

    def take(self, iteration: int) -> Dict[str, int]:
        """peek(iteration), then synced(): the next record starts."""
        record = self.peek(iteration)
        self.synced()
        return record

    def peek(self, iteration: int) -> Dict[str, int]:
        """The record of synced backward `iteration` + 1. The parameter
        checksum (the sum of replica 0's parameters' raw bits, as integers:
        exact whatever the thread count) is taken every CHECKSUM_EVERY synced
        backwards, on CPU replicas only (on GPUs it would make the host
        wait); it sees any change, writes through .data included. `ahead`
        (the link's wait before it) may have taken it already, off the
        critical path."""
        checksum = 0
        if self._checksums(iteration):
            if self._ahead is None or self._ahead[0] != iteration:
                self._ahead = (iteration, self.checksum())
            checksum = self._ahead[1]
        return {
            "synced backward": iteration + 1,
            "optimizer steps": self.steps,
            # The no_sync() ones and this one.
            "micro-batches since the last synced backward": self.backwards_since_sync + 1,
            # One BatchNorm left in eval() counts, not only the whole model.
            "modules in training mode": sum(m.training for m in self._modules),
            "parameter checksum": checksum,
            "optimizer settings (shard mode, class, per-group hyper-parameters and state "
            "dicts loaded, hashed)": self.settings_hash(),
        }

    def note_made(self, optimizer: Any) -> None:
        """dmodel.optimizer made `optimizer` (every rank makes its own)."""
        self._made = [ref for ref in self._made if ref() is not None]
        self._made.append(weakref.ref(optimizer))

    def settings_hash(self) -> int:
        """A hash, equal on ranks with equal settings, of the shard mode and
        of every live optimizer dmodel.optimizer made: its class and each
        param group's hyper-parameters (a learning rate a scheduler changed
        on one rank only, AdamW on one and SGD on another). An optimizer of
        your own is not in it (a rank may never have stepped it, under
        Join); the parameter checksum sees where it steps differently.
        Tensor values are hashed by dtype and shape (reading them would
        make a GPU's host wait)."""
        parts = [
            repr((_user_class(o), [_hyper(g) for g in o.param_groups], _loads(o)))
            for o in (ref() for ref in self._made)
            if o is not None
        ]
        return zlib.crc32(repr((self.shard, parts)).encode())

    def synced(self) -> None:
        """A synced backward ended: the micro-batches count starts again."""
        self.backwards_since_sync = 0

    def ahead(self, iteration: int) -> None:
        """While synced backward `iteration` - 1's reductions are on the
        wire: the checksum synced backward `iteration` will carry, if it is
        one that carries it (the parameters as they are now: a change made
        later is seen CHECKSUM_EVERY synced backwards on)."""
        if self._checksums(iteration):
            self._ahead = (iteration, self.checksum())

    def _checksums(self, iteration: int) -> bool:
        """Whether synced backward `iteration` carries the checksum."""
        if self.on_gpu or iteration % CHECKSUM_EVERY:
            return False
        return self.differ_from is None or iteration < self.differ_from

    def checksum(self) -> int:
        with torch.no_grad():
            return sum(bits_sum(p) for p in self.params) & 0x7FFFFFFFFFFFFFFF


def _user_class(optimizer: Any) -> str:
    """The optimizer's class as the user chose it: torch's SGD whether one
    replica steps it as is or pyddp's subclass steps several (ranks with 1
    and 2 replicas were refused as different settings)."""
    cls = next(c for c in type(optimizer).__mro__ if not c.__module__.startswith("pyddp."))
    return f"{cls.__module__}.{cls.__qualname__}"


def _loads(optimizer: Any) -> int:
    """State dicts a pyddp optimizer loaded (optim/base.py: OptimState.loads)."""
    return getattr(optimizer.__dict__.get("_pyddp"), "loads", 0)


def _hyper(group: Dict[str, Any]) -> List[Tuple[str, str]]:
    return [
        (k, f"tensor {v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else repr(v))
        for k, v in sorted(group.items())
        if k != "params"
    ]


_watched: weakref.WeakSet[WorkRecord] = weakref.WeakSet()


def watch_steps(record: WorkRecord) -> None:
    """Counts `record`'s optimizer steps from now on."""
    _watched.add(record)


def _on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    # Any optimizer in the process; in one process nothing is watched.
    for record in list(_watched):
        record.count_step(optimizer)


register_optimizer_step_post_hook(_on_optimizer_step)


def bits_sum(t: torch.Tensor) -> int:
    """The sum of a tensor's raw bits as integers: equal for bitwise-equal
    tensors whatever the reduction order. Summed as 64-bit words, wrapping
    (addition modulo 2**64 associates, so the thread count does not
    matter): 25 times faster than widening 32-bit words to 64 bits; the
    bytes past the last whole word are added one by one."""
    raw = t.detach().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    total = int(raw[whole:].sum(dtype=torch.int64))
    if whole:
        head = raw[:whole]
        if head.storage_offset() % 8 == 0:
            total += int(head.view(torch.int64).sum())
        else:  # not on a word boundary: a copy that is
            total += int(head.clone().view(torch.int64).sum())
    return total
