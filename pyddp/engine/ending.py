"""The end of a backward (Reducer.finish), before and after the engine's
own finish: the parameters some replica produced no gradient for, settled
before the last buckets launch, and the gradients made final once every
reduction (and the link's agreement) returned: None where no process had
one, scaled to the average the caller asked for, the reduced blocks kept
under shard='gradients'; and after a failed one, whether its gradients
were cleared since."""

from __future__ import annotations

import operator
from collections import Counter
from itertools import compress, repeat
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

import torch

from .._link import Link, WorkRecord
from ..errors import ProcessGroupError
from .streams import StreamOrder

# `layout`: a BucketLayout (buckets.py), which holds a Window: not imported.


def raised_at_finish(link: Link, e: Exception, synced: bool) -> BaseException:
    """What the end of a backward raises for `e`: the user's communication
    hook's own exception (its type; pyddp's account becomes its cause);
    the link's failure, if it failed meanwhile (a launch that heard of
    another rank's failure raises it inside the engine); else `e`, told to
    the other processes at once if this rank's reductions were launched."""
    hook_error = link.hook_error()
    if hook_error is not None:
        return hook_error
    if isinstance(e, ProcessGroupError):
        return e
    try:
        link.check_usable()
    except ProcessGroupError as failed:
        return failed
    if synced:
        link.abandon(f"its end of backward raised {type(e).__name__}: {e}")
    return e


def settle_unmarked(
    engine: Any, layout: Any, link: Link, work: WorkRecord, shadowing: bool
) -> None:
    """Parameters some replica produced no gradient for. A replica that
    produced none contributes its bucket slice as is (or zero, if its
    grad was reset behind pyddp's back). A parameter produced by no
    replica whose canonical copy (replica 0) is None stays None
    everywhere, as on one device; across processes every rank must
    launch the same buckets, so such parameters are reduced with zeros
    while the link agrees which have a gradient on no process at all
    (those return to None after the reductions). `shadowing`: this rank
    joined (torch's Join) and adds nothing to the agreement."""
    window = layout.window
    since_wrap = window.since_wrap  # (no reduction yet: None is wrap's, no reset)
    window.after_backward(layout, engine.sync_enabled)
    unmarked = engine.unmarked()
    if not unmarked:  # every replica produced every gradient (the steady state)
        if engine.sync_enabled:
            link.start_agreement([], len(layout.views[0]), work.take, shadowing)
        return
    replicas = len(layout.views)
    nowhere = {i for i, n in Counter(i for _, i in unmarked).items() if n == replicas}
    none_here = {i for i in nowhere if _no_gradient(layout, i, since_wrap)}
    for i in nowhere - none_here:  # set by hand, unused: kept (one device, torch DDP)
        engine.note_grad(i, True)
    if engine.sync_enabled:
        size = len(layout.views[0])
        agreeing = link.start_agreement(sorted(none_here), size, work.take, shadowing)
        for i in agreeing:
            engine.note_grad(i, True)
            layout.zero_param(i)
            none_here.discard(i)
    for i in sorted(none_here):
        engine.note_grad(i, False)
        layout.zero_param(i)  # None slices read zero (clipping sums buckets)
    for r, i in unmarked:
        layout.take_in(r, i)


def _no_gradient(layout: Any, i: int, since_wrap: bool) -> bool:
    """No replica holds a gradient for parameter i: replica 0's is None,
    and no other replica accumulated one (under no_sync()) since pyddp set
    them all to None (wrap, hand_over, a reset followed). A later replica's
    copy of an earlier reduction does not count: torch's own zero_grad on
    the model resets replica 0's alone."""
    if layout.params[0][i].grad is not None:
        return False
    if layout.scattered is not None and layout.scattered.kept[i]:
        return False  # kept in the blocks since the step (scattered.py)
    others = any(ps[i].grad is not None for ps in layout.params[1:])
    return not ((since_wrap or layout._handed[0][i]) and others)


