"""Combining per-replica tensors into one on devices[0] (gathered outputs, the
summed loss) as an autograd node whose backward hands each replica its share of
the gradient and calls back the owner to run the replicas' backward (one
replica's: replica_backward), and the input shards that need a gradient cut
where the replicas take them (InputCut).

How a column (one output position, one tensor per replica) is combined:
"cat" concatenates along dim 0; "mean" takes the shard-size-weighted mean of
0-dim tensors (a per-shard mean loss becomes the full-batch mean); "sum" adds."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

try:  # the entry torch.autograd.backward itself calls (logging hooks, TLS context)
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # another torch: the public call
    _engine_run_backward = None

# (replicas' tensors, their grads, the inputs cut, the call: see backward_call)
RunBackward = Callable[[List[List[torch.Tensor]], List[List[Any]], Any, str], None]


class InputCut:
    """Input shards that need a gradient, cut where the replicas take them,
    for CPU replicas, whose backwards run on their workers, each over its own
    graph. A graph upstream of the inputs (layers the wrapped model does not
    own: a GAN's generator before a wrapped discriminator) would be run once
    per replica, and the second run found it freed. Each replica gets a leaf
    of its own instead; CombineFn takes the shards it cut as inputs and
    returns the leaves' gradients to them, so autograd runs that graph once,
    after the replicas."""

    def __init__(self) -> None:
        self.shards: List[torch.Tensor] = []
        self.leaves: List[torch.Tensor] = []

    def cut(self, shard: torch.Tensor) -> torch.Tensor:
        """The leaf replica code sees in place of `shard`."""
        leaf = shard.detach().requires_grad_()
        self.shards.append(shard)
        self.leaves.append(leaf)
        return leaf

    def of(self, r: int, replicas: int) -> List[torch.Tensor]:
        """Replica r's leaves (every replica has one per input cut)."""
        k = len(self.leaves) // replicas
        return self.leaves[r * k : (r + 1) * k]

    def clear(self) -> None:
        """Before the replicas' backward (a kept graph may run again, after
        one that raised before its gradients were taken)."""
        for leaf in self.leaves:
            leaf.grad = None

    def grads(self) -> List[Optional[torch.Tensor]]:
        """The leaves' gradients from the replicas' backward (None where a
        replica did not use its shard)."""
        return [leaf.grad for leaf in self.leaves]


class Combine:
    def __init__(
        self,
        tensors: List[List[torch.Tensor]],
        kinds: Sequence[str],
        device: torch.device,
        weights: Sequence[float],
        run_backward: RunBackward,
        detached: bool,
        cut: Optional[InputCut] = None,
    ):
        """tensors[r][j]: replica r's tensor for column j, combined as kinds[j].
        run_backward(tensors, grads) is called from this node's backward;
        `detached`: the replicas' graphs are run by the owner's workers, so the
        outer graph must not reach them (`cut`: the inputs it reaches instead)."""
        self.tensors = tensors
        self.kinds = list(kinds)
        self.device = device
        self.weights = list(weights)
        self.run_backward = run_backward
        self.detached = detached
        self.cut = cut
        self.outputs = len(tensors) * len(tensors[0])  # (every replica's are as wide)

    def apply(self) -> Tuple[torch.Tensor, ...]:
        flat = [t for ts in self.tensors for t in ts]
        if self.detached:
            # The anchor keeps the output differentiable so this node's
            # backward is called.
            flat = [t.detach() for t in flat]
        return CombineFn.apply(self, _ANCHOR, *flat, *(self.cut.shards if self.cut else ()))

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
        return node.combine(flat[: node.outputs])  # (then the shards InputCut cut)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]):
        ctx.saved_tensors  # noqa: B018 - raises if the graph was freed (see forward)
        node = ctx.node
        per_replica = node.split(grads)
        if node.cut:
            node.cut.clear()
        node.run_backward(node.tensors, per_replica, node.cut, backward_call())
        if node.detached:
            flat_grads: List[Any] = [None] * node.outputs
        else:
            flat_grads = [g for gs in per_replica for g in gs]
        return (None, None, *flat_grads, *(node.cut.grads() if node.cut else ()))


# The anchor every combining node takes (one leaf for all: made once, its
# node found once). Autograd runs its node in a whole backward
# (loss.backward()), not in autograd.grad(out, inputs) or
# backward(inputs=...), which ask for given tensors' gradients only.
_ANCHOR = torch.empty(0, requires_grad=True)
_ANCHOR_NODE = torch.autograd.graph.get_gradient_edge(_ANCHOR).node


def backward_call() -> str:
    """What the running backward computes: "backward" (every gradient),
    else "inputs": given tensors' gradients only (autograd.grad,
    backward(inputs=...))."""
    return "backward" if torch._C._will_engine_execute_node(_ANCHOR_NODE) else "inputs"


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


def replica_backward(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[Any],
    retain: bool,
    inputs: Sequence[torch.Tensor] = (),
) -> None:
    """torch.autograd.backward(tensors, grads, retain_graph=retain,
    inputs=inputs or None) over one replica's outputs that need a gradient
    and got one (a constant auxiliary loss on a shard without the case has
    none), without the public call's argument handling (~30 us a call on a
    2-core Xeon, once per replica per step): the gradients are this model's
    own split of the outer gradient, plain tensors of the outputs' shapes.
    Anything else takes the public call: a shape that differs (the public
    call raises where the engine would broadcast), tensor subclasses or an
    active torch function mode (which may override backward), a torch
    without the engine entry."""
    pairs = [(t, g) for t, g in zip(outputs, output_grads) if g is not None and t.requires_grad]
    if not pairs:
        return
    tensors, grads = tuple(t for t, _ in pairs), tuple(g for _, g in pairs)
    if (
        _engine_run_backward is None
        or torch._C._is_torch_function_mode_enabled()
        or any(type(t) is not torch.Tensor for t in (*tensors, *grads))
        or any(t.shape != g.shape for t, g in zip(tensors, grads))
    ):
        torch.autograd.backward(tensors, grads, retain_graph=retain, inputs=inputs or None)
        return
    _engine_run_backward(
        tensors, grads, retain, False, tuple(inputs), allow_unreachable=True, accumulate_grad=True
    )


def keep_graph() -> bool:
    """Whether the backward running now keeps its graph (retain_graph=True)."""
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(query()) if query is not None else False
