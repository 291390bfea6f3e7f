"""The engine's options, validated once: `GradSync`, `pyddp.wrap` and the
`Trainer` (its wrap options) build one `Options` and read it from there.
Every check names the field and what to pass instead."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import torch.distributed as dist

from ..runtime.libraries import checked_timeout
from ..runtime.libraries import timeout_s as env_timeout_s
from .observe import timeline_from_env

_MIB = 1 << 20
_NO_CAP = 1 << 62  # bytes: no bucket is that large

REDUCE_ORDERS = ("ready", "index", "after_backward")


@dataclass(frozen=True)
class Options:
    """The options of `pyddp.wrap`, `GradSync` and the Trainer's wrap
    options, each documented here under its field (and nowhere else).
    GradSync takes all but wrap's own (broadcast_buffers,
    threads_per_replica, run_replicas, follow_unfreezing)."""

    bucket_cap_mb: float = 25.0
    """Bucket size in MiB; 0 is the per-parameter mode (every parameter its
    own bucket). Given without first_bucket_cap_mb it sizes the first bucket
    too (torch DDP's rule)."""
    first_bucket_cap_mb: float = 1.0
    """The first bucket's size in MiB (the last parameters backward produces
    launch early)."""
    taper_buckets: bool = False
    """True: the last buckets shrink by halves down to the first bucket's
    size, so little is left to reduce after backward (csrc/bucket_plan.h). It
    helps CNNs when communication keeps up with backward and costs where
    communication is the bottleneck (docs/simulator.md), so it is off and the
    plan is torch DDP's."""
    reduce_order: Optional[str] = None
    """"ready" (launch buckets as they complete; the default in one process),
    "index" (in bucket order; the default and the only choice across
    processes, where every rank must launch the same sequence) or
    "after_backward" (no overlap: the baseline benchmarks compare against)."""
    rebuild_buckets: bool = True
    """Re-plan the buckets once, from the ready order observed in the first
    synced backward (rank 0's across processes)."""
    op: str = "sum"
    """"sum" or "avg" over this process's replicas (GradSync; wrap sums, and
    averages over processes as torch DDP)."""
    timeout_s: Optional[float] = None
    """A GPU or cross-process reduction not done after this many seconds
    aborts communication and raises ReduceError naming the bucket and the
    ranks that did not arrive (seconds > 0, at most 7 days; None:
    $PYDDP_TIMEOUT_S or 300)."""
    timeline: Optional[int] = None
    """Iterations of bucket and parameter events to keep for
    export_timeline and ready_times (None: $PYDDP_TIMELINE or 0, off)."""
    check_replicas: bool = True
    """GradSync: refuse replicas whose parameters differ from replica 0's at
    construction (False if you make them equal yourself; wrap's replicas are
    deep copies, equal by construction)."""
    group: Any = None
    """The torch.distributed process group to span (torch DDP's
    process_group); None: every process once torch.distributed is
    initialised, else this process alone."""
    broadcast_buffers: bool = True
    """wrap: replica 0's buffers to the other replicas before each
    forward, and rank 0's to every rank after each synced training step
    (torch DDP's default). False: each replica keeps its own (each rank's
    from wrap on, as DDP's broadcast_buffers=False: rank-local buffers);
    what the user changes on replica 0 (load_state_dict, in-place writes)
    still reaches the others."""
    threads_per_replica: Optional[int] = None
    """wrap: each replica's torch intra-op threads (None on CPUs:
    torch.get_num_threads() // replicas, at least 1)."""
    run_replicas: str = "auto"
    """wrap, CPU replicas and GPU replicas sharing one GPU: "threads" (each
    on its own thread, at once),
    "in_turn" (one after another on the caller's thread: no hand-offs, no
    interpreter lock passed at every op; faster where ops are small), or
    "auto": both timed for each kind of work (forward, backward, optimizer
    step, ...) over its first 21 calls, then one way for all kinds: in turn
    where the replicas' work is at least 10% faster that way, else threads
    (dmodel.run_replicas() says which); tried again when a kind first runs
    after the choice (a backward after a validation pass, a new optimizer). Replicas
    on several GPUs and SyncBatchNorm (whose replicas meet inside forward
    and backward) always run on threads. CPU replicas under "auto" run in
    turn for good once activation checkpointing is seen (the first forward,
    run in turn, looks for it; transformers' flag at every forward): their
    recomputed randomness is exact only in turn (docs/semantics.md)."""
    follow_unfreezing: bool = False
    """wrap: parameters frozen at wrap (requires_grad=False) get a place in
    the buckets too, as if frozen just after wrap, so unfreezing them later
    is followed (progressive unfreezing, Lightning's BackboneFinetuning, which
    freezes before the strategy wraps). Their gradients' bucket space takes
    memory, and while they stay frozen it travels as zeros. False: unfreezing
    a parameter frozen at wrap raises at the next forward (torch DDP never
    reduces it, and the processes drift apart in silence)."""
    find_unused_parameters: bool = False
    """torch DDP's, for code ported from it: pyddp finds unused parameters
    itself at every step; this shapes only the buckets a communication hook
    sees, which are DDP's for the same arguments."""
    static_graph: bool = False
    """torch DDP's: the first synced backward counts how many times each
    gradient arrives (a parameter shared by segments of reentrant activation
    checkpointing arrives once per segment) and reduces after backward; later
    backwards reduce a gradient at its counted arrival and refuse one more
    (the graph changed). As find_unused_parameters, it also shapes the
    buckets a communication hook sees."""

    def __post_init__(self) -> None:
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            if not _is_number(getattr(self, name)):
                raise TypeError(f"{name}={getattr(self, name)!r} must be a number of MiB")
        if not (self.bucket_cap_mb >= 0 and self.first_bucket_cap_mb >= 0):  # (NaN too)
            raise ValueError(
                f"bucket_cap_mb={self.bucket_cap_mb} and first_bucket_cap_mb="
                f"{self.first_bucket_cap_mb} must be >= 0 (0 = one bucket per parameter)"
            )
        member = isinstance(self.group, dist.ProcessGroup)  # (or torch's sentinel for others:)
        if self.group is not None and not member and not _not_a_member(self.group):
            raise TypeError(
                f"group={self.group!r} must be a torch.distributed process group "
                "(dist.new_group(...)), or None for every process"
            )
        if self.reduce_order is not None and self.reduce_order not in REDUCE_ORDERS:
            raise ValueError(
                f"reduce_order={self.reduce_order!r}: use 'ready', 'index' or 'after_backward' "
                "(no overlap: the baseline benchmarks compare against)"
            )
        if self.op not in ("sum", "avg"):
            raise ValueError(f"op={self.op!r}: use 'sum' or 'avg'")
        if self.timeout_s is not None:
            checked_timeout(self.timeout_s, f"timeout_s={self.timeout_s!r}")
        else:  # $PYDDP_TIMEOUT_S, refused here, as doctor says (not only where a wait reads it)
            env_timeout_s()
        if self.timeline is not None and (
            not isinstance(self.timeline, int) or isinstance(self.timeline, bool)
        ):
            raise TypeError(f"timeline={self.timeline!r} must be an int (iterations to keep)")
        if self.timeline is not None and self.timeline < 0:
            raise ValueError(f"timeline={self.timeline} must be >= 0 (iterations to keep)")
        if self.threads_per_replica is not None and (
            not isinstance(self.threads_per_replica, int)
            or isinstance(self.threads_per_replica, bool)
            or self.threads_per_replica < 1
        ):
            raise ValueError(
                f"threads_per_replica={self.threads_per_replica!r} must be an int >= 1"
            )
        if self.run_replicas not in RUN_REPLICAS:
            raise ValueError(
                f"run_replicas={self.run_replicas!r} must be one of "
                f"{', '.join(map(repr, RUN_REPLICAS))}"
            )
        for name in (
            "taper_buckets",
            "rebuild_buckets",
            "check_replicas",
            "broadcast_buffers",
            "follow_unfreezing",
            "find_unused_parameters",
            "static_graph",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False")

    @classmethod
    def for_wrap(cls, options: Mapping[str, Any]) -> Options:
        """wrap's and the Trainer's keywords; an unknown one raises TypeError
        naming the known ones. Replicas made by wrap are deep copies of one
        model, identical by construction, and sum over replicas."""
        unknown = sorted(set(options) - set(WRAP_OPTIONS))
        if unknown:
            raise TypeError(
                f"unknown wrap option(s) {', '.join(unknown)}; the options are "
                f"{', '.join(WRAP_OPTIONS)}"
            )
        return cls(**first_cap_as_ddp(options), check_replicas=False)

    @classmethod
    def for_sync(cls, options: Mapping[str, Any]) -> Options:
        """GradSync's keywords: the engine's options (not wrap's own)."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        wrap_only = sorted(
            set(options)
            & {"broadcast_buffers", "threads_per_replica", "run_replicas", "follow_unfreezing"}
        )
        if unknown or wrap_only:
            raise TypeError(
                f"GradSync got unknown option(s) {', '.join(unknown + wrap_only)}"
                + (" (options of pyddp.wrap, which drives the replicas)" if wrap_only else "")
            )
        return cls(**first_cap_as_ddp(options))

    def in_group(self, group: Any) -> Options:
        """These options for `group` (a resolved process group, None in one
        process): reduce_order defaults to "ready" in one process and to
        "index" across processes, where every rank must launch the same
        sequence ("ready" is refused there)."""
        if self.reduce_order is None:
            return self.replace(reduce_order="ready" if group is None else "index")
        if group is not None and self.reduce_order == "ready":
            raise ValueError(
                "reduce_order='ready' across processes: every rank must launch the same "
                "sequence, so buckets launch in index order ('index', the default there)"
            )
        return self

    def keep(self) -> int:
        """Timeline iterations to keep: the option, else $PYDDP_TIMELINE."""
        return timeline_from_env() if self.timeline is None else self.timeline

    def cap_bytes(self) -> Tuple[int, int]:
        """The bucket caps in bytes (every bucket's, the first's; 0: one
        bucket per parameter). Any cap past 2**62 bytes (infinity too) puts
        every parameter in one bucket."""
        cap = int(min(self.bucket_cap_mb * _MIB, _NO_CAP))
        return cap, int(min(self.first_bucket_cap_mb * _MIB, _NO_CAP)) if cap else 0

    def compared(self) -> Dict[str, Any]:
        """The settings every process must share (checked at wrap)."""
        return {name: getattr(self, name) for name in _COMPARED}

    def replace(self, **changes: Any) -> Options:
        return dataclasses.replace(self, **changes)


RUN_REPLICAS = ("auto", "threads", "in_turn")

# What wrap (and the Trainer, for its model) accepts; GradSync takes the
# engine's options (all but broadcast_buffers, threads_per_replica,
# run_replicas and follow_unfreezing) as keywords of its own.
WRAP_OPTIONS = (
    "bucket_cap_mb",
    "first_bucket_cap_mb",
    "taper_buckets",
    "reduce_order",
    "rebuild_buckets",
    "broadcast_buffers",
    "threads_per_replica",
    "run_replicas",
    "timeout_s",
    "timeline",
    "group",
    "follow_unfreezing",
    "find_unused_parameters",
    "static_graph",
)
_COMPARED = (
    "bucket_cap_mb",
    "first_bucket_cap_mb",
    "taper_buckets",
    "reduce_order",
    "rebuild_buckets",
    "op",
    "broadcast_buffers",
    "follow_unfreezing",
    "find_unused_parameters",
    "static_graph",
)


def _not_a_member(group: Any) -> bool:
    """torch's dist.new_group result on a process outside the group (named
    later, where the group is resolved)."""
    return isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER


def first_cap_as_ddp(options: Mapping[str, Any]) -> Dict[str, Any]:
    """torch DDP's rule: a bucket_cap_mb given without first_bucket_cap_mb
    sizes the first bucket too (the 1 MiB first bucket goes with the
    default cap only)."""
    out = dict(options)
    if "bucket_cap_mb" in out and "first_bucket_cap_mb" not in out:
        out["first_bucket_cap_mb"] = out["bucket_cap_mb"]
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