class Window:
    """A gradient accumulation under no_sync() under way, from its first
    backward to the synced one that reduces it (or a zero_grad()): which
    of replica 0's gradients (the user's model) were held at the last
    backward's end. One the user reset since (torch's model.zero_grad()
    between micro-batches, or between a forward and its backward) is
    reset on every replica before the next backward accumulates, as on
    one device: the other replicas kept theirs."""

    def __init__(self) -> None:
        self._held: Optional[List[bool]] = None
        self._seen: Optional[_Seen] = None  # (several replicas in this process)
        self.since_wrap = True  # no backward reduced yet
        self.names: Sequence[str] = ()  # the parameters' (Plan.build), for refusals

    def close(self) -> None:
        self._held = self._seen = None

    def after_backward(self, layout: Any, synced: bool) -> None:
        """A parameter only other replicas produced a gradient for in the
        window gets one on replica 0 too (its slice, zero), as the model on
        one device holds one: a reset of the user's there is then seen."""
        if synced:
            self._held, self._seen, self.since_wrap = None, None, False
            return
        held = _held(layout.params[0])
        for i in [i for i, had in enumerate(held) if not had] if not all(held) else []:
            if any(ps[i].grad is not None for ps in layout.params[1:]):
                view = layout._view(0, i)
                view.zero_()
                layout.params[0][i].grad, layout._handed[0][i] = view, False
                held[i] = True
        self._held = held
        if len(layout.params) > 1:  # (one replica per process: each rank's own, as DDP)
            self._seen = _Seen(layout)

    def check(
        self, layout: Any, params_moved: Optional[Callable[[], Set[int]]], relaid: bool = False
    ) -> None:
        """Replica 0's gradients touched since the last backward's end are
        refused (follow_changes; again until a zero_grad()): at the start of
        a backward, and before pyddp lays the buckets out again (reattach);
        `relaid`: after it, the new buckets are watched. `params_moved`: the
        ids of the parameters Module._apply moved (and their gradients with
        them) since; None: GradSync's caller, who holds every replica."""
        if self._seen is not None:
            if relaid:
                self._seen = _Seen(layout)
            elif params_moved is not None:
                follow_changes(layout, self._seen, params_moved)

    def follow_resets(self, layout: Any, params_moved: Callable[[], Set[int]]) -> None:
        """At the start of a backward: replica 0's gradients set to None
        since the last one's end (torch's `model.zero_grad()`) are reset on
        every replica; any other touch of them is refused (follow_changes).
        Sharded gradients: the open buckets the gradients left since the
        forward (`model.share_memory()`) are laid out again, as at a forward
        (before, the backward accumulated outside them)."""
        self.check(layout, params_moved)
        held, self._held, self._seen = self._held, None, None
        if held is None:
            return
        if layout.scattered is not None:
            layout.scattered.relay(0)
        for i, (had, p) in enumerate(zip(held, layout.params[0])):
            if had and p.grad is None:
                layout.zero_param(i)  # (slices read zero: clipping sums buckets)
                layout.grads_to_none(i)
                for r in range(len(layout.params)):
                    layout.handed(r, i)


class _Seen:
    """At a no_sync() backward's end, with several replicas in this process:
    every replica's buckets and their version counters, which of replica 0's
    gradients were their bucket views, and where its buckets were."""

    def __init__(self, layout: Any) -> None:
        self.flats = [list(flats) for flats in layout.flat]
        self.versions = [[-1 if f is None else f._version for f in fs] for fs in self.flats]
        grads = map(operator.attrgetter("grad"), layout.params[0])
        self.viewed = list(map(operator.is_, grads, layout.views[0]))
        self.spans = [(0, 0) if f is None else (f.data_ptr(), f.nbytes) for f in self.flats[0]]
        # (the views' layouts: a conversion in the window moves their strides)
        self.strides = [None if v is None else v.stride() for v in layout.views[0]]


