"""Joining per-replica tensors into one on devices[0] (gathered outputs, the
summed loss) as an autograd node whose backward hands each replica its slice of
the gradient and lets the owning model run the replicas' backward."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

import torch

if TYPE_CHECKING:
    from .model import DistributedModel


class Join:
    """Joins per-replica tensors into tensors on devices[0] ("cat": along dim 0,
    0-dim ones stacked; "sum": added) with a backward that hands each replica
    its slice of the gradient."""

    def __init__(self, owner: DistributedModel, tensors: List[List[torch.Tensor]], kind: str):
        self.owner = owner
        self.tensors = tensors
        self.kind = kind

    def apply(self) -> Tuple[torch.Tensor, ...]:
        flat = [t for ts in self.tensors for t in ts]
        if self.owner._parallel_backward:
            # Detached: the outer autograd graph must not reach the replicas'
            # graphs, which the workers run. The anchor keeps the output
            # differentiable so this node's backward is called.
            flat = [t.detach() for t in flat]
        anchor = torch.empty(0, requires_grad=True)
        return JoinFn.apply(self, anchor, *flat)

    def combine(self, flat: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        width = len(self.tensors[0])
        columns = [[flat[r * width + j] for r in range(len(self.tensors))] for j in range(width)]
        device = self.owner.devices[0]
        if self.kind == "sum":
            return tuple(sum_on(c, device) for c in columns)
        return tuple(concat(c, device) for c in columns)

    def split(self, grads: Sequence[Optional[torch.Tensor]]) -> List[List[Any]]:
        out: List[List[Any]] = [[] for _ in self.tensors]
        for j, g in enumerate(grads):
            column = [ts[j] for ts in self.tensors]
            if g is None:
                parts: List[Any] = [None] * len(column)
            elif self.kind == "sum":
                parts = [g] * len(column)
            elif column[0].dim() == 0:
                parts = list(g.unbind(0))
            else:
                parts = list(g.split([t.shape[0] for t in column]))
            for r, (t, part) in enumerate(zip(column, parts)):
                out[r].append(None if part is None else part.to(t.device))
        return out


class JoinFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, join: Join, anchor: torch.Tensor, *flat: torch.Tensor):
        ctx.join = join
        ctx.set_materialize_grads(False)
        return join.combine(flat)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]):
        join = ctx.join
        per_replica = join.split(grads)
        join.owner._backward(join.tensors, per_replica)
        if join.owner._parallel_backward:
            flat_grads: List[Any] = [None] * sum(len(ts) for ts in join.tensors)
        else:
            flat_grads = [g for gs in per_replica for g in gs]
        return (None, None, *flat_grads)


def concat(column: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    moved = [t.to(device) for t in column]
    return torch.stack(moved) if moved[0].dim() == 0 else torch.cat(moved)


def sum_on(column: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = column[0].to(device)
    for t in column[1:]:
        total = total + t.to(device)
    return total
