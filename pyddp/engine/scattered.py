"""Gradient memory under sharded gradients (ZeRO stage 2, shard='gradients'):
each replica keeps, between backwards, only its block of every bucket (the
reduced gradient of the elements it steps): 1/N of the gradients. A
bucket's full buffer on a replica exists from the replica's first gradient
of it in a backward until its reduce-scatter is done and the replica's
block is copied out; then it is freed and the parameters' `.grad` on that
replica return to None.

When the block is copied out: on CPU replicas in one process once the
bucket's reduction returned, collected before a replica allocates its next
bucket (a backward holds the blocks and the buckets being filled, reduced,
or returned since); elsewhere (GPUs: ordered on the streams; processes: the
link's wait) at the end of backward. Under no_sync() nothing is reduced:
the buffers stay, holding the accumulated gradient, until the next synced
backward (storage moved under them meanwhile: moved, relay).

After backward the reduced gradient is in the blocks (dmodel.clip_grad_norm_
and the sharded optimizer read them), and each parameter with a gradient
has a placeholder as its `.grad` on the user's model (replica 0): one zero
expanded to the parameter's shape, which reads zero and refuses in-place
arithmetic (torch's own clip_grad_norm_ over it raises instead of clipping
nothing). What the user does to it is what one device would do to the
gradient: set to None, the parameter is skipped by the step and its
gradient reset; zeroed in place (`zero_grad(set_to_none=False)`), its
gradient is reset; any other tensor assigned is refused at the step (it
could not hold the reduced values). After the step the placeholders are
set again, so a reset before the next forward (torch's `model.zero_grad()`)
is seen too; left alone, the next backward adds to the blocks, as one
device adds to `.grad`. They stay on through the forward, so a reset
between it and the backward is seen too, and come off as the backward
starts, before autograd accumulates into them (it cannot; guard); a
tensor assigned by then becomes the parameter's gradient, as on one device.
zero_grad() through pyddp (the optimizer's, dmodel's, the Trainer's) resets
everything at once."""

from __future__ import annotations

import contextlib
import operator
import threading
import weakref
from functools import partial
from itertools import repeat
from typing import Any, Callable, List, Optional, Sequence, Set

import torch


def _arrived(scattered: Any, grad: torch.Tensor) -> None:
    """A guard hook (Scattered.guard): the placeholders come off before
    autograd accumulates. Weak: a hook left on a dropped model does nothing."""
    owner = scattered()
    if owner is not None:
        owner.reconcile(before_step=False)


class _Release:
    """Removed like a hook handle at the reducer's close (engine/reducer.py
    _release, which removes the guards' handles too)."""

    def __init__(self, scattered: Any) -> None:
        self.scattered = scattered

    def remove(self) -> None:
        owner = self.scattered()
        if owner is not None:
            owner.take_off_placeholders()