def follow_changes(layout: Any, seen: _Seen, params_moved: Callable[[], Set[int]]) -> None:
    """Replica 0's gradients touched inside a no_sync() window (since its
    last backward's end), with every replica in this process: a bucket
    changed in place (pyddp's own writes reach every replica alike), a
    gradient assigned, or given other storage by hand (`p.grad.data = ...`;
    Module._apply moves the parameters with them, and keeps the values).
    Refused: the change would reach replica 0's share of the batch alone
    (0.01 to 0.03 off one device after 2 steps), where each DDP rank makes
    it to its own, and what it was cannot be told from replica 0's values
    (a clip or a scale of a share that reads zero leaves it zero; a clamp
    leaves a small one as it was). Set to None: a reset (Window.follow_resets)."""
    changed, views = [], layout.views[0]
    grads = list(map(operator.attrgetter("grad"), layout.params[0]))
    for b, (flat, version) in enumerate(zip(seen.flats[0], seen.versions[0])):
        if flat is None or flat._version == version or _alike(layout, seen, b):
            continue
        members = _members(layout, b, seen.spans[b])
        if any(grads[i] is not None for i in members):  # (else: every one set to None since)
            shown = ", ".join(_name(layout, i) for i in members[:3])
            changed.append(f"in place, one of {shown}{', ...' if len(members) > 3 else ''}")
    assigned = list(map(operator.is_not, grads, views))
    for i in compress(range(len(grads)), assigned) if True in assigned else ():
        if seen.viewed[i] and grads[i] is not None:
            changed.append(_name(layout, i))
    left = layout.moved(assigned=False)
    moved = params_moved() if left else set()  # (gradients moved with them: Module._apply)
    for i, (grad, viewed) in enumerate(zip(grads, seen.viewed)) if left else ():
        view = _window_slice(layout, seen, i) if viewed and grad is not None else None
        if view is None or assigned[i] or grad.data_ptr() == view.data_ptr():
            continue  # (where it accumulates: untouched, or its bucket moved whole)
        if id(layout.params[0][i]) not in moved or not torch.equal(grad, view):
            changed.append(_name(layout, i))  # by hand, or a conversion that lost bits
    if changed:
        raise RuntimeError(
            f"pyddp: your model's gradients were changed inside a no_sync() window "
            f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}): with "
            f"{len(layout.params)} replicas in this process, .grad there is replica 0's own "
            "and the change would reach its share of the batch alone. Change gradients "
            "after the synced backward that ends the window (e.g. clip under `if "
            "accelerator.sync_gradients:`); to reset them, set them to None "
            "(model.zero_grad()); or take one replica per process (torchrun) for DDP's "
            "per-rank behaviour. Refused until zero_grad() (docs/semantics.md#no_sync)"
        )


def _alike(layout: Any, seen: _Seen, b: int) -> bool:
    """Whether bucket b changed alike on every replica holding it (pyddp's own writes)."""
    moved = seen.flats[0][b]._version - seen.versions[0][b]
    others = [(fs[b], vs[b]) for fs, vs in zip(seen.flats[1:], seen.versions[1:])]
    return all(f is None or f._version - v == moved for f, v in others)


def _window_slice(layout: Any, seen: _Seen, i: int) -> Optional[Any]:
    """Replica 0's parameter i's slice of its bucket, wherever the bucket is
    now (share_memory() moves a whole one), holding the window's gradient
    as it was at the last backward's end unless written in place."""
    if layout.scattered is not None:
        return slice_of(layout, 0, i)
    ptr, p = layout.ptrs[0][i], layout.params[0][i]
    for flat, (base, nbytes) in zip(layout.flat[0], seen.spans):
        if flat is not None and base <= ptr < base + nbytes:
            start = (ptr - base) // flat.element_size()
            return slot_view(flat, start, p, seen.strides[i])
    return None


def _members(layout: Any, b: int, span: Tuple[int, int]) -> List[int]:
    """The parameters laid out in replica 0's bucket b (at `span`: its
    address and bytes then; Module._apply may have moved it since)."""
    if layout.scattered is not None:
        return [i for i, k in enumerate(layout.scattered.bucket_of) if k == b]
    return [i for i, ptr in enumerate(layout.ptrs[0]) if span[0] <= ptr < span[0] + span[1]]


def _name(layout: Any, i: int) -> str:
    names = layout.window.names
    return repr(names[i]) if i < len(names) else f"parameter {i}"


