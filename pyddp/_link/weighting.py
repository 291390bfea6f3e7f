"""dmodel.loss's weighting across processes: gradients are averaged over
processes, so each rank's per-replica losses are scaled by world x rows here /
rows everywhere, which keeps an uneven global batch exact. The rows everywhere
are exchanged once and then assumed; the agreement after the buckets carries
each rank's rows (a Window's loads), and finish() rescales by assumed / actual
when they changed. One synced backward's weighings are its Window."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch


class Weighting:
    def __init__(self, world: int):
        self.world = world
        # The global batch's rows when the ranks last exchanged them, and
        # this rank's rows then; this synced backward's weighings; the
        # global batch's loss of the last training step (CPU replicas).
        self.agreed: Optional[Tuple[float, float]] = None
        self.window = Window()
        self.global_loss: Optional[float] = None

    def take_window(self) -> Window:
        """The ending synced backward's weighings; the next one starts empty."""
        window, self.window = self.window, Window()
        return window

    def weigh(
        self,
        losses: List[torch.Tensor],
        rows: int,
        reduction: str,
        synced: bool,
        carried: bool,
        known: Optional[int],
        join: Any,
        host_sums: bool,
        exchange: Callable[[Sequence[float]], List[float]],
    ) -> List[torch.Tensor]:
        """Gradients are averaged over processes. "sum" (over the global
        batch): the average over processes is undone. "mean": this rank's
        are scaled by world * rows here / rows everywhere, so an uneven
        global batch stays exact. The rows everywhere are exchanged once and
        then assumed: the agreement after the buckets carries each rank's
        rows, and finish() rescales the gradients by assumed / actual (1.0,
        no pass, while no rank's rows change; on GPUs on the device, always).
        Micro-batches under no_sync() exchange their rows before their
        backward (a window's gradients can only be rescaled as a whole), and
        so does the synced backward that ends their window, and one whose
        buckets carry the last reduction (`carried`: no zero_grad since; a
        rescale would scale that too; or a communication hook reduces).
        `known`: the global batch's rows from the caller (the Trainer's
        loader), used as they are: no exchange, nothing assumed, nothing to
        rescale. The global
        batch's loss (CPU replicas) is in self.global_loss. `join`: this
        forward's step under torch's Join (None outside); `host_sums`: the
        agreement's sums come to the host (CPU replicas); `exchange`: the
        sum of a few floats over the ranks."""
        window, agreed = self.window, self.agreed
        window.weighed = True  # weighed: no Join divisor on top (the rows are exact)
        if reduction != "mean":
            self.global_loss = None  # (a mean's alone, not the last mean step's)
            return [ScaleGrad.apply(v, float(self.world)) for v in losses]
        # On GPUs (the simulation's too) reading the loss would make the host wait.
        on_host = host_sums and all(v.device.type == "cpu" for v in losses)
        # (a rank without rows adds no loss: its own is NaN for a mean)
        local = sum(float(v.detach()) for v in losses) if on_host and rows else 0.0
        if join is not None:
            # Under Join this forward's exchange carried the global batch's
            # rows: exact, with no exchange here; the global loss travels in
            # the agreement.
            rows_all = join.rows
            self.agreed = (rows_all, float(rows))
            if synced:
                window.weigh(rows, local * rows, False, on_host)
                self.global_loss = None  # known after the backward
            scale = self.world * rows / rows_all if rows_all > 0 else 0.0
            return [ScaleGrad.apply(v, scale) for v in losses]
        if known is not None and known > 0:
            self.agreed = (float(known), float(rows))
            if synced:  # the agreement brings the global loss (no rescale: unchanged)
                window.weigh(rows, local * rows, False, on_host)
            self.global_loss = None
            scale = self.world * rows / known
        elif synced and not (window.exchanged or carried) and agreed is not None and agreed[0] > 0:
            window.weigh(rows, local * rows, rows != agreed[1], on_host)
            self.global_loss = None  # known after the backward
            scale = self.world * rows / agreed[0]
        else:
            rows_all, loss_sum = exchange([float(rows), local * rows])
            window.exchanged = True
            self.agreed = (rows_all, float(rows))
            self.global_loss = loss_sum / rows_all if on_host and rows_all > 0 else None
            scale = self.world * rows / rows_all if rows_all > 0 else 0.0
        return [ScaleGrad.apply(v, scale) for v in losses]

    def cpu_factor(self, window: Window, sums: Any, fail: Callable[[str], None]) -> float:
        """CPU: what the gradients weighed without an exchange still need
        (1.0 if the global batch had the rows assumed), and the global loss."""
        if not window.assumed or self.agreed is None:
            return 1.0
        assumed, rows = self.agreed[0], sums.rows
        self.global_loss = sums.loss_rows / rows if rows > 0 and window.on_host else None
        if sums.changed == 0 or rows <= 0:
            return 1.0
        if sums.varied:
            fail(
                "dmodel.loss weighed losses of different rows in one synced backward and the "
                "global batch's rows changed: the gradients can no longer be weighed exactly; "
                "weigh one batch per synced backward (no_sync() for the others)"
            )
        self.agreed = None  # exchanged again at the next weighing
        return assumed / rows


class Window:
    """The dmodel.loss weighings of one synced backward (and its no_sync()
    micro-batches)."""

    def __init__(self) -> None:
        self.exchanged = False  # some weighing exchanged its rows
        self.assumed = 0  # weighings on the rows agreed before
        self.rows = 0.0  # the first such weighing's rows here
        self.loss_rows = 0.0  # the last one's loss x rows here (CPU)
        self.changed = False  # some had other rows here than at the exchange
        self.varied = False  # they had different rows here
        self.on_host = True
        self.weighed = False  # dmodel.loss weighed some loss of this window

    def weigh(self, rows: float, loss_rows: float, changed: bool, on_host: bool) -> None:
        if not self.assumed:
            self.rows = float(rows)
        self.varied = self.varied or float(rows) != self.rows
        self.assumed += 1
        self.loss_rows = loss_rows
        self.changed = self.changed or changed
        self.on_host = on_host

    def loads(self) -> List[float]:
        return [self.rows, self.loss_rows, float(self.changed), float(self.varied)]


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad * ctx.scale, None
