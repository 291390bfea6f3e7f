"""The bucket layout: each replica's gradients live in flat per-bucket
buffers and every `param.grad` is a view into them, so reducing a bucket
needs no copy (docs/design.md, invariant 2). This object owns the buffers, the
views, their addresses and version counters: laying them out (again, after
a rebuild or after Module._apply moved storage), keeping replicas' copies
in step, and settling parameters a replica produced no gradient for."""

from __future__ import annotations

import operator
import threading
from itertools import compress, repeat
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .ending import Window, fresh_views, reseat, slot_view, views_left
from .scattered import Scattered


class BucketLayout:
    def __init__(
        self,
        params: Sequence[Sequence[torch.Tensor]],
        dtypes: Sequence[str],
        set_buffer: Callable[[int, int, int, int, str, int, int], None],
        gpu_devices: Optional[Sequence[int]],
        before_host_write: Callable[[int], None],
        zeros: Callable[[int, torch.dtype, int], torch.Tensor],
    ):
        """`params[r]`: replica r's trainable parameters; `set_buffer` tells
        the engine where a bucket lives; `before_host_write(r)` orders the
        current stream after reductions still reading replica r's buckets;
        `zeros(count, dtype, r)` allocates a bucket of replica r's."""
        self.params = params
        self.dtypes = list(dtypes)
        self._set_buffer = set_buffer
        self._gpu_devices = gpu_devices
        self._before_host_write = before_host_write
        self._zeros = zeros
        n = len(params[0])
        self.views: List[List[Optional[torch.Tensor]]] = [[None] * n for _ in params]
        self.flat: List[List[torch.Tensor]] = [[] for _ in params]
        # NCCL with wire compression: a 16-bit copy of every float32 bucket.
        self.wire_dtype: Optional[torch.dtype] = None
        self._wire: List[List[torch.Tensor]] = [[] for _ in params]
        # Per replica, where each gradient view was laid out (0: none, sharded).
        self.ptrs: List[List[int]] = [[0] * n for _ in params]
        self._versions: Optional[List[List[int]]] = None  # the buffers' at finish()
        self.riding: Optional[torch.Tensor] = None  # allocate's `spare`
        # Sharded gradients (Engine.set_scatter): every bucket padded to a
        # multiple of the ranks, one block each.
        self.pad_to = 1
        self._adopted = 0  # gradients that arrived outside the buckets and were copied in
        # Per replica and parameter: set to None by hand_over, not yet back.
        # Bytearrays: the C++ hooks (pyddp._hot) read and clear them in place.
        self._handed = [bytearray(n) for _ in params]
        self.window = Window()  # a no_sync() accumulation under way (ending.py)
        # The C++ hooks, if any (hooks.py): told the views after each layout.
        self.hot: Optional[Any] = None
        # Sharded gradients (scattered.py): blocks kept, buckets transient.
        self.scattered: Optional[Scattered] = None
        self.handles: List[Any] = []  # the reducer's hooks, removed at its close (hooks.py)
        self._scatter_setup: Optional[tuple] = None
        self._resets_lock = threading.Lock()

    def scatter_setup(
        self,
        rank_of: Sequence[int],
        engine: Any,
        retire: Callable[..., None],
        early: bool,
        direct: bool,
    ) -> None:
        """Sharded gradients from the next allocate on (pad_to > 1): scattered.py."""
        self._scatter_setup = (list(rank_of), engine, retire, early, direct)

    def zeros_for(self, count: int, dtype: torch.dtype, r: int) -> torch.Tensor:
        return self._zeros(count, dtype, r)

    def empty_for(self, count: int, dtype: torch.dtype, r: int) -> torch.Tensor:
        """Uninitialised on CPUs (the caller writes every element); zeroed on GPUs,
        where the stream provider allocates (the simulation: with guard zones)."""
        if self._gpu_devices is None:
            return torch.empty(count, dtype=dtype)
        return self._zeros(count, dtype, r)

    def tell_engine(self, r: int, b: int, flat: torch.Tensor) -> None:
        """Replica r's bucket b now lives in `flat` (sharded gradients)."""
        device = -1 if self._gpu_devices is None else self._gpu_devices[r]
        dtype = self.dtypes[self.scattered.buckets[b][0]]
        self._set_buffer(r, b, flat.data_ptr(), flat.numel(), dtype, device, 0)

    def handed(self, r: int, i: int) -> None:
        self._handed[r][i] = True

    @property
    def adopted(self) -> int:
        """Gradients copied into the buckets (by the Python hooks and the C++ ones)."""
        return self._adopted + (self.hot.adopted() if self.hot is not None else 0)

    def tell_hooks(self) -> None:
        """The C++ hooks learn every replica's views (after each layout);
        under sharded gradients they hand every gradient to Python."""
        if self.hot is None:
            return
        self.hot.set_python_only(self.scattered is not None)
        for r, (views, ptrs) in enumerate(zip(self.views, self.ptrs)):
            self.hot.set_views(r, views, ptrs)

    def _allocate_scattered(self, buckets: Sequence[Sequence[int]]) -> None:
        """Sharded gradients: every replica's blocks, and no bucket until a
        gradient needs one; gradients held now are copied into theirs."""
        rank_of, engine, retire, early, direct = self._scatter_setup
        held = [[p.grad for p in params] for params in self.params]
        for r in range(len(self.params)):
            self.flat[r] = [None] * len(buckets)  # type: ignore[list-item]
            self.views[r][:] = [None] * len(self.views[r])
            self._wire[r] = []
        self.scattered = Scattered(
            self, buckets, self.pad_to, rank_of, engine, retire, early, direct
        )
        with torch.no_grad():
            for r, grads in enumerate(held):
                for i, g in enumerate(grads):
                    if g is not None:
                        self.scattered.ensure(r, self.scattered.bucket_of[i])
                        self.views[r][i].copy_(g)
                        self.params[r][i].grad = self.views[r][i]
        for ptrs in self.ptrs:
            ptrs[:] = [0] * len(ptrs)
        self._versions = None
        self.tell_hooks()

    def allocate(self, buckets: Sequence[Sequence[int]], spare: int = 0) -> None:
        """Allocates flat buffers for `buckets` and points every gradient there,
        keeping the values gradients already hold. `spare`: elements after
        replica 0's last bucket (self.riding: that bucket and them)."""
        self.riding = None
        if self.pad_to > 1:
            self._allocate_scattered(buckets)
            return
        pad = self.pad_to
        for r, params in enumerate(self.params):
            flats, wires = [], []
            for b, members in enumerate(buckets):
                count = sum(params[i].numel() for i in members)
                count = -(-count // pad) * pad  # sharded gradients: a block per rank
                room = spare if r == 0 and b == len(buckets) - 1 else 0
                flat = self._zeros(count + room, params[members[0]].dtype, r)
                if room:
                    self.riding, flat = flat, flat[:count]
                offset = 0
                for i in members:
                    p = params[i]
                    view = slot_view(flat, offset, p)
                    offset += p.numel()
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view
                    self.views[r][i] = view
                device = -1 if self._gpu_devices is None else self._gpu_devices[r]
                wire = 0
                if self.wire_dtype is not None and flat.dtype == torch.float32:
                    wires.append(self._zeros(count, self.wire_dtype, r))
                    wire = wires[-1].data_ptr()
                dtype = self.dtypes[members[0]]
                self._set_buffer(r, b, flat.data_ptr(), count, dtype, device, wire)
                flats.append(flat)
            self.flat[r], self._wire[r] = flats, wires
        for ptrs, views in zip(self.ptrs, self.views):  # (in place: the hooks hold them)
            ptrs[:] = map(operator.methodcaller("data_ptr"), views)
        self._versions = None
        self.tell_hooks()

    def memory(self) -> List[List[torch.Tensor]]:
        """Per replica, every tensor holding its bucket memory now."""
        if self.scattered is not None:
            return [self.scattered.memory(r) for r in range(len(self.params))]
        return [flats + wires for flats, wires in zip(self.flat, self._wire)]

    def moved(self, assigned: bool = True) -> bool:
        """Whether replica 0's gradients left their bucket views: Module._apply
        or `p.grad.data = ...` gave them new storage (views_left), or (`assigned`)
        one was assigned. The buckets stay allocated: their addresses are not reused."""
        if self.scattered is not None:
            return bool(self.scattered.moved(0))  # only a no_sync() window's buckets stay
        if views_left(self):
            return True
        if not assigned:  # (the caller's hooks adopt an assigned gradient)
            return False
        grads = zip(map(operator.attrgetter("grad"), self.params[0]), self.ptrs[0])
        return any([g is not None and g.data_ptr() != ptr for g, ptr in grads])

    def bucket_bytes(self) -> List[int]:
        flat = self.flat[0] if self.scattered is None else None
        return self.scattered.bucket_bytes() if flat is None else [f.nbytes for f in flat]

    # ------------------------------------------------------ single gradients
    def hand_over(self) -> None:
        """zero_grad(set_to_none=True): every gradient None, the buckets left
        as they are. Autograd hands each replica its next gradient as a new
        tensor, which adopt() copies in (one pass over the memory, where
        zeroing and accumulating would take two); not counted as adopted."""
        for params, handed in zip(self.params, self._handed):
            for i, p in enumerate(params):
                p.grad = None
                handed[i] = True
        self.window.close()
        if self.scattered is not None:
            self.scattered.consume()

    def adopt(self, p: torch.Tensor, view: torch.Tensor, r: int = 0, i: int = -1) -> None:
        """The gradient is not the bucket view (grad was None, or replaced by
        the user; or its view given other storage: `p.grad.data = ...` after
        the forward): copy it in once; later backwards accumulate in place."""
        g = p.grad
        if g.is_sparse:
            raise RuntimeError(
                "pyddp: a parameter produced a sparse gradient; sparse gradients are not "
                "supported (construct nn.Embedding/EmbeddingBag with sparse=False)"
            )
        if view is None:  # sharded gradients: the bucket's first gradient on this replica
            view = self._view(r, i)
        elif i >= 0 and self.ptrs[r][i] not in (0, view.data_ptr()):
            view = reseat(self, r, i)
        view.copy_(g)
        p.grad = view
        if i >= 0 and self._handed[r][i]:
            self._handed[r][i] = False
        else:
            self._adopted += 1

    def take_in(self, r: int, i: int) -> None:
        """Replica r produced no gradient for parameter i this backward: its slice takes
        part as is, unless its grad was reset (None: zero) or replaced (copied in)."""
        grad, view = self.params[r][i].grad, self._view(r, i)
        if grad is view and self.ptrs[r][i] in (0, view.data_ptr()):
            return
        if grad is None:
            view.zero_()
            self._handed[r][i] = False
        else:
            self.adopt(self.params[r][i], view, r, i)

    def zero_param(self, i: int) -> None:
        """Parameter i's slice reads zero on every replica."""
        for r in range(len(self.views)):
            self._view(r, i).zero_()

    def _view(self, r: int, i: int) -> torch.Tensor:
        """Replica r's view of parameter i's gradient slice; under sharded
        gradients its bucket is allocated first if the replica holds none."""
        view = self.views[r][i]
        if view is None:
            self.scattered.ensure(r, self.scattered.bucket_of[i])
            view = self.views[r][i]
        return view

    def grads_to_none(self, i: int) -> None:
        """Parameter i has no gradient anywhere: None, as on one device."""
        for params in self.params:
            params[i].grad = None

    def point_grads(self, i: int) -> None:
        """Parameter i was reduced without every replica producing it: the reduced slice."""
        for params, views in zip(self.params, self.views):
            if params[i].grad is not views[i]:
                params[i].grad = views[i]

    # -------------------------------------------------------- whole buckets
    def keep(self, engine: Any) -> Tuple[Any, ...]:
        """Every replica's gradients as they are (put_back restores them):
        the buckets' values, which gradients are None, and the engine's view
        (which it counts as present, which replicas hold a reduced copy)."""
        if self.scattered is not None:
            raise NotImplementedError(
                "pyddp: shard='gradients' under torch's Join (dmodel.join()): a rank that "
                "joined would have to shadow the reduce-scatters; use shard=True or shard=False"
            )
        values = [[f.clone() for f in flats] for flats in self.flat]
        nones = [[p.grad is None for p in params] for params in self.params]
        present = [engine.has_grad(i) for i in range(len(self.params[0]))]
        copies = [engine.holds_reduced_copy(r) for r in range(len(self.params))]
        return values, nones, present, copies

    def put_back(self, engine: Any, kept: Tuple[Any, ...]) -> None:
        values, nones, present, copies = kept
        with torch.no_grad():
            for flats, saved in zip(self.flat, values):
                torch._foreach_copy_(flats, saved)
        for params, views, none in zip(self.params, self.views, nones):
            for p, view, is_none in zip(params, views, none):
                p.grad = None if is_none else view
        self.forget_reduced()
        for i, had in enumerate(present):
            engine.note_grad(i, had)
        for r, held in enumerate(copies):
            engine.restore_reduced_copy(r, held)

    def zero(self, r: int, copy_dropped: bool = False) -> None:
        """Replica r's gradients read zero. `copy_dropped` (its copy of the last
        reduction; replica 0 carries the sum): one the user reset on replica 0
        since (torch's model.zero_grad()) is None here too, as after zero_grad()."""
        if self.scattered is not None:
            self.scattered.zero(r)
        for flat in self.flat[r]:
            if flat is not None:
                flat.zero_()
        self._handed[r][:] = bytes(len(self._handed[r]))  # in place: the C++ hooks hold it
        grads = map(operator.attrgetter("grad"), self.params[0]) if copy_dropped else ()
        nones = list(map(operator.is_, grads, repeat(None)))  # (C-level: none in the steady state)
        for i in compress(range(len(nones)), nones) if True in nones else ():
            self.params[r][i].grad = None
            self._handed[r][i] = self._handed[0][i] = True

    def follow_resets(self, engine: Any, forward: bool = False, guard: bool = False) -> None:
        """Once per reduction, before any replica accumulates on it, where
        every replica keeps a copy of it (op="avg": each the mean): replica 0's
        gradients reset by the user since (torch's `model.zero_grad()`) are reset
        on every replica, or the others would add the old reduction into the next.
        Sharded gradients: what the user did to replica 0's placeholders
        (scattered.py), at the start of backward (`forward`: guarded, if `guard`)."""
        with self._resets_lock:  # prepare(r) runs in each replica's forward
            if self.scattered is not None:
                return self.scattered.guard(guard) if forward else self.scattered.reconcile(False)
            if len(self.flat) > 1 and all(
                engine.holds_reduced_copy(r) for r in range(len(self.flat))
            ):
                self._follow_resets()

    def _follow_resets(self) -> None:
        """Replica 0's gradients reset by the user are reset on every
        replica. A gradient set to None (torch's zero_grad) resets its
        parameter; a bucket changed in place on replica 0 alone
        is reset if it now reads zero (`zero_grad(set_to_none=False)`,
        `p.grad.zero_()` over the bucket), else copied to the others (each
        copy is the whole mean)."""
        for i, p in enumerate(self.params[0]):
            if p.grad is None and not self._handed[0][i]:  # reset: as hand_over, for it
                for r, views in enumerate(self.views):
                    self._before_host_write(r)
                    views[i].zero_()
                    self.params[r][i].grad, self._handed[r][i] = None, True
        if self._versions is None:
            return
        now = [[f._version for f in flats] for flats in self.flat]
        with torch.no_grad():
            for b, flat0 in enumerate(self.flat[0]):
                moved0 = now[0][b] - self._versions[0][b]
                if all(now[r][b] - self._versions[r][b] == moved0 for r in range(1, len(now))):
                    continue  # untouched, or changed alike on every replica (pyddp's own)
                if not bool(flat0.count_nonzero() == 0):
                    for r in range(1, len(self.flat)):
                        self._before_host_write(r)
                        self.flat[r][b].copy_(flat0)
                    continue
                for r in range(1, len(self.flat)):
                    self._before_host_write(r)
                    self.flat[r][b].zero_()
        self.mark_reduced()

    def copy_to_others(self, buckets: Sequence[int]) -> None:
        """Replica 0's values of `buckets` on every other replica (reduced
        across processes through replica 0's buffers)."""
        if len(self.flat) > 1:
            with torch.no_grad():
                for b in buckets:
                    for flats in self.flat[1:]:
                        if flats[b] is not None:
                            flats[b].copy_(self.flat[0][b])

    def scale(self, factor: Any) -> None:
        """Every bucket times `factor`: a float, or a 0-dim tensor per replica."""
        factors = factor if isinstance(factor, (list, tuple)) else [factor] * len(self.flat)
        with torch.no_grad():
            for r, (flats, f) in enumerate(zip(self.flat, factors)):
                # Sharded gradients: a reduction that landed in the blocks
                # is scaled there; CPUs in one process free buckets during
                # backward, and there nothing is scaled (factor 1).
                landed = self.scattered.landed(r) if self.scattered is not None else set()
                held = [t for b, t in enumerate(flats) if t is not None and b not in landed]
                held += [self.scattered.blocks[r][b] for b in landed]
                if held:
                    torch._foreach_mul_(held, f)

    def _follow_assigned(self) -> None:
        """Gradients assigned on replica 0 since finish() (`p.grad = p.grad
        * 0.5`, a clamp; to a parameter backward left without one): copied
        into its bucket view, every replica's gradient (the version check
        below carries the values), as is one given storage of its own
        (`p.grad.data = ...`: fresh_views). Set to None: None everywhere."""
        fresh_views(self)
        for i, (p, view) in enumerate(zip(self.params[0], self.views[0])):
            g = p.grad
            if g is view:
                continue
            if g is None:
                for params in self.params[1:]:
                    params[i].grad = None
                continue
            if g.is_sparse:
                raise RuntimeError(
                    f"pyddp: a sparse gradient was assigned to parameter {i} after backward; "
                    "assign a dense one (.to_dense())"
                )
            self._before_host_write(0)
            with torch.no_grad():
                view.copy_(g)
            for params, views in zip(self.params, self.views):
                params[i].grad = views[i]

    def mark_reduced(self) -> None:
        """At the end of finish(): the buffers' versions, for align(); none if
        replica 0's gradients had left their views (no assignment to follow)."""
        if self.scattered is not None:
            return  # no buffer outlives a synced backward: nothing to compare
        left = views_left(self)  # (the backward accumulated outside the buckets)
        self._versions = None if left else [[f._version for f in flats] for flats in self.flat]

    def forget_reduced(self) -> None:
        self._versions = None

    def any_gradient(self, r: int) -> bool:
        """Whether a parameter of replica r has a gradient (C-level pass)."""
        grads = map(operator.attrgetter("grad"), self.params[r])
        return any(map(operator.is_not, grads, repeat(None)))

    def align(self) -> None:
        """Before a step: gradients changed on replica 0 only since finish() (torch's
        clip_grad_norm_, a GradScaler's unscale_ over the model's own parameters) are
        copied to the other replicas, seen through the buffers' version counters."""
        if self.scattered is not None:
            self.scattered.reconcile(before_step=True)  # replica 0's placeholders
            return
        if self._versions is None:
            return
        self._follow_assigned()
        now = [[f._version for f in flats] for flats in self.flat]
        if now == self._versions:
            return
        moved0 = [a - b for a, b in zip(now[0], self._versions[0])]
        for r in range(1, len(self.flat)):
            moved = [a - b for a, b in zip(now[r], self._versions[r])]
            for b, (m, m0) in enumerate(zip(moved, moved0)):
                if m != m0:
                    self._before_host_write(r)
                    with torch.no_grad():
                        self.flat[r][b].copy_(self.flat[0][b])
        self.mark_reduced()
