"""The per-backward agreement of the link: at each synced backward, which
parameters hold a gradient on some process, and a record of the work each
rank did since the last one (optimizer steps, micro-batches, train/eval, a
parameter checksum), compared so that ranks that drifted apart raise
instead of averaging different iterations' gradients together."""

from __future__ import annotations

import datetime
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .control import Control, exchange
from .groups import allreduce, first_line

AGREEMENT = exchange("the agreement at the end of a synced backward")
DISAGREEMENT = exchange("the records of a disagreement between ranks")
_AGREEMENT_TAG = 0x70796464  # "pydd": a record paired with another exchange shows here

# Works left pending by a failure stay referenced here: dropping a pending
# gloo work from the thread that fails (inside autograd's end-of-backward
# callback) could block it on that work's completion.
_in_flight: List[Any] = []


class Agreement:
    def __init__(self, control: Control):
        self.control = control
        self.peers, self.failure = control.peers, control.failure
        self.exposed_ns = 0  # the last one's exposed time (launching, and waiting once done)
        self._work: Optional[Any] = None
        self._launch_ns = 0
        self._none_here: List[int] = []
        self._mask: Optional[torch.Tensor] = None
        self._record: Dict[str, int] = {}
        self._size = 0
        self._header: Optional[tuple] = None

    def start(self, none_here: Sequence[int], size: int, record: Dict[str, int]) -> None:
        """Starts the exchange on which parameters hold a gradient on some
        process (a uint8 mask, MAX over ranks), carrying `record`: its bytes
        and their complements, so MAX gives both the largest and the smallest
        value of each byte. Asynchronous on the control group: it travels
        while the bucket reductions finish, so it adds latency only where it
        outlasts them."""
        self.failure.check()
        t0 = time.perf_counter_ns()
        # A header first, as for every control exchange, enqueued without
        # waiting (the agreement stays overlapped with the bucket reductions)
        # and checked in unused_everywhere before the mask is read. A rank at
        # another exchange (a buffer broadcast before a training forward it
        # alone ran) sees the mismatch in its header and never sends that
        # exchange's payload, so the mask never meets a message of another size.
        self._header = self.control.start_header(AGREEMENT)
        packed = torch.tensor([_AGREEMENT_TAG, *record.values()], dtype=torch.int64)
        packed = packed.view(torch.uint8)
        n = packed.numel()
        mask = torch.ones(size + 2 * n, dtype=torch.uint8)
        mask[list(none_here)] = 0
        mask[size : size + n] = packed
        mask[size + n :] = 255 - packed
        self._none_here = list(none_here)
        self._mask, self._record, self._size = mask, dict(record), size
        self._work = allreduce(self.control.group, mask, dist.ReduceOp.MAX)
        self._launch_ns = time.perf_counter_ns() - t0

    def unused_everywhere(self) -> List[int]:
        """After the bucket reductions: the parameters with a gradient on no
        process. Raises on every rank, naming fields and ranks, if the
        ranks' records differ."""
        work, self._work = self._work, None
        if work is None:
            return []
        t0 = time.perf_counter_ns()
        _in_flight.append(work)  # never destroyed while pending (see _in_flight)
        where = f"synced backward {self.peers.iteration}"
        self.control.check_header(AGREEMENT, self._header, where=where)
        timeout = self.peers.timeout
        try:
            ok = work.wait(timeout=datetime.timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - named below
            self.failure.fail(
                f"the exchange on unused parameters failed: {first_line(e)}", where=where
            )
        if ok is False:
            self.failure.fail(
                f"the exchange on unused parameters took over {timeout:g} s", where=where
            )
        # The exposed part: launching it, and waiting for it once the buckets
        # were done.
        _in_flight.remove(work)
        self.exposed_ns = time.perf_counter_ns() - t0 + self._launch_ns
        size, mask = self._size, self._mask
        n = (mask.numel() - size) // 2
        if not torch.equal(mask[size : size + n], 255 - mask[size + n :]):
            self._disagreement()
        return [i for i in self._none_here if not mask[i]]

    def _disagreement(self) -> None:
        """The ranks' records differ (every rank sees it): exchange them and
        name each differing field with every rank's value."""
        records = self.control.gather_objects(self._record, DISAGREEMENT)
        lines = []
        for field in self._record:
            values = [rec.get(field) for rec in records]
            if len(set(values)) > 1:
                ranks = self.peers.ranks
                shown = ", ".join(f"rank {ranks[r]} {v!r}" for r, v in enumerate(values))
                lines.append(f"{field}: {shown}")
        self.failure.fail(
            "the ranks did different work before this synced backward ("
            + "; ".join(lines or ["records differ (a rank paired this exchange with another)"])
            + "): one rank stepped its optimizer more often, ran a micro-batch under no_sync() "
            "the others did not, switched model.train()/eval() alone, or changed its "
            "parameters outside pyddp; its replicas would differ for the rest of the run",
            census=False,
            where=f"synced backward {self.peers.iteration}",  # wait() has counted it
        )
