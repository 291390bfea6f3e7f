"""Combining per-replica tensors into one on devices[0] (gathered outputs, the
summed loss) as an autograd node whose backward hands each replica its share of
the gradient and calls back the owner to run the replicas' backward.

How a column (one output position, one tensor per replica) is combined:
"cat" concatenates along dim 0; "mean" takes the shard-size-weighted mean of
0-dim tensors (a per-shard mean loss becomes the full-batch mean); "sum" adds."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

RunBackward = Callable[[List[List[torch.Tensor]], List[List[Any]]], None]


class Combine:
    def __init__(
        self,
        tensors: List[List[torch.Tensor]],
        kinds: Sequence[str],
        device: torch.device,
        weights: Sequence[float],
        run_backward: RunBackward,
        detached: bool,
    ):
        """tensors[r][j]: replica r's tensor for column j, combined as kinds[j].
        run_backward(tensors, grads) is called from this node's backward;
        `detached`: the replicas' graphs are run by the owner's workers, so the
        outer graph must not reach them."""
        self.tensors = tensors
        self.kinds = list(kinds)
        self.device = device
        self.weights = list(weights)
        self.run_backward = run_backward
        self.detached = detached

    def apply(self) -> Tuple[torch.Tensor, ...]:
        flat = [t for ts in self.tensors for t in ts]
        if self.detached:
            # The anchor keeps the output differentiable so this node's
            # backward is called.
            flat = [t.detach() for t in flat]
        anchor = torch.empty(0, requires_grad=True)
        return CombineFn.apply(self, anchor, *flat)

    def combine(self, flat: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        width = len(self.tensors[0])
        columns = [[flat[r * width + j] for r in range(len(self.tensors))] for j in range(width)]
        return tuple(
            combine_column(c, k, self.device, self.weights) for c, k in zip(columns, self.kinds)
        )

    def split(self, grads: Sequence[Optional[torch.Tensor]]) -> List[List[Any]]:
        out: List[List[Any]] = [[] for _ in self.tensors]
        for j, g in enumerate(grads):
            column = [ts[j] for ts in self.tensors]
            kind = self.kinds[j]
            if g is None:
                parts: List[Any] = [None] * len(column)
            elif kind == "sum":
                parts = [g] * len(column)
            elif kind == "mean":
                parts = [g * w for w in self.weights]
            else:
                parts = list(g.split([t.shape[0] for t in column]))
            for r, (t, part) in enumerate(zip(column, parts)):
                out[r].append(None if part is None else part.to(t.device))
        return out


class CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, node: Combine, anchor: torch.Tensor, *flat: torch.Tensor):
        ctx.node = node
        ctx.set_materialize_grads(False)
        # Saved so that a second backward without retain_graph=True fails in
        # autograd itself, with torch's own message, before any replica runs.
        ctx.save_for_backward(anchor)
        return node.combine(flat)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]):
        ctx.saved_tensors  # noqa: B018 - raises if the graph was freed (see forward)
        node = ctx.node
        per_replica = node.split(grads)
        node.run_backward(node.tensors, per_replica)
        if node.detached:
            flat_grads: List[Any] = [None] * sum(len(ts) for ts in node.tensors)
        else:
            flat_grads = [g for gs in per_replica for g in gs]
        return (None, None, *flat_grads)


def combine_column(
    column: Sequence[torch.Tensor], kind: str, device: torch.device, weights: Sequence[float]
) -> torch.Tensor:
    """The value of one combined column (also for columns that need no gradient)."""
    if kind == "cat":
        moved = [t.to(device) for t in column]
        return torch.stack(moved) if moved[0].dim() == 0 else torch.cat(moved)
    if kind == "mean":
        column = [t * w for t, w in zip(column, weights)]
    total = column[0].to(device)
    for t in column[1:]:
        total = total + t.to(device)
    return total