def zeroed_in_place(layout: Any) -> None:
    """zero_grad(set_to_none=False) zeroed every replica's buckets: replica
    0's gradients the user assigned outside them (`p.grad = p.grad * 0.5`)
    or gave other storage (`p.grad.data = ...`) are zeroed too (before, they
    stayed and the next backward added to them: 0.30 off one device), and a
    no_sync() window's watch starts again from here."""
    scattered, grads = layout.scattered, list(map(operator.attrgetter("grad"), layout.params[0]))
    markers = scattered.markers if scattered is not None else [None] * len(grads)
    outside = list(map(operator.is_not, grads, layout.views[0]))
    if True in outside or layout.moved(assigned=False):
        held = [g for g, m in zip(grads, markers) if g is not None and g is not m]
        with torch.no_grad():  # (not the placeholders of sharded gradients: no memory)
            torch._foreach_zero_(held) if held else None
        if scattered is not None:
            scattered.relay(0)  # (the window's buckets the gradients left: laid out again)
        else:
            fresh_views(layout)  # back into their slices, zero
            for p, view in zip(layout.params[0], layout.views[0]):
                if p.grad is not None and p.grad is not view and view is not None:
                    p.grad = view
    layout.window.check(layout, None, relaid=True)  # (every replica alike)


def _held(params: Sequence[Any]) -> List[bool]:
    """Which of `params` hold a gradient (C-level passes)."""
    return list(map(operator.is_not, map(operator.attrgetter("grad"), params), repeat(None)))


def final_gradients(
    engine: Any,
    layout: Any,
    order: StreamOrder,
    synced: bool,
    no_grad: Sequence[int],
    reduced_partly: Sequence[int],
    launched: Sequence[int],
    unused: Sequence[int],
    post_scale: float,
    factor: Any,
) -> None:
    """After the engine's finish and the link's wait (`synced`: the
    backward reduced): `no_grad` (no gradient on any replica) to None,
    `reduced_partly` pointed at their views again, the buckets the link
    reduced through replica 0 copied to the others, `unused` (no gradient
    on any process) to None; scaled by `post_scale` (NCCL summed over every
    process's GPUs: 1/processes) and `factor` (dmodel.loss's rows across
    processes); under shard='gradients' the blocks copied out and the
    buckets freed."""
    for i in no_grad:
        layout.grads_to_none(i)
    for i in reduced_partly:
        layout.point_grads(i)
    # Reduced across processes through replica 0's buffers (already
    # divided by the number of processes): the other replicas get them.
    layout.copy_to_others(launched)
    for i in unused:  # no gradient on any process: None, as on one device
        engine.note_grad(i, False)
        layout.grads_to_none(i)
    if synced and post_scale != 1.0:
        # On the caller's streams, which finish() ordered after the
        # reductions (no host wait on a GPU).
        order.fence_all()
        layout.scale(post_scale)
    if isinstance(factor, list) or factor != 1.0:
        # dmodel.loss weighed on the rows assumed across processes: the
        # global batch's own (a float, or per replica on its GPU).
        order.fence_all()
        layout.scale(factor)
    if synced and layout.scattered is not None:
        order.fence_all()  # the copies out read the reductions' results
        layout.scattered.release_all()
        layout.scattered.after_backward(engine.has_grad)


def gradients_cleared(layout: Any) -> bool:
    """Whether no replica holds a gradient: every one None, or every bucket
    zero. After a failed backward, torch's own zero_grad (or optimizers that
    each own part of the model) did what zero_grad() asks: its refusal lifts."""
    if not any(layout.any_gradient(r) for r in range(len(layout.params))):
        return True
    flats = [f for fs in layout.flat for f in fs if f is not None]
    return layout.scattered is None and not any(bool(f.any()) for f in flats)