class Scattered:
    """One wrapped model's blocks and transient buckets (owned by its
    BucketLayout, which holds the buffers' lists `flat` and `views`)."""

    def __init__(
        self,
        layout: Any,
        buckets: Sequence[Sequence[int]],
        ranks: int,
        rank_of: Sequence[int],
        engine: Any,
        retire: Callable[[Any, Sequence[Sequence[torch.Tensor]]], None],
        early: bool,
        direct: bool = False,
    ):
        """`rank_of[r]`: replica r's block; `retire(engine, per_replica)`:
        orders the freeing of bucket memory after the reductions that use it
        (GPUs); `early`: the bucket's reduction is done when it returns (the
        CPU backend in one process), so buffers are freed during backward;
        `direct`: the backend writes a reduce-scatter's block where it is
        told (not the cross-process one), so a reduction that replaces the
        blocks lands in them, with no copy out of the bucket."""
        self.layout, self.engine, self.ranks = layout, engine, ranks
        self.direct = direct
        # Per replica and bucket: its reduction lands in the block (set_recv).
        self._landing: List[List[bool]] = []
        self.buckets = [list(b) for b in buckets]
        self.rank_of = list(rank_of)
        self._retire = retire
        self.early = early
        params = layout.params[0]
        self.bucket_of = [0] * len(params)
        self.offset = [0] * len(params)
        self.counts: List[int] = []
        for b, members in enumerate(self.buckets):
            start = 0
            for i in members:
                self.bucket_of[i], self.offset[i] = b, start
                start += params[i].numel()
            self.counts.append(-(-start // ranks) * ranks)
        self.block = [c // ranks for c in self.counts]
        self.blocks = [
            [layout.zeros_for(c, params[m[0]].dtype, r) for c, m in zip(self.block, self.buckets)]
            for r in range(len(layout.params))
        ]
        self._landing = [[False] * len(self.buckets) for _ in layout.params]
        self.fresh = [True] * len(layout.params)  # the next reduction replaces the blocks
        # After a step: replica 0's markers (see the module's docstring).
        self.markers: List[Optional[torch.Tensor]] = [None] * len(params)
        self._stamps = [(0, 0, 0)] * len(params)  # at place(): version, address, parameter's
        self.kept = [False] * len(params)  # not reset since the step: its gradient stays
        self.present = [False] * len(params)  # holds a gradient (the step steps it)
        self._cache: List[Optional[torch.Tensor]] = [None] * len(params)
        self._placed = False  # some placeholder is out (reconcile has work)
        self._guards: List[Any] = []  # hooks on replica 0's parameters (guard)
        # At the reducer's close (or its collection) with its other hooks: the
        # placeholders come off the user's model (autograd cannot accumulate
        # into them; the model is the user's own again).
        layout.handles.append(_Release(weakref.ref(self)))
        # Per replica: its hooks allocate its buckets while another replica's
        # hook (or the main thread) frees them; replicas never wait on each
        # other's allocations.
        self._locks = [threading.Lock() for _ in layout.params]
        self.held = [self._bytes(r) for r in range(len(layout.params))]
        self.peak = list(self.held)

    def _bytes(self, r: int) -> int:
        total = sum(t.numel() * t.element_size() for t in self.blocks[r])
        return total + sum(
            f.numel() * f.element_size() for f in self.layout.flat[r] if f is not None
        )

    # ------------------------------------------------------------ buckets
    def ensure(self, r: int, b: int) -> None:
        """Replica r's buffer of bucket b exists (allocated, the engine told
        where, the gradients' views laid out in it). Buckets whose reduction
        returned are freed first, so their memory can serve this one."""
        if self.early and self.layout.flat[r][b] is None:
            self.poll()
        with self._locks[r]:
            if self.layout.flat[r][b] is not None:
                return
            params = self.layout.params[r]
            members = self.buckets[b]
            # Uninitialised but for the padding: every parameter's slice is
            # written before the bucket can launch (its gradient copied in,
            # or zeroed when it has none: BucketLayout.adopt and take_in).
            flat = self.layout.empty_for(self.counts[b], params[members[0]].dtype, r)
            used = self.offset[members[-1]] + params[members[-1]].numel()
            flat[used:].zero_()
            for i in members:
                p, start = params[i], self.offset[i]
                self.layout.views[r][i] = flat[start : start + p.numel()].view_as(p)
            self.layout.flat[r][b] = flat
            self.layout.tell_engine(r, b, flat)
            if self.direct and self.fresh[r]:  # replaced: the reduction writes the block
                self.engine.set_recv(r, b, self.blocks[r][b].data_ptr())
                self._landing[r][b] = True
            self.held[r] += flat.numel() * flat.element_size()
            self.peak[r] = max(self.peak[r], self.held[r])

    def release(self, r: int, b: int) -> None:
        """Replica r's block of bucket b (reduced) into its blocks, then the
        buffer is freed; its parameters' `.grad` there return to None."""
        with self._locks[r]:
            flat = self.layout.flat[r][b]
            if flat is None:
                return
            k, c = self.rank_of[r], self.block[b]
            with torch.no_grad():
                if self._landing[r][b]:
                    # The reduction wrote the block, unless the bucket held no
                    # gradient anywhere (not reduced): then it reads zero.
                    if not any(self.engine.has_grad(i) for i in self.buckets[b]):
                        self.blocks[r][b].zero_()
                elif self.fresh[r]:
                    self.blocks[r][b].copy_(flat[k * c : (k + 1) * c])
                else:
                    self.blocks[r][b].add_(flat[k * c : (k + 1) * c])
            self._landing[r][b] = False
            params, views = self.layout.params[r], self.layout.views[r]
            for i in self.buckets[b]:
                if params[i].grad is views[i]:
                    params[i].grad = None
                    self.layout.handed(r, i)  # pyddp set it to None: not "adopted" next time
                views[i] = None
            self.layout.flat[r][b] = None
            self.engine.release_buffer(r, b)
            self._retire(self.engine, [[flat] if q == r else [] for q in range(len(self.blocks))])
            self.held[r] -= flat.numel() * flat.element_size()

    def moved(self, r: int) -> List[int]:
        """Replica r's buckets open in a no_sync() window that its gradients
        left: Module._apply moved a whole buffer (share_memory()), or
        `p.grad.data = ...` gave a gradient storage of its own."""
        views, out = self.layout.views[r], []
        for b, flat in enumerate(self.layout.flat[r]):
            base = -1 if flat is None else flat.data_ptr()
            if base != -1 and (base != self.layout.given.get((r, b), base) or any(
                views[i].data_ptr() != base + self.offset[i] * flat.element_size()
                for i in self.buckets[b] if views[i].numel()
            )):  # fmt: skip
                out.append(b)
        return out

    def relay(self, r: int) -> None:
        """Each bucket of replica r's that its gradients left (moved) gets a
        fresh buffer holding their values, where the engine is told to
        reduce; a parameter whose `.grad` was the old view gets the new one."""
        for b in self.moved(r):
            members = self.buckets[b]
            old, flat = [self.layout.views[r][i] for i in members], self.layout.flat[r][b]
            with self._locks[r]:
                self.layout.flat[r][b] = None
                self.held[r] -= flat.numel() * flat.element_size()
            self.ensure(r, b)
            params, views = self.layout.params[r], self.layout.views[r]
            with torch.no_grad():
                for i, was in zip(members, old):
                    views[i].copy_(was)
                    if params[i].grad is was:
                        params[i].grad = views[i]
            self._retire(self.engine, [[flat] if q == r else [] for q in range(len(self.blocks))])

    def poll(self) -> None:
        """During a synced backward (early): frees the buckets whose
        reduction returned since the last poll, on every replica (called
        before each allocation, not per gradient: no cost on the hooks)."""
        for b in self.engine.take_completed():
            for r in range(len(self.blocks)):
                self.release(r, b)

    def release_all(self) -> None:
        """At the end of a synced backward: every bucket still held (the
        placeholders no gradient reached in it reconciled first)."""
        self.reconcile(before_step=False)
        self.unguard()
        for r in range(len(self.blocks)):
            for b in range(len(self.buckets)):
                self.release(r, b)
            self.fresh[r] = False

    # ------------------------------------------------------------ blocks
    def consume(self) -> None:
        """zero_grad() through pyddp: every gradient gone (the placeholders
        with the other gradients); the next reduction replaces the blocks."""
        self.fresh = [True] * len(self.blocks)
        self.markers = [None] * len(self.markers)
        self._placed = False
        self.present = [False] * len(self.present)
        self.unguard()

    def zero(self, r: int) -> None:
        with torch.no_grad():
            for t in self.blocks[r]:
                t.zero_()
        self.fresh[r] = True

    def after_backward(self, has_grad: Callable[[int], bool]) -> None:
        """A synced backward ended: which parameters hold a gradient (one the
        backward reached, or one held before it: zeroed in place or left
        alone, as `.grad` stays on one device), and their placeholders on
        replica 0."""
        self.present = [has_grad(i) or held for i, held in enumerate(self.present)]
        self.kept = [False] * len(self.kept)
        self.place()

    def place(self) -> None:
        """A placeholder as replica 0's `.grad` of every parameter holding a
        gradient (after backward, and again after the step)."""
        for i, p in enumerate(self.layout.params[0]):
            if self.present[i] and p.grad is None:
                marker = self._cache[i]
                if marker is None or marker.dtype != p.dtype or marker.device != p.device:
                    marker = torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p)
                    self._cache[i] = marker
                p.grad = marker
                self.markers[i] = marker
                self._stamps[i] = (marker._version, marker.data_ptr(), p.data_ptr())
                self._placed = True

    def guard(self, needed: bool) -> None:
        """At a forward: the placeholders stay on until the backward starts,
        so a reset in between counts. Where a backward may start past the
        outputs (one replica in the process: `needed`), hooks on their
        parameters, which run before autograd accumulates into `.grad`,
        reconcile at the first one's gradient (they stay, idle, until the
        backward ends: unguard)."""
        if not needed or not self._placed or self._guards:
            return
        params, arrived = self.layout.params[0], partial(_arrived, weakref.ref(self))
        for i, marker in enumerate(self.markers):
            if marker is not None and params[i].requires_grad:  # (frozen since: no hook)
                self._guards.append(params[i].register_hook(arrived))
        self.layout.handles.extend(self._guards)  # removed with the reducer's, at close

    def take_off_placeholders(self) -> None:
        """At the reducer's close: replica 0's `.grad` placeholders go (None:
        the model is the user's own again); the guards' handles went with the
        reducer's (never removed here: _release is walking them)."""
        self._guards.clear()
        self.markers = [None] * len(self.markers)
        self._placed = False
        for p, marker in zip(self.layout.params[0], self._cache):
            if marker is not None and p.grad is marker:
                p.grad = None

    def unguard(self) -> None:
        """Removes guard's hooks (never from within one: autograd walks them)."""
        for handle in self._guards:
            handle.remove()
            with contextlib.suppress(ValueError):  # (the reducer's close took them)
                self.layout.handles.remove(handle)
        self._guards.clear()

    def reconcile(self, before_step: bool) -> None:
        """What the user did to replica 0's placeholders (see the module's
        docstring), applied to every replica's blocks; the placeholders
        are removed. `before_step`: at the step (a tensor assigned is
        refused) rather than before a backward (it becomes the gradient)."""
        if before_step:
            self.unguard()
        if not self._placed:
            return
        self._placed = False
        params = self.layout.params[0]
        reset = []
        for i, (p, marker) in enumerate(zip(params, self.markers)):
            if marker is None:
                continue
            g = p.grad
            # `.data =` swaps it: the user's tensor, unless Module._apply did (still zeros,
            # shared by share_memory(), or the parameter moved too). Made again at place().
            stamp, swapped = self._stamps[i], g is marker and g.data_ptr() != self._stamps[i][1]
            if swapped:
                self._cache[i] = None
                shared = g.device.type == "cpu" and g.is_shared()
                swapped = bool(g.any()) or not (shared or p.data_ptr() != stamp[2])
            own = g is marker and not swapped
            if own and marker._version == stamp[0]:
                self.kept[i] = not before_step  # left alone: the next backward adds to it
            elif g is None or own:
                reset.append(i)
                self.present[i] = self.present[i] and own  # None: skipped
            elif before_step:
                self.markers = [None] * len(self.markers)
                raise RuntimeError(
                    f"pyddp: a tensor was assigned as the gradient (or its .data) of parameter "
                    f"{i} of the wrapped model after backward under shard='gradients', where "
                    "the reduced gradient lives in each replica's blocks and `.grad` is a "
                    "placeholder: set it to None to skip the parameter, zero it in place "
                    "(p.grad.zero_()), or clip with dmodel.clip_grad_norm_; other changes "
                    "need shard=True"
                )
            else:
                reset.append(i)  # assigned before a backward: it is the gradient now
                continue
            if own or g is None:
                p.grad = None
        self.markers = [None] * len(self.markers)
        if not before_step and not any(self.kept):
            self.fresh = [True] * len(self.blocks)  # every gradient reset: replace
            return
        with torch.no_grad():
            for i in reset:
                b, n = self.bucket_of[i], params[i].numel()
                for r, blocks in enumerate(self.blocks):
                    base = self.rank_of[r] * self.block[b]
                    lo = max(self.offset[i], base)
                    hi = min(self.offset[i] + n, base + self.block[b])
                    if lo < hi:
                        blocks[b][lo - base : hi - base].zero_()

    def take_assigned(self) -> None:
        """At the step, after reconcile: gradients held in buckets (below),
        then a gradient assigned on replica 0 to
        a parameter the blocks hold none for (before any backward since
        zero_grad(): torch.distributed.checkpoint's get_optimizer_state_dict
        steps a fresh optimizer once on zeros to make its state; or to one
        the backward left without a gradient) is what one device steps on:
        it is copied into every replica's blocks and the parameter steps as
        one reduced (its placeholder set after the step, so a next backward
        adds to it, as on one device)."""
        params, views = self.layout.params[0], self.layout.views[0]
        grads = list(map(operator.attrgetter("grad"), params))
        if all(map(operator.is_, grads, repeat(None))):
            return  # the steady state: reconcile took every placeholder (C-level)
        if any(f is not None for flats in self.layout.flat for f in flats):
            # Buckets held since this optimizer was made after a synced backward
            # (BucketLayout._allocate_scattered; a step under no_sync() is
            # refused before): the reduced gradient, whose slice is each
            # replica's block, as a reduce-scatter would have left it.
            had = [g is not None and g is views[i] for i, g in enumerate(grads)]
            self._landing = [[False] * len(self.buckets) for _ in self.blocks]  # (none ran)
            self.release_all()
            self.present = list(map(operator.or_, self.present, had))
            grads = list(map(operator.attrgetter("grad"), params))
        taken = [
            i
            for i, g in enumerate(grads)
            if not self.present[i] and g is not None and g is not views[i]
        ]
        if not taken:
            return
        with torch.no_grad():
            for r, blocks in enumerate(self.blocks):
                if self.fresh[r]:  # values from before the last reset
                    for t in blocks:
                        t.zero_()
                    self.fresh[r] = False
            for i in taken:
                grad = params[i].grad.detach().reshape(-1)
                b, n = self.bucket_of[i], grad.numel()
                for r, blocks in enumerate(self.blocks):
                    base = self.rank_of[r] * self.block[b]
                    lo = max(self.offset[i], base)
                    hi = min(self.offset[i] + n, base + self.block[b])
                    if lo < hi:
                        src = grad[lo - self.offset[i] : hi - self.offset[i]]
                        blocks[b][lo - base : hi - base].copy_(src)
                self.present[i] = True
                params[i].grad = None

    def piece(self, r: int, i: int, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of parameter i's reduced gradient, which lie in
        replica r's block of its bucket."""
        b = self.bucket_of[i]
        start = self.offset[i] + lo - self.rank_of[r] * self.block[b]
        return self.blocks[r][b][start : start + hi - lo]

    def landed(self, r: int) -> Set[int]:
        """The buckets whose reduction lands (landed) in replica r's blocks
        this backward, their buffers still held."""
        return {b for b, landing in enumerate(self._landing[r]) if landing}

    def memory(self, r: int) -> List[torch.Tensor]:
        return self.blocks[r] + [f for f in self.layout.flat[r] if f is not None]

    def bucket_bytes(self) -> List[int]:
        params = self.layout.params[0]
        return [c * params[m[0]].element_size() for c, m in zip(self.counts, self.buckets)]
