"""Rank 0's buffers across processes, in at torch DDP's moment.

torch DDP sends rank 0's buffers (BatchNorm statistics) to every rank before
a forward that follows a synced training step; pyddp sends them at the end of
that step's backward, where the ranks have just met in its last all-reduce, so
that a forward that follows needs no collective (an evaluation may run on some
ranks only). Received there, they go in at this rank's next forward through
the wrapper, as DDP's would: until then every rank keeps its own, as under DDP
(an evaluation through the unwrapped module after the last step, as the
transformers Trainer and Accelerate run it, sees each rank's own statistics).

A buffer whose value this rank changed in between keeps the change (a
checkpoint loaded on every rank: rank 0 loaded the same, which DDP would
send). Values are compared, not version counters: BatchNorm's forward moves
its statistics without moving theirs. A buffer replaced by a new tensor in
between (`model.double()`, an assignment) gets them, as DDP's re-collected
buffers would. Under Join, DDP sends the highest rank with inputs at the
next forward: if that rank is this one and another sent at the end of the
backward, this rank keeps its own; if it is yet another (the one that sent
joined since), every rank takes that rank's buffers at that forward, the
ranks that joined too (their join hook shadows it: JoinStep.resend)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .._link.control import BUFFERS_BROADCAST

Slot = Tuple[Dict[str, Any], str]  # a module's _buffers and a name in it


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _put(now: torch.Tensor, then: torch.Tensor, value: torch.Tensor, gpus: bool) -> None:
    """`value` into `now` if `now` still holds `then`, bit for bit (in
    `then`'s dtype): on GPUs decided on the device (no host read)."""
    if now.shape != then.shape:
        return
    if not gpus:  # on the host: values first (a NaN, unequal to itself, by its bits)
        if (now.dtype == then.dtype and torch.equal(now, then)) or torch.equal(
            _bits(now.to(then.dtype)), _bits(then)
        ):
            now.copy_(value)
        return
    held, was = _bits(now.to(then.dtype)), _bits(then)
    now.copy_(torch.where(torch.eq(held, was).all(), value.to(now.dtype), now))


class StagedBuffers:
    __slots__ = ("_slots", "_own", "_received", "_gpus")

    def __init__(self, gpus: bool) -> None:
        self._gpus = gpus  # the buffers are on GPUs (simulated ones are host memory)
        self._slots: List[Slot] = []
        self._own: Optional[List[torch.Tensor]] = None
        self._received: List[torch.Tensor] = []

    def receive(self, link: Any, model: nn.Module) -> None:
        """Rank 0's values of `model`'s buffers (under Join, the highest
        rank with inputs'), held for put_in with this rank's own values
        now; the buffers are left as they are."""
        step = link.joining.step
        source = link.joining.staged_from = 0 if step is None else step.source
        slots = [(m._buffers, n) for m in model.modules() for n, b in m._buffers.items()
                 if b is not None]  # fmt: skip
        live = [d[n].detach() for d, n in slots]
        if source == link.rank:  # the sender keeps its own: nothing to hold
            link.broadcast(live, BUFFERS_BROADCAST)
            self._own = None
            return
        received = [torch.empty_like(b) for b in live]
        own = [b.clone() for b in live]
        link.broadcast(received, BUFFERS_BROADCAST)
        self._slots, self._own, self._received = slots, own, received

    def put_in(self, link: Any, model: nn.Module, now: bool = False) -> None:
        """Before a forward: writes what receive() held into the buffers
        still holding this rank's values of then, once. Under Join, where
        the rank DDP sends from now is another than the one that sent
        (it joined since), that rank sends its buffers now instead. `now`:
        a synced training forward that no backward answered came before this
        one (outside Join): rank 0 sends its buffers as they are, DDP's
        moment (every rank made that forward, as under DDP)."""
        own, received = self._own, self._received
        self._own, self._received = None, []
        step = link.joining.step  # under Join (set by this forward)
        if now or (step is not None and step.resend):
            # Through `.data`, whose writes move no version counter, as DDP's:
            # a graph of the forward before may hold the buffers (BatchNorm's).
            link.broadcast([b.data for b in model.buffers()], BUFFERS_BROADCAST)
            return
        if own is None:
            return
        if (0 if step is None else step.source) == link.rank:
            return  # DDP's sender now (under Join, the highest rank with inputs) keeps its own
        with torch.no_grad():
            for (d, n), then, value in zip(self._slots, own, received):
                now = d.get(n)
                if now is not None:
                    _put(now, then, value, self._gpus)