def fresh_views(layout: Any) -> None:
    """Before a step: `p.grad.data = ...` on replica 0 since finish() gave a
    gradient storage of its own, which the buckets no longer hold; a fresh
    view of its slice takes its place, so BucketLayout.align copies the
    moved values in as an assigned gradient's. A whole bucket moved
    (Module._apply) keeps its values; the next forward re-attaches it."""
    if not views_left(layout):
        return
    for i, (view, was) in enumerate(zip(layout.views[0], layout.ptrs[0])):
        if view.data_ptr() != was:
            fresh_view(layout, 0, i)
    layout.tell_hooks()  # (the C++ hooks copy into the views they were told)


def fresh_view(layout: Any, r: int, i: int) -> Optional[Any]:
    """Replica r's parameter i's slice of its bucket, where it was laid out,
    as a new view (its old one went with `p.grad.data = ...` to other
    storage); None where no bucket holds that address (a whole bucket moved:
    Module._apply)."""
    view = slice_of(layout, r, i)
    if view is not None:
        layout.views[r][i] = view
    return view


def slice_of(layout: Any, r: int, i: int) -> Optional[Any]:
    """Replica r's parameter i's slice of its bucket, where it was laid out
    (None where no bucket holds that address, or none is held)."""
    was, p = layout.ptrs[r][i], layout.params[r][i]
    if layout.scattered is not None:  # (laid out in its bucket, where one is held)
        flat, start = layout.flat[r][layout.scattered.bucket_of[i]], layout.scattered.offset[i]
        return None if flat is None else slot_view(flat, start, p)
    for flat in layout.flat[r]:
        start = (was - flat.data_ptr()) // flat.element_size()
        if was >= flat.data_ptr() and start + p.numel() <= flat.numel():
            return slot_view(flat, start, p)
    return None


def reseat(layout: Any, r: int, i: int) -> Any:
    """During a backward, replica r's gradient i left its bucket view
    (`p.grad.data = ...` after the forward, as `.double().float()` does): a
    fresh view of its slice, told to the C++ hooks. A whole bucket moved
    (share_memory()) is refused: the engine would reduce memory that is gone."""
    view = fresh_view(layout, r, i)
    if view is None:
        raise RuntimeError(
            f"pyddp: replica {r}'s gradient buckets were moved between the forward and its "
            "backward (share_memory() moves them with the gradients); the engine reduces "
            "them where the forward found them: call it before the forward (under GradSync, "
            "then sync.reattach())"
        )
    if layout.hot is not None:  # (this one: all of them would cost O(parameters) each)
        layout.hot.set_view(r, i, view, layout.ptrs[r][i])
    return view


def views_left(layout: Any) -> bool:
    """Whether replica 0's gradient views no longer point where they were laid
    out (Module._apply moved a bucket, or `p.grad.data = ...` one gradient)."""
    return list(map(operator.methodcaller("data_ptr"), layout.views[0])) != layout.ptrs[0]


def slot_view(flat: torch.Tensor, start: int, p: torch.Tensor, stride: Any = None) -> torch.Tensor:
    """`p`'s gradient in its slot of a flat bucket, from `start`: laid out as
    `p` is (or with `stride`: the layout it was given) where that is dense
    (channels_last too), the layout torch gives one device's gradient and
    torch DDP its bucket views. Fused optimizers read a parameter and its
    gradient as flat memory alike: a row-major gradient of a channels_last
    weight stepped the wrong elements (0.08 off one device). The reduction
    sums the bucket element by element, so any layout every replica and
    process shares sums alike."""
    n, shape = p.numel(), tuple(p.shape)
    stride = tuple(p.stride() if stride is None else stride)
    if _dense(shape, stride) != "permuted":
        return flat[start : start + n].view(shape)
    return flat.as_strided(shape, stride, flat.storage_offset() + start)


def _dense(shape: Tuple[int, ...], stride: Tuple[int, ...]) -> str:
    """ "contiguous", "permuted" (the elements fill as many of memory, each
    once, in another order: channels_last) or "" (overlapping or gapped)."""
    expected, order = 1, []
    for size, step, dim in sorted(zip(shape, stride, range(len(shape))), key=lambda x: x[1]):
        if size != 1:
            if step != expected:
                return ""
            expected *= size
            order.append(dim)
    return "contiguous" if order == sorted(order, reverse=True) else "permuted"
