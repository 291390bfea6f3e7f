"""Per-iteration statistics with torch DDP's definitions (so figures compare
with `ddp._get_ddp_logging_data()`), running averages, and a bounded timeline
of bucket (and parameter) events exported as Chrome trace JSON for Perfetto or
chrome://tracing. Times come from the engine's steady clock; on GPU backends
"done" is when the reduction was enqueued; GpuClock (below) times GPU
replicas' steps on the device with events.

Definitions, per synced iteration:
  backward compute = end of forward -> autograd done (finish() starts)
  comm             = first launch -> last reduction done
  overlap          = first launch -> autograd done (clipped to [0, comm])
  exposed comm     = comm - overlap;  overlap fraction = overlap / comm
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

from ..runtime.trace import chrome_trace, rank_path, write_trace

TIMELINE_ENV = "PYDDP_TIMELINE"  # number of iterations to keep, e.g. PYDDP_TIMELINE=20
_AVERAGED = (
    "backward_compute_s",
    "comm_s",
    "overlap_s",
    "exposed_comm_s",
    "finish_wait_s",
    "agree_s",
    "bytes",
    "launches",
)


def timeline_from_env() -> int:
    raw = os.environ.get(TIMELINE_ENV, "0")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{TIMELINE_ENV}={raw!r}: give the number of iterations to keep") from None
    if value < 0:
        raise ValueError(f"{TIMELINE_ENV}={raw!r} must be >= 0")
    return value


def iteration_stats(raw: Dict[str, int], bucket_bytes: Sequence[int]) -> Dict[str, Any]:
    """One iteration's figures (seconds) from the engine's raw nanosecond stamps."""
    fwd, first_ready = raw["forward_end_ns"], raw["first_ready_ns"]
    launch, done, autograd_done = (
        raw["first_launch_ns"],
        raw["last_done_ns"],
        raw["finish_start_ns"],
    )
    start = fwd or first_ready
    comm = (done - launch) / 1e9 if launch and done else 0.0
    overlap = min(max((autograd_done - launch) / 1e9, 0.0), comm) if launch else 0.0
    return {
        "iteration": raw["iteration"],
        "backward_compute_s": (autograd_done - start) / 1e9 if start else 0.0,
        "comm_s": comm,
        "overlap_s": overlap,
        "exposed_comm_s": comm - overlap,
        "overlap_fraction": overlap / comm if comm > 0 else 0.0,
        "finish_wait_s": raw["wait_ns"] / 1e9,
        # Across processes: building the agreement and reading its sums.
        "agree_s": raw.get("agree_ns", 0) / 1e9,
        "bytes": raw["bytes"],
        "launches": raw["launches"],
        "buckets": raw["buckets"],
        "bucket_bytes": list(bucket_bytes),
    }


@dataclass(frozen=True)
class ReadyTimes:
    """When each gradient became ready in one synced iteration, on replica 0:
    the public profile a scaling model reads (`GradSync.ready_times`)."""

    names: List[str]
    bytes: List[int]  # each parameter's gradient size
    dtypes: List[str]  # "float32", ...
    ready_s: List[float]  # seconds after the end of forward (GradSync: the first gradient)
    backward_s: float  # end of forward -> autograd done


def ready_times(
    timelines: Sequence[Dict[str, Any]], names: Sequence[str], params: Sequence[Any]
) -> ReadyTimes:
    """The last kept iteration's ReadyTimes for `params` (replica 0's), from
    the end of forward; on a GradSync, which does not see your forward end,
    from the first gradient (as its stats())."""
    if not timelines:
        raise ValueError(
            "no timeline: wrap with timeline=N (or PYDDP_TIMELINE=N) and run a synced step "
            "(with one replica in one process nothing is reduced, so nothing is timed)"
        )
    t = timelines[-1]
    raw = t["raw"]
    begin = raw["forward_end_ns"] or raw["first_ready_ns"]
    marks = t["param_ready_ns"][: len(names)]
    if not begin or len(marks) < len(names) or not all(marks):
        none = [n for n, m in zip(names, marks) if not m][:5]
        raise ValueError(
            "the last kept iteration has no ready time for every parameter"
            + (f": none for {', '.join(none)} (unused in its backward: time a step that "
               "uses every parameter)" if none else "")
        )  # fmt: skip
    return ReadyTimes(
        list(names),
        [p.numel() * p.element_size() for p in params],
        [str(p.dtype).replace("torch.", "") for p in params],
        [max(0, m - begin) / 1e9 for m in marks],
        (raw["finish_start_ns"] - begin) / 1e9,
    )


class Observer:
    """Keeps the last iteration, running means and the last `keep` timelines."""

    def __init__(self, keep: int = 0):
        self.keep = keep
        self.last: Optional[Dict[str, Any]] = None
        self._sums = dict.fromkeys(_AVERAGED, 0.0)
        self._count = 0
        self.timelines: Deque[Dict[str, Any]] = deque(maxlen=max(keep, 1))

    def record(
        self,
        raw: Dict[str, int],
        bucket_bytes: Sequence[int],
        timeline: Optional[Dict[str, Any]] = None,
    ) -> None:
        self.last = iteration_stats(raw, bucket_bytes)
        self._count += 1
        for k in _AVERAGED:
            self._sums[k] += self.last[k]
        if self.keep and timeline is not None:
            self.timelines.append({"raw": dict(raw), **timeline})

    def means(self) -> Dict[str, float]:
        if not self._count:
            return {}
        means = {k: v / self._count for k, v in self._sums.items()}
        comm = means["comm_s"]
        means["overlap_fraction"] = means["overlap_s"] / comm if comm > 0 else 0.0
        return means

    def reset(self) -> None:
        self._sums = dict.fromkeys(_AVERAGED, 0.0)
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def observe(self, engine: Any, link: Any, layout: Any, finish_called_ns: int) -> None:
        """Records the engine's last iteration, once, with what the link
        waited for."""
        raw = engine.last_stats()
        if not raw["iteration"] or (self.last or {}).get("iteration") == raw["iteration"]:
            return
        # The flat buffers are the buckets: O(buckets) per step, no walk over parameters.
        timeline = engine.last_timeline() if self.keep else None
        if timeline is not None:  # (the plan of this iteration: a rebuild comes after the first)
            timeline["buckets"] = engine.buckets
        link.merge_timing(raw, timeline, finish_called_ns)
        self.record(raw, layout.bucket_bytes(), timeline)

    def stats(self, adopted: int, buckets: int, reduces: bool) -> Dict[str, Any]:
        """GradSync.stats(): the last synced iteration at the top level, the
        running means under "mean" (before the first, or with nothing to
        reduce: iteration, bytes and launches 0, the bucket count, and "mean"
        empty)."""
        if not reduces or self.last is None:
            empty = {"iteration": 0, "bytes": 0, "launches": 0, "buckets": buckets}
            return {**empty, "adopted": adopted, "mean": {}}
        return {**self.last, "adopted": adopted, "mean": self.means()}

    def export(
        self,
        path: os.PathLike,
        names: Sequence[str],
        buckets: Sequence[Sequence[int]],
        n: int,
        rank: Optional[int] = None,
    ) -> Path:
        """The kept iterations as Chrome trace JSON at `path` (n replicas).
        Across processes (`rank` given) each rank writes its own file
        (runtime/trace.rank_path; a probe: the ranks wrote one path, the last
        one's trace kept)."""
        if not self.keep:
            raise RuntimeError(
                "the timeline is off: pass timeline=N (iterations to keep) or set PYDDP_TIMELINE"
            )
        if not self.timelines:
            raise RuntimeError(
                "no synced iteration kept yet: export the timeline after a training step's "
                "backward (one under no_sync() reduces nothing, so is not timed)"
            )
        path = rank_path(path, rank)
        trace = chrome_trace(list(self.timelines), names, buckets, n, rank)
        return write_trace(trace, path)

    def ready_times(self, names: Sequence[str], params: Sequence[Any]) -> ReadyTimes:
        """The last kept iteration's ready times of `params` (replica 0's)."""
        return ready_times(self.timelines, names, params)


class GpuClock:
    """Whether GPU replicas' steps are bound by the host: per device and per
    backward, the host time from the first replica's forward (prepare) to
    the end of backward (finish), and the GPU time between timing events
    recorded on the current stream at those two points (read once the GPU
    passed both: asked, never waited for). At each forward the event that
    ended the previous backward is asked whether the GPU has passed it: if
    it has, the GPU ran out of queued work (the optimizer step's included)
    before the host started the next forward, so it waited for the host.
    The replicas' threads call begin() concurrently; a few calls per device
    per step, none per parameter."""

    HOST_BOUND = 0.5  # of forwards that found the GPU idle: the verdict "host"
    KEEP = 256  # backwards whose GPU time is still to read, at most

    def __init__(self, provider: Any, devices: Optional[Sequence[int]]):
        self.provider = provider  # None (CPU replicas): does nothing
        self.devices = None if devices is None else list(devices)  # CUDA index per replica
        self._lock = threading.Lock()
        self._open: Dict[int, Tuple[Any, int]] = {}  # device -> (start event, host ns)
        self._ended: Dict[int, Any] = {}  # device -> the event that ended the last backward
        self._pending: List[Tuple[int, Any, Any]] = []  # (device, start, end) to read
        self._sums: Dict[int, List[float]] = {}
        self.failed: Optional[str] = None  # why the measuring stopped
        self.reset()

    @contextlib.contextmanager
    def _or_give_up(self) -> Iterator[None]:
        """A timing event that fails (a dead context: pyddp's own calls name
        it where it matters) ends the measuring; report() says why."""
        try:
            yield
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"
            self._open.clear()
            self._ended.clear()
            self._pending = []

    def reset(self) -> None:
        """Forgets the sums, and the spans still to read (they began before)."""
        with self._lock:
            # device -> [backwards, host ms, GPU ms read, GPU reads, forwards asked, found idle]
            self._sums: Dict[int, List[float]] = {}
            self._pending = []

    def begin(self, replica: int) -> None:
        if self.devices is None or self.failed is not None:
            return
        device = self.devices[replica]
        with self._lock, self._or_give_up():
            if device in self._open or self._capturing_elsewhere(device):
                return
            ended = self._ended.pop(device, None)
            if ended is not None:
                sums = self._sums.setdefault(device, [0, 0.0, 0.0, 0, 0, 0])
                sums[4] += 1
                sums[5] += self.provider.event_done(ended)
            self._open[device] = (self.provider.timing_event(device), time.perf_counter_ns())

    def _capturing_elsewhere(self, device: int) -> bool:
        """Whether another device's current stream captures a graph: then
        this backward is not timed, its event queries would break that
        capture (a step with replicas on both sides, which pyddp refuses).
        One GPU: asks nothing."""
        return any(self.provider.capturing(d) for d in set(self.devices) if d != device)

    def end(self) -> None:
        if self.devices is None or self.failed is not None:
            return
        now = time.perf_counter_ns()
        with self._lock, self._or_give_up():
            for device, (start, began) in self._open.items():
                end = self.provider.timing_event(device)
                sums = self._sums.setdefault(device, [0, 0.0, 0.0, 0, 0, 0])
                sums[0] += 1
                sums[1] += (now - began) / 1e6
                self._ended[device] = end
                self._pending.append((device, start, end))
            self._open.clear()
            self._read()

    def _read(self) -> None:
        kept = []
        for device, start, end in self._pending:
            if self.provider.event_done(end):
                sums = self._sums.setdefault(device, [0, 0.0, 0.0, 0, 0, 0])
                sums[2] += self.provider.elapsed_ms(start, end)
                sums[3] += 1
            else:
                kept.append((device, start, end))
        self._pending = kept[-self.KEEP :]

    def stats(self) -> Dict[str, Any]:
        """Per device ("cuda:N"): means over the backwards since reset."""
        out: Dict[str, Any] = {}
        with self._lock:
            if self.failed is None:
                with self._or_give_up():
                    self._read()
            for device, (n, host, gpu, reads, asked, idle) in sorted(self._sums.items()):
                if not n:
                    continue
                waited = idle / asked if asked else None
                bound = None if waited is None else "host" if waited >= self.HOST_BOUND else "gpu"
                out[f"cuda:{device}"] = {
                    "backwards": int(n),
                    "host_ms": host / n,
                    "gpu_ms": gpu / reads if reads else None,
                    "gpu_waited_for_host": waited,
                    "bound": bound,
                }
        return out

    def report(self) -> Dict[str, Any]:
        """stats()'s part: "gpu" (stats()), "gpu_advice" where the host
        bounds the step on some device, "gpu_stopped" once measuring failed."""
        if self.devices is None:
            return {}
        out: Dict[str, Any] = {"gpu": self.stats()}
        if any(d["bound"] == "host" for d in out["gpu"].values()):
            out["gpu_advice"] = HOST_BOUND_ADVICE
        if self.failed is not None:
            out["gpu_stopped"] = f"a timing event failed, the means stop there: {self.failed}"
        return out


HOST_BOUND_ADVICE = (
    "the GPU finished each step's work before the host started the next: the host "
    "(Python: forward, hooks, optimizer, replica by replica under one interpreter "
    "lock) bounds the step. Remedies: a larger batch per GPU; one process per GPU "
    "under torchrun (pyddp across processes, or torch DDP) instead of several GPU "
    "replicas in one process"
)
